//! x86-64 page tables: the 4- and 5-level walk from a CR3 value, as the CPU does it.
//!
//! The walk only needs to read guest-physical memory, so it takes a small [`PhysRead`]
//! trait instead of a memory backend: this crate stays free of vm-memory and the walk can
//! be tested against synthetic page tables.
//!
//! Assumptions that hold for a 64-bit Linux guest: long mode with PAE, `EFER.NXE` set (bit
//! 63 of every entry is the execute-disable bit, not a reserved bit), and no protection
//! keys considered (bits 62:59 are ignored here).

use std::fmt;

use crate::{Gpa, Gva};

/// Why guest-physical memory could not be read or written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PhysAccessError {
    /// Some of the bytes are not guest memory: no RAM or device memory backs them.
    #[error("{len} bytes at {gpa} are not guest memory")]
    NotMemory { gpa: Gpa, len: usize },
    /// The bytes are guest memory, but its backend could not make the access (an atomic
    /// access that is not aligned, a range split across two of its regions), for the
    /// reason it gave.
    /// (The caller names the address: the access it made is its context.)
    #[error("the memory's backend failed: {0}")]
    Backend(#[source] std::sync::Arc<dyn std::error::Error + Send + Sync>),
}

/// Two backend failures are equal when they give the same reason.
impl PartialEq for PhysAccessError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (PhysAccessError::NotMemory { gpa, len }, PhysAccessError::NotMemory { gpa: g, len: l }) => {
                gpa == g && len == l
            }
            (PhysAccessError::Backend(source), PhysAccessError::Backend(s)) => source.to_string() == s.to_string(),
            _ => false,
        }
    }
}

impl Eq for PhysAccessError {}

impl PhysAccessError {
    /// The backend's own `error`.
    pub fn backend(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        PhysAccessError::Backend(std::sync::Arc::new(error))
    }
}

/// Reads guest-physical memory; the walk wraps a failure with the address and level.
pub trait PhysRead {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), PhysAccessError>;
}

/// Writes guest-physical memory (text patching goes through the page walk to here).
pub trait PhysWrite {
    fn write_phys(&self, gpa: Gpa, data: &[u8]) -> Result<(), PhysAccessError>;
}

impl<T: PhysRead + ?Sized> PhysRead for &T {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), PhysAccessError> {
        (**self).read_phys(gpa, buf)
    }
}

impl<T: PhysWrite + ?Sized> PhysWrite for &T {
    fn write_phys(&self, gpa: Gpa, data: &[u8]) -> Result<(), PhysAccessError> {
        (**self).write_phys(gpa, data)
    }
}

/// Page-table entry bits.
pub mod pte {
    pub const PRESENT: u64 = 1 << 0;
    pub const WRITABLE: u64 = 1 << 1;
    pub const USER: u64 = 1 << 2;
    pub const ACCESSED: u64 = 1 << 5;
    pub const DIRTY: u64 = 1 << 6;
    /// Page size: in a PDPTE maps a 1 GiB page, in a PDE a 2 MiB page.
    pub const HUGE: u64 = 1 << 7;
    pub const GLOBAL: u64 = 1 << 8;
    pub const NX: u64 = 1 << 63;
    /// Bits 51:12: the next table's (or a 4 KiB page's) physical address, before the
    /// MAXPHYADDR limit is applied.
    pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
}

/// `CR4.LA57`: 5-level paging.
pub const CR4_LA57: u64 = 1 << 12;

/// How many levels of page tables the guest uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PagingMode {
    /// 4-level paging, 48-bit virtual addresses.
    Level4,
    /// 5-level paging (`CR4.LA57`), 57-bit virtual addresses.
    Level5,
}

impl PagingMode {
    /// The mode a vCPU with this CR4 value walks with.
    pub const fn from_cr4(cr4: u64) -> Self {
        if cr4 & CR4_LA57 != 0 {
            PagingMode::Level5
        } else {
            PagingMode::Level4
        }
    }

    /// Number of table levels (4 or 5).
    pub const fn levels(self) -> u8 {
        match self {
            PagingMode::Level4 => 4,
            PagingMode::Level5 => 5,
        }
    }

    /// Number of implemented virtual-address bits (48 or 57).
    pub const fn va_bits(self) -> u32 {
        match self {
            PagingMode::Level4 => 48,
            PagingMode::Level5 => 57,
        }
    }

    /// Whether `gva` is canonical: bits 63 down to the top implemented bit all equal.
    pub const fn is_canonical(self, gva: Gva) -> bool {
        let shift = 64 - self.va_bits();
        (((gva.0 << shift) as i64) >> shift) as u64 == gva.0
    }
}

impl fmt::Display for PagingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PagingMode::Level4 => f.write_str("4-level paging"),
            PagingMode::Level5 => f.write_str("5-level paging"),
        }
    }
}

/// The size of the page a translation ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageSize {
    Size4K,
    Size2M,
    Size1G,
}

impl PageSize {
    pub const fn bytes(self) -> u64 {
        match self {
            PageSize::Size4K => 0x1000,
            PageSize::Size2M => 0x20_0000,
            PageSize::Size1G => 0x4000_0000,
        }
    }
}

/// What the whole walk allows: the CPU combines the bits of every level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Permissions {
    /// Always true for a successful translation; kept so callers can report it.
    pub present: bool,
    /// R/W set at every level.
    pub writable: bool,
    /// U/S set at every level (user-accessible).
    pub user: bool,
    /// NX clear at every level.
    pub executable: bool,
}

/// A successful walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translation {
    pub gva: Gva,
    pub gpa: Gpa,
    pub page_size: PageSize,
    pub permissions: Permissions,
    /// The entry that mapped the page (PTE, or a PDE/PDPTE with PS set).
    pub leaf_entry: u64,
    /// The level of that entry: 1 = PT, 2 = PD, 3 = PDPT.
    pub leaf_level: u8,
}

impl Translation {
    /// The guest-physical address of the first byte of the page.
    pub const fn page_base(&self) -> Gpa {
        Gpa(self.gpa.0 & !(self.page_size.bytes() - 1))
    }

    /// Bytes from `gva` to the end of its page (at least 1).
    pub const fn bytes_to_page_end(&self) -> u64 {
        self.page_size.bytes() - (self.gva.0 & (self.page_size.bytes() - 1))
    }
}

/// Why a walk failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WalkError {
    #[error("virtual address {gva} is not canonical under {mode}")]
    NonCanonical { gva: Gva, mode: PagingMode },
    #[error("virtual address {gva} is not mapped: {} entry {entry:#x} at {entry_gpa} is not present", level_name(*.level))]
    NotPresent {
        gva: Gva,
        level: u8,
        entry: u64,
        entry_gpa: Gpa,
    },
    #[error("virtual address {gva}: {} entry {entry:#x} at {entry_gpa} has reserved bits {bits:#x} set", level_name(*.level))]
    ReservedBits {
        gva: Gva,
        level: u8,
        entry: u64,
        entry_gpa: Gpa,
        bits: u64,
    },
    #[error("virtual address {gva}: CR3 {cr3:#x} has reserved bits {bits:#x} set")]
    ReservedCr3 { gva: Gva, cr3: u64, bits: u64 },
    #[error("virtual address {gva}: reading the {} entry at {entry_gpa} failed: {source}", level_name(*.level))]
    PhysRead {
        gva: Gva,
        level: u8,
        entry_gpa: Gpa,
        #[source]
        source: PhysAccessError,
    },
}

/// The SDM's name for the table at `level` (5 = PML5 … 1 = PT).
pub const fn level_name(level: u8) -> &'static str {
    match level {
        5 => "PML5",
        4 => "PML4",
        3 => "PDPT",
        2 => "PD",
        1 => "PT",
        _ => "unknown-level",
    }
}

/// Walks page tables. `max_phys_bits` (the CPU's MAXPHYADDR, CPUID 0x80000008 EAX[7:0])
/// decides which address bits are reserved; 52, the architectural maximum, accepts every
/// address a guest can use, so it is the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageWalker {
    mode: PagingMode,
    max_phys_bits: u8,
}

impl PageWalker {
    pub const fn new(mode: PagingMode) -> Self {
        PageWalker {
            mode,
            max_phys_bits: 52,
        }
    }

    /// Use the guest CPU's MAXPHYADDR (clamped to 32..=52) for the reserved-bit checks.
    pub const fn with_max_phys_bits(mut self, bits: u8) -> Self {
        self.max_phys_bits = if bits < 32 {
            32
        } else if bits > 52 {
            52
        } else {
            bits
        };
        self
    }

    pub const fn mode(&self) -> PagingMode {
        self.mode
    }

    /// Address bits 51:MAXPHYADDR, which must be zero in every entry and in CR3.
    const fn high_reserved(&self) -> u64 {
        pte::ADDR_MASK & !((1u64 << self.max_phys_bits) - 1)
    }

    /// Translates `gva` through the tables rooted at `cr3`.
    pub fn translate<M: PhysRead + ?Sized>(&self, mem: &M, cr3: u64, gva: Gva) -> Result<Translation, WalkError> {
        if !self.mode.is_canonical(gva) {
            return Err(WalkError::NonCanonical { gva, mode: self.mode });
        }
        let high_reserved = self.high_reserved();
        // CR3 bits 11:0 are PCID or PWT/PCD, bit 63 is the no-flush hint on writes: none
        // of them is part of the table address.
        let cr3_reserved = cr3 & high_reserved;
        if cr3_reserved != 0 {
            return Err(WalkError::ReservedCr3 {
                gva,
                cr3,
                bits: cr3_reserved,
            });
        }
        let mut table = cr3 & pte::ADDR_MASK;
        let mut writable = true;
        let mut user = true;
        let mut executable = true;

        let mut level = self.mode.levels();
        loop {
            let index = (gva.0 >> (12 + 9 * (u32::from(level) - 1))) & 0x1ff;
            let entry_gpa = Gpa(table + index * 8);
            let mut raw = [0u8; 8];
            mem.read_phys(entry_gpa, &mut raw)
                .map_err(|source| WalkError::PhysRead {
                    gva,
                    level,
                    entry_gpa,
                    source,
                })?;
            let entry = u64::from_le_bytes(raw);
            if entry & pte::PRESENT == 0 {
                return Err(WalkError::NotPresent {
                    gva,
                    level,
                    entry,
                    entry_gpa,
                });
            }
            let huge = entry & pte::HUGE != 0;
            let reserved = entry
                & (high_reserved
                    | match (level, huge) {
                        // PS is reserved in PML5E and PML4E.
                        (4 | 5, _) => pte::HUGE,
                        // A 1 GiB page's address is 1 GiB aligned: bits 29:13 must be zero
                        // (bit 12 is PAT).
                        (3, true) => 0x3fff_e000,
                        // A 2 MiB page's bits 20:13 must be zero.
                        (2, true) => 0x1f_e000,
                        _ => 0,
                    });
            if reserved != 0 {
                return Err(WalkError::ReservedBits {
                    gva,
                    level,
                    entry,
                    entry_gpa,
                    bits: reserved,
                });
            }
            writable &= entry & pte::WRITABLE != 0;
            user &= entry & pte::USER != 0;
            executable &= entry & pte::NX == 0;

            let leaf_size = match (level, huge) {
                (1, _) => Some(PageSize::Size4K),
                (2, true) => Some(PageSize::Size2M),
                (3, true) => Some(PageSize::Size1G),
                _ => None,
            };
            if let Some(page_size) = leaf_size {
                let offset_mask = page_size.bytes() - 1;
                let base = entry & pte::ADDR_MASK & !offset_mask;
                return Ok(Translation {
                    gva,
                    gpa: Gpa(base | (gva.0 & offset_mask)),
                    page_size,
                    permissions: Permissions {
                        present: true,
                        writable,
                        user,
                        executable,
                    },
                    leaf_entry: entry,
                    leaf_level: level,
                });
            }
            table = entry & pte::ADDR_MASK;
            // Level 1 always returned above, so this never goes below 1.
            level -= 1;
        }
    }
}

/// Translates `gva` with default settings (MAXPHYADDR 52).
pub fn translate<M: PhysRead + ?Sized>(
    mem: &M,
    cr3: u64,
    mode: PagingMode,
    gva: Gva,
) -> Result<Translation, WalkError> {
    PageWalker::new(mode).translate(mem, cr3, gva)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// Sparse guest-physical memory: 8-byte-aligned words, absent words read as an error
    /// (so a walk that wanders off the synthetic tables fails loudly).
    #[derive(Default)]
    struct FakeMem {
        words: RefCell<HashMap<u64, u64>>,
        next_table: RefCell<u64>,
    }

    impl PhysRead for FakeMem {
        fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), PhysAccessError> {
            if gpa.0 & 7 != 0 || buf.len() != 8 {
                return Err(PhysAccessError::NotMemory { gpa, len: buf.len() });
            }
            match self.words.borrow().get(&gpa.0) {
                Some(w) => {
                    buf.copy_from_slice(&w.to_le_bytes());
                    Ok(())
                }
                None => Err(PhysAccessError::NotMemory { gpa, len: buf.len() }),
            }
        }
    }

    const P: u64 = pte::PRESENT;
    const W: u64 = pte::WRITABLE;
    const U: u64 = pte::USER;
    const PS: u64 = pte::HUGE;
    const NX: u64 = pte::NX;

    impl FakeMem {
        /// A fresh zeroed (all not-present) table; returns its physical address.
        fn table(&self) -> u64 {
            let mut next = self.next_table.borrow_mut();
            if *next == 0 {
                *next = 0x10_0000;
            }
            let base = *next;
            *next += 0x1000;
            let mut words = self.words.borrow_mut();
            for i in 0..512 {
                words.insert(base + i * 8, 0);
            }
            base
        }

        fn set(&self, table: u64, index: u64, entry: u64) {
            self.words.borrow_mut().insert(table + index * 8, entry);
        }

        /// Maps `gva` through fresh tables from `root` down to `leaf_level`, with `flags[i]`
        /// on the entry of level (top - i); the leaf points at `target`.
        fn map(&self, root: u64, mode: PagingMode, gva: u64, leaf_level: u8, target: u64, flags: &[u64]) {
            let mut table = root;
            for (i, level) in (leaf_level..=mode.levels()).rev().enumerate() {
                let index = (gva >> (12 + 9 * (u32::from(level) - 1))) & 0x1ff;
                let existing = self.words.borrow().get(&(table + index * 8)).copied().unwrap_or(0);
                if level == leaf_level {
                    let ps = if level > 1 { PS } else { 0 };
                    self.set(table, index, target | flags[i] | ps);
                } else if existing & P != 0 {
                    table = existing & pte::ADDR_MASK;
                } else {
                    let next = self.table();
                    self.set(table, index, next | flags[i]);
                    table = next;
                }
            }
        }
    }

    const KERNEL_VA: u64 = 0xffff_ffff_8100_0000;

    #[test]
    fn four_kib_page_translates_with_offset() {
        let m = FakeMem::default();
        let root = m.table();
        m.map(
            root,
            PagingMode::Level4,
            KERNEL_VA,
            1,
            0x123_4000,
            &[P | W, P | W, P | W, P],
        );
        let t = translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA + 0x567)).expect("mapped");
        assert_eq!(t.gpa, Gpa(0x123_4567));
        assert_eq!(t.page_size, PageSize::Size4K);
        assert_eq!(t.leaf_level, 1);
        assert_eq!(t.page_base(), Gpa(0x123_4000));
        assert_eq!(t.bytes_to_page_end(), 0x1000 - 0x567);
        assert!(!t.permissions.writable, "leaf is read-only");
        assert!(!t.permissions.user);
        assert!(t.permissions.executable);
        assert!(t.permissions.present);
    }

    #[test]
    fn two_mib_page_translates_with_offset() {
        let m = FakeMem::default();
        let root = m.table();
        m.map(
            root,
            PagingMode::Level4,
            KERNEL_VA,
            2,
            0x4000_0000,
            &[P | W, P | W, P | W],
        );
        let t = translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA + 0x1f_fff8)).expect("mapped");
        assert_eq!(t.gpa, Gpa(0x401f_fff8));
        assert_eq!(t.page_size, PageSize::Size2M);
        assert_eq!(t.leaf_level, 2);
        assert_eq!(t.bytes_to_page_end(), 8);
        assert!(t.permissions.writable);
    }

    #[test]
    fn one_gib_page_translates_with_offset() {
        let m = FakeMem::default();
        let root = m.table();
        let va = 0xffff_8880_0000_0000; // direct map
        m.map(root, PagingMode::Level4, va, 3, 0x1_4000_0000, &[P | W, P | W | NX]);
        let t = translate(&m, root, PagingMode::Level4, Gva(va + 0x3fff_ffff)).expect("mapped");
        assert_eq!(t.gpa, Gpa(0x1_7fff_ffff));
        assert_eq!(t.page_size, PageSize::Size1G);
        assert_eq!(t.leaf_level, 3);
        assert!(!t.permissions.executable);
        assert!(t.permissions.writable);
    }

    #[test]
    fn nx_at_any_level_makes_the_page_non_executable() {
        for nx_level in 0..4 {
            let m = FakeMem::default();
            let root = m.table();
            let mut flags = [P | W; 4];
            flags[nx_level] |= NX;
            m.map(root, PagingMode::Level4, KERNEL_VA, 1, 0x5000, &flags);
            let t = translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)).expect("mapped");
            assert!(!t.permissions.executable, "NX on level {}", 4 - nx_level);
            assert!(t.permissions.writable);
        }
        let m = FakeMem::default();
        let root = m.table();
        m.map(root, PagingMode::Level4, KERNEL_VA, 1, 0x5000, &[P | W; 4]);
        assert!(
            translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA))
                .expect("mapped")
                .permissions
                .executable
        );
    }

    #[test]
    fn read_only_at_any_level_makes_the_page_read_only() {
        for ro_level in 0..3 {
            let m = FakeMem::default();
            let root = m.table();
            let mut flags = [P | W; 3];
            flags[ro_level] = P;
            m.map(root, PagingMode::Level4, KERNEL_VA, 2, 0x20_0000, &flags);
            let t = translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)).expect("mapped");
            assert!(!t.permissions.writable, "R/O on entry {ro_level}");
        }
    }

    #[test]
    fn user_needs_us_at_every_level() {
        let m = FakeMem::default();
        let root = m.table();
        let user_va = 0x40_0000;
        m.map(root, PagingMode::Level4, user_va, 1, 0x7000, &[P | W | U; 4]);
        let t = translate(&m, root, PagingMode::Level4, Gva(user_va)).expect("mapped");
        assert!(t.permissions.user);

        let m = FakeMem::default();
        let root = m.table();
        m.map(
            root,
            PagingMode::Level4,
            user_va,
            1,
            0x7000,
            &[P | W | U, P | W | U, P | W, P | W | U],
        );
        let t = translate(&m, root, PagingMode::Level4, Gva(user_va)).expect("mapped");
        assert!(!t.permissions.user, "supervisor-only PD entry");
    }

    #[test]
    fn not_present_reports_the_level_and_the_entry() {
        // Build a complete 4 KiB mapping, then clear the present bit at each level in turn.
        for level in 1..=4u8 {
            let m = FakeMem::default();
            let root = m.table();
            m.map(root, PagingMode::Level4, KERNEL_VA, 1, 0x9000, &[P | W; 4]);
            // Walk down to the table of `level` to find the entry's address.
            let mut table = root;
            for l in (level + 1..=4).rev() {
                let index = (KERNEL_VA >> (12 + 9 * (u32::from(l) - 1))) & 0x1ff;
                table = m.words.borrow()[&(table + index * 8)] & pte::ADDR_MASK;
            }
            let index = (KERNEL_VA >> (12 + 9 * (u32::from(level) - 1))) & 0x1ff;
            let old = m.words.borrow()[&(table + index * 8)];
            m.set(table, index, old & !P);
            match translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)) {
                Err(WalkError::NotPresent {
                    level: l,
                    entry,
                    entry_gpa,
                    gva,
                }) => {
                    assert_eq!(l, level);
                    assert_eq!(entry, old & !P);
                    assert_eq!(entry_gpa, Gpa(table + index * 8));
                    assert_eq!(gva, Gva(KERNEL_VA));
                }
                other => panic!("level {level}: expected NotPresent, got {other:?}"),
            }
        }
    }

    #[test]
    fn not_present_message_names_the_table() {
        let m = FakeMem::default();
        let root = m.table();
        let err = translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)).unwrap_err();
        assert!(err.to_string().contains("PML4 entry 0x0"), "{err}");
    }

    #[test]
    fn five_level_walk_uses_bits_56_to_48() {
        let m = FakeMem::default();
        let root = m.table();
        // An address only 5-level paging can express (bit 55 set, sign-extended from 56).
        let va = 0xff80_1234_5678_9000;
        assert!(!PagingMode::Level4.is_canonical(Gva(va)));
        m.map(root, PagingMode::Level5, va, 1, 0xabc_d000, &[P | W; 5]);
        let t = translate(&m, root, PagingMode::Level5, Gva(va + 0x10)).expect("mapped");
        assert_eq!(t.gpa, Gpa(0xabc_d010));
        // The PML5 index really was used: a different PML5 slot is not mapped.
        let other = 0xff00_1234_5678_9000;
        match translate(&m, root, PagingMode::Level5, Gva(other)) {
            Err(WalkError::NotPresent { level: 5, .. }) => {}
            r => panic!("expected a PML5 miss, got {r:?}"),
        }
        // With 5 levels a 2 MiB and a 1 GiB page still work.
        m.map(root, PagingMode::Level5, KERNEL_VA, 2, 0x20_0000, &[P | W; 4]);
        let t = translate(&m, root, PagingMode::Level5, Gva(KERNEL_VA + 5)).expect("mapped");
        assert_eq!((t.gpa, t.page_size), (Gpa(0x20_0005), PageSize::Size2M));
    }

    #[test]
    fn non_canonical_addresses_are_rejected_before_any_read() {
        let m = FakeMem::default(); // empty: any read would be a PhysRead error
        for va in [0x0000_8000_0000_0000u64, 0xffff_7fff_ffff_ffff, 0x1234_0000_0000_0000] {
            assert_eq!(
                translate(&m, 0x1000, PagingMode::Level4, Gva(va)),
                Err(WalkError::NonCanonical {
                    gva: Gva(va),
                    mode: PagingMode::Level4
                })
            );
        }
        assert!(PagingMode::Level4.is_canonical(Gva(0x0000_7fff_ffff_ffff)));
        assert!(PagingMode::Level4.is_canonical(Gva(0xffff_8000_0000_0000)));
        assert!(PagingMode::Level5.is_canonical(Gva(0xff00_0000_0000_0000)));
        assert!(!PagingMode::Level5.is_canonical(Gva(0x0100_0000_0000_0000)));
    }

    #[test]
    fn reserved_bits_are_reported() {
        // PS in a PML4 entry.
        let m = FakeMem::default();
        let root = m.table();
        m.map(root, PagingMode::Level4, KERNEL_VA, 1, 0x9000, &[P | W; 4]);
        let index = (KERNEL_VA >> 39) & 0x1ff;
        let old = m.words.borrow()[&(root + index * 8)];
        m.set(root, index, old | PS);
        match translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)) {
            Err(WalkError::ReservedBits { level: 4, bits, .. }) => assert_eq!(bits, PS),
            r => panic!("expected reserved PS, got {r:?}"),
        }
        // An unaligned 2 MiB page address.
        let m = FakeMem::default();
        let root = m.table();
        m.map(root, PagingMode::Level4, KERNEL_VA, 2, 0x20_2000, &[P | W; 3]);
        match translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)) {
            Err(WalkError::ReservedBits { level: 2, bits, .. }) => assert_eq!(bits, 0x2000),
            r => panic!("expected reserved 2 MiB bits, got {r:?}"),
        }
        // Address bits above MAXPHYADDR.
        let m = FakeMem::default();
        let root = m.table();
        m.map(root, PagingMode::Level4, KERNEL_VA, 1, 0x80_0000_0000, &[P | W; 4]);
        let walker = PageWalker::new(PagingMode::Level4).with_max_phys_bits(39);
        match walker.translate(&m, root, Gva(KERNEL_VA)) {
            Err(WalkError::ReservedBits { level: 1, bits, .. }) => assert_eq!(bits, 0x80_0000_0000),
            r => panic!("expected reserved address bits, got {r:?}"),
        }
        assert!(PageWalker::new(PagingMode::Level4)
            .translate(&m, root, Gva(KERNEL_VA))
            .is_ok());
        match walker.translate(&m, root | (1 << 45), Gva(KERNEL_VA)) {
            Err(WalkError::ReservedCr3 { bits, .. }) => assert_eq!(bits, 1 << 45),
            r => panic!("expected reserved CR3 bits, got {r:?}"),
        }
    }

    #[test]
    fn cr3_low_bits_are_not_part_of_the_table_address() {
        let m = FakeMem::default();
        let root = m.table();
        m.map(root, PagingMode::Level4, KERNEL_VA, 1, 0x9000, &[P | W; 4]);
        // PCID 0x5 in bits 11:0.
        let t = translate(&m, root | 0x5, PagingMode::Level4, Gva(KERNEL_VA)).expect("mapped");
        assert_eq!(t.gpa, Gpa(0x9000));
    }

    #[test]
    fn physical_read_failures_carry_the_reason() {
        let m = FakeMem::default();
        let root = m.table();
        let index = (KERNEL_VA >> 39) & 0x1ff;
        m.set(root, index, 0xdead_0000 | P | W); // points at memory that does not exist
        match translate(&m, root, PagingMode::Level4, Gva(KERNEL_VA)) {
            Err(WalkError::PhysRead {
                level: 3,
                source: PhysAccessError::NotMemory { .. },
                ..
            }) => {}
            r => panic!("expected a PDPT read failure, got {r:?}"),
        }
    }

    #[test]
    fn mode_from_cr4() {
        assert_eq!(PagingMode::from_cr4(0x3406f0), PagingMode::Level4);
        assert_eq!(PagingMode::from_cr4(0x3406f0 | CR4_LA57), PagingMode::Level5);
    }
}
