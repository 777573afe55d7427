//! The seam between the probe engine and a virtual machine. The VMM implements these
//! traits for a live guest; the engine's unit tests implement them with plain memory.

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::task::TaskInfo;

use crate::regs::Regs;

/// The guest kernel's virtual memory (its text, data and stacks: the kernel half of the
/// address space, the same in every process).
pub trait KernelMemory: GuestVirtRead + Send + Sync {
    fn write_virt(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError>;
}

/// The whole machine, as the engine changes it.
pub trait Machine: Send + Sync {
    fn kernel(&self) -> &dyn KernelMemory;

    /// Runs `edit` with every vCPU out of guest mode (all others when called from a vCPU
    /// thread), so that no vCPU executes text while it changes.
    fn with_vcpus_paused(&self, edit: &mut dyn FnMut(&dyn KernelMemory));
}

/// The vCPU that hit a probe, for the duration of the hit.
pub trait Vcpu {
    fn regs(&mut self) -> Result<Regs, String>;
    fn set_regs(&mut self, regs: &Regs) -> Result<(), String>;
    /// Turns single-stepping (with interrupts blocked) on or off for this vCPU.
    fn set_single_step(&mut self, on: bool) -> Result<(), String>;
    /// The task running on this vCPU (`$comm`, pid), when the guest's layout is known.
    fn current_task(&mut self) -> Option<TaskInfo>;
    /// The vCPU's whole address space (user half included), for `+u0(...)` and `ustring`.
    fn user_memory(&mut self) -> Option<Box<dyn GuestVirtRead + '_>>;
}
