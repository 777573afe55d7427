//! Which probes exist, and the text: our int3 is in the guest's text exactly at the sites
//! of enabled probes while the global switch is on, it is only written or removed with
//! every vCPU paused, and a byte the guest rewrote under it is never overwritten with our
//! stale copy of the original.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use hvprobe_arch::{Gva, INT3};

use super::placed::Placement;
use super::placed::WatchPlacement;
use super::site_jump::{jump_intact, Detour, DetourCodes, WhyNotOptimized};
use super::text::{write_text, TextBounds};
use super::{
    hex, EventShape, KprobeRequest, PostHandler, PreHandler, ProbeError, ProbeId, ProbeKind, ProbePoint, Tracer,
};
use crate::detour::event::filter::RecordFilter;
use crate::detour::DetourRegion;
use crate::insn::{self, Execution, ProbedInsn};
use crate::machine::{KernelMemory, PausedView};
use crate::output::{ListEntry, ListKind};
use crate::spec::FetchArg;

/// Counters a listing shows.
#[derive(Default, Debug)]
pub(super) struct Counters {
    pub hits: AtomicU64,
    pub nmissed: AtomicU64,
    /// Hits its event detour's filter discarded in the guest (counted in `hits` too).
    pub filtered_in_guest: AtomicU64,
}

/// What a registered probe is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// Asked for by the user.
    User,
    /// The engine's own, hidden from the listing: on the guest's `do_exit`, where a task's
    /// followed calls that will never return are freed (the host's equivalent of Linux
    /// freeing a task's kretprobe instances when the task goes).
    TaskExit,
    /// The engine's own, hidden: on the guest's `__put_task_struct` (or `free_task`), where
    /// the calls exit-free return probes follow in the guest for the task being freed (its
    /// last ones never returned: `do_exit`'s final schedule, or calls after `do_exit`
    /// began) are freed — Linux's `rethook_flush_task` at the same moment.
    TaskFree,
    /// The engine's own, hidden: on the guest's `do_init_module` and `module_memfree`,
    /// where module probes are armed and disarmed ([`super::modules`]).
    ModuleLoad,
    ModuleFree,
}

/// A probe's module, for a `MOD:SYM+OFF` probe.
#[derive(Clone, Debug)]
pub(super) struct ModuleBinding {
    pub module: String,
    pub symbol: String,
    pub offset: u64,
    pub state: ModuleProbeState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ModuleProbeState {
    /// The module is not loaded and has not been since the probe was made.
    Pending,
    /// In the module's text.
    Armed,
    /// Its module's memory was freed (unloaded, or init text after the init ran).
    Gone,
}

pub(super) struct Probe {
    pub role: Role,
    pub kind: ProbeKind,
    pub group: String,
    pub event: String,
    /// The address the user asked for.
    pub address: Gva,
    /// `sym+0xoff`: the symbol the user gave, or the function containing an address.
    pub location: String,
    /// Where the int3 goes (past an ftrace NOP when `address` is one).
    pub site: Gva,
    pub args: Vec<FetchArg>,
    pub emit_events: bool,
    pub pre: Option<PreHandler>,
    pub post: Option<PostHandler>,
    pub data_size: usize,
    /// Events carry the guest's kernel stack (see [`KprobeRequest::stack_trace`]).
    pub stack_trace: bool,
    /// See [`KprobeRequest::filter`].
    pub filter: Option<RecordFilter>,
    pub enabled: bool,
    pub counters: Arc<Counters>,
    /// `sym+0xoff/0xsize` of `address`, as hit events show it (`%pS`).
    pub trace_location: String,
    /// The module, for a probe on a module's symbol (its site is 0 while not armed).
    pub module: Option<ModuleBinding>,
    /// A probe of no module that shared a module probe's site lost it when that module's
    /// memory was freed: `[GONE]`, and never armed again (the memory is not its text).
    pub freed: bool,
}

impl Probe {
    /// A probe as `request` asks for it, at `address` (no site yet).
    fn new(role: Role, request: &KprobeRequest, address: Gva, location: String) -> Probe {
        Probe {
            role,
            kind: request.kind,
            group: request.group.clone(),
            event: request.event.clone(),
            address,
            location,
            site: Gva(0),
            args: request.args.clone(),
            emit_events: request.emit_events || !request.args.is_empty(),
            pre: request.pre.clone(),
            post: request.post.clone(),
            data_size: request.data_size,
            stack_trace: request.stack_trace,
            filter: request.filter.clone(),
            enabled: !request.disabled,
            counters: Arc::default(),
            trace_location: String::new(),
            module: match &request.point {
                ProbePoint::Module { module, name, offset } => Some(ModuleBinding {
                    module: module.clone(),
                    symbol: name.clone(),
                    offset: *offset,
                    state: ModuleProbeState::Pending,
                }),
                _ => None,
            },
            freed: false,
        }
    }
}

/// The user's events, each with its shape and how many probes it stands for (one event
/// may stand for several: [`KprobeRequest::may_join`]).
#[derive(Clone, Default)]
struct EventNames {
    events: HashMap<(String, String), (usize, EventShape)>,
}

impl EventNames {
    /// Whether `request` may be a probe of its event: a new event, or one more probe of
    /// an event it may join.
    fn admit(&self, request: &KprobeRequest) -> Result<(), ProbeError> {
        match self.events.get(&(request.group.clone(), request.event.clone())) {
            Some((_, shape)) if !request.may_join(shape) => Err(ProbeError::DuplicateEvent {
                group: request.group.clone(),
                event: request.event.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn add(&mut self, request: &KprobeRequest) {
        self.events
            .entry((request.group.clone(), request.event.clone()))
            .or_insert_with(|| (0, request.event_shape()))
            .0 += 1;
    }

    fn remove(&mut self, group: &str, event: &str) {
        let key = (group.to_owned(), event.to_owned());
        if let Some((probes, _)) = self.events.get_mut(&key) {
            *probes -= 1;
            if *probes == 0 {
                self.events.remove(&key);
            }
        }
    }
}

pub(super) struct Site {
    /// The original first byte, written back on disarm.
    pub original: u8,
    /// The decoded original instruction; `None` when the guest had its own int3 there.
    pub insn: Option<ProbedInsn>,
    /// The out-of-line copy: the instruction's own for one that is stepped, or a fallback
    /// for an emulated one that can fault (a push or a call whose stack page is not
    /// present), so that the CPU raises the real fault.
    pub slot: Option<(Gva, insn::OutOfLine)>,
    /// Probes here, in registration order.
    pub probes: Vec<ProbeId>,
    /// Our int3 is in the text (or, when `detour` is set, our jump).
    pub armed: bool,
    /// The guest rewrote the byte under our int3: we no longer own it.
    pub gone: bool,
    /// The jump to its detour, while the site is optimized.
    pub detour: Option<Detour>,
    /// Why the site is not optimized (while the switch is on).
    pub not_optimized: Option<WhyNotOptimized>,
    /// The module whose code it is in, and the start of the module's memory (its core or
    /// init layout) that holds it: a free of that memory takes the site out.
    pub module: Option<(String, Gva)>,
}

impl Site {
    pub fn shared_with_guest(&self) -> bool {
        self.original == INT3
    }
}

pub(super) struct Registry {
    pub probes: BTreeMap<ProbeId, Probe>,
    /// By address (a function's sites are one range of it).
    pub sites: BTreeMap<Gva, Site>,
    /// `group/event` of the user's probes, for the duplicate check.
    events: EventNames,
    next_id: u32,
    /// The global switch (debugfs `enabled`).
    pub armed: bool,
    /// The optimization switch (`debug.kprobes_optimization`).
    pub optimization: bool,
    /// Every detour's code, live or retired.
    pub detour_codes: DetourCodes,
    /// Which watch owns each debug register.
    pub watch_slots: super::placed::WatchSlots,
}

impl Registry {
    /// The sites whose optimized region has `at` inside it (past its first byte). Only
    /// the sites less than [`MAX_REGION_LEN`](crate::detour::MAX_REGION_LEN) bytes before
    /// `at` can: looked up there, not through every site below it (arming N probes in
    /// address order was N²/2 steps).
    pub(super) fn regions_covering(&self, at: Gva) -> impl Iterator<Item = Gva> + '_ {
        self.sites
            .range(Gva(at.0.saturating_sub(crate::detour::MAX_REGION_LEN))..at)
            .filter(move |(_, s)| s.detour.as_ref().is_some_and(|d| d.region.is_interior(at)))
            .map(|(a, _)| *a)
    }

    pub fn new() -> Self {
        Registry {
            probes: BTreeMap::new(),
            sites: BTreeMap::new(),
            events: EventNames::default(),
            next_id: 0,
            armed: true,
            optimization: false,
            detour_codes: DetourCodes::new(),
            watch_slots: Default::default(),
        }
    }

    /// The first of `ids` that is not a user probe of this registry.
    fn first_unknown(&self, ids: &[ProbeId]) -> Option<ProbeId> {
        ids.iter()
            .copied()
            .find(|id| !self.probes.get(id).is_some_and(|p| p.role == Role::User))
    }

    fn user_probes(&self) -> impl Iterator<Item = (&ProbeId, &Probe)> {
        self.probes.iter().filter(|(_, p)| p.role == Role::User)
    }
}

/// A request of a batch, checked.
enum Placed {
    Probe(Placement),
    Watch(WatchPlacement),
    /// A module probe whose module is not loaded.
    Pending,
}

impl Tracer {
    /// Registers a kprobe and arms it (unless disabled or globally disarmed).
    pub fn register(&self, request: KprobeRequest) -> Result<ProbeId, ProbeError> {
        self.register_all(vec![request]).map(|ids| ids[0]).map_err(|(_, e)| e)
    }

    /// Registers all or none, in one pause of the vCPUs: no vCPU runs a probe of the batch
    /// before the whole batch is in. When one fails nothing of the batch stays, and the
    /// error says which request failed (0-based).
    pub fn register_all(&self, requests: Vec<KprobeRequest>) -> Result<Vec<ProbeId>, (usize, ProbeError)> {
        let mut placed = Vec::with_capacity(requests.len());
        let wants_module_hooks = requests.iter().any(|r| matches!(r.point, ProbePoint::Module { .. }));
        let module_hooks = if wants_module_hooks {
            self.relist_modules("module probes").map_err(|e| (0, e))?;
            Some(self.module_hook_placements().map_err(|e| (0, e))?)
        } else {
            None
        };
        for (i, request) in requests.iter().enumerate() {
            if matches!(request.kind, ProbeKind::Watch { .. }) {
                let watch = self.place_watch(request).map_err(|e| (i, e))?;
                placed.push(Placed::Watch(watch));
                continue;
            }
            let placement = match self.place(&request.point) {
                Err(ProbeError::ModuleNotLoaded { what, .. }) => {
                    if let (ProbeKind::Kretprobe { .. }, ProbePoint::Module { offset: 1.., .. }) =
                        (request.kind, &request.point)
                    {
                        return Err((i, ProbeError::ReturnProbeNotAtEntry { what }));
                    }
                    if let ProbeKind::Kretprobe { .. } = request.kind {
                        self.make_trampoline().map_err(|e| (i, e))?;
                    }
                    placed.push(Placed::Pending);
                    continue;
                }
                other => other.map_err(|e| (i, e))?,
            };
            if let ProbeKind::Kretprobe { .. } = request.kind {
                if !placement.at_function_entry {
                    return Err((
                        i,
                        ProbeError::ReturnProbeNotAtEntry {
                            what: placement.what.clone(),
                        },
                    ));
                }
                self.make_trampoline().map_err(|e| (i, e))?;
            }
            placed.push(Placed::Probe(placement));
        }
        let wants_exit_hook = requests.iter().any(|r| matches!(r.kind, ProbeKind::Kretprobe { .. }));
        let task_hooks = if wants_exit_hook {
            self.task_hook_placements()
        } else {
            Vec::new()
        };
        let mut result = Ok(Vec::new());
        self.paused(&mut |view| {
            let mut reg = self.write_registry();
            let mut done = Vec::with_capacity(requests.len());
            for (i, (request, placement)) in requests.iter().zip(&placed).enumerate() {
                let registered = match placement {
                    Placed::Probe(placement) => {
                        self.register_paused(view.text(), &mut reg, request, placement, Role::User)
                    }
                    Placed::Watch(watch) => self.register_watch_paused(&mut reg, request, watch),
                    Placed::Pending => self.register_pending_paused(&mut reg, request),
                };
                let registered = registered.and_then(|id| match self.sync_debug_registers(&reg) {
                    Ok(()) => Ok(id),
                    Err(e) => {
                        self.remove_paused(view, &mut reg, id);
                        Err(e)
                    }
                });
                match registered {
                    Ok(id) => done.push(id),
                    Err(e) => {
                        for id in done.drain(..).rev() {
                            self.remove_paused(view, &mut reg, id);
                        }
                        if let Err(e) = self.sync_debug_registers(&reg) {
                            tracing::error!("the debug registers after a failed registration: {e}");
                        }
                        result = Err((i, e));
                        return;
                    }
                }
            }
            self.ensure_task_hooks(view.text(), &mut reg, &task_hooks);
            if let Some(hooks) = &module_hooks {
                if let Err(e) = self.ensure_module_hooks(view.text(), &mut reg, hooks) {
                    for id in done.drain(..).rev() {
                        self.remove_paused(view, &mut reg, id);
                    }
                    self.drop_module_hooks_if_unused(view, &mut reg);
                    result = Err((0, e));
                    return;
                }
            }
            result = Ok(done);
        })
        .map_err(|e| (0, e.into()))?;
        if result.is_ok() && placed.iter().any(|p| matches!(p, Placed::Pending)) {
            // A module that loaded between the list's read and the pause: its load came
            // before our hook (or it was the first module probe), so arm its probes now.
            self.arm_pending_of_loaded_modules();
        }
        result
    }

    /// Every reason each request would be refused, without registering anything or pausing
    /// the guest: an unknown or ambiguous symbol, an offset outside the function, the
    /// blacklist, a patch site, not an instruction boundary, a return probe off an entry, a
    /// duplicate event name. `(index, error)` in request order; empty when all would go
    /// in (a registration can still fail if the guest changes its text meanwhile).
    pub fn check_all(&self, requests: &[KprobeRequest]) -> Vec<(usize, ProbeError)> {
        let mut problems = Vec::new();
        let mut names = self.read_registry().events.clone();
        for (i, request) in requests.iter().enumerate() {
            if let Err(e) = names.admit(request) {
                problems.push((i, e));
                continue;
            }
            names.add(request);
            if matches!(request.kind, ProbeKind::Watch { .. }) {
                if let Err(e) = self.place_watch(request) {
                    problems.push((i, e));
                }
                continue;
            }
            match self.place(&request.point) {
                Err(ProbeError::ModuleNotLoaded { .. }) => {}
                Err(e) => problems.push((i, e)),
                Ok(placement) => {
                    if matches!(request.kind, ProbeKind::Kretprobe { .. }) && !placement.at_function_entry {
                        problems.push((i, ProbeError::ReturnProbeNotAtEntry { what: placement.what }));
                    } else if placement.bytes.first() != Some(&INT3) {
                        // (On the guest's own int3 there is nothing to decode: ours shares it.)
                        if let Err(e) = analyze_site(&placement) {
                            problems.push((i, e));
                        }
                    }
                }
            }
        }
        problems
    }

    /// Unregisters a probe; its int3 goes when it was the last probe at its site. No
    /// handler of the probe runs once this returns (Linux's guarantee): hits in progress
    /// finished before the pause, and a step in flight looks its probes up when it ends.
    pub fn unregister(&self, id: ProbeId) -> Result<(), ProbeError> {
        self.unregister_many(&[id])
    }

    /// Unregisters several probes in one pause (`unregister_kprobes`): all of them, or
    /// none when one of them does not exist.
    pub fn unregister_many(&self, ids: &[ProbeId]) -> Result<(), ProbeError> {
        // What their event detours recorded so far still counts.
        self.drain_events();
        let mut result = Ok(());
        self.paused(&mut |view| {
            let mut reg = self.write_registry();
            if let Some(missing) = reg.first_unknown(ids) {
                result = Err(ProbeError::NoSuchProbe(missing));
                return;
            }
            for id in ids {
                self.remove_paused(view, &mut reg, *id);
            }
            self.drop_task_exit_hook_if_unused(view, &mut reg);
            self.drop_module_hooks_if_unused(view, &mut reg);
            if let Err(e) = self.sync_debug_registers(&reg) {
                result = Err(e);
            }
        })?;
        result
    }

    /// Unregisters every probe, the engine's own included (at exit: the text is as it was
    /// before).
    pub fn unregister_all(&self) -> Result<(), ProbeError> {
        self.drain_events();
        self.paused(&mut |view| {
            let mut reg = self.write_registry();
            let ids: Vec<ProbeId> = reg.probes.keys().copied().collect();
            for id in ids {
                self.remove_paused(view, &mut reg, id);
            }
            self.drop_module_hooks_if_unused(view, &mut reg);
            if let Err(e) = self.sync_debug_registers(&reg) {
                tracing::error!("clearing the debug registers: {e}");
            }
        })?;
        Ok(())
    }

    /// Enables or disables one probe (`enable_kprobe` / `disable_kprobe`).
    pub fn set_enabled(&self, id: ProbeId, enabled: bool) -> Result<(), ProbeError> {
        self.set_enabled_many(&[id], enabled)
    }

    /// Enables or disables several probes in one pause: all of them, or none when one of
    /// them does not exist.
    pub fn set_enabled_many(&self, ids: &[ProbeId], enabled: bool) -> Result<(), ProbeError> {
        let mut result = Ok(());
        self.paused(&mut |view| {
            let mut reg = self.write_registry();
            if let Some(missing) = reg.first_unknown(ids) {
                result = Err(ProbeError::NoSuchProbe(missing));
                return;
            }
            for id in ids {
                let Some(probe) = reg.probes.get_mut(id) else { continue };
                probe.enabled = enabled;
                let site = probe.site;
                sync_site(self, view.text(), &mut reg, site);
            }
            if let Err(e) = self.sync_debug_registers(&reg) {
                result = Err(e);
            }
        })?;
        result
    }

    /// The global switch: disarms every site (or arms them again) without changing each
    /// probe's own enabled state.
    pub fn set_armed(&self, armed: bool) -> Result<(), ProbeError> {
        self.paused(&mut |view| {
            let mut reg = self.write_registry();
            reg.armed = armed;
            let sites: Vec<Gva> = reg.sites.keys().copied().collect();
            for site in sites {
                sync_site(self, view.text(), &mut reg, site);
            }
            if let Err(e) = self.sync_debug_registers(&reg) {
                tracing::error!("the debug registers after the global switch: {e}");
            }
        })?;
        Ok(())
    }

    pub fn is_armed(&self) -> bool {
        self.read_registry().armed
    }

    /// The probes, in registration order, in the debugfs `list` layout's terms (after a
    /// look for probes the guest overwrote).
    pub fn listing(&self) -> Vec<ListEntry> {
        self.drain_events();
        self.check_gone();
        let reg = self.read_registry();
        reg.user_probes()
            .map(|(_, p)| {
                // A watch has no site (an int3 probe's at its address is not its own).
                let site = match p.kind {
                    ProbeKind::Watch { .. } => None,
                    _ => reg.sites.get(&p.site),
                };
                ListEntry {
                    address: p.address,
                    kind: match p.kind {
                        ProbeKind::Kprobe => ListKind::Kprobe,
                        ProbeKind::Kretprobe { .. } => ListKind::Kretprobe,
                        ProbeKind::Watch { .. } => ListKind::Watch,
                    },
                    location: p.location.clone(),
                    disabled: !p.enabled,
                    gone: site.is_some_and(|s| s.gone)
                        || p.freed
                        || p.module.as_ref().is_some_and(|m| m.state == ModuleProbeState::Gone),
                    ftrace: false,
                    optimized: site.is_some_and(|s| s.detour.is_some()),
                    not_optimized: match (reg.optimization, site) {
                        (true, Some(s)) if s.detour.is_none() => s.not_optimized.as_ref().map(|w| w.to_string()),
                        _ => None,
                    },
                    return_trapped: site
                        .filter(|s| s.detour.is_some())
                        .and_then(|s| self.why_return_traps(&reg, p, s)),
                    hits: p.counters.hits.load(Ordering::Relaxed),
                    nmissed: p.counters.nmissed.load(Ordering::Relaxed),
                    filtered_in_guest: p.counters.filtered_in_guest.load(Ordering::Relaxed),
                    event: format!("{}/{}", p.group, p.event),
                    module: p.module.as_ref().map(|m| m.module.clone()),
                    pending: p.module.as_ref().is_some_and(|m| m.state == ModuleProbeState::Pending),
                }
            })
            .collect()
    }

    /// Re-reads every armed site and marks those whose int3 the guest overwrote as gone
    /// (they are never written back). The engine does this itself at every pause and
    /// whenever an int3 exit finds a site not as it left it.
    pub fn check_gone(&self) {
        self.find_gone(self.machine.kernel());
    }

    pub(super) fn find_gone(&self, text: &dyn KernelMemory) {
        let mut reg = self.write_registry();
        let mut kept = Vec::new();
        for (addr, site) in reg.sites.iter_mut() {
            if !site.armed || site.gone {
                continue;
            }
            if let Some(detour) = &site.detour {
                if !jump_intact(text, *addr, detour) {
                    let mut now = vec![0u8; detour.jump.len()];
                    let _ = text.read_virt(*addr, &mut now);
                    tracing::warn!(
                        "the guest rewrote our jump at {addr} (now {}): its probes are [GONE], the bytes stay as \
                         the guest wrote them, and so does the detour (the guest may have copied the jump)",
                        super::hex(&now)
                    );
                    kept.push(detour.code);
                    self.mark_gone(site);
                }
                continue;
            }
            let mut b = [0u8];
            if text.read_virt(*addr, &mut b).is_ok() && b[0] != INT3 {
                tracing::warn!(
                    "the guest rewrote the probed byte at {addr} (our int3 is now {:#04x}; originally {:#04x}): \
                     its probes are [GONE] and the byte stays as the guest wrote it",
                    b[0],
                    site.original
                );
                self.mark_gone(site);
            }
        }
        for code in kept {
            if let Some(code) = reg.detour_codes.get_mut(&code) {
                code.kept = true;
            }
        }
    }

    fn mark_gone(&self, site: &mut Site) {
        site.gone = true;
        site.armed = false;
        site.detour = None;
        self.stats.gone.fetch_add(1, Ordering::Relaxed);
    }

    /// The user's probe ids, in registration order.
    pub fn probe_ids(&self) -> Vec<ProbeId> {
        self.read_registry().user_probes().map(|(id, _)| *id).collect()
    }

    /// Every user probe with its group and event, in registration order.
    pub fn events(&self) -> Vec<(ProbeId, String, String)> {
        self.read_registry()
            .user_probes()
            .map(|(id, p)| (*id, p.group.clone(), p.event.clone()))
            .collect()
    }

    pub(super) fn register_paused(
        &self,
        text: &dyn KernelMemory,
        reg: &mut Registry,
        request: &KprobeRequest,
        placement: &Placement,
        role: Role,
    ) -> Result<ProbeId, ProbeError> {
        if reg.watch_slots.execute_at(placement.site) {
            return Err(ProbeError::ProbeOnWatch {
                what: placement.what.clone(),
            });
        }
        let id = ProbeId(reg.next_id);
        if role == Role::User {
            reg.events.admit(request)?;
        }
        reg.probes.insert(
            id,
            Probe::new(role, request, placement.address, placement.location.clone()),
        );
        if let Err(e) = self.attach_to_site(text, reg, id, placement) {
            reg.probes.remove(&id);
            return Err(e);
        }
        reg.next_id += 1;
        if role == Role::User {
            reg.events.add(request);
        }
        Ok(id)
    }

    /// Registers a module probe whose module is not loaded: no site until it loads.
    fn register_pending_paused(&self, reg: &mut Registry, request: &KprobeRequest) -> Result<ProbeId, ProbeError> {
        let ProbePoint::Module { name, offset, .. } = &request.point else {
            unreachable!("only module probes are pending");
        };
        reg.events.admit(request)?;
        let id = ProbeId(reg.next_id);
        reg.next_id += 1;
        reg.events.add(request);
        let location = format!("{name}+{offset:#x}");
        reg.probes.insert(id, Probe::new(Role::User, request, Gva(0), location));
        Ok(id)
    }

    /// Puts registered probe `id` on the site of `placement` (made when new) and syncs
    /// the site; the probe takes the placement's address and names.
    pub(super) fn attach_to_site(
        &self,
        text: &dyn KernelMemory,
        reg: &mut Registry,
        id: ProbeId,
        placement: &Placement,
    ) -> Result<(), ProbeError> {
        if !reg.sites.contains_key(&placement.site) {
            // A new site inside an optimized region: the region goes back to its int3 (and
            // stays so while this probe lives), so the text here is the guest's again.
            let covering: Vec<Gva> = reg.regions_covering(placement.site).collect();
            for addr in covering {
                if let Some(site) = reg.sites.get_mut(&addr) {
                    unoptimize(text, &self.text_bounds, addr, site, &mut reg.detour_codes);
                }
            }
            let site = self.new_site(text, placement)?;
            reg.sites.insert(placement.site, site);
        } else if let Some(site) = reg.sites.get_mut(&placement.site) {
            // A kernel probe's site in what is now a module's memory: the module's free must
            // take it out too (its probes then go `[GONE]`), not leave our int3 there.
            if site.module.is_none() {
                site.module = placement.module.clone();
            }
        }
        if let Some(probe) = reg.probes.get_mut(&id) {
            probe.address = placement.address;
            probe.site = placement.site;
            probe.location = placement.location.clone();
            probe.trace_location = placement.trace_location.clone();
            if let Some(binding) = &mut probe.module {
                binding.state = ModuleProbeState::Armed;
            }
        }
        if let Some(site) = reg.sites.get_mut(&placement.site) {
            site.probes.push(id);
        }
        sync_site(self, text, reg, placement.site);
        Ok(())
    }

    /// Takes the site at `addr` out of the text and the registry without a pause (its
    /// memory is being freed: no vCPU runs it), its out-of-line copy retired; its probes
    /// stay registered with no site. Their ids.
    pub(super) fn detach_site(&self, text: &dyn KernelMemory, reg: &mut Registry, addr: Gva) -> Vec<ProbeId> {
        let Some(mut site) = reg.sites.remove(&addr) else {
            return Vec::new();
        };
        disarm(self, text, addr, &mut site, &mut reg.detour_codes);
        if let Some((slot, _)) = site.slot {
            self.retire_slot_later(slot);
        }
        for id in &site.probes {
            if let Some(p) = reg.probes.get_mut(id) {
                p.site = Gva(0);
            }
        }
        site.probes
    }

    /// Registers a watch with the vCPUs paused: a probe with no site, and its debug
    /// register (loaded by the caller's [`Tracer::sync_debug_registers`]).
    fn register_watch_paused(
        &self,
        reg: &mut Registry,
        request: &KprobeRequest,
        watch: &WatchPlacement,
    ) -> Result<ProbeId, ProbeError> {
        reg.events.admit(request)?;
        let id = ProbeId(reg.next_id);
        self.take_watch_slot(reg, id, watch)?;
        reg.next_id += 1;
        reg.events.add(request);
        let address = watch.breakpoint.address();
        reg.probes.insert(
            id,
            Probe {
                role: Role::User,
                kind: request.kind,
                group: request.group.clone(),
                event: request.event.clone(),
                address,
                location: watch.location.clone(),
                site: address,
                args: request.args.clone(),
                emit_events: request.emit_events || !request.args.is_empty(),
                pre: None,
                post: None,
                data_size: 0,
                stack_trace: request.stack_trace,
                filter: None,
                enabled: !request.disabled,
                counters: Arc::default(),
                trace_location: watch.trace_location.clone(),
                module: None,
                freed: false,
            },
        );
        Ok(id)
    }

    /// Removes a probe with the vCPUs paused; its site goes with its last probe, and the
    /// site's out-of-line copy is freed once no vCPU can be in it.
    pub(super) fn remove_paused(&self, view: &dyn PausedView, reg: &mut Registry, id: ProbeId) {
        let Some(probe) = reg.probes.remove(&id) else {
            return;
        };
        if probe.role == Role::User {
            reg.events.remove(&probe.group, &probe.event);
        }
        if matches!(probe.kind, ProbeKind::Watch { .. }) {
            reg.watch_slots.release(id);
            return;
        }
        let site_addr = probe.site;
        let now_empty = match reg.sites.get_mut(&site_addr) {
            Some(site) => {
                site.probes.retain(|p| *p != id);
                site.probes.is_empty()
            }
            None => false,
        };
        if now_empty {
            if let Some(site) = reg.sites.get_mut(&site_addr) {
                disarm(self, view.text(), site_addr, site, &mut reg.detour_codes);
                if site.armed {
                    // Our int3 could not be taken out: the site stays, with no probes, so
                    // that its hits still run the original instruction.
                    return;
                }
            }
            if let Some(site) = reg.sites.remove(&site_addr) {
                if let Some((slot, _)) = site.slot {
                    self.retire_slot(view, slot);
                }
            }
        } else {
            sync_site(self, view.text(), reg, site_addr);
        }
    }

    /// Where the task hooks go: `do_exit` (the trapped path's calls of an exiting task) and
    /// `__put_task_struct` (the exit-free path's: the task's last reference goes, and it
    /// frees the task with `free_task`), those the guest has and we can probe; `free_task`
    /// itself where `__put_task_struct` cannot be placed. `__put_task_struct` first: its
    /// first instructions after the ftrace call take a jump, while a kernel with the
    /// function_graph tracer calls out of `free_task` four bytes in, so a hook there is an
    /// int3 (an exit and an emulation per task freed).
    fn task_hook_placements(&self) -> Vec<(Role, Placement)> {
        let mut hooks = Vec::new();
        for (role, name) in [
            (Role::TaskExit, "do_exit"),
            (Role::TaskFree, "__put_task_struct"),
            (Role::TaskFree, "free_task"),
        ] {
            // One hook per role: the first that is placed.
            if hooks.iter().any(|(r, _)| *r == role) {
                continue;
            }
            let point = ProbePoint::Symbol {
                name: name.into(),
                offset: 0,
            };
            match self.place(&point) {
                Ok(p) => hooks.push((role, p)),
                Err(e) => {
                    tracing::debug!("no {name} hook ({e}): its tasks' calls are freed when their stack is reused");
                }
            }
        }
        hooks
    }

    fn ensure_task_hooks(&self, text: &dyn KernelMemory, reg: &mut Registry, hooks: &[(Role, Placement)]) {
        for (role, placement) in hooks {
            if reg.probes.values().any(|p| p.role == *role) {
                continue;
            }
            let request = KprobeRequest {
                emit_events: false,
                ..KprobeRequest::event(
                    ProbePoint::Address(placement.address),
                    "hvprobe",
                    if *role == Role::TaskExit {
                        "task_exit"
                    } else {
                        "task_free"
                    },
                    Vec::new(),
                )
            };
            if let Err(e) = self.register_paused(text, reg, &request, placement, *role) {
                tracing::warn!(
                    "cannot hook the guest's {} ({e}): calls of exiting tasks are freed later",
                    placement.what
                );
            }
        }
    }

    /// Takes the task hooks out when no return probe is left and no exit-free return
    /// probe's code still has calls in flight (they are freed at `free_task`).
    pub(super) fn drop_task_exit_hook_if_unused(&self, view: &dyn PausedView, reg: &mut Registry) {
        let returns_left = reg
            .probes
            .values()
            .any(|p| matches!(p.kind, ProbeKind::Kretprobe { .. }));
        let exit_free_code_left = reg.detour_codes.values().any(|d| !d.returns.is_empty());
        if returns_left || exit_free_code_left {
            return;
        }
        let hooks: Vec<ProbeId> = reg
            .probes
            .iter()
            .filter(|(_, p)| matches!(p.role, Role::TaskExit | Role::TaskFree))
            .map(|(id, _)| *id)
            .collect();
        for id in hooks {
            self.remove_paused(view, reg, id);
        }
    }

    fn new_site(&self, text: &dyn KernelMemory, placement: &Placement) -> Result<Site, ProbeError> {
        let what = &placement.what;
        let mut current = [0u8];
        text.read_virt(placement.site, &mut current)
            .map_err(|source| ProbeError::Memory {
                what: what.clone(),
                source,
            })?;
        if current[0] == INT3 {
            // The guest's own int3 (its kprobe, or text_poke in progress): ours runs
            // first, then the guest gets its #BP, so its handlers still see every hit.
            return Ok(Site {
                original: INT3,
                insn: None,
                slot: None,
                probes: Vec::new(),
                armed: false,
                gone: false,
                detour: None,
                not_optimized: None,
                module: placement.module.clone(),
            });
        }
        let (insn, step) = analyze_site(placement)?;
        // The bytes were read and decoded while the guest ran: the copy we step or the
        // instruction we emulate must be what the text holds now.
        let mut now = vec![0u8; insn.len];
        text.read_virt(placement.site, &mut now)
            .map_err(|source| ProbeError::Memory {
                what: what.clone(),
                source,
            })?;
        if now != insn.bytes {
            return Err(ProbeError::Unprobeable {
                what: what.clone(),
                reason: format!(
                    "the guest rewrote the instruction while it was being checked (was {}, now {})",
                    hex(&insn.bytes),
                    hex(&now)
                ),
            });
        }
        let slot = match step {
            // No out-of-line area is needed for instructions the host always completes.
            Some(step) if matches!(insn.execution, Execution::Emulate(_)) && !self.has_out_of_line_area() => {
                tracing::debug!(
                    "{what}: no out-of-line area for the fallback step of {}",
                    step_name(&step)
                );
                None
            }
            Some(step) => {
                self.make_step_guard(what)?;
                let slot = self.allocate_slot(what)?;
                let written = step
                    .copy_for(&insn, slot)
                    .map_err(|source| ProbeError::Decode {
                        what: what.clone(),
                        source,
                    })
                    .and_then(|mut copy| {
                        // int3s after the copy, never what an earlier copy left there: a
                        // backend that loses the step's trap (kvm_pvm after a fence) runs
                        // on into them, and the engine ends the step at the first.
                        copy.resize(super::SLOT_SIZE as usize, INT3);
                        text.write_virt(slot, &copy).map_err(|source| ProbeError::Memory {
                            what: what.clone(),
                            source,
                        })
                    });
                if let Err(e) = written {
                    self.free_slot(slot);
                    return Err(e);
                }
                Some((slot, step))
            }
            None => None,
        };
        Ok(Site {
            original: current[0],
            insn: Some(insn),
            slot,
            probes: Vec::new(),
            armed: false,
            gone: false,
            detour: None,
            not_optimized: None,
            module: placement.module.clone(),
        })
    }
}

/// The instruction at a placement and, when it is stepped (or can fall back to a step),
/// how; or why it cannot be probed.
fn analyze_site(placement: &Placement) -> Result<(ProbedInsn, Option<insn::OutOfLine>), ProbeError> {
    let what = &placement.what;
    let insn = insn::analyze(&placement.bytes, placement.site).map_err(|source| ProbeError::Decode {
        what: what.clone(),
        source,
    })?;
    let step = match &insn.execution {
        Execution::Emulate(emulation) => emulation.fallback_step(&insn),
        Execution::Refuse(reason) => {
            return Err(ProbeError::Unprobeable {
                what: what.clone(),
                reason: format!("{} ({})", reason, hex(&insn.bytes)),
            })
        }
        Execution::Step(step) => {
            if placement.may_fault {
                return Err(ProbeError::Unprobeable {
                    what: what.clone(),
                    reason: "the instruction is in the guest's exception table (it may fault, and a fault in an \
                             out-of-line copy has no fixup)"
                        .into(),
                });
            }
            Some(*step)
        }
    };
    Ok((insn, step))
}

fn step_name(step: &insn::OutOfLine) -> String {
    format!("{:?}", step.kind)
}

/// Writes or removes the int3 of the site at `addr` to match its probes and the global
/// switch. A site it finds the guest rewrote is counted gone.
fn sync_site(tracer: &Tracer, text: &dyn KernelMemory, reg: &mut Registry, addr: Gva) {
    let enabled = |role: Option<Role>| {
        reg.sites.get(&addr).is_some_and(|s| {
            s.probes.iter().any(|id| {
                reg.probes
                    .get(id)
                    .is_some_and(|p| p.enabled && role.is_none_or(|r| p.role == r))
            })
        })
    };
    // The module loader's hooks stay in while the global switch is off: a module freed
    // meanwhile must still take our int3s with it.
    let want = (reg.armed && enabled(None)) || enabled(Some(Role::ModuleLoad)) || enabled(Some(Role::ModuleFree));
    let Some(site) = reg.sites.get_mut(&addr) else { return };
    let was_gone = site.gone;
    let bounds = &tracer.text_bounds;
    if want && !site.armed && !site.gone {
        arm(text, bounds, addr, site);
    } else if !want && site.armed {
        // Back to the int3 first (the optimization pass may put the jump in again).
        unoptimize(text, bounds, addr, site, &mut reg.detour_codes);
        if site.armed {
            site.armed = !site.shared_with_guest() && !restore_original(text, bounds, addr, site);
        }
    }
    if site.gone && !was_gone {
        tracer.stats.gone.fetch_add(1, Ordering::Relaxed);
    }
}

/// Writes the int3, unless the guest changed the byte since we read it.
fn arm(text: &dyn KernelMemory, bounds: &TextBounds, addr: Gva, site: &mut Site) {
    if site.shared_with_guest() {
        // The guest's int3 is already there: nothing to write.
        site.armed = true;
        return;
    }
    let mut b = [0u8];
    match text.read_virt(addr, &mut b) {
        Ok(()) if b[0] == site.original => match write_text(text, bounds, addr, &[INT3]) {
            Ok(()) => site.armed = true,
            Err(e) => tracing::error!("arming the probe at {addr}: {e}"),
        },
        Ok(()) => {
            tracing::warn!(
                "the guest rewrote {addr} ({:#04x}, was {:#04x}): probe gone",
                b[0],
                site.original
            );
            site.gone = true;
        }
        Err(e) => tracing::error!("arming the probe at {addr}: {e}"),
    }
}

/// Puts the original byte back, unless the guest has overwritten our int3 (then writing
/// our stale copy would corrupt its text). False when our int3 may still be there.
fn restore_original(text: &dyn KernelMemory, bounds: &TextBounds, addr: Gva, site: &mut Site) -> bool {
    let mut b = [0u8];
    match text.read_virt(addr, &mut b) {
        Ok(()) if b[0] == INT3 => match write_text(text, bounds, addr, &[site.original]) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!("disarming the probe at {addr}: {e}: our int3 stays, and its hits still run");
                false
            }
        },
        Ok(()) => {
            tracing::warn!(
                "the guest rewrote our int3 at {addr} (now {:#04x}): left as it is",
                b[0]
            );
            site.gone = true;
            true
        }
        Err(e) => {
            tracing::error!("disarming the probe at {addr}: {e}: our int3 stays, and its hits still run");
            false
        }
    }
}

fn disarm(tracer: &Tracer, text: &dyn KernelMemory, addr: Gva, site: &mut Site, codes: &mut DetourCodes) {
    if !site.armed {
        return;
    }
    let bounds = &tracer.text_bounds;
    unoptimize(text, bounds, addr, site, codes);
    if !site.armed {
        // The guest rewrote our jump.
        tracer.stats.gone.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if site.shared_with_guest() {
        site.armed = false;
        return;
    }
    let was_gone = site.gone;
    site.armed = !restore_original(text, bounds, addr, site);
    if site.gone && !was_gone {
        tracer.stats.gone.fetch_add(1, Ordering::Relaxed);
    }
}

/// Puts the int3 and the original bytes back where the site's jump is (the probe stays
/// armed), and retires its detour. A jump the guest rewrote makes the site gone; its bytes
/// stay as the guest wrote them.
pub(super) fn unoptimize(
    text: &dyn KernelMemory,
    bounds: &TextBounds,
    addr: Gva,
    site: &mut Site,
    codes: &mut DetourCodes,
) {
    let Some(detour) = site.detour.take() else { return };
    if let Some(code) = codes.get_mut(&detour.code) {
        code.live = false;
    }
    let mut now = vec![0u8; detour.jump.len()];
    match text.read_virt(addr, &mut now) {
        Ok(()) if now == detour.jump => {
            if let Err(e) = write_text(text, bounds, addr, &armed_bytes(&detour.region)) {
                // The jump stays, and so does its detour: hits still go through it.
                tracing::error!("unoptimizing the probe at {addr}: {e}: the jump stays");
                if let Some(code) = codes.get_mut(&detour.code) {
                    code.live = true;
                }
                site.detour = Some(detour);
            }
        }
        Ok(()) => {
            tracing::warn!(
                "the guest rewrote our jump at {addr} (now {}): the probe is [GONE], the bytes stay, and so \
                 does its detour (the guest may have copied the jump)",
                super::hex(&now)
            );
            if let Some(code) = codes.get_mut(&detour.code) {
                code.kept = true;
            }
            site.gone = true;
            site.armed = false;
        }
        Err(e) => {
            tracing::error!("unoptimizing the probe at {addr}: {e}: the jump stays");
            if let Some(code) = codes.get_mut(&detour.code) {
                code.live = true;
            }
            site.detour = Some(detour);
        }
    }
}

/// What an armed, unoptimized site holds where its jump goes: our int3, then the
/// original bytes of the rest of the region.
pub(super) fn armed_bytes(region: &DetourRegion) -> Vec<u8> {
    let mut bytes = region.original_bytes();
    bytes[0] = INT3;
    bytes
}
