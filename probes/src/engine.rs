//! The kprobe engine: a registry of probes, the int3 bytes it owns in the guest's text, and
//! what happens at a hit.
//!
//! A probe names an address (`symbol+offset` or raw). Probes at one address share a
//! *site*: one int3 in the text, the original instruction decoded once, and how that
//! instruction is executed after the pre-handlers ran: emulated on the host (one exit) or
//! single-stepped in an out-of-line copy (two exits). Text is only changed with every vCPU
//! paused, and an int3 is never lifted to execute the original instruction in place.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use hvprobe_arch::{Gva, INT3};
use hvprobe_introspection::facts::{BlacklistReason, ExceptionTable, KprobeBlacklist};
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::symbols::SymbolTable;

use crate::fetch::{evaluate, ArgValue, FetchContext};
use crate::insn::{self, Execution, ProbedInsn, StackAccess, StepFixup};
use crate::machine::{KernelMemory, Machine, Vcpu};
use crate::output::{HitRecord, ListEntry, ListKind};
use crate::regs::Regs;
use crate::spec::FetchArg;

mod sites;
#[cfg(test)]
mod tests;

pub use sites::{PatchSite, PatchSiteKind, PatchSites};

/// The longest function the engine decodes to check an instruction boundary.
const MAX_FUNCTION_BYTES: u64 = 256 << 10;
/// Bytes reserved per out-of-line instruction copy (an instruction is at most 15).
const SLOT_SIZE: u64 = 16;
/// The 5-byte NOP that `-mfentry` / ftrace leaves at a traceable function's entry.
const FTRACE_NOP: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// Identifies a registered probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProbeId(pub u32);

/// Where a probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbePoint {
    Symbol { name: String, offset: u64 },
    Address(Gva),
}

/// What a pre-handler asks for after it ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreAction {
    /// Execute the probed instruction, then the post-handlers.
    Continue,
    /// Do not execute the probed instruction and skip the post-handlers: the handler has
    /// set RIP (and whatever else) itself, as a kprobe pre-handler returning 1 does. The
    /// remaining pre-handlers at this address do not run either.
    Skip,
}

/// What a handler sees of a hit.
pub struct HitContext<'a> {
    pub probe: ProbeId,
    pub cpu: usize,
    /// The probe's address (where the int3 is, or the requested `+0` of an ftrace entry).
    pub address: Gva,
    /// The registers; a pre-handler's changes are written back to the vCPU.
    pub regs: &'a mut Regs,
    pub kernel: &'a dyn GuestVirtRead,
}

/// Handlers run on the hitting vCPU's thread while the registry is read-locked: they must
/// not register, unregister, enable or disable probes (that pauses every vCPU, including
/// the one the handler is running on).
pub type PreHandler = Arc<dyn Fn(&mut HitContext) -> PreAction + Send + Sync>;
pub type PostHandler = Arc<dyn Fn(&mut HitContext) + Send + Sync>;

/// A hit of a probe that has fetch-args or asked for events, for the event consumer.
#[derive(Clone, Debug)]
pub struct HitEvent {
    pub probe: ProbeId,
    pub address: Gva,
    pub regs: Regs,
    pub record: HitRecord,
}

/// Where hit events go. `try_send` must not block a vCPU: when the consumer is behind it
/// returns false and the hit counts as missed.
pub trait EventSink: Send + Sync {
    fn try_send(&self, event: HitEvent) -> bool;
}

/// For async consumers: a bounded tokio channel. A full channel (the consumer is behind)
/// counts the hit as missed instead of stalling the vCPU.
impl EventSink for tokio::sync::mpsc::Sender<HitEvent> {
    fn try_send(&self, event: HitEvent) -> bool {
        tokio::sync::mpsc::Sender::try_send(self, event).is_ok()
    }
}

/// What a probe does at its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeKind {
    /// A kprobe: handlers at the instruction.
    Kprobe,
    /// A return probe (kretprobe): at the function's entry the return address is swapped
    /// for the trampoline's; when the function returns, the return handler (`post`) runs
    /// with the return value in RAX, and the caller gets control back. At most `maxactive`
    /// calls are followed at once; further entries count as missed.
    Kretprobe { maxactive: u32 },
}

/// The kernel's default `maxactive` for a preemptible kernel, `max(10, 2 * CPUs)`: the
/// instances live on the host, so the larger of its two defaults costs nothing.
pub fn default_maxactive(cpus: usize) -> u32 {
    (2 * cpus).max(10) as u32
}

/// A kprobe to register.
#[derive(Clone)]
pub struct KprobeRequest {
    pub kind: ProbeKind,
    pub point: ProbePoint,
    pub group: String,
    pub event: String,
    pub args: Vec<FetchArg>,
    /// Send a [`HitEvent`] per hit (always when there are fetch-args).
    pub emit_events: bool,
    /// The pre-handler; for a return probe, its entry handler (`PreAction::Skip` then
    /// means "do not follow this call", as a non-zero `entry_handler` return does).
    pub pre: Option<PreHandler>,
    /// The post-handler; for a return probe, its return handler.
    pub post: Option<PostHandler>,
    /// Registered but disabled (`KPROBE_FLAG_DISABLED`).
    pub disabled: bool,
}

impl KprobeRequest {
    /// A probe without handlers that emits an event per hit.
    pub fn event(point: ProbePoint, group: &str, event: &str, args: Vec<FetchArg>) -> Self {
        KprobeRequest {
            kind: ProbeKind::Kprobe,
            point,
            group: group.to_string(),
            event: event.to_string(),
            args,
            emit_events: true,
            pre: None,
            post: None,
            disabled: false,
        }
    }
}

/// Why a probe cannot be registered (or changed).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("unknown symbol {0:?}")]
    UnknownSymbol(String),
    #[error("symbol {name:?} is not unique ({count} symbols have that name): give an address instead")]
    AmbiguousSymbol { name: String, count: usize },
    #[error("{0} is not in any kernel function (no text symbol covers it)")]
    NotInFunction(Gva),
    #[error("{what} is outside {function} ({size:#x} bytes)")]
    OffsetBeyondFunction { what: String, function: String, size: u64 },
    #[error("{what} is not an instruction boundary in {function} (instructions start at {before} and {after})")]
    NotInstructionBoundary {
        what: String,
        function: String,
        before: String,
        after: String,
    },
    #[error("{what} is blacklisted: {reason}")]
    Blacklisted { what: String, reason: BlacklistReason },
    #[error("{what} is inside a {kind} patch site at {site} that the guest rewrites itself")]
    PatchSite {
        what: String,
        kind: PatchSiteKind,
        site: Gva,
    },
    #[error("{what} cannot be probed: {reason}")]
    Unprobeable { what: String, reason: String },
    #[error("{what}: {source}")]
    Decode { what: String, source: insn::InsnError },
    #[error("{what}: guest memory: {source}")]
    Memory { what: String, source: MemoryError },
    #[error("the out-of-line area is full ({0} instruction copies)")]
    OutOfLineFull(u64),
    #[error("no probe with id {0:?}")]
    NoSuchProbe(ProbeId),
    #[error("{what}: a return probe goes on a function's entry (offset 0)")]
    ReturnProbeNotAtEntry { what: String },
    #[error("event {group}/{event} already exists")]
    DuplicateEvent { group: String, event: String },
}

/// Guest facts the engine checks probes against.
#[derive(Clone, Debug)]
pub struct KernelView {
    pub symbols: Arc<SymbolTable>,
    pub blacklist: KprobeBlacklist,
    pub ex_table: ExceptionTable,
    pub patch_sites: PatchSites,
}

/// Counters a listing shows.
#[derive(Default, Debug)]
struct Counters {
    hits: AtomicU64,
    nmissed: AtomicU64,
}

struct Probe {
    kind: ProbeKind,
    group: String,
    event: String,
    /// The address the user asked for.
    address: Gva,
    /// `sym+0xoff` of `address`.
    location: String,
    /// Where the int3 goes (past an ftrace NOP when `address` is one).
    site: Gva,
    args: Vec<FetchArg>,
    emit_events: bool,
    pre: Option<PreHandler>,
    post: Option<PostHandler>,
    enabled: bool,
    counters: Arc<Counters>,
    /// `sym+0xoff/0xsize` of `address`, as hit events show it (`%pS`).
    trace_location: String,
}

struct Site {
    /// The original first byte, written back on disarm.
    original: u8,
    /// The decoded original instruction; `None` when the guest had its own int3 there.
    insn: Option<ProbedInsn>,
    /// Out-of-line copy address, for instructions that are single-stepped.
    slot: Option<Gva>,
    /// Probes here, in registration order.
    probes: Vec<ProbeId>,
    /// Our int3 is in the text.
    armed: bool,
    /// The guest rewrote the byte under our int3: we no longer own it.
    gone: bool,
}

impl Site {
    fn shared_with_guest(&self) -> bool {
        self.original == INT3
    }
}

#[derive(Default)]
struct Registry {
    probes: BTreeMap<ProbeId, Probe>,
    sites: HashMap<Gva, Site>,
    next_id: u32,
    /// The global switch (debugfs `enabled`).
    armed: bool,
}

/// An out-of-line step in progress on one vCPU.
struct PendingStep {
    /// The guest's IF before the step (cleared while stepping, put back after).
    saved_if: u64,
    insn: ProbedInsn,
    slot: Gva,
    posts: Vec<(ProbeId, PostHandler)>,
    address: Gva,
}

/// A call a return probe follows: the return address it replaced, keyed by the stack slot
/// that held it.
struct ReturnInstance {
    probe: ProbeId,
    return_address: u64,
}

/// The out-of-line area: guest-virtual memory mapped executable in the kernel's page tables
/// and never used by the guest.
#[derive(Clone, Copy, Debug)]
pub struct OutOfLineArea {
    pub start: Gva,
    pub size: u64,
}

/// Hit counts of the engine as a whole.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub hits: AtomicU64,
    pub emulated: AtomicU64,
    pub stepped: AtomicU64,
    pub skipped: AtomicU64,
    pub shared_with_guest: AtomicU64,
    /// int3 exits at an address we had just disarmed (the instruction re-executes).
    pub stale: AtomicU64,
    /// Host time spent handling hits and steps (registers in and out, handlers, events,
    /// emulation), not counting the exits themselves.
    pub handling_ns: AtomicU64,
}

/// The probe engine for one guest.
pub struct Tracer {
    machine: Arc<dyn Machine>,
    view: KernelView,
    ool: Option<OutOfLineArea>,
    ool_used: AtomicU64,
    registry: RwLock<Registry>,
    stepping: Mutex<HashMap<usize, PendingStep>>,
    /// The return probes' trampoline: an int3 in the out-of-line area, made with the first
    /// return probe and kept for as long as the tracer lives (calls in flight return
    /// through it even after their probe is gone).
    trampoline: std::sync::OnceLock<Gva>,
    returns: Mutex<HashMap<u64, ReturnInstance>>,
    sink: Option<Arc<dyn EventSink>>,
    started: Instant,
    pub stats: EngineStats,
}

/// The kernel's stack through [`KernelMemory`], for emulated pushes and pops.
struct KernelStack<'a>(&'a dyn KernelMemory);

impl StackAccess for KernelStack<'_> {
    fn read_u64(&mut self, at: Gva) -> Result<u64, String> {
        self.0.read_u64(at).map_err(|e| e.to_string())
    }

    fn write_u64(&mut self, at: Gva, value: u64) -> Result<(), String> {
        self.0.write_virt(at, &value.to_le_bytes()).map_err(|e| e.to_string())
    }
}

/// What the engine did with an int3 exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakpointOutcome {
    /// Not ours: the guest gets its #BP.
    NotOurs,
    /// Ours; the vCPU is set up to continue.
    Handled,
    /// Ours and the guest's (its own int3 was there first): our handlers ran, now the
    /// guest gets its #BP.
    HandledThenGuest,
}

/// What the engine did with a single-step exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    NotOurs,
    Handled,
}

impl Tracer {
    /// A tracer with the global switch on. `ool` is where stepped instructions are copied
    /// (`None`: only instructions the host emulates can be probed).
    pub fn new(
        machine: Arc<dyn Machine>,
        view: KernelView,
        ool: Option<OutOfLineArea>,
        sink: Option<Arc<dyn EventSink>>,
    ) -> Tracer {
        Tracer {
            machine,
            view,
            ool,
            ool_used: AtomicU64::new(0),
            registry: RwLock::new(Registry {
                armed: true,
                ..Default::default()
            }),
            stepping: Mutex::new(HashMap::new()),
            trampoline: std::sync::OnceLock::new(),
            returns: Mutex::new(HashMap::new()),
            sink,
            started: Instant::now(),
            stats: EngineStats::default(),
        }
    }

    pub fn symbols(&self) -> &SymbolTable {
        &self.view.symbols
    }

    fn read_registry(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_registry(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.registry.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a kprobe and arms it (unless disabled or globally disarmed).
    pub fn register(&self, request: KprobeRequest) -> Result<ProbeId, ProbeError> {
        let placement = self.place(&request.point)?;
        if let ProbeKind::Kretprobe { .. } = request.kind {
            if !placement.at_function_entry {
                return Err(ProbeError::ReturnProbeNotAtEntry {
                    what: placement.what.clone(),
                });
            }
            self.make_trampoline()?;
        }
        let mut result = Ok(ProbeId(0));
        self.machine.with_vcpus_paused(&mut |text| {
            result = self.register_paused(text, &request, &placement);
        });
        result
    }

    /// The return trampoline's address, writing it on first use.
    fn make_trampoline(&self) -> Result<Gva, ProbeError> {
        if let Some(t) = self.trampoline.get() {
            return Ok(*t);
        }
        let slot = self.allocate_slot("the return trampoline")?;
        self.machine
            .kernel()
            .write_virt(slot, &[INT3])
            .map_err(|source| ProbeError::Memory {
                what: "the return trampoline".into(),
                source,
            })?;
        Ok(*self.trampoline.get_or_init(|| slot))
    }

    fn allocate_slot(&self, what: &str) -> Result<Gva, ProbeError> {
        let ool = self.ool.ok_or_else(|| ProbeError::Unprobeable {
            what: what.to_string(),
            reason: "it needs the out-of-line area and there is none".into(),
        })?;
        let index = self.ool_used.fetch_add(1, Ordering::Relaxed);
        if (index + 1) * SLOT_SIZE > ool.size {
            return Err(ProbeError::OutOfLineFull(ool.size / SLOT_SIZE));
        }
        Ok(Gva(ool.start.0 + index * SLOT_SIZE))
    }

    /// Registers all or none: when one fails, the ones already registered are unregistered
    /// and the error says which request failed (0-based).
    pub fn register_all(&self, requests: Vec<KprobeRequest>) -> Result<Vec<ProbeId>, (usize, ProbeError)> {
        let mut done = Vec::with_capacity(requests.len());
        for (i, request) in requests.into_iter().enumerate() {
            match self.register(request) {
                Ok(id) => done.push(id),
                Err(e) => {
                    for id in done {
                        let _ = self.unregister(id);
                    }
                    return Err((i, e));
                }
            }
        }
        Ok(done)
    }

    /// Unregisters a probe; its int3 goes when it was the last probe at its site.
    pub fn unregister(&self, id: ProbeId) -> Result<(), ProbeError> {
        let mut result = Ok(());
        self.machine.with_vcpus_paused(&mut |text| {
            let mut reg = self.write_registry();
            let Some(probe) = reg.probes.remove(&id) else {
                result = Err(ProbeError::NoSuchProbe(id));
                return;
            };
            let site_addr = probe.site;
            let now_empty = match reg.sites.get_mut(&site_addr) {
                Some(site) => {
                    site.probes.retain(|p| *p != id);
                    site.probes.is_empty()
                }
                None => false,
            };
            if now_empty {
                if let Some(mut site) = reg.sites.remove(&site_addr) {
                    disarm(text, site_addr, &mut site);
                }
            } else {
                Self::sync_site(text, &mut reg, site_addr);
            }
        });
        result
    }

    /// Unregisters every probe (at exit: the text is as it was before).
    pub fn unregister_all(&self) {
        let ids: Vec<ProbeId> = self.read_registry().probes.keys().copied().collect();
        for id in ids {
            let _ = self.unregister(id);
        }
    }

    /// Enables or disables one probe (`enable_kprobe` / `disable_kprobe`).
    pub fn set_enabled(&self, id: ProbeId, enabled: bool) -> Result<(), ProbeError> {
        let mut result = Ok(());
        self.machine.with_vcpus_paused(&mut |text| {
            let mut reg = self.write_registry();
            let Some(probe) = reg.probes.get_mut(&id) else {
                result = Err(ProbeError::NoSuchProbe(id));
                return;
            };
            probe.enabled = enabled;
            let site = probe.site;
            Self::sync_site(text, &mut reg, site);
        });
        result
    }

    /// The global switch: disarms every site (or arms them again) without changing each
    /// probe's own enabled state.
    pub fn set_armed(&self, armed: bool) {
        self.machine.with_vcpus_paused(&mut |text| {
            let mut reg = self.write_registry();
            reg.armed = armed;
            let sites: Vec<Gva> = reg.sites.keys().copied().collect();
            for site in sites {
                Self::sync_site(text, &mut reg, site);
            }
        });
    }

    pub fn is_armed(&self) -> bool {
        self.read_registry().armed
    }

    /// The probes, in registration order, in the debugfs `list` layout's terms.
    pub fn listing(&self) -> Vec<ListEntry> {
        let reg = self.read_registry();
        reg.probes
            .values()
            .map(|p| {
                let site = reg.sites.get(&p.site);
                ListEntry {
                    address: p.address,
                    kind: match p.kind {
                        ProbeKind::Kprobe => ListKind::Kprobe,
                        ProbeKind::Kretprobe { .. } => ListKind::Kretprobe,
                    },
                    location: p.location.clone(),
                    disabled: !p.enabled,
                    gone: site.is_some_and(|s| s.gone),
                    ftrace: false,
                    optimized: false,
                    hits: p.counters.hits.load(Ordering::Relaxed),
                    nmissed: p.counters.nmissed.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Re-reads every armed site and marks those whose int3 the guest overwrote as gone
    /// (they are never written back).
    pub fn check_gone(&self) {
        let mut reg = self.write_registry();
        let kernel = self.machine.kernel();
        for (addr, site) in reg.sites.iter_mut() {
            if site.armed && !site.gone {
                let mut b = [0u8];
                if kernel.read_virt(*addr, &mut b).is_ok() && b[0] != INT3 {
                    site.gone = true;
                    site.armed = false;
                }
            }
        }
    }

    /// The probe ids, in registration order.
    pub fn probe_ids(&self) -> Vec<ProbeId> {
        self.read_registry().probes.keys().copied().collect()
    }

    /// `group/event` of a probe.
    pub fn event_name(&self, id: ProbeId) -> Option<(String, String)> {
        self.read_registry()
            .probes
            .get(&id)
            .map(|p| (p.group.clone(), p.event.clone()))
    }

    /// Writes or removes the int3 of the site at `addr` to match its probes and the
    /// global switch.
    fn sync_site(text: &dyn KernelMemory, reg: &mut Registry, addr: Gva) {
        let want = reg.armed
            && reg
                .sites
                .get(&addr)
                .is_some_and(|s| s.probes.iter().any(|id| reg.probes.get(id).is_some_and(|p| p.enabled)));
        let Some(site) = reg.sites.get_mut(&addr) else { return };
        if want && !site.armed && !site.gone {
            arm(text, addr, site);
        } else if !want && site.armed {
            disarm(text, addr, site);
        }
    }

    /// Resolves a probe point to where its int3 goes, with every check that needs no
    /// paused vCPU.
    fn place(&self, point: &ProbePoint) -> Result<Placement, ProbeError> {
        let symbols = &self.view.symbols;
        let (address, what) = match point {
            ProbePoint::Symbol { name, offset } => {
                let matches: Vec<_> = symbols.lookup_all(name).filter(|s| s.is_text()).collect();
                let symbol = match matches.as_slice() {
                    [] => return Err(ProbeError::UnknownSymbol(name.clone())),
                    [one] => *one,
                    many => {
                        return Err(ProbeError::AmbiguousSymbol {
                            name: name.clone(),
                            count: many.len(),
                        })
                    }
                };
                let size = symbols.size_of(symbol).unwrap_or(0);
                if *offset >= size.max(1) {
                    return Err(ProbeError::OffsetBeyondFunction {
                        what: format!("{name}+{offset:#x}"),
                        function: name.clone(),
                        size,
                    });
                }
                (Gva(symbol.addr.0 + offset), format!("{name}+{offset:#x}"))
            }
            ProbePoint::Address(a) => (*a, format!("{a}")),
        };
        let description = symbols
            .describe(address)
            .filter(|d| d.symbol.is_text())
            .ok_or(ProbeError::NotInFunction(address))?;
        let function = description.symbol.name.clone();
        let func_start = Gva(address.0 - description.offset);
        let func_size = description.size.min(MAX_FUNCTION_BYTES);
        let location = format!("{function}+{:#x}", description.offset);
        let what = if matches!(point, ProbePoint::Address(_)) {
            format!("{what} ({location})")
        } else {
            what
        };
        if let Some(reason) = self.view.blacklist.is_blacklisted(address) {
            return Err(ProbeError::Blacklisted { what, reason });
        }
        let mut code = vec![0u8; func_size as usize];
        let kernel = self.machine.kernel();
        kernel
            .read_virt(func_start, &mut code)
            .map_err(|source| ProbeError::Memory {
                what: what.clone(),
                source,
            })?;
        // Our own int3s would decode as one-byte instructions: see through them.
        {
            let reg = self.read_registry();
            for (addr, site) in &reg.sites {
                if site.armed && (func_start.0..func_start.0 + func_size).contains(&addr.0) {
                    code[(addr.0 - func_start.0) as usize] = site.original;
                }
            }
        }
        let starts =
            insn::instruction_starts_through(&code, func_start, address).map_err(|source| ProbeError::Decode {
                what: what.clone(),
                source,
            })?;
        if starts.binary_search(&address).is_err() {
            let i = starts.partition_point(|a| *a < address);
            let show = |a: Option<&Gva>| match a {
                Some(a) => format!("{function}+{:#x}", a.0 - func_start.0),
                None => "the end".to_string(),
            };
            let before = show(i.checked_sub(1).and_then(|j| starts.get(j)));
            let after = show(starts.get(i));
            return Err(ProbeError::NotInstructionBoundary {
                what,
                function,
                before,
                after,
            });
        }
        // A probe on the ftrace NOP goes on the next instruction: the NOP does nothing,
        // and the guest rewrites those five bytes whenever it traces the function.
        let ftrace_site = self.ftrace_site(&code, func_start);
        let site = match ftrace_site {
            Some(f) if f == address => Gva(f.0 + FTRACE_NOP.len() as u64),
            _ => address,
        };
        if let Some(p) = self.view.patch_sites.containing(site) {
            return Err(ProbeError::PatchSite {
                what,
                kind: p.kind,
                site: p.range.start,
            });
        }
        let offset_in_code = (site.0 - func_start.0) as usize;
        if offset_in_code >= code.len() {
            return Err(ProbeError::Unprobeable {
                what,
                reason: "the function ends with its ftrace NOP".into(),
            });
        }
        let bytes = &code[offset_in_code..(offset_in_code + 15).min(code.len())];
        Ok(Placement {
            address,
            location,
            site,
            at_function_entry: address == func_start,
            trace_location: description.to_string(),
            what,
            bytes: bytes.to_vec(),
            may_fault: self.view.ex_table.lookup(site).is_some(),
        })
    }

    /// The address of a function's ftrace NOP (at its entry, after an `endbr64`), or of
    /// the call the guest patched in its place while it traces the function.
    fn ftrace_site(&self, code: &[u8], func_start: Gva) -> Option<Gva> {
        let skip = if code.starts_with(&ENDBR64) { ENDBR64.len() } else { 0 };
        let entry = code.get(skip..skip + 5)?;
        let at = Gva(func_start.0 + skip as u64);
        if entry == FTRACE_NOP {
            return Some(at);
        }
        if entry[0] == 0xe8 {
            let rel = i32::from_le_bytes([entry[1], entry[2], entry[3], entry[4]]);
            let target = Gva((at.0 + 5).wrapping_add_signed(i64::from(rel)));
            let name = self.view.symbols.describe(target).map(|d| d.symbol.name.as_str())?;
            if name.starts_with("ftrace_") || name == "__fentry__" {
                return Some(at);
            }
        }
        None
    }

    fn register_paused(
        &self,
        text: &dyn KernelMemory,
        request: &KprobeRequest,
        placement: &Placement,
    ) -> Result<ProbeId, ProbeError> {
        let mut reg = self.write_registry();
        if reg
            .probes
            .values()
            .any(|p| p.group == request.group && p.event == request.event)
        {
            return Err(ProbeError::DuplicateEvent {
                group: request.group.clone(),
                event: request.event.clone(),
            });
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = reg.sites.entry(placement.site) {
            slot.insert(self.new_site(text, placement)?);
        }
        let id = ProbeId(reg.next_id);
        reg.next_id += 1;
        reg.probes.insert(
            id,
            Probe {
                kind: request.kind,
                group: request.group.clone(),
                event: request.event.clone(),
                address: placement.address,
                location: placement.location.clone(),
                site: placement.site,
                args: request.args.clone(),
                emit_events: request.emit_events || !request.args.is_empty(),
                pre: request.pre.clone(),
                post: request.post.clone(),
                enabled: !request.disabled,
                counters: Arc::default(),
                trace_location: placement.trace_location.clone(),
            },
        );
        if let Some(site) = reg.sites.get_mut(&placement.site) {
            site.probes.push(id);
        }
        Self::sync_site(text, &mut reg, placement.site);
        Ok(id)
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
            });
        }
        let insn = insn::analyze(&placement.bytes, placement.site).map_err(|source| ProbeError::Decode {
            what: what.clone(),
            source,
        })?;
        let slot = match &insn.execution {
            Execution::Emulate(_) => None,
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
                        reason: "the instruction is in the guest's exception table (it may fault, and a fault \
                                 in an out-of-line copy has no fixup)"
                            .into(),
                    });
                }
                let slot = self.allocate_slot(what)?;
                let copy = step.copy_for(&insn, slot).map_err(|source| ProbeError::Decode {
                    what: what.clone(),
                    source,
                })?;
                text.write_virt(slot, &copy).map_err(|source| ProbeError::Memory {
                    what: what.clone(),
                    source,
                })?;
                Some(slot)
            }
        };
        Ok(Site {
            original: current[0],
            insn: Some(insn),
            slot,
            probes: Vec::new(),
            armed: false,
            gone: false,
        })
    }

    /// An int3 exit at `at` on vCPU `cpu`.
    pub fn on_breakpoint(&self, cpu: usize, vcpu: &mut dyn Vcpu, at: Gva) -> BreakpointOutcome {
        let started = Instant::now();
        let outcome = self.handle_breakpoint(cpu, vcpu, at);
        self.stats
            .handling_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }

    /// A single-step exit on vCPU `cpu`: the end of an out-of-line step.
    pub fn on_single_step(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> StepOutcome {
        let started = Instant::now();
        let outcome = self.handle_single_step(cpu, vcpu);
        self.stats
            .handling_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }

    fn handle_breakpoint(&self, cpu: usize, vcpu: &mut dyn Vcpu, at: Gva) -> BreakpointOutcome {
        if self.trampoline.get() == Some(&at) {
            return self.handle_return(cpu, vcpu);
        }
        let reg = self.read_registry();
        let Some(site) = reg.sites.get(&at) else {
            return BreakpointOutcome::NotOurs;
        };
        if !site.armed && !site.shared_with_guest() {
            // Disarmed between the exit and now: the original byte is back, run it.
            self.stats.stale.fetch_add(1, Ordering::Relaxed);
            return BreakpointOutcome::Handled;
        }
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("vCPU {cpu}: probe hit at {at}: cannot read registers: {e}");
                self.count_missed(&reg, site);
                return self.fallback(site);
            }
        };
        let at_hit = regs;
        let kernel = self.machine.kernel();
        let mut posts = Vec::new();
        let mut action = PreAction::Continue;
        let mut task = None;
        for id in &site.probes {
            let Some(probe) = reg.probes.get(id).filter(|p| p.enabled) else {
                continue;
            };
            if let ProbeKind::Kretprobe { maxactive } = probe.kind {
                self.enter_return_probe(*id, probe, maxactive, cpu, &mut regs, kernel);
                continue;
            }
            probe.counters.hits.fetch_add(1, Ordering::Relaxed);
            // A probe moved past an ftrace NOP shows the registers of its own address
            // (the NOP changes nothing but RIP), as the guest's ftrace-based kprobe would.
            let moved = probe.address != at;
            if moved {
                regs.rip = probe.address.0;
            }
            if probe.emit_events {
                let task = task.get_or_insert_with(|| vcpu.current_task());
                let event = self.hit_event(*id, probe, cpu, &regs, task.as_ref(), vcpu);
                let sent = self.sink.as_ref().is_some_and(|s| s.try_send(event));
                if !sent {
                    probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let Some(pre) = &probe.pre {
                let mut ctx = HitContext {
                    probe: *id,
                    cpu,
                    address: probe.address,
                    regs: &mut regs,
                    kernel: kernel as &dyn GuestVirtRead,
                };
                action = pre(&mut ctx);
            }
            if moved && regs.rip == probe.address.0 {
                regs.rip = at.0;
            }
            if let Some(post) = &probe.post {
                posts.push((*id, Arc::clone(post), probe.address));
            }
            if action == PreAction::Skip {
                break;
            }
        }
        if site.shared_with_guest() {
            // The guest's int3 handler expects RIP where it was; it executes the original
            // instruction itself.
            self.stats.shared_with_guest.fetch_add(1, Ordering::Relaxed);
            if regs != at_hit {
                if let Err(e) = vcpu.set_regs(&regs) {
                    tracing::error!("vCPU {cpu}: cannot write registers: {e}");
                }
            }
            // A handler that moved RIP took the guest elsewhere: its int3 was not reached.
            return if regs.rip != at.0 {
                BreakpointOutcome::Handled
            } else {
                BreakpointOutcome::HandledThenGuest
            };
        }
        if action == PreAction::Skip {
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = vcpu.set_regs(&regs) {
                tracing::error!("vCPU {cpu}: cannot write registers: {e}");
            }
            return BreakpointOutcome::Handled;
        }
        let Some(insn) = site.insn.as_ref() else {
            return BreakpointOutcome::NotOurs;
        };
        match &insn.execution {
            Execution::Emulate(emulation) => {
                self.stats.emulated.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = emulation.execute(insn, &mut regs, &mut KernelStack(kernel)) {
                    // Nothing was written to the vCPU: the int3 re-executes; better a
                    // repeated hit than a corrupted guest.
                    tracing::error!("vCPU {cpu}: emulating the probed instruction at {at}: {e}");
                    return BreakpointOutcome::Handled;
                }
                for (id, post, address) in &posts {
                    let mut ctx = HitContext {
                        probe: *id,
                        cpu,
                        address: *address,
                        regs: &mut regs,
                        kernel: kernel as &dyn GuestVirtRead,
                    };
                    post(&mut ctx);
                }
                if let Err(e) = vcpu.set_regs(&regs) {
                    tracing::error!("vCPU {cpu}: cannot write registers: {e}");
                }
                BreakpointOutcome::Handled
            }
            Execution::Step(_) => {
                let Some(slot) = site.slot else {
                    return BreakpointOutcome::NotOurs;
                };
                self.stats.stepped.fetch_add(1, Ordering::Relaxed);
                // Interrupts stay out of the step the way Linux keeps them out of its own:
                // IF cleared for one instruction. (KVM_GUESTDBG_BLOCKIRQ would do it too,
                // but toggling it flips a VM-wide APICv inhibit at every step.)
                let saved_if = regs.rflags & insn::RFLAGS_IF;
                regs.rflags &= !insn::RFLAGS_IF;
                regs.rip = slot.0;
                if let Err(e) = vcpu.set_regs(&regs).and_then(|()| vcpu.set_single_step(true)) {
                    tracing::error!("vCPU {cpu}: cannot start the out-of-line step at {at}: {e}");
                    return BreakpointOutcome::Handled;
                }
                let pending = PendingStep {
                    saved_if,
                    insn: insn.clone(),
                    slot,
                    posts: posts.into_iter().map(|(id, post, _)| (id, post)).collect(),
                    address: at,
                };
                self.stepping
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(cpu, pending);
                BreakpointOutcome::Handled
            }
            Execution::Refuse(_) => BreakpointOutcome::NotOurs,
        }
    }

    fn handle_single_step(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> StepOutcome {
        let mut stepping = self.stepping.lock().unwrap_or_else(|e| e.into_inner());
        let Some(pending) = stepping.remove(&cpu) else {
            return StepOutcome::NotOurs;
        };
        drop(stepping);
        let kernel = self.machine.kernel();
        let finish = |vcpu: &mut dyn Vcpu| {
            if let Err(e) = vcpu.set_single_step(false) {
                tracing::error!("vCPU {cpu}: cannot stop single-stepping: {e}");
            }
        };
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("vCPU {cpu}: after the out-of-line step: cannot read registers: {e}");
                finish(vcpu);
                return StepOutcome::Handled;
            }
        };
        let Execution::Step(step) = &pending.insn.execution else {
            finish(vcpu);
            return StepOutcome::Handled;
        };
        match step.fixup_after_step(&pending.insn, pending.slot, &mut regs, &mut KernelStack(kernel)) {
            Ok(StepFixup::StepAgain) => {
                self.stepping
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(cpu, pending);
                return StepOutcome::Handled;
            }
            Ok(StepFixup::Done) => {}
            Err(e) => tracing::error!("vCPU {cpu}: fixing up the step of {}: {e}", pending.address),
        }
        regs.rflags = (regs.rflags & !insn::RFLAGS_IF) | pending.saved_if;
        if step.kind == insn::StepKind::PushFlags {
            let mut stack = KernelStack(kernel);
            let pushed = stack
                .read_u64(Gva(regs.rsp))
                .map(|w| (w & !insn::RFLAGS_IF) | pending.saved_if)
                .and_then(|w| stack.write_u64(Gva(regs.rsp), w));
            if let Err(e) = pushed {
                tracing::error!("vCPU {cpu}: fixing the flags pushed at {}: {e}", pending.address);
            }
        }
        finish(vcpu);
        for (id, post) in &pending.posts {
            let mut ctx = HitContext {
                probe: *id,
                cpu,
                address: pending.address,
                regs: &mut regs,
                kernel: kernel as &dyn GuestVirtRead,
            };
            post(&mut ctx);
        }
        if let Err(e) = vcpu.set_regs(&regs) {
            tracing::error!("vCPU {cpu}: cannot write registers: {e}");
        }
        StepOutcome::Handled
    }

    /// A return probe's entry: follow this call (swap its return address for the
    /// trampoline) unless `maxactive` calls are in flight or the entry handler declines.
    fn enter_return_probe(
        &self,
        id: ProbeId,
        probe: &Probe,
        maxactive: u32,
        cpu: usize,
        regs: &mut Regs,
        kernel: &dyn KernelMemory,
    ) {
        let Some(&trampoline) = self.trampoline.get() else {
            return;
        };
        let slot = regs.rsp;
        let mut returns = self.returns.lock().unwrap_or_else(|e| e.into_inner());
        // A call that never returned (its task died, or it left by longjmp-like means)
        // leaves an instance behind; a new call using the same stack slot replaces it.
        returns.remove(&slot);
        let in_flight = returns.values().filter(|r| r.probe == id).count();
        if in_flight >= maxactive as usize {
            probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Some(entry) = &probe.pre {
            let shown_rip = regs.rip;
            regs.rip = probe.address.0;
            let mut ctx = HitContext {
                probe: id,
                cpu,
                address: probe.address,
                regs,
                kernel: kernel as &dyn GuestVirtRead,
            };
            let declined = entry(&mut ctx) == PreAction::Skip;
            regs.rip = shown_rip;
            if declined {
                return;
            }
        }
        let return_address = match kernel.read_u64(Gva(slot)) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(
                    "vCPU {cpu}: return probe at {}: reading the return address: {e}",
                    probe.address
                );
                probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        if let Err(e) = kernel.write_virt(Gva(slot), &trampoline.0.to_le_bytes()) {
            tracing::error!("vCPU {cpu}: return probe at {}: {e}", probe.address);
            probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        returns.insert(
            slot,
            ReturnInstance {
                probe: id,
                return_address,
            },
        );
    }

    /// The trampoline's int3: a followed call returned. Back to its caller, and the return
    /// probe's handler and event.
    fn handle_return(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> BreakpointOutcome {
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("vCPU {cpu}: return trampoline: cannot read registers: {e}");
                return BreakpointOutcome::Handled;
            }
        };
        // `ret` popped the slot that held the trampoline's address.
        let slot = regs.rsp.wrapping_sub(8);
        let instance = self.returns.lock().unwrap_or_else(|e| e.into_inner()).remove(&slot);
        let Some(instance) = instance else {
            // Nowhere to return to: the guest's own #BP handler will report it.
            tracing::error!(
                "vCPU {cpu}: a return through the trampoline with no call on record (stack slot {slot:#x})"
            );
            return BreakpointOutcome::NotOurs;
        };
        regs.rip = instance.return_address;
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        let reg = self.read_registry();
        if let Some(probe) = reg.probes.get(&instance.probe).filter(|p| p.enabled) {
            probe.counters.hits.fetch_add(1, Ordering::Relaxed);
            let kernel = self.machine.kernel();
            if probe.emit_events {
                let task = vcpu.current_task();
                let mut event = self.hit_event(instance.probe, probe, cpu, &regs, task.as_ref(), vcpu);
                event.record.retprobe_caller = Some(
                    self.view
                        .symbols
                        .describe(Gva(instance.return_address))
                        .map(|d| d.to_string())
                        .unwrap_or_else(|| format!("{:#x}", instance.return_address)),
                );
                if !self.sink.as_ref().is_some_and(|s| s.try_send(event)) {
                    probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let Some(ret) = &probe.post {
                let mut ctx = HitContext {
                    probe: instance.probe,
                    cpu,
                    address: probe.address,
                    regs: &mut regs,
                    kernel: kernel as &dyn GuestVirtRead,
                };
                ret(&mut ctx);
            }
        }
        if let Err(e) = vcpu.set_regs(&regs) {
            tracing::error!("vCPU {cpu}: cannot write registers: {e}");
        }
        BreakpointOutcome::Handled
    }

    /// Calls return probes follow right now.
    pub fn returns_in_flight(&self) -> usize {
        self.returns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// When a hit cannot be handled: leave it to the guest if the int3 was its own.
    fn fallback(&self, site: &Site) -> BreakpointOutcome {
        if site.shared_with_guest() {
            BreakpointOutcome::NotOurs
        } else {
            BreakpointOutcome::Handled
        }
    }

    fn count_missed(&self, reg: &Registry, site: &Site) {
        for id in &site.probes {
            if let Some(p) = reg.probes.get(id).filter(|p| p.enabled) {
                p.counters.nmissed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn hit_event(
        &self,
        id: ProbeId,
        probe: &Probe,
        cpu: usize,
        regs: &Regs,
        task: Option<&hvprobe_introspection::task::TaskInfo>,
        vcpu: &mut dyn Vcpu,
    ) -> HitEvent {
        let comm = task.map(|t| t.comm.clone());
        let user = if probe.args.iter().any(needs_user_memory) {
            vcpu.user_memory()
        } else {
            None
        };
        let ctx = FetchContext {
            regs,
            kernel: self.machine.kernel() as &dyn GuestVirtRead,
            user: user.as_deref(),
            symbols: &self.view.symbols,
            comm: comm.as_deref(),
            retval: matches!(probe.kind, ProbeKind::Kretprobe { .. }).then_some(regs.rax),
        };
        let args: Vec<(String, ArgValue)> = probe
            .args
            .iter()
            .map(|arg| (arg.name.clone(), evaluate(arg, &ctx)))
            .collect();
        HitEvent {
            probe: id,
            address: probe.address,
            regs: *regs,
            record: HitRecord {
                comm: comm.unwrap_or_else(|| "<...>".into()),
                pid: task.map(|t| t.pid).unwrap_or(-1),
                cpu,
                timestamp_ns: self.started.elapsed().as_nanos() as u64,
                group: probe.group.clone(),
                event: probe.event.clone(),
                location: probe.trace_location.clone(),
                retprobe_caller: None,
                args,
            },
        }
    }
}

fn needs_user_memory(arg: &FetchArg) -> bool {
    use crate::spec::{ArgType, FetchExpr};
    fn expr_user(e: &FetchExpr) -> bool {
        match e {
            FetchExpr::Deref { user, base, .. } => *user || expr_user(base),
            _ => false,
        }
    }
    arg.ty == ArgType::UString || expr_user(&arg.expr)
}

/// Everything [`Tracer::place`] found out about a probe point.
struct Placement {
    address: Gva,
    /// The probe is at its function's first byte (a return probe must be).
    at_function_entry: bool,
    /// `sym+0xoff` of `address`, for the listing.
    location: String,
    /// `sym+0xoff/0xsize` of `address`, for hit events.
    trace_location: String,
    site: Gva,
    what: String,
    /// The original bytes at `site` (up to 15, within the function).
    bytes: Vec<u8>,
    may_fault: bool,
}

/// Writes the int3, unless the guest changed the byte since we read it.
fn arm(text: &dyn KernelMemory, addr: Gva, site: &mut Site) {
    if site.shared_with_guest() {
        // The guest's int3 is already there: nothing to write.
        site.armed = true;
        return;
    }
    let mut b = [0u8];
    match text.read_virt(addr, &mut b) {
        Ok(()) if b[0] == site.original => match text.write_virt(addr, &[INT3]) {
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
/// our stale copy would corrupt its text).
fn disarm(text: &dyn KernelMemory, addr: Gva, site: &mut Site) {
    if !site.armed {
        return;
    }
    site.armed = false;
    if site.shared_with_guest() {
        return;
    }
    let mut b = [0u8];
    match text.read_virt(addr, &mut b) {
        Ok(()) if b[0] == INT3 => {
            if let Err(e) = text.write_virt(addr, &[site.original]) {
                tracing::error!("disarming the probe at {addr}: {e}");
            }
        }
        Ok(()) => {
            tracing::warn!(
                "the guest rewrote our int3 at {addr} (now {:#04x}): left as it is",
                b[0]
            );
            site.gone = true;
        }
        Err(e) => tracing::error!("disarming the probe at {addr}: {e}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

/// The kernel text range the engine may touch, for integrity checks.
pub fn text_range(symbols: &SymbolTable) -> Option<Range<Gva>> {
    let start = symbols.lookup("_stext")?.addr;
    let end = symbols.lookup("_etext")?.addr;
    Some(start..end)
}
