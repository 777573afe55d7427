//! What a vCPU thread hands to the probe side: breakpoints, single steps and guest events
//! ([`DebugHandler`]), and the KVM guest-debug switches that make them exit.

use hvprobe_arch::Gva;
use kvm_bindings::{kvm_guest_debug, KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP, KVM_GUESTDBG_USE_SW_BP};
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
pub fn set_guest_debug(vcpu: &VcpuFd, backend: Backend, single_step: bool) -> Result<(), Error> {
    let mut control = 0;
    if !backend.int3_is_emulation_failure() {
        control |= KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_SW_BP;
    }
    if single_step {
        control |= KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_SINGLESTEP;
    }
    let debug = kvm_guest_debug {
        control,
        ..Default::default()
    };
    vcpu.set_guest_debug(&debug).map_err(kvm_err("KVM_SET_GUEST_DEBUG"))
}
