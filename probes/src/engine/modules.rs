//! Probes in kernel modules. Invariant: a probe on a module's code is armed exactly while
//! that code is live — from before the module's init runs until before the memory it is
//! in is freed — and is listed pending (its module not loaded) or `[GONE]` (unloaded)
//! otherwise.
//!
//! Linux's kprobes follow modules through the module notifier (`MODULE_STATE_COMING`, and
//! `MODULE_STATE_GOING`/`LIVE` to kill probes on freed code). The host has no notifier: it
//! puts two hidden probes of its own on the guest's module loader while any module probe
//! exists —
//! - `do_init_module(mod)` (kept out of line by the kernel for debuggers; gdb's
//!   `lx-symbols` breaks there too): the module's text is final and nothing has run it
//!   yet. The host reads the `struct module` in `%rdi` and arms the module's pending
//!   probes before the vCPU goes on, so a probe on the init function sees its call;
//! - `module_memfree(region)`: the one function that frees module memory (the init
//!   layout after the init ran, both layouts at unload or a failed load). The host takes
//!   its int3s and jumps out of that memory before the vCPU goes on and marks their
//!   probes `[GONE]`; they arm again if the module loads again (Linux's trace_kprobe
//!   re-registers its probes when their module comes back).
//!
//! Both run on the hitting vCPU without pausing the others: the text they change is
//! code that has not run its init (only a module parameter's own handlers could, and a
//! single-byte int3 write is how text patching starts anyway) or is being freed. The
//! hooks stay in while the global switch is off, and each module site notes the memory
//! (core or init layout) it is in, so that a free takes it out whatever the module list
//! says by then.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hvprobe_arch::Gva;
use hvprobe_introspection::modules::{self, LoadedModule, ModuleBudget, ModuleLayout, ModuleState};
use hvprobe_introspection::unwind::{OrcEntry, OrcLookup, OrcTable};

use super::placed::Placement;
use super::registry::{ModuleBinding, ModuleProbeState, Registry, Role};
use super::text::MODULE_AREA;
use super::{KprobeRequest, ProbeError, ProbeId, ProbeKind, ProbePoint, Tracer};
use crate::machine::{KernelMemory, PausedView, Vcpu};

/// How often a stack walk that ran into module code no read module covers may read the
/// module list again.
const RELIST_INTERVAL: Duration = Duration::from_secs(1);

/// The modules the engine knows of: those of the list's last read, and those its load hook
/// read since. Each load of a module with a new name and address adds one, and the guest
/// chooses how many it "loads": the list stays within the module budget (its count of
/// modules, and its decoded bytes together), the oldest read going first. No two share
/// memory (a real kernel's modules never do; the newest read wins), so the module that
/// holds an address is found in one lookup, not a scan (every frame of a stack asks).
#[derive(Clone, Default)]
pub(super) struct LoadedList {
    /// Oldest read first.
    order: VecDeque<Arc<LoadedModule>>,
    /// Each module's memory (its core layout, and its init layout) by start, with its end.
    by_start: BTreeMap<Gva, (Gva, Arc<LoadedModule>)>,
    /// The modules' decoded bytes together.
    decoded: u64,
}

impl LoadedList {
    /// The list as one read of the guest's list gave it (newest first).
    fn from_read(read: Vec<LoadedModule>, budget: &ModuleBudget) -> LoadedList {
        let mut list = LoadedList::default();
        for module in read.into_iter().rev() {
            list.insert(Arc::new(module), budget);
        }
        list
    }

    /// The module whose memory holds `at`.
    pub(super) fn containing(&self, at: Gva) -> Option<&Arc<LoadedModule>> {
        let (_, (end, module)) = self.by_start.range(..=at).next_back()?;
        (at < *end).then_some(module)
    }

    fn named(&self, name: &str) -> Option<&Arc<LoadedModule>> {
        self.order.iter().find(|m| m.name == name)
    }

    pub(super) fn modules(&self) -> impl Iterator<Item = &Arc<LoadedModule>> {
        self.order.iter()
    }

    /// A module's memory as the list keeps it: its core layout, and its init layout unless
    /// that is empty or overlaps the core (a forged module's; the core is what it is found by).
    fn memory(module: &LoadedModule) -> Vec<Range<Gva>> {
        let mut ranges = vec![module.core.clone()];
        if let Some(init) = &module.init {
            if init.start >= module.core.end || init.end <= module.core.start {
                ranges.push(init.clone());
            }
        }
        ranges.retain(|r| r.start < r.end);
        ranges
    }

    /// The modules whose memory overlaps `range` (the list's ranges are disjoint: the one
    /// that starts below it and reaches in, and those that start inside it).
    fn overlapping(&self, range: &Range<Gva>) -> Vec<Arc<LoadedModule>> {
        let below = self
            .by_start
            .range(..range.start)
            .next_back()
            .filter(|(_, (end, _))| *end > range.start);
        below
            .into_iter()
            .chain(self.by_start.range(range.start..range.end))
            .map(|(_, (_, m))| m.clone())
            .collect()
    }

    fn remove(&mut self, module: &Arc<LoadedModule>) {
        let before = self.order.len();
        self.order.retain(|m| !Arc::ptr_eq(m, module));
        if self.order.len() == before {
            return;
        }
        self.by_start.retain(|_, (_, m)| !Arc::ptr_eq(m, module));
        self.decoded = self.decoded.saturating_sub(module.decoded_bytes);
    }

    /// Adds `module` (the newest read), in place of the same module read before (by name
    /// or address) and of any whose memory it claims, making room within `budget` by
    /// dropping the oldest. A module over the budget on its own is not kept.
    pub(super) fn insert(&mut self, module: Arc<LoadedModule>, budget: &ModuleBudget) {
        let mut stale: Vec<Arc<LoadedModule>> = self
            .order
            .iter()
            .filter(|m| m.name == module.name || m.address == module.address)
            .cloned()
            .collect();
        let memory = LoadedList::memory(&module);
        for range in &memory {
            stale.extend(self.overlapping(range));
        }
        for m in &stale {
            self.remove(m);
        }
        if module.decoded_bytes > budget.max_total_decoded || budget.max_modules == 0 {
            tracing::warn!(
                "module {}: over the module budget on its own: not followed",
                module.name
            );
            return;
        }
        while let Some(oldest) = self.order.front().cloned() {
            let full = self.order.len() >= budget.max_modules
                || self.decoded.saturating_add(module.decoded_bytes) > budget.max_total_decoded;
            if !full {
                break;
            }
            tracing::debug!(
                "module {}: dropped from the engine's list to keep it within budget",
                oldest.name
            );
            self.remove(&oldest);
        }
        for range in memory {
            self.by_start.insert(range.start, (range.end, module.clone()));
        }
        self.decoded = self.decoded.saturating_add(module.decoded_bytes);
        self.order.push_back(module);
    }
}

/// The kernel's ORC table and those of the modules of a [`LoadedList`], as the guest's
/// `orc_find` looks in them: a module's by the one lookup that finds the module.
pub(super) struct KernelAndLoaded<'a> {
    pub kernel: &'a OrcTable,
    pub modules: &'a LoadedList,
}

impl KernelAndLoaded<'_> {
    fn module_table(&self, ip: Gva) -> Option<&OrcTable> {
        self.modules.containing(ip)?.orc.as_ref().filter(|orc| orc.is_text(ip))
    }
}

impl OrcLookup for KernelAndLoaded<'_> {
    fn is_text(&self, ip: Gva) -> bool {
        self.kernel.is_text(ip) || self.module_table(ip).is_some()
    }

    fn find(&self, ip: Gva) -> Option<OrcEntry> {
        if ip.0 == 0 || self.kernel.is_text(ip) {
            return self.kernel.find(ip);
        }
        self.module_table(ip)?.find(ip)
    }
}

/// The guest's modules as the engine last read them, and its hooks on the loader.
#[derive(Default)]
pub(super) struct ModuleTracker {
    /// Replaced whole at each change (changes are rare: loads, frees, reads of the list),
    /// so that a stack walk takes it without holding the lock.
    loaded: Mutex<Arc<LoadedList>>,
    layout: Mutex<Option<ModuleLayout>>,
    last_listed: Mutex<Option<Instant>>,
    /// The sites of the hooks on `do_init_module` and `module_memfree` (0: none).
    load_hook: AtomicU64,
    free_hook: AtomicU64,
}

/// Which hook a hit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ModuleHook {
    Load,
    Free,
}

impl ModuleTracker {
    pub(super) fn hook_at(&self, at: Gva) -> Option<ModuleHook> {
        if at.0 == 0 {
            return None;
        }
        if self.load_hook.load(Ordering::Acquire) == at.0 {
            Some(ModuleHook::Load)
        } else if self.free_hook.load(Ordering::Acquire) == at.0 {
            Some(ModuleHook::Free)
        } else {
            None
        }
    }

    /// The list as it is now.
    pub(super) fn snapshot(&self) -> Arc<LoadedList> {
        self.loaded.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The read module whose memory holds `at`.
    pub(super) fn containing(&self, at: Gva) -> Option<Arc<LoadedModule>> {
        self.snapshot().containing(at).cloned()
    }

    fn named(&self, name: &str) -> Option<Arc<LoadedModule>> {
        self.snapshot().named(name).cloned()
    }

    /// Changes the list (a copy of it, when a walk holds the one in place).
    fn change(&self, edit: impl FnOnce(&mut LoadedList)) {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        edit(Arc::make_mut(&mut loaded));
    }
}

/// Whether a module in this state has code that may be probed (Linux refuses a kprobe in
/// a module that is going, and a module not yet formed has no final code).
fn probeable(state: ModuleState) -> bool {
    matches!(state, ModuleState::Live | ModuleState::Coming)
}

impl Tracer {
    fn module_layout(&self, what: &str) -> Result<ModuleLayout, ProbeError> {
        let mut layout = self.modules.layout.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = *layout {
            return Ok(l);
        }
        let btf = self.kernel_btf().ok_or_else(|| ProbeError::Modules {
            what: what.to_owned(),
            reason: "the guest kernel has no BTF to describe its struct module (CONFIG_DEBUG_INFO_BTF)".into(),
        })?;
        let l = ModuleLayout::from_btf(btf).map_err(|e| ProbeError::Modules {
            what: what.to_owned(),
            reason: e.to_string(),
        })?;
        *layout = Some(l);
        Ok(l)
    }

    fn module_budget(&self) -> ModuleBudget {
        ModuleBudget::for_memory(self.machine.memory_size())
    }

    /// Reads the guest's module list again (every module whole).
    pub(super) fn relist_modules(&self, what: &str) -> Result<(), ProbeError> {
        let layout = self.module_layout(what)?;
        let head = self.view.symbols.lookup("modules").ok_or_else(|| ProbeError::Modules {
            what: what.to_owned(),
            reason: "the guest kernel has no symbol `modules` (built without CONFIG_MODULES?)".into(),
        })?;
        // Read and stored under the list's lock: a load noted meanwhile is not lost.
        let budget = self.module_budget();
        let mut loaded = self.modules.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let read = modules::read_modules(self.machine.kernel(), &layout, head.addr, &budget).map_err(|e| {
            ProbeError::Modules {
                what: what.to_owned(),
                reason: e.to_string(),
            }
        })?;
        *loaded = Arc::new(LoadedList::from_read(read, &budget));
        drop(loaded);
        *self.modules.last_listed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        Ok(())
    }

    /// For a stack walk that met code in the module area no read module covers: reads
    /// the list again, at most once per [`RELIST_INTERVAL`]. True when it did.
    pub(super) fn relist_modules_for(&self, at: Gva) -> bool {
        if !MODULE_AREA.contains(&at.0) || self.modules.containing(at).is_some() {
            return false;
        }
        {
            let last = self.modules.last_listed.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < RELIST_INTERVAL) {
                return false;
            }
        }
        match self.relist_modules("a stack through a module") {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("{e}");
                *self.modules.last_listed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                false
            }
        }
    }

    /// The read modules (for stacks: their symbols and ORC tables).
    pub(super) fn loaded_modules(&self) -> Arc<LoadedList> {
        self.modules.snapshot()
    }

    pub(super) fn module_containing(&self, at: Gva) -> Option<Arc<LoadedModule>> {
        self.modules.containing(at)
    }

    /// The loaded module `name`, from the list as last read; `ModuleNotLoaded` when it is
    /// not there or not in a state whose code may be probed.
    pub(super) fn loaded_module(&self, name: &str, what: &str) -> Result<Arc<LoadedModule>, ProbeError> {
        self.modules
            .named(name)
            .filter(|m| probeable(m.state))
            .ok_or_else(|| ProbeError::ModuleNotLoaded {
                what: what.to_owned(),
                module: name.to_owned(),
            })
    }

    /// The functions of loaded module `name` (its text symbols, sorted, once each), read
    /// from the guest's module list now: what a wildcard `MOD:PATTERN` covers, as
    /// bpftrace's `kprobe:MOD:PATTERN` covers what is loaded when it attaches.
    pub fn module_functions(&self, name: &str) -> Result<Vec<String>, ProbeError> {
        let what = format!("{name}:*");
        self.relist_modules(&what)?;
        let module = self.loaded_module(name, &what)?;
        let mut functions: Vec<String> = module
            .symbols
            .symbols()
            .iter()
            .filter(|s| s.is_text() && module.is_text(s.addr))
            .map(|s| s.name.clone())
            .collect();
        functions.sort_unstable();
        functions.dedup();
        Ok(functions)
    }

    /// Where the hooks go: the kernel's `do_init_module` and `module_memfree`.
    pub(super) fn module_hook_placements(&self) -> Result<(Placement, Placement), ProbeError> {
        let place = |name: &str| {
            self.place(&ProbePoint::Symbol {
                name: name.into(),
                offset: 0,
            })
            .map_err(|e| ProbeError::Modules {
                what: "module probes".into(),
                reason: format!("the module loader cannot be followed at {name}: {e}"),
            })
        };
        Ok((place("do_init_module")?, place("module_memfree")?))
    }

    /// Puts the hooks in (with the vCPUs paused), unless they are there.
    pub(super) fn ensure_module_hooks(
        &self,
        text: &dyn KernelMemory,
        reg: &mut Registry,
        hooks: &(Placement, Placement),
    ) -> Result<(), ProbeError> {
        for (role, placement, slot) in [
            (Role::ModuleLoad, &hooks.0, &self.modules.load_hook),
            (Role::ModuleFree, &hooks.1, &self.modules.free_hook),
        ] {
            if reg.probes.values().any(|p| p.role == role) {
                continue;
            }
            let request = KprobeRequest {
                emit_events: false,
                ..KprobeRequest::event(ProbePoint::Address(placement.address), "hvprobe", "module", Vec::new())
            };
            self.register_paused(text, reg, &request, placement, role)?;
            slot.store(placement.site.0, Ordering::Release);
        }
        Ok(())
    }

    /// Takes the hooks out (with the vCPUs paused) when no module probe is left.
    pub(super) fn drop_module_hooks_if_unused(&self, view: &dyn PausedView, reg: &mut Registry) {
        if reg.probes.values().any(|p| p.module.is_some()) {
            return;
        }
        // (Also when the hooks went with every other probe: an int3 the guest puts there
        // later is not a hook.)
        self.modules.load_hook.store(0, Ordering::Release);
        self.modules.free_hook.store(0, Ordering::Release);
        let hooks: Vec<ProbeId> = reg
            .probes
            .iter()
            .filter(|(_, p)| matches!(p.role, Role::ModuleLoad | Role::ModuleFree))
            .map(|(id, _)| *id)
            .collect();
        for id in hooks {
            self.remove_paused(view, reg, id);
        }
    }

    /// A hit of a hook, before the site's own handling: a module is about to run its
    /// init, or module memory is about to be freed.
    pub(super) fn on_module_hook(&self, hook: ModuleHook, cpu: usize, vcpu: &mut dyn Vcpu) {
        let arg = match vcpu.regs() {
            Ok(r) => r.rdi,
            Err(e) => {
                tracing::error!("vCPU {cpu}: the module hook's registers: {e}: module probes are not followed");
                return;
            }
        };
        match hook {
            ModuleHook::Load => self.module_loading(Gva(arg)),
            ModuleHook::Free => self.module_memory_freed(Gva(arg)),
        }
    }

    /// `do_init_module(mod)`: read the module, arm its probes.
    fn module_loading(&self, at: Gva) {
        let what = format!("the module loading at {at}");
        let module = match self.module_layout(&what).and_then(|layout| {
            modules::read_module(self.machine.kernel(), &layout, at, &self.module_budget()).map_err(|e| {
                ProbeError::Modules {
                    what: what.clone(),
                    reason: e.to_string(),
                }
            })
        }) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                tracing::warn!("{e}: its probes stay pending");
                return;
            }
        };
        tracing::debug!("module {} loading ({} symbols)", module.name, module.symbols.len());
        let budget = self.module_budget();
        self.modules.change(|list| list.insert(module.clone(), &budget));
        self.arm_module_probes(&module.name);
    }

    /// Arms the pending (or gone) probes of module `name`, which is loaded, before its
    /// init runs (no pause: nothing runs its code yet).
    pub(super) fn arm_module_probes(&self, name: &str) {
        let waits = |b: &ModuleBinding| b.module == name && b.state != ModuleProbeState::Armed;
        let placed = self.place_waiting(&waits);
        if placed.is_empty() {
            return;
        }
        let mut reg = self.write_registry();
        self.attach_waiting(self.machine.kernel(), &mut reg, &placed, &waits);
    }

    /// Arms, with the vCPUs paused, the pending probes whose module the list now shows
    /// loaded (its code may be running: the pause is what makes the write safe).
    pub(super) fn arm_pending_of_loaded_modules(&self) {
        if let Err(e) = self.relist_modules("module probes") {
            tracing::warn!("{e}");
            return;
        }
        let waits = |b: &ModuleBinding| b.state == ModuleProbeState::Pending;
        let placed = self.place_waiting(&waits);
        if placed.is_empty() {
            return;
        }
        let paused = self.paused(&mut |view| {
            let mut reg = self.write_registry();
            self.attach_waiting(view.text(), &mut reg, &placed, &waits);
        });
        if let Err(e) = paused {
            tracing::warn!("arming the probes of a module loaded meanwhile: {e}; they wait for its next load");
        }
    }

    /// The module probes `waits` picks, placed in their (loaded) modules, with no lock
    /// held (placing reads the registry); those that cannot be placed stay as they are.
    fn place_waiting(&self, waits: &dyn Fn(&ModuleBinding) -> bool) -> Vec<(ProbeId, Placement)> {
        let waiting: Vec<(ProbeId, ProbePoint, ProbeKind)> = self
            .read_registry()
            .probes
            .iter()
            .filter_map(|(id, p)| {
                let b = p.module.as_ref()?;
                waits(b).then(|| (*id, b.point(), p.kind))
            })
            .collect();
        let mut placed = Vec::new();
        for (id, point, kind) in waiting {
            match self.place(&point) {
                Ok(p) if matches!(kind, ProbeKind::Kretprobe { .. }) && !p.at_function_entry => {
                    tracing::warn!(
                        "{}: a return probe goes on a function's entry: it stays pending",
                        p.what
                    );
                }
                Ok(p) => placed.push((id, p)),
                // (Its module is not loaded: nothing to say.)
                Err(ProbeError::ModuleNotLoaded { .. }) => {}
                Err(e) => tracing::warn!("{e}: the probe stays pending"),
            }
        }
        placed
    }

    /// Puts the placed probes that `waits` still picks (the registry may have changed
    /// since they were placed) on their sites.
    fn attach_waiting(
        &self,
        text: &dyn KernelMemory,
        reg: &mut Registry,
        placed: &[(ProbeId, Placement)],
        waits: &dyn Fn(&ModuleBinding) -> bool,
    ) {
        for (id, placement) in placed {
            let still_waiting = reg.probes.get(id).and_then(|p| p.module.as_ref()).is_some_and(waits);
            if still_waiting {
                if let Err(e) = self.attach_to_site(text, reg, *id, placement) {
                    tracing::warn!("{e}: the probe stays pending");
                }
            }
        }
    }

    /// `module_memfree(region)`: if the region is a read module's core or init layout,
    /// take our int3s out of it and mark their probes gone.
    fn module_memory_freed(&self, region: Gva) {
        if region.0 == 0 {
            return;
        }
        // The sites in that memory, as noted when each was armed (not through the module
        // list, which a read in between may have left without the module).
        let text = self.machine.kernel();
        let mut reg = self.write_registry();
        let sites: Vec<Gva> = reg
            .sites
            .iter()
            .filter(|(_, s)| s.module.as_ref().is_some_and(|(_, layout)| *layout == region))
            .map(|(a, _)| *a)
            .collect();
        for addr in sites {
            let ids = self.detach_site(text, &mut reg, addr);
            for id in ids {
                let Some(probe) = reg.probes.get_mut(&id) else { continue };
                match probe.module.as_mut() {
                    Some(b) => b.state = ModuleProbeState::Gone,
                    // A kernel probe that shared the site (its symbol in the module's
                    // memory): gone with it, and said so.
                    None => probe.freed = true,
                }
            }
        }
        drop(reg);
        // The list as read: without the freed module (or its init layout).
        let budget = self.module_budget();
        self.modules.change(|list| {
            let freed: Vec<Arc<LoadedModule>> = list
                .modules()
                .filter(|m| m.core.start == region || m.init.as_ref().is_some_and(|i| i.start == region))
                .cloned()
                .collect();
            for m in freed {
                list.remove(&m);
                if m.core.start == region {
                    tracing::debug!("module {} freed", m.name);
                } else {
                    let mut without_init = (*m).clone();
                    without_init.init = None;
                    without_init.init_text = None;
                    list.insert(Arc::new(without_init), &budget);
                }
            }
        });
    }
}

impl ModuleBinding {
    /// The point the probe was asked for.
    pub(super) fn point(&self) -> ProbePoint {
        ProbePoint::Module {
            module: self.module.clone(),
            name: self.symbol.clone(),
            offset: self.offset,
        }
    }
}
