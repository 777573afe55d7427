//! The seam between the probe engine and a virtual machine. The VMM implements these
//! traits for a live guest; the engine's unit tests implement them with plain memory.

use std::ops::Range;

use hvprobe_arch::debugreg::DebugRegisters;
use hvprobe_arch::Gva;
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::task::TaskInfo;
use hvprobe_introspection::unwind::CpuStackView;

use crate::regs::Regs;

/// The guest kernel's virtual memory (its text, data and stacks: the kernel half of the
/// address space, the same in every process).
pub trait KernelMemory: GuestVirtRead + Send + Sync {
    fn write_virt(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError>;

    /// Writes the guest's own text (an int3, a jump, original bytes put back): as
    /// `write_virt`, but refused whole where the bytes would reach memory the host keeps
    /// for itself (the out-of-line area, which `write_virt` writes by its physical
    /// address): whatever address the engine was given, the text path never writes the
    /// host's own code.
    fn write_text(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError>;
}

/// What the engine sees of the vCPUs while they are paused.
pub trait PausedView {
    /// The kernel's memory, to change text in.
    fn text(&self) -> &dyn KernelMemory;
    /// The index and RIP of every other vCPU (the caller's own vCPU, when called from a
    /// vCPU thread, is not included: it is in the engine's hands already).
    fn parked_rips(&self) -> Vec<(usize, u64)>;
    /// Every word in `range` found on the guest's kernel stacks (every task's, and every
    /// CPU's interrupt and exception stacks): where a task was interrupted or preempted,
    /// or will return to. Conservative: a stale word counts too. An error when the stacks
    /// cannot be read; then nothing may rely on a range being free of them.
    fn saved_on_stacks(&self, range: Range<Gva>) -> Result<Vec<Gva>, StackScanError> {
        let _ = range;
        Err(StackScanError::Unsupported)
    }
}

/// Why the guest's kernel stacks cannot be searched.
#[derive(Debug, thiserror::Error)]
pub enum StackScanError {
    #[error("this machine cannot search the guest's kernel stacks")]
    Unsupported,
    /// The guest's stacks could not be listed or read.
    #[error("the guest's kernel stacks: {0}")]
    Guest(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The machine could not stop its vCPUs for a change (one was held on the host past the
/// pause's deadline, say): `edit` did not run, nothing changed.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct PauseFailed(pub Box<dyn std::error::Error + Send + Sync>);

/// The whole machine, as the engine changes it.
pub trait Machine: Send + Sync {
    fn kernel(&self) -> &dyn KernelMemory;

    /// The guest's memory in bytes: what a reader of guest data may spend at most.
    fn memory_size(&self) -> u64;

    /// Runs `edit` with every vCPU out of guest mode (all others when called from a vCPU
    /// thread), so that no vCPU executes text while it changes.
    fn with_vcpus_paused(&self, edit: &mut dyn FnMut(&dyn PausedView)) -> Result<(), PauseFailed>;

    /// The index and RIP of every vCPU once the VM has stopped for good (no vCPU runs
    /// guest code again): where each one left the guest. Empty while the VM runs or may
    /// run again (a pause), and on a machine that does not keep them.
    fn stopped_rips(&self) -> Vec<(usize, u64)> {
        Vec::new()
    }

    /// Guest-physical memory as event detours' rings are read and written, while the guest
    /// runs; `None` when the machine has none (no event detours then).
    fn event_memory(&self) -> Option<&dyn crate::detour::ring::RingMemory> {
        None
    }

    /// Which kinds of watch this machine's debug registers fire for (execution, data),
    /// and why not when one does not.
    fn hardware_breakpoints(&self) -> HardwareBreakpointSupport {
        HardwareBreakpointSupport {
            execute: Err("this machine sets no debug registers"),
            data: Err("this machine sets no debug registers"),
        }
    }

    /// Sets the debug registers of every vCPU; called with the vCPUs paused (each loads
    /// them before it enters the guest again).
    fn set_debug_registers(&self, registers: DebugRegisters) -> Result<(), DebugRegistersError> {
        let _ = registers;
        Err(DebugRegistersError::Unsupported)
    }

    /// The kernel stacks CPU `cpu` may be running on now (its current task's, its IRQ,
    /// exception and entry stacks): where an unwind of a hit on that CPU may read; and the
    /// return addresses the guest's own kretprobes swapped out on its task's stack.
    fn cpu_stacks(&self, cpu: usize) -> Result<CpuStackView, StackScanError> {
        let _ = cpu;
        Err(StackScanError::Unsupported)
    }
}

/// What a machine's debug registers fire for: `Ok` for each kind of watch they serve, or
/// why not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HardwareBreakpointSupport {
    pub execute: Result<(), &'static str>,
    pub data: Result<(), &'static str>,
}

/// Why the debug registers could not be set.
#[derive(Debug, thiserror::Error)]
pub enum DebugRegistersError {
    #[error("this machine sets no debug registers")]
    Unsupported,
}

/// A failed operation on the vCPU at a hit: which KVM call, and the error it returned.
#[derive(Debug, thiserror::Error)]
#[error("{ioctl} failed: {source}")]
pub struct VcpuError {
    pub ioctl: &'static str,
    pub source: std::io::Error,
}

impl VcpuError {
    pub fn new(ioctl: &'static str, errno: i32) -> Self {
        VcpuError {
            ioctl,
            source: std::io::Error::from_raw_os_error(errno),
        }
    }
}

/// The segment selectors of the vCPU at a hit (`%cs`, `%ss`): in 64-bit kernel mode CS is
/// the kernel's, but SS is 0 after an interrupt or exception and `__KERNEL_DS` after a
/// system call, so they are read, never assumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentSelectors {
    pub cs: u16,
    pub ss: u16,
}

/// A vCPU's interrupt descriptor table register (IDTR): where its IDT is and its limit
/// (the offset of its last byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InterruptTable {
    pub base: Gva,
    pub limit: u16,
}

/// The vCPU that hit a probe, for the duration of the hit.
pub trait Vcpu {
    fn regs(&mut self) -> Result<Regs, VcpuError>;
    fn set_regs(&mut self, regs: &Regs) -> Result<(), VcpuError>;
    /// The segment selectors (one more KVM call on a live vCPU: read only when needed).
    fn segment_selectors(&mut self) -> Result<SegmentSelectors, VcpuError>;
    /// Turns single-stepping on or off for this vCPU.
    fn set_single_step(&mut self, on: bool) -> Result<(), VcpuError>;
    /// The vCPU's IDTR.
    fn interrupt_table(&mut self) -> Result<InterruptTable, VcpuError>;
    /// Points the vCPU's IDTR at `table` (an out-of-line step runs on the step guard's).
    fn set_interrupt_table(&mut self, table: InterruptTable) -> Result<(), VcpuError>;
    /// The task running on this vCPU (`$comm`, pid), when the guest's layout is known.
    fn current_task(&mut self) -> Option<TaskInfo>;
    /// The vCPU's whole address space (user half included), for `+u0(...)` and `ustring`.
    fn user_memory(&mut self) -> Option<Box<dyn GuestVirtRead + '_>>;
}
