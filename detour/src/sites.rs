//! Places where the guest rewrites its own text (besides ftrace's entry NOPs, which the
//! engine recognises by their bytes): jump labels and static calls. The guest checks the
//! bytes it expects before it patches them, so an int3 of ours there breaks it.

use std::fmt;
use std::ops::Range;

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::symbols::SymbolTable;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchSiteKind {
    JumpLabel,
    StaticCall,
}

impl fmt::Display for PatchSiteKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PatchSiteKind::JumpLabel => "jump label",
            PatchSiteKind::StaticCall => "static call",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PatchSite {
    pub range: Range<Gva>,
    pub kind: PatchSiteKind,
}

/// Sorted, non-overlapping patch sites.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PatchSites {
    sites: Vec<PatchSite>,
}

/// Why the patch-site tables could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PatchSitesError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The guest's table bounds (its own symbols in kallsyms mode) give a table larger than
    /// any kernel has: probes cannot be checked against it, so the tracer does not start.
    #[error("{table} is {len:#x} bytes, over its limit of {limit:#x} bytes (hostile or corrupt guest symbols?)")]
    OverBudget { table: &'static str, len: u64, limit: u64 },
    #[error("a {table} site at {site} runs past the end of the address space")]
    Wraps { table: &'static str, site: Gva },
}

/// The largest patch-site table read: a distro kernel's `__jump_table` has ~40k 16-byte
/// entries (~640 KiB) and its `.static_call_sites` a few thousand 8-byte ones; 16 MiB is
/// 25 times the larger. Without a limit, bounds from a hostile guest's symbols over a page
/// it maps everywhere would make the host read sites for ever.
pub const MAX_SITE_TABLE_BYTES: u64 = 16 << 20;

/// `struct jump_entry` on x86-64: s32 code, s32 target, long key (all relative).
const JUMP_ENTRY_SIZE: u64 = 16;
/// `struct static_call_site`: s32 addr, s32 key.
const STATIC_CALL_SITE_SIZE: u64 = 8;
/// A 2-byte jump label site: `jmp rel8` or the 2-byte NOP `66 90`.
fn is_short_jump_label(bytes: &[u8]) -> bool {
    matches!(bytes, [0xeb, _, ..] | [0x66, 0x90, ..])
}

impl PatchSites {
    pub fn from_sites(mut sites: Vec<PatchSite>) -> Self {
        sites.sort_by_key(|s| s.range.start);
        PatchSites { sites }
    }

    /// Reads `__jump_table` and `.static_call_sites` from guest memory. A kernel without
    /// one of them simply has no such sites.
    pub fn read<M: GuestVirtRead + ?Sized>(mem: &M, symbols: &SymbolTable) -> Result<Self, PatchSitesError> {
        let jump_table = bounds(symbols, "__jump_table", "__start___jump_table", "__stop___jump_table")?;
        let static_calls = bounds(
            symbols,
            ".static_call_sites",
            "__start_static_call_sites",
            "__stop_static_call_sites",
        )?;
        Self::read_tables(mem, jump_table, static_calls)
    }

    /// The sites of a jump table and a static-call site table at these bytes (a module's:
    /// `mod->jump_entries`, `mod->static_call_sites`; or the kernel's).
    pub fn read_tables<M: GuestVirtRead + ?Sized>(
        mem: &M,
        jump_table: Option<Range<Gva>>,
        static_calls: Option<Range<Gva>>,
    ) -> Result<Self, PatchSitesError> {
        for (table, range) in [("__jump_table", &jump_table), (".static_call_sites", &static_calls)] {
            if let Some(r) = range {
                let len = r.end.0.saturating_sub(r.start.0);
                if len > MAX_SITE_TABLE_BYTES {
                    return Err(PatchSitesError::OverBudget {
                        table,
                        len,
                        limit: MAX_SITE_TABLE_BYTES,
                    });
                }
            }
        }
        let mut sites = Vec::new();
        if let Some(table) = jump_table {
            for at in entries(&table, JUMP_ENTRY_SIZE) {
                let code = mem.read_u32(at)? as i32;
                let site = Gva(at.0.wrapping_add_signed(i64::from(code)));
                let mut bytes = [0u8; 2];
                mem.read_virt(site, &mut bytes)?;
                let len = if is_short_jump_label(&bytes) { 2 } else { 5 };
                sites.push(PatchSite {
                    range: site..end_of("__jump_table", site, len)?,
                    kind: PatchSiteKind::JumpLabel,
                });
            }
        }
        if let Some(table) = static_calls {
            for at in entries(&table, STATIC_CALL_SITE_SIZE) {
                let rel = mem.read_u32(at)? as i32;
                let site = Gva(at.0.wrapping_add_signed(i64::from(rel)));
                sites.push(PatchSite {
                    range: site..end_of(".static_call_sites", site, 5)?,
                    kind: PatchSiteKind::StaticCall,
                });
            }
        }
        Ok(Self::from_sites(sites))
    }

    pub fn len(&self) -> usize {
        self.sites.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sites.is_empty()
    }

    /// The site whose bytes include `gva`.
    pub fn containing(&self, gva: Gva) -> Option<&PatchSite> {
        let i = self.sites.partition_point(|s| s.range.start <= gva);
        let site = self.sites.get(i.checked_sub(1)?)?;
        site.range.contains(&gva).then_some(site)
    }
}

/// The table between the symbols `start` and `stop`: `None` when the kernel has none (or
/// the bounds are reversed), an error when it is over [`MAX_SITE_TABLE_BYTES`].
fn bounds(
    symbols: &SymbolTable,
    table: &'static str,
    start: &str,
    stop: &str,
) -> Result<Option<Range<Gva>>, PatchSitesError> {
    let (Some(start), Some(stop)) = (symbols.lookup(start), symbols.lookup(stop)) else {
        return Ok(None);
    };
    let (start, stop) = (start.addr, stop.addr);
    let Some(len) = stop.0.checked_sub(start.0) else {
        return Ok(None);
    };
    if len > MAX_SITE_TABLE_BYTES {
        return Err(PatchSitesError::OverBudget {
            table,
            len,
            limit: MAX_SITE_TABLE_BYTES,
        });
    }
    Ok(Some(start..stop))
}

/// The addresses of the whole `size`-byte entries of `table` (whose length is bounded, so
/// no address here overflows).
fn entries(table: &Range<Gva>, size: u64) -> impl Iterator<Item = Gva> {
    let count = (table.end.0 - table.start.0) / size;
    let start = table.start.0;
    (0..count).map(move |i| Gva(start + i * size))
}

/// The end of a `len`-byte site at `site` (a guest-derived address).
fn end_of(table: &'static str, site: Gva, len: u64) -> Result<Gva, PatchSitesError> {
    site.0
        .checked_add(len)
        .map(Gva)
        .ok_or(PatchSitesError::Wraps { table, site })
}

#[cfg(test)]
mod tests {
    //! Tables as a hostile guest could lay them out.

    use super::*;
    use hvprobe_introspection::memory::SparseMemory;

    fn symbols(pairs: &[(&str, u64)]) -> SymbolTable {
        let map: String = pairs.iter().map(|(n, a)| format!("{a:016x} D {n}\n")).collect();
        SymbolTable::parse_system_map(&map).unwrap()
    }

    /// One jump entry whose 5-byte site starts 3 bytes below 2^64: its end overflowed (a
    /// panic in a debug build). Now a clear error.
    #[test]
    fn a_site_at_the_top_of_the_address_space_is_an_error() {
        let table = 0xffff_ffff_8200_0000u64;
        let mut mem = SparseMemory::new();
        let site = u64::MAX - 3;
        mem.put_u32(table, site.wrapping_sub(table) as u32);
        mem.write(site, &[0x0f]);
        let syms = symbols(&[("__start___jump_table", table), ("__stop___jump_table", table + 16)]);
        let r = PatchSites::read(&mem, &syms);
        assert!(matches!(r, Err(PatchSitesError::Wraps { .. })), "{r:?}");
        // A static call site 2 bytes below the top: the same.
        let mut mem = SparseMemory::new();
        mem.put_u32(table, (u64::MAX - 2).wrapping_sub(table) as u32);
        let syms = symbols(&[
            ("__start_static_call_sites", table),
            ("__stop_static_call_sites", table + 8),
        ]);
        let r = PatchSites::read(&mem, &syms);
        assert!(matches!(r, Err(PatchSitesError::Wraps { .. })), "{r:?}");
    }

    /// Table bounds 2^62 bytes apart over one page mapped everywhere (here: the first
    /// entry's page, the read failing after it) were followed entry by entry; over the
    /// limit is an error before any read, naming the table and the limit.
    #[test]
    fn a_table_over_the_limit_is_refused_before_reading() {
        let table = 0x8000_0000_0000_0000u64;
        let syms = symbols(&[
            ("__start___jump_table", table),
            ("__stop___jump_table", table + (1 << 62)),
        ]);
        match PatchSites::read(&SparseMemory::new(), &syms) {
            Err(PatchSitesError::OverBudget { table, limit, .. }) => {
                assert_eq!((table, limit), ("__jump_table", MAX_SITE_TABLE_BYTES));
            }
            other => panic!("expected the table limit, got {other:?}"),
        }
        // At the limit, the table is read (and here fails on the unmapped memory).
        let syms = symbols(&[
            ("__start___jump_table", table),
            ("__stop___jump_table", table + MAX_SITE_TABLE_BYTES),
        ]);
        assert!(matches!(
            PatchSites::read(&SparseMemory::new(), &syms),
            Err(PatchSitesError::Memory(_))
        ));
    }
}
