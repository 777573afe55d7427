//! Why a VM stopped.

/// Why the VM stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The guest reported the exit status of its workload (or of its shell).
    GuestExit(u8),
    /// The guest reset the machine: a reboot, or the reboot after a kernel panic.
    Reset,
    /// The guest powered off through KVM's system-event exit.
    PowerOff,
    /// A triple fault.
    TripleFault,
    /// KVM could not emulate a guest instruction (kvm_pvm: kernel code is emulated).
    EmulationFailure { cpu: usize, rip: u64, insn: Vec<u8> },
    /// A vCPU ioctl or an unexpected exit, or a panic in the exit loop itself.
    VcpuError { cpu: usize, message: String },
    /// The user asked to quit (Ctrl-A x on the console), or the host stopped the VM.
    Stopped,
    /// The host process got this signal (SIGINT, SIGTERM) and stopped the VM cleanly.
    Signal(i32),
    /// The guest's init is ready for a workload (event 3) and the VM was asked to stop
    /// there ([`VcpuControl::stop_when_ready`]), to be snapshotted.
    GuestReady,
    /// The [`DebugHandler`] panicked on vCPU `cpu`; `message` is the panic's text. The
    /// vCPU was left wherever the handler stopped, so the VM cannot go on.
    HandlerPanicked { cpu: usize, message: String },
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::GuestExit(s) => write!(f, "guest exited with status {s}"),
            StopReason::Reset => write!(f, "guest reset the machine (reboot, or the reboot after a panic)"),
            StopReason::PowerOff => write!(f, "guest powered off"),
            StopReason::TripleFault => write!(f, "guest triple fault"),
            StopReason::EmulationFailure { cpu, rip, insn } => {
                write!(
                    f,
                    "KVM could not emulate the instruction at {rip:#x} on vCPU {cpu} (bytes:"
                )?;
                for b in insn {
                    write!(f, " {b:02x}")?;
                }
                write!(f, ")")
            }
            StopReason::VcpuError { cpu, message } => write!(f, "vCPU {cpu}: {message}"),
            StopReason::Stopped => write!(f, "stopped by the host"),
            StopReason::Signal(sig) => write!(f, "stopped by signal {}", signal_name(*sig)),
            StopReason::GuestReady => write!(f, "guest ready for a workload"),
            StopReason::HandlerPanicked { cpu, message } => {
                write!(f, "the debug handler panicked on vCPU {cpu}: {message}")
            }
        }
    }
}

/// The text of a panic's payload (what `panic!` was given).
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic payload that is not text)".to_owned()
    }
}

/// `SIGINT` for 2, as `kill -l` names them (the number for others).
pub(super) fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => other.to_string(),
    }
}
