//! The x86 debug registers as a host sets them for a guest: up to four hardware
//! breakpoints (DR0–DR3), each an instruction address to stop before, or a naturally
//! aligned range of 1, 2, 4 or 8 bytes whose writes (or reads and writes) stop after the
//! accessing instruction; DR7 enables them and says which is which; DR6 says which fired.

use std::fmt;

use crate::Gva;

/// How many hardware breakpoints an x86 CPU has.
pub const HARDWARE_BREAKPOINTS: usize = 4;

/// What makes a hardware breakpoint fire. x86 has no read-only watch: a read is caught
/// only together with writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// The instruction at the address is about to run (a fault: before it).
    Execute,
    /// A write to the range (a trap: after the instruction).
    Write,
    /// A read or a write of the range (a trap: after the instruction).
    ReadWrite,
}

impl Access {
    /// DR7's R/W field for it.
    const fn rw_bits(self) -> u64 {
        match self {
            Access::Execute => 0b00,
            Access::Write => 0b01,
            Access::ReadWrite => 0b11,
        }
    }

    /// Whether it watches data (fires after the access) rather than an instruction.
    pub const fn is_data(self) -> bool {
        !matches!(self, Access::Execute)
    }

    /// perf's access letters: `x`, `w`, `rw`.
    pub const fn letters(self) -> &'static str {
        match self {
            Access::Execute => "x",
            Access::Write => "w",
            Access::ReadWrite => "rw",
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.letters())
    }
}

/// Why a hardware breakpoint cannot be set as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HardwareBreakpointError {
    #[error("a watched range is 1, 2, 4 or 8 bytes long, not {0}")]
    Length(u64),
    #[error("an execution breakpoint covers one byte (length 1), not {0}")]
    ExecuteLength(u64),
    #[error(
        "{address} is not aligned to the watch's length {len}: the CPU would watch {aligned} instead \
         (watch a naturally aligned range)"
    )]
    Unaligned { address: Gva, len: u64, aligned: Gva },
    #[error("all {HARDWARE_BREAKPOINTS} debug registers are in use")]
    Full,
}

/// One hardware breakpoint, checked: its length is 1 for an instruction, and 1, 2, 4 or 8
/// for data, and its address is aligned to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HardwareBreakpoint {
    address: Gva,
    access: Access,
    len: u8,
}

impl HardwareBreakpoint {
    pub fn new(address: Gva, access: Access, len: u64) -> Result<Self, HardwareBreakpointError> {
        if !matches!(len, 1 | 2 | 4 | 8) {
            return Err(HardwareBreakpointError::Length(len));
        }
        if access == Access::Execute && len != 1 {
            return Err(HardwareBreakpointError::ExecuteLength(len));
        }
        if !address.0.is_multiple_of(len) {
            return Err(HardwareBreakpointError::Unaligned {
                address,
                len,
                aligned: Gva(address.0 & !(len - 1)),
            });
        }
        Ok(HardwareBreakpoint {
            address,
            access,
            len: len as u8,
        })
    }

    pub const fn address(&self) -> Gva {
        self.address
    }

    pub const fn access(&self) -> Access {
        self.access
    }

    pub const fn length(&self) -> u64 {
        self.len as u64
    }

    /// DR7's LEN field for it (0b10 is 8 bytes in 64-bit mode).
    const fn len_bits(&self) -> u64 {
        match self.len {
            1 => 0b00,
            2 => 0b01,
            8 => 0b10,
            _ => 0b11,
        }
    }
}

/// The four debug-register slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DebugRegisters {
    slots: [Option<HardwareBreakpoint>; HARDWARE_BREAKPOINTS],
}

/// DR7's local enable bit of slot `n` (the global ones, bits 1, 3, 5, 7, mean the same to
/// a host that sets them per vCPU).
const fn local_enable(n: usize) -> u64 {
    1 << (2 * n)
}

/// DR6's "breakpoint `n` fired" bits.
const DR6_HITS: u64 = 0b1111;
/// DR7's enable bits, local and global, of all four slots.
const DR7_ENABLES: u64 = 0xff;

impl DebugRegisters {
    /// Puts `bp` into the first free slot and returns that slot.
    pub fn insert(&mut self, bp: HardwareBreakpoint) -> Result<usize, HardwareBreakpointError> {
        let slot = self
            .slots
            .iter()
            .position(Option::is_none)
            .ok_or(HardwareBreakpointError::Full)?;
        self.slots[slot] = Some(bp);
        Ok(slot)
    }

    /// Puts `bp` into `slot` (0–3), replacing what was there.
    pub fn place(&mut self, slot: usize, bp: HardwareBreakpoint) {
        self.slots[slot] = Some(bp);
    }

    /// Empties `slot`; what it held.
    pub fn remove(&mut self, slot: usize) -> Option<HardwareBreakpoint> {
        self.slots.get_mut(slot).and_then(Option::take)
    }

    pub fn get(&self, slot: usize) -> Option<&HardwareBreakpoint> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    pub fn used(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// DR0–DR7 as KVM's `kvm_guest_debug_arch.debugreg` takes them (DR4/5 and DR6 are 0).
    pub fn debugreg(&self) -> [u64; 8] {
        let mut regs = [0u64; 8];
        let mut dr7 = 0;
        for (n, bp) in self.slots.iter().enumerate() {
            if let Some(bp) = bp {
                regs[n] = bp.address.0;
                dr7 |= local_enable(n) | (bp.access.rw_bits() << (16 + 4 * n)) | (bp.len_bits() << (18 + 4 * n));
            }
        }
        regs[7] = dr7;
        regs
    }

    /// The slots of these breakpoints that DR6 says fired.
    pub fn fired(&self, dr6: u64) -> impl Iterator<Item = usize> + '_ {
        (0..HARDWARE_BREAKPOINTS).filter(move |&n| dr6 & DR6_HITS & (1 << n) != 0 && self.slots[n].is_some())
    }
}

/// Whether a DR7 value enables any breakpoint (the guest's own, read back from KVM).
pub const fn dr7_enables_any(dr7: u64) -> bool {
    dr7 & DR7_ENABLES != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dr7_encodes_each_slot_as_the_sdm_says() {
        let mut regs = DebugRegisters::default();
        let exec = HardwareBreakpoint::new(Gva(0x100016), Access::Execute, 1).unwrap();
        let write8 = HardwareBreakpoint::new(Gva(0x100800), Access::Write, 8).unwrap();
        let rw4 = HardwareBreakpoint::new(Gva(0x100804), Access::ReadWrite, 4).unwrap();
        let rw2 = HardwareBreakpoint::new(Gva(0x100806), Access::ReadWrite, 2).unwrap();
        assert_eq!(regs.insert(exec), Ok(0));
        assert_eq!(regs.insert(write8), Ok(1));
        assert_eq!(regs.insert(rw4), Ok(2));
        assert_eq!(regs.insert(rw2), Ok(3));
        let r = regs.debugreg();
        assert_eq!(&r[..4], &[0x100016, 0x100800, 0x100804, 0x100806]);
        // L0..L3; slot 0 R/W 00 LEN 00; slot 1 R/W 01 LEN 10; slot 2 R/W 11 LEN 11;
        // slot 3 R/W 11 LEN 01.
        assert_eq!(r[7], 0b0101_0101 | (0b1001 << 20) | (0b1111 << 24) | (0b0111 << 28));
        // The DR7 the experiment on kvm_pvm and kvm_amd used for slots 0 and 1.
        let mut two = DebugRegisters::default();
        two.insert(exec).unwrap();
        two.insert(write8).unwrap();
        assert_eq!(two.debugreg()[7], 1 | (1 << 2) | (0b01 << 20) | (0b10 << 22));
    }

    #[test]
    fn a_fifth_breakpoint_is_refused_and_a_freed_slot_is_reused() {
        let mut regs = DebugRegisters::default();
        for n in 0..4u64 {
            regs.insert(HardwareBreakpoint::new(Gva(0x1000 + 8 * n), Access::Write, 8).unwrap())
                .unwrap();
        }
        let fifth = HardwareBreakpoint::new(Gva(0x2000), Access::Write, 8).unwrap();
        assert_eq!(regs.insert(fifth), Err(HardwareBreakpointError::Full));
        assert!(regs.remove(2).is_some());
        assert_eq!(regs.insert(fifth), Ok(2));
        assert_eq!(regs.used(), 4);
    }

    #[test]
    fn lengths_and_alignment_are_checked() {
        assert_eq!(
            HardwareBreakpoint::new(Gva(0x1000), Access::Write, 3),
            Err(HardwareBreakpointError::Length(3))
        );
        assert_eq!(
            HardwareBreakpoint::new(Gva(0x1000), Access::Execute, 8),
            Err(HardwareBreakpointError::ExecuteLength(8))
        );
        assert_eq!(
            HardwareBreakpoint::new(Gva(0x1004), Access::Write, 8),
            Err(HardwareBreakpointError::Unaligned {
                address: Gva(0x1004),
                len: 8,
                aligned: Gva(0x1000)
            })
        );
        assert!(HardwareBreakpoint::new(Gva(0x1003), Access::Execute, 1).is_ok());
    }

    #[test]
    fn dr6_names_only_slots_in_use() {
        let mut regs = DebugRegisters::default();
        regs.insert(HardwareBreakpoint::new(Gva(0x10), Access::Execute, 1).unwrap())
            .unwrap();
        // DR6's reserved-as-one bits and a single-step (BS, bit 14) are no hit.
        assert_eq!(regs.fired(0xffff_4ff1).collect::<Vec<_>>(), vec![0]);
        assert_eq!(regs.fired(0xffff_0ff2).count(), 0);
        assert!(dr7_enables_any(0x400 | 0b10));
        assert!(!dr7_enables_any(0x400));
    }
}
