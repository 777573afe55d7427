//! What placing a probe or a watch found out, as the registry keeps it: where a probe's
//! site is and what its bytes were ([`Placement`], made by [`super::placement`]), where a
//! watch's breakpoint goes ([`WatchPlacement`], made by [`super::watch`]) and which watch
//! owns each debug register ([`WatchSlots`]).

use hvprobe_arch::debugreg::{Access, HardwareBreakpoint, HARDWARE_BREAKPOINTS};
use hvprobe_arch::Gva;

use super::{ProbeError, ProbeId};

/// Everything [`Tracer::place`] found out about a probe point.
pub(super) struct Placement {
    pub address: Gva,
    /// The probe is at its function's first byte (a return probe must be).
    pub at_function_entry: bool,
    /// `sym+0xoff` for the listing: the symbol the user named, or the function that
    /// contains an address.
    pub location: String,
    /// `sym+0xoff/0xsize` of `address`, for hit events.
    pub trace_location: String,
    pub site: Gva,
    pub what: String,
    /// The original bytes at `site` (up to 15, within the function).
    pub bytes: Vec<u8>,
    pub may_fault: bool,
    /// The module the site is in, and the start of its memory (core or init layout)
    /// that holds the site.
    pub module: Option<(String, Gva)>,
}

/// Everything [`Tracer::place_watch`] found out about a watch.
pub(super) struct WatchPlacement {
    pub breakpoint: HardwareBreakpoint,
    /// `sym+0xoff`, for the listing.
    pub location: String,
    /// `sym+0xoff/0xsize`, for an execution watch's events.
    pub trace_location: String,
}

/// The watches' slots: which watch owns each debug register.
#[derive(Default)]
pub(super) struct WatchSlots {
    slots: [Option<(ProbeId, HardwareBreakpoint)>; HARDWARE_BREAKPOINTS],
}

impl WatchSlots {
    /// Each debug register's watch and breakpoint, by slot.
    pub fn assigned(&self) -> [Option<(ProbeId, HardwareBreakpoint)>; HARDWARE_BREAKPOINTS] {
        self.slots
    }

    pub fn owner(&self, slot: usize) -> Option<ProbeId> {
        self.slots.get(slot).and_then(|s| s.map(|(id, _)| id))
    }

    pub fn of(&self, id: ProbeId) -> Option<HardwareBreakpoint> {
        self.slots
            .iter()
            .flatten()
            .find(|(owner, _)| *owner == id)
            .map(|(_, bp)| *bp)
    }

    pub fn execute_at(&self, address: Gva) -> bool {
        self.execute_in(address..Gva(address.0.saturating_add(1))).is_some()
    }

    /// The first execution watch in `range`.
    pub fn execute_in(&self, range: std::ops::Range<Gva>) -> Option<Gva> {
        self.slots
            .iter()
            .flatten()
            .filter(|(_, bp)| bp.access() == Access::Execute && range.contains(&bp.address()))
            .map(|(_, bp)| bp.address())
            .min()
    }

    pub fn take(&mut self, id: ProbeId, bp: HardwareBreakpoint, in_use: &[String]) -> Result<(), ProbeError> {
        let free = self
            .slots
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| ProbeError::DebugRegistersFull {
                in_use: in_use.join(", "),
            })?;
        self.slots[free] = Some((id, bp));
        Ok(())
    }

    pub fn release(&mut self, id: ProbeId) {
        for slot in &mut self.slots {
            if slot.is_some_and(|(owner, _)| owner == id) {
                *slot = None;
            }
        }
    }
}
