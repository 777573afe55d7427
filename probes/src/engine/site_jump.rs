//! A site's jump: the detour an optimized site jumps to, the detour code in the
//! out-of-line area, the calls-in-flight slots an exit-free return was given, and why a
//! site is not optimized. Plain state the registry keeps per site and the optimizer makes;
//! the registry puts the int3 back ([`super::registry::unoptimize`]), the optimizer
//! writes the jump ([`super::optimize`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use hvprobe_arch::Gva;

use super::ProbeId;
use crate::detour::{DetourRegion, NotOptimizable};
use crate::machine::KernelMemory;

/// Bytes of the out-of-line area one detour takes (its int3, the relocated region of at
/// most 19 bytes grown by re-encoded branches, and the jump back).
pub(super) const DETOUR_BLOCK: u64 = 64;

/// Why an armed probe is not jump-optimized (the listing's and the API's reason).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WhyNotOptimized {
    #[error("optimization is off")]
    Off,
    #[error("{0}")]
    Region(Arc<NotOptimizable>),
    #[error("the guest's own int3 is at the probe address")]
    SharedWithGuest,
    #[error(
        "the guest's own jump to {target} is at the probe address (its optimized kprobe: it \
         writes its bytes back when it goes, over a jump of ours)"
    )]
    GuestJump { target: Gva },
    #[error("it is in module {0} (module probes stay int3 probes: the module may unload under a detour)")]
    InModule(String),
    #[error("the engine follows module loads there (its hook must exit to the host at the probe address)")]
    ModuleHook,
    #[error("it is not armed (disabled, disarmed or gone)")]
    NotArmed,
    #[error("vCPU {cpu} is stopped inside the region at {rip} (tried again at the next pause)")]
    VcpuInside { cpu: usize, rip: Gva },
    #[error(
        "a kernel stack holds {saved}, inside the region (a task interrupted or preempted there; tried again \
         at the next pause)"
    )]
    TaskInside { saved: Gva },
    #[error("the guest's kernel stacks cannot be checked for a task interrupted in the region: {0}")]
    StacksUnreadable(String),
    #[error("an execution watch at {watch} is inside the region")]
    WatchInside { watch: Gva },
    #[error("no out-of-line area")]
    NoOutOfLineArea,
    #[error("the out-of-line area has no room for another detour")]
    NoRoom,
    #[error("the detour at {detour} is out of rel32 reach of the probe")]
    OutOfReach { detour: Gva },
    #[error("the relocated region takes {len} bytes, more than a detour holds")]
    TooLong { len: usize },
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("its event detour cannot be made: {0}")]
    EventCode(String),
    #[error("every entry of the event rings' miss table is taken ({slots} event detours at once)")]
    NoMissSlot { slots: u32 },
    #[error("the calls-in-flight table has no {maxactive} free slots for its exit-free return (maxactive)")]
    NoReturnSlots { maxactive: u32 },
}

impl WhyNotOptimized {
    /// Whether planning the site again cannot change the answer while its text and probes
    /// stay as they are (a refusal of the region itself, not of a moment's state).
    pub(super) fn permanent(&self) -> bool {
        match self {
            WhyNotOptimized::Region(r) => !r.is_temporary(),
            WhyNotOptimized::OutOfReach { .. }
            | WhyNotOptimized::TooLong { .. }
            | WhyNotOptimized::NoOutOfLineArea
            | WhyNotOptimized::InModule(_) => true,
            _ => false,
        }
    }
}

/// The jump at an optimized site.
#[derive(Clone, Debug)]
pub(super) struct Detour {
    pub region: DetourRegion,
    /// The detour's first byte (a sync detour's int3).
    pub code: Gva,
    /// What we wrote over the region: the jump, then int3s to the region's end. Those are
    /// never executed (nothing branches into the region's interior); they keep a decoder
    /// that walks the function from its start — the guest's own `can_probe` does, before
    /// it places a kprobe after ours — on the instruction boundaries after the region.
    pub jump: Vec<u8>,
    pub kind: DetourKind,
    /// The probes its event detours record for, in order (none for a sync detour).
    pub recorders: Vec<ProbeId>,
    /// Its event detours' entries in the rings' miss table.
    pub miss_slots: Vec<u32>,
    /// Where a vCPU has counted a missed hit in its ring and not yet in the miss-table
    /// entry beside it ([`crate::detour::event::EventDetour::ring_counted_miss_ips`]).
    pub ring_counted_miss_ips: Vec<(Gva, u32)>,
    /// Its exit-free return probes' slots.
    pub returns: Vec<ReturnSlots>,
}

/// What a detour does before the displaced instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DetourKind {
    /// Traps once to the host (an int3), whose handlers run.
    Sync,
    /// Writes the hit into its CPU's ring in the guest: no exit.
    Event,
}

/// A detour's code in the out-of-line area, live or retired. An int3 exit at a sync
/// detour's `code` is a hit of `site` (if it still exists) that goes on in the relocated
/// region at `code + 1`.
#[derive(Clone, Debug)]
pub(super) struct DetourCode {
    pub site: Gva,
    /// Still the jump target of its site (else retired, waiting to be reused).
    pub live: bool,
    /// The guest rewrote the jump to it: the guest may hold a copy of the jump (its own
    /// kprobe on that address copies the instruction there, a `jmp` it emulates and puts
    /// back when its probe goes) and jump here at any time. Never reclaimed.
    pub kept: bool,
    /// Detour blocks it takes.
    pub blocks: u64,
    pub kind: DetourKind,
    /// Its event detours' entries in the rings' miss table, given back with its blocks.
    pub miss_slots: Vec<u32>,
    /// [`Detour::ring_counted_miss_ips`].
    pub ring_counted_miss_ips: Vec<(Gva, u32)>,
    /// Its exit-free return probes' slots: given back with its blocks, once every one is
    /// free (no call of them in flight).
    pub returns: Vec<ReturnSlots>,
}

/// The calls-in-flight slots an exit-free return probe's code was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ReturnSlots {
    pub first: u32,
    pub count: u32,
    /// The first slot's stub.
    pub stubs: Gva,
}

/// Every detour's code by its address.
pub(super) type DetourCodes = BTreeMap<Gva, DetourCode>;

/// Whether the jump of an optimized site is still in the text as we wrote it.
pub(super) fn jump_intact(text: &dyn KernelMemory, addr: Gva, detour: &Detour) -> bool {
    let mut now = vec![0u8; detour.jump.len()];
    text.read_virt(addr, &mut now).is_ok_and(|()| now == detour.jump)
}
