//! Evaluating fetch-args at a probe hit, and their values as ftrace prints them.
//!
//! The semantics are the kernel's (Linux 6.x `kernel/trace/trace_probe.c`,
//! `trace_probe_tmpl.h`, `trace_kprobe.c`, `arch/x86/include/asm/ptrace.h`) for x86-64:
//!
//! - `$argN` is `regs_get_kernel_argument(N - 1)`: rdi, rsi, rdx, rcx, r8, r9, then the
//!   stack at function entry, `[rsp + 8 * (N - 6)]` (the return address is at `[rsp]`).
//! - `$stackN` is the word at `rsp + 8 * N`, `$stack` is rsp, `$retval` is the return value
//!   ([`FetchContext::retval`], else rax), `$comm` the task name, `\IMM` the constant.
//! - `@ADDR`, `@SYM[+-off]` and `+|-OFFS(...)` are memory: the last one is read with the
//!   type's width, inner ones as 8-byte words. `+u` reads user memory.
//! - Kernel reads of lower-half (user) addresses fault, and user reads of upper-half
//!   addresses fault, as `copy_from_kernel_nofault` / `copy_from_user_nofault` do on x86-64
//!   (that is why `ustring` and `+u` exist).
//! - `string` is the NUL-terminated string *at* the memory location (the kernel replaces
//!   the final dereference with the string store); `string[N]` is an array of N string
//!   pointers there. A string is at most [`MAX_STRING_SIZE`] bytes with its NUL: a longer
//!   one is cut to `MAX_STRING_SIZE - 1` bytes; a fault before its NUL makes the whole
//!   string a fault, as the kernel's `fetch_store_strlen` does.
//! - `symbol` is the value shown as `%pS` (`sym+0xoff/0xsize`, `0x...` when no symbol
//!   covers it); `symstr` is the same text as a string.
//! - Bitfields are `(container >> offset) & mask(width)` of the container-width value, shown
//!   unsigned (the kernel prints them with the container's `u*` type).
//!
//! Where the kernel's result is undefined the choice made here is stated: a failed read of a
//! numeric value leaves garbage in the kernel's event record; here it is
//! [`ArgValue::Fault`], printed `(fault)` like a faulted string. `$stackN`/`$argN` reads
//! outside the stack give 0 in the kernel (`regs_get_kernel_stack_nth` checks the stack
//! bounds); here only an unreadable address faults.

use std::fmt;

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::symbols::SymbolTable;

use crate::{ArgType, FetchArg, FetchExpr};
use hvprobe_arch::pt_regs::Regs;

/// Longest string fetched, NUL included (the kernel's `MAX_STRING_SIZE`, `PATH_MAX`).
pub const MAX_STRING_SIZE: usize = 4096;

/// The first kernel-half address; lower addresses belong to user space.
const KERNEL_HALF: u64 = 0x8000_0000_0000_0000;

/// Page size used to split string reads (a read never faults part-way through a page).
const PAGE_SIZE: u64 = 4096;

/// Everything a fetch-arg may read at one probe hit.
#[derive(Clone, Copy)]
pub struct FetchContext<'a> {
    /// The registers at the hit (for a return probe, at the return).
    pub regs: &'a Regs,
    /// Kernel virtual memory.
    pub kernel: &'a dyn GuestVirtRead,
    /// The current task's user memory, if it can be read; `None` makes user reads fault.
    pub user: Option<&'a dyn GuestVirtRead>,
    /// The guest kernel's symbols (for `@SYM`, `symbol`, `symstr`).
    pub symbols: &'a SymbolTable,
    /// The current task's name (`$comm`); `None` makes `$comm` a fault.
    pub comm: Option<&'a str>,
    /// The return value (`$retval`); `None` falls back to `regs.rax`.
    pub retval: Option<u64>,
    /// At a return: the call's entry, whose `$argN` the return's fetch-args read.
    pub entry: Option<EntryValues<'a>>,
}

/// What a return probe's fetch-args read of the call's entry.
#[derive(Clone, Copy, Debug)]
pub struct EntryValues<'a> {
    /// `(N, $argN)` as they were at the entry, for each N the probe's fetch-args name, in
    /// order (`None`: that read faulted).
    pub args: &'a [(u32, Option<u64>)],
    /// `$duration`: nanoseconds on the trace clock from the entry to the return; `None`
    /// when the two were not stamped by the same clock, or it ran backwards between them.
    pub duration_ns: Option<u64>,
}

/// The values of the `$argN` a return probe's fetch-args name, at its entry, to be read at
/// the return as Linux 6.9+ does: the arguments themselves are saved, and whatever a
/// fetch-arg dereferences from them is read at the return.
pub fn entry_args(numbers: &[u32], ctx: &FetchContext) -> Vec<(u32, Option<u64>)> {
    numbers
        .iter()
        .map(|&n| (n, value_of(&FetchExpr::Arg(n), ctx)))
        .collect()
}

/// The `$argN` numbers `args` name, in order, each once.
pub fn args_named(args: &[FetchArg]) -> Vec<u32> {
    fn collect(expr: &FetchExpr, into: &mut Vec<u32>) {
        match expr {
            FetchExpr::Arg(n) => into.push(*n),
            FetchExpr::Deref { base, .. } => collect(base, into),
            _ => {}
        }
    }
    let mut numbers = Vec::new();
    for arg in args {
        collect(&arg.expr, &mut numbers);
    }
    numbers.sort_unstable();
    numbers.dedup();
    numbers
}

/// One fetched value, ready to print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgValue {
    /// `u8`..`u64` and bitfields: printed in decimal (`%u`, `%Lu`).
    Unsigned(u64),
    /// `s8`..`s64`: printed in signed decimal (`%d`, `%Ld`).
    Signed(i64),
    /// `x8`..`x64`: printed `0x%x`, lowercase, **not** zero-padded.
    Hex(u64),
    /// `char`: printed `'%c'`.
    Char(u8),
    /// `symbol`: printed `%pS`, i.e. `description` (`sym+0xoff/0xsize`), or `0x<hex>` when
    /// no symbol covers the address.
    Symbol { address: u64, description: Option<String> },
    /// `string`, `ustring`, `symstr`, `$comm`: the bytes without the NUL, printed in double
    /// quotes.
    String(Vec<u8>),
    /// A read that failed (or a value that can not be had): printed `(fault)`.
    Fault,
    /// `TYPE[N]`: printed `{a,b,c}`.
    Array(Vec<ArgValue>),
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Unsigned(v) => write!(f, "{v}"),
            ArgValue::Signed(v) => write!(f, "{v}"),
            ArgValue::Hex(v) => write!(f, "{v:#x}"),
            // A byte that is not printable is escaped, as in strings (Linux writes it raw).
            ArgValue::Char(c) => write!(f, "'{}'", EscapedBytes(&[*c])),
            ArgValue::Symbol {
                description: Some(d), ..
            } => f.write_str(d),
            ArgValue::Symbol { address, .. } => write!(f, "{address:#x}"),
            ArgValue::String(bytes) => write!(f, "\"{}\"", EscapedBytes(bytes)),
            ArgValue::Fault => f.write_str("(fault)"),
            ArgValue::Array(items) => {
                f.write_str("{")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("}")
            }
        }
    }
}

impl ArgValue {
    /// The value as JSON: `Unsigned`/`Signed` as numbers; `Hex` as a `"0x.."` string (the
    /// text ftrace prints); `Symbol` as its printed text; strings as JSON strings (with the
    /// same `\xNN` escapes as [`Display`](fmt::Display) for bytes that are not valid
    /// UTF-8 — control characters are left to JSON's own escaping); `Fault` as `null`;
    /// arrays as arrays.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            ArgValue::Unsigned(v) => Value::from(*v),
            ArgValue::Signed(v) => Value::from(*v),
            ArgValue::Hex(_) | ArgValue::Symbol { .. } => Value::String(self.to_string()),
            ArgValue::Char(c) => Value::String(json_text(&[*c])),
            ArgValue::String(bytes) => Value::String(json_text(bytes)),
            ArgValue::Fault => Value::Null,
            ArgValue::Array(items) => Value::Array(items.iter().map(ArgValue::to_json).collect()),
        }
    }

    /// Whether this is a fault (an array is one only if it is all faults and not empty).
    pub fn is_fault(&self) -> bool {
        match self {
            ArgValue::Fault => true,
            ArgValue::Array(items) => !items.is_empty() && items.iter().all(ArgValue::is_fault),
            _ => false,
        }
    }
}

/// String bytes as ftrace's `"%s"` shows them, except that what would break a one-line
/// record or is not text is escaped: control characters (C0, DEL, C1) and bytes that are
/// not valid UTF-8 become `\xNN`. The kernel writes them raw.
pub(crate) struct EscapedBytes<'a>(pub(crate) &'a [u8]);

impl fmt::Display for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for chunk in self.0.utf8_chunks() {
            for c in chunk.valid().chars() {
                if c.is_control() {
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        write!(f, "\\x{b:02x}")?;
                    }
                } else {
                    write!(f, "{c}")?;
                }
            }
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

/// String bytes for JSON: valid UTF-8 as is, invalid bytes as `\xNN` text.
fn json_text(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Where an expression's value is, before the type is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// A value (register, stack word, constant).
    Value(u64),
    /// Memory at this address, kernel or user.
    Memory { addr: u64, user: bool },
    /// `$comm`.
    Comm,
}

/// Evaluates one fetch-arg at a hit. Never panics: anything unreadable is
/// [`ArgValue::Fault`] (or a fault element in an array).
pub fn evaluate(arg: &FetchArg, ctx: &FetchContext) -> ArgValue {
    if let FetchExpr::ImmString(text) = &arg.expr {
        // The parser allows it the type `string` only, and no array.
        let bytes = text.as_bytes();
        return ArgValue::String(bytes[..bytes.len().min(MAX_STRING_SIZE - 1)].to_vec());
    }
    let place = locate(&arg.expr, ctx);
    match arg.ty {
        ArgType::String | ArgType::UString => evaluate_string(arg, place, ctx),
        ty => match (place, arg.array_len) {
            (Some(Place::Memory { addr, user }), Some(n)) => {
                let size = value_size(ty) as u64;
                ArgValue::Array(
                    (0..u64::from(n))
                        .map(|i| {
                            let value = addr
                                .checked_add(i * size)
                                .and_then(|a| read_uint(ctx, user, a, size as usize));
                            convert(ty, value, ctx.symbols)
                        })
                        .collect(),
                )
            }
            // Arrays of non-memory values are refused by the parser; one value is shown.
            (Some(Place::Memory { addr, user }), None) => {
                convert(ty, read_uint(ctx, user, addr, value_size(ty)), ctx.symbols)
            }
            (Some(Place::Value(v)), _) => convert(ty, Some(v), ctx.symbols),
            (Some(Place::Comm), _) | (None, _) => fault_shaped(arg.array_len),
        },
    }
}

/// A fault with the arg's shape: `{(fault),...}` for an array, as the kernel always prints
/// N elements.
fn fault_shaped(array_len: Option<u32>) -> ArgValue {
    match array_len {
        Some(n) => ArgValue::Array(vec![ArgValue::Fault; n as usize]),
        None => ArgValue::Fault,
    }
}

fn evaluate_string(arg: &FetchArg, place: Option<Place>, ctx: &FetchContext) -> ArgValue {
    let user_type = arg.ty == ArgType::UString;
    match (place, arg.array_len) {
        (None, n) => fault_shaped(n),
        (Some(Place::Comm), _) => match ctx.comm {
            Some(comm) => {
                let bytes = comm.as_bytes();
                ArgValue::String(bytes[..bytes.len().min(MAX_STRING_SIZE - 1)].to_vec())
            }
            None => ArgValue::Fault,
        },
        // `\IMM:string` (and anything else giving a value): the string at that address.
        (Some(Place::Value(addr)), _) => read_string(ctx, user_type, addr),
        (Some(Place::Memory { addr, user }), None) => read_string(ctx, user_type || user, addr),
        // An array of string pointers at the location.
        (Some(Place::Memory { addr, user }), Some(n)) => ArgValue::Array(
            (0..u64::from(n))
                .map(
                    |i| match addr.checked_add(8 * i).and_then(|a| read_uint(ctx, user, a, 8)) {
                        Some(pointer) => read_string(ctx, user_type || user, pointer),
                        None => ArgValue::Fault,
                    },
                )
                .collect(),
        ),
    }
}

/// Where `expr`'s value is; `None` if getting there already faulted.
fn locate(expr: &FetchExpr, ctx: &FetchContext) -> Option<Place> {
    let regs = ctx.regs;
    Some(match expr {
        FetchExpr::Register(r) => Place::Value(regs.get(*r)),
        FetchExpr::Memory(gva) => Place::Memory {
            addr: gva.0,
            user: false,
        },
        FetchExpr::SymbolMemory { name, offset } => {
            let symbol = ctx.symbols.lookup(name)?;
            Place::Memory {
                addr: symbol.addr.0.wrapping_add_signed(*offset),
                user: false,
            }
        }
        FetchExpr::StackEntry(n) => Place::Value(stack_word(ctx, u64::from(*n))?),
        FetchExpr::StackPointer => Place::Value(regs.rsp),
        FetchExpr::Arg(n) => match (ctx.entry, regs.arg_register(*n)) {
            (Some(entry), _) => Place::Value(entry.args.iter().find(|(number, _)| number == n)?.1?),
            (None, Some(v)) => Place::Value(v),
            (None, None) => Place::Value(stack_word(ctx, u64::from(n.checked_sub(6)?))?),
        },
        FetchExpr::Retval => Place::Value(ctx.retval.unwrap_or(regs.rax)),
        FetchExpr::Duration => Place::Value(ctx.entry?.duration_ns?),
        FetchExpr::Comm => Place::Comm,
        FetchExpr::Immediate(v) => Place::Value(*v),
        FetchExpr::Deref { offset, user, base } => Place::Memory {
            addr: value_of(base, ctx)?.wrapping_add_signed(*offset),
            user: *user,
        },
        // An immediate string is no place (`evaluate` takes it); BTF fetch-args are
        // resolved into the forms above before a probe is armed (`spec::check`), so an
        // unresolved one has no value to give.
        FetchExpr::ImmString(_) | FetchExpr::Btf(_) | FetchExpr::AllArgs | FetchExpr::Params | FetchExpr::Vars => {
            return None
        }
    })
}

/// The full 8-byte value of an expression (an inner dereference reads a word).
fn value_of(expr: &FetchExpr, ctx: &FetchContext) -> Option<u64> {
    match locate(expr, ctx)? {
        Place::Value(v) => Some(v),
        Place::Memory { addr, user } => read_uint(ctx, user, addr, 8),
        Place::Comm => None,
    }
}

/// The kernel stack word `n` words above rsp.
fn stack_word(ctx: &FetchContext, n: u64) -> Option<u64> {
    let addr = ctx.regs.rsp.checked_add(n.checked_mul(8)?)?;
    read_uint(ctx, false, addr, 8)
}

/// Reads `buf.len()` bytes at `addr` from kernel or user memory, with the kernel's
/// address-space checks.
fn read(ctx: &FetchContext, user: bool, addr: u64, buf: &mut [u8]) -> Option<()> {
    let last = addr.checked_add(buf.len().max(1) as u64 - 1)?;
    let reader = if user {
        if last >= KERNEL_HALF {
            return None;
        }
        ctx.user?
    } else {
        if addr < KERNEL_HALF {
            return None;
        }
        ctx.kernel
    };
    reader.read_virt(Gva(addr), buf).ok()
}

/// A little-endian unsigned value of `size` (1, 2, 4 or 8) bytes.
fn read_uint(ctx: &FetchContext, user: bool, addr: u64, size: usize) -> Option<u64> {
    let mut buf = [0u8; 8];
    let size = size.min(8);
    read(ctx, user, addr, &mut buf[..size])?;
    Some(u64::from_le_bytes(buf))
}

/// A NUL-terminated string at `addr`, as `fetch_store_strlen` + `strncpy_from_*_nofault`.
fn read_string(ctx: &FetchContext, user: bool, addr: u64) -> ArgValue {
    let mut out = Vec::new();
    let mut at = addr;
    loop {
        let room = MAX_STRING_SIZE - out.len();
        let in_page = (PAGE_SIZE - at % PAGE_SIZE) as usize;
        let mut chunk = vec![0u8; room.min(in_page)];
        if read(ctx, user, at, &mut chunk).is_none() {
            return ArgValue::Fault;
        }
        if let Some(nul) = chunk.iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..nul]);
            return ArgValue::String(out);
        }
        out.extend_from_slice(&chunk);
        if out.len() >= MAX_STRING_SIZE {
            // No NUL in MAX_STRING_SIZE bytes: the kernel keeps all but the last.
            out.truncate(MAX_STRING_SIZE - 1);
            return ArgValue::String(out);
        }
        match at.checked_add(chunk.len() as u64) {
            Some(next) => at = next,
            None => return ArgValue::Fault,
        }
    }
}

/// Applies a non-string type to a raw value (`None`: the read faulted). Only the low
/// bytes of the type's width count (the event detour records them with garbage above).
pub fn convert(ty: ArgType, raw: Option<u64>, symbols: &SymbolTable) -> ArgValue {
    let Some(raw) = raw else {
        return ArgValue::Fault;
    };
    let bits = value_size(ty) * 8;
    let truncated = if bits >= 64 { raw } else { raw & ((1u64 << bits) - 1) };
    match ty {
        ArgType::U8 | ArgType::U16 | ArgType::U32 | ArgType::U64 => ArgValue::Unsigned(truncated),
        ArgType::S8 | ArgType::S16 | ArgType::S32 | ArgType::S64 => {
            let shift = 64 - bits;
            ArgValue::Signed(((truncated << shift) as i64) >> shift)
        }
        ArgType::X8 | ArgType::X16 | ArgType::X32 | ArgType::X64 => ArgValue::Hex(truncated),
        ArgType::Char => ArgValue::Char(truncated as u8),
        ArgType::Bitfield { width, offset, .. } => {
            let shifted = truncated.checked_shr(u32::from(offset)).unwrap_or(0);
            let mask = if width >= 64 { u64::MAX } else { (1u64 << width) - 1 };
            ArgValue::Unsigned(shifted & mask)
        }
        ArgType::Symbol => ArgValue::Symbol {
            address: raw,
            description: symbols.describe(Gva(raw)).map(|d| d.to_string()),
        },
        ArgType::SymStr => ArgValue::String(symbolize(symbols, raw).into_bytes()),
        // Handled by `evaluate_string`.
        ArgType::String | ArgType::UString => ArgValue::Fault,
    }
}

/// Bytes of memory one value of a non-string type takes (`symstr` symbolizes a word).
pub fn value_size(ty: ArgType) -> usize {
    match ty {
        ArgType::Symbol | ArgType::SymStr => 8,
        ty => ty.record_size() as usize,
    }
}

/// `%pS` / `sprint_symbol`: `sym+0xoff/0xsize`, or `0x<hex>` when no symbol covers it.
pub fn symbolize(symbols: &SymbolTable, address: u64) -> String {
    match symbols.describe(Gva(address)) {
        Some(d) => d.to_string(),
        None => format!("{address:#x}"),
    }
}

#[cfg(test)]
mod tests;
