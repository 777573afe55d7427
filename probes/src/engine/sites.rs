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
    pub fn read<M: GuestVirtRead + ?Sized>(mem: &M, symbols: &SymbolTable) -> Result<Self, MemoryError> {
        let mut sites = Vec::new();
        if let Some(table) = bounds(symbols, "__start___jump_table", "__stop___jump_table") {
            let mut at = table.start;
            while at.0 + JUMP_ENTRY_SIZE <= table.end.0 {
                let code = mem.read_u32(at)? as i32;
                let site = Gva(at.0.wrapping_add_signed(i64::from(code)));
                let mut bytes = [0u8; 2];
                mem.read_virt(site, &mut bytes)?;
                let len = if is_short_jump_label(&bytes) { 2 } else { 5 };
                sites.push(PatchSite {
                    range: site..Gva(site.0 + len),
                    kind: PatchSiteKind::JumpLabel,
                });
                at = Gva(at.0 + JUMP_ENTRY_SIZE);
            }
        }
        if let Some(table) = bounds(symbols, "__start_static_call_sites", "__stop_static_call_sites") {
            let mut at = table.start;
            while at.0 + STATIC_CALL_SITE_SIZE <= table.end.0 {
                let rel = mem.read_u32(at)? as i32;
                let site = Gva(at.0.wrapping_add_signed(i64::from(rel)));
                sites.push(PatchSite {
                    range: site..Gva(site.0 + 5),
                    kind: PatchSiteKind::StaticCall,
                });
                at = Gva(at.0 + STATIC_CALL_SITE_SIZE);
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

fn bounds(symbols: &SymbolTable, start: &str, stop: &str) -> Option<Range<Gva>> {
    let start = symbols.lookup(start)?.addr;
    let stop = symbols.lookup(stop)?.addr;
    (start <= stop).then_some(start..stop)
}
