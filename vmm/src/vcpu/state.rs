//! The x86/KVM state of a vCPU that a parked vCPU publishes (registers, segment
//! registers, its TSC beside the host's).

use hvprobe_arch::tsc::TscSample;
use kvm_bindings::{kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuFd;

use crate::{kvm_err, Error};

/// What a parked vCPU publishes about itself. (`Default`: all zero, for tests' made states.)
#[derive(Clone, Copy, Debug, Default)]
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The syscall entry point; 0 until the guest kernel has set it up.
    pub lstar: u64,
    /// The GS base user mode sees while the kernel runs (swapped by `swapgs`); the kernel's
    /// own GS base is `sregs.gs.base` while the vCPU is in kernel mode.
    pub kernel_gs_base: u64,
    /// `MSR_KVM_SYSTEM_TIME_NEW`: where the guest asked KVM to keep this vCPU's kvm-clock
    /// (`pvclock_vcpu_time_info`), guest-physical, bit 0 = enabled; 0 when it did not (or
    /// KVM would not say).
    pub kvm_system_time: u64,
    /// The vCPU's TSC as KVM reports it, between two reads of the host's (`None` when KVM
    /// would not read it): how guest TSC values relate to host ones.
    pub tsc: Option<TscSample>,
}

impl VcpuState {
    /// Registers, control registers and MSRs; no TSC sample (`tsc` is `None`).
    pub fn read(vcpu: &VcpuFd) -> Result<VcpuState, Error> {
        let regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
        Self::with_regs(vcpu, regs)
    }

    /// [`read`](Self::read) during an exit, in a [`crate::DebugHandler`]: the general
    /// registers come from kvm_run's sync area ([`super::exit_regs`]), so they include
    /// what this exit wrote and cost no ioctl.
    pub fn at_exit(vcpu: &mut VcpuFd) -> Result<VcpuState, Error> {
        let regs = super::exit_regs::read(vcpu)?;
        let sregs = super::exit_regs::read_sregs(vcpu)?;
        Self::with_registers(vcpu, regs, sregs)
    }

    /// `regs` with the control registers and MSRs read now.
    fn with_regs(vcpu: &VcpuFd, regs: kvm_bindings::kvm_regs) -> Result<VcpuState, Error> {
        let sregs = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        Self::with_registers(vcpu, regs, sregs)
    }

    /// `regs` and `sregs` with the MSRs read now.
    fn with_registers(vcpu: &VcpuFd, regs: kvm_regs, sregs: kvm_sregs) -> Result<VcpuState, Error> {
        let msrs = crate::regs::read_state_msrs(vcpu)?;
        Ok(VcpuState {
            regs,
            sregs,
            lstar: msrs.lstar,
            kernel_gs_base: msrs.kernel_gs_base,
            kvm_system_time: msrs.kvm_system_time,
            tsc: None,
        })
    }

    /// [`read`](Self::read) and a sample of the vCPU's TSC against the host's (a few more
    /// ioctls: what a parked vCPU publishes, not what a hit needs).
    pub fn read_with_tsc(vcpu: &VcpuFd) -> Result<VcpuState, Error> {
        Ok(VcpuState {
            tsc: crate::regs::sample_tsc(vcpu),
            ..VcpuState::read(vcpu)?
        })
    }

    /// Whether the vCPU was running guest kernel code (CPL 0).
    pub fn in_kernel_mode(&self) -> bool {
        self.sregs.cs.selector & 3 == 0
    }
}

/// A vCPU as a run left it: its state and the exception KVM was delivering to it. Read
/// after its thread left KVM_RUN for the last time, so a run stopped from outside (a
/// signal, a deadline) can say where the guest was.
#[derive(Clone, Copy, Debug)]
pub struct VcpuAtStop {
    pub cpu: usize,
    pub state: VcpuState,
    pub exception: Option<PendingException>,
}

/// An exception KVM had queued or was injecting (`KVM_GET_VCPU_EVENTS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingException {
    pub vector: u8,
    pub error_code: Option<u32>,
}

impl VcpuAtStop {
    pub fn read(cpu: usize, vcpu: &VcpuFd) -> Result<VcpuAtStop, Error> {
        let events = vcpu.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
        Ok(VcpuAtStop {
            cpu,
            state: VcpuState::read(vcpu)?,
            exception: PendingException::of(&events),
        })
    }
}

impl PendingException {
    pub fn of(events: &kvm_bindings::kvm_vcpu_events) -> Option<PendingException> {
        let e = &events.exception;
        (e.injected != 0 || e.pending != 0).then_some(PendingException {
            vector: e.nr,
            error_code: (e.has_error_code != 0).then_some(e.error_code),
        })
    }
}

impl std::fmt::Display for PendingException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const NAMES: [&str; 21] = [
            "#DE",
            "#DB",
            "NMI",
            "#BP",
            "#OF",
            "#BR",
            "#UD",
            "#NM",
            "#DF",
            "vector 9",
            "#TS",
            "#NP",
            "#SS",
            "#GP",
            "#PF",
            "vector 15",
            "#MF",
            "#AC",
            "#MC",
            "#XM",
            "#VE",
        ];
        match NAMES.get(usize::from(self.vector)) {
            Some(name) => write!(f, "{name}")?,
            None => write!(f, "vector {}", self.vector)?,
        }
        if let Some(code) = self.error_code {
            write!(f, " (error code {code:#x})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exception_kvm_was_delivering_is_named_with_its_error_code() {
        let mut events = kvm_bindings::kvm_vcpu_events::default();
        assert_eq!(PendingException::of(&events), None);
        events.exception.injected = 1;
        events.exception.nr = 14;
        events.exception.has_error_code = 1;
        events.exception.error_code = 0x10;
        let e = PendingException::of(&events).unwrap();
        assert_eq!(e.to_string(), "#PF (error code 0x10)");
        events.exception.injected = 0;
        events.exception.pending = 1;
        events.exception.nr = 3;
        events.exception.has_error_code = 0;
        assert_eq!(PendingException::of(&events).unwrap().to_string(), "#BP");
        events.exception.nr = 200;
        assert_eq!(PendingException::of(&events).unwrap().to_string(), "vector 200");
    }
}
