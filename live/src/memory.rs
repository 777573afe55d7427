//! Guest memory of a running VM as the page walker and the probe engine see it: through
//! the page tables a vCPU has loaded, or through the kernel's own (`init_top_pgt`), which
//! map all of the kernel for as long as the kernel lives.

use hvprobe_arch::paging::{translate, PagingMode, PhysAccessError, PhysRead, PhysWrite, WalkError};
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError, PagedGuestMemory};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::detour::ring::RingMemory;
use hvprobe_probes::machine::KernelMemory;
use hvprobe_vmm::VcpuState;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// vm-memory's error for `len` bytes at `gpa`, as the page walker's: an address outside
/// every region is not guest memory, the rest the backend's failure.
fn phys_error(gpa: Gpa, len: usize, e: vm_memory::GuestMemoryError) -> PhysAccessError {
    match e {
        vm_memory::GuestMemoryError::InvalidGuestAddress(_) => PhysAccessError::NotMemory { gpa, len },
        other => PhysAccessError::backend(other),
    }
}

/// Guest-physical memory as the page walker reads and writes it.
#[derive(Clone)]
pub struct GuestPhys(pub GuestMemoryMmap);

impl PhysRead for GuestPhys {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        self.0
            .read_slice(buf, GuestAddress(gpa.0))
            .map_err(|e| phys_error(gpa, buf.len(), e))
    }
}

impl PhysWrite for GuestPhys {
    fn write_phys(&self, gpa: Gpa, data: &[u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        self.0
            .write_slice(data, GuestAddress(gpa.0))
            .map_err(|e| phys_error(gpa, data.len(), e))
    }
}

/// The event rings' `head` and `tail` are read and written with one atomic access each
/// (vm-memory's `load`/`store` on the mmap), so neither the guest nor the host sees one
/// torn: see `hvprobe_probes::detour::ring` for the ordering contract.
impl RingMemory for GuestPhys {
    fn load_u64_acquire(&self, gpa: Gpa) -> Result<u64, hvprobe_arch::paging::PhysAccessError> {
        self.0
            .load::<u64>(GuestAddress(gpa.0), std::sync::atomic::Ordering::Acquire)
            .map_err(|e| phys_error(gpa, 8, e))
    }

    fn store_u64_release(&self, gpa: Gpa, value: u64) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        self.0
            .store(value, GuestAddress(gpa.0), std::sync::atomic::Ordering::Release)
            .map_err(|e| phys_error(gpa, 8, e))
    }
}

/// Guest-virtual memory as a paused vCPU sees it (its CR3 and paging mode): the process it
/// was running, user half included.
pub fn live_memory(mem: &GuestMemoryMmap, state: &VcpuState) -> PagedGuestMemory<GuestPhys> {
    PagedGuestMemory::new(
        GuestPhys(mem.clone()),
        state.sregs.cr3,
        PagingMode::from_cr4(state.sregs.cr4),
    )
}

/// Why the kernel's own page tables were not found.
#[derive(Debug, thiserror::Error)]
pub enum KernelTablesError {
    #[error("the kernel's symbols have no init_top_pgt: its own page tables cannot be found")]
    NoSymbol,
    #[error("init_top_pgt ({symbol}) does not translate through the vCPU's page tables (CR3 {cr3:#x})")]
    Unmapped {
        symbol: Gva,
        cr3: u64,
        #[source]
        source: WalkError,
    },
}

/// Under page-table isolation a process's user-mode top-level table is the page after its
/// kernel-mode one (Linux's `PTI_USER_PGTABLE_BIT`, CR3 bit 12) and maps little more than
/// the entry code: the kernel's data is found through the kernel-mode table.
const PTI_USER_PGTABLE_BIT: u64 = 1 << 12;

/// The kernel's own top-level page table, `init_top_pgt`. Everything that changes the
/// kernel's mappings or text goes through it: a vCPU's CR3 may be a user process's, whose
/// kernel half is a copy the kernel may not keep in step and which under PTI does not even
/// map the whole kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelPageTables {
    root: Gpa,
    mode: PagingMode,
}

impl KernelPageTables {
    /// Finds `init_top_pgt` by translating the symbol through `state`'s page tables (any
    /// vCPU's, with the kernel's paging set up; under PTI a user-mode CR3 is turned into its
    /// kernel-mode twin first if the symbol does not translate).
    pub fn find(
        mem: &GuestMemoryMmap,
        state: &VcpuState,
        symbols: &SymbolTable,
    ) -> Result<KernelPageTables, KernelTablesError> {
        Self::find_through(
            &GuestPhys(mem.clone()),
            state.sregs.cr3,
            PagingMode::from_cr4(state.sregs.cr4),
            symbols,
        )
    }

    fn find_through(
        phys: &GuestPhys,
        cr3: u64,
        mode: PagingMode,
        symbols: &SymbolTable,
    ) -> Result<KernelPageTables, KernelTablesError> {
        let symbol = symbols.lookup("init_top_pgt").ok_or(KernelTablesError::NoSymbol)?.addr;
        let found = translate(phys, cr3, mode, symbol).or_else(|first| match cr3 & PTI_USER_PGTABLE_BIT {
            0 => Err(first),
            _ => translate(phys, cr3 & !PTI_USER_PGTABLE_BIT, mode, symbol).map_err(|_| first),
        });
        match found {
            Ok(t) => Ok(KernelPageTables { root: t.gpa, mode }),
            Err(source) => Err(KernelTablesError::Unmapped { symbol, cr3, source }),
        }
    }

    /// Tables at `root`, taken on trust (unit tests of code that is given the tables).
    #[cfg(test)]
    pub(crate) fn for_tests(root: Gpa, mode: PagingMode) -> KernelPageTables {
        KernelPageTables { root, mode }
    }

    /// The guest-physical address of `init_top_pgt` (the CR3 value of the kernel's tables).
    pub fn root(&self) -> Gpa {
        self.root
    }

    pub fn mode(&self) -> PagingMode {
        self.mode
    }

    /// Guest kernel memory through these tables.
    pub fn memory(&self, mem: &GuestMemoryMmap) -> LiveKernel {
        LiveKernel::new(PagedGuestMemory::new(GuestPhys(mem.clone()), self.root.0, self.mode))
    }
}

/// Guest memory the host keeps for itself (the out-of-line area), mapped into the guest at
/// `gva`: the host reads and writes it by its guest-physical address, never through the
/// guest's tables, and refuses any write the guest's tables would steer into it.
#[derive(Clone, Copy, Debug)]
pub struct HostArea {
    pub gva: Gva,
    pub gpa: Gpa,
    pub size: u64,
}

impl HostArea {
    /// The guest-physical address of `[gva, gva+len)`, when it starts inside the area; an
    /// error when it runs past its end.
    fn gpa_of(&self, gva: Gva, len: usize) -> Result<Option<Gpa>, MemoryError> {
        let offset = gva.0.wrapping_sub(self.gva.0);
        if offset >= self.size {
            return Ok(None);
        }
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(Some(Gpa(self.gpa.0 + offset))),
            _ => Err(MemoryError::PastHostArea { gva, len }),
        }
    }

    /// Whether any byte of `[gva, gva+len)` is in the area, by its guest-virtual address.
    fn overlaps(&self, gva: Gva, len: usize) -> bool {
        gva.0 < self.gva.0.saturating_add(self.size) && gva.0.saturating_add(len as u64) > self.gva.0
    }

    fn holds(&self, gpa: Gpa, len: usize) -> bool {
        gpa.0 < self.gpa.0.saturating_add(self.size) && gpa.0.saturating_add(len as u64) > self.gpa.0
    }
}

/// The kernel's text: `[start, end)`, which the kernel image mapping puts at
/// `gva + phys_offset` (one linear mapping for the whole image).
#[derive(Clone, Debug)]
pub struct KernelText {
    pub range: std::ops::Range<Gva>,
    pub phys_offset: u64,
}

/// Guest kernel memory through one set of page tables that maps all of the kernel: the
/// kernel's own ([`kernel_memory`]), or a code blob's. With a [`HostArea`] and the
/// [`KernelText`], the host's writes cannot be steered by the guest's tables: the area is
/// written by its physical address, a write the tables map into it is refused, and so is a
/// text write the tables map anywhere but where the kernel's text is.
pub struct LiveKernel {
    pub memory: PagedGuestMemory<GuestPhys>,
    host_area: Option<HostArea>,
    text: Option<KernelText>,
}

impl LiveKernel {
    pub fn new(memory: PagedGuestMemory<GuestPhys>) -> Self {
        LiveKernel {
            memory,
            host_area: None,
            text: None,
        }
    }

    pub fn with_host_area(mut self, area: HostArea) -> Self {
        self.host_area = Some(area);
        self
    }

    pub fn with_kernel_text(mut self, text: KernelText) -> Self {
        self.text = Some(text);
        self
    }

    /// Where `[gva, gva+len)` is when it lies in the host's area (reached by its physical
    /// address, never through the guest's tables).
    fn in_host_area(&self, gva: Gva, len: usize) -> Result<Option<Gpa>, MemoryError> {
        match &self.host_area {
            Some(area) => area.gpa_of(gva, len),
            None => Ok(None),
        }
    }

    /// Where the guest's tables may put a piece of a host write.
    fn check_target(&self, gva: Gva, gpa: Gpa, len: usize) -> Result<(), MemoryError> {
        if self.host_area.is_some_and(|area| area.holds(gpa, len)) {
            return Err(MemoryError::ReservedTarget { gva, gpa });
        }
        if let Some(text) = &self.text {
            if text.range.contains(&gva) {
                let expected = Gpa(gva.0.wrapping_add(text.phys_offset));
                if gpa != expected {
                    return Err(MemoryError::TextMoved {
                        gva,
                        gpa,
                        text: expected,
                    });
                }
            }
        }
        Ok(())
    }
}

impl GuestVirtRead for LiveKernel {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        match self.in_host_area(gva, buf.len())? {
            Some(gpa) => self
                .memory
                .phys()
                .read_phys(gpa, buf)
                .map_err(|source| MemoryError::PhysAccess { gpa, gva, source }),
            None => self.memory.read_virt(gva, buf),
        }
    }
}

impl KernelMemory for LiveKernel {
    /// Never into the host's area, by any address: the probe engine checks where it
    /// writes text, and this is the second line should an address from the guest (a
    /// forged module's "function") get past it. Elsewhere as any write through the tables.
    fn write_text(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError> {
        if self.host_area.is_some_and(|area| area.overlaps(gva, bytes.len())) {
            return Err(MemoryError::TextIntoHostArea { gva, len: bytes.len() });
        }
        self.memory
            .write_virt_checked(gva, bytes, &|at, gpa, len| self.check_target(at, gpa, len))
    }

    fn write_virt(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError> {
        match self.in_host_area(gva, bytes.len())? {
            Some(gpa) => self
                .memory
                .phys()
                .write_phys(gpa, bytes)
                .map_err(|source| MemoryError::PhysAccess { gpa, gva, source }),
            None => self
                .memory
                .write_virt_checked(gva, bytes, &|at, gpa, len| self.check_target(at, gpa, len)),
        }
    }
}

/// Guest kernel memory through the kernel's own page tables, found through `state`'s (see
/// [`KernelPageTables::find`]).
pub fn kernel_memory(
    mem: &GuestMemoryMmap,
    state: &VcpuState,
    symbols: &SymbolTable,
) -> Result<LiveKernel, KernelTablesError> {
    Ok(KernelPageTables::find(mem, state, symbols)?.memory(mem))
}

/// Small 4-level page tables in a [`GuestMemoryMmap`], for the unit tests of this crate.
#[cfg(test)]
pub(crate) mod test_tables {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// Present and writable (a table entry); with `LARGE`, a 2 MiB page.
    pub const TABLE: u64 = 0x3;
    pub const LARGE: u64 = 0x80;
    pub const TWO_MIB: u64 = 2 << 20;

    /// 32 MiB of guest memory, all zero (no page mapped).
    /// 32 MiB from 0, and the VMM's out-of-line area.
    pub fn memory() -> GuestMemoryMmap {
        use hvprobe_vmm::layout::{OOL_AREA_SIZE, OOL_AREA_START};
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 32 << 20),
            (GuestAddress(OOL_AREA_START.0), OOL_AREA_SIZE as usize),
        ])
        .unwrap()
    }

    /// Writes `value` into the entry for `va` of the table at `table`, which is at `level`
    /// (4 = PML4, 3 = PDPT, 2 = PD).
    pub fn set_entry(mem: &GuestMemoryMmap, table: u64, level: u32, va: u64, value: u64) {
        let index = (va >> (12 + 9 * (level - 1))) & 0x1ff;
        mem.write_obj(value, GuestAddress(table + index * 8)).unwrap();
    }

    /// The entry for `va` of the table at `table` (at `level`).
    pub fn entry(mem: &GuestMemoryMmap, table: u64, level: u32, va: u64) -> u64 {
        let index = (va >> (12 + 9 * (level - 1))) & 0x1ff;
        mem.read_obj(GuestAddress(table + index * 8)).unwrap()
    }

    /// The tables of one address space: top-level table, and the PDPT and page directory
    /// of the kernel image mapping.
    #[derive(Clone, Copy)]
    pub struct Tables {
        pub pml4: u64,
        pub pdpt: u64,
        pub pd: u64,
    }

    /// Maps `start..end` (inside one 1 GiB of the top 2 GiB) with 2 MiB pages at `phys(va)`.
    pub fn map_kernel(mem: &GuestMemoryMmap, t: Tables, start: u64, end: u64, phys: impl Fn(u64) -> u64) {
        let Tables { pml4, pdpt, pd } = t;
        set_entry(mem, pml4, 4, start, pdpt | TABLE);
        set_entry(mem, pdpt, 3, start, pd | TABLE);
        let mut va = start;
        while va < end {
            set_entry(mem, pd, 2, va, phys(va) | TABLE | LARGE);
            va += TWO_MIB;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_tables::*;
    use super::*;

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const END: u64 = 0xffff_ffff_8230_0000;
    /// Where `init_top_pgt` is: in the kernel's .data, loaded at physical 0.
    const INIT_TOP_PGT: u64 = TEXT + 0x120_0000;
    const KERNEL_PML4: u64 = INIT_TOP_PGT - TEXT;

    fn symbols() -> SymbolTable {
        SymbolTable::parse_system_map(&format!(
            "{TEXT:016x} T _text\n{INIT_TOP_PGT:016x} D init_top_pgt\n{END:016x} B _end\n"
        ))
        .unwrap()
    }

    /// The kernel mapped as `cleanup_highmap` leaves it (2 MiB pages, image at physical
    /// 0x100_0000), the out-of-line area's 2 MiB page after it, and a [`LiveKernel`] with
    /// the host's area and the kernel's text.
    fn guarded_kernel() -> (GuestMemoryMmap, LiveKernel) {
        use hvprobe_vmm::layout::{OOL_AREA_SIZE, OOL_AREA_START};
        const PML4: u64 = 0x1000;
        let mem = memory();
        let tables = Tables {
            pml4: PML4,
            pdpt: 0x2000,
            pd: 0x3000,
        };
        map_kernel(&mem, tables, TEXT, END, |va| 0x100_0000 + (va - TEXT));
        set_entry(&mem, tables.pd, 2, OOL_VA, OOL_AREA_START.0 | TABLE | LARGE);
        let kernel = LiveKernel::new(PagedGuestMemory::new(GuestPhys(mem.clone()), PML4, PagingMode::Level4))
            .with_host_area(HostArea {
                gva: Gva(OOL_VA),
                gpa: OOL_AREA_START,
                size: OOL_AREA_SIZE,
            })
            .with_kernel_text(KernelText {
                range: Gva(TEXT)..Gva(END),
                phys_offset: 0x100_0000u64.wrapping_sub(TEXT),
            });
        (mem, kernel)
    }

    /// Where `map_out_of_line_area` puts the area for this kernel (after `_end` and one
    /// free 2 MiB page).
    const OOL_VA: u64 = 0xffff_ffff_8260_0000;
    const PD: u64 = 0x3000;

    fn byte_at(mem: &GuestMemoryMmap, gpa: u64) -> u8 {
        mem.read_obj(GuestAddress(gpa)).unwrap()
    }

    /// The host's writes go where the host means them to, whatever
    /// the guest's tables say: its own area by physical address, and never through a
    /// mapping the guest pointed into that area or away from the kernel's text.
    #[test]
    fn the_guests_tables_cannot_steer_a_host_write() {
        use hvprobe_vmm::layout::OOL_AREA_START;
        let (mem, kernel) = guarded_kernel();
        // Unchanged tables: text and area writes land where they are.
        kernel.write_virt(Gva(TEXT + 0x10), &[0xcc]).unwrap();
        assert_eq!(byte_at(&mem, 0x100_0010), 0xcc);
        kernel.write_virt(Gva(OOL_VA + 0x20), &[0x90]).unwrap();
        assert_eq!(byte_at(&mem, OOL_AREA_START.0 + 0x20), 0x90);

        // The guest points its area mapping at its own RAM: the host's area writes and
        // reads still go to the area.
        set_entry(&mem, PD, 2, OOL_VA, 0x80_0000 | TABLE | LARGE);
        kernel.write_virt(Gva(OOL_VA + 0x21), &[0x91]).unwrap();
        assert_eq!(byte_at(&mem, OOL_AREA_START.0 + 0x21), 0x91);
        assert_eq!(byte_at(&mem, 0x80_0021), 0);
        let mut b = [0u8; 2];
        kernel.read_virt(Gva(OOL_VA + 0x20), &mut b).unwrap();
        assert_eq!(b, [0x90, 0x91]);
        // A write that starts inside the area and runs past its end is an error.
        let past = kernel.write_virt(Gva(OOL_VA + (4 << 20) - 1), &[0; 2]).unwrap_err();
        assert!(matches!(past, MemoryError::PastHostArea { .. }), "{past:?}");

        // The guest maps a text page onto the area: the text write is refused, whole.
        set_entry(&mem, PD, 2, TEXT + 0x20_0000, OOL_AREA_START.0 | TABLE | LARGE);
        let into_area = kernel.write_virt(Gva(TEXT + 0x20_0000), &[0xcc]).unwrap_err();
        assert!(matches!(into_area, MemoryError::ReservedTarget { .. }), "{into_area:?}");
        assert_eq!(byte_at(&mem, OOL_AREA_START.0), 0);

        // The guest maps a text page onto other RAM of its own: refused too.
        set_entry(&mem, PD, 2, TEXT + 0x40_0000, 0x60_0000 | TABLE | LARGE);
        let moved = kernel.write_virt(Gva(TEXT + 0x40_0005), &[0xcc]).unwrap_err();
        assert!(
            matches!(moved, MemoryError::TextMoved { gpa, text, .. } if gpa == Gpa(0x60_0005) && text == Gpa(0x140_0005)),
            "{moved:?}"
        );
        assert_eq!(byte_at(&mem, 0x60_0005), 0);
        // A text page the guest left where it was is written as before.
        kernel.write_virt(Gva(TEXT + 0x60_0000), &[0x55]).unwrap();
        assert_eq!(byte_at(&mem, 0x160_0000), 0x55);
    }

    /// The out-of-line area is written by its physical address
    /// whatever the guest's tables say, and so a text write the engine was steered to an
    /// address there (a forged module's "function") landed in hvprobe's own code. The
    /// text path refuses any byte there, whole; the area's own writes go on.
    #[test]
    fn a_text_write_never_reaches_the_out_of_line_area() {
        use hvprobe_vmm::layout::OOL_AREA_START;
        let (mem, kernel) = guarded_kernel();
        kernel.write_virt(Gva(OOL_VA + 0x800), &[0x90, 0x90]).unwrap();
        for (at, len) in [(OOL_VA + 0x800, 1), (OOL_VA - 1, 2), (OOL_VA + (4 << 20) - 1, 1)] {
            let e = kernel.write_text(Gva(at), &vec![0xcc; len]).unwrap_err();
            assert!(matches!(e, MemoryError::TextIntoHostArea { .. }), "{at:#x}: {e:?}");
        }
        assert_eq!(byte_at(&mem, OOL_AREA_START.0 + 0x800), 0x90);
        assert_eq!(byte_at(&mem, OOL_AREA_START.0), 0);
        // Text is written as before.
        kernel.write_text(Gva(TEXT + 0x10), &[0xcc]).unwrap();
        assert_eq!(byte_at(&mem, 0x100_0010), 0xcc);
    }

    #[test]
    fn a_pti_user_cr3_leads_to_its_kernel_twin_and_from_there_to_init_top_pgt() {
        let mem = memory();
        // A process's kernel-mode table (8 KiB aligned) maps the kernel; its user-mode
        // twin, the next page, maps nothing of it.
        let process_pgd = 0x10_0000;
        let process = Tables {
            pml4: process_pgd,
            pdpt: process_pgd + 0x2000,
            pd: process_pgd + 0x3000,
        };
        map_kernel(&mem, process, TEXT, END, |va| va - TEXT);
        let kernel = Tables {
            pml4: KERNEL_PML4,
            pdpt: KERNEL_PML4 + 0x1000,
            pd: KERNEL_PML4 + 0x2000,
        };
        map_kernel(&mem, kernel, TEXT, END, |va| va - TEXT);
        let user_cr3 = process_pgd | PTI_USER_PGTABLE_BIT;
        let phys = GuestPhys(mem);
        let tables = KernelPageTables::find_through(&phys, user_cr3, PagingMode::Level4, &symbols()).unwrap();
        assert_eq!(tables.root(), Gpa(KERNEL_PML4));

        // Without the symbol, or with tables that do not map it, a clear error.
        let none = SymbolTable::parse_system_map(&format!("{TEXT:016x} T _text\n")).unwrap();
        assert!(matches!(
            KernelPageTables::find_through(&phys, user_cr3, PagingMode::Level4, &none),
            Err(KernelTablesError::NoSymbol)
        ));
        let empty = 0x18_0000;
        let err = KernelPageTables::find_through(&phys, empty, PagingMode::Level4, &symbols()).unwrap_err();
        assert!(
            matches!(
                err,
                KernelTablesError::Unmapped {
                    symbol: Gva(INIT_TOP_PGT),
                    ..
                }
            ),
            "{err}"
        );
    }
}
