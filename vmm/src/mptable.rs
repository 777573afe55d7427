//! The Intel MultiProcessor table (MP spec 1.4): how a guest without ACPI learns about its
//! CPUs, its IOAPIC and how ISA interrupts are wired.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{IOAPIC_START, LAPIC_START, MPTABLE_START};
use crate::Error;

const MPC_SPEC: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const ISA_IRQS: u8 = 16;
/// The whole table must fit in the last KiB of base memory.
const MPTABLE_MAX_SIZE: usize = 0x400;

/// Largest vCPU count whose MP table still fits.
pub const MAX_CPUS: u8 = 32;

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// The MP floating pointer followed by the configuration table, as bytes placed at
/// [`MPTABLE_START`].
pub fn mptable_bytes(cpu_count: u8) -> Vec<u8> {
    let ioapic_id = cpu_count;
    let mut entries = Vec::new();
    let mut entry_count: u16 = 0;
    for cpu in 0..cpu_count {
        entries.push(0u8); // processor
        entries.push(cpu); // local APIC id
        entries.push(APIC_VERSION);
        entries.push(1 | if cpu == 0 { 2 } else { 0 }); // enabled, bootstrap processor
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: fpu, apic
        entries.extend_from_slice(&[0; 8]);
        entry_count += 1;
    }
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']); // bus 0: ISA
    entry_count += 1;
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    entry_count += 1;
    for irq in 0..ISA_IRQS {
        // I/O interrupt: INT, conforming polarity/trigger, ISA bus irq -> same IOAPIC pin.
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        entry_count += 1;
    }
    // Local interrupts: ExtINT on LINT0, NMI on LINT1, to all local APICs.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    entry_count += 2;

    let table_addr = MPTABLE_START as u32 + 16;
    let mut table = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    table.push(MPC_SPEC);
    table.push(0); // checksum, below
    table.extend_from_slice(b"HVPROBE ");
    table.extend_from_slice(b"000000000000");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&entry_count.to_le_bytes());
    table.extend_from_slice(&(LAPIC_START as u32).to_le_bytes());
    table.extend_from_slice(&0u32.to_le_bytes()); // extended table length + checksum + reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&table_addr.to_le_bytes());
    floating.push(1); // length in 16-byte units
    floating.push(MPC_SPEC);
    floating.push(0); // checksum, below
    floating.extend_from_slice(&[0; 5]); // feature bytes: 0 = a configuration table follows
    floating[10] = checksum(&floating);

    floating.extend_from_slice(&table);
    floating
}

pub fn write_mptable(mem: &GuestMemoryMmap, cpu_count: u8) -> Result<(), Error> {
    if cpu_count == 0 || cpu_count > MAX_CPUS {
        return Err(Error::CpuCount {
            cpus: cpu_count,
            max: MAX_CPUS,
        });
    }
    let bytes = mptable_bytes(cpu_count);
    debug_assert!(bytes.len() <= MPTABLE_MAX_SIZE);
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))
        .map_err(crate::error::mem_err("writing the MP table"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_are_valid_and_the_table_fits_for_the_largest_guest() {
        for cpus in [1, 2, MAX_CPUS] {
            let b = mptable_bytes(cpus);
            assert!(b.len() <= MPTABLE_MAX_SIZE, "{cpus} cpus: {} bytes", b.len());
            assert_eq!(&b[0..4], b"_MP_");
            assert_eq!(b[0..16].iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
            let table = &b[16..];
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(table.iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
            let count = u16::from_le_bytes([table[34], table[35]]);
            assert_eq!(count as usize, cpus as usize + 1 + 1 + 16 + 2);
        }
    }

    #[test]
    fn only_the_first_cpu_is_the_bootstrap_processor() {
        let b = mptable_bytes(2);
        let first = &b[16 + 44..];
        assert_eq!(first[3], 3);
        assert_eq!(first[20 + 3], 1);
        assert_eq!(first[20 + 1], 1);
    }
}
