//! Pausing, resuming and stopping all vCPUs of a VM.
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
//!
//! A pause has a deadline: a vCPU thread that is busy on the host (blocked writing the
//! guest's console to a stalled stdout, say) cannot be kicked out of that, so a pauser that
//! waits longer than [`DEFAULT_PAUSE_DEADLINE`] gives up, lets every vCPU run on, and
//! reports which vCPUs did not stop and what each was doing ([`PauseTimeout`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use hvprobe_arch::debugreg::DebugRegisters;
use kvm_bindings::kvm_regs;

use super::*;
use crate::devices::GuestEvent;
use crate::Error;

/// How to kick a vCPU out of `KVM_RUN`: `immediate_exit` in its `kvm_run` page, and its
/// thread.
#[derive(Clone, Copy)]
pub(super) struct Kick {
    pub(super) immediate_exit: *const AtomicU8,
    pub(super) thread: libc::pthread_t,
}

struct VcpuSlot {
    /// `None` when the vCPU thread is not in its loop (its `kvm_run` page may be gone).
    kick: Mutex<Option<Kick>>,
    /// What the thread does now, and since when (for a pause that waited too long).
    activity: Mutex<(VcpuActivity, Instant)>,
}

/// How long a pause waits for every vCPU to stop running guest code before it gives up.
/// A kicked vCPU leaves `KVM_RUN` within microseconds and parks at its next checkpoint;
/// seconds mean its thread is held on the host (by a blocked write, say).
pub const DEFAULT_PAUSE_DEADLINE: Duration = Duration::from_secs(10);

/// What a vCPU thread is doing while it counts as running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VcpuActivity {
    /// Entering or inside `KVM_RUN`.
    InGuest,
    /// Handling the guest's write to an I/O port (the serial console writes the guest's
    /// output to stdout here).
    PortWrite(u16),
    /// Handling the guest's read of an I/O port.
    PortRead(u16),
    /// Handling the guest's write to guest-physical MMIO.
    MmioWrite(u64),
    /// Handling the guest's read of guest-physical MMIO.
    MmioRead(u64),
    /// In the debug handler: a breakpoint, a single step or a guest event.
    DebugHandler,
    /// Handling another exit.
    OtherExit,
}

impl VcpuActivity {
    /// What handling `exit` is.
    pub(super) fn of(exit: &kvm_ioctls::VcpuExit<'_>) -> Self {
        use kvm_ioctls::VcpuExit;
        match exit {
            VcpuExit::IoOut(port, _) => VcpuActivity::PortWrite(*port),
            VcpuExit::IoIn(port, _) => VcpuActivity::PortRead(*port),
            VcpuExit::MmioWrite(addr, _) => VcpuActivity::MmioWrite(*addr),
            VcpuExit::MmioRead(addr, _) => VcpuActivity::MmioRead(*addr),
            VcpuExit::Debug(_) | VcpuExit::InternalError => VcpuActivity::DebugHandler,
            _ => VcpuActivity::OtherExit,
        }
    }
}

impl std::fmt::Display for VcpuActivity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VcpuActivity::InGuest => write!(f, "in KVM_RUN (kicked, not out yet)"),
            VcpuActivity::PortWrite(port) => write!(f, "handling its write to I/O port {port:#x}"),
            VcpuActivity::PortRead(port) => write!(f, "handling its read of I/O port {port:#x}"),
            VcpuActivity::MmioWrite(addr) => write!(f, "handling its MMIO write at {addr:#x}"),
            VcpuActivity::MmioRead(addr) => write!(f, "handling its MMIO read at {addr:#x}"),
            VcpuActivity::DebugHandler => write!(f, "in the debug handler (a breakpoint, step or guest event)"),
            VcpuActivity::OtherExit => write!(f, "handling an exit"),
        }
    }
}

/// A vCPU that did not stop for a pause: what it was doing, for how long.
#[derive(Clone, Debug)]
pub struct StuckVcpu {
    pub cpu: usize,
    pub activity: VcpuActivity,
    pub busy_for: Duration,
}

/// A pause gave up: these vCPUs did not stop running within the deadline. Every vCPU runs
/// on; nothing was changed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("the vCPUs did not stop for a pause within {:.1} s: {}", .waited.as_secs_f64(), describe_stuck(.stuck))]
pub struct PauseTimeout {
    pub waited: Duration,
    pub stuck: Vec<StuckVcpu>,
}

fn describe_stuck(stuck: &[StuckVcpu]) -> String {
    stuck
        .iter()
        .map(|s| format!("vCPU {} {} for {:.1} s", s.cpu, s.activity, s.busy_for.as_secs_f64()))
        .collect::<Vec<_>>()
        .join("; ")
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
    /// Where each vCPU left the guest when its thread left its loop (its RIP then).
    left_at: Vec<Option<u64>>,
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
    pub(super) first_entry: OnceLock<Instant>,
    /// When the guest signalled that its workload started.
    workload_started: OnceLock<Instant>,
    /// Stop the VM with [`StopReason::GuestReady`] when the guest signals event 3.
    pub(super) stop_at_ready: AtomicBool,
    /// How long [`VcpuControl::pause_all`] waits, in milliseconds.
    pause_deadline_ms: AtomicU64,
    /// The hardware breakpoints every vCPU loads before it next enters the guest, and
    /// their generation (bumped at each change; a vCPU compares it with what it loaded).
    debug_registers: Mutex<DebugRegisters>,
    debug_registers_generation: AtomicU64,
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
            slots: (0..vcpu_count)
                .map(|_| VcpuSlot {
                    kick: Mutex::new(None),
                    activity: Mutex::new((VcpuActivity::InGuest, Instant::now())),
                })
                .collect(),
            state: Mutex::new(ControlState {
                owner: None,
                depth: 0,
                owner_cpu: None,
                waiting: 0,
                phases: vec![Phase::NotStarted; vcpu_count],
                stop: None,
                parked_state: vec![None; vcpu_count],
                left_at: vec![None; vcpu_count],
            }),
            changed: Condvar::new(),
            request_pending: AtomicBool::new(false),
            started: OnceLock::new(),
            init_reached: OnceLock::new(),
            first_entry: OnceLock::new(),
            workload_started: OnceLock::new(),
            stop_at_ready: AtomicBool::new(false),
            pause_deadline_ms: AtomicU64::new(DEFAULT_PAUSE_DEADLINE.as_millis() as u64),
            debug_registers: Mutex::new(DebugRegisters::default()),
            debug_registers_generation: AtomicU64::new(0),
            counters: ExitCounters::default(),
        }))
    }

    /// Sets the hardware breakpoints of every vCPU: each loads them before it next enters
    /// the guest (restored and restarted vCPUs too). With the vCPUs paused, they are in
    /// effect on all of them before any runs again.
    pub fn set_debug_registers(&self, registers: DebugRegisters) {
        let mut current = self.debug_registers.lock().unwrap_or_else(|e| e.into_inner());
        *current = registers;
        self.debug_registers_generation.fetch_add(1, Ordering::SeqCst);
    }

    /// The hardware breakpoints the vCPUs are to load.
    pub fn debug_registers(&self) -> DebugRegisters {
        *self.debug_registers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The breakpoints and their generation, read together.
    pub(super) fn debug_registers_since(&self, loaded: u64) -> Option<(u64, DebugRegisters)> {
        // The common case, before every entry: nothing changed, no lock.
        if self.debug_registers_generation.load(Ordering::SeqCst) == loaded {
            return None;
        }
        let current = self.debug_registers.lock().unwrap_or_else(|e| e.into_inner());
        let generation = self.debug_registers_generation.load(Ordering::SeqCst);
        (generation != loaded).then_some((generation, *current))
    }

    pub fn vcpu_count(&self) -> usize {
        self.slots.len()
    }

    /// Sets how long a pause waits for the vCPUs ([`DEFAULT_PAUSE_DEADLINE`] until then).
    pub fn set_pause_deadline(&self, deadline: Duration) {
        let ms = u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX).max(1);
        self.pause_deadline_ms.store(ms, Ordering::Relaxed);
    }

    /// Records what vCPU `cpu`'s thread does from now on (the exit loop calls this).
    pub(super) fn set_activity(&self, cpu: usize, activity: VcpuActivity) {
        let mut slot = self.slots[cpu].activity.lock().unwrap_or_else(|e| e.into_inner());
        if slot.0 != activity {
            *slot = (activity, Instant::now());
        }
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
    /// while you hold a pause). Once it holds the pause it waits for the vCPUs at most the
    /// pause deadline; past it, it lets them all run on and says which did not stop.
    pub fn pause_all(self: &Arc<Self>) -> Result<PausedVcpus, PauseTimeout> {
        let me = CURRENT_VCPU.with(|c| c.get());
        let thread = std::thread::current().id();
        let mut st = self.lock();
        if st.owner == Some(thread) {
            st.depth += 1;
            return Ok(PausedVcpus {
                control: Arc::clone(self),
            });
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
        let waited_from = Instant::now();
        let deadline = waited_from + Duration::from_millis(self.pause_deadline_ms.load(Ordering::Relaxed));
        let mut st = self.lock();
        while st.phases.contains(&Phase::Running) {
            let now = Instant::now();
            if now >= deadline {
                let stuck = (0..st.phases.len())
                    .filter(|&cpu| st.phases[cpu] == Phase::Running)
                    .map(|cpu| {
                        let (activity, since) = *self.slots[cpu].activity.lock().unwrap_or_else(|e| e.into_inner());
                        StuckVcpu {
                            cpu,
                            activity,
                            busy_for: now.saturating_duration_since(since),
                        }
                    })
                    .collect();
                // Give the pause up as its guard's drop would: every vCPU runs on.
                st.depth = 1;
                drop(st);
                self.resume();
                self.counters.pause_timeouts.fetch_add(1, Ordering::Relaxed);
                return Err(PauseTimeout {
                    waited: now - waited_from,
                    stuck,
                });
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(PausedVcpus {
            control: Arc::clone(self),
        })
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
    pub(super) fn checkpoint(&self, cpu: usize, park: impl FnOnce() -> Option<VcpuState>) -> bool {
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
    pub(super) fn enter_vcpu_thread(self: &Arc<Self>, cpu: usize, kick: Option<Kick>) -> VcpuThread {
        CURRENT_VCPU.with(|c| c.set(Some(cpu)));
        *self.slots[cpu].kick.lock().unwrap_or_else(|e| e.into_inner()) = kick;
        // A pause taken before this (while the vCPU had not started) is safe: the first
        // checkpoint parks the vCPU before it enters the guest.
        let mut st = self.lock();
        st.phases[cpu] = Phase::Running;
        st.left_at[cpu] = None;
        drop(st);
        VcpuThread {
            control: Arc::clone(self),
            cpu,
        }
    }

    /// Records where vCPU `cpu` left the guest, as its thread leaves its loop.
    pub(super) fn left_guest_at(&self, cpu: usize, rip: u64) {
        self.lock().left_at[cpu] = Some(rip);
    }

    /// The index and RIP of every vCPU that ran, once the VM has stopped and every vCPU
    /// thread has left its loop (no vCPU runs guest code again); empty before.
    pub fn stopped_rips(&self) -> Vec<(usize, u64)> {
        let st = self.lock();
        let over = st.stop.is_some() && st.phases.iter().all(|p| matches!(p, Phase::Exited | Phase::NotStarted));
        if !over {
            return Vec::new();
        }
        st.left_at
            .iter()
            .enumerate()
            .filter_map(|(cpu, rip)| Some((cpu, (*rip)?)))
            .collect()
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

    pub(super) fn guest_event(&self, event: GuestEvent) {
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
pub(super) struct VcpuThread {
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
            let paused = control.pause_all().unwrap();
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

    /// Where the vCPUs left the guest is told only once the VM has stopped and every vCPU
    /// thread is out of its loop: before that a vCPU may still run (or run on after a
    /// pause), and what the engine settles from it would be counted twice.
    #[test]
    fn where_the_vcpus_left_the_guest_is_told_once_the_vm_stopped_for_good() {
        let control = VcpuControl::new(3).unwrap();
        control.mark_started();
        let leaves_at =
            |cpu: usize, rip: u64| -> OnExit { Box::new(move |control, _| control.left_guest_at(cpu, rip)) };
        let first = fake_vcpu(&control, 0, false, Some(1), leaves_at(0, 0x1000));
        first.thread.join().unwrap();
        assert_eq!(control.stopped_rips(), [], "the VM has not stopped");
        let second = fake_vcpu(&control, 1, true, None, leaves_at(1, 0x2000));
        wait_until("vCPU 1 is in the guest", || second.in_guest.load(Ordering::SeqCst));
        control.stop(StopReason::Stopped);
        assert_eq!(control.stopped_rips(), [], "vCPU 1 is still in the guest");
        second.hold.store(false, Ordering::SeqCst);
        second.thread.join().unwrap();
        // vCPU 2 never started: it left nowhere.
        assert_eq!(control.stopped_rips(), [(0, 0x1000), (1, 0x2000)]);
    }

    /// A vCPU held on the host (here: "handling a console write" that never ends) used to
    /// hold every pause, and so every tracer operation, for as long as it was held.
    #[test]
    fn a_pause_gives_up_at_its_deadline_naming_the_vcpu_that_did_not_stop_and_why() {
        let control = VcpuControl::new(2).unwrap();
        control.mark_started();
        control.set_pause_deadline(Duration::from_millis(200));
        let parks = fake_vcpu(&control, 0, false, None, nothing());
        let held = fake_vcpu(&control, 1, true, None, nothing());
        wait_until("vCPU 1 is in the guest", || held.in_guest.load(Ordering::SeqCst));
        control.set_activity(1, VcpuActivity::PortWrite(0x3f8));

        let started = Instant::now();
        let err = control.pause_all().err().expect("the pause did not give up");
        assert!(started.elapsed() < LIMIT, "it waited {:?}", started.elapsed());
        assert!(err.waited >= Duration::from_millis(200), "{err}");
        assert_eq!(err.stuck.len(), 1, "{err}");
        assert_eq!(err.stuck[0].cpu, 1);
        assert_eq!(err.stuck[0].activity, VcpuActivity::PortWrite(0x3f8));
        let message = err.to_string();
        assert!(
            message.contains("vCPU 1 handling its write to I/O port 0x3f8 for"),
            "{message}"
        );
        assert_eq!(control.counters.pause_timeouts.load(Ordering::Relaxed), 1);

        // Given up, the pause holds nothing: the vCPU that had parked runs on ...
        let before = parks.slices.load(Ordering::SeqCst);
        wait_until("vCPU 0 runs again", || parks.slices.load(Ordering::SeqCst) > before);
        // ... and once the held vCPU is free, a pause works as before.
        held.hold.store(false, Ordering::SeqCst);
        let paused = control.pause_all().expect("a pause once every vCPU can stop");
        let frozen = (parks.slices.load(Ordering::SeqCst), held.slices.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            (parks.slices.load(Ordering::SeqCst), held.slices.load(Ordering::SeqCst)),
            frozen,
            "a parked vCPU ran"
        );
        drop(paused);
        control.stop(StopReason::Stopped);
        parks.thread.join().unwrap();
        held.thread.join().unwrap();
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
                let paused = control.pause_all().unwrap();
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
                        let outer = control.pause_all().unwrap();
                        let inner = control.pause_all().unwrap();
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
                    let paused = control.pause_all().unwrap();
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
}
