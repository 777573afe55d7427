//! One vCPU thread's exit loop: KVM_RUN, each exit handled (I/O to the devices,
//! breakpoints and single steps to the [`DebugHandler`], kvm_pvm's emulation failures
//! completed), checkpoints for pauses.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hvprobe_arch::debugreg::{dr7_enables_any, Access, HARDWARE_BREAKPOINTS};
use hvprobe_arch::{Gva, INT3};
use kvm_bindings::{KVM_INTERNAL_ERROR_EMULATION, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::control::VcpuActivity;
use super::exit_regs;
use super::*;
use crate::backend::Backend;
use crate::breakpoint::{reinject_breakpoint, reinject_debug_exception};
use crate::devices::{GuestEvent, IoAction, PortDevices};
use crate::layout::{OOL_AREA_START, OOL_CODE_SIZE};
use crate::stats::VcpuStats;
use crate::virtio::MmioDevices;
use crate::{kvm_err, Error};

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
    /// Pauses that gave up because a vCPU did not stop within the deadline.
    pub pause_timeouts: AtomicU64,
    /// Hardware breakpoints (debug registers the host set) that fired and a handler took.
    pub hardware_breakpoints: AtomicU64,
    /// #DBs the guest raised itself that KVM reported here while hardware breakpoints were
    /// loaded, given back to it.
    pub debug_exceptions_reinjected: AtomicU64,
    /// Loads of the host's hardware breakpoints into a vCPU whose guest had its own
    /// enabled (kgdb, hw_breakpoint, perf's breakpoint events): the guest's do not fire
    /// while the host's are loaded.
    pub guest_debug_registers_hidden: AtomicU64,
    /// Guest writes into the out-of-line area's code half, which its read-only memory slot
    /// turned into MMIO exits: dropped.
    pub ool_writes_refused: AtomicU64,
}

/// Everything one vCPU thread needs.
pub struct VcpuRunner {
    pub cpu: usize,
    pub vcpu: VcpuFd,
    pub backend: Backend,
    pub control: Arc<VcpuControl>,
    pub devices: Arc<PortDevices>,
    pub virtio: Arc<MmioDevices>,
    pub debug: Arc<dyn DebugHandler>,
    pub mem: GuestMemoryMmap,
    /// Registers at exits through kvm_run's sync area ([`exit_regs`]) instead of ioctls.
    pub sync_regs: bool,
    /// The segment and control registers there too.
    pub sync_sregs: bool,
    /// The generation of the VM's hardware breakpoints this vCPU loaded (0: none yet).
    pub(crate) loaded_debug_registers: u64,
    /// An execution breakpoint's instruction is being stepped with the breakpoints off.
    pub(crate) stepping_over_breakpoint: bool,
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
        // Whoever has the vCPU next (a snapshot, a restart) reads its registers by ioctl,
        // also after a panic in the loop.
        if let Err(e) = exit_regs::disable(&mut self.vcpu) {
            self.control.stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: format!("handing the registers to KVM at the end of the run: {e}"),
            });
        }
        // Where the guest stopped on this vCPU: the probe engine settles what a hit in
        // progress there had counted (see `VcpuControl::stopped_rips`).
        match self.vcpu.get_regs() {
            Ok(regs) => self.control.left_guest_at(self.cpu, regs.rip),
            Err(e) => tracing::debug!("vCPU {}: no registers at the end of the run: {e}", self.cpu),
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
        if self.sync_regs {
            if let Err(e) = exit_regs::enable(&mut self.vcpu, self.sync_sregs) {
                tracing::warn!("vCPU {}: registers by ioctl at every exit: {e}", self.cpu);
            }
        }
        let control = Arc::clone(&self.control);

        loop {
            // SAFETY: `immediate_exit` points into this vCPU's kvm_run page, alive as long
            // as `self.vcpu`.
            unsafe { (*immediate_exit).store(0, Ordering::SeqCst) };
            if !control.checkpoint(self.cpu, || self.park()) {
                break;
            }
            if let Err(reason) = self.load_debug_registers() {
                self.control.stop(reason);
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
    fn park(&mut self) -> Option<VcpuState> {
        // A paused vCPU's registers are read by ioctl.
        if let Err(e) = exit_regs::flush(&mut self.vcpu) {
            tracing::error!("vCPU {}: parked with its registers unread: {e}", self.cpu);
            return None;
        }
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
        self.control.set_activity(cpu, VcpuActivity::InGuest);
        let exit = self.vcpu.run();
        if let Ok(exit) = &exit {
            self.control.set_activity(cpu, VcpuActivity::of(exit));
        }
        let exit = match exit {
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
            VcpuExit::MmioWrite(addr, data) if self.virtio.write(addr, data) => Next::Continue,
            VcpuExit::MmioRead(addr, data) => {
                if !self.virtio.read(addr, data) {
                    tracing::debug!("vCPU {cpu}: read of unbacked guest-physical {addr:#x}");
                    data.fill(0xff);
                }
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
                let (exception, pc, dr6) = (arch.exception, arch.pc, arch.dr6);
                if exception == 3 {
                    return self.breakpoint(Gva(pc));
                }
                if exception == 1 && self.stepping_over_breakpoint {
                    return self.end_step_over();
                }
                let fired = handler::loaded_hardware_breakpoints()
                    .fired(dr6)
                    .fold(0u8, |mask, slot| mask | 1 << slot);
                if exception == 1 && fired != 0 {
                    let next = self.hardware_breakpoint(Gva(pc), fired);
                    // A data breakpoint on the instruction a single step ran: the step
                    // ended too, and is handled below.
                    if dr6 & DR6_SINGLE_STEP == 0 || matches!(next, Next::Stop(_)) {
                        return next;
                    }
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
                } else if exception == 1 && !handler::single_stepping() {
                    // The guest's own #DB (its own single step, `int1`, ...): while hardware
                    // breakpoints are loaded KVM reports every #DB here, not to the guest.
                    self.reinject_debug(dr6 & !u64::from(fired))
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
        let rip = exit_regs::read(&mut self.vcpu).map(|r| r.rip).ok();
        let cr3 = exit_regs::read_sregs(&mut self.vcpu).map(|s| s.cr3).ok();
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
        let (suberror, ndata, data) = {
            let run = self.vcpu.get_kvm_run();
            // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, whose data is the union's
            // `internal` member; `emulation_failure` overlays it for the emulation suberror.
            let internal = unsafe { run.__bindgen_anon_1.internal };
            (internal.suberror, internal.ndata, internal.data)
        };
        let rip = match exit_regs::read(&mut self.vcpu) {
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
            return match complete_fwait(&mut self.vcpu, rip) {
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

    /// Loads the VM's hardware breakpoints when they changed since this vCPU last did.
    fn load_debug_registers(&mut self) -> Result<(), StopReason> {
        let Some((generation, registers)) = self.control.debug_registers_since(self.loaded_debug_registers) else {
            return Ok(());
        };
        let fail = |what: &str, e: &dyn std::fmt::Display| StopReason::VcpuError {
            cpu: self.cpu,
            message: format!("{what}: {e}"),
        };
        if !registers.is_empty() {
            // The guest's own DR7, as it set it (KVM keeps it apart from ours).
            let guest = self.vcpu.get_debug_regs().map_err(|e| fail("KVM_GET_DEBUGREGS", &e))?;
            if dr7_enables_any(guest.dr7) {
                let n = self
                    .control
                    .counters
                    .guest_debug_registers_hidden
                    .fetch_add(1, Ordering::Relaxed);
                if n == 0 {
                    tracing::warn!(
                        "vCPU {}: the guest has debug registers of its own enabled (DR7 {:#x}: kgdb, \
                         hw_breakpoint or perf breakpoints); they do not fire while hvprobe's are set",
                        self.cpu,
                        guest.dr7
                    );
                }
            }
        }
        exit_regs::flush_regs(&mut self.vcpu).map_err(|e| fail("handing the registers to KVM", &e))?;
        handler::load_hardware_breakpoints(&self.vcpu, self.backend, registers)
            .map_err(|e| fail("loading the hardware breakpoints", &e))?;
        self.loaded_debug_registers = generation;
        Ok(())
    }

    /// Hardware breakpoints `fired` (a mask of slots) at `pc`: the handler's, then an
    /// execution breakpoint's instruction runs once (the handler may have moved RIP
    /// elsewhere: then nothing is to pass).
    fn hardware_breakpoint(&mut self, pc: Gva, fired: u8) -> Next {
        let taken = match self.call_handler(|debug, cpu, vcpu| debug.on_hardware_breakpoint(cpu, vcpu, pc, fired)) {
            Ok(taken) => taken,
            Err(reason) => return Next::Stop(reason),
        };
        if !taken {
            return Next::Stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: format!("hardware breakpoints {fired:#06b} fired at {pc} and no handler took them"),
            });
        }
        self.control
            .counters
            .hardware_breakpoints
            .fetch_add(1, Ordering::Relaxed);
        let loaded = handler::loaded_hardware_breakpoints();
        let execute_here = (0..HARDWARE_BREAKPOINTS)
            .filter(|slot| fired & (1 << slot) != 0)
            .filter_map(|slot| loaded.get(slot))
            .any(|bp| bp.access() == Access::Execute && bp.address() == pc);
        if !execute_here {
            return Next::Continue;
        }
        let passed = exit_regs::read(&mut self.vcpu).and_then(|mut regs| {
            if regs.rip != pc.0 {
                return Ok(());
            }
            if self.backend.honours_resume_flag() {
                regs.rflags |= RFLAGS_RF;
                return exit_regs::write(&mut self.vcpu, &regs);
            }
            // KVM_SET_GUEST_DEBUG notes the RIP a step starts from.
            exit_regs::flush_regs(&mut self.vcpu)?;
            handler::step_over_breakpoints(&self.vcpu, self.backend, true)?;
            self.stepping_over_breakpoint = true;
            Ok(())
        });
        match passed {
            Ok(()) => Next::Continue,
            Err(e) => Next::Stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: format!("passing the execution breakpoint at {pc}: {e}"),
            }),
        }
    }

    /// Gives the guest a #DB it raised itself, with the DR6 bits it would have seen (those
    /// of our breakpoints taken out).
    fn reinject_debug(&mut self, dr6: u64) -> Next {
        self.control
            .counters
            .debug_exceptions_reinjected
            .fetch_add(1, Ordering::Relaxed);
        let flushed = exit_regs::flush(&mut self.vcpu);
        match flushed.and_then(|()| reinject_debug_exception(&self.vcpu, self.backend, dr6)) {
            Ok(()) => Next::Continue,
            Err(e) => Next::Stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: format!("re-injecting #DB: {e}"),
            }),
        }
    }

    /// The step over an execution breakpoint's instruction ended: the breakpoints again.
    fn end_step_over(&mut self) -> Next {
        self.stepping_over_breakpoint = false;
        match handler::step_over_breakpoints(&self.vcpu, self.backend, false) {
            Ok(()) => Next::Continue,
            Err(e) => Next::Stop(StopReason::VcpuError {
                cpu: self.cpu,
                message: format!("restoring the hardware breakpoints after a step: {e}"),
            }),
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
                // The re-injection reads and writes the registers by ioctl.
                let flushed = exit_regs::flush(&mut self.vcpu);
                match flushed.and_then(|()| reinject_breakpoint(&self.vcpu, &self.mem, self.backend, at)) {
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

/// DR6.BS: the #DB is a single step's.
const DR6_SINGLE_STEP: u64 = 1 << 14;

/// RFLAGS.RF: the next instruction's execution breakpoints do not fire.
const RFLAGS_RF: u64 = 1 << 16;

/// The out-of-line area's code half, guest-physical: read-only to the guest (see
/// `register_guest_memory`), so a guest write there exits as MMIO.
const OOL_CODE: std::ops::Range<u64> = OOL_AREA_START.0..OOL_AREA_START.0 + OOL_CODE_SIZE;
/// How many refused writes into it are logged one by one (all are counted).
const OOL_WRITES_LOGGED: u64 = 8;

/// `fwait`/`wait`: KVM's emulator has no case for it, and Linux executes one in
/// `fpu__drop()` on every exec and exit.
const FWAIT: u8 = 0x9b;
const X87_FSW_ES: u16 = 1 << 7;
const MF_VECTOR: u8 = 16;

/// Completes an `fwait` the emulator refused, as the CPU would: with no unmasked x87
/// exception pending it does nothing; with one, it raises #MF.
fn complete_fwait(vcpu: &mut VcpuFd, rip: u64) -> Result<(), Error> {
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
    let mut regs = exit_regs::read(vcpu)?;
    // The guest's RIP: an fwait at the last byte of the address space wraps, as the CPU's.
    regs.rip = rip.wrapping_add(1);
    exit_regs::write(vcpu, &regs)
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
