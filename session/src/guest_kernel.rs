//! What a run learns of its guest kernel, the same for a boot (once the kernel is up, its
//! vCPUs paused) and a restore (before the restored guest runs): symbols from every
//! source asked for (file-based ones checked against guest memory), the `--resolve`
//! answers, the guest's task names, and the kernel handed to the run's session, which
//! arms the probes.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hvprobe_introspection::symbols::SymbolError;
use hvprobe_live::{live_memory, load_symbols, wait_for_kernel, KernelSymbols, TaskContext};
use hvprobe_vmm::{StopReason, VcpuControl, VcpuState};

use crate::error::SessionError;
use crate::options::SymbolRequest;
use crate::session::RunSession;

/// When the session arms its probes once it has the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArmProbes {
    /// Now: a restored guest, or a booted one already past `/init`.
    Now,
    /// When a vCPU reports `/init`: the boot's text patching is over by then.
    AtInit,
}

/// Why the kernel could not be introspected; the run fails (a boot stops its VM).
#[derive(Debug, thiserror::Error)]
pub enum IntrospectionFailure {
    /// The VM stopped before the kernel set up its syscall entry.
    #[error("the guest kernel never came up far enough to be introspected")]
    NotUp,
    #[error(transparent)]
    Symbols(#[from] hvprobe_live::KernelSymbolsError),
    #[error("{source} (in {from})")]
    Resolve { from: String, source: SymbolError },
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("no kernel symbols: the probes cannot be placed")]
    NoSymbols,
}

/// Introspects the kernel whose vCPU 0 is in `state` (all vCPUs paused or not yet run):
/// loads every source's symbols, prints the `--resolve` answers (`SYM = 0xADDR (source)`),
/// names guest tasks (into `tasks`) and hands the kernel to `session`, which arms its
/// probes as `arm` says. Returns the kernels loaded, the first one the probes'.
///
/// A run that only has a control socket goes on without symbols (its clients are told
/// why); one with a probe file, a text hash or `--resolve` fails.
pub fn introspect(
    control: &Arc<VcpuControl>,
    mem: &vm_memory::GuestMemoryMmap,
    state: &VcpuState,
    request: &SymbolRequest,
    session: &RunSession,
    tasks: &OnceLock<TaskContext>,
    arm: ArmProbes,
) -> Result<Vec<KernelSymbols>, IntrospectionFailure> {
    let memory = live_memory(mem, state);
    let mut kernels = Vec::new();
    let mut failure = None;
    for from in &request.sources {
        let started = std::time::Instant::now();
        match load_symbols(from, &memory, state.lstar) {
            Ok(kernel) => {
                tracing::info!(
                    "{} symbols from {} in {:.0} ms",
                    kernel.table.len(),
                    kernel.from,
                    started.elapsed().as_secs_f64() * 1e3
                );
                for spec in &request.resolve {
                    match kernel.table.resolve(spec) {
                        Ok(r) => eprintln!("{spec} = {:#x} ({})", r.addr.0, from.label()),
                        Err(source) => {
                            failure = Some(IntrospectionFailure::Resolve {
                                from: from.to_string(),
                                source,
                            })
                        }
                    }
                }
                kernels.push(kernel);
            }
            Err(e) => failure = Some(e.into()),
        }
    }
    if let (true, false, true, Some(why)) = (
        kernels.is_empty(),
        session.requires_kernel(),
        request.resolve.is_empty(),
        &failure,
    ) {
        // Only the control socket wanted the symbols: it tells its clients why, and the
        // guest runs on.
        session.symbols_unavailable(why.to_string());
        failure = None;
    }
    if let Some(kernel) = kernels.first() {
        match TaskContext::read(&memory, &kernel.table) {
            Ok(ctx) => {
                let _ = tasks.set(ctx);
            }
            Err(reason) => tracing::warn!("$comm and pid of guest tasks are unavailable: {reason}"),
        }
    }
    if let (true, Some(kernel), None) = (session.needs_kernel(), kernels.first(), &failure) {
        match session.kernel_up(Arc::clone(control), state, &kernel.table, tasks.get().copied()) {
            Ok(()) => match arm {
                ArmProbes::Now => {
                    if let Err(e) = session.arm() {
                        failure = Some(e.into());
                    }
                }
                ArmProbes::AtInit => session.arm_at_init(Arc::clone(control)),
            },
            Err(e) => failure = Some(e.into()),
        }
    } else if session.requires_kernel() && kernels.is_empty() && failure.is_none() {
        failure = Some(IntrospectionFailure::NoSymbols);
    }
    match failure {
        Some(failure) => Err(failure),
        None => Ok(kernels),
    }
}

/// A booted guest's way in: once its kernel is up (all vCPUs paused), [`introspect`] it,
/// arming the probes at `/init` (or at once if the guest is past it). A failure stops the
/// VM.
pub fn introspect_when_up(
    control: &Arc<VcpuControl>,
    mem: &vm_memory::GuestMemoryMmap,
    request: &SymbolRequest,
    session: &RunSession,
    tasks: &OnceLock<TaskContext>,
) -> Result<Vec<KernelSymbols>, IntrospectionFailure> {
    let (paused, state) =
        wait_for_kernel(control, mem, Duration::from_millis(100)).ok_or(IntrospectionFailure::NotUp)?;
    let arm = match control.boot_to_init() {
        Some(_) => ArmProbes::Now,
        None => ArmProbes::AtInit,
    };
    let introspected = introspect(control, mem, &state, request, session, tasks, arm);
    drop(paused);
    if introspected.is_err() {
        control.stop(StopReason::Stopped);
    }
    introspected
}
