//! 64-bit IDT gate descriptors (Intel SDM vol. 3, 6.14.1; AMD APM vol. 2, 4.8.4): the one
//! decoder of a gate, for the VMM's #BP delivery and the probe engine's step guard.
//!
//! Byte 5 of a gate holds its type (bits 0-3), the S bit (4, zero for every system
//! descriptor, gates included), the DPL (5-6) and P (7). A descriptor with S set is no
//! gate: the CPU faults on it, and so must whoever stands in for the CPU.

use crate::Gva;

/// The size of a 64-bit gate, and of an IDT entry.
pub const GATE_BYTES: u64 = 16;

/// The kinds of 64-bit gate an interrupt can go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateKind {
    /// Type 0xE: clears IF on delivery.
    Interrupt,
    /// Type 0xF: leaves IF as it was.
    Trap,
}

/// A decoded 64-bit gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gate {
    pub present: bool,
    /// `None`: not an interrupt or trap gate (a call or task gate, a reserved type, or a
    /// descriptor with the S bit set).
    pub kind: Option<GateKind>,
    pub selector: u16,
    pub handler: Gva,
    /// The interrupt stack table entry, 1-7, or 0 for none.
    pub ist: u8,
    pub dpl: u8,
}

impl Gate {
    pub fn decode(bytes: &[u8; 16]) -> Gate {
        let kind = match bytes[5] & 0x1f {
            0x0e => Some(GateKind::Interrupt),
            0x0f => Some(GateKind::Trap),
            _ => None,
        };
        Gate {
            present: bytes[5] & 0x80 != 0,
            kind,
            selector: u16::from_le_bytes([bytes[2], bytes[3]]),
            handler: Gva(u64::from(u16::from_le_bytes([bytes[0], bytes[1]]))
                | u64::from(u16::from_le_bytes([bytes[6], bytes[7]])) << 16
                | u64::from(u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]])) << 32),
            ist: bytes[4] & 7,
            dpl: (bytes[5] >> 5) & 3,
        }
    }

    /// Whether an interrupt can go through it: present, an interrupt or trap gate.
    pub fn usable(&self) -> Option<GateKind> {
        self.kind.filter(|_| self.present)
    }
}

/// Points the gate `bytes` at `handler`, leaving the rest of it as it is.
pub fn set_handler(bytes: &mut [u8], handler: Gva) {
    bytes[0..2].copy_from_slice(&(handler.0 as u16).to_le_bytes());
    bytes[6..8].copy_from_slice(&((handler.0 >> 16) as u16).to_le_bytes());
    bytes[8..12].copy_from_slice(&((handler.0 >> 32) as u32).to_le_bytes());
}

/// Where gate `vector` is in an IDT at `base`. The base is the guest's IDTR: the address
/// wraps, as the CPU's own addressing does, rather than overflowing.
pub fn gate_address(base: Gva, vector: u8) -> Gva {
    Gva(base.0.wrapping_add(u64::from(vector) * GATE_BYTES))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(handler: u64, selector: u16, byte5: u8, ist: u8) -> [u8; 16] {
        let mut g = [0u8; 16];
        set_handler(&mut g, Gva(handler));
        g[2..4].copy_from_slice(&selector.to_le_bytes());
        g[4] = ist;
        g[5] = byte5;
        g
    }

    #[test]
    fn gates_decode_their_kind_handler_selector_ist_and_dpl() {
        let g = Gate::decode(&gate(0xffff_ffff_8100_1234, 0x10, 0x8e, 2));
        assert_eq!(
            g,
            Gate {
                present: true,
                kind: Some(GateKind::Interrupt),
                selector: 0x10,
                handler: Gva(0xffff_ffff_8100_1234),
                ist: 2,
                dpl: 0,
            }
        );
        assert_eq!(Gate::decode(&gate(0, 0x10, 0xef, 0)).usable(), Some(GateKind::Trap));
        assert_eq!(Gate::decode(&gate(0, 0x10, 0xef, 0)).dpl, 3);
        assert_eq!(Gate::decode(&gate(0, 0x10, 0x0e, 0)).usable(), None, "not present");
        assert_eq!(Gate::decode(&gate(0, 0x10, 0x8c, 0)).kind, None, "a call gate");
    }

    /// The S bit set: a code or data descriptor, not a gate (a decoder that looked at the
    /// type nibble alone took 0x9e for an interrupt gate).
    #[test]
    fn a_descriptor_with_the_s_bit_is_no_gate() {
        assert_eq!(Gate::decode(&gate(0, 0x10, 0x9e, 0)).kind, None);
        assert_eq!(Gate::decode(&gate(0, 0x10, 0x9f, 0)).kind, None);
    }

    #[test]
    fn gate_addresses_wrap_at_the_top_of_the_address_space() {
        assert_eq!(gate_address(Gva(0x1000), 3), Gva(0x1030));
        assert_eq!(
            gate_address(Gva(u64::MAX - 15), 255),
            Gva((u64::MAX - 15).wrapping_add(255 * 16))
        );
    }
}
