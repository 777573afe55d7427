//! Delivering a guest-owned #BP: through KVM (kvm_pvm, user mode, unusual gates) or, on
//! hardware KVM, by the VMM itself without KVM's event injection.
//!
//! KVM delivers a re-injected #BP as a software exception: on SVM without next-RIP saving
//! (nested virtualization, some clouds) it skips the int3 with its instruction emulator,
//! which empties its exception queue. An interrupt pending at that entry was then injected
//! in the #BP's place (RIP already past the int3), and so was one pending when the #BP's
//! own delivery exited (a nested page fault on the IDT or the stack: KVM 6.1 re-queues the
//! #BP itself, out of our reach). The guest's boot-time int3 self-test died of it with
//! `invalid opcode`.
//!
//! So for the case that matters, an int3 in the kernel (CPL 0, 64-bit mode, an interrupt
//! or trap gate in the same code segment), the VMM does what the CPU does: it pushes the
//! 64-bit interrupt frame on the (IST) stack, clears the flags the gate clears and jumps to
//! the handler. Nothing is injected, so nothing can be lost. Anything else (user mode, a
//! gate that changes CS, an unmapped stack) goes back to KVM as a pending exception.

use hvprobe_arch::idt::{gate_address, Gate, GateKind, GATE_BYTES};
use hvprobe_arch::regs::{efer, rflags};
use hvprobe_arch::Gva;
use kvm_bindings::{kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::backend::Backend;
use crate::{kvm_err, Error};

const BP_VECTOR: u8 = 3;
/// Offset of IST1 in the 64-bit TSS.
const TSS_IST1: u64 = 0x24;

/// Where the #BP's gate descriptor is, for the caller to read.
pub(crate) fn bp_gate_address(sregs: &kvm_sregs) -> Option<u64> {
    let end = (u64::from(BP_VECTOR) + 1) * GATE_BYTES - 1;
    // The base is the guest's IDTR: gate_address wraps as the CPU's addressing does (a
    // read there then fails) rather than overflowing.
    (u64::from(sregs.idt.limit) >= end).then(|| gate_address(Gva(sregs.idt.base), BP_VECTOR).0)
}

/// Where IST entry `ist` (1..=7) of the TSS is, for the caller to read.
pub(crate) fn ist_address(sregs: &kvm_sregs, ist: u8) -> u64 {
    // The TSS base is the guest's, and so is `ist` (a gate's 3 bits, 1..=7 when called).
    sregs
        .tr
        .base
        .wrapping_add(TSS_IST1 + 8 * u64::from(ist.saturating_sub(1)))
}

/// What delivering the #BP of the int3 at `int3` does: the frame the CPU pushes (RIP, CS,
/// RFLAGS, RSP, SS, from its lowest address up) at `frame_at`, and the registers after.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BreakpointDelivery {
    pub frame_at: u64,
    pub frame: [u64; 5],
    pub rip: u64,
    pub rsp: u64,
    pub rflags: u64,
}

impl BreakpointDelivery {
    pub fn frame_bytes(&self) -> [u8; 40] {
        let mut bytes = [0u8; 40];
        for (slot, value) in bytes.chunks_exact_mut(8).zip(self.frame) {
            slot.copy_from_slice(&value.to_le_bytes());
        }
        bytes
    }
}

/// The delivery of the #BP for the int3 at `int3`, given the vCPU's registers, the #BP
/// gate's 16 bytes and a reader of the TSS's IST entries; `None` when it is not a case
/// done here (see the module's comment).
pub(crate) fn breakpoint_delivery(
    int3: u64,
    regs: &kvm_regs,
    sregs: &kvm_sregs,
    gate: [u8; 16],
    ist_stack: impl FnOnce(u8) -> Option<u64>,
) -> Option<BreakpointDelivery> {
    let long_mode = sregs.efer & efer::LMA != 0 && sregs.cs.l == 1;
    let cpl = sregs.cs.selector & 3;
    if !long_mode || cpl != 0 || regs.rip != int3 {
        return None;
    }
    let gate = Gate::decode(&gate);
    let kind = gate.usable()?;
    if gate.selector != sregs.cs.selector {
        return None;
    }
    let handler = gate.handler.0;
    let ist = gate.ist;
    let stack = if ist == 0 { regs.rsp } else { ist_stack(ist)? };
    // 64-bit mode aligns the new stack pointer to 16 bytes before it pushes the frame.
    let frame_at = (stack & !0xf).checked_sub(40)?;
    let mut flags = regs.rflags & !(rflags::TF | rflags::NT | rflags::RF | rflags::VM);
    if kind == GateKind::Interrupt {
        flags &= !rflags::IF;
    }
    Some(BreakpointDelivery {
        frame_at,
        frame: [
            int3.wrapping_add(1),
            u64::from(sregs.cs.selector),
            regs.rflags,
            regs.rsp,
            u64::from(sregs.ss.selector),
        ],
        rip: handler,
        rsp: frame_at,
        rflags: flags,
    })
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
        regs.rip = rip_after_int3(at);
        vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
    }
    // On hardware KVM the #BP is delivered as a software exception and KVM advances RIP
    // by the instruction length itself.
    queue_exception(vcpu, backend, BP_VECTOR, None)
}

/// Where a trap leaves RIP after the one-byte int3 at `at`: `at` is the guest's RIP, and
/// an int3 in its last byte wraps RIP as the CPU's own increment does (not a host panic).
fn rip_after_int3(at: Gva) -> u64 {
    at.0.wrapping_add(1)
}

const DB_VECTOR: u8 = 1;

/// Queues exception `vector` for the guest: pending (with `payload`, which KVM delivers as
/// the CPU would: DR6 for a #DB) where the VM has the exception payload capability
/// (hardware KVM, see [`Backend::reinjects_breakpoints_as_pending`]), else injected as is.
fn queue_exception(vcpu: &VcpuFd, backend: Backend, vector: u8, payload: Option<u64>) -> Result<(), Error> {
    let mut events = vcpu.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
    let pending = backend.reinjects_breakpoints_as_pending();
    let payload = payload.filter(|_| pending);
    events.exception.injected = u8::from(!pending);
    events.exception.pending = u8::from(pending);
    events.exception.nr = vector;
    events.exception.has_error_code = 0;
    events.exception.error_code = 0;
    events.exception_has_payload = u8::from(payload.is_some());
    events.exception_payload = payload.unwrap_or(0);
    // Without KVM_VCPUEVENT_VALID_PAYLOAD, KVM ignores `pending`.
    events.flags = if pending {
        kvm_bindings::KVM_VCPUEVENT_VALID_PAYLOAD
    } else {
        0
    };
    vcpu.set_vcpu_events(&events).map_err(kvm_err("KVM_SET_VCPU_EVENTS"))
}

/// DR6 bits that read 1 when clear (the SDM's "active low" bits): KVM reports DR6 as the
/// register reads, and takes a #DB's payload with them flipped.
const DR6_ACTIVE_LOW: u64 = 0xffff_0ff0;

/// Queues a #DB with the DR6 value `dr6` for the guest: one it raised itself while the
/// host's hardware breakpoints made KVM report every #DB to the VMM. With the exception
/// payload capability (hardware KVM) it is pending with DR6 as its payload, which KVM
/// writes into the guest's DR6 as the CPU would; without it, injected as is.
pub fn reinject_debug_exception(vcpu: &VcpuFd, backend: Backend, dr6: u64) -> Result<(), Error> {
    queue_exception(vcpu, backend, DB_VECTOR, Some(dr6 ^ DR6_ACTIVE_LOW))
}

/// Pushes the #BP frame for the kernel int3 at `at` and enters the guest's handler, as the
/// CPU does; false (nothing changed) when this is not a case for it or guest memory on the
/// way is not mapped.
fn deliver_breakpoint_in_place(vcpu: &VcpuFd, mem: &GuestMemoryMmap, at: Gva) -> Result<bool, Error> {
    let mut regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
    let sregs = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
    let Some(gate_at) = bp_gate_address(&sregs) else {
        return Ok(false);
    };
    let Some(gate) = read_virt::<16>(vcpu, mem, gate_at) else {
        return Ok(false);
    };
    let delivery = breakpoint_delivery(at.0, &regs, &sregs, gate, |ist| {
        read_virt::<8>(vcpu, mem, ist_address(&sregs, ist)).map(u64::from_le_bytes)
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

#[cfg(test)]
mod tests {
    use super::*;

    const CS: u16 = 0x10;
    const SS: u16 = 0x18;

    fn kernel(rip: u64, rsp: u64, rflags: u64) -> (kvm_regs, kvm_sregs) {
        let regs = kvm_regs {
            rip,
            rsp,
            rflags,
            ..Default::default()
        };
        let mut sregs = kvm_sregs {
            efer: efer::LMA | efer::LME,
            ..Default::default()
        };
        sregs.cs.selector = CS;
        sregs.cs.l = 1;
        sregs.ss.selector = SS;
        sregs.idt.base = 0xffff_fe00_0000_0000;
        sregs.idt.limit = 0xfff;
        sregs.tr.base = 0xffff_fe00_0000_3000;
        (regs, sregs)
    }

    /// The type nibbles of a 64-bit interrupt and trap gate.
    const GATE_INTERRUPT: u8 = 0xe;
    const GATE_TRAP: u8 = 0xf;

    fn gate(handler: u64, selector: u16, kind: u8, ist: u8) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[0..2].copy_from_slice(&(handler as u16).to_le_bytes());
        g[2..4].copy_from_slice(&selector.to_le_bytes());
        g[4] = ist;
        g[5] = 0x80 | (3 << 5) | kind;
        g[6..8].copy_from_slice(&((handler >> 16) as u16).to_le_bytes());
        g[8..12].copy_from_slice(&((handler >> 32) as u32).to_le_bytes());
        g
    }

    const INT3: u64 = 0xffff_ffff_8100_1234;
    const HANDLER: u64 = 0xffff_ffff_81a0_0bc0;

    #[test]
    fn an_interrupt_gate_pushes_the_64_bit_frame_on_the_aligned_stack_and_clears_if() {
        let (regs, sregs) = kernel(INT3, 0xffff_c900_0001_3f58, 0x246 | rflags::TF | rflags::RF);
        let d = breakpoint_delivery(INT3, &regs, &sregs, gate(HANDLER, CS, GATE_INTERRUPT, 0), |_| None).unwrap();
        assert_eq!(
            d.frame_at,
            0xffff_c900_0001_3f50 - 40,
            "aligned down to 16, then 5 slots"
        );
        assert_eq!(d.frame, [INT3 + 1, u64::from(CS), regs.rflags, regs.rsp, u64::from(SS)]);
        assert_eq!((d.rip, d.rsp), (HANDLER, d.frame_at));
        assert_eq!(d.rflags, 0x46, "IF, TF and RF cleared; the rest kept");
        assert_eq!(&d.frame_bytes()[..8], &(INT3 + 1).to_le_bytes());
    }

    #[test]
    fn a_trap_gate_keeps_if() {
        let (regs, sregs) = kernel(INT3, 0xffff_c900_0001_3f50, 0x246);
        let d = breakpoint_delivery(INT3, &regs, &sregs, gate(HANDLER, CS, GATE_TRAP, 0), |_| None).unwrap();
        assert_eq!(d.rflags, 0x246);
        assert_eq!(d.frame_at, 0xffff_c900_0001_3f50 - 40);
    }

    #[test]
    fn an_ist_gate_switches_to_the_ist_stack() {
        let (regs, sregs) = kernel(INT3, 0xffff_c900_0001_3f58, 0x246);
        let mut asked = None;
        let d = breakpoint_delivery(INT3, &regs, &sregs, gate(HANDLER, CS, GATE_INTERRUPT, 2), |ist| {
            asked = Some(ist);
            Some(0xffff_fe00_0000_8000)
        })
        .unwrap();
        assert_eq!(asked, Some(2));
        assert_eq!(d.frame_at, 0xffff_fe00_0000_8000 - 40);
        assert_eq!(d.frame[3], regs.rsp, "the interrupted stack pointer is saved");
        assert_eq!(ist_address(&sregs, 2), sregs.tr.base + 0x24 + 8);
    }

    #[test]
    fn what_is_not_a_kernel_int3_through_a_same_segment_gate_goes_to_kvm() {
        let (regs, sregs) = kernel(INT3, 0xffff_c900_0001_3f58, 0x246);
        let good = gate(HANDLER, CS, GATE_INTERRUPT, 0);
        let none = |_| None;
        assert!(breakpoint_delivery(INT3, &regs, &sregs, good, none).is_some());

        // The S bit set (a code or data descriptor where the gate should be): no gate, the
        // CPU would fault on it (the type nibble alone, 0xe, read as an interrupt gate).
        let mut not_a_gate = good;
        not_a_gate[5] |= 0x10;
        assert_eq!(
            breakpoint_delivery(INT3, &regs, &sregs, not_a_gate, none),
            None,
            "S bit"
        );

        let mut user = sregs;
        user.cs.selector = 0x33;
        assert_eq!(breakpoint_delivery(INT3, &regs, &user, good, none), None, "CPL 3");
        let mut compat = sregs;
        compat.cs.l = 0;
        assert_eq!(
            breakpoint_delivery(INT3, &regs, &compat, good, none),
            None,
            "not 64-bit code"
        );
        let mut absent = good;
        absent[5] &= 0x7f;
        assert_eq!(
            breakpoint_delivery(INT3, &regs, &sregs, absent, none),
            None,
            "gate not present"
        );
        let call_gate = gate(HANDLER, CS, 0xc, 0);
        assert_eq!(
            breakpoint_delivery(INT3, &regs, &sregs, call_gate, none),
            None,
            "not an interrupt gate"
        );
        let other_cs = gate(HANDLER, 0x8, GATE_INTERRUPT, 0);
        assert_eq!(
            breakpoint_delivery(INT3, &regs, &sregs, other_cs, none),
            None,
            "reloads CS"
        );
        assert_eq!(
            breakpoint_delivery(INT3 + 1, &regs, &sregs, good, none),
            None,
            "RIP not on the int3"
        );
        let ist = gate(HANDLER, CS, GATE_INTERRUPT, 1);
        assert_eq!(
            breakpoint_delivery(INT3, &regs, &sregs, ist, none),
            None,
            "unreadable IST"
        );
        let mut short_idt = sregs;
        short_idt.idt.limit = 3 * 16 + 14;
        assert_eq!(bp_gate_address(&short_idt), None, "vector 3 past the IDT's limit");
        assert_eq!(bp_gate_address(&sregs), Some(sregs.idt.base + 48));
    }

    /// The IDT and TSS bases and the int3's address are the guest's.
    /// Near 2^64 they overflowed (a panic in a debug build of the VMM).
    #[test]
    fn guest_bases_near_the_top_of_the_address_space_do_not_panic() {
        let (regs, mut sregs) = kernel(u64::MAX, 0xffff_c900_0000_8000, 0x202);
        sregs.idt.base = u64::MAX - 8;
        sregs.tr.base = u64::MAX - 8;
        assert_eq!(bp_gate_address(&sregs), Some((u64::MAX - 8).wrapping_add(48)));
        assert_eq!(ist_address(&sregs, 7), (u64::MAX - 8).wrapping_add(0x24 + 48));
        let d = breakpoint_delivery(
            u64::MAX,
            &regs,
            &sregs,
            gate(0xffff_ffff_8100_0000, CS, GATE_INTERRUPT, 0),
            |_| None,
        )
        .unwrap();
        assert_eq!(d.frame[0], 0, "the return address wraps as the CPU's RIP would");
    }

    /// The int3's address is the guest's RIP; kvm_pvm's reinjection
    /// moved it past the int3 with an unchecked sum.
    #[test]
    fn an_int3_at_the_top_of_the_address_space_is_stepped_past_without_a_panic() {
        assert_eq!(rip_after_int3(Gva(0xffff_ffff_8100_0000)), 0xffff_ffff_8100_0001);
        assert_eq!(rip_after_int3(Gva(u64::MAX)), 0, "RIP wraps as the CPU's does");
    }
}
