//! The kprobe_events language: probe specs parsed as Linux parses them ([`check`] checks
//! them against a kernel), the values their fetch-args read ([`fetch`]) and the event
//! lines they print ([`output`]).
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

/// Whether a symbol name is a pattern over many functions: a glob (`*`, `?`) or an
/// explicit list (`{vfs_read,vfs_write}`, `vfs_{read,write}`).
pub fn is_wildcard_pattern(name: &str) -> bool {
    name.contains(['*', '?', '{'])
}

/// Whether `name` matches `pattern`: `*` any run of characters, `?` any one, as
/// bpftrace's `kprobe:vfs_*` and ftrace's `set_ftrace_filter` globs do; `{a,b}` either
/// alternative, as in a shell (braces do not nest; an unbalanced one matches nothing).
pub fn wildcard_matches(pattern: &str, name: &str) -> bool {
    brace_alternatives(pattern).is_some_and(|globs| globs.iter().any(|g| glob_matches(g, name)))
}

/// Most names a pattern's `{a,b}` lists may stand for: each list multiplies the others,
/// so a few long lists would otherwise ask for more memory than there is (the spec fuzzer
/// found one that did).
pub const MAX_BRACE_ALTERNATIVES: usize = 1024;

/// How many names a pattern's `{a,b}` lists stand for (the product of their lengths,
/// saturating), without building them.
fn brace_alternative_count(pattern: &str) -> usize {
    let mut count = 1usize;
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let list = &rest[open + 1..open + close];
        count = count.saturating_mul(list.split(',').count());
        rest = &rest[open + close + 1..];
    }
    count
}

/// The globs a pattern's `{a,b}` lists stand for (the product of every list), or None
/// when a brace is unbalanced or nested, or the lists stand for more than
/// [`MAX_BRACE_ALTERNATIVES`] names.
pub fn brace_alternatives(pattern: &str) -> Option<Vec<String>> {
    if brace_alternative_count(pattern) > MAX_BRACE_ALTERNATIVES {
        return None;
    }
    expand_braces(pattern)
}

fn expand_braces(pattern: &str) -> Option<Vec<String>> {
    let Some(open) = pattern.find('{') else {
        return (!pattern.contains('}')).then(|| vec![pattern.to_owned()]);
    };
    let close = open + pattern[open..].find('}')?;
    let (head, list, tail) = (&pattern[..open], &pattern[open + 1..close], &pattern[close + 1..]);
    if head.contains('}') || list.contains('{') {
        return None;
    }
    let tails = expand_braces(tail)?;
    Some(
        list.split(',')
            .flat_map(|alt| tails.iter().map(move |t| format!("{head}{alt}{t}")))
            .collect(),
    )
}

fn glob_matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    // Where the last `*` was, and how much of the name it has eaten.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
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

/// What is wrong with a spec line: a syntax error, or (from [`check`]) a name the kernel
/// does not have. Each maps to the code of Linux's probe parser that refuses the same
/// thing ([`SpecErrorKind::linux_error`]), except hvprobe's own extensions and limits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecErrorKind {
    #[error(
        "a wildcard target probes many functions, each with its generated event name: write `GRP/` without an \
         EVENT, and no offset"
    )]
    NamedWildcard,
    #[error("unknown probe type `{0}` (expected `p`, `r`, `w` or `-:`)")]
    UnknownProbeType(String),
    #[error("bad watch length `{0}`: 1, 2, 4 or 8 bytes")]
    BadWatchLength(String),
    #[error("bad watch access `{0}`: `w` (writes), `rw` (reads and writes) or `x` (execution)")]
    BadWatchAccess(String),
    #[error("x86's debug registers cannot watch reads alone: `rw` watches reads and writes")]
    ReadOnlyWatch,
    #[error("an execution watch (`x`) covers one byte: its length is 1")]
    ExecuteWatchLength,
    #[error("a watch takes one address or symbol, not a wildcard, a source line or `%return`")]
    WatchTargetNotSingle,
    #[error("unexpected `{0}` after the probe type (expected `:GROUP/EVENT` or a space)")]
    JunkAfterProbeType(String),
    #[error("MAXACTIVE is only for return probes (`r`)")]
    MaxactiveOnKprobe,
    #[error("bad MAXACTIVE `{0}`: expected a number from 1 to {MAX_MAXACTIVE}")]
    BadMaxactive(String),
    #[error("MAXACTIVE `{0}` is too big: at most {MAX_MAXACTIVE}")]
    MaxactiveTooBig(String),
    #[error("empty group name before `/`")]
    NoGroupName,
    #[error("bad group name `{0}`: expected [A-Za-z_][A-Za-z0-9_-]*")]
    BadGroupName(String),
    #[error("group name longer than {MAX_EVENT_NAME_LEN} characters")]
    GroupNameTooLong,
    #[error("empty event name")]
    NoEventName,
    #[error("bad event name `{0}`: expected [A-Za-z_][A-Za-z0-9_]*")]
    BadEventName(String),
    #[error("event name longer than {MAX_EVENT_NAME_LEN} characters")]
    EventNameTooLong,
    #[error("missing probe target (a symbol or an address)")]
    MissingTarget,
    #[error("bad probe target `{0}`: expected SYMBOL[+OFFSET] or an address")]
    BadTarget(String),
    #[error("the `{{a,b}}` lists of `{0}` stand for more than {MAX_BRACE_ALTERNATIVES} names")]
    TooManyAlternatives(String),
    #[error("bad offset `{0}` after the symbol: expected +N, 0 <= N <= 4294967295")]
    BadTargetOffset(String),
    #[error(
        "bad module target `{0}`: expected MODULE:SYMBOL[+OFFSET] (a module name of letters, digits \
         and `_`, and one of its functions or a pattern of them)"
    )]
    BadModuleTarget(String),
    #[error("bad source line `{0}`: expected a line number")]
    BadSourceLine(String),
    #[error("a return probe on a source target must name a function's entry (`FUNC@FILE%return`), not a line")]
    RetprobeOnSourceLine,
    #[error("${0} needs a source target (FUNC:LINE, FUNC@FILE or FILE:LINE), whose DWARF lists the variables")]
    SourceVarsNotAtSource(String),
    #[error("${0} takes no NAME= or :TYPE: each variable it lists keeps its own name and DWARF type")]
    SourceVarsTakeNoNameOrType(String),
    #[error("`{0}` looks like a uprobe target; only kernel probes are supported")]
    UprobeNotSupported(String),
    #[error("unknown target suffix `{0}` (only `%return` is allowed)")]
    BadTargetSuffix(String),
    #[error("a return probe must be on a function entry (`+0`), not `+{0}`")]
    RetprobeNotOnEntry(u64),
    #[error("a remove (`-:`) takes no other arguments")]
    ArgsOnRemove,
    #[error("more than {MAX_ARGS} fetch-args")]
    TooManyArgs,
    #[error("empty argument name before `=`")]
    NoArgName,
    #[error("argument name longer than {MAX_ARG_NAME_LEN} characters")]
    ArgNameTooLong,
    #[error("bad argument name `{0}`: expected [A-Za-z_][A-Za-z0-9_]*")]
    BadArgName(String),
    #[error("argument name `{0}` is already used")]
    DuplicateArgName(String),
    #[error("argument name `{0}` is reserved")]
    ReservedArgName(String),
    #[error("empty fetch-arg")]
    NoArgBody,
    #[error("fetch-arg longer than {MAX_ARG_BODY_LEN} characters")]
    ArgTooLong,
    #[error("unknown register %{name}{}", .hint.map(|h| format!(" (the kernel calls it %{h})")).unwrap_or_default())]
    UnknownRegister { name: String, hint: Option<&'static str> },
    #[error("bad memory address `{0}`")]
    BadMemoryAddress(String),
    #[error("file offsets (`@+OFFS`) are for uprobes, not kernel probes")]
    FileOffsetOnKprobe,
    #[error("bad symbol `{0}` in `@SYM[+|-OFFS]`")]
    BadMemorySymbol(String),
    #[error("unknown variable `${0}` (expected $stack, $stackN, $argN, $arg*, $retval or $comm)")]
    UnknownVariable(String),
    #[error("bad stack index `{0}`: expected 0 to {MAX_STACK_INDEX}")]
    BadStackIndex(String),
    #[error("bad argument number `{0}`: expected 1 to {MAX_STACK_INDEX}")]
    BadArgNumber(String),
    #[error("$argN only works on a kprobe at a function entry (SYMBOL or SYMBOL+0)")]
    ArgNotOnEntry,
    #[error("$retval only works on a return probe")]
    RetvalOnKprobe,
    #[error("$duration only works on a return probe (the time since the call's entry; hvprobe's, not Linux's)")]
    DurationOnKprobe,
    #[error("dereference needs `(`: expected +|-[u]OFFS(FETCHARG)")]
    DerefNeedsParen,
    #[error("bad dereference offset `{0}`")]
    BadDerefOffset(String),
    #[error("missing `)` to close the dereference")]
    DerefNotClosed,
    #[error("unexpected `{0}` after the dereference's `)`")]
    JunkAfterDeref(String),
    #[error("$comm and immediate strings can not be dereferenced")]
    CommDeref,
    #[error("bad immediate value `{0}`")]
    BadImmediate(String),
    #[error("immediate string not closed with `\"`")]
    ImmStringNotClosed,
    #[error(
        "unknown fetch-arg `{0}` (expected %REG, @ADDR, @SYM, $VAR, \\IMM, +|-OFFS(FETCHARG) or a parameter name)"
    )]
    BadFetchArg(String),
    #[error("fetch-arg too complex: needs {0} fetch operations, the kernel allows {MAX_FETCH_OPS}")]
    TooManyFetchOps(usize),
    #[error("unknown type `{0}`")]
    UnknownType(String),
    #[error("bad bitfield `{0}`: expected b<width>@<offset>/<8|16|32|64>, width >= 1, width + offset <= size")]
    BadBitfield(String),
    #[error("missing `]` to close the array length")]
    ArrayNotClosed,
    #[error("unexpected `{0}` after the array's `]`")]
    JunkAfterArray(String),
    #[error("bad array length `{0}`: expected 1 to {MAX_ARRAY_LEN}")]
    BadArrayLen(String),
    #[error("array length `{0}` is too big: at most {MAX_ARRAY_LEN}")]
    ArrayTooBig(String),
    #[error("arrays are only for memory fetch-args (@ADDR, @SYM, +|-OFFS(...)) of non-symstr types")]
    ArrayNotOnMemory,
    #[error("`{0}` is only for memory fetch-args (@ADDR, @SYM, +|-OFFS(...), \\IMM) and $comm")]
    StringNotOnMemory(&'static str),
    #[error("symstr is only for %REG, $stackN, $argN, $retval, @ADDR, @SYM and kernel dereferences")]
    SymstrBadFetch,
    #[error("the type of $comm and of an immediate string can only be `string`")]
    CommNotString,
    #[error("event data too big: {0} bytes, at most {MAX_EVENT_DATA_SIZE}")]
    EventTooBig(u32),
    #[error("$arg* stands alone: no name, type or dereference")]
    VarArgsNotAlone,
    #[error("$arg* may be used only once in a probe")]
    DoubleVarArgs,
    #[error("$arg* and parameter names only work on a kprobe at a function entry (SYMBOL or SYMBOL+0)")]
    BtfArgNotOnEntry,
    #[error("`-` without `>`: a field is reached with `->` or `.`")]
    BadHyphen,
    #[error("`.` on a parameter: only a pointer parameter's fields can be read (`->`)")]
    DotOnParam,
    // What needs the kernel's symbols, text or BTF (see `check`).
    // The same words as the engine's refusals of the running kernel.
    #[error("unknown symbol {0:?}")]
    UnknownProbeSymbol(String),
    #[error("symbol {name:?} is not unique ({count} symbols have that name): give an address instead")]
    NotUniqueSymbol { name: String, count: usize },
    #[error("{what} is outside {function} ({size:#x} bytes)")]
    OffsetBeyondFunction { what: String, function: String, size: u64 },
    #[error("{0}")]
    NotInstructionBoundary(Box<SplitInstruction>),
    #[error("no symbol `{0}` in the kernel (for `@{0}`)")]
    UnknownDataSymbol(String),
    #[error("the kernel's BTF is not available: parameter names and $arg* need it")]
    NoBtf,
    #[error("no BTF entry for function `{0}`")]
    NoBtfEntry(String),
    #[error("`{name}` is not a parameter of {function}")]
    NoSuchParam { name: String, function: String },
    #[error("{0} returns void: there is no $retval")]
    NoRetval(String),
    #[error("`{0}` is not a pointer to a struct or union")]
    NotPointerToStruct(String),
    #[error("no field `{field}` in {container}")]
    NoSuchField { field: String, container: String },
    #[error("bad BTF type: {0}")]
    BadBtfType(String),
    #[error("the type of `{0}` can not be shown as a string (only char arrays and char pointers)")]
    BadTypeForString(String),
}

/// A probe point inside an instruction, with the instructions around it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} is not an instruction boundary in {function} (instructions start at {before} and {after})")]
pub struct SplitInstruction {
    pub what: String,
    pub function: String,
    pub before: String,
    pub after: String,
}

/// The error codes of Linux's probe parser (`kernel/trace/trace_probe.h`), those a
/// `kprobe_events` line can hit. Each [`SpecErrorKind`] maps to one of them, or to none
/// where hvprobe refuses what Linux has no code for (its extensions, its limits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum LinuxError {
    BAD_MAXACT_TYPE,
    BAD_MAXACT,
    MAXACT_TOO_BIG,
    BAD_PROBE_ADDR,
    NON_UNIQ_SYMBOL,
    BAD_RETPROBE,
    BAD_ADDR_SUFFIX,
    NO_GROUP_NAME,
    GROUP_TOO_LONG,
    BAD_GROUP_NAME,
    NO_EVENT_NAME,
    EVENT_TOO_LONG,
    BAD_EVENT_NAME,
    RETVAL_ON_PROBE,
    NO_RETVAL,
    BAD_STACK_NUM,
    BAD_ARG_NUM,
    BAD_VAR,
    BAD_REG_NAME,
    BAD_MEM_ADDR,
    BAD_IMM,
    IMMSTR_NO_CLOSE,
    FILE_ON_KPROBE,
    TOO_MANY_OPS,
    DEREF_NEED_BRACE,
    BAD_DEREF_OFFS,
    DEREF_OPEN_BRACE,
    COMM_CANT_DEREF,
    BAD_FETCH_ARG,
    ARRAY_NO_CLOSE,
    BAD_ARRAY_SUFFIX,
    BAD_ARRAY_NUM,
    ARRAY_TOO_BIG,
    BAD_TYPE,
    BAD_STRING,
    BAD_SYMSTRING,
    BAD_BITFIELD,
    ARG_NAME_TOO_LONG,
    NO_ARG_NAME,
    BAD_ARG_NAME,
    USED_ARG_NAME,
    ARG_TOO_LONG,
    NO_ARG_BODY,
    BAD_INSN_BNDRY,
    NOSUP_BTFARG,
    NO_BTFARG,
    NO_BTF_ENTRY,
    BAD_VAR_ARGS,
    NOFENTRY_ARGS,
    DOUBLE_ARGS,
    NO_PTR_STRCT,
    NOSUP_DAT_ARG,
    BAD_HYPHEN,
    NO_BTF_FIELD,
    BAD_BTF_TID,
    BAD_TYPE4STR,
    NEED_STRING_TYPE,
    TOO_MANY_ARGS,
    EVENT_TOO_BIG,
}

impl LinuxError {
    /// Every code, in `trace_probe.h`'s order.
    pub const ALL: [LinuxError; 59] = [
        LinuxError::BAD_MAXACT_TYPE,
        LinuxError::BAD_MAXACT,
        LinuxError::MAXACT_TOO_BIG,
        LinuxError::BAD_PROBE_ADDR,
        LinuxError::NON_UNIQ_SYMBOL,
        LinuxError::BAD_RETPROBE,
        LinuxError::BAD_ADDR_SUFFIX,
        LinuxError::NO_GROUP_NAME,
        LinuxError::GROUP_TOO_LONG,
        LinuxError::BAD_GROUP_NAME,
        LinuxError::NO_EVENT_NAME,
        LinuxError::EVENT_TOO_LONG,
        LinuxError::BAD_EVENT_NAME,
        LinuxError::RETVAL_ON_PROBE,
        LinuxError::NO_RETVAL,
        LinuxError::BAD_STACK_NUM,
        LinuxError::BAD_ARG_NUM,
        LinuxError::BAD_VAR,
        LinuxError::BAD_REG_NAME,
        LinuxError::BAD_MEM_ADDR,
        LinuxError::BAD_IMM,
        LinuxError::IMMSTR_NO_CLOSE,
        LinuxError::FILE_ON_KPROBE,
        LinuxError::TOO_MANY_OPS,
        LinuxError::DEREF_NEED_BRACE,
        LinuxError::BAD_DEREF_OFFS,
        LinuxError::DEREF_OPEN_BRACE,
        LinuxError::COMM_CANT_DEREF,
        LinuxError::BAD_FETCH_ARG,
        LinuxError::ARRAY_NO_CLOSE,
        LinuxError::BAD_ARRAY_SUFFIX,
        LinuxError::BAD_ARRAY_NUM,
        LinuxError::ARRAY_TOO_BIG,
        LinuxError::BAD_TYPE,
        LinuxError::BAD_STRING,
        LinuxError::BAD_SYMSTRING,
        LinuxError::BAD_BITFIELD,
        LinuxError::ARG_NAME_TOO_LONG,
        LinuxError::NO_ARG_NAME,
        LinuxError::BAD_ARG_NAME,
        LinuxError::USED_ARG_NAME,
        LinuxError::ARG_TOO_LONG,
        LinuxError::NO_ARG_BODY,
        LinuxError::BAD_INSN_BNDRY,
        LinuxError::NOSUP_BTFARG,
        LinuxError::NO_BTFARG,
        LinuxError::NO_BTF_ENTRY,
        LinuxError::BAD_VAR_ARGS,
        LinuxError::NOFENTRY_ARGS,
        LinuxError::DOUBLE_ARGS,
        LinuxError::NO_PTR_STRCT,
        LinuxError::NOSUP_DAT_ARG,
        LinuxError::BAD_HYPHEN,
        LinuxError::NO_BTF_FIELD,
        LinuxError::BAD_BTF_TID,
        LinuxError::BAD_TYPE4STR,
        LinuxError::NEED_STRING_TYPE,
        LinuxError::TOO_MANY_ARGS,
        LinuxError::EVENT_TOO_BIG,
    ];
}

impl SpecErrorKind {
    /// The code Linux's probe parser gives the same mistake; `None` for what Linux has no
    /// code for: hvprobe's extensions (wildcards, brace lists), what it does not support
    /// (modules, uprobes), and junk Linux silently ignores but hvprobe refuses.
    pub fn linux_error(&self) -> Option<LinuxError> {
        use LinuxError as L;
        use SpecErrorKind as K;
        Some(match self {
            K::NamedWildcard
            | K::TooManyAlternatives(_)
            | K::BadWatchLength(_)
            | K::BadWatchAccess(_)
            | K::ReadOnlyWatch
            | K::ExecuteWatchLength
            | K::WatchTargetNotSingle
            | K::UnknownProbeType(_)
            | K::JunkAfterProbeType(_)
            | K::MissingTarget
            | K::BadModuleTarget(_)
            | K::BadSourceLine(_)
            | K::RetprobeOnSourceLine
            | K::SourceVarsNotAtSource(_)
            | K::SourceVarsTakeNoNameOrType(_)
            | K::UprobeNotSupported(_)
            | K::ArgsOnRemove
            | K::JunkAfterDeref(_) => return None,
            K::MaxactiveOnKprobe => L::BAD_MAXACT_TYPE,
            K::BadMaxactive(_) => L::BAD_MAXACT,
            K::MaxactiveTooBig(_) => L::MAXACT_TOO_BIG,
            K::NoGroupName => L::NO_GROUP_NAME,
            K::BadGroupName(_) => L::BAD_GROUP_NAME,
            K::GroupNameTooLong => L::GROUP_TOO_LONG,
            K::NoEventName => L::NO_EVENT_NAME,
            K::BadEventName(_) => L::BAD_EVENT_NAME,
            K::EventNameTooLong => L::EVENT_TOO_LONG,
            K::BadTarget(_) | K::BadTargetOffset(_) | K::UnknownProbeSymbol(_) | K::OffsetBeyondFunction { .. } => {
                L::BAD_PROBE_ADDR
            }
            K::NotUniqueSymbol { .. } => L::NON_UNIQ_SYMBOL,
            K::BadTargetSuffix(_) => L::BAD_ADDR_SUFFIX,
            K::RetprobeNotOnEntry(_) => L::BAD_RETPROBE,
            K::TooManyArgs => L::TOO_MANY_ARGS,
            K::NoArgName => L::NO_ARG_NAME,
            K::ArgNameTooLong => L::ARG_NAME_TOO_LONG,
            K::BadArgName(_) => L::BAD_ARG_NAME,
            K::DuplicateArgName(_) | K::ReservedArgName(_) => L::USED_ARG_NAME,
            K::NoArgBody => L::NO_ARG_BODY,
            K::ArgTooLong => L::ARG_TOO_LONG,
            K::UnknownRegister { .. } => L::BAD_REG_NAME,
            K::BadMemoryAddress(_) | K::BadMemorySymbol(_) | K::UnknownDataSymbol(_) => L::BAD_MEM_ADDR,
            K::FileOffsetOnKprobe => L::FILE_ON_KPROBE,
            K::UnknownVariable(_) | K::DurationOnKprobe => L::BAD_VAR,
            K::BadStackIndex(_) => L::BAD_STACK_NUM,
            K::BadArgNumber(_) => L::BAD_ARG_NUM,
            K::ArgNotOnEntry | K::BtfArgNotOnEntry => L::NOFENTRY_ARGS,
            K::RetvalOnKprobe => L::RETVAL_ON_PROBE,
            K::DerefNeedsParen => L::DEREF_NEED_BRACE,
            K::BadDerefOffset(_) => L::BAD_DEREF_OFFS,
            K::DerefNotClosed => L::DEREF_OPEN_BRACE,
            K::CommDeref => L::COMM_CANT_DEREF,
            K::BadImmediate(_) => L::BAD_IMM,
            K::ImmStringNotClosed => L::IMMSTR_NO_CLOSE,
            K::BadFetchArg(_) => L::BAD_FETCH_ARG,
            K::TooManyFetchOps(_) => L::TOO_MANY_OPS,
            K::UnknownType(_) => L::BAD_TYPE,
            K::BadBitfield(_) => L::BAD_BITFIELD,
            K::ArrayNotClosed => L::ARRAY_NO_CLOSE,
            K::JunkAfterArray(_) => L::BAD_ARRAY_SUFFIX,
            K::BadArrayLen(_) => L::BAD_ARRAY_NUM,
            K::ArrayTooBig(_) => L::ARRAY_TOO_BIG,
            K::ArrayNotOnMemory | K::StringNotOnMemory(_) => L::BAD_STRING,
            K::SymstrBadFetch => L::BAD_SYMSTRING,
            K::CommNotString => L::NEED_STRING_TYPE,
            K::EventTooBig(_) => L::EVENT_TOO_BIG,
            K::VarArgsNotAlone => L::BAD_VAR_ARGS,
            K::DoubleVarArgs => L::DOUBLE_ARGS,
            K::BadHyphen => L::BAD_HYPHEN,
            K::DotOnParam => L::NOSUP_DAT_ARG,
            K::NotInstructionBoundary(_) => L::BAD_INSN_BNDRY,
            K::NoBtf => L::NOSUP_BTFARG,
            K::NoBtfEntry(_) => L::NO_BTF_ENTRY,
            K::NoSuchParam { .. } => L::NO_BTFARG,
            K::NoRetval(_) => L::NO_RETVAL,
            K::NotPointerToStruct(_) => L::NO_PTR_STRCT,
            K::NoSuchField { .. } => L::NO_BTF_FIELD,
            K::BadBtfType(_) => L::BAD_BTF_TID,
            K::BadTypeForString(_) => L::BAD_TYPE4STR,
        })
    }
}

/// A spec error, with where it is (1-based line and column, in characters).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}{line}:{column}: {kind}", .file.as_deref().map(|f| format!("{f}:")).unwrap_or_default())]
pub struct SpecError {
    /// The file name given to [`parse_file`]; `None` from [`parse_line`].
    pub file: Option<String>,
    pub line: usize,
    pub column: usize,
    pub kind: SpecErrorKind,
}

/// Parses one line. `Ok(None)` for a blank or comment-only line.
pub fn parse_line(line: &str) -> Result<Option<ProbeSpec>, SpecError> {
    parse_numbered_line(line, 1, None)
}

/// Parses a whole spec file: every probe in order, or the first error.
pub fn parse_file(text: &str, file_name: &str) -> Result<Vec<ProbeSpec>, SpecError> {
    Ok(parse_file_numbered(text, file_name)?
        .into_iter()
        .map(|(_, spec)| spec)
        .collect())
}

/// Like [`parse_file`], with each spec's 1-based line number (for later errors that are
/// not about syntax, such as an unknown symbol).
pub fn parse_file_numbered(text: &str, file_name: &str) -> Result<Vec<(usize, ProbeSpec)>, SpecError> {
    let mut specs = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if let Some(spec) = parse_numbered_line(line, index + 1, Some(file_name))? {
            specs.push((index + 1, spec));
        }
    }
    Ok(specs)
}

/// Like [`parse_file_numbered`], but every line is parsed: the probes of the lines that
/// parse, and every error, both in line order, so that a file with several mistakes needs
/// one round of fixing.
pub fn parse_file_all_errors(text: &str, file_name: &str) -> (Vec<(usize, ProbeSpec)>, Vec<SpecError>) {
    let mut specs = Vec::new();
    let mut errors = Vec::new();
    for (index, line) in text.lines().enumerate() {
        match parse_numbered_line(line, index + 1, Some(file_name)) {
            Ok(Some(spec)) => specs.push((index + 1, spec)),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    (specs, errors)
}

fn parse_numbered_line(line: &str, number: usize, file: Option<&str>) -> Result<Option<ProbeSpec>, SpecError> {
    LineParser { line }
        .parse()
        .map_err(|LocatedError { byte, kind }| SpecError {
            file: file.map(str::to_owned),
            line: number,
            // Columns count characters, not bytes, so that an editor lands on the spot.
            column: line.char_indices().take_while(|&(at, _)| at < byte).count() + 1,
            kind,
        })
}

/// An error at a byte offset into the line.
struct LocatedError {
    byte: usize,
    kind: SpecErrorKind,
}

type Parsed<T> = Result<T, LocatedError>;

/// What the fetch-args of a probe may use, from its kind and target.
#[derive(Clone, Copy)]
struct ProbeContext {
    is_return: bool,
    at_function_entry: bool,
    /// A source target: names are variables from DWARF, wherever the probe is.
    at_source: bool,
}

/// Parses one line; every `&str` handled is a slice of `line`, so an error's position is
/// the slice's place in it.
struct LineParser<'a> {
    line: &'a str,
}

impl<'a> LineParser<'a> {
    /// An error pointing at the start of `at`, which must be a slice of the line.
    fn err(&self, at: &str, kind: SpecErrorKind) -> LocatedError {
        let byte = (at.as_ptr() as usize).saturating_sub(self.line.as_ptr() as usize);
        LocatedError {
            byte: byte.min(self.line.len()),
            kind,
        }
    }

    fn parse(&self) -> Parsed<Option<ProbeSpec>> {
        // The kernel cuts a line at its first `#`, wherever it is.
        let code = match self.line.find('#') {
            Some(hash) => &self.line[..hash],
            None => self.line,
        };
        // The kernel's isspace(), which unlike char::is_ascii_whitespace includes \v.
        let mut tokens = code
            .split([' ', '\t', '\n', '\x0b', '\x0c', '\r'])
            .filter(|t| !t.is_empty());
        let Some(head) = tokens.next() else {
            return Ok(None);
        };
        let rest: Vec<&'a str> = tokens.collect();
        match head.as_bytes()[0] {
            b'p' => self.parse_probe(head, false, &rest).map(Some),
            b'r' => self.parse_probe(head, true, &rest).map(Some),
            b'w' => self.parse_watch(head, &rest).map(Some),
            b'-' => self.parse_remove(head, &rest).map(Some),
            _ => Err(self.err(head, SpecErrorKind::UnknownProbeType(head.to_owned()))),
        }
    }

    fn parse_remove(&self, head: &'a str, rest: &[&'a str]) -> Parsed<ProbeSpec> {
        let Some(name) = head.strip_prefix("-:") else {
            return Err(self.err(head, SpecErrorKind::UnknownProbeType(head.to_owned())));
        };
        if let Some(extra) = rest.first() {
            return Err(self.err(extra, SpecErrorKind::ArgsOnRemove));
        }
        let (group, event) = self.parse_group_event(name)?;
        let Some(event) = event else {
            return Err(self.err(self.end_of(name), SpecErrorKind::NoEventName));
        };
        Ok(ProbeSpec::Remove { group, event })
    }

    /// The empty slice just past `s`.
    fn end_of(&self, s: &'a str) -> &'a str {
        &s[s.len()..]
    }

    fn parse_probe(&self, head: &'a str, is_r: bool, rest: &[&'a str]) -> Parsed<ProbeSpec> {
        let after_kind = &head[1..];
        let digits_len = after_kind.find(':').unwrap_or(after_kind.len());
        let (maxactive_text, name_part) = after_kind.split_at(digits_len);
        let maxactive = if maxactive_text.is_empty() {
            None
        } else if !maxactive_text.as_bytes()[0].is_ascii_digit() {
            return Err(self.err(
                maxactive_text,
                SpecErrorKind::JunkAfterProbeType(maxactive_text.to_owned()),
            ));
        } else if !is_r {
            return Err(self.err(maxactive_text, SpecErrorKind::MaxactiveOnKprobe));
        } else {
            match parse_unsigned(maxactive_text) {
                Some(n) if (1..=u64::from(MAX_MAXACTIVE)).contains(&n) => Some(n as u32),
                Some(1..) => {
                    return Err(self.err(
                        maxactive_text,
                        SpecErrorKind::MaxactiveTooBig(maxactive_text.to_owned()),
                    ))
                }
                _ => return Err(self.err(maxactive_text, SpecErrorKind::BadMaxactive(maxactive_text.to_owned()))),
            }
        };
        let (group, event) = match name_part.strip_prefix(':') {
            Some(name) => self.parse_group_event(name)?,
            None => (None, None),
        };

        let Some((&target_text, arg_texts)) = rest.split_first() else {
            return Err(self.err(self.end_of(head), SpecErrorKind::MissingTarget));
        };
        let (target, return_suffix) = self.parse_target(target_text)?;
        let is_return = is_r || return_suffix;
        if let (true, Target::Symbol { offset, .. } | Target::ModuleSymbol { offset, .. }) = (is_return, &target) {
            if *offset != 0 {
                return Err(self.err(target_text, SpecErrorKind::RetprobeNotOnEntry(*offset)));
            }
        }
        if let (true, Target::Source(point)) = (is_return, &target) {
            if !point.is_function_entry() {
                return Err(self.err(target_text, SpecErrorKind::RetprobeOnSourceLine));
            }
        }
        let context = ProbeContext {
            is_return,
            // Only a symbol+0 counts: the kernel decides "function entry" from the symbol.
            at_function_entry: match &target {
                Target::Symbol { offset, .. } | Target::ModuleSymbol { offset, .. } => *offset == 0,
                Target::Source(point) => point.is_function_entry(),
                Target::Address(_) => false,
            },
            at_source: matches!(target, Target::Source(_)),
        };

        if target.is_wildcard()
            && (event.is_some()
                || matches!(
                    target,
                    Target::Symbol { offset: 1.., .. } | Target::ModuleSymbol { offset: 1.., .. }
                ))
        {
            return Err(self.err(target_text, SpecErrorKind::NamedWildcard));
        }
        let group = group.unwrap_or_else(|| DEFAULT_GROUP.to_owned());
        let event = event.unwrap_or_else(|| default_event_name(is_return, &target));
        let args = self.parse_args(arg_texts, context)?;
        Ok(if is_return {
            ProbeSpec::Kretprobe {
                group,
                event,
                target,
                maxactive,
                args,
            }
        } else {
            ProbeSpec::Kprobe {
                group,
                event,
                target,
                args,
            }
        })
    }

    /// `w[:[GRP/]EVENT] TARGET[/LEN][:ACCESS] [FETCHARGS]`: ACCESS `w`, `rw` (the default,
    /// as perf's) or `x`; LEN 1, 2, 4 or 8 (default 4 for data, as perf's; 1 for `x`).
    fn parse_watch(&self, head: &'a str, rest: &[&'a str]) -> Parsed<ProbeSpec> {
        let after_kind = &head[1..];
        let (group, event) = match after_kind.strip_prefix(':') {
            Some(name) => self.parse_group_event(name)?,
            None if after_kind.is_empty() => (None, None),
            None => return Err(self.err(after_kind, SpecErrorKind::JunkAfterProbeType(after_kind.to_owned()))),
        };
        let Some((&spec_text, arg_texts)) = rest.split_first() else {
            return Err(self.err(self.end_of(head), SpecErrorKind::MissingTarget));
        };
        let (target_and_len, access) = match spec_text.rfind(':') {
            Some(colon) => {
                let letters = &spec_text[colon + 1..];
                let access = match letters {
                    "w" => Access::Write,
                    "rw" | "wr" => Access::ReadWrite,
                    "x" => Access::Execute,
                    "r" => return Err(self.err(letters, SpecErrorKind::ReadOnlyWatch)),
                    _ => return Err(self.err(letters, SpecErrorKind::BadWatchAccess(letters.to_owned()))),
                };
                (&spec_text[..colon], access)
            }
            None => (spec_text, Access::ReadWrite),
        };
        let (target_text, len) = match target_and_len.find('/') {
            Some(slash) => {
                let len_text = &target_and_len[slash + 1..];
                let len = match len_text {
                    "1" => 1,
                    "2" => 2,
                    "4" => 4,
                    "8" => 8,
                    _ => return Err(self.err(len_text, SpecErrorKind::BadWatchLength(len_text.to_owned()))),
                };
                if access == Access::Execute && len != 1 {
                    return Err(self.err(len_text, SpecErrorKind::ExecuteWatchLength));
                }
                (&target_and_len[..slash], len)
            }
            None => (target_and_len, if access == Access::Execute { 1 } else { 4 }),
        };
        let (target, is_return) = self.parse_target(target_text)?;
        if is_return || target.is_wildcard() || matches!(target, Target::Source(_)) {
            return Err(self.err(target_text, SpecErrorKind::WatchTargetNotSingle));
        }
        let context = ProbeContext {
            is_return: false,
            at_function_entry: access == Access::Execute && matches!(target, Target::Symbol { offset: 0, .. }),
            at_source: false,
        };
        let group = group.unwrap_or_else(|| DEFAULT_GROUP.to_owned());
        let event = event.unwrap_or_else(|| event_name_of('w', &target));
        let args = self.parse_args(arg_texts, context)?;
        Ok(ProbeSpec::Watch {
            group,
            event,
            target,
            access,
            len,
            args,
        })
    }

    /// `[GRP/][EVENT]` (or `GRP.EVENT`, which the kernel also takes); `None` for what is
    /// left out.
    fn parse_group_event(&self, text: &'a str) -> Parsed<(Option<String>, Option<String>)> {
        // `/` wins over `.`, as in the kernel, so `a.b/c` is the (bad) group `a.b`.
        let (group, event_text) = match text.find('/').or_else(|| text.find('.')) {
            Some(slash) => {
                let group = &text[..slash];
                if group.is_empty() {
                    return Err(self.err(text, SpecErrorKind::NoGroupName));
                }
                if group.len() > MAX_EVENT_NAME_LEN {
                    return Err(self.err(group, SpecErrorKind::GroupNameTooLong));
                }
                if !is_good_name(group, true) {
                    return Err(self.err(group, SpecErrorKind::BadGroupName(group.to_owned())));
                }
                (Some(group.to_owned()), &text[slash + 1..])
            }
            None => (None, text),
        };
        if event_text.is_empty() {
            // `GRP/` alone keeps the generated event name, as in the kernel.
            return if group.is_some() {
                Ok((group, None))
            } else {
                Err(self.err(event_text, SpecErrorKind::NoEventName))
            };
        }
        if event_text.len() > MAX_EVENT_NAME_LEN {
            return Err(self.err(event_text, SpecErrorKind::EventNameTooLong));
        }
        if !is_good_name(event_text, false) {
            return Err(self.err(event_text, SpecErrorKind::BadEventName(event_text.to_owned())));
        }
        Ok((group, Some(event_text.to_owned())))
    }

    /// The target, and whether it ended in `%return`.
    fn parse_target(&self, text: &'a str) -> Parsed<(Target, bool)> {
        // As in the kernel, anything that reads as a number is an address.
        if let Some(address) = parse_unsigned(text) {
            return Ok((Target::Address(Gva(address)), false));
        }
        // (The file of a module's `MOD:FILE:LINE` is the second part.)
        let source_file = text.split([':', '%']).take(2).any(is_source_file);
        if text.contains('/') && text.contains(':') && !source_file {
            return Err(self.err(text, SpecErrorKind::UprobeNotSupported(text.to_owned())));
        }
        let (symbol_part, is_return) = match text.find('%') {
            Some(percent) if &text[percent..] == "%return" => (&text[..percent], true),
            Some(percent) => {
                let suffix = &text[percent..];
                return Err(self.err(suffix, SpecErrorKind::BadTargetSuffix(suffix.to_owned())));
            }
            None => (text, false),
        };
        // A module's source: `MOD:` before a source form (one with a `@` or a line).
        if let Some((module, rest)) = symbol_part.split_once(':') {
            if is_module_name(module)
                && (rest.contains(['@', ':']) || rest.split(':').next().is_some_and(is_source_file))
            {
                return match self.parse_source_point(text, rest, is_return)? {
                    Some(point) => Ok((
                        Target::Source(SourcePoint {
                            module: Some(module.to_owned()),
                            ..point
                        }),
                        is_return,
                    )),
                    None => Err(self.err(text, SpecErrorKind::BadModuleTarget(symbol_part.to_owned()))),
                };
            }
        }
        if let Some(point) = self.parse_source_point(text, symbol_part, is_return)? {
            return Ok((Target::Source(point), is_return));
        }
        let (module, symbol_part) = match symbol_part.split_once(':') {
            Some((module, symbol)) => {
                let good_module = is_module_name(module);
                let symbol_name = symbol.split(['+', '-']).next().unwrap_or("");
                if !good_module || !is_symbol_name(symbol_name) {
                    return Err(self.err(text, SpecErrorKind::BadModuleTarget(symbol_part.to_owned())));
                }
                (Some(module), symbol)
            }
            None => (None, symbol_part),
        };
        let (name, offset) = match symbol_part.find(['+', '-']) {
            Some(sign) => {
                let offset_text = &symbol_part[sign..];
                match parse_signed(offset_text) {
                    Some(offset) if (0..=i64::from(u32::MAX)).contains(&offset) => {
                        (&symbol_part[..sign], offset as u64)
                    }
                    // Linux points at the whole target: its offset is part of the address.
                    _ => return Err(self.err(text, SpecErrorKind::BadTargetOffset(offset_text.to_owned()))),
                }
            }
            None => (symbol_part, 0),
        };
        if brace_alternative_count(name) > MAX_BRACE_ALTERNATIVES {
            return Err(self.err(name, SpecErrorKind::TooManyAlternatives(name.to_owned())));
        }
        if !is_symbol_name(name) {
            return Err(self.err(text, SpecErrorKind::BadTarget(text.to_owned())));
        }
        if let Some(module) = module {
            return Ok((
                Target::ModuleSymbol {
                    module: module.to_owned(),
                    name: name.to_owned(),
                    offset,
                },
                is_return,
            ));
        }
        Ok((
            Target::Symbol {
                name: name.to_owned(),
                offset,
            },
            is_return,
        ))
    }

    /// perf probe's source targets: `FUNC@FILE[:RLN]`, `FUNC:RLN`, `FILE:LINE` (a file has a
    /// `.` or a `/`; `NAME:NAME` is a module target). `None` for anything else.
    fn parse_source_point(&self, text: &'a str, target: &'a str, is_return: bool) -> Parsed<Option<SourcePoint>> {
        let (place, line_text) = match target.rsplit_once(':') {
            Some((place, line)) => (place, Some(line)),
            None => (target, None),
        };
        let line = match line_text {
            Some(l) if !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()) => match l.parse::<u32>() {
                Ok(n) => Some(n),
                Err(_) => return Err(self.err(l, SpecErrorKind::BadSourceLine(l.to_owned()))),
            },
            // `MOD:SYM`, or no line.
            Some(_) if !place.contains('@') => return Ok(None),
            Some(l) => return Err(self.err(l, SpecErrorKind::BadSourceLine(l.to_owned()))),
            None => None,
        };
        if is_return && line.is_some() {
            return Err(self.err(text, SpecErrorKind::RetprobeOnSourceLine));
        }
        let point = match place.split_once('@') {
            Some((function, file)) => {
                // One function: a pattern names many (wildcards are symbol targets only).
                if !is_symbol_name(function) || is_wildcard_pattern(function) {
                    return Err(self.err(function, SpecErrorKind::BadTarget(text.to_owned())));
                }
                if file.is_empty() || file.contains('@') {
                    return Err(self.err(file, SpecErrorKind::BadTarget(text.to_owned())));
                }
                SourcePoint {
                    function: Some(function.to_owned()),
                    file: Some(file.to_owned()),
                    line,
                    module: None,
                }
            }
            None => {
                let Some(line) = line else { return Ok(None) };
                if is_source_file(place) {
                    SourcePoint {
                        function: None,
                        file: Some(place.to_owned()),
                        line: Some(line),
                        module: None,
                    }
                } else if is_symbol_name(place) && !is_wildcard_pattern(place) {
                    SourcePoint {
                        function: Some(place.to_owned()),
                        file: None,
                        line: Some(line),
                        module: None,
                    }
                } else {
                    return Err(self.err(text, SpecErrorKind::BadTarget(text.to_owned())));
                }
            }
        };
        Ok(Some(point))
    }

    fn parse_args(&self, texts: &[&'a str], context: ProbeContext) -> Parsed<Vec<FetchArg>> {
        if let Some(first_extra) = texts.get(MAX_ARGS) {
            return Err(self.err(first_extra, SpecErrorKind::TooManyArgs));
        }
        let mut args: Vec<FetchArg> = Vec::with_capacity(texts.len());
        let mut data_size = 0u32;
        for (index, &text) in texts.iter().enumerate() {
            // Linux looks for `$arg*` before it parses any argument.
            // A return probe takes them too, saved at the call's entry (Linux 6.9+).
            if text.starts_with("$arg*") {
                if !context.at_function_entry {
                    return Err(self.err(text, SpecErrorKind::BtfArgNotOnEntry));
                }
                if args.iter().any(|a| a.expr == FetchExpr::AllArgs) {
                    return Err(self.err(text, SpecErrorKind::DoubleVarArgs));
                }
            }
            let arg = self.parse_arg(text, index, context)?;
            if RESERVED_ARG_NAMES.contains(&arg.name.as_str()) {
                return Err(self.err(text, SpecErrorKind::ReservedArgName(arg.name)));
            }
            if args.iter().any(|a| a.name == arg.name) {
                return Err(self.err(text, SpecErrorKind::DuplicateArgName(arg.name)));
            }
            data_size += arg.ty.record_size() * arg.array_len.unwrap_or(1);
            if data_size > MAX_EVENT_DATA_SIZE {
                return Err(self.err(text, SpecErrorKind::EventTooBig(data_size)));
            }
            args.push(arg);
        }
        Ok(args)
    }

    /// `[NAME=]FETCHARG[:TYPE[[N]]]`, the `index`th (from 0) argument.
    fn parse_arg(&self, text: &'a str, index: usize, context: ProbeContext) -> Parsed<FetchArg> {
        let named = text.contains('=');
        let (name, body) = match text.find('=') {
            Some(equals) => {
                let name = &text[..equals];
                if name.is_empty() {
                    return Err(self.err(text, SpecErrorKind::NoArgName));
                }
                if name.len() > MAX_ARG_NAME_LEN {
                    return Err(self.err(text, SpecErrorKind::ArgNameTooLong));
                }
                if !is_good_name(name, false) {
                    return Err(self.err(text, SpecErrorKind::BadArgName(name.to_owned())));
                }
                (name.to_owned(), &text[equals + 1..])
            }
            // Linux 6.5+ names an unnamed argument by its text when that is a name (a BTF
            // parameter: `count`), else by its position.
            None => {
                let before_type = text.split(':').next().unwrap_or(text);
                if text == "$arg*" {
                    ("$arg*".to_owned(), text)
                } else if is_good_name(before_type, false) {
                    (before_type.to_owned(), text)
                } else {
                    (format!("arg{}", index + 1), text)
                }
            }
        };
        if body.is_empty() {
            return Err(self.err(body, SpecErrorKind::NoArgBody));
        }
        // Checked before the recursive descent, which this bounds.
        if body.len() > MAX_ARG_BODY_LEN {
            return Err(self.err(body, SpecErrorKind::ArgTooLong));
        }
        if body == "$arg*" && name == "$arg*" {
            return Ok(FetchArg {
                name,
                expr: FetchExpr::AllArgs,
                ty: ArgType::X64,
                array_len: None,
                typed: false,
            });
        }
        let (expr_text, type_text) = match body.find(':') {
            Some(colon) => (&body[..colon], Some(&body[colon + 1..])),
            None => (body, None),
        };
        let (type_name, array_len) = match type_text {
            Some(t) => {
                let (name, len) = self.parse_array_suffix(t)?;
                (Some(name), len)
            }
            None => (None, None),
        };
        // $comm and immediate strings are strings, and nothing else (Linux's check is on
        // the text, before the fetch-arg is parsed).
        let is_comm = expr_text == "$comm" || expr_text == "$COMM" || expr_text.starts_with("\\\"");
        if is_comm && (array_len.is_some() || type_name.is_some_and(|t| t != "string")) {
            return Err(self.err(type_name.unwrap_or(body), SpecErrorKind::CommNotString));
        }
        // `$params` and `$vars` become one argument per variable, each named and typed
        // from DWARF: a name or type given here would have nothing to apply to.
        if context.at_source && (named || type_text.is_some()) {
            if let Some(list) = expr_text.strip_prefix('$').filter(|v| matches!(*v, "params" | "vars")) {
                let at = if named { text } else { type_text.unwrap_or(body) };
                return Err(self.err(at, SpecErrorKind::SourceVarsTakeNoNameOrType(list.to_owned())));
            }
        }
        let ty = match type_name {
            Some(t) => self.parse_type(t)?,
            None if is_comm => ArgType::String,
            None if expr_text == "$duration" => ArgType::U64,
            None => ArgType::X64,
        };
        let expr = match self.parse_expr(expr_text, context)? {
            // Linux 6.5+ reads an unnamed `$argN` argument as the Nth parameter, named
            // and typed from BTF when BTF knows the function's parameters, else as the
            // register or stack slot: which, is known once the kernel is.
            FetchExpr::Arg(n) if !named => FetchExpr::Btf(BtfRef {
                base: BtfBase::Arg(n),
                fields: Vec::new(),
            }),
            expr => expr,
        };
        let type_at = type_name.unwrap_or(body);
        let is_btf = matches!(expr, FetchExpr::Btf(_));
        // A BTF fetch-arg's type is checked against its BTF type once that is known.
        if !is_btf {
            self.check_type_fits(&expr, ty, array_len, type_at, body)?;
        }
        Ok(FetchArg {
            name,
            expr,
            ty,
            array_len,
            typed: is_btf && type_name.is_some(),
        })
    }

    /// Splits `TYPE[N]` into `TYPE` and N.
    fn parse_array_suffix(&self, text: &'a str) -> Parsed<(&'a str, Option<u32>)> {
        let Some(open) = text.find('[') else {
            return Ok((text, None));
        };
        let inside_and_rest = &text[open + 1..];
        let Some(close) = inside_and_rest.find(']') else {
            return Err(self.err(self.end_of(text), SpecErrorKind::ArrayNotClosed));
        };
        let after = &inside_and_rest[close + 1..];
        if !after.is_empty() {
            return Err(self.err(after, SpecErrorKind::JunkAfterArray(after.to_owned())));
        }
        let len_text = &inside_and_rest[..close];
        match parse_unsigned(len_text) {
            Some(n) if (1..=u64::from(MAX_ARRAY_LEN)).contains(&n) => Ok((&text[..open], Some(n as u32))),
            Some(1..) => Err(self.err(len_text, SpecErrorKind::ArrayTooBig(len_text.to_owned()))),
            _ => Err(self.err(len_text, SpecErrorKind::BadArrayLen(len_text.to_owned()))),
        }
    }

    fn parse_type(&self, text: &'a str) -> Parsed<ArgType> {
        if let Some(ty) = ArgType::from_plain_name(text) {
            return Ok(ty);
        }
        if let Some(spec) = text.strip_prefix('b') {
            // Linux first finds the type by the container size after `/`: without a good
            // one the type is unknown; with one, the rest must be a good bitfield.
            let container = spec.split_once('/').and_then(|(_, c)| parse_unsigned(c));
            if !matches!(container, Some(8 | 16 | 32 | 64)) {
                return Err(self.err(text, SpecErrorKind::UnknownType(text.to_owned())));
            }
            return parse_bitfield(spec).ok_or_else(|| self.err(text, SpecErrorKind::BadBitfield(text.to_owned())));
        }
        Err(self.err(text, SpecErrorKind::UnknownType(text.to_owned())))
    }

    /// The kernel's rules on which fetch-args may take which types, and its op budget.
    fn check_type_fits(
        &self,
        expr: &FetchExpr,
        ty: ArgType,
        array_len: Option<u32>,
        type_at: &'a str,
        body: &'a str,
    ) -> Parsed<()> {
        let reads_memory = matches!(
            expr,
            FetchExpr::Deref { .. } | FetchExpr::Memory(_) | FetchExpr::SymbolMemory { .. }
        );
        if ty.is_memory_string()
            && !(reads_memory
                || matches!(
                    expr,
                    FetchExpr::Immediate(_) | FetchExpr::Comm | FetchExpr::ImmString(_)
                ))
        {
            let name = if ty == ArgType::String { "string" } else { "ustring" };
            return Err(self.err(type_at, SpecErrorKind::StringNotOnMemory(name)));
        }
        if ty == ArgType::SymStr {
            let fits = match expr {
                FetchExpr::Deref { user, .. } => !user,
                FetchExpr::Register(_)
                | FetchExpr::StackEntry(_)
                | FetchExpr::Arg(_)
                | FetchExpr::Retval
                | FetchExpr::Memory(_)
                | FetchExpr::SymbolMemory { .. } => true,
                _ => false,
            };
            if !fits {
                return Err(self.err(type_at, SpecErrorKind::SymstrBadFetch));
            }
        }
        if array_len.is_some() && (ty == ArgType::SymStr || !(reads_memory || ty.is_memory_string())) {
            return Err(self.err(type_at, SpecErrorKind::ArrayNotOnMemory));
        }
        // Count the kernel's fetch instructions: the fetch itself, then a store op unless the
        // last deref becomes the store, then one each for a bitfield and an array loop.
        let store_needs_slot = if ty.is_memory_string() || ty == ArgType::SymStr {
            ty == ArgType::SymStr
                || matches!(
                    expr,
                    FetchExpr::Immediate(_) | FetchExpr::Comm | FetchExpr::ImmString(_)
                )
                || array_len.is_some()
        } else {
            !reads_memory
        };
        let ops = expr.fetch_op_count()
            + usize::from(store_needs_slot)
            + usize::from(matches!(ty, ArgType::Bitfield { .. }))
            + usize::from(array_len.is_some());
        if ops > MAX_FETCH_OPS {
            // Linux finds it out in the outermost dereference, after its `(`.
            let at = match expr {
                FetchExpr::Deref { .. } => body.find('(').map_or(body, |open| &body[open + 1..]),
                _ => body,
            };
            return Err(self.err(at, SpecErrorKind::TooManyFetchOps(ops)));
        }
        Ok(())
    }

    fn parse_expr(&self, text: &'a str, context: ProbeContext) -> Parsed<FetchExpr> {
        let Some(&first) = text.as_bytes().first() else {
            return Err(self.err(text, SpecErrorKind::NoArgBody));
        };
        match first {
            b'%' => {
                let name = &text[1..];
                Register::from_name(name).map(FetchExpr::Register).ok_or_else(|| {
                    self.err(
                        text,
                        SpecErrorKind::UnknownRegister {
                            name: name.to_owned(),
                            hint: register_hint(name),
                        },
                    )
                })
            }
            b'@' => self.parse_memory(text),
            b'$' => self.parse_variable(text, context),
            b'+' | b'-' => self.parse_deref(text, context),
            b'\\' => self.parse_immediate(text),
            b if b.is_ascii_alphabetic() || b == b'_' => {
                let name_len = text.find(['-', '.']).unwrap_or(text.len());
                self.parse_btf_ref(
                    text,
                    BtfBase::Param(text[..name_len].to_owned()),
                    &text[name_len..],
                    context,
                )
            }
            _ => Err(self.err(text, SpecErrorKind::BadFetchArg(text.to_owned()))),
        }
    }

    /// The `->`/`.` steps of a BTF fetch-arg after its base (`text` is the whole of it,
    /// `fields` its tail). Linux 6.5+ reads these only at a function entry.
    fn parse_btf_ref(&self, text: &'a str, base: BtfBase, fields: &'a str, context: ProbeContext) -> Parsed<FetchExpr> {
        let on_return = matches!(base, BtfBase::Retval);
        let dwarf_variable = context.at_source && matches!(base, BtfBase::Param(_));
        if !on_return && !context.at_function_entry && !dwarf_variable {
            return Err(self.err(text, SpecErrorKind::BtfArgNotOnEntry));
        }
        let mut steps = Vec::new();
        let mut rest = fields;
        while !rest.is_empty() {
            let (arrow, after) = if let Some(after) = rest.strip_prefix("->") {
                (true, after)
            } else if let Some(after) = rest.strip_prefix('.') {
                (false, after)
            } else {
                return Err(self.err(rest, SpecErrorKind::BadHyphen));
            };
            // A DWARF variable may be a struct in memory, whose members `.` reads.
            if steps.is_empty() && !arrow && !dwarf_variable {
                return Err(self.err(after, SpecErrorKind::DotOnParam));
            }
            let len = after.find(['-', '.']).unwrap_or(after.len());
            steps.push(BtfField {
                name: after[..len].to_owned(),
                arrow,
            });
            rest = &after[len..];
        }
        Ok(FetchExpr::Btf(BtfRef { base, fields: steps }))
    }

    /// `@ADDR` or `@SYM[+|-OFFS]`.
    fn parse_memory(&self, text: &'a str) -> Parsed<FetchExpr> {
        let spec = &text[1..];
        match spec.as_bytes().first() {
            Some(b) if b.is_ascii_digit() => parse_unsigned(spec)
                .map(|a| FetchExpr::Memory(Gva(a)))
                .ok_or_else(|| self.err(text, SpecErrorKind::BadMemoryAddress(spec.to_owned()))),
            Some(b'+') => Err(self.err(text, SpecErrorKind::FileOffsetOnKprobe)),
            _ => {
                let (name, offset) = match spec.find(['+', '-']) {
                    Some(sign) => {
                        let offset_text = &spec[sign..];
                        let offset = parse_signed(offset_text).ok_or_else(|| {
                            self.err(offset_text, SpecErrorKind::BadDerefOffset(offset_text.to_owned()))
                        })?;
                        (&spec[..sign], offset)
                    }
                    None => (spec, 0),
                };
                if !is_symbol_name(name) {
                    return Err(self.err(spec, SpecErrorKind::BadMemorySymbol(name.to_owned())));
                }
                Ok(FetchExpr::SymbolMemory {
                    name: name.to_owned(),
                    offset,
                })
            }
        }
    }

    /// `$stack`, `$stackN`, `$argN`, `$retval`, `$comm`.
    fn parse_variable(&self, text: &'a str, context: ProbeContext) -> Parsed<FetchExpr> {
        let name = &text[1..];
        if name == "arg*" {
            // Only as an argument of its own (see `parse_args`).
            return Err(self.err(text, SpecErrorKind::VarArgsNotAlone));
        }
        // `$argN->field`, `$retval->field`: BTF fields through the parameter's type.
        if let Some(sep) = name.find(['-', '.']) {
            let base = &name[..sep];
            let fields = &name[sep..];
            if base == "retval" {
                if !context.is_return {
                    return Err(self.err(text, SpecErrorKind::RetvalOnKprobe));
                }
                return self.parse_btf_ref(text, BtfBase::Retval, fields, context);
            }
            if let Some(number) = base.strip_prefix("arg").and_then(parse_decimal) {
                return match number {
                    1..=MAX_STACK_INDEX_U64 => self.parse_btf_ref(text, BtfBase::Arg(number as u32), fields, context),
                    _ => Err(self.err(text, SpecErrorKind::BadArgNumber(base[3..].to_owned()))),
                };
            }
        }
        match name {
            "params" | "vars" if !context.at_source => {
                return Err(self.err(text, SpecErrorKind::SourceVarsNotAtSource(name.to_owned())))
            }
            "params" => return Ok(FetchExpr::Params),
            "vars" => return Ok(FetchExpr::Vars),
            "retval" if context.is_return => return Ok(FetchExpr::Retval),
            "retval" => return Err(self.err(text, SpecErrorKind::RetvalOnKprobe)),
            "duration" if context.is_return => return Ok(FetchExpr::Duration),
            "duration" => return Err(self.err(text, SpecErrorKind::DurationOnKprobe)),
            "stack" => return Ok(FetchExpr::StackPointer),
            "comm" | "COMM" => return Ok(FetchExpr::Comm),
            _ => {}
        }
        if let Some(index_text) = name
            .strip_prefix("stack")
            .filter(|n| n.starts_with(|c: char| c.is_ascii_digit()))
        {
            return match parse_decimal(index_text) {
                Some(n) if n <= u64::from(MAX_STACK_INDEX) => Ok(FetchExpr::StackEntry(n as u32)),
                _ => Err(self.err(text, SpecErrorKind::BadStackIndex(index_text.to_owned()))),
            };
        }
        if let Some(number_text) = name.strip_prefix("arg").filter(|n| !n.is_empty()) {
            let number = parse_decimal(number_text)
                .ok_or_else(|| self.err(text, SpecErrorKind::UnknownVariable(name.to_owned())))?;
            // The kernel only knows $argN where a function is being entered (for a return
            // probe: saved at the entry, as Linux 6.9+ does).
            if !context.at_function_entry {
                return Err(self.err(text, SpecErrorKind::ArgNotOnEntry));
            }
            return match number {
                1..=MAX_STACK_INDEX_U64 => Ok(FetchExpr::Arg(number as u32)),
                _ => Err(self.err(text, SpecErrorKind::BadArgNumber(number_text.to_owned()))),
            };
        }
        Err(self.err(text, SpecErrorKind::UnknownVariable(name.to_owned())))
    }

    /// `+|-[u]OFFS(FETCHARG)`.
    fn parse_deref(&self, text: &'a str, context: ProbeContext) -> Parsed<FetchExpr> {
        let negative = text.starts_with('-');
        let after_sign = &text[1..];
        let (user, number_start) = match after_sign.strip_prefix('u') {
            Some(rest) => (true, rest),
            None => (false, after_sign),
        };
        let Some(open) = number_start.find('(') else {
            return Err(self.err(text, SpecErrorKind::DerefNeedsParen));
        };
        let offset_text = &number_start[..open];
        let magnitude = parse_unsigned(offset_text)
            .filter(|_| !offset_text.starts_with('+'))
            .and_then(|m| {
                if negative {
                    0i64.checked_sub_unsigned(m)
                } else {
                    i64::try_from(m).ok()
                }
            });
        let Some(offset) = magnitude else {
            return Err(self.err(text, SpecErrorKind::BadDerefOffset(offset_text.to_owned())));
        };
        let inner_and_rest = &number_start[open + 1..];
        // The innermost `(` pairs with the last `)`, as in the kernel (strrchr).
        let Some(close) = inner_and_rest.rfind(')') else {
            return Err(self.err(self.end_of(inner_and_rest), SpecErrorKind::DerefNotClosed));
        };
        let after = &inner_and_rest[close + 1..];
        if !after.is_empty() {
            return Err(self.err(after, SpecErrorKind::JunkAfterDeref(after.to_owned())));
        }
        let inner = &inner_and_rest[..close];
        let base = self.parse_expr(inner, context)?;
        if matches!(base, FetchExpr::Comm | FetchExpr::ImmString(_)) {
            return Err(self.err(inner, SpecErrorKind::CommDeref));
        }
        Ok(FetchExpr::Deref {
            offset,
            user,
            base: Box::new(base),
        })
    }

    /// `\IMM`: a number, with an optional sign as the kernel's `str_to_immediate` takes.
    fn parse_immediate(&self, text: &'a str) -> Parsed<FetchExpr> {
        let value_text = &text[1..];
        if let Some(quoted) = value_text.strip_prefix('"') {
            // The last character closes it: what is between is the string, `"`s and all.
            return match quoted.strip_suffix('"') {
                Some(string) => Ok(FetchExpr::ImmString(string.to_owned())),
                None => Err(self.err(self.end_of(text), SpecErrorKind::ImmStringNotClosed)),
            };
        }
        let value = match value_text.as_bytes().first() {
            Some(b) if b.is_ascii_digit() => parse_unsigned(value_text),
            Some(b'-' | b'+') => parse_signed(value_text).map(|v| v as u64),
            _ => None,
        };
        value
            .map(FetchExpr::Immediate)
            .ok_or_else(|| self.err(value_text, SpecErrorKind::BadImmediate(value_text.to_owned())))
    }
}

impl FetchExpr {
    /// How many kernel fetch instructions this compiles to (before the store).
    fn fetch_op_count(&self) -> usize {
        match self {
            // Symbol lookup, immediate address, load.
            FetchExpr::SymbolMemory { .. } => 3,
            // Immediate address, load.
            FetchExpr::Memory(_) => 2,
            FetchExpr::Deref { base, .. } => base.fetch_op_count() + 1,
            _ => 1,
        }
    }
}

/// The name the kernel gives an event the spec does not name: `p_SYM_OFFS`, `r_0xADDR`.
/// Empty for a wildcard: each function it matches gets its own (see [`Target::expand`]).
pub fn default_event_name(is_return: bool, target: &Target) -> String {
    event_name_of(if is_return { 'r' } else { 'p' }, target)
}

/// [`default_event_name`] for a probe of `kind` (`p`, `r`, or a watch's `w`).
fn event_name_of(kind: char, target: &Target) -> String {
    if target.is_wildcard() {
        return String::new();
    }
    let mut name = match target {
        Target::Symbol { name, offset } => format!("{kind}_{name}_{offset}"),
        // The kernel's name for `MOD:SYM` sanitizes the colon: `p_MOD_SYM_0`.
        Target::ModuleSymbol { module, name, offset } => format!("{kind}_{module}_{name}_{offset}"),
        // The kernel prints a hashed %p here; the real address is more useful and stable.
        Target::Address(address) => format!("{kind}_{:#x}", address.raw()),
        // perf probe's names: `FUNC_L12` for a line, `FUNC` for a function; a file's line
        // by the file's name (`read_write_L470`).
        Target::Source(point) => {
            let stem = || {
                let file = point.file.as_deref().unwrap_or_default();
                let base = file.rsplit('/').next().unwrap_or(file);
                base.split('.').next().unwrap_or(base).replace('-', "_")
            };
            let name = point.function.clone().unwrap_or_else(stem);
            let name = match (point.line, kind) {
                (Some(line), _) => format!("{name}_L{line}"),
                (None, 'r') => format!("{name}__return"),
                (None, _) => name,
            };
            // What an event name may hold (`[A-Za-z_][A-Za-z0-9_]*`), as perf probe makes
            // one of a file's name.
            let name: String = name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            match name.starts_with(|c: char| c.is_ascii_digit()) {
                true => format!("_{name}"),
                false => name,
            }
        }
    }
    .replace(['.', ':'], "_");
    // The kernel truncates to its buffer; names are ASCII, so this is on a char boundary.
    name.truncate(MAX_EVENT_NAME_LEN);
    name
}

/// The kernel's `is_good_name` (`[A-Za-z_][A-Za-z0-9_]*`); `dash_ok` adds `-` for groups.
fn is_good_name(name: &str, dash_ok: bool) -> bool {
    let ok = |c: u8| c.is_ascii_alphabetic() || c == b'_' || (dash_ok && c == b'-');
    match name.as_bytes().split_first() {
        Some((&first, rest)) => ok(first) && rest.iter().all(|&c| ok(c) || c.is_ascii_digit()),
        None => false,
    }
}

/// A kernel symbol name: `[A-Za-z_.][A-Za-z0-9_.]*` (`.` for `foo.isra.0`, `foo.cold`),
/// or a pattern over them (`*` any run of characters, `?` any one, `{a,b}` a list).
/// Whether a target's place names a source file (`fs/read_write.c`, `read_write.c`,
/// `include/linux/fs.h`) rather than a symbol or a uprobe's binary.
fn is_source_file(place: &str) -> bool {
    let name = place.rsplit('@').next().unwrap_or(place);
    [".c", ".h", ".S", ".rs"].iter().any(|ext| name.ends_with(ext))
}

/// A kernel module's name as the kernel keeps it: letters, digits and `_` (the file's `-`
/// becomes `_`), at most `MODULE_NAME_LEN` - 1 bytes.
fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MODULE_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn is_symbol_name(name: &str) -> bool {
    let ok = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'*' | b'?' | b'{' | b'}' | b',');
    let well_formed = !name.contains(['{', '}', ','])
        || brace_alternatives(name).is_some_and(|alts| alts.iter().all(|a| !a.is_empty() && !a.contains(',')));
    match name.as_bytes().split_first() {
        Some((&first, rest)) => !first.is_ascii_digit() && ok(first) && rest.iter().all(|&c| ok(c)) && well_formed,
        None => false,
    }
}

/// The kernel name of a register spelled the usual assembler way (`rax`, `eip`, `rflags`).
fn register_hint(name: &str) -> Option<&'static str> {
    let stripped = name.strip_prefix(['r', 'e'])?;
    Register::from_name(stripped).map(Register::name)
}

/// `b<width>@<offset>/<container bits>` after the `b`.
fn parse_bitfield(spec: &str) -> Option<ArgType> {
    let (width_text, rest) = spec.split_once('@')?;
    let (offset_text, container_text) = rest.split_once('/')?;
    let width = parse_unsigned(width_text)?;
    let offset = parse_unsigned(offset_text)?;
    let container_bits = parse_unsigned(container_text)?;
    if !matches!(container_bits, 8 | 16 | 32 | 64) || width == 0 || width.checked_add(offset)? > container_bits {
        return None;
    }
    // All three are at most 64 now.
    Some(ArgType::Bitfield {
        width: width as u8,
        offset: offset as u8,
        container_bits: container_bits as u8,
    })
}

/// A number as the kernel's `kstrtoul(s, 0)` reads it: `0x` hex, leading-`0` octal, else
/// decimal, an optional leading `+`, and nothing else.
fn parse_unsigned(text: &str) -> Option<u64> {
    let digits = text.strip_prefix('+').unwrap_or(text);
    let (radix, digits) = match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(hex) if hex.starts_with(|c: char| c.is_ascii_hexdigit()) => (16, hex),
        _ if digits.starts_with('0') => (8, digits),
        _ => (10, digits),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// A number as `kstrtol(s, 0)` reads it: [`parse_unsigned`] with an optional `-`.
fn parse_signed(text: &str) -> Option<i64> {
    match text.strip_prefix('-') {
        Some(magnitude) if !magnitude.starts_with('+') => 0i64.checked_sub_unsigned(parse_unsigned(magnitude)?),
        Some(_) => None,
        None => i64::try_from(parse_unsigned(text)?).ok(),
    }
}

/// Plain decimal digits (the kernel reads `$stackN` and `$argN` in base 10).
fn parse_decimal(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

impl fmt::Display for ProbeSpec {
    /// The canonical `kprobe_events` line: group, event and argument names always spelled
    /// out, as the kernel lists them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let args = match self {
            ProbeSpec::Kprobe {
                group,
                event,
                target,
                args,
            } => {
                write!(f, "p:{group}/{event} {target}")?;
                args
            }
            ProbeSpec::Kretprobe {
                group,
                event,
                target,
                maxactive,
                args,
            } => {
                f.write_str("r")?;
                if let Some(n) = maxactive {
                    write!(f, "{n}")?;
                }
                write!(f, ":{group}/{event} {target}")?;
                args
            }
            ProbeSpec::Watch {
                group,
                event,
                target,
                access,
                len,
                args,
            } => {
                write!(f, "w:{group}/{event} {target}/{len}:{access}")?;
                args
            }
            ProbeSpec::Remove { group, event } => {
                f.write_str("-:")?;
                if let Some(group) = group {
                    write!(f, "{group}/")?;
                }
                return f.write_str(event);
            }
        };
        for arg in args {
            write!(f, " {arg}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Symbol { name, offset: 0 } => f.write_str(name),
            Target::Symbol { name, offset } => write!(f, "{name}+{}", Number(*offset)),
            Target::Address(address) => write!(f, "{}", Number(address.raw())),
            Target::ModuleSymbol {
                module,
                name,
                offset: 0,
            } => write!(f, "{module}:{name}"),
            Target::ModuleSymbol { module, name, offset } => write!(f, "{module}:{name}+{}", Number(*offset)),
            Target::Source(point) => write!(f, "{point}"),
        }
    }
}

impl fmt::Display for SourcePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(module) = &self.module {
            write!(f, "{module}:")?;
        }
        match (&self.function, &self.file) {
            (Some(function), Some(file)) => write!(f, "{function}@{file}")?,
            (Some(function), None) => f.write_str(function)?,
            (None, Some(file)) => f.write_str(file)?,
            (None, None) => {}
        }
        match self.line {
            Some(line) => write!(f, ":{line}"),
            None => Ok(()),
        }
    }
}

impl fmt::Display for BtfRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.base {
            BtfBase::Param(name) => f.write_str(name)?,
            BtfBase::Arg(n) => write!(f, "$arg{n}")?,
            BtfBase::Retval => f.write_str("$retval")?,
        }
        for field in &self.fields {
            let sep = if field.arrow { "->" } else { "." };
            write!(f, "{sep}{}", field.name)?;
        }
        Ok(())
    }
}

impl fmt::Display for FetchArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.expr {
            FetchExpr::AllArgs => return f.write_str("$arg*"),
            FetchExpr::Params => return f.write_str("$params"),
            FetchExpr::Vars => return f.write_str("$vars"),
            // Unnamed, as it was written: a name would make it the plain register.
            FetchExpr::Btf(BtfRef {
                base: BtfBase::Arg(_),
                fields,
            }) if fields.is_empty() => write!(f, "{}", self.expr)?,
            // Only a name taken from a BTF parameter can be this long, and written as
            // `NAME=` it would be refused: unnamed, the parameter names it again.
            _ if self.name.len() > MAX_ARG_NAME_LEN => write!(f, "{}", self.expr)?,
            _ => write!(f, "{}={}", self.name, self.expr)?,
        }
        // The default type is left out so that the text never outgrows the kernel's
        // 63-character limit when the input fit in it.
        let default_type = match self.expr {
            FetchExpr::Comm | FetchExpr::ImmString(_) => ArgType::String,
            FetchExpr::Duration => ArgType::U64,
            _ => ArgType::X64,
        };
        let btf = matches!(self.expr, FetchExpr::Btf(_));
        if (btf && self.typed) || (!btf && self.ty != default_type) || self.array_len.is_some() {
            write!(f, ":{}", self.ty)?;
        }
        if let Some(n) = self.array_len {
            write!(f, "[{n}]")?;
        }
        Ok(())
    }
}

impl fmt::Display for FetchExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchExpr::Register(r) => write!(f, "%{r}"),
            FetchExpr::Memory(address) => write!(f, "@{}", Number(address.raw())),
            FetchExpr::SymbolMemory { name, offset: 0 } => write!(f, "@{name}"),
            FetchExpr::SymbolMemory { name, offset } => write!(f, "@{name}{}", SignedNumber(*offset)),
            FetchExpr::StackEntry(n) => write!(f, "$stack{n}"),
            FetchExpr::StackPointer => f.write_str("$stack"),
            FetchExpr::Arg(n) => write!(f, "$arg{n}"),
            FetchExpr::Retval => f.write_str("$retval"),
            FetchExpr::Duration => f.write_str("$duration"),
            FetchExpr::Comm => f.write_str("$comm"),
            // Shown signed, as it was most likely written (`\\-1`), and shorter that way.
            FetchExpr::Immediate(value) => match *value as i64 {
                v if v < 0 => write!(f, "\\{}", SignedNumber(v)),
                _ => write!(f, "\\{}", Number(*value)),
            },
            FetchExpr::Deref { offset, user, base } => {
                let sign = if *offset < 0 { '-' } else { '+' };
                let user = if *user { "u" } else { "" };
                write!(f, "{sign}{user}{}({base})", Number(offset.unsigned_abs()))
            }
            FetchExpr::ImmString(text) => write!(f, "\\\"{text}\""),
            FetchExpr::Btf(r) => write!(f, "{r}"),
            FetchExpr::AllArgs => f.write_str("$arg*"),
            FetchExpr::Params => f.write_str("$params"),
            FetchExpr::Vars => f.write_str("$vars"),
        }
    }
}

/// A number in its shorter spelling, decimal or `0x` hex: never longer than any spelling
/// the parser accepts, so displayed fetch-args stay within the kernel's length limit.
struct Number(u64);

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let decimal = self.0.to_string();
        let hex = format!("{:#x}", self.0);
        f.write_str(if hex.len() < decimal.len() { &hex } else { &decimal })
    }
}

/// A signed [`Number`], always with its sign (`+8`, `-0x10`).
struct SignedNumber(i64);

impl fmt::Display for SignedNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { '-' } else { '+' };
        write!(f, "{sign}{}", Number(self.0.unsigned_abs()))
    }
}

impl fmt::Display for ArgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ArgType::U8 => "u8",
            ArgType::U16 => "u16",
            ArgType::U32 => "u32",
            ArgType::U64 => "u64",
            ArgType::S8 => "s8",
            ArgType::S16 => "s16",
            ArgType::S32 => "s32",
            ArgType::S64 => "s64",
            ArgType::X8 => "x8",
            ArgType::X16 => "x16",
            ArgType::X32 => "x32",
            ArgType::X64 => "x64",
            ArgType::String => "string",
            ArgType::UString => "ustring",
            ArgType::Symbol => "symbol",
            ArgType::SymStr => "symstr",
            ArgType::Char => "char",
            ArgType::Bitfield {
                width,
                offset,
                container_bits,
            } => {
                return write!(f, "b{width}@{offset}/{container_bits}");
            }
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod conformance;
