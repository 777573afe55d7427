//! Facts about the guest kernel that probe placement has to respect, read from guest
//! memory with the help of a symbol table: where kernel text is, which instructions the
//! exception table lists (a detour must not move them), and what the guest itself refuses
//! to probe (its kprobe blacklist).
//!
//! The symbol table must match the memory: relocated by the KASLR slide for a live guest,
//! unrelocated for a vmlinux [`ElfImage`](crate::memory::ElfImage).

use std::fmt;
use std::ops::Range;

use hvprobe_arch::Gva;

use crate::memory::{GuestVirtRead, MemoryError};
use crate::symbols::{Symbol, SymbolTable};

/// Why a fact could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FactsError {
    #[error("the symbol table has no {0}")]
    MissingSymbol(&'static str),
    #[error("{end_name} ({end}) lies before {start_name} ({start})")]
    BadBounds {
        start_name: &'static str,
        start: Gva,
        end_name: &'static str,
        end: Gva,
    },
    #[error("{what} is {len:#x} bytes, not a whole number of {entry}-byte entries")]
    RaggedTable { what: &'static str, len: u64, entry: u64 },
    #[error("{what} is {len:#x} bytes, more than the {max:#x} any kernel has")]
    TableTooLarge { what: &'static str, len: u64, max: u64 },
    #[error("reading {what} from guest memory: {source}")]
    Memory { what: &'static str, source: MemoryError },
    #[error("{0}")]
    Corrupt(String),
    /// A hostile or corrupt guest structure is larger than any real kernel's.
    #[error("{structure} is over its limit of {limit} {unit} (hostile or corrupt guest memory?)")]
    OverBudget {
        structure: &'static str,
        limit: u64,
        unit: &'static str,
    },
}

/// No exception table or blacklist array comes near this; a larger one means the symbols
/// do not belong to this memory.
const MAX_TABLE_BYTES: u64 = 16 << 20;

fn symbol(syms: &SymbolTable, name: &'static str) -> Result<Gva, FactsError> {
    syms.lookup(name).map(|s| s.addr).ok_or(FactsError::MissingSymbol(name))
}

fn bounds(syms: &SymbolTable, start_name: &'static str, end_name: &'static str) -> Result<Range<Gva>, FactsError> {
    let start = symbol(syms, start_name)?;
    let end = symbol(syms, end_name)?;
    if end < start {
        return Err(FactsError::BadBounds {
            start_name,
            start,
            end_name,
            end,
        });
    }
    Ok(start..end)
}

fn read_table<M: GuestVirtRead + ?Sized>(
    mem: &M,
    what: &'static str,
    range: &Range<Gva>,
    entry: u64,
) -> Result<Vec<u8>, FactsError> {
    let len = range.end.0 - range.start.0;
    if len / entry * entry != len {
        return Err(FactsError::RaggedTable { what, len, entry });
    }
    if len > MAX_TABLE_BYTES {
        return Err(FactsError::TableTooLarge {
            what,
            len,
            max: MAX_TABLE_BYTES,
        });
    }
    let mut buf = vec![0u8; len as usize];
    mem.read_virt(range.start, &mut buf)
        .map_err(|source| FactsError::Memory { what, source })?;
    Ok(buf)
}

/// Where kernel code is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextBounds {
    /// `_stext` .. `_etext`.
    pub text: Range<Gva>,
    /// `_sinittext` .. `_einittext` (freed after boot, but probes armed early land there).
    pub init_text: Option<Range<Gva>>,
}

impl TextBounds {
    pub fn read(syms: &SymbolTable) -> Result<Self, FactsError> {
        let text = bounds(syms, "_stext", "_etext")?;
        let init_text = match bounds(syms, "_sinittext", "_einittext") {
            Ok(r) => Some(r),
            Err(FactsError::MissingSymbol(_)) => None,
            Err(e) => return Err(e),
        };
        Ok(TextBounds { text, init_text })
    }

    /// In core text or init text.
    pub fn contains(&self, gva: Gva) -> bool {
        self.text.contains(&gva) || self.init_text.as_ref().is_some_and(|r| r.contains(&gva))
    }
}

/// One `struct exception_table_entry` (x86, 6.1: three `int`s relative to their own
/// address: insn, fixup, data), with the addresses made absolute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExTableEntry {
    /// The instruction that may fault.
    pub insn: Gva,
    /// Where execution continues after the fault.
    pub fixup: Gva,
    /// Type (bits 7:0), register (11:8), flags (15:12) and a signed immediate (31:16).
    pub data: i32,
}

impl ExTableEntry {
    /// `EX_TYPE_*` from `asm/extable_fixup_types.h`.
    pub fn fixup_type(&self) -> u8 {
        (self.data & 0xff) as u8
    }

    pub fn imm(&self) -> i16 {
        (self.data >> 16) as i16
    }
}

/// The kernel's exception table (`__start___ex_table` .. `__stop___ex_table`), sorted by
/// instruction address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExceptionTable {
    entries: Vec<ExTableEntry>,
}

impl ExceptionTable {
    pub fn read<M: GuestVirtRead + ?Sized>(mem: &M, syms: &SymbolTable) -> Result<Self, FactsError> {
        let range = bounds(syms, "__start___ex_table", "__stop___ex_table")?;
        let raw = read_table(mem, "__ex_table", &range, 12)?;
        Ok(ExceptionTable::parse(range.start, &raw))
    }

    /// The table from its bytes (whole 12-byte entries; a partial one at the end is
    /// ignored), which start at `start`: a module's, or the kernel's.
    pub fn parse(start: Gva, raw: &[u8]) -> Self {
        let field = |c: &[u8], i: usize| i32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
        let mut entries: Vec<ExTableEntry> = raw
            .chunks_exact(12)
            .enumerate()
            .map(|(i, c)| {
                let at = start.0.wrapping_add(12 * i as u64);
                ExTableEntry {
                    insn: Gva(at.wrapping_add_signed(field(c, 0).into())),
                    fixup: Gva((at + 4).wrapping_add_signed(field(c, 4).into())),
                    data: field(c, 8),
                }
            })
            .collect();
        // Built sorted (scripts/sorttable), but a guest that sorts at boot may not be yet.
        entries.sort_by_key(|e| e.insn);
        ExceptionTable { entries }
    }

    pub fn entries(&self) -> &[ExTableEntry] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry for the instruction at exactly `insn`.
    pub fn lookup(&self, insn: Gva) -> Option<&ExTableEntry> {
        let i = self.entries.partition_point(|e| e.insn < insn);
        self.entries.get(i).filter(|e| e.insn == insn)
    }

    /// Entries whose instruction starts inside `range` (a region a detour would move).
    pub fn in_range(&self, range: Range<Gva>) -> &[ExTableEntry] {
        let from = self.entries.partition_point(|e| e.insn < range.start);
        let to = self.entries.partition_point(|e| e.insn < range.end);
        &self.entries[from..to.max(from)]
    }
}

/// Why the guest would refuse a kprobe at an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlacklistReason {
    /// Inside a function marked `NOKPROBE_SYMBOL()` (an entry of `_kprobe_blacklist`).
    Symbol { name: String, range: Range<Gva> },
    /// Inside a section the kernel blacklists wholesale.
    Section { section: &'static str, range: Range<Gva> },
    /// Inside a compiler-made part (`.cold`, `.isra.0`, …) of a blacklisted function.
    Suffixed { name: String, base: String },
}

impl fmt::Display for BlacklistReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlacklistReason::Symbol { name, range } => {
                write!(f, "{name} ({}..{}) is marked NOKPROBE_SYMBOL", range.start, range.end)
            }
            BlacklistReason::Section { section, range } => {
                write!(
                    f,
                    "inside {section} ({}..{}), which kprobes never probe",
                    range.start, range.end
                )
            }
            BlacklistReason::Suffixed { name, base } => write!(f, "{name} is part of blacklisted {base}"),
        }
    }
}

/// The sections Linux 6.1 blacklists as a whole: `populate_kprobe_blacklist()` in
/// kernel/kprobes.c adds `__kprobes_text` and `noinstr`, x86's
/// `arch_populate_kprobe_blacklist()` adds the entry text. (The irqentry and softirqentry
/// sections are not blacklisted in 6.1; on x86 irqentry text lies inside the entry text.)
pub const BLACKLISTED_SECTIONS: [(&str, &str, &str); 3] = [
    (".kprobes.text", "__kprobes_text_start", "__kprobes_text_end"),
    (".noinstr.text", "__noinstr_text_start", "__noinstr_text_end"),
    (".entry.text", "__entry_text_start", "__entry_text_end"),
];

/// The guest's kprobe blacklist, as the guest builds it at boot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KprobeBlacklist {
    /// `NOKPROBE_SYMBOL` functions, by start address.
    symbols: Vec<(Range<Gva>, String)>,
    sections: Vec<(&'static str, Range<Gva>)>,
    /// Suffixed parts of blacklisted functions: (range, name, base name).
    suffixed: Vec<(Range<Gva>, String, String)>,
    /// `symbols` as disjoint pieces, sorted, each with the index of the first entry that
    /// covers it: a lookup is a binary search. A linear scan per lookup made
    /// [`KprobeBlacklist::suffixed_parts`] quadratic (every dotted symbol times every
    /// entry: 10^12 steps with a hostile guest's 1 M entries and symbols).
    cover: Vec<(Range<Gva>, usize)>,
    /// The same for `suffixed`.
    suffixed_cover: Vec<(Range<Gva>, usize)>,
}

/// The index that `cover` (from [`disjoint_cover`]) gives `gva`.
fn covering(cover: &[(Range<Gva>, usize)], gva: Gva) -> Option<usize> {
    let piece = cover.partition_point(|(r, _)| r.end <= gva);
    cover.get(piece).filter(|(r, _)| r.contains(&gva)).map(|&(_, i)| i)
}

/// Disjoint pieces of `ranges` (sorted by start), each naming the first range (in order)
/// that covers it, by a sweep over their ends: O(n log n).
fn disjoint_cover<'a>(ranges: impl ExactSizeIterator<Item = &'a Range<Gva>>) -> Vec<(Range<Gva>, usize)> {
    let mut points: Vec<(Gva, bool, usize)> = Vec::with_capacity(2 * ranges.len());
    for (i, r) in ranges.enumerate() {
        if r.start < r.end {
            points.push((r.start, true, i));
            points.push((r.end, false, i));
        }
    }
    points.sort_unstable_by_key(|&(at, opens, i)| (at, opens, i));
    let mut active = std::collections::BTreeSet::new();
    let mut cover: Vec<(Range<Gva>, usize)> = Vec::new();
    let mut k = 0;
    while k < points.len() {
        let at = points[k].0;
        while k < points.len() && points[k].0 == at {
            let (_, opens, i) = points[k];
            if opens {
                active.insert(i);
            } else {
                active.remove(&i);
            }
            k += 1;
        }
        let (Some(&first), Some(&(next, _, _))) = (active.first(), points.get(k)) else {
            continue;
        };
        match cover.last_mut() {
            Some((r, owner)) if *owner == first && r.end == at => r.end = next,
            _ => cover.push((at..next, first)),
        }
    }
    cover
}

/// The range the kernel blacklists for a symbol: from the address to the next symbol
/// (kallsyms has no sizes), or to the ELF end if that is further.
fn symbol_range(syms: &SymbolTable, s: &Symbol, from: Gva) -> Range<Gva> {
    let size = s.size.unwrap_or(0).max(syms.extent(s).unwrap_or(0)).max(1);
    from..Gva(s.addr.0.saturating_add(size).max(from.0.saturating_add(1)))
}

impl KprobeBlacklist {
    pub fn read<M: GuestVirtRead + ?Sized>(mem: &M, syms: &SymbolTable) -> Result<Self, FactsError> {
        let text = TextBounds::read(syms)?;
        let array = bounds(syms, "__start_kprobe_blacklist", "__stop_kprobe_blacklist")?;
        let raw = read_table(mem, "_kprobe_blacklist", &array, 8)?;
        let mut symbols = Vec::new();
        for c in raw.chunks_exact(8) {
            let entry = Gva(u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]));
            // populate_kprobe_blacklist() skips entries it cannot size (-EINVAL): outside
            // kernel text or without a symbol.
            if !text.contains(entry) {
                continue;
            }
            if let Some(d) = syms.describe(entry) {
                symbols.push((symbol_range(syms, d.symbol, entry), d.symbol.name.clone()));
            }
        }
        symbols.sort_by_key(|(r, _)| r.start);

        let mut sections = Vec::new();
        for (section, start_name, end_name) in BLACKLISTED_SECTIONS {
            let range = match bounds(syms, start_name, end_name) {
                Ok(r) => r,
                Err(FactsError::MissingSymbol(_)) => continue,
                Err(e) => return Err(e),
            };
            if range.is_empty() {
                continue;
            }
            // kprobe_add_area_blacklist() adds whole symbols, so the last one is covered
            // to its end even where it runs past the section's end marker.
            let end = syms
                .describe(Gva(range.end.0 - 1))
                .map(|d| symbol_range(syms, d.symbol, range.start).end)
                .map_or(range.end, |e| e.max(range.end));
            sections.push((section, range.start..end));
        }

        Ok(KprobeBlacklist::new(symbols, sections, syms))
    }

    /// The blacklist of a running kernel: the `kprobe_blacklist` list it built at boot
    /// (`struct kprobe_blacklist_entry { list_head; start_addr; end_addr }`). After boot
    /// this is the only copy: the `_kprobe_blacklist` array that [`read`](Self::read) uses
    /// lives in init data, which the kernel frees. An empty list (a kernel that has not
    /// built it yet) falls back to [`read`](Self::read).
    pub fn read_live<M: GuestVirtRead + ?Sized>(mem: &M, syms: &SymbolTable) -> Result<Self, FactsError> {
        /// More entries than any kernel has: one per NOKPROBE_SYMBOL and per symbol of
        /// the blacklisted sections, a few thousand with its modules', so 64 Ki is over
        /// ten times that. Each entry costs three reads through the guest's page tables
        /// (a list of 1 Mi, the old limit, took seconds); lookups are logarithmic.
        const MAX_ENTRIES: usize = 1 << 16;
        let head = symbol(syms, "kprobe_blacklist")?;
        let memory = |what: &'static str| move |source| FactsError::Memory { what, source };
        let mut next = Gva(mem.read_u64(head).map_err(memory("kprobe_blacklist"))?);
        if next == head || next.0 == 0 {
            return Self::read(mem, syms);
        }
        let mut symbols = Vec::new();
        // A list that comes back to one of its own entries instead of the head loops:
        // an error at once rather than at the limit.
        let mut visited = std::collections::HashSet::new();
        while next != head {
            if !visited.insert(next) {
                return Err(FactsError::Corrupt(format!(
                    "the kprobe_blacklist list loops at {next} without coming back to its head"
                )));
            }
            if symbols.len() == MAX_ENTRIES {
                return Err(FactsError::OverBudget {
                    structure: "the kprobe_blacklist list",
                    limit: MAX_ENTRIES as u64,
                    unit: "entries",
                });
            }
            // The guest's pointer: its fields' addresses may not wrap.
            let field = |off: u64| {
                next.0.checked_add(off).map(Gva).ok_or_else(|| {
                    FactsError::Corrupt(format!("kprobe_blacklist entry at {next} runs past the address space"))
                })
            };
            let start = Gva(mem.read_u64(field(16)?).map_err(memory("kprobe_blacklist entry"))?);
            let end = Gva(mem.read_u64(field(24)?).map_err(memory("kprobe_blacklist entry"))?);
            let name = syms
                .describe(start)
                .map(|d| d.symbol.name.clone())
                .unwrap_or_else(|| start.to_string());
            symbols.push((start..end, name));
            next = Gva(mem.read_u64(next).map_err(memory("kprobe_blacklist entry"))?);
        }
        symbols.sort_by_key(|(r, _)| r.start);
        Ok(KprobeBlacklist::new(symbols, Vec::new(), syms))
    }

    /// The blacklist of `symbols` (sorted by start) and `sections`, with the suffixed parts
    /// of its functions found in `syms`.
    fn new(symbols: Vec<(Range<Gva>, String)>, sections: Vec<(&'static str, Range<Gva>)>, syms: &SymbolTable) -> Self {
        let mut list = KprobeBlacklist {
            cover: disjoint_cover(symbols.iter().map(|(r, _)| r)),
            symbols,
            sections,
            suffixed: Vec::new(),
            suffixed_cover: Vec::new(),
        };
        list.suffixed = list.suffixed_parts(syms);
        list.suffixed_cover = disjoint_cover(list.suffixed.iter().map(|(r, _, _)| r));
        list
    }

    /// Compiler-made parts (`foo.cold`, ...) of blacklisted functions: the kernel's
    /// `within_kprobe_blacklist()` refuses them by their base name.
    fn suffixed_parts(&self, syms: &SymbolTable) -> Vec<(Range<Gva>, String, String)> {
        let mut suffixed = Vec::new();
        for s in syms.symbols().iter().filter(|s| s.is_text()) {
            let Some((base, _)) = s.name.split_once('.') else {
                continue;
            };
            let Some(b) = syms.lookup(base) else { continue };
            if self.direct_reason(b.addr).is_some() {
                suffixed.push((symbol_range(syms, s, s.addr), s.name.clone(), base.to_string()));
            }
        }
        suffixed
    }

    fn direct_reason(&self, gva: Gva) -> Option<BlacklistReason> {
        if let Some((section, range)) = self.sections.iter().find(|(_, r)| r.contains(&gva)) {
            return Some(BlacklistReason::Section {
                section,
                range: range.clone(),
            });
        }
        covering(&self.cover, gva)
            .map(|i| &self.symbols[i])
            .map(|(range, name)| BlacklistReason::Symbol {
                name: name.clone(),
                range: range.clone(),
            })
    }

    /// Why the guest would refuse to probe `gva`, or `None` if it would not.
    pub fn is_blacklisted(&self, gva: Gva) -> Option<BlacklistReason> {
        self.direct_reason(gva).or_else(|| {
            covering(&self.suffixed_cover, gva)
                .map(|i| &self.suffixed[i])
                .map(|(_, name, base)| BlacklistReason::Suffixed {
                    name: name.clone(),
                    base: base.clone(),
                })
        })
    }

    /// The `NOKPROBE_SYMBOL` functions: (range, name).
    pub fn symbols(&self) -> &[(Range<Gva>, String)] {
        &self.symbols
    }

    /// The wholesale-blacklisted sections present in this kernel: (name, range).
    pub fn sections(&self) -> &[(&'static str, Range<Gva>)] {
        &self.sections
    }
}

/// Everything above, read once.
#[derive(Clone, Debug)]
pub struct KernelFacts {
    pub text: TextBounds,
    pub ex_table: ExceptionTable,
    pub blacklist: KprobeBlacklist,
}

impl KernelFacts {
    pub fn read<M: GuestVirtRead + ?Sized>(mem: &M, syms: &SymbolTable) -> Result<Self, FactsError> {
        Ok(KernelFacts {
            text: TextBounds::read(syms)?,
            ex_table: ExceptionTable::read(mem, syms)?,
            blacklist: KprobeBlacklist::read(mem, syms)?,
        })
    }
}

#[cfg(test)]
mod tests {
    //! On small synthetic tables; `tests/bundled_guest.rs` reads the bundled guest's.

    use super::*;
    use crate::memory::BytesAt;
    use crate::symbols::SymbolSource;

    fn data_symbol(name: &str, addr: u64) -> Symbol {
        Symbol {
            name: name.into(),
            addr: Gva(addr),
            kind: 'D',
            size: None,
        }
    }

    #[test]
    fn exception_table_entries_are_relative_sorted_and_looked_up() {
        // Two entries, out of order: each field is relative to its own address.
        let table = 0xffff_ffff_8200_0000u64;
        let entry = |at: u64, insn: u64, fixup: u64, data: i32| {
            let mut e = Vec::new();
            e.extend_from_slice(&((insn.wrapping_sub(at)) as i32).to_le_bytes());
            e.extend_from_slice(&((fixup.wrapping_sub(at + 4)) as i32).to_le_bytes());
            e.extend_from_slice(&data.to_le_bytes());
            e
        };
        let mut bytes = entry(table, 0xffff_ffff_8100_2000, 0xffff_ffff_8100_2100, 3);
        bytes.extend(entry(table + 12, 0xffff_ffff_8100_1000, 0xffff_ffff_8100_1100, 1));
        let mem = BytesAt { base: table, bytes };
        let syms = SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![
                data_symbol("__start___ex_table", table),
                data_symbol("__stop___ex_table", table + 24),
            ],
        );
        let ex = ExceptionTable::read(&mem, &syms).unwrap();
        let insns: Vec<Gva> = ex.entries().iter().map(|e| e.insn).collect();
        assert_eq!(insns, [Gva(0xffff_ffff_8100_1000), Gva(0xffff_ffff_8100_2000)]);
        assert_eq!(ex.entries()[0].fixup, Gva(0xffff_ffff_8100_1100));
        assert_eq!(
            ex.lookup(Gva(0xffff_ffff_8100_2000)).map(|e| e.fixup),
            Some(Gva(0xffff_ffff_8100_2100))
        );
        assert_eq!(ex.lookup(Gva(0xffff_ffff_8100_2001)), None);
        assert_eq!(ex.in_range(Gva(0xffff_ffff_8100_1800)..Gva(u64::MAX)).len(), 1);
    }

    #[test]
    fn missing_symbols_and_bad_tables_are_errors() {
        let img = &BytesAt {
            base: 0xffff_ffff_8100_0000,
            bytes: vec![0; 16],
        };
        let empty = SymbolTable::from_symbols(SymbolSource::SystemMap, vec![]);
        assert!(matches!(
            TextBounds::read(&empty),
            Err(FactsError::MissingSymbol("_stext"))
        ));
        let s = data_symbol;
        let ragged = SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![
                s("__start___ex_table", 0xffff_ffff_8100_0000),
                s("__stop___ex_table", 0xffff_ffff_8100_0010),
            ],
        );
        let e = ExceptionTable::read(img, &ragged).unwrap_err();
        assert!(e.to_string().contains("not a whole number of 12-byte entries"), "{e}");
        let backwards = SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![
                s("__start___ex_table", 0xffff_ffff_8100_0010),
                s("__stop___ex_table", 0xffff_ffff_8100_0000),
            ],
        );
        assert!(matches!(
            ExceptionTable::read(img, &backwards),
            Err(FactsError::BadBounds { .. })
        ));
        let unmapped = SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![s("__start___ex_table", 0x1000), s("__stop___ex_table", 0x100c)],
        );
        assert!(matches!(
            ExceptionTable::read(img, &unmapped),
            Err(FactsError::Memory { .. })
        ));
    }

    fn text_symbol(name: &str, addr: u64) -> Symbol {
        Symbol {
            name: name.into(),
            addr: Gva(addr),
            kind: 't',
            size: Some(0x10),
        }
    }

    const HEAD: u64 = 0xffff_ffff_8300_0000;
    const ENTRIES: u64 = 0xffff_8880_0100_0000;
    const TEXT: u64 = 0xffff_ffff_8100_0000;

    /// A live `kprobe_blacklist` list of `n` entries (each 32 bytes: list_head, start, end)
    /// over the first `n` text symbols `f{i}`, each with a `f{i}.cold` part.
    fn live_blacklist(n: u64) -> (crate::memory::SparseMemory, SymbolTable) {
        let mut mem = crate::memory::SparseMemory::new();
        let mut syms = vec![data_symbol("kprobe_blacklist", HEAD)];
        let mut next = HEAD;
        for i in (0..n).rev() {
            let e = ENTRIES + 32 * i;
            let f = TEXT + 0x40 * i;
            mem.put_u64(e, next);
            mem.put_u64(e + 16, f);
            mem.put_u64(e + 24, f + 0x10);
            next = e;
            syms.push(text_symbol(&format!("f{i}"), f));
            syms.push(text_symbol(&format!("f{i}.cold"), f + 0x20));
        }
        mem.put_u64(HEAD, next);
        (mem, SymbolTable::from_symbols(SymbolSource::Kallsyms, syms))
    }

    /// Every dotted symbol was checked against every blacklist entry
    /// (here 140k x 40k; a guest can have 64 Ki entries and millions of symbols). Lookups
    /// are logarithmic now: reading the list with the `.cold` parts costs a small multiple
    /// of reading it without them (timed in the same conditions, so that a loaded machine
    /// slows both), where the linear lookups cost over ten times as much.
    #[test]
    fn a_long_live_blacklist_and_many_dotted_symbols_are_not_quadratic() {
        let (mem, syms) = live_blacklist(40_000);
        // And 100k functions off the list with `.cold` parts: each part's base was looked
        // for through the whole list.
        let mut all = syms.symbols().to_vec();
        for i in 0..100_000u64 {
            let g = TEXT + 0x40 * 40_000 + 0x40 * i;
            all.push(text_symbol(&format!("g{i}"), g));
            all.push(text_symbol(&format!("g{i}.cold"), g + 0x20));
        }
        let syms = SymbolTable::from_symbols(SymbolSource::Kallsyms, all);
        let undotted: Vec<Symbol> = syms
            .symbols()
            .iter()
            .filter(|s| !s.name.contains('.'))
            .cloned()
            .collect();
        let plain = SymbolTable::from_symbols(SymbolSource::Kallsyms, undotted);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let timed = |syms: &SymbolTable| {
                let t0 = std::time::Instant::now();
                let list = KprobeBlacklist::read_live(&mem, syms);
                (t0.elapsed(), list)
            };
            let (without, _) = timed(&plain);
            let (with, list) = timed(&syms);
            let _ = tx.send((
                without,
                with,
                list.map(|b| (b.symbols().len(), b.is_blacklisted(Gva(TEXT + 0x40 * 39_999 + 0x24)))),
            ));
        });
        let (without, with, list) = rx
            .recv_timeout(std::time::Duration::from_secs(300))
            .expect("reading the blacklist took more than 5 minutes");
        assert!(
            with < without * 4 + std::time::Duration::from_millis(500),
            "with the dotted symbols {with:?}, without {without:?}"
        );
        let (n, reason) = list.unwrap();
        assert_eq!(n, 40_000);
        assert_eq!(
            reason,
            Some(BlacklistReason::Suffixed {
                name: "f39999.cold".into(),
                base: "f39999".into()
            })
        );
    }

    /// An entry near 2^64: its fields' addresses overflowed (a panic in a debug build).
    #[test]
    fn a_blacklist_entry_near_the_top_of_the_address_space_is_an_error() {
        let (mut mem, syms) = live_blacklist(1);
        mem.put_u64(HEAD, u64::MAX - 8);
        mem.put_u64(u64::MAX - 8, HEAD);
        assert!(KprobeBlacklist::read_live(&mem, &syms).is_err());
    }

    /// A list that loops without coming back to its head is an error at once (found by
    /// the guest_facts fuzz target: 1 Mi reads before, seconds); one longer than the limit
    /// is an error naming it.
    #[test]
    fn looping_and_overlong_blacklists_are_errors() {
        let (mut mem, syms) = live_blacklist(3);
        mem.put_u64(ENTRIES + 64, ENTRIES);
        let r = KprobeBlacklist::read_live(&mem, &syms);
        assert!(
            matches!(&r, Err(FactsError::Corrupt(m)) if m.contains("loops")),
            "{r:?}"
        );
        let (mem, syms) = live_blacklist((1 << 16) + 1);
        match KprobeBlacklist::read_live(&mem, &syms) {
            Err(FactsError::OverBudget { structure, limit, .. }) => {
                assert_eq!((structure, limit), ("the kprobe_blacklist list", 1 << 16));
            }
            other => panic!("expected the entry limit, got {other:?}"),
        }
    }

    /// Overlapping and nested entries: the first (by start) that covers an address names
    /// it, as the linear scan did.
    #[test]
    fn the_disjoint_cover_names_the_first_covering_entry() {
        let r = |a: u64, b: u64, n: &str| (Gva(a)..Gva(b), n.to_string());
        let list = [
            r(10, 50, "a"),
            r(20, 30, "b"),
            r(40, 70, "c"),
            r(60, 60, "empty"),
            r(80, 90, "d"),
        ];
        let cover = disjoint_cover(list.iter().map(|(x, _)| x));
        for gva in 0..100 {
            let linear = list.iter().position(|(x, _)| x.contains(&Gva(gva)));
            assert_eq!(covering(&cover, Gva(gva)), linear, "at {gva}");
        }
    }
}
