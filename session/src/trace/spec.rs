//! Reading a run's spec text (a `--probes` file, a `probe add`): parsing, wildcard
//! expansion, binding `filter`/`trigger` lines to their events, and the check before
//! boot against the kernel's files.

use super::*;

/// A check's error, and for an unknown symbol that the kernel's DWARF knows as an inlined
/// function (no symbol of its own), how to reach it: perf probe's `FUNC` finds inlined
/// functions, a `kprobe_events` symbol cannot.
fn with_inlined_hint(e: hvprobe_probes::spec::SpecError, kernel: &KernelSourceFiles) -> String {
    let SpecErrorKind::UnknownProbeSymbol(name) = &e.kind else {
        return e.to_string();
    };
    let files = kernel
        .get()
        .ok()
        .and_then(|k| k.functions(name.as_str(), None).ok())
        .map(|fs| {
            let mut files: Vec<String> = fs.into_iter().filter_map(|f| f.decl_file).collect();
            files.sort();
            files.dedup();
            files
        })
        .unwrap_or_default();
    match files.first() {
        Some(file) => {
            let tail = file.rsplit('/').take(3).collect::<Vec<_>>();
            let short: Vec<&str> = tail.into_iter().rev().collect();
            format!(
                "{e} (the kernel's DWARF has it inlined: probe its instances with {name}@{})",
                short.join("/")
            )
        }
        None => e.to_string(),
    }
}

/// A spec line with a source target as the plain probes it stands for (one per site),
/// any other line as it is.
fn resolve_source_target(
    spec: ProbeSpec,
    line: usize,
    source: &str,
    kernel: &KernelSourceFiles,
) -> Result<Vec<ProbeSpec>, String> {
    let target = match &spec {
        ProbeSpec::Kprobe { target, .. } | ProbeSpec::Kretprobe { target, .. } => target,
        _ => return Ok(vec![spec]),
    };
    if !matches!(target, Target::Source(_)) {
        return Ok(vec![spec]);
    }
    let module = match target {
        Target::Source(point) => point.module.clone(),
        _ => None,
    };
    let kernel = match &module {
        Some(m) => kernel.get_module(m),
        None => kernel.get(),
    }
    .map_err(|e| format!("{source}:{line}: {target}: {e}"))?;
    let (specs, notes) = kernel.resolve(&spec).map_err(|e| format!("{source}:{line}: {e}"))?;
    for note in notes {
        tracing::warn!("{source}:{line}: {note}");
    }
    Ok(specs)
}

/// Parses a spec text: syntax, and what this version supports. `-:` lines remove a probe
/// defined above them in the same text; those that name none are returned apart. A
/// source target becomes its sites (see [`KernelSource::resolve`]).
pub(super) fn parse_spec_text(
    text: &str,
    source: &str,
    cpus: usize,
    kernel: &KernelSourceFiles,
) -> (Vec<SpecProbe>, Vec<Removal>, LineProblems) {
    // Every problem at once, in line order: one round of fixing.
    let (specs, errors) = parse_file_all_errors(text, source);
    let mut problems: Vec<(usize, String)> = errors.iter().map(|e| (e.line, e.to_string())).collect();
    let mut probes: Vec<SpecProbe> = Vec::new();
    let mut removals = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut resolved = Vec::with_capacity(specs.len());
    for (line, spec) in specs {
        match resolve_source_target(spec, line, source, kernel) {
            Ok(specs) => resolved.extend(specs.into_iter().map(|s| (line, s))),
            Err(problem) => problems.push((line, problem)),
        }
    }
    for (line, spec) in resolved {
        let (group, event, target, args, kind) = match spec {
            ProbeSpec::Kprobe {
                group,
                event,
                target,
                args,
            } => (group, event, target, args, ProbeKind::Kprobe),
            ProbeSpec::Kretprobe {
                group,
                event,
                target,
                maxactive,
                args,
            } => {
                let maxactive = maxactive.unwrap_or_else(|| default_maxactive(cpus));
                (group, event, target, args, ProbeKind::Kretprobe { maxactive })
            }
            ProbeSpec::Watch {
                group,
                event,
                target,
                access,
                len,
                args,
            } => (group, event, target, args, ProbeKind::Watch { access, len }),
            ProbeSpec::Remove { group, event } => {
                let before = probes.len();
                probes.retain(|p| !(p.request.event == event && group.as_ref().is_none_or(|g| *g == p.request.group)));
                if probes.len() == before {
                    removals.push(Removal { line, group, event });
                }
                continue;
            }
        };
        let point = match target {
            Target::Symbol { name, offset } => ProbePoint::Symbol { name, offset },
            Target::Address(a) => ProbePoint::Address(a),
            Target::ModuleSymbol { module, name, offset } => ProbePoint::Module { module, name, offset },
            Target::Source(_) => unreachable!("resolved into symbol targets above"),
        };
        let request = KprobeRequest {
            kind,
            ..KprobeRequest::event(point, &group, &event, args)
        };
        // (A wildcard's events are named per function, once the kernel is known.) A probe
        // may join an event defined above ([`KprobeRequest::may_join`]): the sites of one
        // source target, or lines that say so.
        if let Some(other) = probes.iter().find(|p| {
            !event.is_empty()
                && p.request.group == group
                && p.request.event == event
                && !request.may_join(&p.request.event_shape())
        }) {
            problems.push((
                line,
                format!(
                    "{source}:{line}: event {group}/{event} is already defined on line {}",
                    other.line
                ),
            ));
            continue;
        }
        probes.push(SpecProbe {
            line,
            text: lines.get(line - 1).copied().unwrap_or_default().to_owned(),
            request,
        });
    }
    (probes, removals, problems)
}

/// Reads and checks a spec file: syntax, and what this version supports. Its probes and
/// its `filter`/`trigger` lines.
pub(super) fn read_spec_file(
    path: &Path,
    cpus: usize,
    kernel: &KernelSourceFiles,
) -> Result<(Vec<SpecProbe>, Vec<Request>), SessionError> {
    let (probes, requests, problems) = read_spec_file_all(path, cpus, kernel)?;
    spec_result(&path.display().to_string(), problems).map(|()| (probes, requests))
}

/// Problems of a spec text, each with its line (to report them in line order).
type LineProblems = Vec<(usize, String)>;

/// A spec file's probes, its `filter`/`trigger` lines and its problems with their lines (a
/// `-:` line must name a probe above it); an error only when it cannot be read.
pub(super) fn read_spec_file_all(
    path: &Path,
    cpus: usize,
    kernel: &KernelSourceFiles,
) -> Result<(Vec<SpecProbe>, Vec<Request>, LineProblems), SessionError> {
    let source = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| SessionError::Spec {
        origin: source.clone(),
        problems: vec![format!("cannot read probe file {source}: {e}")],
    })?;
    let (text, requests, request_errors) = take_request_lines(&text, &source);
    let (probes, removals, mut problems) = parse_spec_text(&text, &source, cpus, kernel);
    problems.extend(request_errors.iter().map(|e| (error_line(e), e.to_string())));
    for r in removals {
        problems.push((
            r.line,
            format!(
                "{source}:{}: -:{}{}: no such event defined above",
                r.line,
                r.group.map(|g| format!("{g}/")).unwrap_or_default(),
                r.event
            ),
        ));
    }
    Ok((probes, requests, problems))
}

pub(super) fn spec_result(source: &str, mut problems: LineProblems) -> Result<(), SessionError> {
    if problems.is_empty() {
        return Ok(());
    }
    problems.sort_by_key(|(line, _)| *line);
    Err(SessionError::Spec {
        origin: source.to_owned(),
        problems: problems.into_iter().map(|(_, p)| p).collect(),
    })
}

/// A short name for why a wildcard's function is skipped, for the count.
pub(super) fn refusal_kind(e: &ProbeError) -> &'static str {
    match e {
        ProbeError::Blacklisted { .. } => "blacklisted",
        ProbeError::PatchSite { .. } => "on a guest patch site",
        ProbeError::MovedOntoBranchTarget { .. } => "entered by a jump",
        ProbeError::AmbiguousSymbol { .. } => "not a unique name",
        ProbeError::DuplicateEvent { .. } => "already probed by that name",
        ProbeError::Unprobeable { .. } | ProbeError::Decode { .. } => "instruction not probeable",
        _ => "other",
    }
}

/// `SOURCE:LINE: GRP/EVENT: reason`, for a probe the engine refused.
pub(super) fn refusal(source: &str, p: &SpecProbe, e: &ProbeError) -> String {
    format!("{source}:{}: {}/{}: {e}", p.line, p.request.group, p.request.event)
}

/// The text functions a wildcard line matches, each as its own probe.
pub(super) fn expand_wildcard(p: &SpecProbe, pattern: &str, symbols: &SymbolTable) -> Vec<SpecProbe> {
    let functions = symbols
        .symbols()
        .iter()
        .filter(|s| s.is_text())
        .map(|s| s.name.as_str());
    probes_of_matches(p, pattern, None, functions)
}

/// A probe of `p`'s for each of `functions` that `pattern` matches (of `module`'s, or the
/// kernel's), named as the kernel names an unnamed probe.
fn probes_of_matches<'f>(
    p: &SpecProbe,
    pattern: &str,
    module: Option<&str>,
    functions: impl Iterator<Item = &'f str>,
) -> Vec<SpecProbe> {
    let is_return = matches!(p.request.kind, ProbeKind::Kretprobe { .. });
    let mut matched: Vec<&str> = functions.filter(|name| wildcard_matches(pattern, name)).collect();
    matched.sort_unstable();
    matched.dedup();
    matched
        .into_iter()
        .map(|function| {
            let (target, point) = match module {
                Some(module) => (
                    Target::ModuleSymbol {
                        module: module.to_owned(),
                        name: function.to_owned(),
                        offset: 0,
                    },
                    ProbePoint::Module {
                        module: module.to_owned(),
                        name: function.to_owned(),
                        offset: 0,
                    },
                ),
                None => (
                    Target::Symbol {
                        name: function.to_owned(),
                        offset: 0,
                    },
                    ProbePoint::Symbol {
                        name: function.to_owned(),
                        offset: 0,
                    },
                ),
            };
            let mut request = p.request.clone();
            request.event = default_event_name(is_return, &target);
            request.point = point;
            SpecProbe {
                line: p.line,
                text: p.text.clone(),
                request,
            }
        })
        .collect()
}

/// The wildcard over a module's functions of a probe, if it has one: `(module, pattern)`.
fn module_wildcard_of(p: &SpecProbe) -> Option<(&str, &str)> {
    match &p.request.point {
        ProbePoint::Module { module, name, .. } if is_wildcard_pattern(name) => Some((module, name)),
        _ => None,
    }
}

/// The probes of a wildcard over module `module`'s functions, from the module as loaded
/// now (bpftrace's `kprobe:MOD:PATTERN` covers what is loaded when it attaches), or why
/// there are none.
fn expand_module_wildcard(
    tracer: &Tracer,
    p: &SpecProbe,
    module: &str,
    pattern: &str,
    source: &str,
) -> Result<Vec<SpecProbe>, String> {
    let functions = tracer.module_functions(module).map_err(|e| match e {
        hvprobe_probes::engine::ProbeError::ModuleNotLoaded { .. } => format!(
            "{source}:{}: {module}:{pattern}: module {module} is not loaded: a wildcard covers the functions of a \
             loaded module (add it when the module is loaded, or name each function: those wait for it)",
            p.line
        ),
        other => format!("{source}:{}: {other}", p.line),
    })?;
    let probes = probes_of_matches(p, pattern, Some(module), functions.iter().map(String::as_str));
    if probes.is_empty() {
        return Err(format!(
            "{source}:{}: {module}:{pattern}: matches no function of module {module}",
            p.line
        ));
    }
    Ok(probes)
}

/// `SOURCE:LINE: PATTERN: matches no kernel function`, for a wildcard with nothing to arm.
pub(super) fn matches_nothing(source: &str, line: usize, pattern: &str) -> String {
    format!("{source}:{line}: {pattern}: matches no kernel function")
}

/// The wildcard pattern of a probe, if it has one.
pub(super) fn wildcard_of(p: &SpecProbe) -> Option<&str> {
    match &p.request.point {
        ProbePoint::Symbol { name, .. } if is_wildcard_pattern(name) => Some(name),
        _ => None,
    }
}

/// Checks a spec file before the guest boots: its syntax, and with the kernel's symbols,
/// that every symbol exists, is unique and holds its offset, that every `@SYM` of a
/// fetch-arg exists, and that every wildcard matches some function; with its vmlinux
/// (`vmlinux`), that offsets are instruction boundaries of its text and that BTF
/// fetch-args (parameter names, `$arg*`, `->` fields) name what its BTF has. (Raw
/// addresses wait for the guest: KASLR may move them.) All problems at once, each at
/// Linux's column.
///
/// The filters and triggers (the file's and `flags`) are checked too: their syntax, and
/// with the symbols, that each names an event of the file and fields it has.
pub fn check_before_boot(
    file: &Path,
    cpus: usize,
    symbols: Option<&SymbolTable>,
    vmlinux: Option<&Path>,
    kernel_source: &KernelSourceFiles,
    flags: &AnalysisFlags,
) -> Result<(), SessionError> {
    let source = file.display().to_string();
    let (probes, mut requests, mut problems) = read_spec_file_all(file, cpus, kernel_source)?;
    // The lines again, to check each probe's against the kernel at its columns.
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let (flag_requests, flag_errors) = flags.parse();
    problems.extend(flag_errors.iter().map(|e| (error_line(e), e.to_string())));
    requests.extend(flag_requests);
    // What this host's KVM cannot do, before a boot that would be refused at its end.
    let backend = hvprobe_vmm::Backend::detect();
    for p in &probes {
        if let (ProbeKind::Watch { access, .. }, Err(reason)) = (p.request.kind, backend.data_breakpoints()) {
            if access.is_data() {
                let (group, event) = (&p.request.group, &p.request.event);
                problems.push((p.line, format!("{source}:{}: {group}/{event}: {reason}", p.line)));
            }
        }
    }
    let Some(symbols) = symbols else {
        return spec_result(&source, problems);
    };
    let files = vmlinux
        .filter(|_| probes.iter().any(|p| needs_kernel_files(&p.request)))
        .and_then(|path| KernelFiles::load(path, symbols));
    let kernel = Kernel {
        symbols,
        text: files.as_ref().map(|f| &f.image as &dyn GuestVirtRead),
        btf: match files.as_ref().map(|f| &f.btf) {
            Some(FileBtf::Known(btf)) => BtfKnowledge::Known(btf),
            Some(FileBtf::Absent) => BtfKnowledge::Absent,
            Some(FileBtf::Unreadable) | None => BtfKnowledge::Unknown,
        },
    };
    let mut events = Vec::new();
    for p in &probes {
        if let Some(pattern) = wildcard_of(p) {
            let functions = expand_wildcard(p, pattern, symbols);
            if functions.is_empty() {
                problems.push((p.line, matches_nothing(&source, p.line, pattern)));
            }
            events.extend(functions);
        } else {
            let line = lines.get(p.line - 1).copied().unwrap_or_default();
            let mut event = p.clone();
            // A source target's line was checked as it was resolved into its sites.
            let spec = parse_line(line).ok().flatten().filter(|spec| {
                !matches!(
                    spec,
                    ProbeSpec::Kprobe {
                        target: Target::Source(_),
                        ..
                    } | ProbeSpec::Kretprobe {
                        target: Target::Source(_),
                        ..
                    }
                )
            });
            if let Some(spec) = spec {
                match check_spec(line, p.line, Some(&source), &spec, &kernel) {
                    // The filters and triggers bind to the fields as they will be armed
                    // (`$arg*` and `$argN` named after the parameters).
                    Ok(
                        ProbeSpec::Kprobe { args, .. }
                        | ProbeSpec::Kretprobe { args, .. }
                        | ProbeSpec::Watch { args, .. },
                    ) => event.request.args = args,
                    Ok(ProbeSpec::Remove { .. }) => {}
                    Err(e) => problems.push((p.line, with_inlined_hint(e, kernel_source))),
                }
            }
            events.push(event);
        }
    }
    if let Err(errors) = bind_requests(&requests, &events) {
        problems.extend(errors);
    }
    spec_result(&source, problems)
}

/// Whether checking a probe before boot needs the kernel's vmlinux: for an offset's
/// instruction boundary, or for BTF (parameter names, `$arg*`, and the `$argN` and
/// `$retval` Linux checks against the function's prototype).
pub(super) fn needs_kernel_files(request: &KprobeRequest) -> bool {
    matches!(request.point, ProbePoint::Symbol { offset: 1.., .. })
        || has_btf_args(&request.args)
        || request
            .args
            .iter()
            .any(|a| matches!(a.expr, FetchExpr::Arg(_) | FetchExpr::Retval))
}

/// What a vmlinux file tells before boot: its text (the loadable segments) and its BTF.
pub(super) struct KernelFiles {
    image: ElfImage,
    btf: FileBtf,
}

/// A vmlinux's BTF.
pub(super) enum FileBtf {
    Known(Btf),
    /// The kernel has none (no `__start_BTF`/`__stop_BTF`).
    Absent,
    /// It could not be read: BTF fetch-args wait for the running kernel.
    Unreadable,
}

impl KernelFiles {
    /// The vmlinux at `path`; `None` (with the reason logged) when it cannot be read, so
    /// that what it would check waits for the running kernel.
    fn load(path: &Path, symbols: &SymbolTable) -> Option<KernelFiles> {
        let image = ElfImage::open(path)
            .map_err(|e| {
                tracing::warn!(
                    "{}: {e}; its text and BTF are checked once the guest is up",
                    path.display()
                )
            })
            .ok()?;
        let btf = match (symbols.lookup("__start_BTF"), symbols.lookup("__stop_BTF")) {
            (Some(start), Some(stop)) => match Btf::from_guest(&image, start.addr, stop.addr) {
                Ok(btf) => FileBtf::Known(btf),
                Err(e) => {
                    tracing::warn!(
                        "{}: its BTF: {e}; BTF arguments are checked once the guest is up",
                        path.display()
                    );
                    FileBtf::Unreadable
                }
            },
            _ => FileBtf::Absent,
        };
        Some(KernelFiles { image, btf })
    }
}

/// The filters and triggers bound to the events of `probes`, or every problem with its
/// line.
pub(super) fn bind_requests(requests: &[Request], probes: &[SpecProbe]) -> Result<AnalysisTable, LineProblems> {
    // An event of several probes (their fields are alike) is one schema.
    let mut seen = std::collections::HashSet::new();
    let schemas: Vec<EventSchema> = probes
        .iter()
        .filter(|p| seen.insert((&p.request.group, &p.request.event)))
        .map(|p| EventSchema {
            group: &p.request.group,
            event: &p.request.event,
            args: &p.request.args,
        })
        .collect();
    AnalysisTable::build(requests, &schemas)
        .map_err(|errors| errors.iter().map(|e| (error_line(e), e.to_string())).collect())
}

/// Expands wildcards and checks every probe against the kernel: `(what to arm, one line
/// per wildcard with its counts)`, or every refusal. A wildcard's functions that cannot be
/// probed are skipped and counted; a wildcard that matches nothing is a refusal.
/// What the run's filters and triggers ask of the probe of `request`'s event: an event
/// with a `stacktrace` trigger has its probe unwind the stack at each hit; an event detour
/// runs what it can of its event's filter in the guest.
pub(super) fn with_analysis(request: &mut KprobeRequest, analysis: &AnalysisTable) {
    request.stack_trace = analysis.wants_stacks(&request.group, &request.event);
    request.filter = analysis.record_filter(&request.group, &request.event, &request.args);
}

pub(super) fn plan(
    tracer: &Tracer,
    symbols: &SymbolTable,
    source: &str,
    probes: &[SpecProbe],
) -> Result<(Vec<SpecProbe>, Vec<String>), SessionError> {
    let (armed, notes, problems) = expand_and_check(tracer, symbols, source, probes);
    spec_result(source, problems)?;
    Ok((armed, notes))
}

/// Why a wildcard's function is skipped when it lacks the BTF arguments its line names.
const WITHOUT_BTF_ARGS: &str = "without those BTF arguments";

/// A probe that cannot be armed as its line asks: one of its wildcard's functions skipped
/// and counted by `kind`, or, for a line of its own, the line's refusal.
fn skip_or_refuse(
    skipped: &mut BTreeMap<usize, BTreeMap<&'static str, usize>>,
    problems: &mut LineProblems,
    wildcard: Option<usize>,
    kind: &'static str,
    line: usize,
    refusal: impl FnOnce() -> String,
) {
    match wildcard {
        Some(w) => *skipped.entry(w).or_default().entry(kind).or_default() += 1,
        None => problems.push((line, refusal())),
    }
}

/// [`plan`]'s work: what to arm, the wildcard notes, and every refusal with its line.
pub(super) fn expand_and_check(
    tracer: &Tracer,
    symbols: &SymbolTable,
    source: &str,
    probes: &[SpecProbe],
) -> (Vec<SpecProbe>, Vec<String>, LineProblems) {
    let mut problems = Vec::new();
    let mut expanded = Vec::new();
    let mut from_wildcard = Vec::new();
    for (index, p) in probes.iter().enumerate() {
        // Checked before boot too when the symbols were known; `probe add` and runs on
        // the guest's kallsyms only learn them here.
        if let Some((arg, name)) = unknown_fetch_symbol(&p.request.args, symbols) {
            problems.push((
                p.line,
                format!(
                    "{source}:{}: {}/{}: argument {}: {}",
                    p.line,
                    p.request.group,
                    p.request.event,
                    arg + 1,
                    SpecErrorKind::UnknownDataSymbol(name.to_owned())
                ),
            ));
            continue;
        }
        if let Some((module, pattern)) = module_wildcard_of(p) {
            match expand_module_wildcard(tracer, p, module, pattern, source) {
                Ok(functions) => {
                    from_wildcard.extend(std::iter::repeat_n(Some(index), functions.len()));
                    expanded.extend(functions);
                }
                Err(problem) => problems.push((p.line, problem)),
            }
            continue;
        }
        match wildcard_of(p) {
            Some(pattern) => {
                let functions = expand_wildcard(p, pattern, symbols);
                if functions.is_empty() {
                    problems.push((p.line, matches_nothing(source, p.line, pattern)));
                }
                from_wildcard.extend(std::iter::repeat_n(Some(index), functions.len()));
                expanded.extend(functions);
            }
            None => {
                expanded.push(p.clone());
                from_wildcard.push(None);
            }
        }
    }
    let mut skipped: BTreeMap<usize, BTreeMap<&'static str, usize>> = BTreeMap::new();
    // BTF fetch-args (parameter names, `$arg*`, `->` fields) become plain fetches typed
    // from the guest's BTF, for each function (a wildcard's each: one without such a
    // parameter is skipped).
    let matched_from = from_wildcard.clone();
    let mut kept = Vec::with_capacity(expanded.len());
    let mut kept_from = Vec::with_capacity(expanded.len());
    for (mut p, wildcard) in expanded.into_iter().zip(from_wildcard) {
        // A return probe's `$retval` of a `void` function, as Linux 6.5+ refuses it.
        let is_return = matches!(p.request.kind, ProbeKind::Kretprobe { .. });
        let retval = p.request.args.iter().any(|a| a.expr == FetchExpr::Retval);
        if let (true, true, ProbePoint::Symbol { name, .. }) = (is_return, retval, &p.request.point) {
            if let Some(e) = tracer
                .kernel_btf()
                .and_then(|btf| void_retval(name, &p.request.args, btf))
            {
                skip_or_refuse(&mut skipped, &mut problems, wildcard, "returning void", p.line, || {
                    locate_btf_error(&p.text, p.line, Some(source), &p.request.args, e).to_string()
                });
                continue;
            }
        }
        // A module function's parameters are in the module's BTF, which is not read: its
        // BTF fetch-args would fetch nothing at every hit.
        if let (true, ProbePoint::Module { module, name, .. }) = (has_btf_args(&p.request.args), &p.request.point) {
            skip_or_refuse(&mut skipped, &mut problems, wildcard, WITHOUT_BTF_ARGS, p.line, || {
                format!(
                    "{source}:{}: {module}:{name}: BTF arguments (parameter names, $arg*, ->fields) need the \
                     module's BTF, which hvprobe does not read: fetch registers ($argN, %REG), or give a source \
                     line of the module with its .ko (MOD:FUNC@FILE)",
                    p.line
                )
            });
            continue;
        }
        if let (true, ProbePoint::Symbol { name, .. }) = (has_btf_args(&p.request.args), &p.request.point) {
            match resolve_btf_args(name, &p.request.args, tracer.kernel_btf().map(|b| b.as_ref())) {
                Ok(args) => p.request.args = args,
                Err(e) => {
                    skip_or_refuse(&mut skipped, &mut problems, wildcard, WITHOUT_BTF_ARGS, p.line, || {
                        locate_btf_error(&p.text, p.line, Some(source), &p.request.args, e).to_string()
                    });
                    continue;
                }
            }
        }
        kept.push(p);
        kept_from.push(wildcard);
    }
    let (expanded, from_wildcard) = (kept, kept_from);
    let requests: Vec<KprobeRequest> = expanded.iter().map(|p| p.request.clone()).collect();
    let mut refused = vec![false; expanded.len()];
    for (i, e) in tracer.check_all(&requests) {
        match from_wildcard[i] {
            Some(w) => {
                *skipped.entry(w).or_default().entry(refusal_kind(&e)).or_default() += 1;
                refused[i] = true;
            }
            None => problems.push((expanded[i].line, refusal(source, &expanded[i], &e))),
        }
    }
    let mut notes = Vec::new();
    for (index, p) in probes.iter().enumerate() {
        let Some(pattern) = wildcard_of(p) else { continue };
        let matched = matched_from.iter().filter(|w| **w == Some(index)).count();
        let reasons = skipped.get(&index);
        let n_skipped: usize = reasons.map(|r| r.values().sum()).unwrap_or(0);
        let why = reasons
            .map(|r| r.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", "))
            .map(|why| format!(" ({why})"))
            .unwrap_or_default();
        notes.push(format!(
            "{source}:{}: {pattern}: {matched} functions match, {} to arm, {n_skipped} skipped{why}",
            p.line,
            matched - n_skipped,
        ));
    }
    let armed = expanded
        .into_iter()
        .zip(refused)
        .filter(|(_, r)| !r)
        .map(|(p, _)| p)
        .collect();
    (armed, notes, problems)
}
