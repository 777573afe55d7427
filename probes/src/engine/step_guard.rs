//! The step guard: the IDT a vCPU runs on for the one instruction of an out-of-line step.
//!
//! An exception the copy raises (or an NMI that comes at it) must reach the guest's handler
//! with the probe address in its frame, never the copy's, or the guest's fixup lookup and
//! its oops report see an address it does not know. kvm_pvm's emulator reports the step
//! trap at the handler's first instruction, but hardware KVM does not stop there: the CPU
//! delivers the exception through the guest's IDT, clears TF, and the handler runs to its
//! end before the host hears of it.
//!
//! So while the copy runs, the vCPU's IDTR points at a copy of the guest's IDT whose every
//! present gate keeps its type, selector and IST but leads to a one-byte int3 stub of its
//! own vector, in the out-of-line area. The CPU pushes the frame exactly where the guest's
//! gate would have (same stack, same IST, same flags cleared); the stub's int3 exits (or,
//! on kvm_pvm, the step trap reports the stub), and the host rewrites the frame and sends
//! the vCPU on into the guest's own handler, with the guest's IDTR back.

pub(super) use hvprobe_arch::idt::gate_address;
use hvprobe_arch::idt::{set_handler, Gate, GATE_BYTES};
use hvprobe_arch::{Gva, INT3};

/// A 64-bit IDT's size: 256 gates of 16 bytes.
pub(super) const IDT_BYTES: u64 = 256 * GATE_BYTES;
/// The guard's bytes in the out-of-line area: its IDT, then one int3 per vector.
pub(super) const GUARD_BYTES: u64 = IDT_BYTES + 256;

/// Where the guard lives: its IDT at `base`, the stub of vector `v` at `base + 4096 + v`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepGuard {
    pub base: Gva,
}

impl StepGuard {
    pub fn idt(&self) -> Gva {
        self.base
    }

    /// Where the int3 stubs are, one per vector.
    pub fn stubs(&self) -> Gva {
        Gva(self.base.0 + IDT_BYTES)
    }

    /// The stubs' bytes.
    pub fn stub_bytes() -> [u8; 256] {
        [INT3; 256]
    }

    /// The vector whose stub is at `at`, if `at` is one.
    pub fn vector_at(&self, at: Gva) -> Option<u8> {
        let offset = at.0.checked_sub(self.stubs().0)?;
        u8::try_from(offset).ok()
    }

    /// The guard's IDT for the guest's `idt` (its bytes up to its limit): each present
    /// 64-bit interrupt or trap gate leads to its vector's stub, everything else (a gate
    /// not present, a task or call gate) is copied as it is, so that the CPU faults on it
    /// as it would on the guest's own.
    pub fn idt_for(&self, guest_idt: &[u8]) -> Vec<u8> {
        let mut idt = guest_idt.to_vec();
        for (vector, gate) in idt.chunks_exact_mut(GATE_BYTES as usize).enumerate() {
            let bytes: &[u8; 16] = (&*gate).try_into().expect("chunks of a gate's size");
            if Gate::decode(bytes).usable().is_none() {
                continue;
            }
            set_handler(gate, Gva(self.stubs().0 + vector as u64));
        }
        idt
    }
}

/// The handler a 64-bit gate leads to.
pub(super) fn gate_handler(gate: &[u8; 16]) -> Gva {
    Gate::decode(gate).handler
}

/// Whether the CPU pushes an error code when it delivers `vector` (#DF, #TS, #NP, #SS, #GP,
/// #PF, #AC, #CP, #VC, #SX): the frame then starts one word above it.
pub(super) fn has_error_code(vector: u8) -> bool {
    matches!(vector, 8 | 10..=14 | 17 | 21 | 29 | 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GUARD: StepGuard = StepGuard {
        base: Gva(0xffff_ffff_8240_0000),
    };

    fn gate(handler: u64, ist: u8, type_attr: u8) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[0..2].copy_from_slice(&(handler as u16).to_le_bytes());
        g[2..4].copy_from_slice(&0x10u16.to_le_bytes());
        g[4] = ist;
        g[5] = type_attr;
        g[6..8].copy_from_slice(&((handler >> 16) as u16).to_le_bytes());
        g[8..12].copy_from_slice(&((handler >> 32) as u32).to_le_bytes());
        g
    }

    #[test]
    fn present_gates_lead_to_their_vectors_stub_and_keep_everything_else() {
        let mut guest = Vec::new();
        guest.extend(gate(0xffff_ffff_81a0_0000, 0, 0x8e)); // #DE, interrupt gate
        guest.extend(gate(0xffff_ffff_81a0_0100, 3, 0x8e)); // #DB on IST 3
        guest.extend(gate(0xffff_ffff_81a0_0200, 0, 0xef)); // a DPL 3 trap gate
        guest.extend([0u8; 16]); // not present
        guest.extend(gate(0xffff_ffff_81a0_0400, 0, 0x0e)); // present bit clear
        let idt = GUARD.idt_for(&guest);
        assert_eq!(idt.len(), guest.len(), "as long as the guest's, up to its limit");
        for (vector, (ours, theirs)) in idt.chunks_exact(16).zip(guest.chunks_exact(16)).enumerate() {
            let (ours, theirs): (&[u8; 16], &[u8; 16]) = (ours.try_into().unwrap(), theirs.try_into().unwrap());
            if vector < 3 {
                assert_eq!(gate_handler(ours), Gva(GUARD.base.0 + 4096 + vector as u64));
                assert_eq!(GUARD.vector_at(gate_handler(ours)), Some(vector as u8));
                assert_eq!(ours[2..6], theirs[2..6], "selector, IST and type kept");
                assert_eq!(ours[12..], theirs[12..]);
            } else {
                assert_eq!(ours, theirs, "vector {vector}: copied as it is");
            }
        }
    }

    #[test]
    fn only_the_stubs_are_vectors() {
        assert_eq!(GUARD.vector_at(Gva(GUARD.base.0 + 4096)), Some(0));
        assert_eq!(GUARD.vector_at(Gva(GUARD.base.0 + 4096 + 255)), Some(255));
        assert_eq!(GUARD.vector_at(Gva(GUARD.base.0 + 4096 + 256)), None);
        assert_eq!(GUARD.vector_at(Gva(GUARD.base.0 + 4095)), None);
        assert_eq!(GUARD.vector_at(Gva(0)), None);
    }

    #[test]
    fn the_vectors_that_push_an_error_code() {
        let with: Vec<u8> = (0..=255u8).filter(|&v| has_error_code(v)).collect();
        assert_eq!(with, [8, 10, 11, 12, 13, 14, 17, 21, 29, 30]);
    }
}
