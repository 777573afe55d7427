//! The out-of-line step: a copy of the probed instruction in the out-of-line area runs
//! for one instruction with the guest's IF cleared, then the host puts RIP (and a pushed
//! return address or flags) back in the function. Two invariants:
//!
//! - The step ends at the instruction after the probe — or, when an exception or NMI was
//!   delivered instead of (or before) the copy, the guest's handler finds in its exception
//!   frame the probe address and the guest's own flags, never the copy with IF cleared
//!   (what Linux's kprobe fault handler does to `regs->ip` and the flags). The step runs
//!   on the step guard's IDT ([`step_guard`]), so that such a delivery comes to the host
//!   before the guest's handler runs; the guest's IDTR is back when the step ends.
//! - A slot is handed out again only once no vCPU is in it: every vCPU between its int3
//!   exit and its step exit has a pending step naming its slot, and a frame that pointed
//!   into a slot was sent back to the probe address when the step ended.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use hvprobe_arch::regs::rflags;
use hvprobe_arch::{Gva, INT3};

use super::site_jump::DETOUR_BLOCK;
use super::step_guard::{self, StepGuard, GUARD_BYTES, IDT_BYTES};
use super::{EngineFault, HitContext, OutOfLineArea, ProbeError, ProbeId, StepOutcome, Tracer, SLOT_SIZE};
use crate::insn::{self, OutOfLine, ProbedInsn};
use crate::machine::{InterruptTable, KernelMemory, PausedView, Vcpu, VcpuError};
use crate::regs::Regs;

/// The out-of-line area's slots: handed out from the start, and reused when freed.
/// Detours are handed out from the area's end, in blocks of [`DETOUR_BLOCK`] bytes.
pub(super) struct Slots {
    /// The area less the step guard's place at its end.
    area: Option<OutOfLineArea>,
    guard: Option<StepGuard>,
    next: u64,
    free: Vec<Gva>,
    /// Freed while a vCPU was still stepping in them: reusable once it is not.
    retired: Vec<Gva>,
    /// Detour blocks handed out from the end so far.
    detours: u64,
    /// Freed runs of detour blocks: (first block, number of blocks).
    free_detours: Vec<(Gva, u64)>,
}

impl Slots {
    pub fn new(area: Option<OutOfLineArea>) -> Self {
        let reserved = GUARD_BYTES.next_multiple_of(DETOUR_BLOCK);
        let (area, guard) = match area {
            Some(a) if a.size > reserved => (
                Some(OutOfLineArea {
                    size: a.size - reserved,
                    ..a
                }),
                Some(StepGuard {
                    base: Gva(a.start.0 + a.size - reserved),
                }),
            ),
            _ => (area, None),
        };
        Slots {
            area,
            guard,
            next: 0,
            free: Vec::new(),
            retired: Vec::new(),
            detours: 0,
            free_detours: Vec::new(),
        }
    }

    /// Whether `slots` instruction slots and `detours` detour blocks fit in the area.
    fn fits(area: &OutOfLineArea, slots: u64, detours: u64) -> bool {
        slots * SLOT_SIZE + detours * DETOUR_BLOCK <= area.size
    }
}

/// An out-of-line step in progress on one vCPU.
pub(super) struct PendingStep {
    /// The guest's IF before the step (cleared while stepping, put back after).
    saved_if: u64,
    insn: ProbedInsn,
    step: OutOfLine,
    slot: Gva,
    /// The int3's address.
    site: Gva,
    /// The guest's IDTR, put back when the step ends.
    guest_idt: InterruptTable,
    /// Probes whose post-handlers run after the step, if they are still registered and
    /// enabled then, with the address each reports.
    posts: Vec<(ProbeId, Gva)>,
}

pub(super) type PendingSteps = HashMap<usize, PendingStep>;

/// The fields of an x86-64 exception frame (what the CPU pushes when it delivers an
/// exception or interrupt in 64-bit mode), from the interrupted RIP on.
const FRAME_RIP: u64 = 0;
const FRAME_RFLAGS: u64 = 16;
const FRAME_RSP: u64 = 24;

impl Tracer {
    pub(super) fn has_out_of_line_area(&self) -> bool {
        self.ool.is_some()
    }

    /// A free slot of the out-of-line area.
    pub(super) fn allocate_slot(&self, what: &str) -> Result<Gva, ProbeError> {
        let stepping: Vec<Gva> = self.pending_slots();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let Some(area) = slots.area else {
            return Err(ProbeError::Unprobeable {
                what: what.to_string(),
                reason: "it needs the out-of-line area and there is none".into(),
            });
        };
        let (still_busy, reusable): (Vec<Gva>, Vec<Gva>) = slots.retired.drain(..).partition(|s| stepping.contains(s));
        slots.retired = still_busy;
        slots.free.extend(reusable);
        if let Some(slot) = slots.free.pop() {
            return Ok(slot);
        }
        if !Slots::fits(&area, slots.next + 1, slots.detours) {
            return Err(ProbeError::OutOfLineFull(slots.next));
        }
        let slot = Gva(area.start.0 + slots.next * SLOT_SIZE);
        slots.next += 1;
        Ok(slot)
    }

    /// Gives a slot back (with the vCPUs paused): free now if no vCPU is stepping in it,
    /// else once it is not.
    /// Retires a slot without a pause: it is reused once a pause finds no vCPU in it.
    pub(super) fn retire_slot_later(&self, slot: Gva) {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).retired.push(slot);
    }

    pub(super) fn retire_slot(&self, view: &dyn PausedView, slot: Gva) {
        let in_use = self.pending_slots().contains(&slot)
            || view
                .parked_rips()
                .iter()
                .any(|(_, rip)| (slot.0..slot.0 + SLOT_SIZE).contains(rip));
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if in_use {
            slots.retired.push(slot);
        } else {
            slots.free.push(slot);
        }
    }

    /// `blocks` contiguous free detour blocks (from the area's end), if there is room.
    pub(super) fn allocate_detour(&self, blocks: u64) -> Option<Gva> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let area = slots.area?;
        if let Some(i) = slots.free_detours.iter().position(|(_, n)| *n == blocks) {
            return Some(slots.free_detours.swap_remove(i).0);
        }
        if !Slots::fits(&area, slots.next, slots.detours + blocks) {
            return None;
        }
        slots.detours += blocks;
        Some(Gva(area.start.0 + area.size - slots.detours * DETOUR_BLOCK))
    }

    /// Gives `blocks` detour blocks back, once nothing can be in them.
    pub(super) fn free_detour(&self, first: Gva, blocks: u64) {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_detours
            .push((first, blocks));
    }

    /// Gives back a slot no copy was written to.
    pub(super) fn free_slot(&self, slot: Gva) {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).free.push(slot);
    }

    /// Slots a vCPU is stepping in right now.
    fn pending_slots(&self) -> Vec<Gva> {
        self.stepping
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|p| p.slot)
            .collect()
    }

    /// The return trampoline's address, writing it on first use.
    pub(super) fn make_trampoline(&self) -> Result<Gva, ProbeError> {
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

    /// The step guard (at the area's end, kept for it since the tracer was made), with its
    /// stubs written by the first site that may be stepped.
    pub(super) fn make_step_guard(&self, what: &str) -> Result<StepGuard, ProbeError> {
        if let Some(guard) = self.step_guard.get() {
            return Ok(*guard);
        }
        let Some(guard) = self.slots.lock().unwrap_or_else(|e| e.into_inner()).guard else {
            return Err(ProbeError::Unprobeable {
                what: what.to_string(),
                reason: "it needs the out-of-line area and there is none (or it is too small)".into(),
            });
        };
        self.machine
            .kernel()
            .write_virt(guard.stubs(), &StepGuard::stub_bytes())
            .map_err(|source| ProbeError::Memory {
                what: "the out-of-line step guard".into(),
                source,
            })?;
        Ok(*self.step_guard.get_or_init(|| guard))
    }

    /// Points the vCPU's IDTR at the step guard's IDT, built from the guest's current one
    /// (rebuilt only when the guest's changed); returns the guest's IDTR.
    fn arm_step_guard(&self, vcpu: &mut dyn Vcpu, guard: StepGuard) -> Result<InterruptTable, StepGuardError> {
        let guest_idt = vcpu.interrupt_table()?;
        let len = (u64::from(guest_idt.limit) + 1).min(IDT_BYTES) as usize;
        let mut bytes = vec![0u8; len];
        let kernel = self.machine.kernel();
        kernel.read_virt(guest_idt.base, &mut bytes)?;
        {
            let mut built_from = self.step_guard_built_from.lock().unwrap_or_else(|e| e.into_inner());
            if *built_from != bytes {
                kernel.write_virt(guard.idt(), &guard.idt_for(&bytes))?;
                *built_from = bytes;
            }
        }
        vcpu.set_interrupt_table(InterruptTable {
            base: guard.idt(),
            limit: guest_idt.limit,
        })?;
        Ok(guest_idt)
    }

    /// Sends the vCPU into the copy at `slot` for one step. If single-stepping cannot be
    /// switched on, the vCPU's registers are put back (it stays on the int3) and the VM
    /// stops: the copy never runs untrapped. (RIP moves into the copy before the step is
    /// switched on because hardware KVM arms its trap flag for the RIP it finds then.)
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_step(
        &self,
        cpu: usize,
        vcpu: &mut dyn Vcpu,
        regs: &mut Regs,
        insn: &ProbedInsn,
        (slot, step): (Gva, OutOfLine),
        site: Gva,
        posts: Vec<(ProbeId, Gva)>,
    ) -> Result<(), EngineFault> {
        let fault = |source| EngineFault::Vcpu { cpu, at: site, source };
        // Interrupts stay out of the step the way Linux keeps them out of its own: IF
        // cleared for one instruction. (KVM_GUESTDBG_BLOCKIRQ would do it too, but
        // toggling it flips a VM-wide APICv inhibit at every step.)
        let saved_if = regs.rflags & rflags::IF;
        let mut stepping = *regs;
        stepping.rflags &= !rflags::IF;
        stepping.rip = slot.0;
        let guard = self
            .step_guard
            .get()
            .copied()
            .ok_or(EngineFault::StepWithoutGuard { cpu, at: site })?;
        let guest_idt = self.arm_step_guard(vcpu, guard).map_err(|e| match e {
            StepGuardError::Vcpu(source) => fault(source),
            StepGuardError::Memory(source) => EngineFault::StepGuardMemory { cpu, at: site, source },
        })?;
        let started = vcpu.set_regs(&stepping).and_then(|()| vcpu.set_single_step(true));
        if let Err(e) = started {
            if let Err(back) = vcpu.set_regs(regs).and_then(|()| vcpu.set_interrupt_table(guest_idt)) {
                tracing::error!("vCPU {cpu}: putting the registers back after a failed step: {back}");
            }
            return Err(fault(e));
        }
        self.stats.stepped.fetch_add(1, Ordering::Relaxed);
        self.stepping.lock().unwrap_or_else(|e| e.into_inner()).insert(
            cpu,
            PendingStep {
                saved_if,
                insn: insn.clone(),
                step,
                slot,
                site,
                guest_idt,
                posts,
            },
        );
        Ok(())
    }

    pub(super) fn handle_single_step(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> StepOutcome {
        let Some(pending) = self.stepping.lock().unwrap_or_else(|e| e.into_inner()).remove(&cpu) else {
            return StepOutcome::NotOurs;
        };
        let regs = match vcpu.regs() {
            Ok(r) => r,
            Err(source) => {
                return StepOutcome::Fatal(EngineFault::Vcpu {
                    cpu,
                    at: pending.site,
                    source,
                })
            }
        };
        // kvm_pvm reports the step trap at the first instruction of the handler an
        // exception or NMI was delivered to: the guard's stub.
        if let Some(vector) = self.step_guard.get().and_then(|g| g.vector_at(Gva(regs.rip))) {
            return self.step_interrupted(cpu, vcpu, vector, regs, pending);
        }
        self.finish_step(cpu, vcpu, regs, pending)
    }

    /// An int3 exit at `at` in the out-of-line area: when it is the int3 right after the
    /// copy this vCPU is stepping, the copy ran to its end and the backend never reported
    /// the step's trap (kvm_pvm's emulator loses it after `mfence`, `lfence`, `sfence`,
    /// `serialize`, `swapgs` and `out`), so the step ends here as if it had. Only a copy
    /// that falls through can get there: a branch's copy leaves the slot.
    pub(super) fn step_trap_lost(&self, cpu: usize, vcpu: &mut dyn Vcpu, at: Gva) -> Option<StepOutcome> {
        let pending = {
            let mut stepping = self.stepping.lock().unwrap_or_else(|e| e.into_inner());
            let pending = stepping.get(&cpu)?;
            let falls_through = matches!(pending.step.kind, insn::StepKind::Plain | insn::StepKind::PushFlags);
            if !falls_through || pending.slot.0.checked_add(pending.insn.len as u64) != Some(at.0) {
                return None;
            }
            stepping.remove(&cpu)?
        };
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(source) => {
                return Some(StepOutcome::Fatal(EngineFault::Vcpu {
                    cpu,
                    at: pending.site,
                    source,
                }))
            }
        };
        // On the int3, unexecuted (kvm_pvm), or past it (a #BP trap): the copy's end either way.
        regs.rip = at.0;
        self.stats.step_traps_lost.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            "vCPU {cpu}: the step trap after the copy of {} never came; the step ends at the int3 after it",
            pending.site
        );
        Some(self.finish_step(cpu, vcpu, regs, pending))
    }

    /// The copy ran to its end (`regs` as it left them: RIP after the copy or at a branch's
    /// target): the registers and stack are put back in the function's terms, single-
    /// stepping and the step guard go, the post-handlers run.
    fn finish_step(&self, cpu: usize, vcpu: &mut dyn Vcpu, mut regs: Regs, pending: PendingStep) -> StepOutcome {
        let kernel = self.machine.kernel();
        let fault = |source| EngineFault::Vcpu {
            cpu,
            at: pending.site,
            source,
        };
        if let Err(source) = pending.put_back(&mut regs, kernel) {
            let _ = vcpu.set_single_step(false);
            let _ = vcpu.set_interrupt_table(pending.guest_idt);
            return StepOutcome::Fatal(EngineFault::Insn {
                cpu,
                at: pending.site,
                source: Box::new(source),
            });
        }
        regs.rflags = (regs.rflags & !rflags::IF) | pending.saved_if;
        if let Err(e) = vcpu
            .set_single_step(false)
            .and_then(|()| vcpu.set_interrupt_table(pending.guest_idt))
        {
            return StepOutcome::Fatal(fault(e));
        }
        self.run_posts(cpu, &pending.posts, &mut regs);
        match vcpu.set_regs(&regs) {
            Ok(()) => StepOutcome::Handled,
            Err(e) => StepOutcome::Fatal(fault(e)),
        }
    }

    /// Post-handlers of the probes that are still registered and enabled (a probe
    /// unregistered while this vCPU was parked mid-step runs nothing).
    pub(super) fn run_posts(&self, cpu: usize, posts: &[(ProbeId, Gva)], regs: &mut Regs) {
        if posts.is_empty() {
            return;
        }
        let reg = self.read_registry();
        let kernel = self.machine.kernel();
        for (id, address) in posts {
            let Some(post) = reg.probes.get(id).filter(|p| p.enabled).and_then(|p| p.post.as_ref()) else {
                continue;
            };
            let mut ctx = HitContext {
                probe: *id,
                cpu,
                address: *address,
                regs,
                kernel,
                data: &mut [],
            };
            post(&mut ctx);
        }
    }

    /// An int3 exit at `at`, one of the step guard's stubs: on hardware KVM the step trap
    /// does not stop at the handler an exception or NMI was delivered to, so the stub's
    /// int3 reports it.
    pub(super) fn step_guard_breakpoint(&self, cpu: usize, vcpu: &mut dyn Vcpu, at: Gva) -> Option<StepOutcome> {
        let vector = self.step_guard.get()?.vector_at(at)?;
        let pending = self.stepping.lock().unwrap_or_else(|e| e.into_inner()).remove(&cpu)?;
        let regs = match vcpu.regs() {
            Ok(r) => r,
            Err(source) => {
                return Some(StepOutcome::Fatal(EngineFault::Vcpu {
                    cpu,
                    at: pending.site,
                    source,
                }))
            }
        };
        Some(self.step_interrupted(cpu, vcpu, vector, regs, pending))
    }

    /// Exception or NMI `vector` was delivered during the step, through the guard's gate:
    /// its frame is where the guest's own gate would have put it. Either the copy raised it
    /// (or it came before the copy ran: frame RIP = the copy), and the frame is made to say
    /// the probe address, which the guest's handler returns to and which hits again, as in
    /// Linux; or it came after the copy completed, before the step's trap (frame RIP = the
    /// copy's end or a branch's target), and the frame is made to say where the instruction
    /// left off in the function, as a trap at the step's end would have, the post-handlers
    /// running once. The frame's flags become the guest's own (no TF, its IF), the guest's
    /// IDTR goes back, and the vCPU goes on in the guest's handler for `vector`.
    fn step_interrupted(
        &self,
        cpu: usize,
        vcpu: &mut dyn Vcpu,
        vector: u8,
        mut regs: Regs,
        pending: PendingStep,
    ) -> StepOutcome {
        let kernel = self.machine.kernel();
        let at = pending.site;
        let vcpu_fault = |source| StepOutcome::Fatal(EngineFault::Vcpu { cpu, at, source });
        // The step is over whatever follows: the vCPU must not go on with the guard's IDT.
        if let Err(e) = vcpu
            .set_single_step(false)
            .and_then(|()| vcpu.set_interrupt_table(pending.guest_idt))
        {
            return vcpu_fault(e);
        }
        // RSP is the guest's: addresses wrap as the CPU's would, and a frame there is then
        // unreadable (the guard's error) rather than an overflow.
        let frame = regs
            .rsp
            .wrapping_add(if step_guard::has_error_code(vector) { 8 } else { 0 });
        let guard_fault = |found: String| {
            StepOutcome::Fatal(EngineFault::StepGuard {
                cpu,
                at,
                vector,
                frame,
                found,
            })
        };
        let word = |offset: u64| kernel.read_u64(Gva(frame.wrapping_add(offset)));
        let (rip, flags, rsp) = match (word(FRAME_RIP), word(FRAME_RFLAGS), word(FRAME_RSP)) {
            (Ok(rip), Ok(flags), Ok(rsp)) => (rip, flags, rsp),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return guard_fault(format!("cannot be read: {e}")),
        };
        let flags = (flags & !(rflags::IF | rflags::TF)) | pending.saved_if;
        let resume_at = if rip == pending.slot.0 {
            at.0
        } else {
            // The instruction completed: its registers are the vCPU's, but for RIP, RSP and
            // RFLAGS, which the frame holds.
            let mut after = Regs {
                rip,
                rsp,
                rflags: flags,
                ..regs
            };
            let in_slot = (pending.slot.0..pending.slot.0.saturating_add(SLOT_SIZE)).contains(&rip);
            let after_copy = pending.slot.0.wrapping_add(pending.insn.len as u64);
            if in_slot && rip != after_copy {
                return guard_fault(format!(
                    "says RIP {rip:#x}, inside the out-of-line slot at {} but neither the copy's start nor its end",
                    pending.slot
                ));
            }
            if let Err(e) = pending.put_back(&mut after, kernel) {
                return guard_fault(format!(
                    "says RIP {rip:#x}, after the copy at {}, but {e}",
                    pending.slot
                ));
            }
            self.run_posts(cpu, &pending.posts, &mut after);
            // A post-handler's general registers go to the vCPU; RIP, RSP and RFLAGS are the
            // frame's, which the guest's handler returns to.
            regs = Regs {
                rip: regs.rip,
                rsp: regs.rsp,
                rflags: regs.rflags,
                cs: regs.cs,
                ss: regs.ss,
                ..after
            };
            after.rip
        };
        let mut gate = [0u8; 16];
        let rewritten = kernel
            .write_virt(Gva(frame.wrapping_add(FRAME_RIP)), &resume_at.to_le_bytes())
            .and_then(|()| kernel.write_virt(Gva(frame.wrapping_add(FRAME_RFLAGS)), &flags.to_le_bytes()))
            .and_then(|()| kernel.read_virt(step_guard::gate_address(pending.guest_idt.base, vector), &mut gate));
        if let Err(e) = rewritten {
            return guard_fault(format!("cannot be rewritten: {e}"));
        }
        regs.rip = step_guard::gate_handler(&gate).0;
        if let Err(e) = vcpu.set_regs(&regs) {
            return vcpu_fault(e);
        }
        self.stats.steps_interrupted.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            "vCPU {cpu}: vector {vector} during the out-of-line step of {at}: its handler returns to {resume_at:#x}"
        );
        StepOutcome::Handled
    }
}

impl PendingStep {
    /// `regs` as the completed copy left them (RIP after it, or at a branch's target), put
    /// in the function's terms: RIP or a call's pushed return address the function's, and a
    /// `pushf`'s word without our TF and with the guest's IF (the step ran with IF cleared).
    fn put_back(&self, regs: &mut Regs, kernel: &dyn KernelMemory) -> Result<(), insn::InsnError> {
        let mut stack = super::KernelStack(kernel);
        self.step.fixup_after_step(&self.insn, self.slot, regs, &mut stack)?;
        if self.step.kind != insn::StepKind::PushFlags {
            return Ok(());
        }
        let at = Gva(regs.rsp);
        insn::StackAccess::read_u64(&mut stack, at)
            .map(|w| (w & !rflags::IF) | self.saved_if)
            .and_then(|w| insn::StackAccess::write_u64(&mut stack, at, w))
            .map_err(|source| insn::InsnError::Stack {
                addr: self.insn.addr,
                bytes: insn::HexBytes(self.insn.bytes.clone()),
                at,
                source,
            })
    }
}

/// Why the step guard could not be armed.
#[derive(Debug, thiserror::Error)]
enum StepGuardError {
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Memory(#[from] hvprobe_introspection::memory::MemoryError),
}
