//! The VMM's debug handler for probes: hands int3 and single-step exits to the engine once
//! there is a tracer (before, every int3 is the guest's), and stops the VM when the engine
//! cannot leave a vCPU where the guest expects it.

use std::sync::{Arc, Mutex, OnceLock};

use hvprobe_arch::Gva;
use hvprobe_probes::engine::{BreakpointOutcome, EngineFault, StepOutcome, Tracer};
use hvprobe_vmm::{Backend, BreakpointDisposition, DebugHandler, GuestEvent, StopReason, VcpuControl, Vm};
use kvm_ioctls::VcpuFd;
use vm_memory::GuestMemoryMmap;

use crate::machine::HitVcpu;
use crate::task::TaskContext;

/// Hands the VMM's debug exits to a [`Tracer`] once there is one (before, every int3 is
/// the guest's), and runs a hook when the guest reaches `/init`.
pub struct ProbeHandler {
    backend: Backend,
    mem: GuestMemoryMmap,
    control: Arc<VcpuControl>,
    tracer: OnceLock<Arc<Tracer>>,
    tasks: OnceLock<TaskContext>,
    on_init: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl ProbeHandler {
    /// A handler for `vm`'s vCPUs; hits go nowhere until [`ProbeHandler::attach`].
    pub fn new(vm: &Vm) -> Arc<Self> {
        Arc::new(ProbeHandler {
            backend: vm.backend(),
            mem: vm.memory().clone(),
            control: vm.control(),
            tracer: OnceLock::new(),
            tasks: OnceLock::new(),
            on_init: Mutex::new(None),
        })
    }

    /// Starts handing hits to `tracer` (once; later calls are ignored).
    pub fn attach(&self, tracer: Arc<Tracer>, tasks: Option<TaskContext>) {
        if let Some(t) = tasks {
            let _ = self.tasks.set(t);
        }
        let _ = self.tracer.set(tracer);
    }

    pub fn tracer(&self) -> Option<&Arc<Tracer>> {
        self.tracer.get()
    }

    /// Runs `hook` on the vCPU thread that reports `/init`, before the guest goes on.
    pub fn on_init(&self, hook: Box<dyn FnOnce() + Send>) {
        *self.on_init.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    fn hit_vcpu<'a>(&'a self, vcpu: &'a mut VcpuFd) -> HitVcpu<'a> {
        HitVcpu::new(vcpu, self.backend, &self.mem, self.tasks.get())
    }

    /// Stops the VM: the vCPU is not where the guest expects it, and must not run on. (A
    /// vCPU checks for a stop before it enters the guest again.)
    fn stop(&self, cpu: usize, fault: EngineFault) {
        tracing::error!("{fault}");
        self.control.stop(StopReason::VcpuError {
            cpu,
            message: format!("probe engine: {fault}"),
        });
    }
}

impl DebugHandler for ProbeHandler {
    fn on_breakpoint(&self, cpu: usize, vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition {
        let Some(tracer) = self.tracer.get() else {
            return BreakpointDisposition::GuestOwned;
        };
        match tracer.on_breakpoint(cpu, &mut self.hit_vcpu(vcpu), at) {
            BreakpointOutcome::Handled => BreakpointDisposition::Handled,
            BreakpointOutcome::NotOurs | BreakpointOutcome::HandledThenGuest => BreakpointDisposition::GuestOwned,
            BreakpointOutcome::Fatal(fault) => {
                self.stop(cpu, fault);
                BreakpointDisposition::Handled
            }
        }
    }

    fn on_single_step(&self, cpu: usize, vcpu: &mut VcpuFd) -> bool {
        let Some(tracer) = self.tracer.get() else {
            return false;
        };
        match tracer.on_single_step(cpu, &mut self.hit_vcpu(vcpu)) {
            StepOutcome::Handled => true,
            StepOutcome::NotOurs => false,
            StepOutcome::Fatal(fault) => {
                self.stop(cpu, fault);
                true
            }
        }
    }

    fn on_hardware_breakpoint(&self, cpu: usize, vcpu: &mut VcpuFd, pc: Gva, fired: u8) -> bool {
        self.tracer
            .get()
            .is_some_and(|tracer| tracer.on_hardware_breakpoint(cpu, &mut self.hit_vcpu(vcpu), pc, fired))
    }

    fn on_guest_event(&self, _cpu: usize, event: GuestEvent) {
        if event == GuestEvent::InitReached {
            let hook = self.on_init.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(hook) = hook {
                hook();
            }
        }
    }
}
