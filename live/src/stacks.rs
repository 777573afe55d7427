//! The guest's kernel stacks ([`hvprobe_introspection::stacks`]) narrowed with what the
//! paused vCPUs' registers prove.

use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::stacks::{KernelStacks, StacksError};
use hvprobe_introspection::task::select_per_cpu_base;
use hvprobe_vmm::VcpuState;

/// Narrows the scan of each CPU's current task (and IRQ stack) with the registers of the
/// paused vCPU running that CPU ([`KernelStacks::narrow_to_vcpu`]): the CPU is the one whose
/// per-CPU base the vCPU's GS registers hold. Every vCPU must be paused and `states` read
/// in this pause. The vCPUs' own RIPs are still the caller's to check.
pub fn narrow_to_vcpus(
    stacks: &mut KernelStacks,
    mem: &(impl GuestVirtRead + ?Sized),
    states: &[VcpuState],
) -> Result<(), StacksError> {
    for state in states {
        let cpl = (state.sregs.cs.selector & 3) as u8;
        let base = select_per_cpu_base(cpl, state.sregs.gs.base, state.kernel_gs_base)?;
        stacks.narrow_to_vcpu(mem, base, cpl, state.regs.rsp)?;
    }
    Ok(())
}
