//! The out-of-line step: a copy of the probed instruction in the out-of-line area runs
//! for one instruction with the guest's IF cleared, then the host puts RIP (and a pushed
//! return address or flags) back in the function. Two invariants:
//!
//! - The step ends at the instruction after the probe — or, when an exception or NMI was
//!   delivered instead of (or before) the copy, the guest's handler finds in its exception
//!   frame the probe address and the guest's own flags, never the copy with IF cleared
//!   (what Linux's kprobe fault handler does to `regs->ip` and the flags).
//! - A slot is handed out again only once no vCPU is in it: every vCPU between its int3
//!   exit and its step exit has a pending step naming its slot, and a frame that pointed
//!   into a slot was sent back to the probe address when the step ended.

use std::collections::HashMap;

use hvprobe_arch::regs::rflags;
use hvprobe_arch::{Gva, INT3};

use super::optimize::DETOUR_BLOCK;
use super::{EngineFault, HitContext, OutOfLineArea, ProbeError, ProbeId, StepOutcome, Tracer, COUNT, SLOT_SIZE};
use crate::insn::{self, OutOfLine, ProbedInsn, StepFixup};
use crate::machine::{KernelMemory, PausedView, Vcpu};
use crate::regs::Regs;

/// The out-of-line area's slots: handed out from the start, and reused when freed.
/// Detours are handed out from the area's end, in blocks of [`DETOUR_BLOCK`] bytes.
pub(super) struct Slots {
    area: Option<OutOfLineArea>,
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
        Slots {
            area,
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
    /// Probes whose post-handlers run after the step, if they are still registered and
    /// enabled then, with the address each reports.
    posts: Vec<(ProbeId, Gva)>,
}

pub(super) type PendingSteps = HashMap<usize, PendingStep>;

/// The fields of an x86-64 exception frame (what the CPU pushes when it delivers an
/// exception or interrupt in 64-bit mode), from the interrupted RIP on.
const FRAME_RIP: u64 = 0;
const FRAME_CS: u64 = 8;
const FRAME_RFLAGS: u64 = 16;

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
        vcpu.set_regs(&stepping).map_err(fault)?;
        if let Err(e) = vcpu.set_single_step(true) {
            if let Err(back) = vcpu.set_regs(regs) {
                tracing::error!("vCPU {cpu}: putting the registers back after a failed step: {back}");
            }
            return Err(fault(e));
        }
        self.stats.stepped.fetch_add(1, COUNT);
        self.stepping.lock().unwrap_or_else(|e| e.into_inner()).insert(
            cpu,
            PendingStep {
                saved_if,
                insn: insn.clone(),
                step,
                slot,
                site,
                posts,
            },
        );
        Ok(())
    }

    pub(super) fn handle_single_step(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> StepOutcome {
        let Some(pending) = self.stepping.lock().unwrap_or_else(|e| e.into_inner()).remove(&cpu) else {
            return StepOutcome::NotOurs;
        };
        let kernel = self.machine.kernel();
        let fault = |source| EngineFault::Vcpu {
            cpu,
            at: pending.site,
            source,
        };
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(e) => return StepOutcome::Fatal(fault(e)),
        };
        let after_copy = pending.slot.0 + pending.insn.len as u64;
        let ended_normally =
            regs.rip == after_copy || (pending.step.kind == insn::StepKind::RepString && regs.rip == pending.slot.0);
        if !ended_normally && self.send_handler_back(kernel, &regs, &pending) {
            // An exception or NMI was delivered instead: the guest's handler runs on, and
            // returns to the probe (which hits again, as in Linux).
            self.stats.steps_interrupted.fetch_add(1, COUNT);
            return match vcpu.set_single_step(false) {
                Ok(()) => StepOutcome::Handled,
                Err(e) => StepOutcome::Fatal(fault(e)),
            };
        }
        let fixup =
            pending
                .step
                .fixup_after_step(&pending.insn, pending.slot, &mut regs, &mut super::KernelStack(kernel));
        match fixup {
            Ok(StepFixup::StepAgain) => {
                self.stepping
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(cpu, pending);
                return StepOutcome::Handled;
            }
            Ok(StepFixup::Done) => {}
            Err(source) => {
                let _ = vcpu.set_single_step(false);
                return StepOutcome::Fatal(EngineFault::Insn {
                    cpu,
                    at: pending.site,
                    source: Box::new(source),
                });
            }
        }
        regs.rflags = (regs.rflags & !rflags::IF) | pending.saved_if;
        if pending.step.kind == insn::StepKind::PushFlags {
            let mut stack = super::KernelStack(kernel);
            let pushed = insn::StackAccess::read_u64(&mut stack, Gva(regs.rsp))
                .map(|w| (w & !rflags::IF) | pending.saved_if)
                .and_then(|w| insn::StackAccess::write_u64(&mut stack, Gva(regs.rsp), w));
            if let Err(source) = pushed {
                let _ = vcpu.set_single_step(false);
                return StepOutcome::Fatal(EngineFault::Insn {
                    cpu,
                    at: pending.site,
                    source: Box::new(insn::InsnError::Stack {
                        addr: pending.insn.addr,
                        bytes: insn::HexBytes(pending.insn.bytes.clone()),
                        at: Gva(regs.rsp),
                        source,
                    }),
                });
            }
        }
        if let Err(e) = vcpu.set_single_step(false) {
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

    /// When the step exit finds the vCPU elsewhere than after the copy: if an exception
    /// frame on the stack says the copy was interrupted (its RIP is the slot, its CS the
    /// kernel's), make the handler return to the probe address with the guest's own IF
    /// and no TF. Returns whether it found and fixed such a frame.
    fn send_handler_back(&self, kernel: &dyn KernelMemory, regs: &Regs, pending: &PendingStep) -> bool {
        // With an error code the frame starts one word higher.
        for frame in [regs.rsp, regs.rsp.wrapping_add(8)] {
            let word = |off: u64| kernel.read_u64(Gva(frame.wrapping_add(off))).ok();
            let (Some(rip), Some(cs), Some(rflags)) = (word(FRAME_RIP), word(FRAME_CS), word(FRAME_RFLAGS)) else {
                continue;
            };
            let kernel_cs = cs != 0 && cs < 0x10000 && cs & 3 == 0;
            if rip != pending.slot.0 || !kernel_cs {
                continue;
            }
            let rflags = (rflags & !(rflags::IF | rflags::TF)) | pending.saved_if;
            let rewritten = kernel
                .write_virt(Gva(frame + FRAME_RIP), &pending.site.0.to_le_bytes())
                .and_then(|()| kernel.write_virt(Gva(frame + FRAME_RFLAGS), &rflags.to_le_bytes()));
            return match rewritten {
                Ok(()) => {
                    tracing::debug!(
                        "the out-of-line step of {} was interrupted: the handler returns to the probe",
                        pending.site
                    );
                    true
                }
                Err(e) => {
                    tracing::error!("fixing the exception frame at {frame:#x}: {e}");
                    false
                }
            };
        }
        false
    }
}
