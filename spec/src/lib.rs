//! The kprobe_events language: probe specs parsed as Linux parses them ([`check`] checks
//! them against a kernel), the values their fetch-args read ([`fetch`]) and the event
//! lines they print ([`output`]). This module holds what a spec *is* (the syntax tree and
//! Linux's limits); `parse` reads it, `display` writes it back, `error` is the catalogue of
//! refusals, `glob` the symbol patterns.
//!
//! The probe-spec parser: the kernel's `kprobe_events` syntax, one probe a line.
//!
//! Users paste what they already write into `/sys/kernel/tracing/kprobe_events`, so the
//! rules follow Linux's parser (`kernel/trace/trace_kprobe.c`, `trace_probe.c`, up to its
//! 6.5+ BTF arguments and 6.6 `char`) for x86-64: the same names, limits and defaults, the
//! same combinations rejected, each refusal with Linux's error code
//! ([`SpecErrorKind::linux_error`]) at the column of Linux's error-log caret. Where the
//! kernel silently ignores junk (text after a deref's `)`, letters after `p`), this parser
//! reports it instead, because a typo in a file should not change what is probed.
//!
//! Parsing is purely syntactic: symbols are not resolved, `+0` is not checked to be a real
//! function entry, and BTF fetch-args (parameter names, `$arg*`, `->` fields) are kept as
//! written; [`check`] does that against the kernel's symbols, text and BTF.
//!
//! ```text
//! p[:[GRP/][EVENT]] SYM[+offs]|MEMADDR [FETCHARGS]
//! p[:[GRP/][EVENT]] SYM[+0]%return [FETCHARGS]
//! r[MAXACTIVE][:[GRP/][EVENT]] SYM[+0]|MEMADDR [FETCHARGS]
//! -:[GRP/]EVENT
//! ```

#![forbid(unsafe_code)]

use std::fmt;

pub use hvprobe_arch::debugreg::Access;
pub use hvprobe_arch::pt_regs::Register;
use hvprobe_arch::Gva;

mod display;
mod error;
mod glob;
mod parse;

pub use error::*;
pub use glob::*;
pub use parse::*;

pub mod check;
pub mod fetch;
pub mod output;
pub mod source;

/// The group of a probe whose spec names none, as in the kernel.
pub const DEFAULT_GROUP: &str = "kprobes";
/// Most fetch-args one probe may have (`MAX_TRACE_ARGS`).
pub const MAX_ARGS: usize = 128;
/// Longest event or group name, in bytes (`MAX_EVENT_NAME_LEN` - 1 for the NUL).
pub const MAX_EVENT_NAME_LEN: usize = 63;
/// The kernel's `MODULE_NAME_LEN` (64 - sizeof(unsigned long)) less its NUL.
pub const MAX_MODULE_NAME_LEN: usize = 55;
/// Longest argument name, in bytes (`MAX_ARG_NAME_LEN`).
pub const MAX_ARG_NAME_LEN: usize = 32;
/// Longest fetch-arg text after `NAME=`, type included (`MAX_ARGSTR_LEN`).
pub const MAX_ARG_BODY_LEN: usize = 63;
/// Most elements of an array type (`MAX_ARRAY_LEN`).
pub const MAX_ARRAY_LEN: u32 = 64;
/// Largest MAXACTIVE of a return probe (`KRETPROBE_MAXACTIVE_MAX`).
pub const MAX_MAXACTIVE: u32 = 4096;
/// Largest N of `$stackN` and `$argN`: the words in a 16 KiB x86-64 kernel stack
/// (`PARAM_MAX_STACK` = THREAD_SIZE / sizeof(long)).
pub const MAX_STACK_INDEX: u32 = 2048;
const MAX_STACK_INDEX_U64: u64 = MAX_STACK_INDEX as u64;
/// Most bytes of recorded data one event may carry (`MAX_PROBE_EVENT_SIZE`).
pub const MAX_EVENT_DATA_SIZE: u32 = 3072;
/// Fetch operations one argument may compile to (`FETCH_INSN_MAX` minus the end marker).
/// Checked here so that a spec the kernel would refuse is refused here too.
pub const MAX_FETCH_OPS: usize = 15;

/// Field names every trace event already has, which an argument may not take.
const RESERVED_ARG_NAMES: [&str; 8] = [
    "common_type",
    "common_flags",
    "common_preempt_count",
    "common_pid",
    "common_tgid",
    "__probe_ip",
    "__probe_ret_ip",
    "__probe_func",
];

/// One line of a spec file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeSpec {
    /// `p`: a probe on an instruction.
    Kprobe {
        group: String,
        event: String,
        target: Target,
        args: Vec<FetchArg>,
    },
    /// `r`, or `p` with `%return`: a probe on a function's return.
    Kretprobe {
        group: String,
        event: String,
        target: Target,
        /// How many calls may be in flight at once; `None` is the kernel's default.
        maxactive: Option<u32>,
        args: Vec<FetchArg>,
    },
    /// `w`: a watch, hvprobe's extension (a hardware breakpoint; perf's `mem:` events):
    /// `w[:[GRP/]EVENT] TARGET[/LEN][:ACCESS] [FETCHARGS]`.
    Watch {
        group: String,
        event: String,
        target: Target,
        access: Access,
        len: u8,
        args: Vec<FetchArg>,
    },
    /// `-:`: remove an event; with no group, the event of that name in whatever group.
    Remove { group: Option<String>, event: String },
}

/// Where a probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A kernel symbol plus a byte offset (0 ..= u32::MAX, as the kernel allows).
    Symbol { name: String, offset: u64 },
    /// A kernel virtual address.
    Address(Gva),
    /// A symbol of a kernel module plus a byte offset (`MOD:SYM+OFF`): armed when the
    /// module is loaded (or loads).
    ModuleSymbol { module: String, name: String, offset: u64 },
    /// A place in the kernel's source, as `perf probe` names one (`FUNC:RLN`, `FUNC@FILE`,
    /// `FUNC@FILE:RLN`, `FILE:LINE`): turned into `SYM+OFF` sites with the kernel's DWARF
    /// (see [`source`]).
    Source(SourcePoint),
}

/// A place in the kernel's source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePoint {
    /// The function (`FUNC…`); `None` for `FILE:LINE`.
    pub function: Option<String>,
    /// The source file (`…@FILE`, `FILE:…`): a path or its last components.
    pub file: Option<String>,
    /// The line: relative to the function's declaration line when there is a function
    /// (perf probe's `RLN`: the declaration is line 0), else the file's line.
    pub line: Option<u32>,
    /// The module whose source it is (`MOD:FUNC:N`, `MOD:FUNC@FILE`, `MOD:FILE:LINE`: perf
    /// probe's `-m MOD`); `None`: the kernel's.
    pub module: Option<String>,
}

impl SourcePoint {
    /// Whether it is a function's entry (`FUNC@FILE`), where `$argN` and return probes work.
    pub fn is_function_entry(&self) -> bool {
        self.function.is_some() && self.line.is_none()
    }
}

impl Target {
    /// A symbol pattern (`*`, `?`, `{a,b}`): one probe per function it matches.
    pub fn is_wildcard(&self) -> bool {
        matches!(self, Target::Symbol { name, .. } | Target::ModuleSymbol { name, .. } if is_wildcard_pattern(name))
    }
}

/// One fetch-arg: what to record each time the probe hits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchArg {
    /// The field name; `argN` (1-based position) when the spec gives none.
    pub name: String,
    /// Where the value comes from.
    pub expr: FetchExpr,
    /// How to read and show it; already defaulted (`x64`, or `string` for `$comm`).
    pub ty: ArgType,
    /// `TYPE[N]`: N consecutive elements in memory (1 ..= 64).
    pub array_len: Option<u32>,
    /// A BTF fetch-arg ([`FetchExpr::Btf`]) whose spec gave its type: without one it takes
    /// the type BTF gives it. Always false for other fetch-args (their default is `x64`).
    pub typed: bool,
}

/// Where a fetch-arg's value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FetchExpr {
    /// `%REG`: a register at the probe hit.
    Register(Register),
    /// `@ADDR`: the memory at a kernel address.
    Memory(Gva),
    /// `@SYM[+|-offs]`: the memory at a (data) symbol plus an offset.
    SymbolMemory { name: String, offset: i64 },
    /// `$stackN`: the Nth word on the stack, from 0.
    StackEntry(u32),
    /// `$stack`: the stack pointer itself.
    StackPointer,
    /// `$argN`: the Nth function argument, from 1, by the calling convention.
    Arg(u32),
    /// `$retval`: the return value (return probes only).
    Retval,
    /// `$duration`: nanoseconds on the trace clock since the call's entry (return probes
    /// only; hvprobe's, not Linux's).
    Duration,
    /// `$comm`: the current task's name.
    Comm,
    /// `\IMM`: a constant.
    Immediate(u64),
    /// `\"TEXT"`: a constant string (type `string` only).
    ImmString(String),
    /// A function parameter by name or `$argN`, with `->`/`.` fields through its type, as
    /// Linux 6.5+ reads them from BTF: resolved into plain fetches by
    /// [`check::resolve_btf_args`] once the kernel's BTF is known.
    Btf(BtfRef),
    /// `$arg*`: every parameter of the function, by name, from BTF.
    AllArgs,
    /// `$params` (perf probe's): every parameter of the function at a source target, from
    /// DWARF, as it is at the probe's address.
    Params,
    /// `$vars` (perf probe's): every parameter and local variable in scope at a source
    /// target's address, from DWARF.
    Vars,
    /// `+|-[u]OFFS(FETCHARG)`: the memory at the inner value plus `offset`; `user` when the
    /// address is a user-space one (`u`).
    Deref {
        offset: i64,
        user: bool,
        base: Box<FetchExpr>,
    },
}

/// What a BTF fetch-arg starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BtfBase {
    /// A parameter named in the spec (`count`); at a source target, any variable in
    /// scope there, found in the kernel's DWARF.
    Param(String),
    /// `$argN->...`: the Nth parameter (from 1), through its BTF type.
    Arg(u32),
    /// `$retval->...`: the return value, through the function's BTF return type.
    Retval,
}

/// One `->NAME` or `.NAME` step of a BTF fetch-arg.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BtfField {
    pub name: String,
    /// `->`: through a pointer (a read); `.`: a member of the struct reached so far.
    pub arrow: bool,
}

/// A BTF fetch-arg before its resolution: a base and its field steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BtfRef {
    pub base: BtfBase,
    pub fields: Vec<BtfField>,
}

/// A fetch-arg's type, the element type when it is an array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgType {
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    X8,
    X16,
    X32,
    X64,
    /// A NUL-terminated kernel string.
    String,
    /// A NUL-terminated user-space string.
    UString,
    /// An address shown as `symbol+offset`.
    Symbol,
    /// An address turned into the string `symbol+offset/size`.
    SymStr,
    /// One byte shown as a character (`'c'`), Linux 6.6+.
    Char,
    /// `b<width>@<offset>/<container bits>`: `width` bits from bit `offset` of a
    /// `container_bits`-wide (8, 16, 32 or 64) unsigned value.
    Bitfield {
        width: u8,
        offset: u8,
        container_bits: u8,
    },
}

impl ArgType {
    /// The type named `name`, bitfields and arrays aside.
    fn from_plain_name(name: &str) -> Option<ArgType> {
        Some(match name {
            "u8" => ArgType::U8,
            "u16" => ArgType::U16,
            "u32" => ArgType::U32,
            "u64" => ArgType::U64,
            "s8" => ArgType::S8,
            "s16" => ArgType::S16,
            "s32" => ArgType::S32,
            "s64" => ArgType::S64,
            "x8" => ArgType::X8,
            "x16" => ArgType::X16,
            "x32" => ArgType::X32,
            "x64" => ArgType::X64,
            "string" => ArgType::String,
            "ustring" => ArgType::UString,
            "symbol" => ArgType::Symbol,
            "symstr" => ArgType::SymStr,
            "char" => ArgType::Char,
            _ => return None,
        })
    }

    /// Bytes one value takes in the event record (strings are a 4-byte `__data_loc`).
    pub const fn record_size(self) -> u32 {
        match self {
            ArgType::U8 | ArgType::S8 | ArgType::X8 | ArgType::Char => 1,
            ArgType::U16 | ArgType::S16 | ArgType::X16 => 2,
            ArgType::U32 | ArgType::S32 | ArgType::X32 => 4,
            ArgType::U64 | ArgType::S64 | ArgType::X64 | ArgType::Symbol => 8,
            ArgType::String | ArgType::UString | ArgType::SymStr => 4,
            ArgType::Bitfield { container_bits, .. } => container_bits as u32 / 8,
        }
    }

    /// Whether the value is a string read through a pointer (not `symstr`).
    const fn is_memory_string(self) -> bool {
        matches!(self, ArgType::String | ArgType::UString)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod conformance;
