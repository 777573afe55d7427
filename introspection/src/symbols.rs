//! Kernel symbols from three sources behind one table: a System.map file, the vmlinux ELF
//! symbol table, and kallsyms decoded from guest memory (found by content, so a guest
//! whose System.map is lost can still be probed by name).
//!
//! Addresses in a System.map or ELF table are link-time addresses; with KASLR the running
//! kernel is shifted by a slide ([`SymbolTable::relocated`]). Kallsyms read from a running
//! guest already holds run-time addresses.

mod kallsyms;

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;

use goblin::elf::section_header::{SHF_ALLOC, SHF_EXECINSTR, SHF_WRITE, SHT_NOBITS};
use goblin::elf::sym::{STB_GLOBAL, STB_GNU_UNIQUE, STB_WEAK, STT_FILE, STT_OBJECT, STT_SECTION};
use goblin::elf::Elf;
use hvprobe_arch::Gva;

use crate::memory::{GuestVirtRead, MemoryError};

pub use kallsyms::KallsymsLayout;

/// Where a symbol table came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SymbolSource {
    SystemMap,
    Elf,
    Kallsyms,
}

impl fmt::Display for SymbolSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SymbolSource::SystemMap => "System.map",
            SymbolSource::Elf => "vmlinux ELF",
            SymbolSource::Kallsyms => "guest kallsyms",
        })
    }
}

/// One kernel symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    pub name: String,
    pub addr: Gva,
    /// The `nm` / `/proc/kallsyms` type letter (`t`, `T`, `d`, `D`, `A`, `W`, …):
    /// upper case is global.
    pub kind: char,
    /// The ELF `st_size`, when the source has one and it is not zero.
    pub size: Option<u64>,
}

impl Symbol {
    /// Whether the symbol is code (`t`/`T`, or a weak definition `W`/`w`, which in the
    /// kernel are almost always functions).
    pub fn is_text(&self) -> bool {
        matches!(self.kind, 't' | 'T' | 'W' | 'w')
    }

    /// Absolute and undefined (`U`, and lower-case weak `w`/`v`) symbols do not name a
    /// place in the kernel image.
    fn names_a_location(&self) -> bool {
        !matches!(self.kind, 'a' | 'A' | 'U' | 'w' | 'v')
    }
}

/// Why building a table or resolving a name failed.
#[derive(Debug, thiserror::Error)]
pub enum SymbolError {
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("System.map line {line}: {reason}: {text:?}")]
    SystemMapLine {
        line: usize,
        reason: &'static str,
        text: String,
    },
    #[error("vmlinux ELF: {0}")]
    Elf(String),
    #[error("vmlinux ELF has no symbol table (stripped?)")]
    NoElfSymbols,
    #[error("malformed symbol specification {spec:?}: {reason}")]
    Malformed { spec: String, reason: String },
    #[error("unknown symbol {0:?}")]
    UnknownSymbol(String),
    #[error("{spec:?}: {name} at {addr} plus offset {offset:#x} overflows the address space")]
    AddressOverflow {
        spec: String,
        name: String,
        addr: Gva,
        offset: u64,
    },
    #[error("kallsyms not found in {start}..{end}: {reason}")]
    KallsymsNotFound { start: Gva, end: Gva, reason: String },
    #[error("kallsyms tables at {at} are inconsistent: {reason}")]
    KallsymsInvalid { at: Gva, reason: String },
    #[error("reading {what} from guest memory: {source}")]
    Memory { what: &'static str, source: MemoryError },
}

/// A name (plus offset) resolved to an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolved<'a> {
    pub addr: Gva,
    pub symbol: &'a Symbol,
    pub offset: u64,
    pub source: SymbolSource,
}

/// An address described as `symbol+offset/size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Description<'a> {
    pub symbol: &'a Symbol,
    pub offset: u64,
    /// ELF `st_size` when that covers the address, else the distance to the next symbol
    /// (what the kernel's `%pS` prints).
    pub size: u64,
    pub source: SymbolSource,
}

impl fmt::Display for Description<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{:#x}/{:#x}", self.symbol.name, self.offset, self.size)
    }
}

/// The symbols of one kernel, searchable by name and by address.
#[derive(Clone, Debug)]
pub struct SymbolTable {
    source: SymbolSource,
    /// Sorted by address; ties keep the source's order.
    symbols: Vec<Symbol>,
    /// Indices into `symbols`, ascending, so the first is the lowest address.
    by_name: HashMap<String, Vec<u32>>,
    /// Indices of symbols that name a location (see `Symbol::names_a_location`), by
    /// address: the candidates for `describe` and for "distance to the next symbol".
    located: Vec<u32>,
    slide: i64,
}

/// Kernel-half addresses are the ones KASLR moves; per-CPU offsets and absolute values
/// (which the tables also list) stay put.
const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;

impl SymbolTable {
    /// Builds a table from any list of symbols.
    pub fn from_symbols(source: SymbolSource, mut symbols: Vec<Symbol>) -> Self {
        symbols.sort_by_key(|s| s.addr); // stable: aliases keep the source order
        let mut by_name: HashMap<String, Vec<u32>> = HashMap::with_capacity(symbols.len());
        let mut located = Vec::with_capacity(symbols.len());
        for (i, s) in symbols.iter().enumerate() {
            // More than 4 billion symbols cannot come out of any of the parsers (each
            // costs at least a byte of input well below u32::MAX bytes); saturating keeps
            // that impossible case from indexing wrongly rather than panicking.
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            by_name.entry(s.name.clone()).or_default().push(i);
            if s.names_a_location() {
                located.push(i);
            }
        }
        SymbolTable {
            source,
            symbols,
            by_name,
            located,
            slide: 0,
        }
    }

    /// Parses System.map text (`<hex address> <type> <name>` per line).
    pub fn parse_system_map(text: &str) -> Result<Self, SymbolError> {
        let mut symbols = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |reason| SymbolError::SystemMapLine {
                line: i + 1,
                reason,
                text: line.to_string(),
            };
            let mut fields = line.split_ascii_whitespace();
            let (Some(addr), Some(kind), Some(name), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(bad("expected three fields: address, type, name"));
            };
            let addr = u64::from_str_radix(addr, 16).map_err(|_| bad("address is not hexadecimal"))?;
            let mut k = kind.chars();
            let (Some(kind), None) = (k.next(), k.next()) else {
                return Err(bad("type is not a single letter"));
            };
            if !kind.is_ascii_alphabetic() && kind != '?' {
                return Err(bad("type is not a single letter"));
            }
            symbols.push(Symbol {
                name: name.to_string(),
                addr: Gva(addr),
                kind,
                size: None,
            });
        }
        Ok(Self::from_symbols(SymbolSource::SystemMap, symbols))
    }

    pub fn from_system_map_file(path: impl AsRef<Path>) -> Result<Self, SymbolError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| SymbolError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse_system_map(&text)
    }

    /// Reads the `.symtab` of a vmlinux (with `st_size`), typed the way `nm` types them.
    pub fn parse_elf(bytes: &[u8]) -> Result<Self, SymbolError> {
        let elf = Elf::parse(bytes).map_err(|e| SymbolError::Elf(e.to_string()))?;
        if elf.syms.is_empty() {
            return Err(SymbolError::NoElfSymbols);
        }
        let mut symbols = Vec::with_capacity(elf.syms.len());
        for sym in elf.syms.iter() {
            if sym.st_shndx == 0 || matches!(sym.st_type(), STT_SECTION | STT_FILE) {
                continue;
            }
            let name = match elf.strtab.get_at(sym.st_name) {
                Some(n) if !n.is_empty() => n,
                _ => continue,
            };
            let bind = sym.st_bind();
            let kind = if bind == STB_WEAK {
                if sym.st_type() == STT_OBJECT {
                    'V'
                } else {
                    'W'
                }
            } else if bind == STB_GNU_UNIQUE {
                'u'
            } else {
                let lower = if sym.st_shndx == goblin::elf::section_header::SHN_ABS as usize {
                    'a'
                } else {
                    match elf.section_headers.get(sym.st_shndx) {
                        Some(sh) if sh.sh_flags & u64::from(SHF_EXECINSTR) != 0 => 't',
                        Some(sh) if sh.sh_type == SHT_NOBITS => 'b',
                        Some(sh) if sh.sh_flags & u64::from(SHF_WRITE) != 0 => 'd',
                        Some(sh) if sh.sh_flags & u64::from(SHF_ALLOC) != 0 => 'r',
                        Some(_) => 'n',
                        None => '?',
                    }
                };
                if bind == STB_GLOBAL {
                    lower.to_ascii_uppercase()
                } else {
                    lower
                }
            };
            symbols.push(Symbol {
                name: name.to_string(),
                addr: Gva(sym.st_value),
                kind,
                size: (sym.st_size != 0).then_some(sym.st_size),
            });
        }
        Ok(Self::from_symbols(SymbolSource::Elf, symbols))
    }

    pub fn from_elf_file(path: impl AsRef<Path>) -> Result<Self, SymbolError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| SymbolError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse_elf(&bytes)
    }

    /// Finds kallsyms in `search` (a virtual range that holds the kernel's `.rodata`, e.g.
    /// a few tens of MiB from the start of kernel text) and decodes it.
    pub fn from_kallsyms<M: GuestVirtRead + ?Sized>(mem: &M, search: Range<Gva>) -> Result<Self, SymbolError> {
        let layout = KallsymsLayout::locate(mem, search)?;
        Self::from_kallsyms_layout(mem, &layout)
    }

    /// Decodes kallsyms whose tables were already located.
    pub fn from_kallsyms_layout<M: GuestVirtRead + ?Sized>(
        mem: &M,
        layout: &KallsymsLayout,
    ) -> Result<Self, SymbolError> {
        Ok(Self::from_symbols(SymbolSource::Kallsyms, layout.decode(mem)?))
    }

    pub fn source(&self) -> SymbolSource {
        self.source
    }

    /// The slide added by [`relocated`](Self::relocated) so far.
    pub fn slide(&self) -> i64 {
        self.slide
    }

    pub fn len(&self) -> usize {
        self.symbols.len()
    }

    pub fn is_empty(&self) -> bool {
        self.symbols.is_empty()
    }

    /// All symbols, by address.
    pub fn symbols(&self) -> &[Symbol] {
        &self.symbols
    }

    /// The symbol of that name at the lowest address (static functions can share a name).
    pub fn lookup(&self, name: &str) -> Option<&Symbol> {
        self.lookup_all(name).next()
    }

    /// Every symbol of that name, by address.
    pub fn lookup_all<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a Symbol> + 'a {
        self.by_name
            .get(name)
            .map(|v| v.as_slice())
            .unwrap_or_default()
            .iter()
            .filter_map(|&i| self.symbols.get(i as usize))
    }

    /// Resolves `name`, `name+0x10` or `name+16` to an address. With duplicate names the
    /// lowest address wins; [`lookup_all`](Self::lookup_all) lists the others.
    pub fn resolve(&self, spec: &str) -> Result<Resolved<'_>, SymbolError> {
        let (name, offset) = parse_spec(spec)?;
        let symbol = self
            .lookup(name)
            .ok_or_else(|| SymbolError::UnknownSymbol(name.to_string()))?;
        let addr = symbol
            .addr
            .checked_add(offset)
            .ok_or_else(|| SymbolError::AddressOverflow {
                spec: spec.to_string(),
                name: name.to_string(),
                addr: symbol.addr,
                offset,
            })?;
        Ok(Resolved {
            addr,
            symbol,
            offset,
            source: self.source,
        })
    }

    /// The distance from `symbol` to the next located symbol at a higher address (how the
    /// kernel sizes symbols, since kallsyms has no sizes).
    pub fn extent(&self, symbol: &Symbol) -> Option<u64> {
        let next = self
            .located
            .partition_point(|&i| self.symbols[i as usize].addr <= symbol.addr);
        let next = self.located.get(next)?;
        Some(self.symbols[*next as usize].addr.0 - symbol.addr.0)
    }

    /// The size of `symbol`: its ELF size when known, else [`extent`](Self::extent).
    pub fn size_of(&self, symbol: &Symbol) -> Option<u64> {
        symbol.size.or_else(|| self.extent(symbol))
    }

    /// Describes an address as `symbol+offset/size`. Among aliases at one address the
    /// kernel's preference is followed (not weak, sized, fewest leading underscores), and a
    /// function is preferred over a section marker (`__schedule`, not
    /// `__sched_text_start`).
    /// `None` below the first symbol or past the end of the last one.
    pub fn describe(&self, gva: Gva) -> Option<Description<'_>> {
        let end = self.located.partition_point(|&i| self.symbols[i as usize].addr <= gva);
        let last = *self.located.get(end.checked_sub(1)?)?;
        let at = self.symbols[last as usize].addr;
        let first = self.located[..end].partition_point(|&i| self.symbols[i as usize].addr < at);
        let symbol = self.located[first..end]
            .iter()
            .map(|&i| &self.symbols[i as usize])
            .min_by_key(|s| {
                (
                    matches!(s.kind, 'W' | 'w' | 'V' | 'v'),
                    is_section_marker(&s.name),
                    s.size.is_none(),
                    s.name.bytes().take_while(|&b| b == b'_').count(),
                    !s.is_text(),
                )
            })?;
        let offset = gva.0 - at.0;
        let size = match (symbol.size, self.extent(symbol)) {
            (Some(sz), _) if offset < sz => sz,
            (_, Some(ext)) if offset < ext => ext,
            _ => return None,
        };
        Some(Description {
            symbol,
            offset,
            size,
            source: self.source,
        })
    }

    /// The same table with every kernel-half, non-absolute address moved by `slide` (the
    /// KASLR slide: run-time minus link-time address). Per-CPU offsets and absolute
    /// symbols are not moved, as the kernel's relocation does not move them either.
    pub fn relocated(&self, slide: i64) -> SymbolTable {
        let mut table = self.clone();
        for s in &mut table.symbols {
            if s.addr.0 >= KERNEL_HALF && !matches!(s.kind, 'a' | 'A') {
                s.addr = Gva(s.addr.0.wrapping_add_signed(slide));
            }
        }
        // Moving only some symbols may reorder them; rebuild the indices.
        let mut table = Self::from_symbols(self.source, table.symbols);
        table.slide = self.slide.wrapping_add(slide);
        table
    }
}

/// Splits `name[+offset]`; the offset is decimal or `0x` hexadecimal.
fn parse_spec(spec: &str) -> Result<(&str, u64), SymbolError> {
    let bad = |reason: String| SymbolError::Malformed {
        spec: spec.to_string(),
        reason,
    };
    if spec.is_empty() {
        return Err(bad("empty".into()));
    }
    if let Some(c) = spec.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(format!("contains {c:?}")));
    }
    let (name, offset) = match spec.split_once('+') {
        None => (spec, None),
        Some((name, off)) => (name, Some(off)),
    };
    if name.is_empty() {
        return Err(bad("no symbol name before '+'".into()));
    }
    let Some(off) = offset else {
        return Ok((name, 0));
    };
    if off.is_empty() {
        return Err(bad("no offset after '+'".into()));
    }
    let parsed = match off.strip_prefix("0x").or_else(|| off.strip_prefix("0X")) {
        Some("") => return Err(bad("no digits after '0x'".into())),
        Some(hex) if hex.bytes().all(|b| b.is_ascii_hexdigit()) => u64::from_str_radix(hex, 16),
        None if off.bytes().all(|b| b.is_ascii_digit()) => off.parse::<u64>(),
        _ => {
            return Err(bad(format!(
                "offset {off:?} is not a decimal or 0x-prefixed hexadecimal number"
            )));
        }
    };
    parsed
        .map(|o| (name, o))
        .map_err(|_| bad(format!("offset {off:?} does not fit in 64 bits")))
}

/// Linker-script symbols that mark where a section starts or ends (`_stext`,
/// `__sched_text_start`, `__start___jump_table`): they share an address with the first
/// function of the section but name no code of their own.
fn is_section_marker(name: &str) -> bool {
    name.starts_with("__start_")
        || name.starts_with("__stop_")
        || (name.starts_with('_') && (name.ends_with("_start") || name.ends_with("_end")))
        || matches!(
            name,
            "_text" | "_stext" | "_etext" | "_sinittext" | "_einittext" | "_sdata" | "_edata"
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::test_support::guest_dir;
    use crate::memory::ElfImage;
    use std::collections::HashSet;
    use std::time::Instant;

    /// A memory image with some bytes replaced.
    struct Patched<'a> {
        inner: &'a ElfImage,
        at: Gva,
        bytes: Vec<u8>,
    }

    impl GuestVirtRead for Patched<'_> {
        fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
            self.inner.read_virt(gva, buf)?;
            for (i, b) in self.bytes.iter().enumerate() {
                if let Some(o) = (self.at.0 + i as u64)
                    .checked_sub(gva.0)
                    .filter(|&o| o < buf.len() as u64)
                {
                    buf[o as usize] = *b;
                }
            }
            Ok(())
        }
    }

    fn sym(name: &str, addr: u64, kind: char, size: Option<u64>) -> Symbol {
        Symbol {
            name: name.into(),
            addr: Gva(addr),
            kind,
            size,
        }
    }

    fn small() -> SymbolTable {
        SymbolTable::from_symbols(
            SymbolSource::Elf,
            vec![
                sym("second_static", 0xffff_ffff_8100_2000, 't', Some(0x20)),
                sym("_stext", 0xffff_ffff_8100_0000, 'T', None),
                sym("startup_64", 0xffff_ffff_8100_0000, 'T', Some(0x40)),
                sym("dup", 0xffff_ffff_8100_1000, 't', Some(0x10)),
                sym("dup", 0xffff_ffff_8100_0800, 't', Some(0x10)),
                sym("percpu_thing", 0x2000, 'D', Some(8)),
                sym("__abs_const", 0xffff_ffff_8100_0100, 'A', None),
                sym("_etext", 0xffff_ffff_8100_3000, 'T', None),
            ],
        )
    }

    #[test]
    fn resolve_accepts_name_and_offsets() {
        let t = small();
        let r = t.resolve("startup_64").expect("known");
        assert_eq!(
            (r.addr, r.offset, r.source),
            (Gva(0xffff_ffff_8100_0000), 0, SymbolSource::Elf)
        );
        assert_eq!(
            t.resolve("startup_64+0x10").expect("hex").addr,
            Gva(0xffff_ffff_8100_0010)
        );
        assert_eq!(
            t.resolve("startup_64+16").expect("dec").addr,
            Gva(0xffff_ffff_8100_0010)
        );
        assert_eq!(t.resolve("startup_64+0X1f").expect("HEX").offset, 0x1f);
    }

    #[test]
    fn resolve_reports_what_is_wrong() {
        let t = small();
        let msg = |s: &str| t.resolve(s).unwrap_err().to_string();
        assert!(matches!(t.resolve("nope"), Err(SymbolError::UnknownSymbol(n)) if n == "nope"));
        assert!(matches!(t.resolve("nope+4"), Err(SymbolError::UnknownSymbol(n)) if n == "nope"));
        assert!(msg("").contains("empty"));
        assert!(msg("+0x10").contains("no symbol name"), "{}", msg("+0x10"));
        assert!(msg("startup_64+").contains("no offset"));
        assert!(msg("startup_64+0x").contains("no digits"));
        assert!(msg("startup_64+0xzz").contains("not a decimal or 0x-prefixed"));
        assert!(msg("startup_64+1+2").contains("not a decimal"));
        assert!(msg("startup_64+-1").contains("not a decimal"));
        assert!(msg("startup_64+99999999999999999999").contains("does not fit"));
        assert!(msg("startup_64 +1").contains("contains ' '"));
        assert!(matches!(
            t.resolve("startup_64+0xffffffffffffffff"),
            Err(SymbolError::AddressOverflow { .. })
        ));
    }

    #[test]
    fn duplicates_resolve_to_the_lowest_and_are_all_listed() {
        let t = small();
        assert_eq!(t.resolve("dup").expect("dup").addr, Gva(0xffff_ffff_8100_0800));
        let all: Vec<_> = t.lookup_all("dup").map(|s| s.addr.0).collect();
        assert_eq!(all, vec![0xffff_ffff_8100_0800, 0xffff_ffff_8100_1000]);
        assert_eq!(t.lookup_all("absent").count(), 0);
    }

    #[test]
    fn describe_prefers_sized_aliases_and_uses_next_symbol_distance() {
        let t = small();
        let d = t.describe(Gva(0xffff_ffff_8100_0010)).expect("inside startup_64");
        assert_eq!(d.to_string(), "startup_64+0x10/0x40");
        // Past st_size: the kernel's view, distance to the next located symbol (the
        // absolute symbol in between does not count).
        let d = t
            .describe(Gva(0xffff_ffff_8100_0104))
            .expect("padding after startup_64");
        assert_eq!(d.to_string(), "startup_64+0x104/0x800");
        assert_eq!(
            t.describe(Gva(0xffff_ffff_8100_2004)).expect("static").to_string(),
            "second_static+0x4/0x20"
        );
        assert!(t.describe(Gva(0x10)).is_none(), "below the first symbol");
        assert!(
            t.describe(Gva(0xffff_ffff_8100_3000)).is_none(),
            "_etext has no size and nothing follows"
        );
        assert_eq!(t.extent(t.lookup("dup").expect("dup")), Some(0x800));
    }

    #[test]
    fn describe_prefers_a_function_over_a_section_marker_at_its_address() {
        // As kallsyms gives them: no sizes, the marker first.
        let t = SymbolTable::parse_system_map(
            "ffffffff81a00000 T __sched_text_start\nffffffff81a00000 T __schedule\nffffffff81a00400 T schedule\n",
        )
        .unwrap();
        let d = t.describe(Gva(0xffff_ffff_81a0_0000)).unwrap();
        assert_eq!(d.symbol.name, "__schedule");
    }

    #[test]
    fn relocation_moves_kernel_symbols_only() {
        let t = small().relocated(0x2a0_0000);
        assert_eq!(t.slide(), 0x2a0_0000);
        assert_eq!(t.resolve("startup_64").expect("moved").addr, Gva(0xffff_ffff_83a0_0000));
        assert_eq!(t.resolve("percpu_thing").expect("percpu").addr, Gva(0x2000));
        assert_eq!(t.resolve("__abs_const").expect("abs").addr, Gva(0xffff_ffff_8100_0100));
        assert_eq!(
            t.describe(Gva(0xffff_ffff_83a0_2001)).expect("moved").to_string(),
            "second_static+0x1/0x20"
        );
        let back = t.relocated(-0x2a0_0000);
        assert_eq!(
            back.resolve("startup_64").expect("back").addr,
            Gva(0xffff_ffff_8100_0000)
        );
        assert_eq!(back.slide(), 0);
    }

    #[test]
    fn system_map_errors_name_the_line() {
        let e = SymbolTable::parse_system_map("ffffffff81000000 T _text\nzzzz T bad\n").unwrap_err();
        assert!(e.to_string().contains("line 2: address is not hexadecimal"), "{e}");
        let e = SymbolTable::parse_system_map("ffffffff81000000 T\n").unwrap_err();
        assert!(e.to_string().contains("line 1: expected three fields"), "{e}");
        let e = SymbolTable::parse_system_map("ffffffff81000000 TT x\n").unwrap_err();
        assert!(e.to_string().contains("single letter"), "{e}");
        let e = SymbolTable::parse_system_map("ffffffff81000000 T x y\n").unwrap_err();
        assert!(e.to_string().contains("three fields"), "{e}");
        assert!(SymbolTable::parse_system_map("").expect("empty is fine").is_empty());
        assert!(matches!(
            SymbolTable::from_system_map_file("/nonexistent/System.map"),
            Err(SymbolError::Io { .. })
        ));
        assert!(matches!(
            SymbolTable::parse_elf(b"not an elf"),
            Err(SymbolError::Elf(_))
        ));
    }

    proptest::proptest! {
        #[test]
        fn resolve_never_panics(s in proptest::prelude::any::<String>()) {
            let _ = small().resolve(&s);
        }

        #[test]
        fn resolve_never_panics_on_spec_like_input(
            parts in proptest::collection::vec(
                proptest::sample::select(vec!["dup", "startup_64", "+", "0x", "0X", "f", "9", "18446744073709551615", "", " ", "-", "\u{0}", "é"]),
                0..6,
            )
        ) {
            let s: String = parts.concat();
            if let Ok(r) = small().resolve(&s) {
                proptest::prop_assert!(s.starts_with(&r.symbol.name));
            }
        }
    }

    fn guest_tables() -> (SymbolTable, SymbolTable) {
        let dir = guest_dir();
        let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map parses");
        let elf = SymbolTable::from_elf_file(dir.join("vmlinux")).expect("vmlinux symbols parse");
        (map, elf)
    }

    #[test]
    fn system_map_and_elf_agree_on_functions() {
        let (map, elf) = guest_tables();
        assert_eq!(map.source(), SymbolSource::SystemMap);
        let mut checked = 0;
        for s in map.symbols().iter().filter(|s| s.is_text()) {
            assert!(
                elf.lookup_all(&s.name)
                    .any(|e| e.addr == s.addr && e.kind.eq_ignore_ascii_case(&s.kind)),
                "{} {} {} from System.map is not in the ELF symbols",
                s.addr,
                s.kind,
                s.name
            );
            checked += 1;
        }
        assert!(checked > 10_000, "only {checked} text symbols");
        let vfs_read = elf.resolve("vfs_read").expect("vfs_read");
        assert_eq!(vfs_read.addr, map.resolve("vfs_read").expect("vfs_read").addr);
        let size = vfs_read.symbol.size.expect("functions have st_size");
        let mid = vfs_read.addr.checked_add(size / 2).expect("no overflow");
        assert_eq!(
            elf.describe(mid).expect("inside vfs_read").to_string(),
            format!("vfs_read+{:#x}/{size:#x}", size / 2)
        );
        println!(
            "checked {checked} text symbols; System.map has {}, ELF {}",
            map.len(),
            elf.len()
        );
    }

    #[test]
    fn kallsyms_decoded_offline_matches_system_map() {
        let dir = guest_dir();
        let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
        let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map");
        let text = map.resolve("_text").expect("_text").addr;
        let search = text..Gva(text.0 + 48 * 1024 * 1024);

        let started = Instant::now();
        let layout = KallsymsLayout::locate(&img, search.clone()).expect("kallsyms located");
        let located = started.elapsed();
        let ks = SymbolTable::from_kallsyms_layout(&img, &layout).expect("kallsyms decodes");
        let total = started.elapsed();
        println!(
            "kallsyms: located (with a validating decode) in {located:?}, decoded again in {:?}: {} symbols \
             (System.map {}) {layout:x?}",
            total - located,
            ks.len(),
            map.len()
        );
        assert_eq!(ks.source(), SymbolSource::Kallsyms);

        // The tables are where the linker put them.
        for (name, at) in [
            ("kallsyms_token_table", layout.token_table),
            ("kallsyms_token_index", layout.token_index),
            ("kallsyms_names", layout.names),
            ("kallsyms_markers", layout.markers),
            ("kallsyms_num_syms", layout.num_syms_addr),
            ("kallsyms_relative_base", layout.relative_base_addr),
            ("kallsyms_offsets", layout.offsets),
        ] {
            assert_eq!(map.resolve(name).expect(name).addr, at, "{name}");
        }
        assert_eq!(
            layout.seqs_of_names,
            map.lookup("kallsyms_seqs_of_names").map(|s| s.addr)
        );

        // Every kallsyms symbol is in System.map at the same address, with the same type
        // (per-CPU symbols are typed 'A' by kallsyms and 'D'/'d' by System.map).
        let mut percpu = 0;
        for s in ks.symbols() {
            let m = map.lookup_all(&s.name).find(|m| m.addr == s.addr).unwrap_or_else(|| {
                panic!("kallsyms {} {} {} not in System.map", s.addr, s.kind, s.name);
            });
            if s.kind == 'A' && m.kind != 'A' {
                percpu += 1;
                assert!(s.addr.0 < KERNEL_HALF, "{s:?}");
            } else {
                assert_eq!(s.kind, m.kind, "{s:?} vs {m:?}");
            }
        }
        let ks_names: HashSet<&str> = ks.symbols().iter().map(|s| s.name.as_str()).collect();
        let missing: Vec<&Symbol> = map
            .symbols()
            .iter()
            .filter(|s| !ks_names.contains(s.name.as_str()))
            .collect();
        println!(
            "kallsyms {} symbols ({percpu} per-CPU typed 'A'); System.map {}; {} System.map names not in kallsyms: {:?}",
            ks.len(),
            map.len(),
            missing.len(),
            missing.iter().map(|s| format!("{} {}", s.kind, s.name)).collect::<Vec<_>>()
        );
        assert!(ks.len() > 10_000 && ks.len() < map.len());
        assert!(percpu > 0);
        // What kallsyms leaves out is its own tables (they are added after its symbol
        // list is made) and absolute symbols; every function is there.
        let unexpected: Vec<_> = missing
            .iter()
            .filter(|s| s.is_text() && !s.name.starts_with("kallsyms_"))
            .map(|s| format!("{} {} {}", s.addr, s.kind, s.name))
            .collect();
        assert!(
            unexpected.is_empty(),
            "text symbols missing from kallsyms: {unexpected:?}"
        );
    }

    /// Guest RAM as one byte vector.
    struct Ram(Vec<u8>);

    impl hvprobe_arch::paging::PhysRead for Ram {
        fn read_phys(&self, gpa: hvprobe_arch::Gpa, buf: &mut [u8]) -> Result<(), String> {
            let src = usize::try_from(gpa.0)
                .ok()
                .and_then(|start| self.0.get(start..start.checked_add(buf.len())?))
                .ok_or_else(|| {
                    format!(
                        "{gpa} + {:#x} is beyond the {:#x} bytes of RAM",
                        buf.len(),
                        self.0.len()
                    )
                })?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    #[test]
    fn kallsyms_decodes_through_guest_page_tables() {
        use goblin::elf::program_header::PT_LOAD;
        use hvprobe_arch::paging::PagingMode;

        // Load vmlinux the way a boot loader does (segments at their physical addresses)
        // and map the kernel image the way head_64.S does, with 2 MiB pages, except the
        // first 2 MiB through a 4 KiB page table; then find kallsyms through the walk.
        let dir = guest_dir();
        let bytes = std::fs::read(dir.join("vmlinux")).expect("vmlinux");
        let elf = goblin::elf::Elf::parse(&bytes).expect("ELF");
        let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map");
        let image_end = elf
            .program_headers
            .iter()
            .filter(|p| p.p_type == PT_LOAD)
            .map(|p| p.p_paddr + p.p_memsz)
            .max()
            .expect("segments");
        let ram_len = (image_end + (4 << 20)) & !0x1f_ffff;
        let mut ram = vec![0u8; ram_len as usize];
        for p in elf.program_headers.iter().filter(|p| p.p_type == PT_LOAD) {
            let (dst, src) = (p.p_paddr as usize, p.p_offset as usize);
            ram[dst..dst + p.p_filesz as usize].copy_from_slice(&bytes[src..src + p.p_filesz as usize]);
        }
        let text = map.resolve("_text").expect("_text").addr;
        let phys_base = 0x100_0000u64;
        let (pml4, pdpt, pd, pt) = (0x10_0000u64, 0x10_1000u64, 0x10_2000u64, 0x10_3000u64);
        let mut put = |at: u64, v: u64| ram[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes());
        put(pml4 + ((text.0 >> 39) & 0x1ff) * 8, pdpt | 0x3);
        put(pdpt + ((text.0 >> 30) & 0x1ff) * 8, pd | 0x3);
        let pd_first = (text.0 >> 21) & 0x1ff;
        put(pd + pd_first * 8, pt | 0x3);
        for i in 0..512 {
            put(pt + i * 8, (phys_base + i * 0x1000) | 0x1); // read-only 4 KiB pages
        }
        let big_pages = (image_end - phys_base).div_ceil(0x20_0000);
        for i in 1..big_pages {
            put(pd + (pd_first + i) * 8, (phys_base + i * 0x20_0000) | 0x83);
        }
        let mem = crate::memory::PagedGuestMemory::new(Ram(ram), pml4, PagingMode::Level4);
        let t = mem.translate(text).expect("text mapped");
        assert_eq!(
            (t.gpa.0, t.page_size),
            (phys_base, hvprobe_arch::paging::PageSize::Size4K)
        );

        let started = Instant::now();
        let ks = SymbolTable::from_kallsyms(&mem, text..Gva(text.0 + (48 << 20))).expect("kallsyms via page walk");
        println!(
            "kallsyms through 4-level page walks: {} symbols in {:?}",
            ks.len(),
            started.elapsed()
        );
        let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
        let offline = SymbolTable::from_kallsyms(&img, text..Gva(text.0 + (48 << 20))).expect("kallsyms offline");
        assert_eq!(ks.symbols(), offline.symbols());
    }

    #[test]
    fn kallsyms_search_fails_cleanly_where_there_is_none() {
        let dir = guest_dir();
        let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
        let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map");
        let text = map.resolve("_stext").expect("_stext").addr;
        // Kernel text alone holds no token table.
        let etext = map.resolve("_etext").expect("_etext").addr;
        match SymbolTable::from_kallsyms(&img, text..etext) {
            Err(SymbolError::KallsymsNotFound { start, end, .. }) => assert_eq!((start, end), (text, etext)),
            other => panic!("expected KallsymsNotFound, got {:?}", other.map(|t| t.len())),
        }
        // An unmapped range.
        assert!(matches!(
            SymbolTable::from_kallsyms(&img, Gva(0x1000)..Gva(0x10_0000)),
            Err(SymbolError::KallsymsNotFound { .. })
        ));
        // A corrupted marker table is caught by validation, not decoded into garbage.
        let layout = KallsymsLayout::locate(&img, text..Gva(text.0 + 48 * 1024 * 1024)).expect("located");
        // The second marker claims symbol 256 starts at byte 1 of the names.
        let bad = Patched {
            inner: &img,
            at: Gva(layout.markers.0 + 4),
            bytes: 1u32.to_le_bytes().to_vec(),
        };
        assert!(matches!(layout.decode(&bad), Err(SymbolError::KallsymsInvalid { .. })));
    }
}
