//! vCPU threads: the exit loop, guest-owned breakpoints, and pausing, resuming and
//! stopping all vCPUs.
//!
//! A vCPU is kicked out of `KVM_RUN` by setting its `immediate_exit` byte and sending its
//! thread a signal: the byte catches a vCPU that is about to enter, the signal one that is
//! inside. The vCPU clears the byte before it looks at what was requested, so a request
//! made after that look always leaves the byte set for the next entry.
//!
//! Pausing: one thread at a time holds the pause (it nests within that thread). A pauser
//! waits until every other vCPU is out of guest mode: parked at its checkpoint, exited,
//! not started, or itself inside `pause_all` (a vCPU thread waiting for its turn to pause
//! runs no guest code). That last rule is what lets two vCPU threads pause at once: each
//! would otherwise wait for the other to park.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use hvprobe_arch::tsc::TscSample;
use hvprobe_arch::{Gva, INT3};
use kvm_bindings::{
    kvm_guest_debug, kvm_regs, kvm_sregs, KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP, KVM_GUESTDBG_USE_SW_BP,
    KVM_INTERNAL_ERROR_EMULATION, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::backend::Backend;
use crate::breakpoint;
use crate::devices::{GuestEvent, IoAction, PortDevices};
use crate::layout::{OOL_AREA_START, OOL_CODE_SIZE};
use crate::stats::VcpuStats;
use crate::{kvm_err, Error};

/// Why the VM stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The guest reported the exit status of its workload (or of its shell).
    GuestExit(u8),
    /// The guest reset the machine: a reboot, or the reboot after a kernel panic.
    Reset,
    /// The guest powered off through KVM's system-event exit.
    PowerOff,
    /// A triple fault.
    TripleFault,
    /// KVM could not emulate a guest instruction (kvm_pvm: kernel code is emulated).
    EmulationFailure { cpu: usize, rip: u64, insn: Vec<u8> },
    /// A vCPU ioctl or an unexpected exit, or a panic in the exit loop itself.
    VcpuError { cpu: usize, message: String },
    /// The user asked to quit (Ctrl-A x on the console), or the host stopped the VM.
    Stopped,
    /// The host process got this signal (SIGINT, SIGTERM) and stopped the VM cleanly.
    Signal(i32),
    /// The guest's init is ready for a workload (event 3) and the VM was asked to stop
    /// there ([`VcpuControl::stop_when_ready`]), to be snapshotted.
    GuestReady,
    /// The [`DebugHandler`] panicked on vCPU `cpu`; `message` is the panic's text. The
    /// vCPU was left wherever the handler stopped, so the VM cannot go on.
    HandlerPanicked { cpu: usize, message: String },
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::GuestExit(s) => write!(f, "guest exited with status {s}"),
            StopReason::Reset => write!(f, "guest reset the machine (reboot, or the reboot after a panic)"),
            StopReason::PowerOff => write!(f, "guest powered off"),
            StopReason::TripleFault => write!(f, "guest triple fault"),
            StopReason::EmulationFailure { cpu, rip, insn } => {
                write!(
                    f,
                    "KVM could not emulate the instruction at {rip:#x} on vCPU {cpu} (bytes:"
                )?;
                for b in insn {
                    write!(f, " {b:02x}")?;
                }
                write!(f, ")")
            }
            StopReason::VcpuError { cpu, message } => write!(f, "vCPU {cpu}: {message}"),
            StopReason::Stopped => write!(f, "stopped by the host"),
            StopReason::Signal(sig) => write!(f, "stopped by signal {}", signal_name(*sig)),
            StopReason::GuestReady => write!(f, "guest ready for a workload"),
            StopReason::HandlerPanicked { cpu, message } => {
                write!(f, "the debug handler panicked on vCPU {cpu}: {message}")
            }
        }
    }
}

/// The text of a panic's payload (what `panic!` was given).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic payload that is not text)".to_owned()
    }
}

/// `SIGINT` for 2, as `kill -l` names them (the number for others).
fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => other.to_string(),
    }
}

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

/// Counters of the exit loop, for all vCPUs together.
#[derive(Debug, Default)]
pub struct ExitCounters {
    pub exits: AtomicU64,
    pub io_exits: AtomicU64,
    pub breakpoints: AtomicU64,
    pub breakpoints_reinjected: AtomicU64,
    /// Single-step traps a debug handler took (out-of-line steps of probed instructions).
    pub single_steps: AtomicU64,
    /// Guest instructions KVM emulated (KVM's `insn_emulation` statistic; on kvm_pvm every
    /// guest kernel instruction), summed over vCPUs when they stop.
    pub instructions_emulated: AtomicU64,
    /// VM exits as KVM counts them (its `exits` statistic: the ones KVM handles itself
    /// too, which never reach this loop), summed over vCPUs when they stop.
    pub kvm_exits: AtomicU64,
    /// Pauses a kvm-clock guest was told about (`KVM_KVMCLOCK_CTRL` on a parking vCPU).
    pub kvmclock_pauses: AtomicU64,
    /// Pauses of every vCPU ([`VcpuControl::pause_all`], outermost ones only).
    pub pauses: AtomicU64,
    /// Guest writes into the out-of-line area's code half, which its read-only memory slot
    /// turned into MMIO exits: dropped (issue 24).
    pub ool_writes_refused: AtomicU64,
}

/// How to kick a vCPU out of `KVM_RUN`: `immediate_exit` in its `kvm_run` page, and its
/// thread.
#[derive(Clone, Copy)]
struct Kick {
    immediate_exit: *const AtomicU8,
    thread: libc::pthread_t,
}

struct VcpuSlot {
    /// `None` when the vCPU thread is not in its loop (its `kvm_run` page may be gone).
    kick: Mutex<Option<Kick>>,
}

// SAFETY: the raw pointer is only dereferenced under the slot's lock, and the slot holds it
// only while the vCPU thread that owns the `kvm_run` mapping is alive and has not yet
// dropped its `VcpuFd`: `VcpuThread`'s drop clears the slot first, on every way out of the
// thread's loop, a panic included.
unsafe impl Send for VcpuSlot {}
// SAFETY: as above.
unsafe impl Sync for VcpuSlot {}

/// Where a vCPU thread is, as a pauser sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// No thread yet.
    NotStarted,
    /// In KVM_RUN, about to enter it, or handling an exit: may run guest code soon.
    Running,
    /// Parked at its checkpoint.
    Parked,
    /// Inside `pause_all` (waiting for its turn or holding the pause): runs no guest code
    /// until its pause ends.
    Pausing,
    /// Out of its loop for good.
    Exited,
}

struct ControlState {
    /// The thread that holds the pause, and how deep its pauses nest.
    owner: Option<ThreadId>,
    depth: usize,
    /// The vCPU whose thread holds the pause, if a vCPU thread does.
    owner_cpu: Option<usize>,
    /// Threads inside `pause_all` waiting for their turn: parked vCPUs stay parked for them.
    waiting: usize,
    phases: Vec<Phase>,
    stop: Option<StopReason>,
    parked_state: Vec<Option<VcpuState>>,
}

impl ControlState {
    /// Whether a vCPU reaching its checkpoint must park.
    fn pause_wanted(&self) -> bool {
        self.owner.is_some() || self.waiting > 0
    }
}

/// Shared control of all vCPUs of a VM: pause, resume, stop, and what happened.
pub struct VcpuControl {
    slots: Vec<VcpuSlot>,
    state: Mutex<ControlState>,
    changed: Condvar,
    /// Set whenever a pause is wanted or a stop is: the vCPUs' fast path reads only this.
    request_pending: AtomicBool,
    started: OnceLock<Instant>,
    init_reached: OnceLock<Duration>,
    /// When vCPU 0 first entered KVM_RUN.
    first_entry: OnceLock<Instant>,
    /// When the guest signalled that its workload started.
    workload_started: OnceLock<Instant>,
    /// Stop the VM with [`StopReason::GuestReady`] when the guest signals event 3.
    stop_at_ready: AtomicBool,
    pub counters: ExitCounters,
}

thread_local! {
    static CURRENT_VCPU: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

extern "C" fn kick_signal_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

fn register_kick_signal() -> Result<(), Error> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result =
            vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_signal_handler).map_err(Error::Signal);
    });
    result
}

impl VcpuControl {
    pub fn new(vcpu_count: usize) -> Result<Arc<Self>, Error> {
        register_kick_signal()?;
        Ok(Arc::new(VcpuControl {
            slots: (0..vcpu_count).map(|_| VcpuSlot { kick: Mutex::new(None) }).collect(),
            state: Mutex::new(ControlState {
                owner: None,
                depth: 0,
                owner_cpu: None,
                waiting: 0,
                phases: vec![Phase::NotStarted; vcpu_count],
                stop: None,
                parked_state: vec![None; vcpu_count],
            }),
            changed: Condvar::new(),
            request_pending: AtomicBool::new(false),
            started: OnceLock::new(),
            init_reached: OnceLock::new(),
            first_entry: OnceLock::new(),
            workload_started: OnceLock::new(),
            stop_at_ready: AtomicBool::new(false),
            counters: ExitCounters::default(),
        }))
    }

    pub fn vcpu_count(&self) -> usize {
        self.slots.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, st: std::sync::MutexGuard<'a, ControlState>) -> std::sync::MutexGuard<'a, ControlState> {
        self.changed.wait(st).unwrap_or_else(|e| e.into_inner())
    }

    fn kick_all(&self) {
        for slot in &self.slots {
            let kick = slot.kick.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(Kick { immediate_exit, thread }) = *kick {
                // SAFETY: the pointer is valid while the slot holds it (see `VcpuSlot`), and
                // we hold the slot's lock.
                unsafe { (*immediate_exit).store(1, Ordering::SeqCst) };
                // SAFETY: the thread is alive while the slot holds it; the handler does nothing.
                unsafe { libc::pthread_kill(thread, kick_signal()) };
            }
        }
    }

    /// Stops the VM: every vCPU leaves its loop. The first reason given is kept.
    pub fn stop(&self, reason: StopReason) {
        {
            let mut st = self.lock();
            if st.stop.is_none() {
                st.stop = Some(reason);
            }
        }
        self.request_pending.store(true, Ordering::SeqCst);
        self.kick_all();
        self.changed.notify_all();
    }

    /// Why the VM stopped, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.lock().stop.clone()
    }

    /// Pauses all vCPUs (all others, when called from a vCPU thread) and returns once none
    /// of them can run guest code: each is parked, exited, not started yet, or in a
    /// `pause_all` of its own. That holds during a stop too. They run again when the
    /// returned guard is dropped.
    ///
    /// One thread holds the pause at a time: pauses nest within that thread, another
    /// thread's `pause_all` waits for its turn (so do not wait for another pausing thread
    /// while you hold a pause).
    pub fn pause_all(self: &Arc<Self>) -> PausedVcpus {
        let me = CURRENT_VCPU.with(|c| c.get());
        let thread = std::thread::current().id();
        let mut st = self.lock();
        if st.owner == Some(thread) {
            st.depth += 1;
            return PausedVcpus {
                control: Arc::clone(self),
            };
        }
        if let Some(cpu) = me {
            // Out of guest mode until this pause ends: a pauser must not wait for us.
            st.phases[cpu] = Phase::Pausing;
            self.changed.notify_all();
        }
        st.waiting += 1;
        self.request_pending.store(true, Ordering::SeqCst);
        while st.owner.is_some() {
            st = self.wait(st);
        }
        st.waiting -= 1;
        st.owner = Some(thread);
        st.owner_cpu = me;
        st.depth = 1;
        drop(st);
        self.counters.pauses.fetch_add(1, Ordering::Relaxed);
        self.kick_all();
        let mut st = self.lock();
        while st.phases.contains(&Phase::Running) {
            st = self.wait(st);
        }
        PausedVcpus {
            control: Arc::clone(self),
        }
    }

    fn resume(&self) {
        let mut st = self.lock();
        st.depth -= 1;
        if st.depth == 0 {
            st.owner = None;
            if let Some(cpu) = st.owner_cpu.take() {
                if st.phases[cpu] == Phase::Pausing {
                    st.phases[cpu] = Phase::Running;
                }
            }
            if !st.pause_wanted() && st.stop.is_none() {
                self.request_pending.store(false, Ordering::SeqCst);
            }
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Called by a vCPU thread between runs: parks while a pause is wanted, first calling
    /// `park` for the state it publishes while parked. Returns false when the vCPU must
    /// stop.
    fn checkpoint(&self, cpu: usize, park: impl FnOnce() -> Option<VcpuState>) -> bool {
        if !self.request_pending.load(Ordering::SeqCst) {
            return true;
        }
        let mut st = self.lock();
        if st.stop.is_some() {
            return false;
        }
        if !st.pause_wanted() {
            return true;
        }
        st.parked_state[cpu] = park();
        st.phases[cpu] = Phase::Parked;
        self.changed.notify_all();
        while st.pause_wanted() && st.stop.is_none() {
            st = self.wait(st);
        }
        // On a stop the vCPU leaves its loop at once, and counts as exited then.
        st.phases[cpu] = Phase::Running;
        st.parked_state[cpu] = None;
        st.stop.is_none()
    }

    /// Registers the calling thread as vCPU `cpu`'s, kicked through `kick` (none for a
    /// thread that never enters KVM_RUN: tests). Until the returned value is dropped the
    /// vCPU counts as running.
    fn enter_vcpu_thread(self: &Arc<Self>, cpu: usize, kick: Option<Kick>) -> VcpuThread {
        CURRENT_VCPU.with(|c| c.set(Some(cpu)));
        *self.slots[cpu].kick.lock().unwrap_or_else(|e| e.into_inner()) = kick;
        // A pause taken before this (while the vCPU had not started) is safe: the first
        // checkpoint parks the vCPU before it enters the guest.
        self.lock().phases[cpu] = Phase::Running;
        VcpuThread {
            control: Arc::clone(self),
            cpu,
        }
    }

    pub(crate) fn mark_started(&self) {
        let _ = self.started.set(Instant::now());
    }

    /// Makes the guest's "ready for a workload" event stop the VM (for a snapshot).
    pub fn stop_when_ready(&self) {
        self.stop_at_ready.store(true, Ordering::SeqCst);
    }

    /// When vCPU 0 first entered the guest (its first KVM_RUN).
    pub fn first_entry(&self) -> Option<Instant> {
        self.first_entry.get().copied()
    }

    /// When the guest signalled that its workload started (event 2).
    pub fn workload_started(&self) -> Option<Instant> {
        self.workload_started.get().copied()
    }

    /// Time from the start of the vCPUs to the guest's `/init` signal.
    pub fn boot_to_init(&self) -> Option<Duration> {
        self.init_reached.get().copied()
    }

    fn guest_event(&self, event: GuestEvent) {
        match event {
            GuestEvent::InitReached => {
                if let Some(started) = self.started.get() {
                    let t = started.elapsed();
                    if self.init_reached.set(t).is_ok() {
                        tracing::info!("guest reached /init after {:.2} s", t.as_secs_f64());
                    }
                }
            }
            GuestEvent::WorkloadStarted => {
                let _ = self.workload_started.set(Instant::now());
                tracing::debug!("guest workload started")
            }
            GuestEvent::ReadyForWorkload => tracing::debug!("guest ready for a workload"),
            GuestEvent::Other(v) => tracing::debug!("unknown guest event {v}"),
        }
    }
}

/// A vCPU thread's registration (see [`VcpuControl::enter_vcpu_thread`]). Dropping it,
/// on every way out of the thread's loop, a panic included, forgets how to kick the vCPU
/// (before the `VcpuFd` and its `kvm_run` page go) and counts the vCPU as exited; after a
/// panic it also stops the VM, which cannot go on without this vCPU.
struct VcpuThread {
    control: Arc<VcpuControl>,
    cpu: usize,
}

impl Drop for VcpuThread {
    fn drop(&mut self) {
        let control = &self.control;
        *control.slots[self.cpu].kick.lock().unwrap_or_else(|e| e.into_inner()) = None;
        CURRENT_VCPU.with(|c| c.set(None));
        if std::thread::panicking() {
            control.stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: "vCPU thread panicked".into(),
            });
        }
        {
            let mut st = control.lock();
            st.phases[self.cpu] = Phase::Exited;
            st.parked_state[self.cpu] = None;
        }
        control.changed.notify_all();
    }
}

/// What a parked vCPU publishes about itself.
#[derive(Clone, Copy, Debug)]
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The syscall entry point; 0 until the guest kernel has set it up.
    pub lstar: u64,
    /// The GS base user mode sees while the kernel runs (swapped by `swapgs`); the kernel's
    /// own GS base is `sregs.gs.base` while the vCPU is in kernel mode.
    pub kernel_gs_base: u64,
    /// `MSR_KVM_SYSTEM_TIME_NEW`: where the guest asked KVM to keep this vCPU's kvm-clock
    /// (`pvclock_vcpu_time_info`), guest-physical, bit 0 = enabled; 0 when it did not (or
    /// KVM would not say).
    pub kvm_system_time: u64,
    /// The vCPU's TSC as KVM reports it, between two reads of the host's (`None` when KVM
    /// would not read it): how guest TSC values relate to host ones.
    pub tsc: Option<TscSample>,
}

impl VcpuState {
    /// Registers, control registers and MSRs; no TSC sample (`tsc` is `None`).
    pub fn read(vcpu: &VcpuFd) -> Result<VcpuState, Error> {
        let regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
        let sregs = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        let msrs = crate::regs::read_state_msrs(vcpu)?;
        Ok(VcpuState {
            regs,
            sregs,
            lstar: msrs.lstar,
            kernel_gs_base: msrs.kernel_gs_base,
            kvm_system_time: msrs.kvm_system_time,
            tsc: None,
        })
    }

    /// [`read`](Self::read) and a sample of the vCPU's TSC against the host's (a few more
    /// ioctls: what a parked vCPU publishes, not what a hit needs).
    pub fn read_with_tsc(vcpu: &VcpuFd) -> Result<VcpuState, Error> {
        Ok(VcpuState {
            tsc: crate::regs::sample_tsc(vcpu),
            ..VcpuState::read(vcpu)?
        })
    }

    /// Whether the vCPU was running guest kernel code (CPL 0).
    pub fn in_kernel_mode(&self) -> bool {
        self.sregs.cs.selector & 3 == 0
    }

    /// The base of this CPU's per-CPU area (the kernel's GS base), whichever mode the vCPU
    /// was in.
    pub fn kernel_per_cpu_base(&self) -> u64 {
        if self.in_kernel_mode() {
            self.sregs.gs.base
        } else {
            self.kernel_gs_base
        }
    }
}

/// No vCPU but the caller's can run guest code (see [`VcpuControl::pause_all`]);
/// dropping this resumes them.
pub struct PausedVcpus {
    control: Arc<VcpuControl>,
}

impl PausedVcpus {
    /// The registers of a parked vCPU (`None` for the calling vCPU, an exited one, or one
    /// whose thread is itself in `pause_all`).
    pub fn regs(&self, cpu: usize) -> Option<kvm_regs> {
        self.state(cpu).map(|s| s.regs)
    }

    /// Registers, control registers and the MSRs introspection needs, of a parked vCPU
    /// (`None` for the calling vCPU, an exited one, or one whose thread is itself in
    /// `pause_all`).
    pub fn state(&self, cpu: usize) -> Option<VcpuState> {
        self.control.lock().parked_state.get(cpu).copied().flatten()
    }
}

impl Drop for PausedVcpus {
    fn drop(&mut self) {
        self.control.resume();
    }
}

/// Delivers a #BP to the guest for the int3 at `at`, as the CPU would have without a
/// hypervisor watching. The two backends differ in who moves RIP past the int3; on
/// hardware KVM a kernel int3's #BP is delivered by the VMM itself (see
/// [`crate::breakpoint`]), and only the rest goes back through KVM.
pub fn reinject_breakpoint(vcpu: &VcpuFd, mem: &GuestMemoryMmap, backend: Backend, at: Gva) -> Result<(), Error> {
    if !backend.int3_is_emulation_failure() && deliver_breakpoint_in_place(vcpu, mem, at)? {
        return Ok(());
    }
    if backend.int3_is_emulation_failure() {
        // kvm_pvm leaves RIP on the int3 and injects the exception as is: the guest's
        // handler expects RIP after the int3, as a trap would leave it.
        let mut regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
        regs.rip = at.0 + 1;
        vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
    }
    // On hardware KVM the #BP is delivered as a software exception and KVM advances RIP
    // by the instruction length itself.
    let mut events = vcpu.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
    let pending = backend.reinjects_breakpoints_as_pending();
    events.exception.injected = u8::from(!pending);
    events.exception.pending = u8::from(pending);
    events.exception.nr = 3;
    events.exception.has_error_code = 0;
    events.exception.error_code = 0;
    events.exception_has_payload = 0;
    events.exception_payload = 0;
    // Without KVM_VCPUEVENT_VALID_PAYLOAD, KVM ignores `pending`.
    events.flags = if pending {
        kvm_bindings::KVM_VCPUEVENT_VALID_PAYLOAD
    } else {
        0
    };
    vcpu.set_vcpu_events(&events).map_err(kvm_err("KVM_SET_VCPU_EVENTS"))
}

/// Pushes the #BP frame for the kernel int3 at `at` and enters the guest's handler, as the
/// CPU does; false (nothing changed) when this is not a case for it or guest memory on the
/// way is not mapped.
fn deliver_breakpoint_in_place(vcpu: &VcpuFd, mem: &GuestMemoryMmap, at: Gva) -> Result<bool, Error> {
    let mut regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
    let sregs = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
    let Some(gate_at) = breakpoint::bp_gate_address(&sregs) else {
        return Ok(false);
    };
    let Some(gate) = read_virt::<16>(vcpu, mem, gate_at) else {
        return Ok(false);
    };
    let delivery = breakpoint::breakpoint_delivery(at.0, &regs, &sregs, gate, |ist| {
        read_virt::<8>(vcpu, mem, breakpoint::ist_address(&sregs, ist)).map(u64::from_le_bytes)
    });
    let Some(delivery) = delivery else {
        return Ok(false);
    };
    if !write_virt(vcpu, mem, delivery.frame_at, &delivery.frame_bytes()) {
        return Ok(false);
    }
    regs.rip = delivery.rip;
    regs.rsp = delivery.rsp;
    regs.rflags = delivery.rflags;
    vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
    Ok(true)
}

/// The guest-physical addresses of `len` bytes at `gva` through the vCPU's page tables,
/// in at most two pieces (a page boundary); `None` if any byte is unmapped.
fn virt_pieces(vcpu: &VcpuFd, gva: u64, len: usize) -> Option<Vec<(u64, usize)>> {
    let mut pieces = Vec::new();
    let (mut at, end) = (gva, gva.checked_add(len as u64)?);
    while at < end {
        let t = vcpu.translate_gva(at).ok()?;
        if t.valid == 0 {
            return None;
        }
        let in_page = (0x1000 - (at & 0xfff)).min(end - at);
        pieces.push((t.physical_address, in_page as usize));
        at += in_page;
    }
    Some(pieces)
}

fn read_virt<const N: usize>(vcpu: &VcpuFd, mem: &GuestMemoryMmap, gva: u64) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    let mut done = 0;
    for (gpa, len) in virt_pieces(vcpu, gva, N)? {
        mem.read_slice(&mut out[done..done + len], GuestAddress(gpa)).ok()?;
        done += len;
    }
    Some(out)
}

/// Writes `bytes` at `gva`, all or nothing as far as the mapping goes (every piece is
/// translated before the first write).
fn write_virt(vcpu: &VcpuFd, mem: &GuestMemoryMmap, gva: u64, bytes: &[u8]) -> bool {
    let Some(pieces) = virt_pieces(vcpu, gva, bytes.len()) else {
        return false;
    };
    if pieces
        .iter()
        .any(|&(gpa, len)| !mem.check_range(GuestAddress(gpa), len))
    {
        return false;
    }
    let mut done = 0;
    for (gpa, len) in pieces {
        if mem.write_slice(&bytes[done..done + len], GuestAddress(gpa)).is_err() {
            return false;
        }
        done += len;
    }
    true
}

/// Everything one vCPU thread needs.
pub struct VcpuRunner {
    pub cpu: usize,
    pub vcpu: VcpuFd,
    pub backend: Backend,
    pub control: Arc<VcpuControl>,
    pub devices: Arc<PortDevices>,
    pub debug: Arc<dyn DebugHandler>,
    pub mem: GuestMemoryMmap,
}

/// What the loop does after an exit.
enum Next {
    Continue,
    Stop(StopReason),
}

impl VcpuRunner {
    /// Runs the vCPU until the VM stops; gives the vCPU back (a snapshot saves its state).
    /// A panic in the loop stops the VM with its message instead of taking the thread down.
    pub fn run(mut self) -> VcpuFd {
        let immediate_exit = &mut self.vcpu.get_kvm_run().immediate_exit as *mut u8 as *const AtomicU8;
        let kick = Kick {
            immediate_exit,
            // SAFETY: pthread_self has no preconditions.
            thread: unsafe { libc::pthread_self() },
        };
        // Declared after `self`, so dropped before it (and its kvm_run mapping) even when
        // unwinding.
        let _registration = self.control.enter_vcpu_thread(self.cpu, Some(kick));
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| self.run_loop(immediate_exit))) {
            self.control.stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: format!("the exit loop panicked: {}", panic_message(payload.as_ref())),
            });
        }
        self.vcpu
    }

    fn run_loop(&mut self, immediate_exit: *const AtomicU8) {
        if self.debug.wants_breakpoints() && !self.backend.int3_is_emulation_failure() {
            if let Err(e) = set_guest_debug(&self.vcpu, self.backend, false) {
                tracing::error!("vCPU {}: int3 exits unavailable: {e}", self.cpu);
            }
        }
        let stats = VcpuStats::open(&self.vcpu)
            .map_err(|e| tracing::debug!("vCPU {}: no KVM statistics: {e}", self.cpu))
            .ok();

        loop {
            // SAFETY: `immediate_exit` points into this vCPU's kvm_run page, alive as long
            // as `self.vcpu`.
            unsafe { (*immediate_exit).store(0, Ordering::SeqCst) };
            if !self.control.checkpoint(self.cpu, || self.park()) {
                break;
            }
            if self.cpu == 0 && self.control.first_entry.get().is_none() {
                let _ = self.control.first_entry.set(Instant::now());
            }
            let next = self.run_once();
            if let Next::Stop(reason) = next {
                self.control.stop(reason);
                break;
            }
        }

        if let Some(stats) = stats {
            let counters = &self.control.counters;
            if let Some(emulated) = stats.get("insn_emulation") {
                counters.instructions_emulated.fetch_add(emulated, Ordering::Relaxed);
            }
            if let Some(exits) = stats.get("exits") {
                counters.kvm_exits.fetch_add(exits, Ordering::Relaxed);
            }
        }
    }

    /// What a vCPU does as it parks for a pause: tells a kvm-clock guest that it is paused
    /// (the guest's RCU stall and soft-lockup detectors then forgive the time jump a long
    /// pause makes, as they do for a paused QEMU or firecracker guest), and returns the
    /// state it publishes while parked.
    fn park(&self) -> Option<VcpuState> {
        match self.vcpu.kvmclock_ctrl() {
            Ok(()) => {
                self.control.counters.kvmclock_pauses.fetch_add(1, Ordering::Relaxed);
            }
            // EINVAL: the guest has not enabled kvm-clock on this vCPU (a code blob, or
            // a kernel still booting).
            Err(e) => tracing::debug!("vCPU {}: KVM_KVMCLOCK_CTRL: {e}", self.cpu),
        }
        VcpuState::read_with_tsc(&self.vcpu).ok()
    }

    /// Calls the debug handler; a panic in it becomes [`StopReason::HandlerPanicked`]
    /// (the vCPU's registers are wherever the handler left them: it must not run on).
    fn call_handler<T>(
        &mut self,
        call: impl FnOnce(&dyn DebugHandler, usize, &mut VcpuFd) -> T,
    ) -> Result<T, StopReason> {
        let (debug, cpu, vcpu) = (&*self.debug, self.cpu, &mut self.vcpu);
        catch_unwind(AssertUnwindSafe(|| call(debug, cpu, vcpu))).map_err(|payload| StopReason::HandlerPanicked {
            cpu,
            message: panic_message(payload.as_ref()),
        })
    }

    fn run_once(&mut self) -> Next {
        let cpu = self.cpu;
        let exit = match self.vcpu.run() {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => return Next::Continue,
            Err(e) => {
                return Next::Stop(StopReason::VcpuError {
                    cpu,
                    message: format!("KVM_RUN failed: {e}"),
                })
            }
        };
        self.control.counters.exits.fetch_add(1, Ordering::Relaxed);
        match exit {
            VcpuExit::IoOut(port, data) => {
                self.control.counters.io_exits.fetch_add(1, Ordering::Relaxed);
                match self.devices.write(port, data) {
                    IoAction::Continue => Next::Continue,
                    IoAction::Event(GuestEvent::ReadyForWorkload)
                        if self.control.stop_at_ready.load(Ordering::SeqCst) =>
                    {
                        self.control.guest_event(GuestEvent::ReadyForWorkload);
                        Next::Stop(StopReason::GuestReady)
                    }
                    IoAction::Event(e) => {
                        self.control.guest_event(e);
                        match self.call_handler(|debug, cpu, _| debug.on_guest_event(cpu, e)) {
                            Ok(()) => Next::Continue,
                            Err(reason) => Next::Stop(reason),
                        }
                    }
                    IoAction::GuestExit(status) => Next::Stop(StopReason::GuestExit(status)),
                    IoAction::Reset => Next::Stop(StopReason::Reset),
                }
            }
            VcpuExit::IoIn(port, data) => {
                self.control.counters.io_exits.fetch_add(1, Ordering::Relaxed);
                self.devices.read(port, data);
                Next::Continue
            }
            VcpuExit::MmioRead(addr, data) => {
                tracing::debug!("vCPU {cpu}: read of unbacked guest-physical {addr:#x}");
                data.fill(0xff);
                Next::Continue
            }
            VcpuExit::MmioWrite(addr, data) if OOL_CODE.contains(&addr) => {
                let len = data.len();
                self.ool_write_refused(cpu, addr, len);
                Next::Continue
            }
            VcpuExit::MmioWrite(addr, _) => {
                tracing::debug!("vCPU {cpu}: write to unbacked guest-physical {addr:#x}");
                Next::Continue
            }
            VcpuExit::Hlt => Next::Continue,
            VcpuExit::Shutdown => Next::Stop(StopReason::TripleFault),
            VcpuExit::SystemEvent(kind, _) => match kind {
                KVM_SYSTEM_EVENT_SHUTDOWN => Next::Stop(StopReason::PowerOff),
                KVM_SYSTEM_EVENT_RESET => Next::Stop(StopReason::Reset),
                other => Next::Stop(StopReason::VcpuError {
                    cpu,
                    message: format!("system event {other}"),
                }),
            },
            VcpuExit::Debug(arch) => {
                let (exception, pc) = (arch.exception, arch.pc);
                if exception == 3 {
                    return self.breakpoint(Gva(pc));
                }
                let stepped = exception == 1 && {
                    match self.call_handler(|debug, cpu, vcpu| debug.on_single_step(cpu, vcpu)) {
                        Ok(taken) => taken,
                        Err(reason) => return Next::Stop(reason),
                    }
                };
                if stepped {
                    self.control.counters.single_steps.fetch_add(1, Ordering::Relaxed);
                    Next::Continue
                } else {
                    Next::Stop(StopReason::VcpuError {
                        cpu,
                        message: format!("unexpected debug exit: exception {exception} at {pc:#x}"),
                    })
                }
            }
            VcpuExit::InternalError => self.internal_error(),
            VcpuExit::FailEntry(reason, hw_cpu) => Next::Stop(StopReason::VcpuError {
                cpu,
                message: format!("VM entry failed: hardware reason {reason:#x} on host CPU {hw_cpu}"),
            }),
            other => Next::Stop(StopReason::VcpuError {
                cpu,
                message: format!("unexpected exit: {other:?}"),
            }),
        }
    }

    /// A guest write of `len` bytes at `addr`, inside the out-of-line area's read-only code:
    /// dropped (KVM has not written it), counted, and the first few reported with the
    /// writer's RIP (past the instruction, which KVM completed as MMIO) and CR3. The run
    /// goes on: our code is unchanged, so the probes keep working.
    fn ool_write_refused(&mut self, cpu: usize, addr: u64, len: usize) {
        let n = self.control.counters.ool_writes_refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n > OOL_WRITES_LOGGED {
            return;
        }
        let rip = self.vcpu.get_regs().map(|r| r.rip).ok();
        let cr3 = self.vcpu.get_sregs().map(|s| s.cr3).ok();
        let shown = |v: Option<u64>| v.map_or_else(|| "?".to_string(), |v| format!("{v:#x}"));
        tracing::warn!(
            "vCPU {cpu}: the guest wrote {len} bytes at {addr:#x}, into hvprobe's out-of-line code: refused \
             (RIP after the write {}, CR3 {}){}",
            shown(rip),
            shown(cr3),
            if n == OOL_WRITES_LOGGED {
                "; further ones are only counted"
            } else {
                ""
            }
        );
    }

    /// `KVM_EXIT_INTERNAL_ERROR`: on kvm_pvm a guest int3 at CPL0 arrives this way.
    fn internal_error(&mut self) -> Next {
        let cpu = self.cpu;
        // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, whose data is the union's
        // `internal` member; `emulation_failure` overlays it for the emulation suberror.
        let (suberror, ndata, data) = {
            let run = self.vcpu.get_kvm_run();
            let internal = unsafe { run.__bindgen_anon_1.internal };
            (internal.suberror, internal.ndata, internal.data)
        };
        let rip = match self.vcpu.get_regs() {
            Ok(r) => r.rip,
            Err(e) => {
                return Next::Stop(StopReason::VcpuError {
                    cpu,
                    message: format!("KVM_GET_REGS: {e}"),
                })
            }
        };
        if suberror != KVM_INTERNAL_ERROR_EMULATION {
            return Next::Stop(StopReason::VcpuError {
                cpu,
                message: format!(
                    "KVM internal error, suberror {suberror}, rip {rip:#x}, data {:x?}",
                    &data[..(ndata as usize).min(16)]
                ),
            });
        }
        let mut insn = emulation_failure_bytes(ndata, &data);
        if insn.is_empty() {
            insn = self.bytes_at(rip);
        }
        if self.backend.int3_is_emulation_failure() && insn.first() == Some(&INT3) {
            return self.breakpoint(Gva(rip));
        }
        if insn.first() == Some(&FWAIT) {
            return match complete_fwait(&self.vcpu, rip) {
                Ok(()) => Next::Continue,
                Err(e) => Next::Stop(StopReason::VcpuError {
                    cpu,
                    message: format!("completing fwait: {e}"),
                }),
            };
        }
        Next::Stop(StopReason::EmulationFailure { cpu, rip, insn })
    }

    /// Up to 15 instruction bytes at a guest-virtual address, through KVM's translation
    /// of the vCPU's current page tables (empty when unmapped).
    fn bytes_at(&self, rip: u64) -> Vec<u8> {
        let Ok(t) = self.vcpu.translate_gva(rip) else {
            return Vec::new();
        };
        if t.valid == 0 {
            return Vec::new();
        }
        let in_page = (0x1000 - (rip & 0xfff)).min(15) as usize;
        let mut buf = vec![0u8; in_page];
        match self.mem.read_slice(&mut buf, GuestAddress(t.physical_address)) {
            Ok(()) => buf,
            Err(_) => Vec::new(),
        }
    }

    fn breakpoint(&mut self, at: Gva) -> Next {
        self.control.counters.breakpoints.fetch_add(1, Ordering::Relaxed);
        let disposition = match self.call_handler(|debug, cpu, vcpu| debug.on_breakpoint(cpu, vcpu, at)) {
            Ok(d) => d,
            Err(reason) => return Next::Stop(reason),
        };
        match disposition {
            BreakpointDisposition::Handled => Next::Continue,
            BreakpointDisposition::GuestOwned => {
                self.control
                    .counters
                    .breakpoints_reinjected
                    .fetch_add(1, Ordering::Relaxed);
                match reinject_breakpoint(&self.vcpu, &self.mem, self.backend, at) {
                    Ok(()) => Next::Continue,
                    Err(e) => Next::Stop(StopReason::VcpuError {
                        cpu: self.cpu,
                        message: format!("re-injecting #BP: {e}"),
                    }),
                }
            }
        }
    }
}

/// `fwait`/`wait`: KVM's emulator has no case for it, and Linux executes one in
/// `fpu__drop()` on every exec and exit.
/// The out-of-line area's code half, guest-physical: read-only to the guest (see
/// `register_guest_memory`), so a guest write there exits as MMIO.
const OOL_CODE: std::ops::Range<u64> = OOL_AREA_START.0..OOL_AREA_START.0 + OOL_CODE_SIZE;
/// How many refused writes into it are logged one by one (all are counted).
const OOL_WRITES_LOGGED: u64 = 8;

const FWAIT: u8 = 0x9b;
const X87_FSW_ES: u16 = 1 << 7;
const MF_VECTOR: u8 = 16;

/// Completes an `fwait` the emulator refused, as the CPU would: with no unmasked x87
/// exception pending it does nothing; with one, it raises #MF.
fn complete_fwait(vcpu: &VcpuFd, rip: u64) -> Result<(), Error> {
    let fpu = vcpu.get_fpu().map_err(kvm_err("KVM_GET_FPU"))?;
    if fpu.fsw & X87_FSW_ES != 0 {
        let mut events = vcpu.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
        events.exception.injected = 1;
        events.exception.pending = 0;
        events.exception.nr = MF_VECTOR;
        events.exception.has_error_code = 0;
        events.flags = 0;
        return vcpu.set_vcpu_events(&events).map_err(kvm_err("KVM_SET_VCPU_EVENTS"));
    }
    let mut regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
    // The guest's RIP: an fwait at the last byte of the address space wraps, as the CPU's.
    regs.rip = rip.wrapping_add(1);
    vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))
}

/// The instruction bytes KVM reports with an emulation failure
/// (`struct kvm_run::emulation_failure`: flags, then insn_size and insn_bytes).
fn emulation_failure_bytes(ndata: u32, data: &[u64; 16]) -> Vec<u8> {
    const HAS_INSN_BYTES: u64 = 1;
    if ndata < 3 || data[0] & HAS_INSN_BYTES == 0 {
        return Vec::new();
    }
    let mut raw = [0u8; 16];
    raw[..8].copy_from_slice(&data[1].to_le_bytes());
    raw[8..].copy_from_slice(&data[2].to_le_bytes());
    let size = (raw[0] as usize).min(15);
    raw[1..1 + size].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::thread::JoinHandle;

    const LIMIT: Duration = Duration::from_secs(10);

    /// What a fake vCPU does after each exit, as a debug handler would: gets the control
    /// and the number of the slice that just ended.
    type OnExit = Box<dyn FnMut(&Arc<VcpuControl>, u64) + Send>;

    /// A stand-in for a vCPU thread, without KVM (kicks need a `kvm_run`): it "runs the
    /// guest" in short slices and goes through the checkpoint between them, as the exit
    /// loop does, until the VM stops or it has run `exit_after` slices.
    struct FakeVcpu {
        /// True while it is "in the guest".
        in_guest: Arc<AtomicBool>,
        slices: Arc<AtomicU64>,
        /// Keeps it in the guest (a long KVM_RUN) while set.
        hold: Arc<AtomicBool>,
        thread: JoinHandle<()>,
    }

    fn fake_vcpu(
        control: &Arc<VcpuControl>,
        cpu: usize,
        hold: bool,
        exit_after: Option<u64>,
        mut on_exit: OnExit,
    ) -> FakeVcpu {
        let in_guest = Arc::new(AtomicBool::new(false));
        let slices = Arc::new(AtomicU64::new(0));
        let hold = Arc::new(AtomicBool::new(hold));
        let thread = {
            let (control, in_guest, slices, hold) = (control.clone(), in_guest.clone(), slices.clone(), hold.clone());
            std::thread::spawn(move || {
                let _thread = control.enter_vcpu_thread(cpu, None);
                while control.checkpoint(cpu, || None) {
                    in_guest.store(true, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_micros(200));
                    while hold.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    in_guest.store(false, Ordering::SeqCst);
                    let n = slices.fetch_add(1, Ordering::SeqCst) + 1;
                    on_exit(&control, n);
                    if exit_after == Some(n) {
                        break;
                    }
                }
            })
        };
        FakeVcpu {
            in_guest,
            slices,
            hold,
            thread,
        }
    }

    fn nothing() -> OnExit {
        Box::new(|_, _| {})
    }

    fn wait_until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + LIMIT;
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A pause from a host thread, in a thread of its own: sends whether `in_guest` was set
    /// when `pause_all` returned, then holds the pause until `release` says so.
    fn pause_in_thread(
        control: &Arc<VcpuControl>,
        in_guest: &Arc<AtomicBool>,
    ) -> (mpsc::Receiver<bool>, mpsc::Sender<()>) {
        let (returned_tx, returned_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let (control, in_guest) = (control.clone(), in_guest.clone());
        std::thread::spawn(move || {
            let paused = control.pause_all();
            let _ = returned_tx.send(in_guest.load(Ordering::SeqCst));
            let _ = release_rx.recv();
            drop(paused);
        });
        (returned_rx, release_tx)
    }

    #[test]
    fn a_pause_from_the_host_waits_until_every_vcpu_is_parked_or_exited() {
        let control = VcpuControl::new(2).unwrap();
        control.mark_started();
        let running = fake_vcpu(&control, 0, true, None, nothing());
        let leaving = fake_vcpu(&control, 1, false, Some(1), nothing());
        wait_until("vCPU 0 is in the guest", || running.in_guest.load(Ordering::SeqCst));
        leaving.thread.join().unwrap();

        let (returned, release) = pause_in_thread(&control, &running.in_guest);
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            returned.try_recv().is_err(),
            "pause_all returned while vCPU 0 was in the guest"
        );
        running.hold.store(false, Ordering::SeqCst);
        let in_guest = returned
            .recv_timeout(LIMIT)
            .expect("pause_all did not return once vCPU 0 parked");
        assert!(!in_guest, "pause_all returned while vCPU 0 was in the guest");
        let frozen = running.slices.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(running.slices.load(Ordering::SeqCst), frozen, "a parked vCPU ran");
        release.send(()).unwrap();
        wait_until("vCPU 0 runs again", || running.slices.load(Ordering::SeqCst) > frozen);
        control.stop(StopReason::Stopped);
        running.thread.join().unwrap();
    }

    /// A stop during a pause used to end the pauser's wait at once, while vCPUs were still
    /// in KVM_RUN; the caller would then write guest text under them.
    #[test]
    fn a_stop_racing_a_pause_does_not_report_paused_while_a_vcpu_runs() {
        let control = VcpuControl::new(1).unwrap();
        control.mark_started();
        let vcpu = fake_vcpu(&control, 0, true, None, nothing());
        wait_until("vCPU 0 is in the guest", || vcpu.in_guest.load(Ordering::SeqCst));

        let (returned, release) = pause_in_thread(&control, &vcpu.in_guest);
        std::thread::sleep(Duration::from_millis(20));
        control.stop(StopReason::Stopped);
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            returned.try_recv().is_err(),
            "pause_all returned while vCPU 0 was in the guest"
        );
        vcpu.hold.store(false, Ordering::SeqCst);
        let in_guest = returned
            .recv_timeout(LIMIT)
            .expect("pause_all did not return once vCPU 0 exited");
        assert!(!in_guest);
        vcpu.thread.join().unwrap();
        release.send(()).unwrap();
        assert_eq!(control.stop_reason(), Some(StopReason::Stopped));
    }

    /// Two vCPU threads that pause at the same moment (two handlers arming probes) each
    /// used to wait for the other to park: neither ever did.
    #[test]
    fn two_vcpu_threads_pausing_at_once_both_complete() {
        let control = VcpuControl::new(3).unwrap();
        control.mark_started();
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let (done_tx, done_rx) = mpsc::channel();
        // Whether each vCPU is in the guest, for the pausers to check.
        let flags: Arc<OnceLock<Vec<Arc<AtomicBool>>>> = Arc::new(OnceLock::new());
        let pauser = |cpu: usize| -> OnExit {
            let (barrier, done_tx, flags) = (barrier.clone(), done_tx.clone(), flags.clone());
            Box::new(move |control, slice| {
                if slice != 3 {
                    return;
                }
                barrier.wait();
                let paused = control.pause_all();
                for _ in 0..10 {
                    for (other, in_guest) in flags.wait().iter().enumerate() {
                        assert!(
                            other == cpu || !in_guest.load(Ordering::SeqCst),
                            "vCPU {other} ran during vCPU {cpu}'s pause"
                        );
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                drop(paused);
                done_tx.send(cpu).unwrap();
            })
        };
        let vcpus = [
            fake_vcpu(&control, 0, false, None, pauser(0)),
            fake_vcpu(&control, 1, false, None, pauser(1)),
            fake_vcpu(&control, 2, false, None, nothing()),
        ];
        flags.set(vcpus.iter().map(|v| v.in_guest.clone()).collect()).unwrap();
        let mut done = Vec::new();
        for _ in 0..2 {
            match done_rx.recv_timeout(LIMIT) {
                Ok(cpu) => done.push(cpu),
                Err(_) => {
                    // Unblock the threads before failing (a stop ends every wait).
                    control.stop(StopReason::Stopped);
                    panic!("vCPU threads pausing at once deadlocked (completed: {done:?})");
                }
            }
        }
        let ran = vcpus[2].slices.load(Ordering::SeqCst);
        wait_until("the vCPUs run after both pauses", || {
            vcpus[2].slices.load(Ordering::SeqCst) > ran
        });
        control.stop(StopReason::Stopped);
        for v in vcpus {
            v.thread.join().unwrap();
        }
    }

    /// An engine bug outside the debug handler takes the vCPU thread down: its
    /// registration must still count it as exited (or every later pause waits for it) and
    /// stop the VM (or the other vCPUs run on without it).
    #[test]
    fn a_vcpu_thread_that_panics_stops_the_vm_and_counts_as_exited() {
        let control = VcpuControl::new(2).unwrap();
        let survivor = fake_vcpu(&control, 1, false, None, nothing());
        let crashing = fake_vcpu(
            &control,
            0,
            false,
            None,
            Box::new(|_, slice| {
                if slice == 2 {
                    panic!("engine bug");
                }
            }),
        );
        assert!(crashing.thread.join().is_err());
        survivor.thread.join().unwrap();
        assert_eq!(
            control.stop_reason(),
            Some(StopReason::VcpuError {
                cpu: 0,
                message: "vCPU thread panicked".into()
            })
        );
        let (returned, _release) = pause_in_thread(&control, &Arc::new(AtomicBool::new(false)));
        returned.recv_timeout(LIMIT).expect("a pause waited for a dead vCPU");
    }

    /// Pausers on vCPU threads and on a host thread, all at once and many times: each
    /// pause is alone (they take turns) and no other vCPU is in the guest during it.
    #[test]
    fn pauses_from_vcpu_and_host_threads_take_turns_and_exclude_guest_code() {
        const VCPUS: usize = 3;
        const ROUNDS: u64 = 40;
        let control = VcpuControl::new(VCPUS).unwrap();
        let held = Arc::new(AtomicBool::new(false));
        let flags: Arc<OnceLock<Vec<Arc<AtomicBool>>>> = Arc::new(OnceLock::new());
        let check = |held: &AtomicBool, flags: &OnceLock<Vec<Arc<AtomicBool>>>, me: Option<usize>| {
            assert!(!held.swap(true, Ordering::SeqCst), "two pauses held at once");
            for (cpu, in_guest) in flags.wait().iter().enumerate() {
                assert!(
                    Some(cpu) == me || !in_guest.load(Ordering::SeqCst),
                    "vCPU {cpu} ran during a pause"
                );
            }
            std::thread::sleep(Duration::from_micros(300));
            held.store(false, Ordering::SeqCst);
        };
        let (done_tx, done_rx) = mpsc::channel();
        let vcpus: Vec<FakeVcpu> = (0..VCPUS)
            .map(|cpu| {
                let (held, flags, done_tx) = (held.clone(), flags.clone(), done_tx.clone());
                let on_exit: OnExit = Box::new(move |control, slice| {
                    if slice <= ROUNDS * 2 && slice % 2 == 0 {
                        let outer = control.pause_all();
                        let inner = control.pause_all();
                        check(&held, &flags, Some(cpu));
                        drop(inner);
                        drop(outer);
                        if slice == ROUNDS * 2 {
                            done_tx.send(()).unwrap();
                        }
                    }
                });
                fake_vcpu(&control, cpu, false, None, on_exit)
            })
            .collect();
        flags.set(vcpus.iter().map(|v| v.in_guest.clone()).collect()).unwrap();
        {
            let (control, held, flags, done_tx) = (control.clone(), held.clone(), flags.clone(), done_tx.clone());
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    let paused = control.pause_all();
                    check(&held, &flags, None);
                    drop(paused);
                }
                done_tx.send(()).unwrap();
            });
        }
        for _ in 0..=VCPUS {
            if done_rx.recv_timeout(LIMIT).is_err() {
                control.stop(StopReason::Stopped);
                panic!("pausers did not all finish");
            }
        }
        control.stop(StopReason::Stopped);
        for v in vcpus {
            v.thread.join().unwrap();
        }
    }

    #[test]
    fn emulation_failure_bytes_are_decoded_from_the_exit_data() {
        let mut data = [0u64; 16];
        data[0] = 1;
        data[1] = u64::from_le_bytes([2, 0xcc, 0x90, 0, 0, 0, 0, 0]);
        assert_eq!(emulation_failure_bytes(3, &data), vec![0xcc, 0x90]);
        data[0] = 0;
        assert!(emulation_failure_bytes(3, &data).is_empty());
        assert!(emulation_failure_bytes(1, &data).is_empty());
    }
}
