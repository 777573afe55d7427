//! Where things live in guest-physical memory.
//!
//! ```text
//! 0x0000_0500  GDT used at entry (both boot protocols)
//! 0x0000_6000  PVH start_info, its memory map and module list
//! 0x0000_7000  zero page (bzImage boot_params)
//! 0x0000_9000  identity page tables for the 64-bit bzImage entry
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  MP table (last KiB of base memory, where Linux scans for it)
//! 0x000e_0000  ACPI tables, the RSDP first (where Linux scans for it)
//! 0x0010_0000  kernel (bzImage protected-mode part, or the ELF's own physical addresses)
//! ...          RAM up to min(size, 3 GiB); the initrd sits at its top
//! 0xd000_0000  out-of-line area: never RAM to the guest (reserved in the e820 map)
//! 0xd100_0000  virtio-mmio register windows, 4 KiB each (announced on the command line)
//! 0xfec0_0000  IOAPIC, 0xfee0_0000 LAPIC (in-kernel)
//! 0x1_0000_0000 RAM above 3 GiB, if any
//! ```

use hvprobe_arch::Gpa;

pub const GDT_START: u64 = 0x500;
pub const PVH_INFO_START: u64 = 0x6000;
pub const PVH_MEMMAP_START: u64 = 0x6100;
pub const PVH_MODLIST_START: u64 = 0x6800;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
/// Four page directories, identity-mapping the first 4 GiB with 2 MiB pages.
pub const PDE_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x20000;
/// The kernel's x86 command-line limit (COMMAND_LINE_SIZE).
pub const CMDLINE_MAX_SIZE: usize = 2048;
pub const MPTABLE_START: u64 = 0x9fc00;
/// The ACPI tables: the BIOS area, reserved in the memory map.
pub const ACPI_START: u64 = 0xe0000;
pub const ACPI_END: u64 = 0x100000;
pub const EBDA_END: u64 = 0x100000;
pub const HIMEM_START: u64 = 0x100000;

/// Highest end of the RAM block below 4 GiB.
pub const LOW_RAM_MAX_END: u64 = 0xc000_0000;
/// Where RAM continues when the guest has more than [`LOW_RAM_MAX_END`].
pub const HIGH_RAM_START: u64 = 0x1_0000_0000;

/// The out-of-line area: guest-physical memory the VMM keeps for probe code (instruction
/// copies, trampolines, detours) in its first 2 MiB, and for event detours' rings in its
/// second (mapped as two 2 MiB pages: the code read-only and executable, the rings
/// writable and not executable). The guest's memory map lists it as reserved, so the guest
/// never uses it as RAM (nor maps it: a page table of ours in it would be one the guest's
/// own page-table walkers cannot read).
pub const OOL_AREA_START: Gpa = Gpa(0xd000_0000);
pub const OOL_AREA_SIZE: u64 = 4 << 20;
/// The code part's size; the rings take the rest.
pub const OOL_CODE_SIZE: u64 = 2 << 20;

/// The first virtio-mmio register window; device N's is N windows further.
pub const VIRTIO_MMIO_START: u64 = 0xd100_0000;
pub const VIRTIO_MMIO_WINDOW: u64 = 0x1000;

pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const LAPIC_START: u64 = 0xfee0_0000;

/// Guest RAM ranges (start, length) for a guest of `mem_bytes`.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(Gpa, u64)> {
    if mem_bytes <= LOW_RAM_MAX_END {
        vec![(Gpa(0), mem_bytes)]
    } else {
        vec![
            (Gpa(0), LOW_RAM_MAX_END),
            (Gpa(HIGH_RAM_START), mem_bytes - LOW_RAM_MAX_END),
        ]
    }
}

/// The kind of an entry in the guest's memory map, with the e820 type numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    Ram = 1,
    Reserved = 2,
}

/// The memory map the guest is told about (e820 for bzImage, the PVH memmap otherwise).
pub fn memory_map(mem_bytes: u64) -> Vec<(Gpa, u64, MemoryKind)> {
    let mut map = vec![
        (Gpa(0), MPTABLE_START, MemoryKind::Ram),
        (Gpa(MPTABLE_START), EBDA_END - MPTABLE_START, MemoryKind::Reserved),
    ];
    for (start, len) in ram_ranges(mem_bytes) {
        // Below 1 MiB only the base memory counts as RAM (the MP table and BIOS area follow).
        let start_above_bios = start.0.max(HIMEM_START);
        let end = start.0 + len;
        if end > start_above_bios {
            map.push((Gpa(start_above_bios), end - start_above_bios, MemoryKind::Ram));
        }
    }
    map.push((OOL_AREA_START, OOL_AREA_SIZE, MemoryKind::Reserved));
    map
}

/// End of the RAM block that starts at 0 (where the initrd goes).
pub fn low_ram_end(mem_bytes: u64) -> u64 {
    mem_bytes.min(LOW_RAM_MAX_END)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_has_one_ram_block_above_1mib_and_a_reserved_ool_area() {
        let map = memory_map(128 << 20);
        assert_eq!(map[0], (Gpa(0), MPTABLE_START, MemoryKind::Ram));
        assert_eq!(map[2], (Gpa(HIMEM_START), (128 << 20) - HIMEM_START, MemoryKind::Ram));
        assert_eq!(map[3], (OOL_AREA_START, OOL_AREA_SIZE, MemoryKind::Reserved));
        assert_eq!(map.len(), 4);
    }

    #[test]
    fn big_guest_continues_above_4gib_and_ool_area_is_not_ram() {
        let mem = 4u64 << 30;
        let ranges = ram_ranges(mem);
        assert_eq!(
            ranges,
            vec![(Gpa(0), LOW_RAM_MAX_END), (Gpa(HIGH_RAM_START), mem - LOW_RAM_MAX_END)]
        );
        let map = memory_map(mem);
        for (start, len, kind) in &map {
            if *kind == MemoryKind::Ram {
                let end = start.0 + len;
                assert!(end <= OOL_AREA_START.0 || start.0 >= OOL_AREA_START.0 + OOL_AREA_SIZE);
            }
        }
        assert!(map.iter().any(|e| e.0 == Gpa(HIGH_RAM_START) && e.2 == MemoryKind::Ram));
    }
}
