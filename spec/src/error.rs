//! The error catalogue: what is wrong with a spec line, the code of Linux's probe parser that
//! refuses the same thing, and where on the line.

use super::*;

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
