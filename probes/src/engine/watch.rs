//! Watches: hardware breakpoints (the debug registers, set by the host on every vCPU) as
//! probes. Invariant: the debug registers the machine loads hold exactly the enabled
//! watches while the global switch is on, each in the slot it was given at registration
//! (so enabling a watch again never fails for want of a slot), and no watch shares an
//! instruction with an int3 probe.
//!
//! An execution watch fires before its instruction and touches no text, so it goes where
//! int3 probes are refused: the guest's own patch sites (jump labels, static calls, ftrace
//! NOPs). A data watch fires after the instruction that wrote (or read) its range; its
//! event names that instruction, found by decoding its function up to the trap.

use hvprobe_arch::debugreg::{Access, DebugRegisters, HardwareBreakpoint, HARDWARE_BREAKPOINTS};
use hvprobe_arch::Gva;
use std::sync::atomic::Ordering;

use super::placed::WatchPlacement;
use super::registry::Registry;
use super::{KprobeRequest, ProbeError, ProbeId, ProbeKind, ProbePoint, Tracer, MAX_FUNCTION_BYTES};
use crate::insn;
use crate::machine::Vcpu;

impl Tracer {
    /// Resolves a watch with every check that needs no paused vCPU.
    pub(super) fn place_watch(&self, request: &KprobeRequest) -> Result<WatchPlacement, ProbeError> {
        let ProbeKind::Watch { access, len } = request.kind else {
            unreachable!("place_watch is called for watches")
        };
        let symbols = &self.view.symbols;
        let (address, what) = match &request.point {
            ProbePoint::Symbol { name, offset } => {
                // Data or text: a watch may be on either.
                let symbol = super::placement::unique_symbol(symbols, name, |_| true)?;
                let address = symbol.addr.0.checked_add(*offset).ok_or(ProbeError::Unprobeable {
                    what: format!("{name}+{offset:#x}"),
                    reason: "the address overflows".into(),
                })?;
                (Gva(address), format!("{name}+{offset:#x}"))
            }
            ProbePoint::Address(a) => (*a, a.to_string()),
            ProbePoint::Module { module, name, offset } => {
                return Err(ProbeError::WatchUnsupported {
                    what: format!("{module}:{name}+{offset:#x}"),
                    reason: "a watch does not follow a module's loads and unloads: give the address of a loaded \
                             module's variable",
                })
            }
        };
        let description = symbols.describe(address);
        let support = self.machine.hardware_breakpoints();
        let supported = if access.is_data() {
            support.data
        } else {
            support.execute
        };
        if let Err(reason) = supported {
            return Err(ProbeError::WatchUnsupported { what, reason });
        }
        let breakpoint =
            HardwareBreakpoint::new(address, access, u64::from(len)).map_err(|source| ProbeError::Watch {
                what: what.clone(),
                source,
            })?;
        if access == Access::Execute {
            let Some(d) = description.as_ref().filter(|d| d.symbol.is_text()) else {
                return Err(ProbeError::NotInFunction(address));
            };
            if let Some(reason) = self.view.blacklist.is_blacklisted(address) {
                return Err(ProbeError::Blacklisted { what, reason });
            }
            let start = Gva(address.0 - d.offset);
            let code = self.function_code(start, d.size.min(MAX_FUNCTION_BYTES), &what)?;
            let starts =
                insn::instruction_starts_through(&code, start, address).map_err(|source| ProbeError::Decode {
                    what: what.clone(),
                    source,
                })?;
            if starts.binary_search(&address).is_err() {
                return Err(ProbeError::Unprobeable {
                    what,
                    reason: format!("no instruction of {} starts there", d.symbol.name),
                });
            }
        }
        // The symbol the user named (as a probe's listing has it), or the one that
        // covers an address.
        let location = match &request.point {
            ProbePoint::Symbol { .. } | ProbePoint::Module { .. } => what.clone(),
            ProbePoint::Address(_) => description.as_ref().map_or_else(
                || format!("{address}"),
                |d| format!("{}+{:#x}", d.symbol.name, d.offset),
            ),
        };
        Ok(WatchPlacement {
            breakpoint,
            trace_location: description.map_or_else(|| location.clone(), |d| d.to_string()),
            location: format!("{location}/{len}:{access}"),
        })
    }

    /// Gives watch `id` its debug register (with the vCPUs paused).
    pub(super) fn take_watch_slot(
        &self,
        reg: &mut Registry,
        id: ProbeId,
        placement: &WatchPlacement,
    ) -> Result<(), ProbeError> {
        let bp = placement.breakpoint;
        if bp.access() == Access::Execute {
            // On a probe's int3, or inside an optimized probe's region (the guest runs the
            // relocated copy there, never the watched instruction).
            let at = bp.address();
            let covered = reg.sites.contains_key(&at) || reg.regions_covering(at).next().is_some();
            if covered {
                return Err(ProbeError::WatchOnProbe {
                    what: placement.location.clone(),
                });
            }
        }
        let in_use: Vec<String> = reg
            .probes
            .iter()
            .filter(|(_, p)| matches!(p.kind, ProbeKind::Watch { .. }))
            .map(|(_, p)| format!("{}/{} at {}", p.group, p.event, p.location))
            .collect();
        reg.watch_slots.take(id, bp, &in_use)
    }

    /// The debug registers as the registry says they should be: every enabled watch in
    /// its slot while the global switch is on.
    pub(super) fn wanted_debug_registers(reg: &Registry) -> DebugRegisters {
        let mut registers = DebugRegisters::default();
        if !reg.armed {
            return registers;
        }
        let mut slots = reg.watch_slots.assigned();
        for slot in &mut slots {
            if slot.is_some_and(|(id, _)| !reg.probes.get(&id).is_some_and(|p| p.enabled)) {
                *slot = None;
            }
        }
        for (n, slot) in slots.iter().enumerate() {
            if let Some((_, bp)) = slot {
                registers.place(n, *bp);
            }
        }
        registers
    }

    /// Hands the machine the debug registers the registry wants (with the vCPUs paused).
    pub(super) fn sync_debug_registers(&self, reg: &Registry) -> Result<(), ProbeError> {
        let wanted = Self::wanted_debug_registers(reg);
        let mut loaded = self.debug_registers.lock().unwrap_or_else(|e| e.into_inner());
        if *loaded == wanted {
            return Ok(());
        }
        self.machine
            .set_debug_registers(wanted)
            .map_err(|source| ProbeError::DebugRegisters { source })?;
        *loaded = wanted;
        Ok(())
    }

    /// Hardware breakpoints `fired` (a mask of slots) on vCPU `cpu`, at `pc`: before an
    /// execution watch's instruction, after a data watch's access. False when a slot that
    /// fired is no watch's (the machine then stops: nothing else sets them).
    pub fn on_hardware_breakpoint(&self, cpu: usize, vcpu: &mut dyn Vcpu, pc: Gva, fired: u8) -> bool {
        let reg = self.read_registry();
        let mut known = true;
        for slot in (0..HARDWARE_BREAKPOINTS).filter(|n| fired & (1 << n) != 0) {
            let Some(id) = reg.watch_slots.owner(slot) else {
                known = false;
                continue;
            };
            let Some(probe) = reg.probes.get(&id).filter(|p| p.enabled) else {
                // Disabled while this exit was on its way: not a hit.
                continue;
            };
            probe.counters.hits.fetch_add(1, Ordering::Relaxed);
            if !probe.emit_events {
                continue;
            }
            let regs = match vcpu.regs() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("vCPU {cpu}: watch {}/{}: {e}", probe.group, probe.event);
                    probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let task = vcpu.current_task();
            let mut event = self.hit_event(id, probe, cpu, &regs, task.as_ref(), vcpu, None);
            if reg.watch_slots.of(id).is_some_and(|bp| bp.access().is_data()) {
                event.record.location = self.accessing_instruction(&reg, pc);
            }
            self.send_event(probe, event);
        }
        known
    }

    /// Where the instruction that ends at `after` is, as `sym+0xoff/0xsize` (what a data
    /// watch's trap leaves in RIP is the instruction after the access; perf reports that
    /// one). Decoded from the start of the function; `after` itself, marked so, when it is
    /// in no function or its function does not decode up to it.
    fn accessing_instruction(&self, reg: &Registry, after: Gva) -> String {
        let symbols = &self.view.symbols;
        let Some(d) = symbols.describe(after).filter(|d| d.symbol.is_text()) else {
            return format!("{after} (after the access)");
        };
        // A `rep` string instruction traps after each iteration with RIP still on it.
        let mut at_trap = [0u8; 15];
        if self.machine.kernel().read_virt(after, &mut at_trap).is_ok() && insn::is_rep_string(&at_trap) {
            return d.to_string();
        }
        let start = Gva(after.0 - d.offset);
        let mut code = vec![0u8; d.offset.min(MAX_FUNCTION_BYTES) as usize];
        let decoded = self.machine.kernel().read_virt(start, &mut code).ok().and_then(|()| {
            super::placement::compiler_bytes(reg, start, &mut code);
            let starts = insn::instruction_starts_through(&code, start, Gva(after.0 - 1)).ok()?;
            starts.last().copied()
        });
        match decoded.and_then(|at| symbols.describe(at)) {
            Some(writer) => writer.to_string(),
            None => format!("{d} (after the access)"),
        }
    }
}
