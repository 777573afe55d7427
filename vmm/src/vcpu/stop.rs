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
    /// A host thread that handles guest data (a device's worker, the event rings' drain)
    /// panicked: the run ends rather than go on without it.
    ThreadPanicked { thread: String, message: String },
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
            StopReason::ThreadPanicked { thread, message } => {
                write!(f, "the host thread `{thread}` panicked: {message}")
            }
        }
    }
}

/// How a host thread that handles guest data ends the run when it panics. Such a thread
/// parses what the guest wrote (a queue, a ring); a panic there is a bug the guest found,
/// and a thread that vanished would leave the guest's I/O or the probes' events stopped
/// with no word. Cloned into each thread; it holds only the VM's stop.
#[derive(Clone)]
pub struct PanicStop(std::sync::Arc<super::VcpuControl>);

impl PanicStop {
    pub fn new(control: std::sync::Arc<super::VcpuControl>) -> PanicStop {
        PanicStop(control)
    }

    /// Starts the thread `name` running `work`; if `work` panics, the run stops with
    /// [`StopReason::ThreadPanicked`] and the thread gives `None`.
    pub fn spawn<T: Send + 'static>(
        &self,
        name: &str,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<std::thread::JoinHandle<Option<T>>> {
        let control = std::sync::Arc::clone(&self.0);
        let thread = name.to_owned();
        std::thread::Builder::new().name(name.to_owned()).spawn(move || {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
                Ok(done) => Some(done),
                Err(payload) => {
                    let message = panic_message(payload.as_ref());
                    tracing::error!("the host thread `{thread}` panicked: {message}; the run ends");
                    control.stop(StopReason::ThreadPanicked { thread, message });
                    None
                }
            }
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guarded_thread_that_panics_ends_the_run_with_its_name_and_message() {
        let control = super::super::VcpuControl::new(1).unwrap();
        let panics = PanicStop::new(std::sync::Arc::clone(&control));
        let worker = panics
            .spawn("virtio-blk", || -> u32 { panic!("a chain of 70000 descriptors") })
            .unwrap();
        assert_eq!(
            worker.join().expect("the panic is caught, the thread ends normally"),
            None
        );
        assert_eq!(
            control.stop_reason(),
            Some(StopReason::ThreadPanicked {
                thread: "virtio-blk".into(),
                message: "a chain of 70000 descriptors".into()
            })
        );
    }

    #[test]
    fn a_guarded_thread_that_ends_normally_gives_its_result_and_stops_nothing() {
        let control = super::super::VcpuControl::new(1).unwrap();
        let panics = PanicStop::new(std::sync::Arc::clone(&control));
        assert_eq!(panics.spawn("event-drain", || 7).unwrap().join().unwrap(), Some(7));
        assert_eq!(control.stop_reason(), None);
    }
}
