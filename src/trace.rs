//! `hvprobe run --probes FILE`: the probes of a spec file, armed in a running guest, their
//! hits printed as they happen and the listing printed at the end (and on SIGUSR1).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{build_tracer, ProbeHandler, TaskContext};
use hvprobe_probes::engine::{
    default_maxactive, EventSink, HitEvent, KprobeRequest, ProbeError, ProbeKind, ProbePoint,
};
use hvprobe_probes::output::{ftrace_line, json_line, listing_line};
use hvprobe_probes::spec::{
    default_event_name, is_wildcard_pattern, parse_file_all_errors, wildcard_matches, ProbeSpec, Target,
};
use hvprobe_vmm::{ConsoleLog, VcpuControl, VcpuState, Vm};
use vm_memory::GuestMemoryMmap;

use crate::cli::OutputFormat;

/// Events a slow printer has not taken yet; beyond this, hits count as missed.
const EVENT_QUEUE: usize = 1 << 16;

/// A probe from the spec file, with its line for error messages.
#[derive(Clone)]
struct SpecProbe {
    line: usize,
    request: KprobeRequest,
}

/// The probes of one run and where their output goes.
pub struct TraceSession {
    file: PathBuf,
    /// As the file gives them (a wildcard is one entry).
    probes: Vec<SpecProbe>,
    /// What is armed: the file's probes with every wildcard replaced by one probe per
    /// function it matches that can be probed (set once the kernel's symbols are known).
    expanded: OnceLock<Vec<SpecProbe>>,
    pub handler: Arc<ProbeHandler>,
    sink: Arc<ChannelSink>,
    printer: Mutex<Option<JoinHandle<()>>>,
    /// Why arming failed (it happens on a vCPU thread).
    failure: Arc<Mutex<Option<String>>>,
}

struct ChannelSink {
    tx: Mutex<Option<SyncSender<HitEvent>>>,
}

impl EventSink for ChannelSink {
    fn try_send(&self, event: HitEvent) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.as_ref().is_some_and(|tx| tx.try_send(event).is_ok())
    }
}

/// Reads and checks a spec file: syntax, and what this version supports.
fn read_spec_file(path: &Path, cpus: usize) -> Result<Vec<SpecProbe>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read probe file {}: {e}", path.display()))?;
    // Every problem of the file at once, in line order: one round of fixing.
    let (specs, errors) = parse_file_all_errors(&text, &path.display().to_string());
    let mut problems: Vec<(usize, String)> = errors.iter().map(|e| (e.line, e.to_string())).collect();
    let mut probes: Vec<SpecProbe> = Vec::new();
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
                    problems.push((
                        line,
                        format!(
                            "{}:{line}: -:{}{event}: no such event defined above",
                            path.display(),
                            group.map(|g| format!("{g}/")).unwrap_or_default()
                        ),
                    ));
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
                    "{}:{line}: event {group}/{event} is already defined on line {}",
                    path.display(),
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
            request: KprobeRequest {
                kind,
                ..KprobeRequest::event(point, &group, &event, args)
            },
        });
    }
    if problems.is_empty() {
        Ok(probes)
    } else {
        problems.sort_by_key(|(line, _)| *line);
        Err(all_problems(path, problems.into_iter().map(|(_, p)| p).collect()))
    }
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

/// Several problems of one spec file as one error: a count, then one per line.
fn all_problems(path: &Path, problems: Vec<String>) -> String {
    match problems.len() {
        1 => problems.into_iter().next().unwrap_or_default(),
        n => format!("{n} problems in {}:\n{}", path.display(), problems.join("\n")),
    }
}

impl TraceSession {
    /// Parses the probe file and starts the printer. Nothing touches the guest yet.
    pub fn new(probes_file: &Path, format: OutputFormat, vm: &Vm) -> Result<TraceSession, String> {
        let probes = read_spec_file(probes_file, vm.control().vcpu_count())?;
        let console = vm.console_log();
        let (tx, rx) = std::sync::mpsc::sync_channel(EVENT_QUEUE);
        let printer = std::thread::Builder::new()
            .name("trace-printer".into())
            .spawn(move || print_events(rx, format, console))
            .map_err(|e| format!("cannot start the trace printer: {e}"))?;
        Ok(TraceSession {
            file: probes_file.to_path_buf(),
            probes,
            expanded: OnceLock::new(),
            handler: ProbeHandler::new(vm),
            sink: Arc::new(ChannelSink {
                tx: Mutex::new(Some(tx)),
            }),
            printer: Mutex::new(Some(printer)),
            failure: Arc::new(Mutex::new(None)),
        })
    }

    /// Once the kernel is up (vCPUs paused, `state` one of theirs): reads the kernel facts
    /// the engine checks probes against, maps the out-of-line area and attaches a tracer.
    /// Checks that every probe's symbol exists, so a typo fails before the guest goes on.
    pub fn prepare(
        &self,
        control: Arc<VcpuControl>,
        mem: &GuestMemoryMmap,
        state: &VcpuState,
        symbols: &SymbolTable,
        tasks: Option<TaskContext>,
    ) -> Result<(), String> {
        let sink: Arc<dyn EventSink> = self.sink.clone();
        let tracer = build_tracer(control, mem, state, symbols, Some(sink)).map_err(|e| e.to_string())?;
        // Every refusal at once, before the guest goes on (arming re-checks each probe in
        // the pause, in case the guest's text changed meanwhile). A wildcard's functions
        // that cannot be probed are skipped and counted instead.
        let mut expanded = Vec::new();
        let mut wildcard_of = Vec::new();
        for (index, p) in self.probes.iter().enumerate() {
            match &p.request.point {
                ProbePoint::Symbol { name, .. } if is_wildcard_pattern(name) => {
                    let kind_is_return = matches!(p.request.kind, ProbeKind::Kretprobe { .. });
                    let mut functions: Vec<&str> = symbols
                        .symbols()
                        .iter()
                        .filter(|s| s.is_text() && wildcard_matches(name, &s.name))
                        .map(|s| s.name.as_str())
                        .collect();
                    functions.sort_unstable();
                    functions.dedup();
                    for function in functions {
                        let target = Target::Symbol {
                            name: function.to_string(),
                            offset: 0,
                        };
                        let mut request = p.request.clone();
                        request.event = default_event_name(kind_is_return, &target);
                        request.point = ProbePoint::Symbol {
                            name: function.to_string(),
                            offset: 0,
                        };
                        expanded.push(SpecProbe { line: p.line, request });
                        wildcard_of.push(Some(index));
                    }
                }
                _ => {
                    expanded.push(p.clone());
                    wildcard_of.push(None);
                }
            }
        }
        let requests: Vec<KprobeRequest> = expanded.iter().map(|p| p.request.clone()).collect();
        let mut problems = Vec::new();
        let mut skipped: BTreeMap<usize, BTreeMap<&'static str, usize>> = BTreeMap::new();
        let mut refused = vec![false; expanded.len()];
        for (i, e) in tracer.check_all(&requests) {
            if let Some(w) = wildcard_of[i] {
                *skipped.entry(w).or_default().entry(refusal_kind(&e)).or_default() += 1;
                refused[i] = true;
                continue;
            }
            problems.push(self.refusal(&expanded[i], &e));
        }
        if !problems.is_empty() {
            return Err(all_problems(&self.file, problems));
        }
        for (index, p) in self.probes.iter().enumerate() {
            let matched = wildcard_of.iter().filter(|w| **w == Some(index)).count();
            let pattern = match &p.request.point {
                ProbePoint::Symbol { name, .. } if is_wildcard_pattern(name) => name,
                _ => continue,
            };
            let reasons = skipped.get(&index);
            let n_skipped: usize = reasons.map(|r| r.values().sum()).unwrap_or(0);
            let why = reasons
                .map(|r| r.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", "))
                .unwrap_or_default();
            eprintln!(
                "hvprobe: {}:{}: {}: {matched} functions match, {} to arm, {n_skipped} skipped{}",
                self.file.display(),
                p.line,
                pattern,
                matched - n_skipped,
                if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({why})")
                }
            );
        }
        let armed: Vec<SpecProbe> = expanded
            .into_iter()
            .zip(refused)
            .filter(|(_, r)| !r)
            .map(|(p, _)| p)
            .collect();
        let _ = self.expanded.set(armed);
        self.handler.attach(tracer, tasks);
        Ok(())
    }

    /// `FILE:LINE: GRP/EVENT: reason`, for a probe the engine refused.
    fn refusal(&self, p: &SpecProbe, e: &ProbeError) -> String {
        format!(
            "{}:{}: {}/{}: {e}",
            self.file.display(),
            p.line,
            p.request.group,
            p.request.event
        )
    }

    /// Registers and arms every probe (all or none). Call with the guest where probes
    /// should start counting (at `/init`, or before a restored guest runs).
    pub fn arm(&self) -> Result<(), String> {
        let tracer = self.handler.tracer().ok_or("the probe engine is not attached")?;
        let probes = self
            .expanded
            .get()
            .ok_or("the probes were not checked against the kernel")?;
        let requests = probes.iter().map(|p| p.request.clone()).collect();
        tracer
            .register_all(requests)
            .map_err(|(i, e)| self.refusal(&probes[i], &e))?;
        tracing::info!("{} probe(s) armed", probes.len());
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

    /// The listing: one line per probe, the debugfs `list` layout plus hits and nmissed.
    pub fn listing(&self) -> String {
        let Some(tracer) = self.handler.tracer() else {
            return String::new();
        };
        tracer.check_gone();
        tracer
            .listing()
            .iter()
            .map(|e| format!("{}\n", listing_line(e)))
            .collect()
    }

    /// After the run: waits for the printer, prints the listing and the engine's counters,
    /// and removes every probe (the guest's text is as before).
    pub fn finish(&self) {
        let Some(tracer) = self.handler.tracer() else {
            return;
        };
        *self.sink.tx.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let printer = self.printer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(printer) = printer {
            let _ = printer.join();
        }
        eprint!("{}", self.listing());
        tracer.unregister_all();
        let s = &tracer.stats;
        use std::sync::atomic::Ordering::Relaxed;
        eprintln!(
            "hvprobe: probe hits {} (emulated {}, stepped out of line {}, skipped by a handler {}, shared with a guest int3 {})",
            s.hits.load(Relaxed),
            s.emulated.load(Relaxed),
            s.stepped.load(Relaxed),
            s.skipped.load(Relaxed),
            s.shared_with_guest.load(Relaxed)
        );
        eprintln!(
            "hvprobe: probes gone {}, steps an exception or NMI interrupted {}, emulations stepped instead {}, \
             return-probe calls that never returned {}",
            s.gone.load(Relaxed),
            s.steps_interrupted.load(Relaxed),
            s.emulation_fallbacks.load(Relaxed),
            s.returns_abandoned.load(Relaxed)
        );
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
                        Some(s) => eprint!("{}", s.listing()),
                        None => return,
                    }
                }
            })
            .map_err(|e| format!("cannot watch SIGUSR1: {e}"))?;
        Ok(())
    }
}

/// How long a batch of hit lines waits for the guest's console to finish its line (a
/// shell prompt never does) before it starts on a new line of its own.
const CONSOLE_LINE_WAIT: Duration = Duration::from_millis(100);

/// Prints events as they come, a batch of lines at a time. stdout is shared with the
/// guest's console, which prints a byte at a time: a batch goes out under stdout's lock,
/// only when the console is at the start of a line, so neither splits the other's lines.
fn print_events(rx: Receiver<HitEvent>, format: OutputFormat, console: ConsoleLog) {
    let mut batch = String::new();
    // The console's byte count when a batch of ours last broke one of its lines: as long
    // as it has printed nothing since, stdout is at the start of a line (ours).
    let mut broke_line_at = None;
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(event) = next {
            batch.push_str(&match format {
                OutputFormat::Text => ftrace_line(&event.record),
                OutputFormat::Json => json_line(&event.record),
            });
            batch.push('\n');
            next = if batch.len() < 1 << 16 {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        let at_line_start = || console.at_line_start() || broke_line_at == Some(console.written());
        let waiting = Instant::now();
        let mut out = std::io::stdout().lock();
        while !at_line_start() && waiting.elapsed() < CONSOLE_LINE_WAIT {
            drop(out);
            std::thread::sleep(Duration::from_millis(1));
            out = std::io::stdout().lock();
        }
        if !at_line_start() {
            batch.insert(0, '\n');
            broke_line_at = Some(console.written());
        }
        if out.write_all(batch.as_bytes()).and_then(|()| out.flush()).is_err() {
            return;
        }
        batch.clear();
    }
}
