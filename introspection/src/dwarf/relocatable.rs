//! The DWARF of a relocatable object (a kernel module's `.ko`): its debug sections refer
//! to code and to each other through relocations the module loader never applies (it
//! does not load them). Here each allocated section gets an address — laid out one after
//! the other from [`FIRST_ADDRESS`] — and the debug sections' relocations are applied
//! against those addresses, so that every address in the DWARF is a place in one
//! section, and the object's own symbols ([`Layout::symbols`]) name it.

use goblin::elf::section_header::SHF_ALLOC;
use goblin::elf::sym::{STB_GLOBAL, STB_WEAK, STT_FUNC, STT_OBJECT};
use goblin::elf::Elf;

use super::DwarfError;
use crate::symbols::{Symbol, SymbolSource, SymbolTable};
use hvprobe_arch::Gva;

/// Where the first allocated section goes (not 0: an address of 0 means "none" in DWARF).
const FIRST_ADDRESS: u64 = 0x1000;

/// x86-64 relocation types found in a module's debug sections.
const R_X86_64_NONE: u32 = 0;
const R_X86_64_64: u32 = 1;
const R_X86_64_PC32: u32 = 2;
const R_X86_64_32: u32 = 10;
const R_X86_64_32S: u32 = 11;
const R_X86_64_PC64: u32 = 24;

/// Each section's address (0 for a section that is not loaded, as a debug section's own
/// offsets are 0-based).
pub(super) struct Layout {
    base: Vec<u64>,
}

impl Layout {
    pub(super) fn of(elf: &Elf) -> Layout {
        let mut next = FIRST_ADDRESS;
        let base = elf
            .section_headers
            .iter()
            .map(|h| {
                if h.sh_flags & u64::from(SHF_ALLOC) == 0 {
                    return 0;
                }
                let align = h.sh_addralign.max(1);
                let at = next.div_ceil(align).saturating_mul(align);
                next = at.saturating_add(h.sh_size);
                at
            })
            .collect();
        Layout { base }
    }

    /// The bytes of section `index` with its relocations applied.
    pub(super) fn relocated(&self, elf: &Elf, index: usize, bytes: &[u8], path: &str) -> Result<Vec<u8>, DwarfError> {
        let mut out = bytes.to_vec();
        let section_name = || {
            elf.section_headers
                .get(index)
                .and_then(|h| elf.shdr_strtab.get_at(h.sh_name))
                .unwrap_or("?")
                .to_owned()
        };
        for (reloc_index, relocs) in &elf.shdr_relocs {
            let applies_to = elf.section_headers.get(*reloc_index).map(|h| h.sh_info as usize);
            if applies_to != Some(index) {
                continue;
            }
            for (i, r) in relocs.iter().enumerate() {
                let bad = |reason: String| DwarfError::BadRelocation {
                    path: path.to_owned(),
                    section: section_name(),
                    index: i,
                    reason,
                };
                let symbol = elf
                    .syms
                    .get(r.r_sym)
                    .ok_or_else(|| bad(format!("symbol {} out of the table", r.r_sym)))?;
                let section_base = self.base.get(symbol.st_shndx).copied().unwrap_or(0);
                let value = section_base
                    .wrapping_add(symbol.st_value)
                    .wrapping_add_signed(r.r_addend.unwrap_or(0));
                let place = self.base.get(index).copied().unwrap_or(0).wrapping_add(r.r_offset);
                let (width, field) = match r.r_type {
                    R_X86_64_NONE => continue,
                    R_X86_64_64 => (8, value),
                    R_X86_64_PC64 => (8, value.wrapping_sub(place)),
                    R_X86_64_32 | R_X86_64_32S => (4, value),
                    R_X86_64_PC32 => (4, value.wrapping_sub(place)),
                    other => return Err(bad(format!("type {other}"))),
                };
                let at = usize::try_from(r.r_offset).map_err(|_| bad("offset too large".into()))?;
                let slot = at
                    .checked_add(width)
                    .and_then(|end| out.get_mut(at..end))
                    .ok_or_else(|| bad(format!("offset {at:#x} past the section's end")))?;
                slot.copy_from_slice(&field.to_le_bytes()[..width]);
            }
        }
        Ok(out)
    }

    /// The object's functions and variables, at their sections' addresses.
    pub(super) fn symbols(&self, elf: &Elf) -> SymbolTable {
        let symbols = elf
            .syms
            .iter()
            .filter(|s| matches!(s.st_type(), STT_FUNC | STT_OBJECT) && s.st_shndx != 0)
            .filter_map(|s| {
                let name = elf.strtab.get_at(s.st_name)?;
                let base = *self.base.get(s.st_shndx)?;
                if base == 0 || name.is_empty() {
                    return None;
                }
                let global = matches!(s.st_bind(), STB_GLOBAL | STB_WEAK);
                let kind = match (s.st_type() == STT_FUNC, global) {
                    (true, true) => 'T',
                    (true, false) => 't',
                    (false, true) => 'D',
                    (false, false) => 'd',
                };
                Some(Symbol {
                    name: name.to_owned(),
                    addr: Gva(base.wrapping_add(s.st_value)),
                    kind,
                    size: Some(s.st_size).filter(|&n| n != 0),
                })
            })
            .collect();
        SymbolTable::from_symbols(SymbolSource::Elf, symbols)
    }
}
