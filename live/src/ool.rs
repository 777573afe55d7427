//! The out-of-line area (instruction copies, the return-probe trampoline, detours, the step
//! guard, event rings): guest-physical memory the VMM withholds from the guest, mapped by
//! the host into the kernel's own page tables in two free 2 MiB slots of the kernel image
//! mapping, within ±2 GiB of all kernel text.
//!
//! Invariant: no page of it is both writable and executable to the guest (a kernel with
//! `CONFIG_DEBUG_WX` checks its mappings at boot and warns of any such page). Its first
//! 2 MiB page (code) is read-only and executable (the host writes it through
//! guest-physical memory), its second (rings) writable and not executable. Both are leaf
//! entries of the kernel's page directory: a page table of ours would sit in memory the
//! guest does not map, and its own page-table walkers (ptdump, the W+X check) would fault
//! reading it.

use hvprobe_arch::paging::{pte, translate, WalkError};
use hvprobe_arch::regs::efer;
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::engine::OutOfLineArea;
use hvprobe_vmm::layout::{OOL_AREA_SIZE, OOL_AREA_START, OOL_CODE_SIZE};
use hvprobe_vmm::VcpuState;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use crate::memory::{GuestPhys, KernelPageTables, KernelTablesError};

/// The kernel image mapping: `level2_kernel_pgt` covers 1 GiB from `__START_KERNEL_map`;
/// the module area starts at its end when KASLR is configured.
const KERNEL_IMAGE_MAP_START: u64 = 0xffff_ffff_8000_0000;
const KERNEL_IMAGE_MAP_END: u64 = 0xffff_ffff_c000_0000;
/// Where modules start without `CONFIG_RANDOMIZE_BASE` (a 512 MiB kernel image).
const MODULES_START_WITHOUT_KASLR: u64 = 0xffff_ffff_a000_0000;
const TWO_MIB: u64 = 2 << 20;
/// The code's 2 MiB page: present, read-only, accessed, large, global; executable and
/// supervisor-only.
const CODE_PDE_FLAGS: u64 = pte::PRESENT | pte::ACCESSED | pte::HUGE | pte::GLOBAL;
/// The rings' 2 MiB page: present, writable, accessed, dirty, large, global, supervisor-only;
/// not executable where the guest has NX on (without it every page is executable, and
/// there is no W+X to avoid).
const RINGS_PDE_FLAGS: u64 = pte::PRESENT | pte::WRITABLE | pte::ACCESSED | pte::DIRTY | pte::HUGE | pte::GLOBAL;

/// The area's parts when it is mapped at `va`.
pub fn out_of_line_area_at(va: u64) -> OutOfLineArea {
    OutOfLineArea {
        start: Gva(va),
        size: OOL_CODE_SIZE,
        rings: Gva(va + OOL_CODE_SIZE),
        rings_size: OOL_AREA_SIZE - OOL_CODE_SIZE,
    }
}

/// Why the out-of-line area could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum OutOfLineError {
    #[error("the kernel has no {0} symbol: cannot place the out-of-line area")]
    MissingSymbol(&'static str),
    #[error("cannot place the out-of-line area: {0}")]
    KernelTables(#[from] KernelTablesError),
    #[error(
        "no two free 2 MiB slots in the kernel image mapping ({KERNEL_IMAGE_MAP_START:#x}..{limit:#x}) outside the \
         kernel ({text:#x}..{end:#x})"
    )]
    NoFreeSlot { limit: u64, text: u64, end: u64 },
    #[error("the kernel's _text {text:#x} .. _end {end:#x} is not inside the kernel image mapping {KERNEL_IMAGE_MAP_START:#x}..{KERNEL_IMAGE_MAP_END:#x}")]
    KernelOutsideImageMap { text: u64, end: u64 },
    #[error("writing the out-of-line area's page-directory entry at {entry_gpa}")]
    WriteEntry {
        entry_gpa: Gpa,
        #[source]
        source: GuestMemoryError,
    },
}

/// Maps the VMM's out-of-line area into the kernel's own page tables (`init_top_pgt`, found
/// through `state`'s, any vCPU's: see [`KernelPageTables::find`]). Never through the
/// vCPU's own tables: they may be a user process's.
pub fn place_out_of_line_area(
    mem: &GuestMemoryMmap,
    state: &VcpuState,
    symbols: &SymbolTable,
) -> Result<OutOfLineArea, OutOfLineError> {
    let tables = KernelPageTables::find(mem, state, symbols)?;
    map_out_of_line_area(&GuestPhys(mem.clone()), tables, symbols, guest_has_nx(state))
}

/// Whether the guest turned NX on (page-table entries' bit 63 is reserved otherwise).
pub fn guest_has_nx(state: &VcpuState) -> bool {
    state.sregs.efer & efer::NXE != 0
}

/// Maps the VMM's out-of-line area into `tables`, in a free 2 MiB slot of the kernel image
/// mapping outside the kernel (within ±2 GiB of all kernel text, below the module area),
/// with its rings not executable when `nx` (the guest's EFER.NXE). Returns where its parts
/// are. Idempotent: an area already mapped (a restored snapshot of a traced guest) is
/// found again.
pub fn map_out_of_line_area(
    phys: &GuestPhys,
    tables: KernelPageTables,
    symbols: &SymbolTable,
    nx: bool,
) -> Result<OutOfLineArea, OutOfLineError> {
    let bound = |name: &'static str| {
        symbols
            .lookup(name)
            .map(|s| s.addr.0)
            .ok_or(OutOfLineError::MissingSymbol(name))
    };
    let (text, end) = (bound("_text")?, bound("_end")?);
    // Both come from the guest in kallsyms mode: outside the image mapping, the slot
    // arithmetic below overflowed (an `_end` near 2^64) or the search covered the user half.
    if !(KERNEL_IMAGE_MAP_START..KERNEL_IMAGE_MAP_END).contains(&text) || !(text..=KERNEL_IMAGE_MAP_END).contains(&end)
    {
        return Err(OutOfLineError::KernelOutsideImageMap { text, end });
    }
    let limit = if end < MODULES_START_WITHOUT_KASLR {
        MODULES_START_WITHOUT_KASLR
    } else {
        KERNEL_IMAGE_MAP_END
    };
    // One free 2 MiB page between the kernel and us, so that nothing the kernel maps just
    // past its end (or before its start) is mistaken for free. Above the kernel first; a
    // randomized kernel near the top of its 1 GiB leaves room only below it.
    let above = (end.div_ceil(TWO_MIB) + 1) * TWO_MIB;
    let below = (text / TWO_MIB).saturating_sub(1 + OOL_AREA_SIZE / TWO_MIB) * TWO_MIB;
    let candidates = (above..limit.saturating_sub(OOL_AREA_SIZE - 1))
        .step_by(TWO_MIB as usize)
        .chain((KERNEL_IMAGE_MAP_START..=below).rev().step_by(TWO_MIB as usize));
    let walk = |va: u64| translate(phys, tables.root().0, tables.mode(), Gva(va));
    for va in candidates {
        let code_entry = match walk(va) {
            Ok(t) if t.gpa == OOL_AREA_START => return Ok(out_of_line_area_at(va)),
            Err(WalkError::NotPresent {
                level: 2, entry_gpa, ..
            }) => entry_gpa,
            _ => continue,
        };
        let Err(WalkError::NotPresent {
            level: 2,
            entry_gpa: rings_entry,
            ..
        }) = walk(va + OOL_CODE_SIZE)
        else {
            continue;
        };
        let rings_pde = (OOL_AREA_START.0 + OOL_CODE_SIZE) | RINGS_PDE_FLAGS | if nx { pte::NX } else { 0 };
        for (entry_gpa, value) in [
            (rings_entry, rings_pde),
            (code_entry, OOL_AREA_START.0 | CODE_PDE_FLAGS),
        ] {
            phys.0
                .write_obj(value, GuestAddress(entry_gpa.0))
                .map_err(|source| OutOfLineError::WriteEntry { entry_gpa, source })?;
        }
        return Ok(out_of_line_area_at(va));
    }
    Err(OutOfLineError::NoFreeSlot { limit, text, end })
}

/// The out-of-line area's guest-physical start (for tests and diagnostics).
pub const fn out_of_line_gpa() -> Gpa {
    OOL_AREA_START
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::test_tables::{entry, map_kernel, memory, set_entry, Tables, TABLE};
    use hvprobe_arch::paging::PagingMode;

    const PML4: u64 = 0x1000;
    const KERNEL: Tables = Tables {
        pml4: PML4,
        pdpt: 0x2000,
        pd: 0x3000,
    };

    /// The kernel's tables at [`KERNEL`], with the kernel mapped by 2 MiB pages from
    /// `text` to `end`, as `cleanup_highmap` leaves them.
    fn kernel_tables(text: u64, end: u64) -> (GuestPhys, KernelPageTables) {
        let mem = memory();
        map_kernel(&mem, KERNEL, text, end, |va| 0x100_0000 + (va - KERNEL_IMAGE_MAP_START));
        let tables = KernelPageTables::for_tests(Gpa(PML4), PagingMode::Level4);
        (GuestPhys(mem), tables)
    }

    fn symbols(text: u64, end: u64) -> SymbolTable {
        SymbolTable::parse_system_map(&format!("{text:016x} T _text\n{end:016x} B _end\n")).unwrap()
    }

    #[test]
    fn the_out_of_line_area_goes_after_the_kernel_and_is_found_again() {
        let (text, end) = (0xffff_ffff_8100_0000, 0xffff_ffff_8230_0000);
        let (phys, tables) = kernel_tables(text, end);
        let area = map_out_of_line_area(&phys, tables, &symbols(text, end), true).unwrap();
        assert_eq!(
            area.start,
            Gva(0xffff_ffff_8260_0000),
            "after _end and one free 2 MiB page"
        );
        let t = translate(&phys, PML4, PagingMode::Level4, area.start).unwrap();
        assert_eq!(t.gpa, OOL_AREA_START);
        let again = map_out_of_line_area(&phys, tables, &symbols(text, end), true).unwrap();
        assert_eq!(again.start, area.start);
    }

    /// The kernel's W+X check (CONFIG_DEBUG_WX) found the area when it was one 2 MiB
    /// writable and executable page: a warning in a stock kernel's boot log.
    #[test]
    fn no_page_of_the_area_is_writable_and_executable() {
        let (text, end) = (0xffff_ffff_8100_0000, 0xffff_ffff_8230_0000);
        for nx in [true, false] {
            let (phys, tables) = kernel_tables(text, end);
            let area = map_out_of_line_area(&phys, tables, &symbols(text, end), nx).unwrap();
            assert_eq!(area.start.0 + area.size, area.rings.0, "the rings right after the code");
            assert_eq!(area.size + area.rings_size, OOL_AREA_SIZE);
            for page in (0..OOL_AREA_SIZE).step_by(4096) {
                let va = Gva(area.start.0 + page);
                let t = translate(&phys, PML4, PagingMode::Level4, va).unwrap();
                assert_eq!(t.gpa, Gpa(OOL_AREA_START.0 + page), "{va}");
                assert!(!t.permissions.user, "{va}");
                if area.contains(va) {
                    assert!(t.permissions.executable, "{va}: a code page is executable");
                    assert!(!t.permissions.writable, "{va}: a code page is read-only");
                } else {
                    assert!(t.permissions.writable, "{va}: a ring page is writable");
                    assert_eq!(
                        t.permissions.executable, !nx,
                        "{va}: a ring page executes only without NX"
                    );
                }
            }
        }
    }

    /// `_text`/`_end` are the guest's own symbols in kallsyms mode. An
    /// `_end` near 2^64 overflowed the slot arithmetic (a panic in debug; in release a
    /// search from near 0 over the user half), a `_text` in the user half put the search
    /// there. Both are a clear error, with nothing written.
    #[test]
    fn kernel_bounds_outside_the_image_mapping_are_refused() {
        let (text, end) = (0xffff_ffff_8100_0000, 0xffff_ffff_8230_0000);
        for (t, e) in [(text, u64::MAX - 5), (0x40_0000, 0x80_0000), (end, text)] {
            let (phys, tables) = kernel_tables(text, end);
            let err = map_out_of_line_area(&phys, tables, &symbols(t, e), true).unwrap_err();
            assert!(
                matches!(err, OutOfLineError::KernelOutsideImageMap { text, end } if (text, end) == (t, e)),
                "{err}"
            );
        }
    }

    #[test]
    fn a_kernel_randomized_to_the_top_gets_the_area_below_it() {
        let (text, end) = (0xffff_ffff_be00_0000, 0xffff_ffff_bfe1_c000);
        let (phys, tables) = kernel_tables(text, end);
        let area = map_out_of_line_area(&phys, tables, &symbols(text, end), true).unwrap();
        assert_eq!(
            area.start,
            Gva(0xffff_ffff_bda0_0000),
            "its 4 MiB below _text and one free 2 MiB page"
        );
        // Everything is taken: a clear error, nothing written.
        let (full, tables) = kernel_tables(KERNEL_IMAGE_MAP_START, KERNEL_IMAGE_MAP_END);
        let err = map_out_of_line_area(
            &full,
            tables,
            &symbols(KERNEL_IMAGE_MAP_START + TWO_MIB, KERNEL_IMAGE_MAP_END - TWO_MIB),
            true,
        )
        .unwrap_err();
        assert!(matches!(err, OutOfLineError::NoFreeSlot { .. }), "{err}");
        assert!(err.to_string().contains("no two free 2 MiB slots"), "{err}");
    }

    /// A vCPU parked in a user process: its CR3 is the process's, whose kernel half is a
    /// copy of the kernel's in tables of its own. The area must land in `init_top_pgt`'s
    /// tables (which every process's kernel half is copied from, and which the guest's
    /// later processes inherit), not in the copy.
    #[test]
    fn the_area_is_mapped_in_init_top_pgt_not_in_the_parked_vcpus_process_tables() {
        let (text, end) = (0xffff_ffff_8100_0000u64, 0xffff_ffff_8230_0000u64);
        // The kernel is loaded at physical 0 and init_top_pgt is in its .data.
        let init_top_pgt = text + 0x120_0000;
        let kernel = Tables {
            pml4: init_top_pgt - text,
            pdpt: init_top_pgt - text + 0x1000,
            pd: init_top_pgt - text + 0x2000,
        };
        let process = Tables {
            pml4: 0x10_0000,
            pdpt: 0x10_1000,
            pd: 0x10_2000,
        };
        let mem = memory();
        for tables in [kernel, process] {
            map_kernel(&mem, tables, text, end, |va| va - text);
        }
        // The process also has a user half.
        set_entry(&mem, process.pml4, 4, 0x40_0000, 0x10_3000 | TABLE);
        let symbols = SymbolTable::parse_system_map(&format!(
            "{text:016x} T _text\n{init_top_pgt:016x} D init_top_pgt\n{end:016x} B _end\n"
        ))
        .unwrap();
        let mut state = VcpuState::default();
        state.sregs.cr3 = process.pml4;
        state.sregs.cr4 = 0x20; // PAE, no LA57: 4-level paging

        let area = place_out_of_line_area(&mem, &state, &symbols).unwrap();
        let phys = GuestPhys(mem.clone());
        let through = |pml4| translate(&phys, pml4, PagingMode::Level4, area.start);
        assert_eq!(
            through(kernel.pml4).map(|t| t.gpa),
            Ok(OOL_AREA_START),
            "the area is not mapped in init_top_pgt's tables"
        );
        assert_eq!(
            entry(&mem, process.pd, 2, area.start.0),
            0,
            "the area was mapped in the process's copy of the kernel's tables"
        );
        // Found again, from either vCPU state, without a second mapping.
        assert_eq!(
            place_out_of_line_area(&mem, &state, &symbols).unwrap().start,
            area.start
        );
        state.sregs.cr3 = kernel.pml4;
        assert_eq!(
            place_out_of_line_area(&mem, &state, &symbols).unwrap().start,
            area.start
        );
    }
}
