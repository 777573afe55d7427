//! The probes of one run: those of `--probes FILE`, armed once the guest is ready, and
//! those the control socket adds, removes, enables and disables while it runs. Hits are
//! printed as they happen and streamed to every `hvprobe trace` client; the listing is
//! printed at the end (and on SIGUSR1).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hvprobe_analysis::request::Request;
use hvprobe_analysis::table::{AnalysisTable, EventSchema};
use hvprobe_introspection::btf::Btf;
use hvprobe_introspection::memory::{ElfImage, GuestVirtRead};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{build_tracer, ProbeHandler, TaskContext};
use hvprobe_probes::clock::TraceClock;
use hvprobe_probes::engine::{
    default_maxactive, EventSink, HitEvent, KprobeRequest, ProbeError, ProbeId, ProbeKind, ProbePoint, Tracer,
};
use hvprobe_probes::output::{ftrace_text, json_line, listing_line};
use hvprobe_probes::spec::check::{
    check_spec, has_btf_args, locate_btf_error, resolve_btf_args, unknown_fetch_symbol, void_retval, BtfKnowledge,
    Kernel,
};
use hvprobe_probes::spec::{
    default_event_name, is_wildcard_pattern, parse_file_all_errors, parse_line, wildcard_matches, FetchExpr, ProbeSpec,
    SpecErrorKind, Target,
};
use hvprobe_vmm::{ConsoleLog, VcpuControl, VcpuState, Vm};
use vm_memory::GuestMemoryMmap;

use crate::analysis::{
    error_line, hist_report, lock_stdout_at_line, origin_line, print_on_own_lines, take_request_lines, AnalysisFlags,
};
use crate::cli::{HitOutputs, OutputFormat};
use crate::perfetto::{PerfettoError, PerfettoFile};

/// Events a slow printer has not taken yet; beyond this, hits count as missed.
const EVENT_QUEUE: usize = 1 << 16;

/// What a request to the running session could not do.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Every problem of a spec text (or of its probes against the kernel), one per line,
    /// each `SOURCE:LINE:[COLUMN:] reason`.
    #[error("{}", all_problems(origin, problems))]
    Spec { origin: String, problems: Vec<String> },
    #[error("the guest kernel is not up yet: probes can be added once it is")]
    KernelNotUp,
    #[error("the guest has not reached /init yet: probes go in once its boot-time text patching is over")]
    NotReady,
    #[error("no kernel symbols, so no probes can be placed: {0}")]
    NoSymbols(String),
    #[error("cannot start the probe engine: {0}")]
    Engine(String),
    #[error("the run has ended")]
    Finished,
    #[error("no probe event matches {0:?}")]
    NoSuchEvent(String),
    #[error("{event}: {source}")]
    Probe { event: String, source: Box<ProbeError> },
    #[error("--filter and --trigger apply to the events of --probes FILE, and there is none")]
    AnalysisWithoutProbes,
    #[error("--perfetto records probe hits, and this run has no probes: give --probes FILE, or a control socket to add them")]
    PerfettoWithoutProbes,
    #[error(transparent)]
    Perfetto(#[from] PerfettoError),
}

/// A probe from a spec text, with its line for error messages.
#[derive(Clone)]
struct SpecProbe {
    line: usize,
    /// The line's text, for errors at their column found once the kernel is known.
    text: String,
    request: KprobeRequest,
}

/// A `-:[GRP/]EVENT` line that names no probe defined above it in the same text.
struct Removal {
    line: usize,
    group: Option<String>,
    event: String,
}

/// What an accepted `add` did.
#[derive(Debug, Default)]
pub struct AddReport {
    /// `GRP/EVENT` of every probe armed.
    pub added: Vec<String>,
    /// `GRP/EVENT` of every probe a `-:` line removed.
    pub removed: Vec<String>,
    /// Per wildcard line: how many functions matched, were armed and skipped (and why).
    pub wildcards: Vec<String>,
    /// How long arming the new probes took, and in how many pauses of the vCPUs (one,
    /// unless another thread paused them meanwhile).
    pub arm_time: Duration,
    pub arm_pauses: u64,
}

/// Where the kernel is, once it is up: what the engine is built from.
struct KernelUp {
    control: Arc<VcpuControl>,
    state: VcpuState,
    symbols: SymbolTable,
    tasks: Option<TaskContext>,
}

/// The probes of one run and where their hits go.
pub struct TraceSession {
    /// `--probes FILE`, if given.
    file: Option<PathBuf>,
    /// The file's probes as it gives them (a wildcard is one entry).
    initial: Vec<SpecProbe>,
    /// The file's probes with every wildcard replaced by one probe per function it matches
    /// that can be probed, checked against the kernel: what [`TraceSession::arm`] arms.
    planned: OnceLock<Vec<SpecProbe>>,
    kernel: OnceLock<KernelUp>,
    /// Why the kernel's symbols could not be had, when they could not.
    no_symbols: OnceLock<String>,
    /// The guest is past its boot-time text patching: probes may go in.
    ready: AtomicBool,
    /// The run is over: no probe goes in any more.
    finished: AtomicBool,
    cpus: usize,
    mem: GuestMemoryMmap,
    pub handler: Arc<ProbeHandler>,
    events: Arc<EventFanout>,
    printer: Mutex<Option<JoinHandle<()>>>,
    /// Why arming failed (it happens on a vCPU thread).
    failure: Arc<Mutex<Option<String>>>,
    /// Serializes the engine's construction and the control socket's changes (a check and
    /// the registration that follows it see the same probes).
    changes: Mutex<()>,
    /// Jump-optimize probes (the engine's switch, set when it is built).
    optimize: bool,
    /// The clock hits are stamped with (`--clock`).
    clock: TraceClock,
    /// The filters and triggers of the flags and of the file, bound to the file's events
    /// once the kernel is known.
    requests: Vec<Request>,
    /// How hits are printed (and so the histograms).
    format: OutputFormat,
    /// `--sym-offset`: stack frames with their offsets.
    sym_offset: bool,
    console: ConsoleLog,
}

/// Where hit events go: the run's printer, and every live `hvprobe trace` stream. No
/// consumer ever blocks a vCPU: a full queue drops the event for that consumer alone (the
/// printer's drops are the probe's nmissed; a stream's are counted for that stream).
struct EventFanout {
    printer: Mutex<Option<SyncSender<HitEvent>>>,
    streams: Mutex<Vec<EventStream>>,
    /// The events' filters and triggers, set before any probe is armed (when there are
    /// any): every hit goes through them first.
    analysis: OnceLock<Arc<AnalysisTable>>,
}

/// One `hvprobe trace` client's queue.
struct EventStream {
    tx: SyncSender<HitEvent>,
    dropped: Arc<AtomicU64>,
}

/// A subscription to hit events: the events as they come, and how many were dropped
/// because the queue was full.
pub struct Subscription {
    pub events: Receiver<HitEvent>,
    pub dropped: Arc<AtomicU64>,
    /// The run's `--sym-offset`, for stack frames in text.
    pub sym_offset: bool,
}

impl EventSink for EventFanout {
    fn try_send(&self, mut event: HitEvent) -> bool {
        if let Some(analysis) = self.analysis.get() {
            if !analysis.observe(&mut event.record) {
                // Filtered out: counted by the filter, not missed.
                return true;
            }
        }
        {
            let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            streams.retain(|s| match s.tx.try_send(event.clone()) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    s.dropped.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Err(TrySendError::Disconnected(_)) => false,
            });
        }
        let printer = self.printer.lock().unwrap_or_else(|e| e.into_inner());
        match printer.as_ref() {
            Some(tx) => tx.try_send(event).is_ok(),
            // Nobody prints (`--format none`): the event is delivered to whoever streams.
            None => true,
        }
    }
}

impl EventFanout {
    /// Ends every stream and the printer's queue: their consumers see the end once they
    /// have taken what is queued.
    fn close(&self) {
        self.streams.lock().unwrap_or_else(|e| e.into_inner()).clear();
        *self.printer.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Parses a spec text: syntax, and what this version supports. `-:` lines remove a probe
/// defined above them in the same text; those that name none are returned apart.
fn parse_spec_text(text: &str, source: &str, cpus: usize) -> (Vec<SpecProbe>, Vec<Removal>, LineProblems) {
    // Every problem at once, in line order: one round of fixing.
    let (specs, errors) = parse_file_all_errors(text, source);
    let mut problems: Vec<(usize, String)> = errors.iter().map(|e| (e.line, e.to_string())).collect();
    let mut probes: Vec<SpecProbe> = Vec::new();
    let mut removals = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    for (line, spec) in specs {
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
            ProbeSpec::Remove { group, event } => {
                let before = probes.len();
                probes.retain(|p| !(p.request.event == event && group.as_ref().is_none_or(|g| *g == p.request.group)));
                if probes.len() == before {
                    removals.push(Removal { line, group, event });
                }
                continue;
            }
        };
        // (A wildcard's events are named per function, once the kernel is known.)
        if let Some(other) = probes
            .iter()
            .find(|p| !event.is_empty() && p.request.group == group && p.request.event == event)
        {
            problems.push((
                line,
                format!(
                    "{source}:{line}: event {group}/{event} is already defined on line {}",
                    other.line
                ),
            ));
            continue;
        }
        let point = match target {
            Target::Symbol { name, offset } => ProbePoint::Symbol { name, offset },
            Target::Address(a) => ProbePoint::Address(a),
        };
        probes.push(SpecProbe {
            line,
            text: lines.get(line - 1).copied().unwrap_or_default().to_owned(),
            request: KprobeRequest {
                kind,
                ..KprobeRequest::event(point, &group, &event, args)
            },
        });
    }
    (probes, removals, problems)
}

/// Reads and checks a spec file: syntax, and what this version supports. Its probes and
/// its `filter`/`trigger` lines.
fn read_spec_file(path: &Path, cpus: usize) -> Result<(Vec<SpecProbe>, Vec<Request>), SessionError> {
    let (probes, requests, problems) = read_spec_file_all(path, cpus)?;
    spec_result(&path.display().to_string(), problems).map(|()| (probes, requests))
}

/// Problems of a spec text, each with its line (to report them in line order).
type LineProblems = Vec<(usize, String)>;

/// A spec file's probes, its `filter`/`trigger` lines and its problems with their lines (a
/// `-:` line must name a probe above it); an error only when it cannot be read.
fn read_spec_file_all(path: &Path, cpus: usize) -> Result<(Vec<SpecProbe>, Vec<Request>, LineProblems), SessionError> {
    let source = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| SessionError::Spec {
        origin: source.clone(),
        problems: vec![format!("cannot read probe file {source}: {e}")],
    })?;
    let (text, requests, request_errors) = take_request_lines(&text, &source);
    let (probes, removals, mut problems) = parse_spec_text(&text, &source, cpus);
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

fn spec_result(source: &str, mut problems: LineProblems) -> Result<(), SessionError> {
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
fn refusal_kind(e: &ProbeError) -> &'static str {
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

/// Several problems of one spec text as one message: a count, then one per line.
fn all_problems(source: &str, problems: &[String]) -> String {
    match problems {
        [one] => one.clone(),
        many => format!("{} problems in {source}:\n{}", many.len(), many.join("\n")),
    }
}

/// `SOURCE:LINE: GRP/EVENT: reason`, for a probe the engine refused.
fn refusal(source: &str, p: &SpecProbe, e: &ProbeError) -> String {
    format!("{source}:{}: {}/{}: {e}", p.line, p.request.group, p.request.event)
}

/// The text functions a wildcard line matches, each as its own probe.
fn expand_wildcard(p: &SpecProbe, pattern: &str, symbols: &SymbolTable) -> Vec<SpecProbe> {
    let is_return = matches!(p.request.kind, ProbeKind::Kretprobe { .. });
    let mut functions: Vec<&str> = symbols
        .symbols()
        .iter()
        .filter(|s| s.is_text() && wildcard_matches(pattern, &s.name))
        .map(|s| s.name.as_str())
        .collect();
    functions.sort_unstable();
    functions.dedup();
    functions
        .into_iter()
        .map(|function| {
            let target = Target::Symbol {
                name: function.to_string(),
                offset: 0,
            };
            let mut request = p.request.clone();
            request.event = default_event_name(is_return, &target);
            request.point = ProbePoint::Symbol {
                name: function.to_string(),
                offset: 0,
            };
            SpecProbe {
                line: p.line,
                text: p.text.clone(),
                request,
            }
        })
        .collect()
}

/// `SOURCE:LINE: PATTERN: matches no kernel function`, for a wildcard with nothing to arm.
fn matches_nothing(source: &str, line: usize, pattern: &str) -> String {
    format!("{source}:{line}: {pattern}: matches no kernel function")
}

/// The wildcard pattern of a probe, if it has one.
fn wildcard_of(p: &SpecProbe) -> Option<&str> {
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
    flags: &AnalysisFlags,
) -> Result<(), SessionError> {
    let source = file.display().to_string();
    let (probes, mut requests, mut problems) = read_spec_file_all(file, cpus)?;
    // The lines again, to check each probe's against the kernel at its columns.
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let (flag_requests, flag_errors) = flags.parse();
    problems.extend(flag_errors.iter().map(|e| (error_line(e), e.to_string())));
    requests.extend(flag_requests);
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
            if let Ok(Some(spec)) = parse_line(line) {
                match check_spec(line, p.line, Some(&source), &spec, &kernel) {
                    // The filters and triggers bind to the fields as they will be armed
                    // (`$arg*` and `$argN` named after the parameters).
                    Ok(ProbeSpec::Kprobe { args, .. } | ProbeSpec::Kretprobe { args, .. }) => event.request.args = args,
                    Ok(ProbeSpec::Remove { .. }) => {}
                    Err(e) => problems.push((p.line, e.to_string())),
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
fn needs_kernel_files(request: &KprobeRequest) -> bool {
    matches!(request.point, ProbePoint::Symbol { offset: 1.., .. })
        || has_btf_args(&request.args)
        || request
            .args
            .iter()
            .any(|a| matches!(a.expr, FetchExpr::Arg(_) | FetchExpr::Retval))
}

/// What a vmlinux file tells before boot: its text (the loadable segments) and its BTF.
struct KernelFiles {
    image: ElfImage,
    btf: FileBtf,
}

/// A vmlinux's BTF.
enum FileBtf {
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
fn bind_requests(requests: &[Request], probes: &[SpecProbe]) -> Result<AnalysisTable, LineProblems> {
    let schemas: Vec<EventSchema> = probes
        .iter()
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
fn with_analysis(request: &mut KprobeRequest, analysis: &AnalysisTable) {
    request.stack_trace = analysis.wants_stacks(&request.group, &request.event);
    request.filter = analysis.record_filter(&request.group, &request.event, &request.args);
}

fn plan(
    tracer: &Tracer,
    symbols: &SymbolTable,
    source: &str,
    probes: &[SpecProbe],
) -> Result<(Vec<SpecProbe>, Vec<String>), SessionError> {
    let (armed, notes, problems) = expand_and_check(tracer, symbols, source, probes);
    spec_result(source, problems)?;
    Ok((armed, notes))
}

/// [`plan`]'s work: what to arm, the wildcard notes, and every refusal with its line.
fn expand_and_check(
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
                match wildcard {
                    Some(w) => *skipped.entry(w).or_default().entry("returning void").or_default() += 1,
                    None => problems.push((
                        p.line,
                        locate_btf_error(&p.text, p.line, Some(source), &p.request.args, e).to_string(),
                    )),
                }
                continue;
            }
        }
        if let (true, ProbePoint::Symbol { name, .. }) = (has_btf_args(&p.request.args), &p.request.point) {
            match resolve_btf_args(name, &p.request.args, tracer.kernel_btf().map(|b| b.as_ref())) {
                Ok(args) => p.request.args = args,
                Err(e) => {
                    match wildcard {
                        Some(w) => {
                            *skipped
                                .entry(w)
                                .or_default()
                                .entry("without those BTF arguments")
                                .or_default() += 1
                        }
                        None => problems.push((
                            p.line,
                            locate_btf_error(&p.text, p.line, Some(source), &p.request.args, e).to_string(),
                        )),
                    }
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

/// What stamped the run's hits, for the log: the guest's clock as it stands at the end
/// (its page, TSC offset and how exactly it is known), and the stamps a page read could not
/// serve.
fn log_trace_clock(tracer: &Tracer) {
    let used = clock_name(tracer.trace_clock());
    match tracer.guest_clock() {
        Some(clock) => tracing::info!(
            "hits stamped with the {used} clock; guest trace clock at the end: {}; stamps from an earlier page read: {}",
            clock.describe(),
            clock.stale_stamps()
        ),
        None => tracing::info!("hits stamped with the {used} clock (no guest trace clock)"),
    }
}

/// A clock as `--clock` names it.
fn clock_name(clock: TraceClock) -> &'static str {
    match clock {
        TraceClock::Local => "local",
        TraceClock::Global => "global",
        TraceClock::Host => "host",
    }
}

/// Whether `GRP/EVENT` matches a user's event pattern: `GRP/EVENT`, `EVENT` (any group),
/// or `GRP/` (the whole group), each part a glob.
fn event_matches(pattern: &str, group: &str, event: &str) -> bool {
    match pattern.split_once('/') {
        Some((g, "")) => wildcard_matches(g, group),
        Some((g, e)) => wildcard_matches(g, group) && wildcard_matches(e, event),
        None => wildcard_matches(pattern, event),
    }
}

impl TraceSession {
    /// Parses the probe file (if any) and starts the printer. Nothing touches the guest yet.
    pub fn new(
        probes_file: Option<&Path>,
        outputs: &HitOutputs,
        sym_offset: bool,
        optimize: bool,
        clock: TraceClock,
        analysis: &AnalysisFlags,
        vm: &Vm,
    ) -> Result<TraceSession, SessionError> {
        let cpus = vm.control().vcpu_count();
        let (initial, mut requests) = match probes_file {
            Some(file) => read_spec_file(file, cpus)?,
            None if !analysis.is_empty() => return Err(SessionError::AnalysisWithoutProbes),
            None => (Vec::new(), Vec::new()),
        };
        let (flag_requests, flag_errors) = analysis.parse();
        if !flag_errors.is_empty() {
            return Err(SessionError::Spec {
                origin: "the command line".into(),
                problems: flag_errors.iter().map(ToString::to_string).collect(),
            });
        }
        requests.extend(flag_requests);
        let format = outputs.stdout();
        // Created now, so that a file that cannot be written fails before the guest runs.
        let perfetto = outputs.perfetto.as_deref().map(PerfettoFile::create).transpose()?;
        let (printer_tx, printer) = match (format, perfetto) {
            (OutputFormat::None, None) => (None, None),
            (format, perfetto) => {
                let console = vm.console_log();
                let (tx, rx) = std::sync::mpsc::sync_channel(EVENT_QUEUE);
                let printer = std::thread::Builder::new()
                    .name("trace-printer".into())
                    .spawn(move || print_events(rx, format, sym_offset, console, perfetto))
                    .map_err(|e| SessionError::Engine(format!("cannot start the trace printer: {e}")))?;
                (Some(tx), Some(printer))
            }
        };
        Ok(TraceSession {
            file: probes_file.map(Path::to_path_buf),
            initial,
            planned: OnceLock::new(),
            kernel: OnceLock::new(),
            no_symbols: OnceLock::new(),
            ready: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            cpus,
            mem: vm.memory().clone(),
            handler: ProbeHandler::new(vm),
            events: Arc::new(EventFanout {
                printer: Mutex::new(printer_tx),
                streams: Mutex::new(Vec::new()),
                analysis: OnceLock::new(),
            }),
            printer: Mutex::new(printer),
            failure: Arc::new(Mutex::new(None)),
            changes: Mutex::new(()),
            optimize,
            clock,
            requests,
            format,
            sym_offset,
            console: vm.console_log(),
        })
    }

    /// Whether a probe file was given.
    pub fn has_file(&self) -> bool {
        self.file.is_some()
    }

    fn source(&self) -> String {
        self.file.as_ref().map(|f| f.display().to_string()).unwrap_or_default()
    }

    /// Once the kernel is up (vCPUs paused, `state` one of theirs): remembers where it is,
    /// and when there is a probe file, builds the engine (reading the kernel facts the
    /// engine checks probes against, mapping the out-of-line area) and checks every probe
    /// of the file against the kernel, so that a refusal fails before the guest goes on.
    /// Arms nothing.
    pub fn prepare(
        &self,
        control: Arc<VcpuControl>,
        state: &VcpuState,
        symbols: &SymbolTable,
        tasks: Option<TaskContext>,
    ) -> Result<(), SessionError> {
        let _ = self.kernel.set(KernelUp {
            control,
            state: *state,
            symbols: symbols.clone(),
            tasks,
        });
        if self.file.is_none() {
            return Ok(());
        }
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let tracer = self.attach_tracer()?;
        let (mut armed, notes) = plan(&tracer, symbols, &self.source(), &self.initial)?;
        for note in notes {
            eprintln!("hvprobe: {note}");
        }
        // Filters and triggers are in place before the first hit can come.
        let analysis = match bind_requests(&self.requests, &armed) {
            Ok(analysis) => analysis,
            Err(problems) => return spec_result(&self.source(), problems),
        };
        for p in &mut armed {
            with_analysis(&mut p.request, &analysis);
        }
        if !analysis.is_empty() {
            let _ = self.events.analysis.set(Arc::new(analysis));
        }
        let _ = self.planned.set(armed);
        Ok(())
    }

    /// The kernel's symbols could not be had: every request for probes says why.
    pub fn symbols_unavailable(&self, why: String) {
        let _ = self.no_symbols.set(why);
    }

    /// The engine, built on first need (the caller has the vCPUs paused and holds
    /// `changes`).
    fn attach_tracer(&self) -> Result<Arc<Tracer>, SessionError> {
        if let Some(tracer) = self.handler.tracer() {
            return Ok(Arc::clone(tracer));
        }
        let kernel = self.kernel.get().ok_or(SessionError::KernelNotUp)?;
        let sink: Arc<dyn EventSink> = self.events.clone();
        let tracer = build_tracer(
            Arc::clone(&kernel.control),
            &self.mem,
            &kernel.state,
            &kernel.symbols,
            Some(sink),
        )
        .map_err(|e| SessionError::Engine(e.to_string()))?;
        tracer.set_optimization(self.optimize);
        if let Err(e) = tracer.set_trace_clock(self.clock) {
            eprintln!(
                "hvprobe: --clock {}: {e}; hits are stamped with the {} clock",
                clock_name(self.clock),
                clock_name(tracer.trace_clock())
            );
        }
        self.handler.attach(Arc::clone(&tracer), kernel.tasks);
        Ok(tracer)
    }

    /// The engine for a request of the control socket, built (in a pause) if this is the
    /// first probe of the run; an error while the guest cannot take probes yet. The caller
    /// holds `changes`.
    fn live_tracer(&self) -> Result<(Arc<Tracer>, &SymbolTable), SessionError> {
        if self.finished.load(Ordering::Acquire) {
            return Err(SessionError::Finished);
        }
        if let Some(why) = self.no_symbols.get() {
            return Err(SessionError::NoSymbols(why.clone()));
        }
        let kernel = self.kernel.get().ok_or(SessionError::KernelNotUp)?;
        if !self.ready.load(Ordering::Acquire) {
            return Err(SessionError::NotReady);
        }
        let tracer = match self.handler.tracer() {
            Some(tracer) => Arc::clone(tracer),
            None => {
                let paused = kernel.control.pause_all();
                let tracer = self.attach_tracer();
                drop(paused);
                tracer?
            }
        };
        Ok((tracer, &kernel.symbols))
    }

    /// Registers and arms every probe of the file (all or none). Call with the guest where
    /// probes should start counting (at `/init`, or before a restored guest runs); from
    /// then on the control socket can add probes too.
    pub fn arm(&self) -> Result<(), String> {
        if self.file.is_some() {
            let tracer = self.handler.tracer().ok_or("the probe engine is not attached")?;
            let probes = self
                .planned
                .get()
                .ok_or("the probes were not checked against the kernel")?;
            let requests = probes.iter().map(|p| p.request.clone()).collect();
            tracer
                .register_all(requests)
                .map_err(|(i, e)| refusal(&self.source(), &probes[i], &e))?;
            tracing::info!("{} probe(s) armed", probes.len());
        }
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// Arms the probes on the vCPU thread that reports `/init`; a failure stops the VM.
    pub fn arm_at_init(self: &Arc<Self>, control: Arc<VcpuControl>) {
        let session = Arc::clone(self);
        self.handler.on_init(Box::new(move || {
            if let Err(e) = session.arm() {
                *session.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                control.stop(hvprobe_vmm::StopReason::Stopped);
            }
        }));
    }

    /// Why arming failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Adds the probes of a spec text on the running guest, as writing it to
    /// `kprobe_events` does (`-:` lines remove probes, also ones added before). Every
    /// problem of the text at once; the `-:` lines take effect first (so a text can
    /// redefine an event), then the new probes go in all or none, in one pause.
    pub fn add(&self, text: &str, source: &str) -> Result<AddReport, SessionError> {
        let (text, requests, request_errors) = take_request_lines(text, source);
        let (probes, removals, mut problems) = parse_spec_text(&text, source, self.cpus);
        let request_lines = requests.iter().map(|r| origin_line(&r.origin));
        for line in request_lines.chain(request_errors.iter().map(error_line)) {
            problems.push((
                line,
                format!(
                    "{source}:{line}: filters and triggers are set with the run (--probes FILE, --filter, --trigger)"
                ),
            ));
        }
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let (tracer, symbols) = self.live_tracer()?;
        let existing = tracer.events();
        let mut to_remove = Vec::new();
        for r in &removals {
            let before = to_remove.len();
            to_remove.extend(
                existing
                    .iter()
                    .filter(|(_, g, e)| *e == r.event && r.group.as_ref().is_none_or(|rg| rg == g))
                    .map(|(id, g, e)| (*id, format!("{g}/{e}"))),
            );
            if to_remove.len() == before {
                problems.push((
                    r.line,
                    format!(
                        "{source}:{}: -:{}{}: no such event",
                        r.line,
                        r.group.as_ref().map(|g| format!("{g}/")).unwrap_or_default(),
                        r.event
                    ),
                ));
            }
        }
        // Every problem of the text at once: its syntax, its removals and its probes. (The
        // probes are checked again after the removals, which may free their names.)
        if !problems.is_empty() {
            problems.extend(expand_and_check(&tracer, symbols, source, &probes).2);
            spec_result(source, problems)?;
        }
        if !to_remove.is_empty() {
            let ids: Vec<ProbeId> = to_remove.iter().map(|(id, _)| *id).collect();
            tracer
                .unregister_many(&ids)
                .map_err(|e| self.probe_error(&to_remove, e))?;
        }
        let (mut armed, wildcards) = plan(&tracer, symbols, source, &probes)?;
        // An event of the run's filters and triggers keeps them, also when added again.
        if let Some(analysis) = self.events.analysis.get() {
            for p in &mut armed {
                with_analysis(&mut p.request, analysis);
            }
        }
        let requests = armed.iter().map(|p| p.request.clone()).collect();
        let pauses = || {
            self.kernel
                .get()
                .map(|k| k.control.counters.pauses.load(Ordering::Relaxed))
        };
        let (pauses_before, started) = (pauses(), Instant::now());
        tracer.register_all(requests).map_err(|(i, e)| SessionError::Spec {
            origin: source.to_owned(),
            problems: vec![refusal(source, &armed[i], &e)],
        })?;
        let arm_time = started.elapsed();
        let arm_pauses = pauses().zip(pauses_before).map(|(after, before)| after - before);
        Ok(AddReport {
            arm_time,
            arm_pauses: arm_pauses.unwrap_or(0),
            added: armed
                .iter()
                .map(|p| format!("{}/{}", p.request.group, p.request.event))
                .collect(),
            removed: to_remove.into_iter().map(|(_, name)| name).collect(),
            wildcards,
        })
    }

    /// The probes whose events match any of `patterns` (see [`event_matches`]); every
    /// pattern must match something.
    fn matching(&self, tracer: &Tracer, patterns: &[String]) -> Result<Vec<(ProbeId, String)>, SessionError> {
        let events = tracer.events();
        let mut found = Vec::new();
        for pattern in patterns {
            let before = found.len();
            found.extend(
                events
                    .iter()
                    .filter(|(_, g, e)| event_matches(pattern, g, e))
                    .map(|(id, g, e)| (*id, format!("{g}/{e}"))),
            );
            if found.len() == before {
                return Err(SessionError::NoSuchEvent(pattern.clone()));
            }
        }
        found.sort_by_key(|(id, _)| *id);
        found.dedup_by_key(|(id, _)| *id);
        Ok(found)
    }

    /// Removes the probes of the events `patterns` name (`GRP/EVENT`, `EVENT`, `GRP/`, with
    /// globs), in one request: every pattern must match a probe, or nothing is removed.
    pub fn remove(&self, patterns: &[String]) -> Result<Vec<String>, SessionError> {
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let (tracer, _) = self.live_tracer()?;
        let found = self.matching(&tracer, patterns)?;
        let ids: Vec<ProbeId> = found.iter().map(|(id, _)| *id).collect();
        tracer.unregister_many(&ids).map_err(|e| self.probe_error(&found, e))?;
        Ok(found.into_iter().map(|(_, name)| name).collect())
    }

    /// An engine error about one of `probes`, named by its event.
    fn probe_error(&self, probes: &[(ProbeId, String)], e: ProbeError) -> SessionError {
        let event = match &e {
            ProbeError::NoSuchProbe(id) => probes.iter().find(|(p, _)| p == id).map(|(_, n)| n.clone()),
            _ => None,
        };
        SessionError::Probe {
            event: event.unwrap_or_default(),
            source: Box::new(e),
        }
    }

    /// Enables or disables the probes of the events `patterns` name; with no pattern, the
    /// global switch (Linux's kprobes' debugfs `kprobes/enabled`), which keeps each probe's own
    /// state.
    pub fn set_enabled(&self, patterns: &[String], enabled: bool) -> Result<Vec<String>, SessionError> {
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let (tracer, _) = self.live_tracer()?;
        if patterns.is_empty() {
            tracer.set_armed(enabled);
            return Ok(Vec::new());
        }
        let found = self.matching(&tracer, patterns)?;
        let ids: Vec<ProbeId> = found.iter().map(|(id, _)| *id).collect();
        tracer
            .set_enabled_many(&ids, enabled)
            .map_err(|e| self.probe_error(&found, e))?;
        Ok(found.into_iter().map(|(_, name)| name).collect())
    }

    /// The optimization switch, now and for the engine still to be built.
    pub fn set_optimization(&self, on: bool) -> Result<(), SessionError> {
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let (tracer, _) = self.live_tracer()?;
        tracer.set_optimization(on);
        Ok(())
    }

    /// Whether probes are jump-optimized.
    pub fn optimization(&self) -> bool {
        self.handler.tracer().map_or(self.optimize, |t| t.optimization())
    }

    /// Whether the global switch is on (no engine yet counts as on).
    pub fn is_armed(&self) -> bool {
        self.handler.tracer().is_none_or(|t| t.is_armed())
    }

    /// A new stream of hit events, `queue` of them held for a slow reader before more are
    /// dropped (and counted in [`Subscription::dropped`]).
    pub fn subscribe(&self, queue: usize) -> Subscription {
        let (tx, rx) = std::sync::mpsc::sync_channel(queue.max(1));
        let dropped = Arc::new(AtomicU64::new(0));
        self.events
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(EventStream {
                tx,
                dropped: Arc::clone(&dropped),
            });
        Subscription {
            events: rx,
            dropped,
            sym_offset: self.sym_offset,
        }
    }

    /// The listing: one line per probe, the debugfs `list` layout plus hits, nmissed and
    /// the event's name.
    pub fn listing(&self) -> String {
        let Some(tracer) = self.handler.tracer() else {
            return String::new();
        };
        let analysis = self.events.analysis.get();
        tracer
            .listing()
            .iter()
            .map(|e| {
                // A filtered-out hit is a hit (as in kprobe_profile) that went no further,
                // discarded on the host or already in the guest by an event detour.
                let filtered = analysis
                    .and_then(|a| e.event.split_once('/').and_then(|(g, ev)| a.get(g, ev)))
                    .and_then(|a| a.filtered())
                    .map(|n| format!(" filtered={}", n + e.filtered_in_guest))
                    .unwrap_or_default();
                format!("{}{filtered}\n", listing_line(e))
            })
            .collect()
    }

    /// The histograms of the hist triggers, as `--format` says (empty without any).
    pub fn hist_report(&self) -> String {
        match self.events.analysis.get() {
            Some(analysis) => hist_report(analysis, self.format, self.kernel.get().map(|k| &k.symbols)),
            None => String::new(),
        }
    }

    /// After the run: ends every event stream and waits for the printer, prints the
    /// listing and the engine's counters, and removes every probe (the guest's text is as
    /// before).
    pub fn finish(&self) {
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        self.finished.store(true, Ordering::Release);
        // The last records of event detours go to the printer and the streams before they
        // close: drained after, they would be hits that nobody printed.
        if let Some(tracer) = self.handler.tracer() {
            tracer.drain_events();
        }
        self.events.close();
        let printer = self.printer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(printer) = printer {
            let _ = printer.join();
        }
        let Some(tracer) = self.handler.tracer() else {
            return;
        };
        eprint!("{}", self.listing());
        tracer.unregister_all();
        log_trace_clock(tracer);
        // Every hit is in now (the rings are drained when the probes go).
        print_on_own_lines(&self.hist_report(), &self.console);
        if let Some(analysis) = self.events.analysis.get() {
            let with_filter = analysis.events().filter(|a| a.filtered().is_some()).count();
            if with_filter > 0 {
                let in_guest = tracer.stats.filtered_in_guest.load(Ordering::Relaxed);
                eprintln!(
                    "hvprobe: filters on {with_filter} event(s) discarded {} hits ({in_guest} of them in the guest, by event detours)",
                    analysis.total_filtered() + in_guest
                );
            }
        }
        let s = &tracer.stats;
        use std::sync::atomic::Ordering::Relaxed;
        eprintln!(
            "hvprobe: probe hits {} (optimized: recorded in the guest {}, sync {}; emulated {}, stepped out of line {}, skipped by a handler {}, shared with a guest int3 {}); records the guest's rings missed {}",
            s.hits.load(Relaxed),
            s.optimized_events.load(Relaxed),
            s.optimized.load(Relaxed),
            s.emulated.load(Relaxed),
            s.stepped.load(Relaxed),
            s.skipped.load(Relaxed),
            s.shared_with_guest.load(Relaxed),
            s.ring_missed.load(Relaxed)
        );
        eprintln!(
            "hvprobe: probes gone {}, steps an exception or NMI interrupted {}, emulations stepped instead {}, \
             return-probe calls that never returned {}",
            s.gone.load(Relaxed),
            s.steps_interrupted.load(Relaxed),
            s.emulation_fallbacks.load(Relaxed),
            s.returns_abandoned.load(Relaxed)
        );
        let rejected = s.ring_rejected.load(Relaxed);
        if rejected > 0 {
            eprintln!(
                "hvprobe: the guest wrote {rejected} impossible things into the event rings (records naming \
                 another CPU than their ring's, counters growing faster than its vCPUs can hit), refused: \
                 the counts of probes recorded in the guest are not to be trusted (--no-optimize traps every hit)"
            );
        }
        let stacks = s.stacks_unwound.load(Relaxed);
        if stacks > 0 {
            eprintln!(
                "hvprobe: kernel stacks unwound {stacks}, {:.1} us each on the host",
                s.unwind_ns.load(Relaxed) as f64 / stacks as f64 / 1000.0
            );
        }
    }

    /// Prints the listing on SIGUSR1 while the run lasts.
    pub fn listing_on_sigusr1(self: &Arc<Self>) -> Result<(), String> {
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
            .map_err(|e| format!("cannot watch SIGUSR1: {e}"))?;
        let session = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("listing-on-sigusr1".into())
            .spawn(move || {
                for _ in signals.forever() {
                    match session.upgrade() {
                        Some(s) => {
                            eprint!("{}", s.listing());
                            print_on_own_lines(&s.hist_report(), &s.console);
                        }
                        None => return,
                    }
                }
            })
            .map_err(|e| format!("cannot watch SIGUSR1: {e}"))?;
        Ok(())
    }
}

/// One hit in `format`, without the last newline: a line, or for a text hit with a kernel
/// stack the event's line and the stack's lines (frames with offsets with `sym_offset`).
pub fn event_line(event: &HitEvent, format: OutputFormat, sym_offset: bool) -> String {
    match format {
        OutputFormat::Json => json_line(&event.record),
        OutputFormat::Text | OutputFormat::None => ftrace_text(&event.record, sym_offset),
    }
}

/// Prints events as they come, a batch of lines at a time, and writes them to the Perfetto
/// trace (if any), which is finished when the queue ends (the run's end, however it ends).
fn print_events(
    rx: Receiver<HitEvent>,
    format: OutputFormat,
    sym_offset: bool,
    console: ConsoleLog,
    mut perfetto: Option<PerfettoFile>,
) {
    let mut stdout = (format != OutputFormat::None).then(|| StdoutPrinter::new(format, sym_offset, console));
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(event) = next {
            if let Some(printer) = &mut stdout {
                printer.push(&event);
            }
            if let Some(file) = &mut perfetto {
                file.write_hit(&event.record);
            }
            taken += 1;
            // A batch is printed (and the trace flushed) at 64 KiB of text or 4096 hits.
            let full = taken >= 4096 || stdout.as_ref().is_some_and(|p| p.batch.len() >= 1 << 16);
            next = if full { None } else { rx.try_recv().ok() };
        }
        if let Some(printer) = &mut stdout {
            if !printer.flush() {
                if perfetto.is_none() {
                    // stdout is gone (a closed pipe): the hits from now on are missed.
                    return;
                }
                // The trace file still takes every hit.
                stdout = None;
            }
        }
        if let Some(file) = &mut perfetto {
            file.flush();
        }
    }
    if let Some(file) = perfetto {
        let path = file.path().display().to_string();
        match file.finish() {
            Ok(summary) => eprintln!("hvprobe: {}", crate::perfetto::summary_line(&path, &summary)),
            Err(e) => eprintln!("hvprobe: error: {e}"),
        }
    }
}

/// Hit lines for stdout, a batch at a time. stdout is shared with the guest's console,
/// which prints a byte at a time: a batch goes out under stdout's lock, only when the
/// console is at the start of a line, so neither splits the other's lines.
struct StdoutPrinter {
    format: OutputFormat,
    /// `--sym-offset`: stack frames with their offsets.
    sym_offset: bool,
    console: ConsoleLog,
    batch: String,
    /// The console's byte count when a batch of ours last broke one of its lines: as long
    /// as it has printed nothing since, stdout is at the start of a line (ours).
    broke_line_at: Option<u64>,
}

impl StdoutPrinter {
    fn new(format: OutputFormat, sym_offset: bool, console: ConsoleLog) -> Self {
        StdoutPrinter {
            format,
            sym_offset,
            console,
            batch: String::new(),
            broke_line_at: None,
        }
    }

    fn push(&mut self, event: &HitEvent) {
        self.batch.push_str(&event_line(event, self.format, self.sym_offset));
        self.batch.push('\n');
    }

    /// Prints the batch; false when stdout cannot be written any more.
    fn flush(&mut self) -> bool {
        if self.batch.is_empty() {
            return true;
        }
        let console = &self.console;
        let broke_line_at = self.broke_line_at;
        let at_line_start = || console.at_line_start() || broke_line_at == Some(console.written());
        let (mut out, at_line) = lock_stdout_at_line(console, at_line_start);
        if !at_line {
            self.batch.insert(0, '\n');
            self.broke_line_at = Some(console.written());
        }
        let written = out.write_all(self.batch.as_bytes()).and_then(|()| out.flush()).is_ok();
        self.batch.clear();
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_patterns_name_an_event_a_group_or_a_glob_of_them() {
        for (pattern, group, event, matches) in [
            ("grp/ev", "grp", "ev", true),
            ("grp/ev", "other", "ev", false),
            ("ev", "any", "ev", true),
            ("grp/", "grp", "whatever", true),
            ("grp/", "grpx", "whatever", false),
            ("vfs/p_vfs_*", "vfs", "p_vfs_read_0", true),
            ("vfs/p_vfs_*", "vfs", "p_do_sys_open_0", false),
            ("*/ev", "a", "ev", true),
        ] {
            assert_eq!(
                event_matches(pattern, group, event),
                matches,
                "{pattern} vs {group}/{event}"
            );
        }
    }

    #[test]
    fn a_spec_text_returns_its_probes_and_the_removals_it_cannot_resolve() {
        let text = "p:a/x vfs_read\n-:a/x\n-:b/gone\np:a/y do_sys_open\nbad line\n";
        let (probes, removals, problems) = parse_spec_text(text, "t", 1);
        assert_eq!(probes.iter().map(|p| p.line).collect::<Vec<_>>(), [4]);
        assert_eq!(
            removals.iter().map(|r| (r.line, r.event.as_str())).collect::<Vec<_>>(),
            [(3, "gone")]
        );
        assert_eq!(problems.iter().map(|(l, _)| *l).collect::<Vec<_>>(), [5]);
    }

    /// A made-up kernel: two functions and a data symbol.
    fn symbols() -> SymbolTable {
        use hvprobe_arch::Gva;
        use hvprobe_introspection::symbols::{Symbol, SymbolSource};
        let symbol = |name: &str, addr: u64, kind: char| Symbol {
            name: name.to_owned(),
            addr: Gva(addr),
            kind,
            size: Some(0x40),
        };
        SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![
                symbol("vfs_read", 0xffff_ffff_8100_0000, 'T'),
                symbol("vfs_write", 0xffff_ffff_8100_0040, 'T'),
                symbol("_sdata", 0xffff_ffff_8200_0000, 'D'),
            ],
        )
    }

    fn check_file(name: &str, text: &str) -> Result<(), SessionError> {
        let path = std::env::temp_dir().join(format!("hvprobe-trace-{}-{name}.probes", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let result = check_before_boot(&path, 1, Some(&symbols()), None, &AnalysisFlags::default());
        let _ = std::fs::remove_file(&path);
        result
    }

    #[test]
    fn a_fetch_arg_symbol_the_kernel_lacks_is_refused_before_boot_at_its_column() {
        let e = check_file(
            "data-symbols",
            "p:b/ok vfs_read @_sdata\np:b/x vfs_read @nosuchsymbol\np:b/y vfs_read a=+0(@_sdata*10):u32\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("2 problems in "), "{e}");
        assert!(
            e.contains(".probes:2:16: no symbol `nosuchsymbol` in the kernel"),
            "{e}"
        );
        assert!(e.contains(".probes:3:21: no symbol `_sdata*10` in the kernel"), "{e}");
    }

    #[test]
    fn probe_points_are_checked_before_boot_at_linux_columns() {
        let e = check_file("points", "p:a/ok vfs_read\np:a/typo vfs_raed\np:a/far vfs_read+0x100\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains(".probes:2:10: unknown symbol \"vfs_raed\""), "{e}");
        assert!(e.contains(".probes:3:9: vfs_read+0x100 is outside vfs_read"), "{e}");
        check_file(
            "fine",
            "p:a/ok vfs_read @_sdata+8 count $arg*\nr:a/r vfs_write $retval\n",
        )
        .unwrap();
    }

    #[test]
    fn several_problems_read_as_a_count_then_one_per_line() {
        let e = SessionError::Spec {
            origin: "f".into(),
            problems: vec!["f:1: a".into(), "f:3: b".into()],
        };
        assert_eq!(e.to_string(), "2 problems in f:\nf:1: a\nf:3: b");
        let e = SessionError::Spec {
            origin: "f".into(),
            problems: vec!["f:1: a".into()],
        };
        assert_eq!(e.to_string(), "f:1: a");
    }
}
