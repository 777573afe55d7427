//! An event's filter, run by its event detour in the guest: a hit the filter discards is
//! counted in the detour's entry of the rings' filter table ([`super::super::ring`]) and
//! never becomes a record, so it costs no ring slot, no drain and no host work.
//!
//! The host's filter (ftrace's event-filter grammar, bound to the event's fields) is the
//! one that decides; the detour runs what of it it can on its own record, as a
//! [`RecordFilter`], and must never discard a hit the host would keep. So a test the
//! record cannot answer exactly (a glob, a bitfield, a `symstr`, a string longer than its
//! area, a field the record does not hold) is taken as *true* where that only lets more
//! hits through (under `&&` and `||`), and makes the whole `!` above it unknown (then
//! taken as true as well): what the detour runs is the host's filter or a weaker one
//! ([`FilterInGuest`]), and the host's filter still sees every hit that gets through.
//!
//! A test reads the record the detour has just written, as the host's decoding reads it
//! ([`super::EventLayout::decode`]): a fetch-arg's value slot cut to the field's size and
//! sign-extended for a signed field, a string's bytes up to its first NUL, the task
//! stamp's pid and comm, the record's CPU. A fetch-arg that faulted fails every test on
//! it, negated or not, as on the host. The filter runs as soon as the last fetch-arg it
//! reads is recorded: the fetch-args after that are not fetched for a discarded hit.

use iced_x86::code_asm::*;

use super::{ArgKind, DetourAssembler, DetourCodeError, EventLayout, COMM_SIZE};
use crate::ring::{RECORD_CPU, RECORD_FAULTS};
use hvprobe_spec::fetch::value_size;
use hvprobe_spec::ArgType;

/// An event filter in the form an event detour evaluates on its record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordFilter {
    Or(Box<RecordFilter>, Box<RecordFilter>),
    And(Box<RecordFilter>, Box<RecordFilter>),
    Not(Box<RecordFilter>),
    Test(RecordTest),
    /// A test only the host can make.
    HostOnly,
}

/// One comparison of a field of the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordTest {
    pub field: RecordField,
    pub check: RecordCheck,
}

/// A field of the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordField {
    /// The fetch-arg at this index of the probe's args.
    Arg(usize),
    /// The CPU number the record carries (`cpu`).
    Cpu,
    /// The task stamp's pid (`common_pid`).
    Pid,
    /// The task stamp's comm (`comm`).
    Comm,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordCheck {
    /// `field OP value`: the field cut to `size` bytes (1, 2, 4 or 8) and, when `signed`,
    /// sign-extended, against `value` (normalized the same way).
    Number {
        op: NumberOp,
        value: u64,
        size: u8,
        signed: bool,
    },
    /// The field's bytes up to its first NUL are `pattern` (`whole`) or start with it;
    /// `negate` inverts the result (`!=`, `~ "!..."`).
    Bytes {
        pattern: Vec<u8>,
        whole: bool,
        negate: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NumberOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// `field & value` is not zero.
    BitAnd,
}

/// How much of an event's filter its detour runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterInGuest {
    /// All of it: every hit the detour records passes the host's filter.
    Exact,
    /// A weaker filter: some tests are left to the host.
    Partial,
}

/// The part of a filter the detour can run on a record of `layout`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Reduced {
    /// Nothing is left: every hit passes in the guest.
    True,
    Filter {
        filter: RecordFilter,
        exact: bool,
    },
}

fn reduce(filter: &RecordFilter, layout: &EventLayout) -> Reduced {
    match filter {
        RecordFilter::HostOnly => Reduced::True,
        RecordFilter::Test(test) => match readable(test, layout) {
            true => Reduced::Filter {
                filter: filter.clone(),
                exact: true,
            },
            false => Reduced::True,
        },
        RecordFilter::Not(inner) => match reduce(inner, layout) {
            Reduced::Filter { filter, exact: true } => Reduced::Filter {
                filter: RecordFilter::Not(Box::new(filter)),
                exact: true,
            },
            _ => Reduced::True,
        },
        RecordFilter::And(a, b) => match (reduce(a, layout), reduce(b, layout)) {
            (Reduced::True, Reduced::True) => Reduced::True,
            (Reduced::True, Reduced::Filter { filter, .. }) | (Reduced::Filter { filter, .. }, Reduced::True) => {
                Reduced::Filter { filter, exact: false }
            }
            (Reduced::Filter { filter: fa, exact: ea }, Reduced::Filter { filter: fb, exact: eb }) => Reduced::Filter {
                filter: RecordFilter::And(Box::new(fa), Box::new(fb)),
                exact: ea && eb,
            },
        },
        RecordFilter::Or(a, b) => match (reduce(a, layout), reduce(b, layout)) {
            (Reduced::Filter { filter: fa, exact: ea }, Reduced::Filter { filter: fb, exact: eb }) => Reduced::Filter {
                filter: RecordFilter::Or(Box::new(fa), Box::new(fb)),
                exact: ea && eb,
            },
            _ => Reduced::True,
        },
    }
}

/// Where a field is in the record.
enum Storage {
    /// `width` bytes at `at` hold the value.
    Number { at: u32, width: u8 },
    /// A NUL-terminated string in `len` bytes at `at`.
    Bytes { at: u32, len: u32 },
    /// Never there (the fetch-arg always faults): every test on it fails.
    Fault,
}

/// Where `field` is in a record of `layout`, and its fault bit; `None` when the record
/// does not hold it as the host's decoding reads it.
fn storage(field: RecordField, layout: &EventLayout) -> Option<(Storage, Option<u32>)> {
    Some(match field {
        RecordField::Cpu => (
            Storage::Number {
                at: RECORD_CPU as u32,
                width: 4,
            },
            None,
        ),
        RecordField::Pid => (
            Storage::Number {
                at: layout.task?,
                width: 4,
            },
            None,
        ),
        RecordField::Comm => (
            Storage::Bytes {
                at: layout.task? + 8,
                len: COMM_SIZE,
            },
            None,
        ),
        RecordField::Arg(i) => {
            let arg = layout.args.get(i)?;
            if arg.array_len.is_some() {
                return None;
            }
            let storage = match (arg.kind, arg.ty) {
                (ArgKind::Fault, _) => Storage::Fault,
                (ArgKind::String { area, len }, _) => Storage::Bytes { at: area, len },
                (ArgKind::Value, ArgType::SymStr | ArgType::Bitfield { .. } | ArgType::String | ArgType::UString) => {
                    return None
                }
                (ArgKind::Value, ty) => Storage::Number {
                    at: arg.slot,
                    width: u8::try_from(value_size(ty)).ok()?,
                },
                (ArgKind::Array { .. } | ArgKind::Duration, _) => return None,
            };
            (storage, arg.fault_bit)
        }
    })
}

/// Whether the detour answers `test` exactly as the host would.
fn readable(test: &RecordTest, layout: &EventLayout) -> bool {
    let Some((storage, _)) = storage(test.field, layout) else {
        return false;
    };
    match (&test.check, storage) {
        (_, Storage::Fault) => true,
        (RecordCheck::Number { size, .. }, Storage::Number { width, .. }) => {
            matches!(size, 1 | 2 | 4 | 8) && *size <= width
        }
        (RecordCheck::Bytes { pattern, .. }, Storage::Bytes { len, .. }) => {
            // Shorter than the area, so that a match includes the NUL or the area's end
            // cannot cut the host's string shorter than the pattern; the host shows a
            // task's comm through a lossy UTF-8 conversion, so only ASCII is compared.
            pattern.len() < len as usize
                && !pattern.contains(&0)
                && (test.field != RecordField::Comm || pattern.is_ascii())
        }
        _ => false,
    }
}

/// The filter the detour runs for `filter` on records of `layout`, how much of it that
/// is, and the last fetch-arg it reads; `None` when nothing of it can run in the guest.
pub(super) fn plan_filter(
    filter: &RecordFilter,
    layout: &EventLayout,
) -> Option<(RecordFilter, FilterInGuest, Option<usize>)> {
    match reduce(filter, layout) {
        Reduced::True => None,
        Reduced::Filter { filter, exact } => {
            let last_arg = last_arg(&filter);
            let how = if exact {
                FilterInGuest::Exact
            } else {
                FilterInGuest::Partial
            };
            Some((filter, how, last_arg))
        }
    }
}

fn last_arg(filter: &RecordFilter) -> Option<usize> {
    match filter {
        RecordFilter::Or(a, b) | RecordFilter::And(a, b) => last_arg(a).max(last_arg(b)),
        RecordFilter::Not(a) => last_arg(a),
        RecordFilter::Test(RecordTest {
            field: RecordField::Arg(i),
            ..
        }) => Some(*i),
        RecordFilter::Test(_) | RecordFilter::HostOnly => None,
    }
}

/// A flags condition and its inverse.
#[derive(Clone, Copy)]
enum Cond {
    E,
    Ne,
    L,
    Le,
    G,
    Ge,
    B,
    Be,
    A,
    Ae,
}

impl Cond {
    fn not(self) -> Cond {
        match self {
            Cond::E => Cond::Ne,
            Cond::Ne => Cond::E,
            Cond::L => Cond::Ge,
            Cond::Ge => Cond::L,
            Cond::Le => Cond::G,
            Cond::G => Cond::Le,
            Cond::B => Cond::Ae,
            Cond::Ae => Cond::B,
            Cond::Be => Cond::A,
            Cond::A => Cond::Be,
        }
    }

    fn of(op: NumberOp, signed: bool) -> Cond {
        match (op, signed) {
            (NumberOp::Eq, _) => Cond::E,
            (NumberOp::Ne | NumberOp::BitAnd, _) => Cond::Ne,
            (NumberOp::Lt, true) => Cond::L,
            (NumberOp::Le, true) => Cond::Le,
            (NumberOp::Gt, true) => Cond::G,
            (NumberOp::Ge, true) => Cond::Ge,
            (NumberOp::Lt, false) => Cond::B,
            (NumberOp::Le, false) => Cond::Be,
            (NumberOp::Gt, false) => Cond::A,
            (NumberOp::Ge, false) => Cond::Ae,
        }
    }
}

impl DetourAssembler<'_> {
    fn jump_if(&mut self, cond: Cond, target: CodeLabel) -> Result<(), DetourCodeError> {
        let a = &mut self.asm;
        match cond {
            Cond::E => a.je(target)?,
            Cond::Ne => a.jne(target)?,
            Cond::L => a.jl(target)?,
            Cond::Le => a.jle(target)?,
            Cond::G => a.jg(target)?,
            Cond::Ge => a.jge(target)?,
            Cond::B => a.jb(target)?,
            Cond::Be => a.jbe(target)?,
            Cond::A => a.ja(target)?,
            Cond::Ae => a.jae(target)?,
        }
        Ok(())
    }

    /// Jumps to `target` when `filter` is `when` on the record, else falls through
    /// (`rax`, `rdx` and the flags are clobbered).
    pub(super) fn branch_on_filter(
        &mut self,
        filter: &RecordFilter,
        layout: &EventLayout,
        target: CodeLabel,
        when: bool,
    ) -> Result<(), DetourCodeError> {
        match (filter, when) {
            (RecordFilter::Not(inner), _) => self.branch_on_filter(inner, layout, target, !when)?,
            (RecordFilter::And(a, b), false) | (RecordFilter::Or(a, b), true) => {
                self.branch_on_filter(a, layout, target, when)?;
                self.branch_on_filter(b, layout, target, when)?;
            }
            (RecordFilter::And(a, b), true) | (RecordFilter::Or(a, b), false) => {
                let mut skip = self.asm.create_label();
                self.branch_on_filter(a, layout, skip, !when)?;
                self.branch_on_filter(b, layout, target, when)?;
                self.asm.set_label(&mut skip)?;
                self.asm.zero_bytes()?;
            }
            (RecordFilter::Test(test), _) => self.branch_on_test(test, layout, target, when)?,
            (RecordFilter::HostOnly, _) => {
                return Err(DetourCodeError::Assemble(
                    "a filter test only the host can make reached the detour".into(),
                ))
            }
        }
        Ok(())
    }

    fn branch_on_test(
        &mut self,
        test: &RecordTest,
        layout: &EventLayout,
        target: CodeLabel,
        when: bool,
    ) -> Result<(), DetourCodeError> {
        let Some((storage, fault_bit)) = storage(test.field, layout).filter(|_| readable(test, layout)) else {
            return Err(DetourCodeError::Assemble(format!(
                "a filter test the record cannot answer reached the detour: {test:?}"
            )));
        };
        let rec = self.frame.rec;
        // A test on a faulted fetch-arg is false.
        let mut skip = self.asm.create_label();
        let if_false = if when { skip } else { target };
        if let Storage::Fault = storage {
            if !when {
                self.asm.jmp(target)?;
            }
            return Ok(());
        }
        if let Some(bit) = fault_bit {
            self.asm.test(
                byte_ptr(rec + (RECORD_FAULTS as i32 + (bit / 8) as i32)),
                1i32 << (bit % 8),
            )?;
            self.asm.jne(if_false)?;
        }
        match (&test.check, storage) {
            (
                &RecordCheck::Number {
                    op,
                    value,
                    size,
                    signed,
                },
                Storage::Number { at, .. },
            ) => {
                let m = rec + at as i32;
                match (size, signed) {
                    (8, _) => self.asm.mov(rax, qword_ptr(m))?,
                    (4, true) => self.asm.movsxd(rax, dword_ptr(m))?,
                    (4, false) => self.asm.mov(eax, dword_ptr(m))?,
                    (2, true) => self.asm.movsx(rax, word_ptr(m))?,
                    (2, false) => self.asm.movzx(eax, word_ptr(m))?,
                    (_, true) => self.asm.movsx(rax, byte_ptr(m))?,
                    (_, false) => self.asm.movzx(eax, byte_ptr(m))?,
                }
                let imm = i32::try_from(value as i64).ok();
                match (op, imm) {
                    (NumberOp::BitAnd, Some(v)) => self.asm.test(rax, v)?,
                    (NumberOp::BitAnd, None) => {
                        self.asm.mov(rdx, value)?;
                        self.asm.test(rax, rdx)?;
                    }
                    (_, Some(v)) => self.asm.cmp(rax, v)?,
                    (_, None) => {
                        self.asm.mov(rdx, value)?;
                        self.asm.cmp(rax, rdx)?;
                    }
                }
                let cond = Cond::of(op, signed);
                self.jump_if(if when { cond } else { cond.not() }, target)?;
            }
            (RecordCheck::Bytes { pattern, whole, negate }, Storage::Bytes { at, .. }) => {
                let mut bytes = pattern.clone();
                if *whole {
                    bytes.push(0);
                }
                // The test is true when the bytes are equal, unless negated.
                let jump_when_equal = when != *negate;
                let chunks = chunks(&bytes);
                let last = chunks.len().wrapping_sub(1);
                if chunks.is_empty() && jump_when_equal {
                    self.asm.jmp(target)?;
                }
                for (i, (offset, len, value)) in chunks.into_iter().enumerate() {
                    let m = rec + (at + offset) as i32;
                    match len {
                        8 => {
                            self.asm.mov(rdx, value)?;
                            self.asm.cmp(qword_ptr(m), rdx)?;
                        }
                        4 => self.asm.cmp(dword_ptr(m), value as u32 as i32)?,
                        2 => self.asm.cmp(word_ptr(m), value as u16 as i32)?,
                        _ => self.asm.cmp(byte_ptr(m), value as u8 as i32)?,
                    }
                    if !jump_when_equal {
                        self.asm.jne(target)?;
                    } else if i == last {
                        self.asm.je(target)?;
                    } else {
                        self.asm.jne(skip)?;
                    }
                }
            }
            _ => {
                return Err(DetourCodeError::Assemble(format!(
                    "a filter test of the wrong kind for its field: {test:?}"
                )))
            }
        }
        self.asm.set_label(&mut skip)?;
        self.asm.zero_bytes()?;
        Ok(())
    }
}

/// `bytes` as little-endian pieces of 8, 4, 2 and 1 bytes: `(offset, length, value)`.
fn chunks(bytes: &[u8]) -> Vec<(u32, u32, u64)> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = bytes.len() - at;
        let len = [8, 4, 2, 1].into_iter().find(|&n| n <= rest).unwrap_or(1);
        let mut word = [0u8; 8];
        word[..len].copy_from_slice(&bytes[at..at + len]);
        out.push((at as u32, len as u32, u64::from_le_bytes(word)));
        at += len;
    }
    out
}

#[cfg(test)]
mod tests;
