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
use hvprobe_probes::machine::PauseFailed;
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

use crate::error::SessionError;
use crate::filters_and_triggers::{error_line, hist_report, origin_line, take_request_lines};
use crate::kernel_source::KernelSourceFiles;
use crate::options::{AnalysisFlags, OutputFormat, TraceOptions};
use crate::perfetto::PerfettoFile;

mod fanout;
mod functions;
mod printer;
mod spec;

pub use fanout::Subscription;
use fanout::*;
pub use functions::function_requests;
use functions::{FunctionPlan, PrintMode};
pub use printer::event_line;
use printer::*;
pub use spec::check_before_boot;
use spec::*;

/// Events a slow printer has not taken yet; beyond this, hits count as missed.
const EVENT_QUEUE: usize = 1 << 16;

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
    /// The kernel's DWARF, for source targets (in the file and in `probe add`).
    kernel_source: Arc<KernelSourceFiles>,
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
    failure: Arc<Mutex<Option<Arc<SessionError>>>>,
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
    /// `--tracer`: the functions traced, when the run traces functions.
    functions: Option<FunctionPlan>,
}

/// `ftrace/`: the group of the function tracers' events.
const FUNCTION_EVENTS_PREFIX: &str = "ftrace/";

/// The function tracers' probes in the listing: per event, how many, their hits and
/// misses, how many are optimized and why the others are not.
fn function_listing(entries: &[&hvprobe_probes::output::ListEntry]) -> String {
    /// One event's probes, summed.
    #[derive(Default)]
    struct Sum {
        probes: usize,
        hits: u64,
        nmissed: u64,
        optimized: usize,
        why: BTreeMap<String, usize>,
    }
    let mut events: BTreeMap<&str, Sum> = BTreeMap::new();
    for e in entries {
        let sum = events.entry(e.event.as_str()).or_default();
        sum.probes += 1;
        sum.hits += e.hits;
        sum.nmissed += e.nmissed;
        sum.optimized += usize::from(e.optimized);
        if let Some(reason) = e.not_optimized.as_deref().or(e.return_trapped.as_deref()) {
            *sum.why.entry(reason_kind(reason)).or_default() += 1;
        }
    }
    events
        .iter()
        .map(|(event, sum)| {
            let Sum {
                probes,
                hits,
                nmissed,
                optimized,
                why,
            } = sum;
            let why: Vec<String> = why.iter().map(|(r, n)| format!("{n}: {r}")).collect();
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(" (not optimized or trapping: {})", why.join("; "))
            };
            format!("{event}: {probes} functions, hits={hits} nmissed={nmissed}, optimized {optimized}{why}\n")
        })
        .collect()
}

/// A reason without what is particular to one site (its instruction, its addresses), so
/// that the reasons of thousands of sites count up by kind.
fn reason_kind(reason: &str) -> String {
    // Instructions are quoted in backticks, addresses are `0x` numbers.
    let mut unquoted = String::with_capacity(reason.len());
    let mut rest = reason;
    while let Some((before, after)) = rest.split_once('`') {
        unquoted.push_str(before);
        match after.split_once('`') {
            Some((_, tail)) => {
                unquoted.push_str("`…`");
                rest = tail;
            }
            None => {
                unquoted.push('`');
                rest = after;
            }
        }
    }
    unquoted.push_str(rest);
    let address = |w: &str| {
        w.strip_prefix("0x")
            .is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    unquoted
        .split(' ')
        .map(|word| {
            let bare = word.trim_end_matches([',', ':', ')', ';']);
            match address(bare) {
                true => format!("ADDR{}", &word[bare.len()..]),
                false => word.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The function tracer's probes that the engine would place now, and the line that says
/// how many, with every refusal counted by its reason (best effort per function).
fn check_functions(
    tracer: &Tracer,
    functions: &FunctionPlan,
    symbols: &SymbolTable,
    cpus: usize,
) -> (Vec<SpecProbe>, String) {
    let probes = functions.probes(symbols, cpus);
    let requests: Vec<KprobeRequest> = probes.iter().map(|p| p.request.clone()).collect();
    let mut refused = vec![false; probes.len()];
    let mut skipped: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (i, e) in tracer.check_all(&requests) {
        refused[i] = true;
        // A function_graph function's return probe goes with its entry probe.
        if !matches!(probes[i].request.kind, ProbeKind::Kretprobe { .. }) {
            *skipped.entry(refusal_kind(&e)).or_default() += 1;
        }
    }
    // Both probes of a function, or neither.
    let site = |p: &SpecProbe| match p.request.point {
        ProbePoint::Address(at) => Some(at),
        _ => None,
    };
    let refused_sites: std::collections::BTreeSet<hvprobe_arch::Gva> = probes
        .iter()
        .zip(&refused)
        .filter(|(_, r)| **r)
        .filter_map(|(p, _)| site(p))
        .collect();
    for (p, r) in probes.iter().zip(refused.iter_mut()) {
        *r |= site(p).is_some_and(|at| refused_sites.contains(&at));
    }
    let kept: Vec<SpecProbe> = probes
        .into_iter()
        .zip(&refused)
        .filter(|(_, r)| !**r)
        .map(|(p, _)| p)
        .collect();
    let note = functions.summary(kept.len(), &skipped);
    (kept, note)
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
    /// What hvprobe keeps in the guest at `at` (a detour, an out-of-line copy), if the
    /// engine is attached and the address is its out-of-line area.
    pub fn out_of_line_place(&self, at: hvprobe_arch::Gva) -> Option<hvprobe_probes::engine::OutOfLinePlace> {
        self.handler.tracer()?.out_of_line_place(at)
    }

    /// Parses the probe file (if any) and starts the printer. Nothing touches the guest yet.
    /// `optimize` is the run's choice (`options.optimize` or the backend's default).
    pub fn new(options: &TraceOptions, optimize: bool, vm: &Vm) -> Result<TraceSession, SessionError> {
        let probes_file = options.probes.as_deref();
        let kernel_source = options.kernel_source.clone();
        let (outputs, sym_offset, clock, analysis) =
            (&options.output, options.sym_offset, options.clock, &options.analysis);
        let cpus = vm.control().vcpu_count();
        let (initial, mut requests) = match probes_file {
            Some(file) => read_spec_file(file, cpus, &kernel_source)?,
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
        let functions = options
            .functions
            .as_ref()
            .map(|f| FunctionPlan::new(f, &kernel_source, cpus))
            .transpose()?;
        let mode = functions.as_ref().map_or(PrintMode::Probes, FunctionPlan::print_mode);
        let pids = functions.as_ref().map(|f| f.pids().to_vec()).unwrap_or_default();
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
                    .spawn(move || {
                        print_events(
                            rx,
                            Layout {
                                format,
                                sym_offset,
                                mode,
                                pids,
                            },
                            console,
                            perfetto,
                        )
                    })
                    .map_err(|source| SessionError::Thread {
                        what: "trace printer",
                        source,
                    })?;
                (Some(tx), Some(printer))
            }
        };
        Ok(TraceSession {
            file: probes_file.map(Path::to_path_buf),
            kernel_source,
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
            functions,
        })
    }

    /// Whether probes go in at the start: a probe file, or a function tracer.
    pub fn has_file(&self) -> bool {
        self.file.is_some() || self.functions.is_some()
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
        if !self.has_file() {
            return Ok(());
        }
        let _changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let tracer = self.attach_tracer()?;
        let (mut armed, notes) = plan(&tracer, symbols, &self.source(), &self.initial)?;
        for note in notes {
            eprintln!("hvprobe: {note}");
        }
        if let Some(functions) = &self.functions {
            let (probes, note) = check_functions(&tracer, functions, symbols, self.cpus);
            eprintln!("hvprobe: {note}");
            armed.extend(probes);
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
        tracer
            .set_optimization(self.optimize)
            .map_err(SessionError::of_all_probes)?;
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
                let paused = kernel.control.pause_all().map_err(|e| PauseFailed(Box::new(e)))?;
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
    pub fn arm(&self) -> Result<(), SessionError> {
        if self.has_file() {
            let tracer = self.handler.tracer().ok_or(SessionError::NotAttached)?;
            let mut probes: Vec<&SpecProbe> = self.planned.get().ok_or(SessionError::NotChecked)?.iter().collect();
            let source = self.source();
            // A function tracer's probe refused now (the guest changed that text since the
            // check) is left out and the rest armed again; a file's fails the run.
            loop {
                let requests = probes.iter().map(|p| p.request.clone()).collect();
                match tracer.register_all(requests) {
                    Ok(_) => break,
                    Err((i, e)) if probes[i].line == 0 => {
                        eprintln!("hvprobe: function tracer: {} left out: {e}", probes[i].text);
                        probes.remove(i);
                    }
                    Err((i, e)) => {
                        return Err(SessionError::Spec {
                            problems: vec![refusal(&source, probes[i], &e)],
                            origin: source.clone(),
                        })
                    }
                }
            }
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
                *session.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(e));
                control.stop(hvprobe_vmm::StopReason::Stopped);
            }
        }));
    }

    /// Why arming failed, if it did.
    pub fn failure(&self) -> Option<Arc<SessionError>> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Adds the probes of a spec text on the running guest, as writing it to
    /// `kprobe_events` does (`-:` lines remove probes, also ones added before). Every
    /// problem of the text at once; the `-:` lines take effect first (so a text can
    /// redefine an event), then the new probes go in all or none, in one pause.
    pub fn add(&self, text: &str, source: &str) -> Result<AddReport, SessionError> {
        let (text, requests, request_errors) = take_request_lines(text, source);
        let (probes, removals, mut problems) = parse_spec_text(&text, source, self.cpus, &self.kernel_source);
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
            tracer.set_armed(enabled).map_err(SessionError::of_all_probes)?;
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
        tracer.set_optimization(on).map_err(SessionError::of_all_probes)
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
        let listing = tracer.listing();
        // A function tracer's thousands of probes are summed up, a line per event.
        let (functions, probes): (Vec<_>, Vec<_>) = listing
            .iter()
            .partition(|e| self.functions.is_some() && e.event.starts_with(FUNCTION_EVENTS_PREFIX));
        let mut text = function_listing(&functions);
        text += &probes
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
            .collect::<String>();
        text
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
        if let Err(e) = tracer.unregister_all() {
            eprintln!("hvprobe: the probes could not be taken out of the guest's text: {e}");
        }
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
            "hvprobe: probes gone {}, steps an exception or NMI interrupted {}, step traps the backend lost {}, \
             emulations stepped instead {}, return-probe calls that never returned {}",
            s.gone.load(Relaxed),
            s.steps_interrupted.load(Relaxed),
            s.step_traps_lost.load(Relaxed),
            s.emulation_fallbacks.load(Relaxed),
            s.returns_abandoned.load(Relaxed)
        );
        let rejected = s.ring_rejected.load(Relaxed);
        if rejected > 0 {
            eprintln!(
                "hvprobe: the guest wrote {rejected} impossible things into the event rings (records naming \
                 another CPU than their ring's, counters growing faster than its vCPUs can hit), refused: \
                 the counts of probes recorded in the guest are not to be trusted (--optimize off traps every hit)"
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
    pub fn listing_on_sigusr1(self: &Arc<Self>) -> Result<(), SessionError> {
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1]).map_err(|source| {
            SessionError::Signal {
                signal: "SIGUSR1",
                source,
            }
        })?;
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
            .map_err(|source| SessionError::Thread {
                what: "SIGUSR1 listing",
                source,
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sites_reason_counts_by_kind_without_its_instruction_and_addresses() {
        assert_eq!(
            reason_kind(
                "`btr qword ptr [rdi],17h` at 0xffffffff810293e5 cannot run displaced: opcode 0f ba is not one"
            ),
            "`…` at ADDR cannot run displaced: opcode 0f ba is not one"
        );
        assert_eq!(
            reason_kind("vCPU 0 is stopped inside the region at 0xffffffff81000010 (tried again)"),
            "vCPU 0 is stopped inside the region at ADDR (tried again)"
        );
    }

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

    /// Two lines may name one event when they record the same fields (Linux 5.7's
    /// multi-probe events: `p:a/x f1 v=%di` then `p:a/x f2 v=%si` is one event over two
    /// probes); with other fields, or of another kind, the second is refused.
    #[test]
    fn lines_of_one_event_must_record_the_same_fields() {
        let none = KernelSourceFiles::none();
        let (probes, _, problems) = parse_spec_text("p:a/x vfs_read v=%di\np:a/x vfs_write v=%si\n", "t", 1, &none);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(probes.len(), 2);
        for text in [
            "p:a/x vfs_read v=%di\np:a/x vfs_write w=%si\n",
            "p:a/x vfs_read v=%di\np:a/x vfs_write v=%si:u32\n",
            "p:a/x vfs_read v=%di\nr:a/x vfs_write v=%si\n",
        ] {
            let (probes, _, problems) = parse_spec_text(text, "t", 1, &none);
            assert_eq!(probes.len(), 1, "{text}");
            assert!(
                problems[0].1.contains("event a/x is already defined on line 1"),
                "{problems:?}"
            );
        }
    }

    #[test]
    fn a_spec_text_returns_its_probes_and_the_removals_it_cannot_resolve() {
        let text = "p:a/x vfs_read\n-:a/x\n-:b/gone\np:a/y do_sys_open\nbad line\n";
        let (probes, removals, problems) = parse_spec_text(text, "t", 1, &KernelSourceFiles::none());
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
        let result = check_before_boot(
            &path,
            1,
            Some(&symbols()),
            None,
            &KernelSourceFiles::none(),
            &AnalysisFlags::default(),
        );
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
}
