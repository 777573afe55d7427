//! The kprobe engine: a registry of probes, the int3 bytes it owns in the guest's text, and
//! what happens at a hit.
//!
//! A probe names an address (`symbol+offset` or raw). Probes at one address share a
//! *site*: one int3 in the text, the original instruction decoded once, and how that
//! instruction is executed after the pre-handlers ran: emulated on the host (one exit) or
//! single-stepped in an out-of-line copy (two exits). Text is only changed with every vCPU
//! paused, and an int3 is never lifted to execute the original instruction in place.
//!
//! Each submodule owns one invariant:
//! - [`registry`]: which probes exist, and the text holds our int3 exactly at the sites of
//!   enabled probes while the global switch is on (and never writes a stale byte back;
//!   putting an optimized site's int3 back is its `unoptimize`);
//! - [`placed`] and [`site_jump`]: the state the registry keeps per probe, watch and
//!   site (what placement found; a site's jump and detour code), below everything that
//!   makes or changes it, so that the engine's modules import one way;
//! - [`placement`]: a probe goes only on an instruction boundary of one function, off the
//!   guest's own patch sites;
//! - [`hit`]: an int3 exit runs every enabled probe once and leaves the vCPU where the
//!   guest expects it (or stops the VM with the reason);
//! - [`step`]: an out-of-line step ends at the instruction after the probe, or — when an
//!   exception or NMI interrupted it — the guest's handler returns to the probe address with
//!   its own flags; slots are reused only when no vCPU can be in them;
//! - [`step_guard`]: an exception or NMI during a step reaches the host before the guest's
//!   handler runs, on both backends;
//! - [`returns`]: every followed call returns to its own caller, through per-stack chains;
//! - [`events`]: what a hit records, and that a record not taken is counted as missed;
//! - [`modules`]: a probe on a module's code is armed exactly while that code is live —
//!   from before the module's init runs until before its memory is freed;
//! - [`stamps`]: every hit is stamped with the one chosen clock (the guest's trace clock, or
//!   host time when it is chosen or cannot be had).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use hvprobe_arch::debugreg::{Access, DebugRegisters};
use hvprobe_arch::Gva;
use hvprobe_introspection::facts::{BlacklistReason, ExceptionTable, KprobeBlacklist};
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::symbols::SymbolTable;

use crate::clock::GuestClock;
use crate::detour::event::filter::RecordFilter;
use crate::insn;
use crate::machine::{KernelMemory, Machine, PausedView};
use crate::output::HitRecord;
use crate::regs::Regs;
use crate::spec::FetchArg;

mod event_rings;
mod events;
mod hit;
mod modules;
mod optimize;
mod out_of_line;
mod placed;
mod placement;
mod registry;
mod returns;
mod site_jump;
mod stack;
mod stamps;
mod step;
mod step_guard;
#[cfg(test)]
mod tests;
mod text;
mod watch;

pub use event_rings::EventSetupError;
pub use hvprobe_detour::sites::{PatchSite, PatchSiteKind, PatchSites, PatchSitesError, MAX_SITE_TABLE_BYTES};
pub use out_of_line::OutOfLinePlace;
pub use placement::resolve_symbol;
pub use site_jump::WhyNotOptimized;
pub use text::TextBoundsError;

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
    Symbol {
        name: String,
        offset: u64,
    },
    Address(Gva),
    /// A symbol of a kernel module (`MOD:SYM+OFF`): armed while the module is loaded,
    /// pending before it loads and after it unloads (see [`modules`]).
    Module {
        module: String,
        name: String,
        offset: u64,
    },
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
    /// The registers; a pre-handler's changes are written back to the vCPU. `cs` and `ss`
    /// are 0 here (reading them costs another KVM call per hit; fetch-args that name them
    /// read the real selectors).
    pub regs: &'a mut Regs,
    pub kernel: &'a dyn GuestVirtRead,
    /// A return probe's per-call private data (`kretprobe_instance.data`, `data_size`
    /// bytes, zeroed at entry): what the entry handler writes there, the return handler of
    /// the same call reads. Empty for kprobes.
    pub data: &'a mut [u8],
}

/// Handlers run on the hitting vCPU's thread while the registry is read-locked: they must
/// not call the [`Tracer`] at all (registering, unregistering, enabling or disabling
/// pauses every vCPU, including the one the handler is running on; the listing and the
/// other queries take the registry's lock again and can wait on a writer forever). Send
/// what you need to another thread instead.
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
    /// A watch: a hardware breakpoint (a debug register) on an instruction (`Execute`,
    /// `len` 1), or on `len` bytes of data that fire after each write or access. No text
    /// changes; at most four at once.
    Watch { access: Access, len: u8 },
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
    /// For a return probe: bytes of private data per followed call, shared by its entry
    /// and return handlers ([`HitContext::data`]; Linux's kprobes' `data_size`).
    pub data_size: usize,
    /// Each event carries the guest's kernel stack at the hit ([`HitRecord::stack`],
    /// ftrace's `stacktrace` trigger), unwound on the host with the guest's ORC data. The
    /// stack is only there while the vCPU is stopped, so such a probe always traps: it is
    /// never optimized into an event detour (a sync detour traps, and is fine).
    pub stack_trace: bool,
    /// The event's filter as an event detour can run it in the guest (see
    /// [`crate::detour::event::filter`]); a hit it discards never becomes a record and is
    /// counted in [`crate::output::ListEntry::filtered_in_guest`]. Only for a probe whose every hit is
    /// filtered so on the host too: it must discard no hit the host would keep.
    pub filter: Option<RecordFilter>,
}

/// What the probes of one event have alike (Linux 5.7's multi-probe events, Linux's
/// `append_trace_kprobe` rule): their kind, and fields of the same names and types; the
/// fetches themselves may differ per site (perf probe's several sites of one line or
/// inlined function).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventShape {
    kind: std::mem::Discriminant<ProbeKind>,
    fields: Vec<(String, crate::spec::ArgType, Option<u32>)>,
}

impl KprobeRequest {
    /// The shape of the event this request makes.
    pub fn event_shape(&self) -> EventShape {
        EventShape {
            kind: std::mem::discriminant(&self.kind),
            fields: self.args.iter().map(|a| (a.name.clone(), a.ty, a.array_len)).collect(),
        }
    }

    /// Whether this request may be one more probe of an event of `shape` (a watch is
    /// always an event of its own).
    pub fn may_join(&self, shape: &EventShape) -> bool {
        !matches!(self.kind, ProbeKind::Watch { .. }) && self.event_shape() == *shape
    }

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
            data_size: 0,
            stack_trace: false,
            filter: None,
        }
    }
}

/// Why a probe cannot be registered (or changed).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The vCPUs could not be paused for the change; nothing changed.
    #[error(transparent)]
    Pause(#[from] crate::machine::PauseFailed),
    #[error("unknown symbol {0:?}")]
    UnknownSymbol(String),
    #[error("symbol {name:?} is not unique ({count} symbols have that name): give an address instead")]
    AmbiguousSymbol { name: String, count: usize },
    #[error("{0} is not in any kernel function (no text symbol covers it)")]
    NotInFunction(Gva),
    #[error("{what}: {symbol} at {addr} plus {offset:#x} runs past the end of the address space")]
    AddressWraps {
        what: String,
        symbol: String,
        addr: Gva,
        offset: u64,
    },
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
    #[error("{what} is blacklisted: {reason}")]
    ModuleBlacklisted {
        what: String,
        reason: hvprobe_introspection::modules::ModuleBlacklistReason,
    },
    #[error("{what} is inside a {kind} patch site at {site} that the guest rewrites itself")]
    PatchSite {
        what: String,
        kind: PatchSiteKind,
        site: Gva,
    },
    #[error("{what} cannot be probed: {reason}")]
    Unprobeable { what: String, reason: String },
    /// Where the probe would write is not text the engine may write (see
    /// [`text`](self::text)).
    #[error("{what} cannot be probed: {source}")]
    OutsideText { what: String, source: TextBoundsError },
    #[error("{what}: {source}")]
    Decode { what: String, source: insn::InsnError },
    #[error("{what}: guest memory: {source}")]
    Memory { what: String, source: MemoryError },
    #[error("the out-of-line area is full ({0} instruction copies)")]
    OutOfLineFull(u64),
    #[error(
        "{what}: the function's next instruction, where the probe would move off the ftrace NOP, is a branch \
             target inside {function} (from {from}): the probe would fire on every jump there, not once per call"
    )]
    MovedOntoBranchTarget {
        what: String,
        function: String,
        from: String,
    },
    #[error("no probe with id {0:?}")]
    NoSuchProbe(ProbeId),
    #[error("{what}: a return probe goes on a function's entry (offset 0)")]
    ReturnProbeNotAtEntry { what: String },
    #[error("event {group}/{event} already exists")]
    DuplicateEvent { group: String, event: String },
    #[error("{what}: {source}")]
    Watch {
        what: String,
        source: hvprobe_arch::debugreg::HardwareBreakpointError,
    },
    #[error("{what}: {reason}")]
    WatchUnsupported { what: String, reason: &'static str },
    #[error("all four debug registers are in use (by {in_use}): remove a watch first")]
    DebugRegistersFull { in_use: String },
    #[error("{what}: an int3 probe is on that instruction; a watch and a probe do not share one")]
    WatchOnProbe { what: String },
    #[error("{what}: an execution watch is on that instruction; a probe and a watch do not share one")]
    ProbeOnWatch { what: String },
    #[error("{what}: module {module} has no text symbol {name:?}")]
    UnknownModuleSymbol { what: String, module: String, name: String },
    #[error("{what}: the guest's modules cannot be followed: {reason}")]
    Modules { what: String, reason: String },
    /// The module is not loaded: the probe waits for it (never returned to a caller of
    /// `register`, which registers the probe as pending).
    #[error("{what}: module {module} is not loaded")]
    ModuleNotLoaded { what: String, module: String },
    #[error("setting the debug registers: {source}")]
    DebugRegisters {
        source: crate::machine::DebugRegistersError,
    },
}

/// Guest facts the engine checks probes against.
#[derive(Clone, Debug)]
pub struct KernelView {
    pub symbols: Arc<SymbolTable>,
    pub blacklist: KprobeBlacklist,
    pub ex_table: ExceptionTable,
    pub patch_sites: PatchSites,
}

/// The out-of-line area: guest-virtual memory mapped in the kernel's page tables and never
/// used by the guest, in two parts no page of which is both writable and executable (a
/// kernel's W+X check would report it).
#[derive(Clone, Copy, Debug)]
pub struct OutOfLineArea {
    /// Copies, the trampoline, detours and the step guard: executable, read-only to the
    /// guest (the host writes them through guest-physical memory).
    pub start: Gva,
    pub size: u64,
    /// Event detours' rings: writable, not executable.
    pub rings: Gva,
    pub rings_size: u64,
}

impl OutOfLineArea {
    pub fn contains(&self, at: Gva) -> bool {
        at.0.wrapping_sub(self.start.0) < self.size
    }
}

/// Hit counts of the engine as a whole.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub hits: AtomicU64,
    /// Hits through a jump and its sync detour (one exit each).
    pub optimized: AtomicU64,
    /// Hits an event detour recorded in the guest (no exit), taken from its ring.
    pub optimized_events: AtomicU64,
    /// Records an event detour could not write: its CPU's ring was full, or the hit came
    /// while that CPU was writing another record (an NMI). Counted by the guest.
    pub ring_missed: AtomicU64,
    /// What the host refused of the event rings, which the guest can write: records whose
    /// CPU number is not their ring's (vCPU's), and counter steps no vCPU count could have
    /// made since the last drain (one hit per nanosecond per vCPU). Only a misbehaving guest
    /// kernel makes these; its optimized probes' counts are not to be trusted then.
    pub ring_rejected: AtomicU64,
    /// Hits an event detour's filter discarded in the guest (counted in `hits` too).
    pub filtered_in_guest: AtomicU64,
    pub emulated: AtomicU64,
    pub stepped: AtomicU64,
    pub skipped: AtomicU64,
    pub shared_with_guest: AtomicU64,
    /// int3 exits at an address we had just disarmed (the instruction re-executes).
    pub stale: AtomicU64,
    /// Host emulations that failed (a stack page not present): the instruction was stepped
    /// out of line instead, so that the CPU raised the real fault.
    pub emulation_fallbacks: AtomicU64,
    /// Out-of-line steps an exception or NMI interrupted: the guest's handler was sent back
    /// to the probe address (or past the instruction, when it had completed) with the
    /// guest's own flags.
    pub steps_interrupted: AtomicU64,
    /// Out-of-line steps whose trap the backend never reported: the vCPU ran on to the int3
    /// after the copy, where the step ended (kvm_pvm's emulator, after a fence, `serialize`,
    /// `swapgs` or `out`).
    pub step_traps_lost: AtomicU64,
    /// Probes found `[GONE]`: the guest rewrote the byte under our int3.
    pub gone: AtomicU64,
    /// Return-probe calls that never returned (their task exited, or their stack frame
    /// was abandoned), found and freed.
    pub returns_abandoned: AtomicU64,
    /// Host time spent handling hits and steps (registers in and out, handlers, events,
    /// emulation), not counting the exits themselves.
    pub handling_ns: AtomicU64,
    /// Kernel stacks unwound for events that asked for them, and the host time it took
    /// (part of `handling_ns`).
    pub stacks_unwound: AtomicU64,
    pub unwind_ns: AtomicU64,
}

/// Why the engine cannot leave a vCPU where the guest expects it: the VM must stop (with
/// this reason) rather than run on in a state the guest never made.
#[derive(Debug, thiserror::Error)]
pub enum EngineFault {
    #[error("vCPU {cpu}: probe hit at {at}: {source}")]
    Vcpu {
        cpu: usize,
        at: Gva,
        source: crate::machine::VcpuError,
    },
    #[error("vCPU {cpu}: int3 at {at} in the out-of-line area that is no copy or trampoline of ours (an engine bug)")]
    UnknownOutOfLineBreakpoint { cpu: usize, at: Gva },
    #[error("vCPU {cpu}: the probe at {at} has an out-of-line copy but no step guard was written (an engine bug)")]
    StepWithoutGuard { cpu: usize, at: Gva },
    #[error(
        "vCPU {cpu}: a return through the trampoline with no call on record for stack slot {slot:#x} (an engine bug)"
    )]
    UnknownReturn { cpu: usize, slot: u64 },
    #[error(
        "vCPU {cpu}: a pre-handler of the probe at {at} asked to skip the instruction but left RIP on the probe \
         (it would hit again forever): a skipping handler must set RIP"
    )]
    SkipWithoutRip { cpu: usize, at: Gva },
    #[error("vCPU {cpu}: probe at {at}: {source}")]
    Insn {
        cpu: usize,
        at: Gva,
        source: Box<insn::InsnError>,
    },
    #[error(
        "vCPU {cpu}: probe at {at}: exception vector {vector} during its out-of-line step, but its frame at \
         {frame:#x} {found}: the VM stops rather than resume the guest where it never was"
    )]
    StepGuard {
        cpu: usize,
        at: Gva,
        vector: u8,
        frame: u64,
        found: String,
    },
    #[error("vCPU {cpu}: probe at {at}: the IDT its out-of-line step runs on cannot be made: {source}")]
    StepGuardMemory { cpu: usize, at: Gva, source: MemoryError },
    #[error(
        "vCPU {cpu}: probe at {at}: the host cannot emulate {insn} ({source}) and has no out-of-line copy to step"
    )]
    NoFallback {
        cpu: usize,
        at: Gva,
        insn: String,
        source: Box<insn::InsnError>,
    },
}

/// What the engine did with an int3 exit.
#[derive(Debug)]
pub enum BreakpointOutcome {
    /// Not ours: the guest gets its #BP.
    NotOurs,
    /// Ours; the vCPU is set up to continue.
    Handled,
    /// Ours and the guest's (its own int3 was there first): our handlers ran, now the
    /// guest gets its #BP.
    HandledThenGuest,
    /// The vCPU cannot continue correctly: stop the VM with this reason.
    Fatal(EngineFault),
}

/// What the engine did with a single-step exit.
#[derive(Debug)]
pub enum StepOutcome {
    NotOurs,
    Handled,
    /// The vCPU cannot continue correctly: stop the VM with this reason.
    Fatal(EngineFault),
}

/// The probe engine for one guest.
pub struct Tracer {
    machine: Arc<dyn Machine>,
    view: KernelView,
    /// Where the copies and the trampoline live (fixed for the tracer's life).
    ool: Option<OutOfLineArea>,
    registry: RwLock<registry::Registry>,
    slots: Mutex<step::Slots>,
    stepping: Mutex<step::PendingSteps>,
    /// The return probes' trampoline: an int3 in the out-of-line area, made with the first
    /// return probe and kept for as long as the tracer lives (calls in flight return
    /// through it even after their probe is gone).
    trampoline: OnceLock<Gva>,
    /// The IDT out-of-line steps run on ([`step_guard`]), made with the first stepped
    /// site, and the guest IDT bytes it was last built from.
    step_guard: OnceLock<step_guard::StepGuard>,
    step_guard_built_from: Mutex<Vec<u8>>,
    returns: Mutex<returns::ReturnChains>,
    /// The guest's own return trampoline (`arch_rethook_trampoline`), which its kretprobes
    /// swap in: a slot holding it may hold a call we follow too.
    guest_return_trampoline: Option<Gva>,
    /// The guest's function_graph tracer's return hook (`return_to_handler`), which its
    /// ftrace call at a function's entry swaps in (keeping what was there, ours too, in the
    /// task's return stack): the same for us as its return trampoline.
    guest_graph_return: Option<Gva>,
    sink: Option<Arc<dyn EventSink>>,
    started: Instant,
    /// The guest's trace clock, once the machine could give one.
    guest_clock: OnceLock<Arc<GuestClock>>,
    /// The chosen clock (its index in [`stamps::TRACE_CLOCKS`]).
    trace_clock: AtomicU8,
    /// The guest's clock failed a stamp (logged once: host time was used).
    warned_clock: AtomicBool,
    /// The guest's indirect-branch thunks (for the optimization checks), found once.
    thunks: OnceLock<crate::detour::IndirectThunks>,
    /// The rings of event detours, once set up.
    events: OnceLock<event_rings::EventSetup>,
    /// The guest's ORC data, read when a stack is first asked for.
    orc: OnceLock<Option<Arc<hvprobe_introspection::unwind::OrcTable>>>,
    /// The guest's BTF, read when a probe first names a parameter ([`Tracer::kernel_btf`]).
    btf: OnceLock<Option<Arc<hvprobe_introspection::btf::Btf>>>,
    /// Stack frames described so far (`func+0xoff/0xsize` by address): the same return
    /// addresses come back hit after hit.
    frame_names: Mutex<HashMap<Gva, Option<String>>>,
    /// The debug registers last handed to the machine (see [`watch`]).
    debug_registers: Mutex<DebugRegisters>,
    /// The guest's modules as last read, and the hooks that follow their loads and frees.
    modules: modules::ModuleTracker,
    /// Where text may be written (the kernel's text and the module area, never the
    /// out-of-line area), fixed at the start.
    text_bounds: text::TextBounds,
    pub stats: EngineStats,
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
        let guest_return_trampoline = [
            "arch_rethook_trampoline",
            "__kretprobe_trampoline",
            "kretprobe_trampoline",
        ]
        .iter()
        .find_map(|name| view.symbols.lookup(name).map(|s| s.addr));
        let guest_graph_return = view.symbols.lookup("return_to_handler").map(|s| s.addr);
        Tracer {
            text_bounds: text::TextBounds::new(&view.symbols, ool),
            machine,
            view,
            ool,
            registry: RwLock::new(registry::Registry::new()),
            slots: Mutex::new(step::Slots::new(ool)),
            stepping: Mutex::default(),
            trampoline: OnceLock::new(),
            step_guard: OnceLock::new(),
            step_guard_built_from: Mutex::default(),
            returns: Mutex::default(),
            guest_return_trampoline,
            guest_graph_return,
            sink,
            started: Instant::now(),
            guest_clock: OnceLock::new(),
            trace_clock: AtomicU8::new(0),
            warned_clock: AtomicBool::new(false),
            thunks: OnceLock::new(),
            events: OnceLock::new(),
            orc: OnceLock::new(),
            btf: OnceLock::new(),
            frame_names: Mutex::default(),
            debug_registers: Mutex::default(),
            modules: modules::ModuleTracker::default(),
            stats: EngineStats::default(),
        }
    }

    pub fn symbols(&self) -> &SymbolTable {
        &self.view.symbols
    }

    /// The guest kernel's BTF (`__start_BTF`..`__stop_BTF`), read from its memory on first
    /// use (a run whose probes name no parameter never reads it); `None`, logged once,
    /// when the kernel has none or it cannot be read.
    pub fn kernel_btf(&self) -> Option<&Arc<hvprobe_introspection::btf::Btf>> {
        self.btf
            .get_or_init(|| {
                let symbols = &self.view.symbols;
                let (Some(start), Some(stop)) = (symbols.lookup("__start_BTF"), symbols.lookup("__stop_BTF")) else {
                    tracing::info!("the guest kernel has no BTF (no __start_BTF/__stop_BTF)");
                    return None;
                };
                match hvprobe_introspection::btf::Btf::from_guest(&self.machine.kernel(), start.addr, stop.addr) {
                    Ok(btf) => {
                        tracing::info!("the guest kernel's BTF: {} types", btf.len());
                        Some(Arc::new(btf))
                    }
                    Err(e) => {
                        tracing::warn!("the guest kernel's BTF cannot be read: {e}");
                        None
                    }
                }
            })
            .as_ref()
    }

    fn read_registry(&self) -> std::sync::RwLockReadGuard<'_, registry::Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_registry(&self) -> std::sync::RwLockWriteGuard<'_, registry::Registry> {
        self.registry.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `edit` with every vCPU paused, after looking at every armed site for a byte
    /// the guest rewrote (a pause is when the guest's text can be read without racing it).
    fn paused(&self, edit: &mut dyn FnMut(&dyn PausedView)) -> Result<(), crate::machine::PauseFailed> {
        self.machine.with_vcpus_paused(&mut |view| {
            self.find_gone(view.text());
            edit(view);
            self.optimize_pass(view);
        })
    }

    /// Calls return probes follow right now.
    pub fn returns_in_flight(&self) -> usize {
        self.returns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The kernel text range the engine may touch, for integrity checks.
pub fn text_range(symbols: &SymbolTable) -> Option<Range<Gva>> {
    let start = symbols.lookup("_stext")?.addr;
    let end = symbols.lookup("_etext")?.addr;
    Some(start..end)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

/// `KernelMemory` as the instruction layer's stack.
struct KernelStack<'a>(&'a dyn KernelMemory);

impl insn::StackAccess for KernelStack<'_> {
    fn read_u64(&mut self, at: Gva) -> Result<u64, MemoryError> {
        self.0.read_u64(at)
    }

    fn write_u64(&mut self, at: Gva, value: u64) -> Result<(), MemoryError> {
        self.0.write_virt(at, &value.to_le_bytes())
    }
}
