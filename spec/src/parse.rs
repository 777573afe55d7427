//! The line parser: a `kprobe_events` line (or a file of them) into a [`ProbeSpec`], each
//! refusal at the column of Linux's error-log caret.

use super::*;

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

pub(crate) fn parse_numbered_line(
    line: &str,
    number: usize,
    file: Option<&str>,
) -> Result<Option<ProbeSpec>, SpecError> {
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
pub(crate) struct LocatedError {
    pub(crate) byte: usize,
    pub(crate) kind: SpecErrorKind,
}

type Parsed<T> = Result<T, LocatedError>;

/// What the fetch-args of a probe may use, from its kind and target.
#[derive(Clone, Copy)]
pub(crate) struct ProbeContext {
    is_return: bool,
    at_function_entry: bool,
    /// A source target: names are variables from DWARF, wherever the probe is.
    at_source: bool,
}

/// Parses one line; every `&str` handled is a slice of `line`, so an error's position is
/// the slice's place in it.
pub(crate) struct LineParser<'a> {
    pub(crate) line: &'a str,
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
    pub(crate) fn check_type_fits(
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
pub(crate) fn event_name_of(kind: char, target: &Target) -> String {
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
pub(crate) fn is_good_name(name: &str, dash_ok: bool) -> bool {
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
pub(crate) fn is_source_file(place: &str) -> bool {
    let name = place.rsplit('@').next().unwrap_or(place);
    [".c", ".h", ".S", ".rs"].iter().any(|ext| name.ends_with(ext))
}

/// A kernel module's name as the kernel keeps it: letters, digits and `_` (the file's `-`
/// becomes `_`), at most `MODULE_NAME_LEN` - 1 bytes.
pub(crate) fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MODULE_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

pub(crate) fn is_symbol_name(name: &str) -> bool {
    let ok = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'*' | b'?' | b'{' | b'}' | b',');
    let well_formed = !name.contains(['{', '}', ','])
        || brace_alternatives(name).is_some_and(|alts| alts.iter().all(|a| !a.is_empty() && !a.contains(',')));
    match name.as_bytes().split_first() {
        Some((&first, rest)) => !first.is_ascii_digit() && ok(first) && rest.iter().all(|&c| ok(c)) && well_formed,
        None => false,
    }
}

/// The kernel name of a register spelled the usual assembler way (`rax`, `eip`, `rflags`).
pub(crate) fn register_hint(name: &str) -> Option<&'static str> {
    let stripped = name.strip_prefix(['r', 'e'])?;
    Register::from_name(stripped).map(Register::name)
}

/// `b<width>@<offset>/<container bits>` after the `b`.
pub(crate) fn parse_bitfield(spec: &str) -> Option<ArgType> {
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
pub(crate) fn parse_unsigned(text: &str) -> Option<u64> {
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
pub(crate) fn parse_signed(text: &str) -> Option<i64> {
    match text.strip_prefix('-') {
        Some(magnitude) if !magnitude.starts_with('+') => 0i64.checked_sub_unsigned(parse_unsigned(magnitude)?),
        Some(_) => None,
        None => i64::try_from(parse_unsigned(text)?).ok(),
    }
}

/// Plain decimal digits (the kernel reads `$stackN` and `$argN` in base 10).
pub(crate) fn parse_decimal(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}
