//! What `hvprobe run` does around the guest, built once and the same for a booted and a
//! restored guest: the probes of `--probes` and of the control socket (the hit printer, the
//! listing on SIGUSR1 and at exit) and the kernel text hash of `--text-hash`. The two paths differ only in when the
//! kernel is up (a booted guest: found by the introspection thread; a restored one: before
//! it runs) and when the probes are armed (at `/init`, or at once).

use std::sync::{Arc, Mutex, OnceLock};

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{kernel_memory, TaskContext};
use hvprobe_vmm::{DebugHandler, NoProbes, StopReason, VcpuControl, VcpuState, Vm};
use sha2::{Digest, Sha256};
use vm_memory::GuestMemoryMmap;

use crate::control::server::ControlServer;
use crate::error::SessionError;
use crate::options::{optimize_by_default, ControlSocket, TraceOptions};
use crate::trace::TraceSession;

/// Why the tracing side of a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunSessionError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("cannot stop the VM on signals: {source}")]
    Signals {
        #[source]
        source: std::io::Error,
    },
    #[error("cannot hash the kernel text: {0}")]
    TextHash(#[from] TextHashError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
}

/// Why the kernel's text could not be hashed.
#[derive(Debug, thiserror::Error)]
pub enum TextHashError {
    #[error("the kernel has no _stext/_etext symbols")]
    NoTextSymbols,
    #[error(transparent)]
    Tables(#[from] hvprobe_live::KernelTablesError),
    #[error(transparent)]
    Memory(#[from] hvprobe_introspection::memory::MemoryError),
}

/// The tracing side of one run.
pub struct RunSession {
    probes: Option<Arc<TraceSession>>,
    control: Mutex<Option<ControlServer>>,
    text_hash: bool,
    mem: GuestMemoryMmap,
    /// Where the kernel is, once it is up (for the text hash): a vCPU's state then and the
    /// kernel's symbols.
    kernel: OnceLock<(VcpuState, SymbolTable)>,
}

impl RunSession {
    /// Reads the probe file (a bad one fails here, before the guest runs), starts the hit
    /// printer, the listing on SIGUSR1 and the control socket. Nothing touches the guest
    /// yet.
    pub fn start(options: &TraceOptions, vm: &Vm) -> Result<Arc<RunSession>, RunSessionError> {
        stop_on_signals(vm.control())?;
        let probes = match (&options.probes, &options.control) {
            (None, _) if !options.analysis.is_empty() => return Err(SessionError::AnalysisWithoutProbes.into()),
            (None, ControlSocket::Off) if options.output.perfetto.is_some() && options.functions.is_none() => {
                return Err(SessionError::PerfettoWithoutProbes.into())
            }
            (None, ControlSocket::Off) if options.functions.is_none() => None,
            _ => {
                let optimize = options
                    .optimize
                    .unwrap_or_else(|| optimize_by_default(hvprobe_vmm::Backend::detect()));
                let session = Arc::new(TraceSession::new(options, optimize, vm)?);
                session.listing_on_sigusr1()?;
                Some(session)
            }
        };
        let control = match (&options.control, &probes) {
            (ControlSocket::Off, _) | (_, None) => None,
            (socket, Some(session)) => {
                let path = match socket {
                    ControlSocket::At(path) => Some(path.clone()),
                    _ => None,
                };
                let server = ControlServer::start(path, Arc::clone(session), vm.control())?;
                eprintln!(
                    "hvprobe: control socket {} (hvprobe probe add|remove|enable|disable|list, hvprobe trace)",
                    server.path().display()
                );
                Some(server)
            }
        };
        Ok(Arc::new(RunSession {
            probes,
            control: Mutex::new(control),
            text_hash: options.text_hash,
            mem: vm.memory().clone(),
            kernel: OnceLock::new(),
        }))
    }

    /// Whether there are probes to place, or may be (a control socket).
    pub fn has_probes(&self) -> bool {
        self.probes.is_some()
    }

    /// Whether the run needs the kernel's symbols: probes to place (now or through the
    /// control socket), or a text to hash.
    pub fn needs_kernel(&self) -> bool {
        self.has_probes() || self.text_hash
    }

    /// Whether the run fails without the kernel's symbols: a probe file, or a text to
    /// hash. (A control socket alone only tells its clients why it has no probes.)
    pub fn requires_kernel(&self) -> bool {
        self.probes.as_ref().is_some_and(|p| p.has_file()) || self.text_hash
    }

    /// The kernel's symbols could not be had; for a run that does not require them, the
    /// control socket's clients are told why.
    pub fn symbols_unavailable(&self, why: String) {
        tracing::warn!("no kernel symbols: the control socket cannot place probes: {why}");
        if let Some(probes) = &self.probes {
            probes.symbols_unavailable(why);
        }
    }

    /// The debug handler to run the VM with.
    pub fn handler(&self) -> Arc<dyn DebugHandler> {
        match &self.probes {
            Some(s) => s.handler.clone(),
            None => Arc::new(NoProbes),
        }
    }

    /// Once the kernel is up (vCPUs paused, `state` one of theirs): remembers where its text
    /// is, checks that every probe's symbol exists, reads the kernel facts the engine checks
    /// probes against, maps the out-of-line area and attaches the engine. Arms nothing.
    pub fn kernel_up(
        &self,
        control: Arc<VcpuControl>,
        state: &VcpuState,
        symbols: &SymbolTable,
        tasks: Option<TaskContext>,
    ) -> Result<(), SessionError> {
        if let Some(probes) = &self.probes {
            probes.prepare(control, state, symbols, tasks)?;
        }
        if self.text_hash {
            let _ = self.kernel.set((*state, symbols.clone()));
        }
        Ok(())
    }

    /// Registers and arms every probe (all or none), now.
    pub fn arm(&self) -> Result<(), SessionError> {
        match &self.probes {
            Some(probes) => probes.arm(),
            None => Ok(()),
        }
    }

    /// Arms the probes on the vCPU thread that reports `/init`; a failure stops the VM and
    /// is told by [`RunSession::failure`].
    pub fn arm_at_init(&self, control: Arc<VcpuControl>) {
        if let Some(probes) = &self.probes {
            probes.arm_at_init(control);
        }
    }

    /// Why arming at `/init` failed, if it did.
    pub fn failure(&self) -> Option<Arc<SessionError>> {
        self.probes.as_ref().and_then(|p| p.failure())
    }

    /// The name of what hvprobe keeps in the guest at `at` (a detour, an out-of-line copy),
    /// while the probes are still there: for the report of where a stopped vCPU was.
    pub fn hvprobe_code_at(&self, at: hvprobe_arch::Gva) -> Option<String> {
        Some(self.probes.as_ref()?.out_of_line_place(at)?.to_string())
    }

    /// After the run: the last hits, the listing and the engine's counters, every probe
    /// removed; then the SHA-256 of the kernel's text, when asked for and the kernel was
    /// ever up.
    pub fn finish(&self) -> Result<(), RunSessionError> {
        let control = self.control.lock().unwrap_or_else(|e| e.into_inner()).take();
        let control = control.map(|mut c| {
            c.stop_accepting();
            c
        });
        if let Some(probes) = &self.probes {
            probes.finish();
        }
        if let Some(control) = control {
            control.finish();
        }
        if let Some((state, symbols)) = self.kernel.get() {
            let memory = kernel_memory(&self.mem, state, symbols).map_err(TextHashError::from)?;
            let hash = kernel_text_hash(&memory, symbols)?;
            eprintln!("hvprobe: kernel text sha256 {hash}");
        }
        Ok(())
    }
}

/// SIGINT, SIGTERM and SIGHUP stop the VM the way the guest's own end does: the vCPUs
/// leave the guest, then the run finishes as usual (every probe removed, the hits already
/// taken printed, the listing and the summary), and hvprobe exits with
/// [`exit_status_for_signal`]. (With the console attached to a terminal in raw mode,
/// Ctrl-C is a byte for the guest, not a SIGINT.)
fn stop_on_signals(control: Arc<VcpuControl>) -> Result<(), RunSessionError> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|source| RunSessionError::Signals { source })?;
    std::thread::Builder::new()
        .name("hvprobe-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                eprintln!("hvprobe: stopping the VM on signal {sig}");
                control.stop(StopReason::Signal(sig));
            }
        })
        .map_err(|source| RunSessionError::Signals { source })?;
    Ok(())
}

/// The exit status after a stop by `sig`: 128 + its number, as a shell reports a command
/// the signal ended (130 for SIGINT, 143 for SIGTERM).
pub fn exit_status_for_signal(sig: i32) -> u8 {
    (128 + sig).clamp(0, 255) as u8
}

/// SHA-256 of the kernel's text (`_stext`..`_etext`) in guest memory.
fn kernel_text_hash(mem: &(impl GuestVirtRead + ?Sized), symbols: &SymbolTable) -> Result<String, TextHashError> {
    let range = hvprobe_probes::engine::text_range(symbols).ok_or(TextHashError::NoTextSymbols)?;
    let mut hasher = Sha256::new();
    let mut page = vec![0u8; 4096];
    let mut at = range.start.0;
    while at < range.end.0 {
        let n = (range.end.0 - at).min(4096) as usize;
        mem.read_virt(Gva(at), &mut page[..n])?;
        hasher.update(&page[..n]);
        at += n as u64;
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
