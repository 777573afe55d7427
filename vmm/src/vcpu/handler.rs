//! What a vCPU thread hands to the probe side: breakpoints, single steps and guest events
//! ([`DebugHandler`]), and the KVM guest-debug switches that make them exit.

use std::cell::Cell;

use hvprobe_arch::debugreg::DebugRegisters;
use hvprobe_arch::Gva;
use kvm_bindings::{
    kvm_guest_debug, KVM_GUESTDBG_BLOCKIRQ, KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP, KVM_GUESTDBG_USE_HW_BP,
    KVM_GUESTDBG_USE_SW_BP,
};
use kvm_ioctls::VcpuFd;

use crate::backend::Backend;
use crate::devices::GuestEvent;
use crate::{kvm_err, Error};

/// What a [`DebugHandler`] did with a breakpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakpointDisposition {
    /// Not ours: deliver the #BP to the guest as if no hypervisor were there.
    GuestOwned,
    /// Ours: the handler has set the vCPU up to continue.
    Handled,
}

/// Receives the debug events of every vCPU. The VMM knows nothing about probes: the
/// probe engine implements this.
pub trait DebugHandler: Send + Sync {
    /// An int3 at `at` (guest virtual) was hit on vCPU `cpu`; RIP still points at it.
    fn on_breakpoint(&self, cpu: usize, vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition;

    /// A single-step trap on vCPU `cpu` (one the handler asked for with
    /// [`set_guest_debug`]); false when it was not expecting one.
    fn on_single_step(&self, _cpu: usize, _vcpu: &mut VcpuFd) -> bool {
        false
    }

    /// The guest signalled `event`; the vCPU continues when this returns, so a handler
    /// can make the guest wait (e.g. arm probes before `/init` runs).
    fn on_guest_event(&self, _cpu: usize, _event: GuestEvent) {}

    /// Hardware breakpoints fired on vCPU `cpu` (`fired`: a mask of DR0–DR3, slots of the
    /// VM's [`DebugRegisters`]): before the instruction at `pc` for an execution
    /// breakpoint, after the accessing instruction (RIP past it) for a data one. True when
    /// the handler took them; the VMM then lets an execution breakpoint's instruction run
    /// once. False stops the VM: nothing else sets the debug registers the VMM loads.
    fn on_hardware_breakpoint(&self, _cpu: usize, _vcpu: &mut VcpuFd, _pc: Gva, _fired: u8) -> bool {
        false
    }

    /// Whether int3 exits are wanted at all. On hardware KVM they cost an exit per guest
    /// int3 (KVM_GUESTDBG_USE_SW_BP); kvm_pvm reports them regardless.
    fn wants_breakpoints(&self) -> bool {
        true
    }
}

/// A handler that owns no breakpoint: every int3 goes back to the guest.
pub struct NoProbes;

impl DebugHandler for NoProbes {
    fn on_breakpoint(&self, _cpu: usize, _vcpu: &mut VcpuFd, _at: Gva) -> BreakpointDisposition {
        BreakpointDisposition::GuestOwned
    }

    fn wants_breakpoints(&self) -> bool {
        false
    }
}

/// Sets what KVM reports of a vCPU's debug events: its int3s (on hardware KVM they are the
/// guest's business unless we ask) and, while `single_step`, a trap after each instruction.
/// Keeping interrupts out of a step is the caller's job (clear IF in the guest's flags, as
/// the probe engine does): `KVM_GUESTDBG_BLOCKIRQ` would do it, but setting or clearing it
/// flips a VM-wide APICv inhibit, which on kvm_pvm made every stepped probe hit several
/// times slower.
///
/// Called on the vCPU's own thread: the VM's hardware breakpoints this thread loaded last
/// stay loaded.
pub fn set_guest_debug(vcpu: &VcpuFd, backend: Backend, single_step: bool) -> Result<(), Error> {
    let mut wanted = GUEST_DEBUG.get();
    wanted.single_step = single_step;
    apply(vcpu, backend, wanted)
}

/// Loads the VM's hardware breakpoints `registers` into this thread's vCPU, keeping its
/// single-step state.
pub(super) fn load_hardware_breakpoints(
    vcpu: &VcpuFd,
    backend: Backend,
    registers: DebugRegisters,
) -> Result<(), Error> {
    let mut wanted = GUEST_DEBUG.get();
    wanted.breakpoints = registers;
    apply(vcpu, backend, wanted)
}

/// Runs one instruction with the hardware breakpoints off and interrupts held (`on`), or
/// ends that: how an execution breakpoint's instruction runs once where RF does not.
/// Interrupts are held so that the step ends after that instruction, not inside a
/// handler that would return to the breakpoint and fire it again.
pub(super) fn step_over_breakpoints(vcpu: &VcpuFd, backend: Backend, on: bool) -> Result<(), Error> {
    let mut wanted = GUEST_DEBUG.get();
    wanted.step_over = on;
    apply(vcpu, backend, wanted)
}

/// What this vCPU thread's vCPU is asked to report.
#[derive(Clone, Copy, Default)]
struct GuestDebug {
    single_step: bool,
    step_over: bool,
    breakpoints: DebugRegisters,
}

thread_local! {
    /// The last [`GuestDebug`] this thread loaded (a vCPU is run by one thread).
    static GUEST_DEBUG: Cell<GuestDebug> = Cell::new(GuestDebug::default());
}

fn apply(vcpu: &VcpuFd, backend: Backend, wanted: GuestDebug) -> Result<(), Error> {
    let mut debug = kvm_guest_debug::default();
    if !backend.int3_is_emulation_failure() {
        debug.control |= KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_SW_BP;
    }
    if wanted.single_step || wanted.step_over {
        debug.control |= KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_SINGLESTEP;
    }
    if wanted.step_over {
        debug.control |= KVM_GUESTDBG_BLOCKIRQ;
    } else if !wanted.breakpoints.is_empty() {
        debug.control |= KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_HW_BP;
        debug.arch.debugreg = wanted.breakpoints.debugreg();
    }
    vcpu.set_guest_debug(&debug).map_err(kvm_err("KVM_SET_GUEST_DEBUG"))?;
    GUEST_DEBUG.set(wanted);
    Ok(())
}

/// Whether this thread's vCPU single-steps for its handler.
pub(super) fn single_stepping() -> bool {
    GUEST_DEBUG.get().single_step
}

/// The hardware breakpoints this thread's vCPU has loaded.
pub(super) fn loaded_hardware_breakpoints() -> DebugRegisters {
    GUEST_DEBUG.get().breakpoints
}
