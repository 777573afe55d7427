//! What hvprobe keeps at an address of the out-of-line area: a vCPU stopped there runs
//! hvprobe's code (a detour, an instruction's out-of-line copy, the return trampoline, the
//! step guard), which no kernel symbol names; a report of where it stopped names it so.

use std::fmt;

use hvprobe_arch::Gva;

use super::site_jump::{DetourKind, DETOUR_BLOCK};
use super::step_guard::GUARD_BYTES;
use super::{Tracer, SLOT_SIZE};

/// What an address of the out-of-line area holds, and for which probes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutOfLinePlace {
    /// A detour's code. `site` is where its jump goes (`%pS`), `events` the probes there
    /// now (`GROUP/EVENT`); `live` is false for a detour whose site no longer jumps to it
    /// (a vCPU that had entered it goes on through it, back to the kernel's text).
    Detour {
        recording: bool,
        site: String,
        live: bool,
        events: Vec<String>,
    },
    /// The out-of-line copy of the instruction at `site`, which a vCPU steps.
    Copy { site: String, events: Vec<String> },
    /// The int3 return probes' calls return through.
    ReturnTrampoline,
    /// The interrupt table and stubs out-of-line steps run on.
    StepGuard,
    /// Nothing of ours now (freed, or never handed out).
    Unused,
}

impl fmt::Display for OutOfLinePlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let probes = |f: &mut fmt::Formatter<'_>, events: &[String]| match events {
            [] => Ok(()),
            events => write!(f, " ({})", events.join(", ")),
        };
        match self {
            OutOfLinePlace::Detour {
                recording,
                site,
                live,
                events,
            } => {
                let kind = if *recording { "event" } else { "sync" };
                let retired = if *live { "" } else { "retired " };
                write!(f, "hvprobe's {retired}{kind} detour for {site}")?;
                probes(f, events)
            }
            OutOfLinePlace::Copy { site, events } => {
                write!(f, "hvprobe's out-of-line copy of the instruction at {site}")?;
                probes(f, events)
            }
            OutOfLinePlace::ReturnTrampoline => f.write_str("hvprobe's return-probe trampoline"),
            OutOfLinePlace::StepGuard => f.write_str("hvprobe's step guard (the IDT out-of-line steps run on)"),
            OutOfLinePlace::Unused => f.write_str("hvprobe's out-of-line area, in nothing handed out now"),
        }
    }
}

impl Tracer {
    /// What the out-of-line area holds at `at`, or `None` outside it.
    pub fn out_of_line_place(&self, at: Gva) -> Option<OutOfLinePlace> {
        let area = self.ool?;
        if !area.contains(at) {
            return None;
        }
        let within = |start: Gva, len: u64| at.0.wrapping_sub(start.0) < len;
        let named = |gva: Gva| match self.view.symbols.describe(gva) {
            Some(d) => d.to_string(),
            None => format!("{:#x}", gva.0),
        };
        let registry = self.registry.read().unwrap_or_else(|e| e.into_inner());
        let events_at = |site: Gva| -> Vec<String> {
            let Some(s) = registry.sites.get(&site) else {
                return Vec::new();
            };
            s.probes
                .iter()
                .filter_map(|id| registry.probes.get(id))
                .map(|p| format!("{}/{}", p.group, p.event))
                .collect()
        };
        if let Some((code, detour)) = registry.detour_codes.range(..=at).next_back() {
            if within(*code, detour.blocks.saturating_mul(DETOUR_BLOCK)) {
                return Some(OutOfLinePlace::Detour {
                    recording: detour.kind == DetourKind::Event,
                    site: named(detour.site),
                    live: detour.live,
                    events: events_at(detour.site),
                });
            }
        }
        if let Some(site) = registry
            .sites
            .iter()
            .find(|(_, s)| s.slot.as_ref().is_some_and(|(slot, _)| within(*slot, SLOT_SIZE)))
            .map(|(site, _)| *site)
        {
            return Some(OutOfLinePlace::Copy {
                site: named(site),
                events: events_at(site),
            });
        }
        if self.trampoline.get().is_some_and(|t| within(*t, SLOT_SIZE)) {
            return Some(OutOfLinePlace::ReturnTrampoline);
        }
        if self.step_guard.get().is_some_and(|g| within(g.base, GUARD_BYTES)) {
            return Some(OutOfLinePlace::StepGuard);
        }
        Some(OutOfLinePlace::Unused)
    }
}
