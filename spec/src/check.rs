//! What of a parsed spec line needs the kernel: that its function exists (once), that an
//! offset into it is an instruction boundary, that every `@SYM` of its fetch-args exists,
//! and its BTF fetch-args (parameter names, `$arg*`, `->` fields), resolved into the plain
//! fetches the engine runs, typed as Linux 6.5+ types them.
//!
//! Before the guest boots, the kernel is known from its files (System.map, the vmlinux's
//! symbols, text and `.BTF` section); once it is up, from its memory. Errors carry
//! Linux's column, as the parser's do: Linux only finds these when it registers the probe,
//! so its error log points at the probe point (`BAD_PROBE_ADDR`) for a missing `@SYM`;
//! hvprobe points at the `@SYM` itself and calls it `BAD_MEM_ADDR` (see
//! [`SpecErrorKind::linux_error`]).

use hvprobe_arch::Gva;
use hvprobe_introspection::btf::{Btf, BtfType, Kind, TypeData, TypeId};
use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::symbols::{Symbol, SymbolTable};

use super::{
    is_good_name, ArgType, BtfBase, BtfRef, FetchArg, FetchExpr, LineParser, ProbeSpec, SpecError, SpecErrorKind,
    SplitInstruction, Target, MAX_ARGS,
};

/// The longest function decoded to check an instruction boundary (as the engine does).
const MAX_FUNCTION_BYTES: u64 = 256 << 10;

/// What is known of the kernel's BTF.
#[derive(Clone, Copy)]
pub enum BtfKnowledge<'a> {
    /// Not known yet (before boot, without a vmlinux): BTF fetch-args wait for the guest.
    Unknown,
    /// The kernel has none: BTF fetch-args are refused, as Linux refuses them.
    Absent,
    Known(&'a Btf),
}

/// The kernel a spec is checked against.
#[derive(Clone, Copy)]
pub struct Kernel<'a> {
    pub symbols: &'a SymbolTable,
    /// Its memory (the vmlinux file's segments, before boot), to check instruction
    /// boundaries in its text; `None` leaves them to the engine.
    pub text: Option<&'a dyn GuestVirtRead>,
    pub btf: BtfKnowledge<'a>,
}

/// Checks a parsed spec line against the kernel, and resolves its BTF fetch-args if the
/// BTF is known: the spec to arm, or the first problem at Linux's column of `line` (the
/// text `spec` was parsed from; `number` and `file` as for [`SpecError`]). A wildcard
/// target is checked per function once expanded (see [`resolve_btf_args`]).
pub fn check_spec(
    line: &str,
    number: usize,
    file: Option<&str>,
    spec: &ProbeSpec,
    kernel: &Kernel,
) -> Result<ProbeSpec, SpecError> {
    let located = |token: usize, at: usize, kind: SpecErrorKind| {
        let tokens = tokens(line);
        let byte = tokens
            .get(token)
            .map_or(line.len(), |&(start, t)| start + at.min(t.len()));
        SpecError {
            file: file.map(str::to_owned),
            line: number,
            column: line[..byte.min(line.len())].chars().count() + 1,
            kind,
        }
    };
    let (target, args) = match spec {
        ProbeSpec::Kprobe { target, args, .. } | ProbeSpec::Kretprobe { target, args, .. } => (target, args),
        // A watch's symbol may be data; its instruction and alignment are checked when it
        // is placed, its fetch-args read registers and memory as they are at the hit.
        ProbeSpec::Watch { target, args, .. } => {
            if let Target::Symbol { name, .. } = target {
                if kernel.symbols.lookup_all(name).next().is_none() {
                    return Err(located(1, 0, SpecErrorKind::UnknownProbeSymbol(name.clone())));
                }
            }
            for (i, arg) in args.iter().enumerate() {
                if let Some(name) = unknown_data_symbol(&arg.expr, kernel.symbols) {
                    let token = tokens(line).get(i + 2).map_or("", |t| t.1);
                    let at = token.find(&format!("@{name}")).unwrap_or(0);
                    return Err(located(i + 2, at, SpecErrorKind::UnknownDataSymbol(name.to_owned())));
                }
            }
            return Ok(spec.clone());
        }
        ProbeSpec::Remove { .. } => return Ok(spec.clone()),
    };
    let function = match target {
        Target::Symbol { name, offset } if !super::is_wildcard_pattern(name) => {
            let symbol = function_symbol(kernel.symbols, name, *offset).map_err(|kind| located(1, 0, kind))?;
            if *offset > 0 {
                if let Some(text) = kernel.text {
                    check_boundary(kernel.symbols, text, symbol, name, *offset).map_err(|kind| located(1, 0, kind))?;
                }
            }
            Some(name.as_str())
        }
        _ => None,
    };
    for (i, arg) in args.iter().enumerate() {
        if let Some(name) = unknown_data_symbol(&arg.expr, kernel.symbols) {
            let token = tokens(line).get(i + 2).map_or("", |t| t.1);
            let at = token.find(&format!("@{name}")).unwrap_or(0);
            return Err(located(i + 2, at, SpecErrorKind::UnknownDataSymbol(name.to_owned())));
        }
    }
    let btf = match kernel.btf {
        BtfKnowledge::Known(btf) => Some(btf),
        BtfKnowledge::Absent => None,
        BtfKnowledge::Unknown => return Ok(spec.clone()),
    };
    let Some(function) = function else {
        return Ok(spec.clone());
    };
    if let Some(e) = btf.and_then(|b| void_retval(function, args, b)) {
        return Err(locate_btf_error(line, number, file, args, e));
    }
    let resolved = resolve_btf_args(function, args, btf).map_err(|e| locate_btf_error(line, number, file, args, e))?;
    let mut spec = spec.clone();
    if let ProbeSpec::Kprobe { args, .. } | ProbeSpec::Kretprobe { args, .. } = &mut spec {
        *args = resolved;
    }
    Ok(spec)
}

/// A BTF fetch-arg's error at Linux's column of `line`, the text `args` were parsed from
/// (`number` and `file` as for [`SpecError`]).
pub fn locate_btf_error(line: &str, number: usize, file: Option<&str>, args: &[FetchArg], e: BtfArgError) -> SpecError {
    let tokens = tokens(line);
    let token_index = e.arg + 2;
    let (start, token) = tokens.get(token_index).copied().unwrap_or((line.len(), ""));
    let body_start = args
        .get(e.arg)
        .and_then(|a| token.strip_prefix(a.name.as_str()))
        .filter(|rest| rest.starts_with('='))
        .map_or(0, |_| args[e.arg].name.len() + 1);
    // The parser's type rules point at the type, as Linux does.
    let type_rule = matches!(
        e.kind,
        SpecErrorKind::StringNotOnMemory(_) | SpecErrorKind::ArrayNotOnMemory | SpecErrorKind::SymstrBadFetch
    );
    let at = match token[body_start.min(token.len())..].find(':') {
        Some(colon) if type_rule => colon + 1,
        _ => e.at,
    };
    let byte = (start + (body_start + at).min(token.len())).min(line.len());
    SpecError {
        file: file.map(str::to_owned),
        line: number,
        column: line[..byte].chars().count() + 1,
        kind: e.kind,
    }
}

/// The whitespace-separated tokens of a line (before any `#`), with their byte offsets:
/// the parser's split, so token 1 is the target and token 2 + i the ith fetch-arg.
fn tokens(line: &str) -> Vec<(usize, &str)> {
    let code = line.find('#').map_or(line, |hash| &line[..hash]);
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in code.char_indices() {
        let blank = matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r');
        match (blank, start) {
            (true, Some(s)) => {
                out.push((s, &code[s..i]));
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((s, &code[s..]));
    }
    out
}

/// The one function `name` names, with `offset` inside it.
fn function_symbol<'s>(symbols: &'s SymbolTable, name: &str, offset: u64) -> Result<&'s Symbol, SpecErrorKind> {
    let matches: Vec<&Symbol> = symbols.lookup_all(name).filter(|s| s.is_text()).collect();
    let symbol = match matches.as_slice() {
        [] => return Err(SpecErrorKind::UnknownProbeSymbol(name.to_owned())),
        [one] => *one,
        many => {
            return Err(SpecErrorKind::NotUniqueSymbol {
                name: name.to_owned(),
                count: many.len(),
            })
        }
    };
    let size = symbols.size_of(symbol).unwrap_or(0);
    if offset >= size.max(1) {
        return Err(SpecErrorKind::OffsetBeyondFunction {
            what: format!("{name}+{offset:#x}"),
            function: name.to_owned(),
            size,
        });
    }
    Ok(symbol)
}

/// Refuses `SYM+offset` when it splits an instruction of the function's text. Text that
/// can not be read or decoded says nothing (the engine checks again on the live kernel).
fn check_boundary(
    symbols: &SymbolTable,
    text: &dyn GuestVirtRead,
    symbol: &Symbol,
    name: &str,
    offset: u64,
) -> Result<(), SpecErrorKind> {
    let size = symbols.size_of(symbol).unwrap_or(0).min(MAX_FUNCTION_BYTES);
    let mut code = vec![0u8; size as usize];
    if text.read_virt(symbol.addr, &mut code).is_err() {
        return Ok(());
    }
    let address = Gva(symbol.addr.0 + offset);
    let Ok(starts) = hvprobe_insn::instruction_starts_through(&code, symbol.addr, address) else {
        return Ok(());
    };
    if starts.binary_search(&address).is_err() {
        let show = |a: &Gva| format!("{name}+{:#x}", a.0 - symbol.addr.0);
        let i = starts.partition_point(|a| *a < address);
        return Err(SpecErrorKind::NotInstructionBoundary(Box::new(SplitInstruction {
            what: format!("{name}+{offset:#x}"),
            function: name.to_owned(),
            before: i
                .checked_sub(1)
                .and_then(|j| starts.get(j))
                .map_or_else(|| "the start".to_owned(), show),
            after: starts.get(i).map_or_else(|| "the end".to_owned(), show),
        })));
    }
    Ok(())
}

/// The first fetch-arg (its index) with an `@SYM` the kernel has no symbol for, and that
/// name: a probe with one would only ever record faults.
pub fn unknown_fetch_symbol<'a>(args: &'a [FetchArg], symbols: &SymbolTable) -> Option<(usize, &'a str)> {
    args.iter()
        .enumerate()
        .find_map(|(i, a)| unknown_data_symbol(&a.expr, symbols).map(|name| (i, name)))
}

/// The first `@SYM` of `expr` the kernel has no symbol for.
fn unknown_data_symbol<'e>(expr: &'e FetchExpr, symbols: &SymbolTable) -> Option<&'e str> {
    match expr {
        FetchExpr::SymbolMemory { name, .. } if symbols.lookup(name).is_none() => Some(name),
        FetchExpr::Deref { base, .. } => unknown_data_symbol(base, symbols),
        _ => None,
    }
}

/// A BTF fetch-arg that can not be resolved: which argument, where in its body (after
/// `NAME=`, in bytes), and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("argument {}: {kind}", .arg + 1)]
pub struct BtfArgError {
    pub arg: usize,
    pub at: usize,
    pub kind: SpecErrorKind,
}

/// A `$retval` of a function BTF says returns `void` (Linux 6.5+ reads `$retval` through
/// BTF too, and refuses it there).
pub fn void_retval(function: &str, args: &[FetchArg], btf: &Btf) -> Option<BtfArgError> {
    let proto = FuncProto::find(btf, function)?;
    let arg = args
        .iter()
        .position(|a| a.expr == FetchExpr::Retval && proto.returns == 0)?;
    Some(BtfArgError {
        arg,
        at: 0,
        kind: SpecErrorKind::NoRetval(function.to_owned()),
    })
}

/// Whether any fetch-arg needs BTF.
pub fn has_btf_args(args: &[FetchArg]) -> bool {
    args.iter()
        .any(|a| matches!(a.expr, FetchExpr::Btf(_) | FetchExpr::AllArgs))
}

/// The fetch-args of a probe on `function`'s entry (or return, for `$retval->`) with every
/// BTF fetch-arg resolved against `btf` (`None`: the kernel has no BTF): `$arg*` becomes
/// one argument per parameter, named after it; a parameter becomes its register or stack
/// slot, each `->` a dereference at the field's offset, `.` adding the member's offset;
/// the type is the one given, else BTF's as Linux maps it (signed and unsigned integers by
/// size, enums `s32`/`s64`, pointers and the rest `x64`, bitfields as bitfields);
/// `:string` reads the string a `char *` points to, or a `char[]` member in place.
pub fn resolve_btf_args(function: &str, args: &[FetchArg], btf: Option<&Btf>) -> Result<Vec<FetchArg>, BtfArgError> {
    if !has_btf_args(args) {
        return Ok(args.to_vec());
    }
    let fail = |arg: usize, at: usize, kind: SpecErrorKind| BtfArgError { arg, at, kind };
    let mut out: Vec<FetchArg> = Vec::with_capacity(args.len());
    // Which original argument each output one came from (for errors after expansion).
    let mut origin: Vec<usize> = Vec::with_capacity(args.len());
    for (i, arg) in args.iter().enumerate() {
        let (FetchExpr::Btf(_) | FetchExpr::AllArgs) = &arg.expr else {
            out.push(arg.clone());
            origin.push(i);
            continue;
        };
        if let FetchExpr::Btf(BtfRef {
            base: BtfBase::Arg(n),
            fields,
        }) = &arg.expr
        {
            if fields.is_empty() {
                let resolved = resolve_plain_arg(function, arg, *n, btf).map_err(|(at, k)| fail(i, at, k))?;
                check_resolved_type(&resolved).map_err(|k| fail(i, 0, k))?;
                out.push(resolved);
                origin.push(i);
                continue;
            }
        }
        let Some(btf) = btf else {
            return Err(fail(i, 0, SpecErrorKind::NoBtf));
        };
        let proto =
            FuncProto::find(btf, function).ok_or_else(|| fail(i, 0, SpecErrorKind::NoBtfEntry(function.into())))?;
        match &arg.expr {
            FetchExpr::AllArgs => {
                if proto.params.is_empty() {
                    return Err(fail(i, 0, SpecErrorKind::NoBtfEntry(function.into())));
                }
                for param in &proto.params {
                    if param.name.is_empty() || !is_good_name(&param.name, false) {
                        return Err(fail(i, 0, SpecErrorKind::NoBtfEntry(function.into())));
                    }
                    let r = BtfRef {
                        base: BtfBase::Param(param.name.clone()),
                        fields: Vec::new(),
                    };
                    let (expr, ty) = resolve_ref(btf, &proto, &r, None, function).map_err(|(_, k)| fail(i, 0, k))?;
                    out.push(FetchArg {
                        name: param.name.clone(),
                        expr,
                        ty,
                        array_len: None,
                        typed: false,
                    });
                    origin.push(i);
                }
            }
            FetchExpr::Btf(r) => {
                let given = arg.typed.then_some(arg.ty);
                let (expr, ty) = resolve_ref(btf, &proto, r, given, function).map_err(|(at, k)| fail(i, at, k))?;
                let resolved = FetchArg {
                    name: arg.name.clone(),
                    expr,
                    ty,
                    array_len: arg.array_len,
                    typed: false,
                };
                check_resolved_type(&resolved).map_err(|k| fail(i, 0, k))?;
                out.push(resolved);
                origin.push(i);
            }
            _ => unreachable!("only BTF fetch-args get here"),
        }
    }
    if out.len() > MAX_ARGS {
        let i = origin.get(MAX_ARGS).copied().unwrap_or(0);
        return Err(fail(i, 0, SpecErrorKind::TooManyArgs));
    }
    for (j, arg) in out.iter().enumerate() {
        if out[..j].iter().any(|a| a.name == arg.name) {
            return Err(fail(origin[j], 0, SpecErrorKind::DuplicateArgName(arg.name.clone())));
        }
    }
    Ok(out)
}

/// An unnamed `$argN` as Linux 6.5+ reads it: the Nth parameter, named after it and typed
/// from BTF, when BTF knows the function's parameters; else the register or stack slot
/// (`argI`, `x64` unless typed), as before BTF arguments.
fn resolve_plain_arg(function: &str, arg: &FetchArg, n: u32, btf: Option<&Btf>) -> Result<FetchArg, Failed> {
    let proto = btf
        .and_then(|b| FuncProto::find(b, function).map(|p| (b, p)))
        .filter(|(_, p)| !p.params.is_empty());
    let Some((btf, proto)) = proto else {
        return Ok(FetchArg {
            expr: FetchExpr::Arg(n),
            typed: false,
            ..arg.clone()
        });
    };
    let param = proto.params.get(n as usize - 1).ok_or_else(|| {
        (
            0,
            SpecErrorKind::NoSuchParam {
                name: format!("$arg{n}"),
                function: function.to_owned(),
            },
        )
    })?;
    let name = if is_good_name(&param.name, false) {
        param.name.clone()
    } else {
        arg.name.clone()
    };
    let r = BtfRef {
        base: BtfBase::Arg(n),
        fields: Vec::new(),
    };
    let (expr, ty) = resolve_ref(btf, &proto, &r, arg.typed.then_some(arg.ty), function)?;
    Ok(FetchArg {
        name,
        expr,
        ty,
        array_len: arg.array_len,
        typed: false,
    })
}

/// The parser's type rules, on a resolved BTF fetch-arg (a type given to a parameter may
/// not fit what it became: `count:string`).
fn check_resolved_type(arg: &FetchArg) -> Result<(), SpecErrorKind> {
    let parser = LineParser { line: "" };
    parser
        .check_type_fits(&arg.expr, arg.ty, arg.array_len, "", "")
        .map_err(|e| e.kind)
}

/// A parameter of a function, from BTF.
struct ProtoParam {
    name: String,
    type_id: TypeId,
}

/// A function's prototype: its parameters and return type (0: void).
struct FuncProto {
    params: Vec<ProtoParam>,
    returns: TypeId,
}

impl FuncProto {
    /// The prototype of the BTF `FUNC` named `function`.
    fn find(btf: &Btf, function: &str) -> Option<FuncProto> {
        let func = btf.find_type(function, Kind::Func)?;
        let proto_id = btf.type_by_id(func).ok()?.size_or_type;
        let proto = btf.type_by_id(proto_id).ok()?;
        let TypeData::Params(params) = &proto.data else {
            return None;
        };
        let params = params
            .iter()
            // A trailing `...` is a parameter with no name and no type.
            .filter(|p| !(p.name_off == 0 && p.type_id == 0))
            .map(|p| ProtoParam {
                name: btf.string(p.name_off).unwrap_or("").to_owned(),
                type_id: p.type_id,
            })
            .collect();
        Some(FuncProto {
            params,
            returns: proto.size_or_type,
        })
    }
}

/// A resolution failure: where in the fetch-arg's body (bytes) and why.
type Failed = (usize, SpecErrorKind);

/// Follows typedefs and qualifiers to the type itself; `None` for void.
fn real_type(btf: &Btf, id: TypeId) -> Result<Option<(TypeId, &BtfType)>, SpecErrorKind> {
    let id = btf.resolve(id).map_err(|e| SpecErrorKind::BadBtfType(e.to_string()))?;
    if id == 0 {
        return Ok(None);
    }
    let t = btf
        .type_by_id(id)
        .map_err(|e| SpecErrorKind::BadBtfType(e.to_string()))?;
    Ok(Some((id, t)))
}

/// Resolves one BTF reference into a plain fetch and its type (`given`: the spec's).
fn resolve_ref(
    btf: &Btf,
    proto: &FuncProto,
    r: &BtfRef,
    given: Option<ArgType>,
    function: &str,
) -> Result<(FetchExpr, ArgType), Failed> {
    let (mut expr, base_type, base_len) = match &r.base {
        BtfBase::Param(name) => {
            let index = proto.params.iter().position(|p| p.name == *name).ok_or_else(|| {
                (
                    0,
                    SpecErrorKind::NoSuchParam {
                        name: name.clone(),
                        function: function.to_owned(),
                    },
                )
            })?;
            (
                FetchExpr::Arg(index as u32 + 1),
                proto.params[index].type_id,
                name.len(),
            )
        }
        BtfBase::Arg(n) => {
            let param = proto.params.get(*n as usize - 1).ok_or_else(|| {
                (
                    0,
                    SpecErrorKind::NoSuchParam {
                        name: format!("$arg{n}"),
                        function: function.to_owned(),
                    },
                )
            })?;
            (FetchExpr::Arg(*n), param.type_id, format!("$arg{n}").len())
        }
        BtfBase::Retval => {
            if proto.returns == 0 {
                return Err((0, SpecErrorKind::NoRetval(function.to_owned())));
            }
            (FetchExpr::Retval, proto.returns, "$retval".len())
        }
    };
    let mut current = base_type;
    let mut bit_offset = 0u64;
    let mut bit_size = 0u32;
    // Where the text of the step being resolved starts, for errors.
    let mut at = base_len;
    let mut i = 0;
    while i < r.fields.len() {
        // One `->` and the `.` steps after it: one read at the summed offset. Linux
        // points at the field name after the `->` when what is before is no pointer.
        let field_at = at + 2;
        let (_, ptr) = real_type(btf, current)
            .map_err(|k| (field_at, k))?
            .ok_or((field_at, not_ptr(r, i)))?;
        if ptr.kind != Kind::Ptr {
            return Err((field_at, not_ptr(r, i)));
        }
        let mut container = ptr.size_or_type;
        let mut bits = 0u64;
        loop {
            let field = &r.fields[i];
            let sep = if field.arrow { 2 } else { 1 };
            let (cid, ct) = real_type(btf, container)
                .map_err(|k| (at + sep, k))?
                .ok_or((at + sep, not_ptr(r, i)))?;
            if !matches!(ct.kind, Kind::Struct | Kind::Union) {
                return Err((at + sep, not_ptr(r, i)));
            }
            let container_name = btf.type_name(cid).unwrap_or("").to_owned();
            let member = btf.member_path(cid, &container_name, &field.name).map_err(|_| {
                (
                    at + sep,
                    SpecErrorKind::NoSuchField {
                        field: field.name.clone(),
                        container: if container_name.is_empty() {
                            "an anonymous struct".to_owned()
                        } else {
                            format!("struct {container_name}")
                        },
                    },
                )
            })?;
            bits += member.bit_offset;
            bit_size = u32::from(member.bitfield_size);
            container = member.type_id;
            at += sep + field.name.len();
            i += 1;
            if i == r.fields.len() || r.fields[i].arrow {
                break;
            }
        }
        expr = FetchExpr::Deref {
            offset: (bits / 8) as i64,
            user: false,
            base: Box::new(expr),
        };
        bit_offset = bits % 8;
        current = container;
    }
    // Linux points at the fetch-arg when its parameter's own type is bad.
    let last = real_type(btf, current).map_err(|k| (if r.fields.is_empty() { 0 } else { at }, k))?;
    let ty = match given {
        Some(ArgType::String | ArgType::UString) => {
            let Some((_, t)) = last else {
                return Err((0, SpecErrorKind::BadTypeForString(r.to_string())));
            };
            if is_char_array(btf, t) {
                if matches!(expr, FetchExpr::Deref { .. }) {
                    return Ok((expr, given.unwrap_or(ArgType::String)));
                }
                return Err((0, SpecErrorKind::BadTypeForString(r.to_string())));
            }
            if is_char_pointer(btf, t) {
                // The string is where the pointer points.
                expr = FetchExpr::Deref {
                    offset: 0,
                    user: given == Some(ArgType::UString),
                    base: Box::new(expr),
                };
                return Ok((expr, given.unwrap_or(ArgType::String)));
            }
            return Err((0, SpecErrorKind::BadTypeForString(r.to_string())));
        }
        Some(ty) => ty,
        None => {
            let (ty, int_bits) = btf_fetch_type(last.map(|(_, t)| t));
            // A bitfield: its width from the member (kind_flag) or its INT type.
            let width = if bit_size != 0 { bit_size } else { int_bits.unwrap_or(0) };
            if (width != 0 && width % 8 != 0) || bit_offset != 0 {
                // A whole value at an odd bit offset: the width of its type.
                let width = if width == 0 { ty.record_size() * 8 } else { width };
                ArgType::Bitfield {
                    width: width.min(64) as u8,
                    offset: bit_offset as u8,
                    container_bits: 64,
                }
            } else {
                ty
            }
        }
    };
    Ok((expr, ty))
}

fn not_ptr(r: &BtfRef, step: usize) -> SpecErrorKind {
    let mut shown = BtfRef {
        base: r.base.clone(),
        fields: r.fields[..step].to_vec(),
    }
    .to_string();
    if shown.is_empty() {
        shown = r.to_string();
    }
    SpecErrorKind::NotPointerToStruct(shown)
}

/// Linux's type for a BTF type shown without one given (`fetch_type_from_btf_type`), and
/// for an INT of a size that is not a whole number of bytes, its width in bits.
fn btf_fetch_type(t: Option<&BtfType>) -> (ArgType, Option<u32>) {
    let Some(t) = t else {
        return (ArgType::X64, None);
    };
    match (&t.kind, &t.data) {
        (Kind::Enum, _) => (ArgType::S32, None),
        (Kind::Enum64, _) => (ArgType::S64, None),
        (Kind::Int, TypeData::Int { encoding, bits, .. }) => {
            let signed = encoding & 1 != 0;
            match (signed, bits) {
                (true, 8) => (ArgType::S8, None),
                (true, 16) => (ArgType::S16, None),
                (true, 32) => (ArgType::S32, None),
                (true, 64) => (ArgType::S64, None),
                (false, 8) => (ArgType::U8, None),
                (false, 16) => (ArgType::U16, None),
                (false, 32) => (ArgType::U32, None),
                (false, 64) => (ArgType::U64, None),
                (_, bits) => (ArgType::U64, Some(u32::from(*bits))),
            }
        }
        // Pointers, and what Linux has no type for (structs, arrays, floats).
        _ => (ArgType::X64, None),
    }
}

/// An unsigned 8-bit INT (Linux's test for a string's `char`).
fn is_char(btf: &Btf, id: TypeId) -> bool {
    matches!(
        real_type(btf, id),
        Ok(Some((_, BtfType { kind: Kind::Int, data: TypeData::Int { encoding, bits: 8, .. }, .. }))) if encoding & 1 == 0
    )
}

fn is_char_pointer(btf: &Btf, t: &BtfType) -> bool {
    t.kind == Kind::Ptr && is_char(btf, t.size_or_type)
}

fn is_char_array(btf: &Btf, t: &BtfType) -> bool {
    matches!(&t.data, TypeData::Array { elem_type, .. } if t.kind == Kind::Array && is_char(btf, *elem_type))
}

#[cfg(test)]
mod tests;
