//! Where a probe's values are in its records, and how the host turns them back into
//! values: the record layout an event detour writes and the drain reads.

use super::*;

/// Where a probe's values are in its records, and how to show them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventLayout {
    pub probe_id: u32,
    /// Bytes of the record this probe uses (at most the rings' record size).
    pub size: u32,
    /// Whether the record's fault mask is written (some argument can fault).
    pub faults_written: bool,
    /// Where the task stamp is, when the records have one.
    pub task: Option<u32>,
    /// A return probe's records: where the call's caller and its entry's TSC are.
    pub ret: Option<ReturnFields>,
    pub args: Vec<ArgLayout>,
}

/// The fields a return's record has after the task stamp: the address the call returned
/// to as the caller (never one of our stubs, nor the guest's rethook trampoline when its
/// node was found), the entry's TSC, then the `$argN` words the entry saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReturnFields {
    pub caller: u32,
    pub entry_tsc: u32,
}

/// The task a record was written by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskStamp {
    pub pid: i32,
    /// Up to the first NUL, at most 16 bytes.
    pub comm: Vec<u8>,
}

/// One fetch-arg in a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgLayout {
    pub name: String,
    pub ty: ArgType,
    pub array_len: Option<u32>,
    /// Offset of its `u64` value slot.
    pub slot: u32,
    /// Its bit in the fault mask, when it can fault.
    pub fault_bit: Option<u32>,
    pub kind: ArgKind,
}

/// What a record holds for one argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// The raw value in the slot.
    Value,
    /// A NUL-terminated string in `len` bytes at `area` (the slot holds what the copy
    /// returned).
    String { area: u32, len: u32 },
    /// `count` elements of `elem` bytes at `area`.
    Array { area: u32, elem: u32, count: u32 },
    /// Always `(fault)` (an unknown `@SYM`, `$comm` with a numeric type).
    Fault,
    /// `$duration` of a return: nanoseconds from the entry's stamp to the return's, which
    /// the host computes on its trace clock ([`EventLayout::decode_with`]).
    Duration,
}

impl EventLayout {
    /// The task stamp of a record, when this probe's records have one.
    pub fn task(&self, record: &[u8]) -> Option<TaskStamp> {
        let at = self.task? as usize;
        let pid = i32::from_le_bytes(record.get(at..at + 4)?.try_into().ok()?);
        let comm = record.get(at + 8..at + 8 + COMM_SIZE as usize)?;
        let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
        Some(TaskStamp {
            pid,
            comm: comm[..end].to_vec(),
        })
    }

    /// The probe's values from one of its records (`record`: the whole record, as
    /// [`super::ring::RawEvent::record`] gives it), as the host's fetch would show them.
    /// The record is guest memory: anything out of its bounds is `(fault)`.
    pub fn decode(&self, record: &[u8], symbols: &SymbolTable) -> Vec<(String, ArgValue)> {
        self.decode_with(record, symbols, None)
    }

    /// A return's caller and its entry's TSC, from one of its records.
    pub fn call(&self, record: &[u8]) -> Option<(Gva, u64)> {
        let f = self.ret?;
        let u64_at = |at: u32| {
            Some(u64::from_le_bytes(
                record.get(at as usize..at as usize + 8)?.try_into().ok()?,
            ))
        };
        Some((Gva(u64_at(f.caller)?), u64_at(f.entry_tsc)?))
    }

    /// [`decode`](Self::decode), with a return's `$duration` (nanoseconds, computed by the
    /// caller from the two stamps; `None` makes it `(fault)`).
    pub fn decode_with(&self, record: &[u8], symbols: &SymbolTable, duration: Option<u64>) -> Vec<(String, ArgValue)> {
        let u64_at = |at: u32| -> Option<u64> {
            let at = at as usize;
            Some(u64::from_le_bytes(record.get(at..at + 8)?.try_into().ok()?))
        };
        let faults = if self.faults_written {
            u64_at(RECORD_FAULTS as u32).unwrap_or(u64::MAX)
        } else {
            0
        };
        self.args
            .iter()
            .map(|arg| {
                let faulted = arg.fault_bit.is_some_and(|b| faults & (1u64 << b) != 0);
                let value = if faulted {
                    fault_shaped(arg.array_len)
                } else {
                    match arg.kind {
                        ArgKind::Fault => fault_shaped(arg.array_len),
                        ArgKind::Duration => convert(arg.ty, duration, symbols),
                        ArgKind::Value => convert(arg.ty, u64_at(arg.slot), symbols),
                        ArgKind::String { area, len } => {
                            match record.get(area as usize..area as usize + len as usize) {
                                Some(bytes) => {
                                    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                                    ArgValue::String(bytes[..end].to_vec())
                                }
                                None => ArgValue::Fault,
                            }
                        }
                        ArgKind::Array { area, elem, count } => ArgValue::Array(
                            (0..count)
                                .map(|i| {
                                    let at = area as usize + (i * elem) as usize;
                                    let raw = record.get(at..at + elem as usize).map(|b| {
                                        let mut w = [0u8; 8];
                                        w[..b.len()].copy_from_slice(b);
                                        u64::from_le_bytes(w)
                                    });
                                    convert(arg.ty, raw, symbols)
                                })
                                .collect(),
                        ),
                    }
                };
                (arg.name.clone(), value)
            })
            .collect()
    }
}

pub(super) fn fault_shaped(array_len: Option<u32>) -> ArgValue {
    match array_len {
        Some(n) => ArgValue::Array(vec![ArgValue::Fault; n as usize]),
        None => ArgValue::Fault,
    }
}
