//! Jump optimization of armed sites (Linux's optimized kprobes, done from the host).
//!
//! Invariant: **a site's first five bytes hold our `jmp` to its detour only while the
//! region planned for it (see [`crate::detour`]) is safe to jump over — every vCPU was
//! paused outside the region and no kernel stack held an address inside it when the jump
//! was written — and the detour holds that region's instructions, relocated, behind one
//! int3 (a *sync* detour: the hit traps once, the handlers see RIP at the probe address,
//! then the displaced instructions run natively and jump back). Unoptimizing puts the int3
//! and the four original bytes back (the probe stays armed); a detour's memory is reused
//! only when no vCPU is in it and no kernel stack holds an address in it.**
//!
//! Optimization is tried at the end of every pause of the vCPUs, for every armed site
//! that meets Linux's kprobes' pre-optimization conditions (every probe of the site enabled,
//! none with a post-handler, no other probe inside the region) while the switch
//! ([`Tracer::set_optimization`]) is on; a site whose state changes is unoptimized before
//! its bytes change. A site refused for a reason that can go away (a vCPU or a task inside
//! the region, a probe inside it) is tried again at the next pause.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hvprobe_arch::{Gva, INT3};

use super::placement::compiler_bytes;
use super::registry::{armed_bytes, unoptimize, Counters, Registry, Role, Site};
use super::site_jump::{Detour, DetourCode, DetourKind, ReturnSlots, WhyNotOptimized, DETOUR_BLOCK};
use super::text::write_text;
use super::{ProbeError, ProbeId, ProbeKind, Tracer};
use crate::detour::event::filter::RecordFilter;
use crate::detour::event::{event_detour, EventDetourParams, EventLayout, ReturnDetourParams, DEFAULT_STRING_SIZE};
use crate::detour::{
    check_probe, jump_bytes, plan_region, relocate, Code, DetourFacts, DetourRegion, FunctionText, IndirectThunks,
    NotOptimizable, ProbeConditions, JMP_REL32_LEN,
};
use crate::machine::PausedView;

/// Whether a probe only records (no handler of any kind, the user's, no kernel stack to
/// unwind at its hits): what an event detour can do for it.
fn records_only(probe: &super::registry::Probe) -> bool {
    probe.role == Role::User && probe.pre.is_none() && probe.post.is_none() && probe.emit_events && !probe.stack_trace
}

/// A probe that only records, for its event detour.
struct EventProbe {
    id: ProbeId,
    address: Gva,
    args: Vec<crate::spec::FetchArg>,
    filter: Option<RecordFilter>,
    counters: Arc<Counters>,
    /// A return probe's `maxactive`: its detour follows calls in the guest.
    maxactive: Option<u32>,
}

/// Most probes of one site whose detours record in the guest, one after the other.
const MAX_RECORDERS: usize = 8;

/// A probe whose event detour a site's code will hold, with what it was given: its entry
/// of the miss table and, for a return probe, its slots of the calls-in-flight table.
struct Recorder {
    probe: EventProbe,
    miss_slot: u32,
    slots: Option<(u32, u32)>,
}

/// What one recorder's event detour came with.
struct DetourMade {
    layout: EventLayout,
    stubs: Option<Gva>,
    ring_counted_miss_ips: Vec<Gva>,
}

impl Tracer {
    /// Linux's kprobes' `debug.kprobes_optimization`: on, every armed probe that can be is
    /// jump-optimized; off, every optimized probe goes back to its int3. Takes effect in one
    /// pause of the vCPUs.
    pub fn set_optimization(&self, on: bool) -> Result<(), ProbeError> {
        self.paused(&mut |_view| {
            self.write_registry().optimization = on;
        })?;
        Ok(())
    }

    pub fn optimization(&self) -> bool {
        self.read_registry().optimization
    }

    /// Why a probe is not jump-optimized; `None` when it is.
    pub fn why_not_optimized(&self, id: ProbeId) -> Option<WhyNotOptimized> {
        let reg = self.read_registry();
        let probe = reg.probes.get(&id)?;
        if matches!(probe.kind, super::ProbeKind::Watch { .. }) {
            return None;
        }
        let site = reg.sites.get(&probe.site)?;
        if site.detour.is_some() {
            return None;
        }
        if !reg.optimization {
            return Some(WhyNotOptimized::Off);
        }
        Some(site.not_optimized.clone().unwrap_or(WhyNotOptimized::NotArmed))
    }

    /// At the end of a pause: unoptimizes what no longer qualifies, optimizes what does,
    /// and reuses retired detours nothing can be in any more.
    pub(super) fn optimize_pass(&self, view: &dyn PausedView) {
        let mut guard = self.write_registry();
        let reg = &mut *guard;
        if !reg.optimization && reg.detour_codes.is_empty() {
            return;
        }
        let addrs: Vec<Gva> = reg.sites.keys().copied().collect();
        for addr in &addrs {
            let blocked = self.blocking_reason(reg, *addr);
            // A detour made for other probes than the site has now (one came or went): its
            // event detours would record for the old ones only.
            let stale = blocked.is_none()
                && reg
                    .sites
                    .get(addr)
                    .and_then(|s| s.detour.as_ref())
                    .is_some_and(|d| d.recorders != self.recorder_ids(reg, *addr));
            let Some(site) = reg.sites.get_mut(addr) else { continue };
            if stale {
                unoptimize(view.text(), &self.text_bounds, *addr, site, &mut reg.detour_codes);
                self.stats.gone.fetch_add(u64::from(site.gone), Ordering::Relaxed);
                if site.gone {
                    continue;
                }
            }
            match (&site.detour, blocked) {
                (Some(_), Some(why)) => {
                    unoptimize(view.text(), &self.text_bounds, *addr, site, &mut reg.detour_codes);
                    self.stats.gone.fetch_add(u64::from(site.gone), Ordering::Relaxed);
                    site.not_optimized = Some(why);
                }
                (Some(_), None) => {}
                (None, Some(why)) => site.not_optimized = Some(why),
                (None, None) => {
                    if site.not_optimized.as_ref().is_some_and(WhyNotOptimized::permanent) {
                        continue;
                    }
                    let outcome = self.optimize_site(view, reg, *addr);
                    match outcome {
                        Ok((detour, blocks)) => {
                            reg.detour_codes.insert(
                                detour.code,
                                DetourCode {
                                    site: *addr,
                                    live: true,
                                    kept: false,
                                    blocks,
                                    kind: detour.kind,
                                    miss_slots: detour.miss_slots.clone(),
                                    ring_counted_miss_ips: detour.ring_counted_miss_ips.clone(),
                                    returns: detour.returns.clone(),
                                },
                            );
                            if let Some(site) = reg.sites.get_mut(addr) {
                                site.detour = Some(detour);
                                site.not_optimized = None;
                            }
                        }
                        Err(why) => {
                            if let Some(site) = reg.sites.get_mut(addr) {
                                site.not_optimized = Some(why);
                            }
                        }
                    }
                }
            }
        }
        self.reclaim_detours(view, reg);
        // The task hooks outlive the last return probe while its exit-free code has calls
        // in flight: they may go once that code is reclaimed.
        if reg.detour_codes.values().all(|d| d.returns.is_empty()) {
            self.drop_task_exit_hook_if_unused(view, reg);
        }
    }

    /// Where a `jmp rel32` at a probe site goes when that is outside the kernel's text: a
    /// jump the guest wrote over its own code (its optimized kprobe's, into an instruction
    /// page), which the guest puts its original bytes back over when its probe goes.
    fn guest_jump(&self, insn: &crate::insn::ProbedInsn) -> Option<Gva> {
        let [0xe9, a, b, c, d] = insn.bytes[..] else {
            return None;
        };
        let target = Gva(insn
            .next_addr()
            .0
            .wrapping_add(i32::from_le_bytes([a, b, c, d]) as i64 as u64));
        let text = super::text_range(&self.view.symbols)?;
        (!text.contains(&target)).then_some(target)
    }

    /// Why the site at `addr` may not be optimized now for reasons of state (the switch,
    /// the probes' conditions); `None` when the text may be planned.
    fn blocking_reason(&self, reg: &Registry, addr: Gva) -> Option<WhyNotOptimized> {
        if !reg.optimization {
            return Some(WhyNotOptimized::Off);
        }
        let site = reg.sites.get(&addr)?;
        if site.shared_with_guest() {
            return Some(WhyNotOptimized::SharedWithGuest);
        }
        if let Some((module, _)) = &site.module {
            return Some(WhyNotOptimized::InModule(module.clone()));
        }
        let hook = |id: &ProbeId| {
            reg.probes
                .get(id)
                .is_some_and(|p| matches!(p.role, Role::ModuleLoad | Role::ModuleFree))
        };
        if site.probes.iter().any(hook) {
            return Some(WhyNotOptimized::ModuleHook);
        }
        if let Some(target) = site.insn.as_ref().and_then(|i| self.guest_jump(i)) {
            return Some(WhyNotOptimized::GuestJump { target });
        }
        for id in &site.probes {
            let probe = reg.probes.get(id)?;
            let conditions = ProbeConditions {
                has_post_handler: probe.post.is_some(),
                enabled: probe.enabled,
            };
            if let Err(e) = check_probe(conditions) {
                return Some(WhyNotOptimized::Region(Arc::new(e)));
            }
        }
        if !site.armed || site.gone || !reg.armed {
            return Some(WhyNotOptimized::NotArmed);
        }
        // A site inside an optimized region blocks that region (Linux's kprobes' "blocked by
        // another kprobe"), whichever came first.
        if let Some(detour) = &site.detour {
            if let Some((&other, _)) = reg.sites.range(Gva(addr.0 + 1)..detour.region.end()).next() {
                return Some(WhyNotOptimized::Region(Arc::new(NotOptimizable::ProbeInsideRegion {
                    probe: other,
                    start: addr,
                    end: detour.region.end(),
                })));
            }
        }
        None
    }

    /// Plans, checks and writes the jump of one armed site: to an event detour when its one
    /// probe only records and the rings are set up (a sync one when that detour cannot be
    /// made), else to a sync detour. Returns the detour and the blocks it takes.
    fn optimize_site(
        &self,
        view: &dyn PausedView,
        reg: &Registry,
        addr: Gva,
    ) -> Result<(Detour, u64), WhyNotOptimized> {
        let area = self.ool.ok_or(WhyNotOptimized::NoOutOfLineArea)?;
        let region = self.plan(reg, addr)?;
        // An execution watch inside would never fire: the guest would run the relocated
        // copy, not the watched instruction.
        if let Some(watch) = reg.watch_slots.execute_in(addr..region.end()) {
            return Err(WhyNotOptimized::WatchInside { watch });
        }
        let range = addr.0 + 1..region.end().0;
        if let Some((cpu, rip)) = view.parked_rips().into_iter().find(|(_, rip)| range.contains(rip)) {
            return Err(WhyNotOptimized::VcpuInside { cpu, rip: Gva(rip) });
        }
        let interior = Gva(addr.0 + 1)..region.end();
        match view.saved_on_stacks(interior) {
            Ok(saved) if !saved.is_empty() => return Err(WhyNotOptimized::TaskInside { saved: saved[0] }),
            Ok(_) => {}
            Err(e) => return Err(WhyNotOptimized::StacksUnreadable(e.to_string())),
        }
        let recorders = match self.event_only_probes(reg, addr) {
            Some(probes) => self.take_recorders(probes)?,
            None => Vec::new(),
        };
        let written = self.write_detour(view, addr, region, &recorders, area);
        if written.is_err() {
            // The jump was not written: nothing can run the detour.
            self.release_recorders(&recorders);
        }
        written
    }

    /// Each probe's entry of the miss table and, for a return probe, its slots of the
    /// calls-in-flight table; on a refusal, nothing stays taken.
    fn take_recorders(&self, probes: Vec<EventProbe>) -> Result<Vec<Recorder>, WhyNotOptimized> {
        let mut taken: Vec<Recorder> = Vec::with_capacity(probes.len());
        for probe in probes {
            let miss_slot = match self.take_miss_slot(&probe.counters) {
                Ok(slot) => slot,
                Err(why) => {
                    self.release_recorders(&taken);
                    return Err(why);
                }
            };
            let slots = match probe.maxactive {
                Some(count) => match self.return_table().and_then(|t| t.take(count)) {
                    Some(first) => Some((first, count)),
                    None => {
                        self.release_miss_slot(miss_slot);
                        self.release_recorders(&taken);
                        return Err(WhyNotOptimized::NoReturnSlots { maxactive: count });
                    }
                },
                None => None,
            };
            taken.push(Recorder {
                probe,
                miss_slot,
                slots,
            });
        }
        Ok(taken)
    }

    fn release_recorders(&self, recorders: &[Recorder]) {
        for r in recorders {
            self.release_miss_slot(r.miss_slot);
            if let (Some((first, count)), Some(table)) = (r.slots, self.return_table()) {
                table.give_back(first, count);
            }
        }
    }

    fn return_table(&self) -> Option<&super::event_rings::ReturnTable> {
        self.events.get()?.returns.as_ref()
    }

    /// Makes the detour (event ones for `recorders`, one after the other, when there are
    /// any), writes it and then the jump (see [`Tracer::optimize_site`]).
    fn write_detour(
        &self,
        view: &dyn PausedView,
        addr: Gva,
        region: DetourRegion,
        recorders: &[Recorder],
        area: super::OutOfLineArea,
    ) -> Result<(Detour, u64), WhyNotOptimized> {
        // The detour's code at `code`, and each recorder's record layout and stubs.
        let make = |code: Gva| -> Result<(Vec<u8>, Vec<DetourMade>), WhyNotOptimized> {
            if recorders.is_empty() {
                let relocated = relocate(&region, Gva(code.0 + 1), region.end())
                    .map_err(|e| WhyNotOptimized::Region(Arc::new(e)))?;
                let mut detour = vec![INT3];
                detour.extend_from_slice(&relocated);
                return Ok((detour, Vec::new()));
            }
            self.event_chain(&region, recorders, code, area)
        };
        // Sized at the area's last block, then made where it goes (its length does not
        // depend on where it is; checked).
        let probe_place = Gva(area.start.0 + area.size - DETOUR_BLOCK);
        let sized = make(probe_place)?.0.len() as u64;
        let blocks = sized.div_ceil(DETOUR_BLOCK).max(1);
        let code = self.allocate_detour(blocks).ok_or(WhyNotOptimized::NoRoom)?;
        let written = (|| {
            let jump = padded_jump(
                &jump_bytes(addr, code).ok_or(WhyNotOptimized::OutOfReach { detour: code })?,
                &region,
            );
            let (detour, made) = make(code)?;
            if detour.len() as u64 > blocks * DETOUR_BLOCK {
                return Err(WhyNotOptimized::TooLong { len: detour.len() });
            }
            let text = view.text();
            text.write_virt(code, &detour)
                .map_err(|e| WhyNotOptimized::Memory(e.to_string()))?;
            // The site holds our int3 and then the original bytes; anything else is the
            // guest's, and stays.
            let mut now = vec![0u8; jump.len()];
            text.read_virt(addr, &mut now)
                .map_err(|e| WhyNotOptimized::Memory(e.to_string()))?;
            if now != armed_bytes(&region) {
                return Err(WhyNotOptimized::Memory(format!(
                    "the text at {addr} changed under the probe (now {})",
                    super::hex(&now)
                )));
            }
            write_text(text, &self.text_bounds, addr, &jump).map_err(|e| WhyNotOptimized::Memory(e.to_string()))?;
            let kind = match self.events.get() {
                Some(setup) if !made.is_empty() => {
                    // Before the registry is released: no record of it is drained earlier.
                    let mut layouts = setup.layouts.write().unwrap_or_else(|e| e.into_inner());
                    for (r, m) in recorders.iter().zip(&made) {
                        layouts.insert(r.probe.id.0, m.layout.clone());
                    }
                    DetourKind::Event
                }
                _ => DetourKind::Sync,
            };
            let returns = recorders
                .iter()
                .zip(&made)
                .filter_map(|(r, m)| {
                    let (first, count) = r.slots?;
                    Some(ReturnSlots {
                        first,
                        count,
                        stubs: m.stubs?,
                    })
                })
                .collect();
            let ring_counted_miss_ips = recorders
                .iter()
                .zip(&made)
                .flat_map(|(r, m)| m.ring_counted_miss_ips.iter().map(|at| (*at, r.miss_slot)))
                .collect();
            Ok((jump, kind, returns, ring_counted_miss_ips))
        })();
        match written {
            Ok((jump, kind, returns, ring_counted_miss_ips)) => Ok((
                Detour {
                    region,
                    code,
                    jump,
                    kind,
                    recorders: recorders.iter().map(|r| r.probe.id).collect(),
                    miss_slots: recorders.iter().map(|r| r.miss_slot).collect(),
                    ring_counted_miss_ips,
                    returns,
                },
                blocks,
            )),
            Err(why) => {
                self.free_detour(code, blocks);
                Err(why)
            }
        }
    }

    /// The probes of a site when every one only records (no handler of any kind, a kprobe
    /// or a return probe, the user's, no kernel stack to unwind at its hits) and the rings
    /// are set up (and, for a return probe, the calls-in-flight table): the site's detour
    /// can be event ones, one after the other, in the site's order.
    fn event_only_probes(&self, reg: &Registry, addr: Gva) -> Option<Vec<EventProbe>> {
        self.recorders_of(reg, addr, |id, probe, maxactive| EventProbe {
            id,
            address: probe.address,
            args: probe.args.clone(),
            filter: probe.filter.clone(),
            counters: probe.counters.clone(),
            maxactive,
        })
    }

    /// The probes an optimized site's detour records for now: [`Self::event_only_probes`]'s.
    fn recorder_ids(&self, reg: &Registry, addr: Gva) -> Vec<ProbeId> {
        self.recorders_of(reg, addr, |id, _, _| id).unwrap_or_default()
    }

    /// `make` of each probe of the site at `addr` (with a return probe's `maxactive`) when
    /// every one of them can record in the guest ([`Self::event_only_probes`]).
    fn recorders_of<T>(
        &self,
        reg: &Registry,
        addr: Gva,
        make: impl Fn(ProbeId, &super::registry::Probe, Option<u32>) -> T,
    ) -> Option<Vec<T>> {
        self.events.get()?;
        let site = reg.sites.get(&addr)?;
        if site.probes.is_empty() || site.probes.len() > MAX_RECORDERS {
            return None;
        }
        site.probes
            .iter()
            .map(|id| {
                let probe = reg.probes.get(id)?;
                let maxactive = match probe.kind {
                    ProbeKind::Kprobe => None,
                    ProbeKind::Kretprobe { maxactive } if self.return_table().is_some() => Some(maxactive),
                    _ => return None,
                };
                (records_only(probe) && probe.enabled).then(|| make(*id, probe, maxactive))
            })
            .collect()
    }

    /// Why a return probe `probe` at the optimized `site` is followed on the host (its
    /// site's detour traps) rather than exit-free; `None` when it is exit-free or no return
    /// probe.
    pub(super) fn why_return_traps(
        &self,
        reg: &Registry,
        probe: &super::registry::Probe,
        site: &Site,
    ) -> Option<String> {
        let ProbeKind::Kretprobe { .. } = probe.kind else {
            return None;
        };
        let detour = site.detour.as_ref()?;
        if detour.kind == DetourKind::Event {
            return None;
        }
        Some(if self.events.get().is_none() {
            "no event rings (the guest's per-CPU facts are not known)".into()
        } else if self.return_table().is_none() {
            "no calls-in-flight table (the out-of-line area's writable part is too small)".into()
        } else if probe.pre.is_some() || probe.post.is_some() {
            "it has handlers, which run on the host".into()
        } else if probe.stack_trace {
            "it records kernel stacks, unwound on the host".into()
        } else if site.probes.len() > MAX_RECORDERS {
            format!("more than {MAX_RECORDERS} probes share its address")
        } else if site
            .probes
            .iter()
            .any(|id| reg.probes.get(id).is_some_and(|p| !records_only(p)))
        {
            "another probe at its address has handlers or records stacks".into()
        } else {
            "its exit-free detour cannot be made (see the log)".into()
        })
    }

    /// The event detours of `recorders` at `code`, one after the other (each but the last
    /// jumps to the next where the displaced instructions would be), 16-byte aligned.
    fn event_chain(
        &self,
        region: &DetourRegion,
        recorders: &[Recorder],
        code: Gva,
        area: super::OutOfLineArea,
    ) -> Result<(Vec<u8>, Vec<DetourMade>), WhyNotOptimized> {
        let mut starts: Vec<Gva> = vec![code; recorders.len()];
        for _ in 0..8 {
            let mut made = Vec::with_capacity(recorders.len());
            let mut bytes = Vec::new();
            let mut next_starts = Vec::with_capacity(recorders.len());
            for (k, r) in recorders.iter().enumerate() {
                let at = Gva(code.0 + bytes.len() as u64);
                next_starts.push(at);
                let next = starts.get(k + 1).copied();
                let generated = self.event_code(region, r, next, at, area)?;
                bytes.extend_from_slice(&generated.code);
                bytes.resize(bytes.len().next_multiple_of(16), INT3);
                made.push(DetourMade {
                    layout: generated.layout,
                    stubs: generated.stubs,
                    ring_counted_miss_ips: generated.ring_counted_miss_ips,
                });
            }
            if next_starts == starts {
                return Ok((bytes, made));
            }
            starts = next_starts;
        }
        Err(WhyNotOptimized::EventCode(
            "the event detours' layout did not settle".into(),
        ))
    }

    /// The event detour generated at `code` ([`crate::detour::event::EventDetour`]).
    /// `next`: the next event detour of the chain, which this one jumps to instead of
    /// running the displaced instructions.
    fn event_code(
        &self,
        region: &DetourRegion,
        recorder: &Recorder,
        next: Option<Gva>,
        code: Gva,
        area: super::OutOfLineArea,
    ) -> Result<crate::detour::event::EventDetour, WhyNotOptimized> {
        let (probe, miss_slot, first_slot) = (&recorder.probe, recorder.miss_slot, recorder.slots);
        let setup = self.events.get().ok_or(WhyNotOptimized::NoRoom)?;
        let displaced = |ip: Gva| match next {
            Some(next) => jump_bytes(ip, next)
                .map(|j| j.to_vec())
                .ok_or(NotOptimizable::ReturnOutOfReach { from: ip, to: next }),
            None => relocate(region, ip, region.end()),
        };
        let facts = &setup.facts;
        let returns = match (first_slot, &setup.returns) {
            (Some((first_slot, maxactive)), Some(table)) => Some(ReturnDetourParams {
                table: table.gva,
                table_slots: table.slots,
                first_slot,
                maxactive,
                code_area: (area.start, area.size),
                rethooks: facts.rethooks,
            }),
            _ => None,
        };
        let generated = event_detour(&EventDetourParams {
            probe_id: probe.id.0,
            miss_slot,
            probe_address: probe.address,
            detour_ip: code,
            args: &probe.args,
            rings: &setup.rings,
            kernel: facts,
            symbols: &self.view.symbols,
            string_size: DEFAULT_STRING_SIZE,
            record_task: facts.current_task.is_some() && facts.pid_offset.is_some() && facts.comm_offset.is_some(),
            filter: probe.filter.as_ref(),
            displaced: &displaced,
            returns,
        })
        .map_err(|e| WhyNotOptimized::EventCode(e.to_string()))?;
        Ok(generated)
    }

    /// The region a jump at `addr` would displace, planned on the function's own bytes.
    fn plan(&self, reg: &Registry, addr: Gva) -> Result<DetourRegion, WhyNotOptimized> {
        let symbols = &self.view.symbols;
        let description = symbols.describe(addr).filter(|d| d.symbol.is_text()).ok_or_else(|| {
            WhyNotOptimized::Region(Arc::new(NotOptimizable::NotInFunction {
                at: addr,
                function: addr..addr,
            }))
        })?;
        let start = Gva(addr.0 - description.offset);
        let size = description.size.min(super::MAX_FUNCTION_BYTES);
        let mut bytes = vec![0u8; size as usize];
        self.machine
            .kernel()
            .read_virt(start, &mut bytes)
            .map_err(|e| WhyNotOptimized::Memory(e.to_string()))?;
        compiler_bytes(reg, start, &mut bytes);
        let end = Gva(start.0 + size);
        let others: Vec<Gva> = reg
            .sites
            .range(start..end)
            .map(|(at, _)| *at)
            .filter(|at| *at != addr)
            .collect();
        let thunks = self.thunks.get_or_init(|| IndirectThunks::from_symbols(symbols));
        let facts = DetourFacts {
            ex_table: &self.view.ex_table,
            patch_sites: &self.view.patch_sites,
            thunks,
        };
        let function = FunctionText {
            body: Code { start, bytes: &bytes },
            ftrace_site: self.ftrace_site(&bytes, start),
            split_parts: &[],
        };
        plan_region(addr, &function, &facts, &others).map_err(|e| WhyNotOptimized::Region(Arc::new(e)))
    }

    /// Frees retired detours that no vCPU is in and no kernel stack points into.
    fn reclaim_detours(&self, view: &dyn PausedView, reg: &mut Registry) {
        // Retired, or live for a site that lost its jump some other way (found gone).
        let retired: Vec<Gva> = reg
            .detour_codes
            .iter()
            .filter(|(_, d)| !d.kept)
            .filter(|(at, d)| {
                !d.live
                    || reg
                        .sites
                        .get(&d.site)
                        .and_then(|s| s.detour.as_ref())
                        .is_none_or(|detour| detour.code != **at)
            })
            .map(|(at, _)| *at)
            .collect();
        if retired.is_empty() {
            return;
        }
        // A vCPU stopped for good counts too: a miss it was counting there is settled
        // from this code's record (`count_misses_the_stop_cut_short`).
        let mut rips = view.parked_rips();
        rips.extend(self.machine.stopped_rips());
        for code in retired {
            let blocks = reg.detour_codes.get(&code).map_or(1, |d| d.blocks);
            let range = code.0..code.0 + blocks * DETOUR_BLOCK;
            if rips.iter().any(|(_, rip)| range.contains(rip)) {
                continue;
            }
            // An exit-free return probe's code stays while a call of it is in flight: the
            // call returns through its stub.
            let returns = reg
                .detour_codes
                .get(&code)
                .map(|d| d.returns.clone())
                .unwrap_or_default();
            let table = self
                .events
                .get()
                .and_then(|s| Some((s.returns.as_ref()?, self.machine.event_memory()?)));
            if let Some((table, mem)) = table {
                if returns.iter().any(|r| !table.all_free(mem, r.first, r.count)) {
                    continue;
                }
            }
            match view.saved_on_stacks(code..Gva(range.end)) {
                Ok(saved) if saved.is_empty() => {
                    if let Some(d) = reg.detour_codes.remove(&code) {
                        for slot in d.miss_slots {
                            self.release_miss_slot(slot);
                        }
                        if let Some((table, _)) = table {
                            for r in d.returns {
                                table.give_back(r.first, r.count);
                            }
                        }
                    }
                    self.free_detour(code, blocks);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!("the retired detour at {code} is kept: {e}");
                }
            }
        }
    }
}

/// The jump, then int3s to the end of the region (see [`Detour::jump`]).
fn padded_jump(jump: &[u8; JMP_REL32_LEN], region: &DetourRegion) -> Vec<u8> {
    let mut bytes = vec![INT3; region.original_bytes().len()];
    bytes[..JMP_REL32_LEN].copy_from_slice(jump);
    bytes
}
