//! Kernel symbols from three sources behind one table: a System.map file, the vmlinux ELF
//! symbol table, and kallsyms decoded from guest memory (found by content, so a guest
//! whose System.map is lost can still be probed by name).
//!
//! Addresses in a System.map or ELF table are link-time addresses; with KASLR the running
//! kernel is shifted by a slide ([`SymbolTable::relocated`]). Kallsyms read from a running
//! guest already holds run-time addresses.

mod kallsyms;
#[cfg(any(test, feature = "test-support"))]
pub mod synthetic;

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
    /// A hostile or corrupt guest made the kallsyms search or decode do more work than any
    /// real kernel needs: symbols from kallsyms are off for this run.
    #[error("kallsyms: {structure} is over its limit of {limit} {unit} (a real kernel needs a fraction of that; hostile or corrupt guest memory?)")]
    KallsymsOverBudget {
        structure: &'static str,
        limit: u64,
        unit: &'static str,
    },
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
    /// ELF `st_size` when that covers the address, else the distance to the next symbol:
    /// how far the function's code goes.
    pub size: u64,
    /// The distance to the next symbol, as the kernel's kallsyms sizes a symbol (it has no
    /// sizes): what its `%pS` prints after the slash, padding included.
    pub kallsyms_size: u64,
    pub source: SymbolSource,
}

/// `symbol+offset/size` as the kernel's `%pS` prints it.
impl fmt::Display for Description<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{:#x}/{:#x}", self.symbol.name, self.offset, self.kallsyms_size)
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
    /// The addresses of `located`, side by side: address searches (every stack frame of
    /// a hit is described) walk one contiguous array instead of the symbols themselves.
    located_addrs: Vec<Gva>,
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
        let located_addrs = located.iter().map(|&i| symbols[i as usize].addr).collect();
        SymbolTable {
            source,
            symbols,
            by_name,
            located,
            located_addrs,
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
        // The search validates a candidate by decoding it: keep those symbols rather than
        // decoding (and holding) every name twice.
        let (_, symbols) = KallsymsLayout::locate_and_decode(mem, search)?;
        Ok(Self::from_symbols(SymbolSource::Kallsyms, symbols))
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
        let next = self.located_addrs.partition_point(|&a| a <= symbol.addr);
        Some(self.located_addrs.get(next)?.0 - symbol.addr.0)
    }

    /// The size of `symbol`: its ELF size when known, else [`extent`](Self::extent).
    pub fn size_of(&self, symbol: &Symbol) -> Option<u64> {
        symbol.size.or_else(|| self.extent(symbol))
    }

    /// Describes an address as `symbol+offset/size`. Among aliases at one address the
    /// kernel's kallsyms order is followed: not weak, not a section marker (`__schedule`,
    /// not `__sched_text_start`), fewest leading underscores, then the first name in `nm
    /// -n`'s order, which sorts equal addresses by name (`__do_sys_getppid`, not its alias
    /// `__x64_sys_getppid`).
    /// `None` below the first symbol or past the end of the last one.
    pub fn describe(&self, gva: Gva) -> Option<Description<'_>> {
        let end = self.located_addrs.partition_point(|&a| a <= gva);
        let at = *self.located_addrs.get(end.checked_sub(1)?)?;
        let first = self.located_addrs[..end].partition_point(|&a| a < at);
        let symbol = self.located[first..end]
            .iter()
            .map(|&i| &self.symbols[i as usize])
            .min_by_key(|s| {
                (
                    matches!(s.kind, 'W' | 'w' | 'V' | 'v'),
                    is_section_marker(&s.name),
                    s.name.bytes().take_while(|&b| b == b'_').count(),
                    !s.is_text(),
                    s.name.as_str(),
                )
            })?;
        let offset = gva.0 - at.0;
        let extent = self.extent(symbol);
        let size = match (symbol.size, extent) {
            (Some(sz), _) if offset < sz => sz,
            (_, Some(ext)) if offset < ext => ext,
            _ => return None,
        };
        Some(Description {
            symbol,
            offset,
            size,
            kallsyms_size: extent.filter(|&ext| offset < ext).unwrap_or(size),
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
    fn describe_sizes_as_kallsyms_does_and_bounds_code_by_the_elf_size() {
        let t = small();
        // The kernel's view: the distance to the next located symbol (the absolute symbol
        // in between does not count), the ELF size where it bounds the function's code.
        let d = t.describe(Gva(0xffff_ffff_8100_0010)).expect("inside startup_64");
        assert_eq!(d.to_string(), "startup_64+0x10/0x800");
        assert_eq!(d.size, 0x40);
        let d = t
            .describe(Gva(0xffff_ffff_8100_0104))
            .expect("padding after startup_64");
        assert_eq!(d.to_string(), "startup_64+0x104/0x800");
        assert_eq!(d.size, 0x800);
        let d = t.describe(Gva(0xffff_ffff_8100_2004)).expect("static");
        assert_eq!((d.to_string().as_str(), d.size), ("second_static+0x4/0x1000", 0x20));
        assert!(t.describe(Gva(0x10)).is_none(), "below the first symbol");
        assert!(
            t.describe(Gva(0xffff_ffff_8100_3000)).is_none(),
            "_etext has no size and nothing follows"
        );
        assert_eq!(t.extent(t.lookup("dup").expect("dup")), Some(0x800));
    }

    #[test]
    fn describe_names_aliases_as_kallsyms_does() {
        // SYSCALL_DEFINE0's stub and body at one address, both sized (GCC 12, -O2): the
        // kernel's kallsyms and `%pS` name the first by name, as `nm -n` sorts them, whatever
        // order the source lists them in.
        let elf = SymbolTable::from_symbols(
            SymbolSource::Elf,
            vec![
                sym("__x64_sys_getppid", 0xffff_ffff_8106_4170, 'T', Some(0x24)),
                sym("__do_sys_getppid", 0xffff_ffff_8106_4170, 't', Some(0x24)),
                sym("__x64_sys_getpid", 0xffff_ffff_8106_41a0, 'T', Some(0x24)),
            ],
        );
        let d = elf.describe(Gva(0xffff_ffff_8106_4170)).unwrap();
        assert_eq!(d.to_string(), "__do_sys_getppid+0x0/0x30");
        // Fewer leading underscores first; weak last.
        let t = SymbolTable::parse_system_map(
            "ffffffff81000000 W __weak_one\nffffffff81000000 t __b\nffffffff81000000 t _a_longer_name\n\
             ffffffff81000100 t next\n",
        )
        .unwrap();
        assert_eq!(
            t.describe(Gva(0xffff_ffff_8100_0000)).unwrap().symbol.name,
            "_a_longer_name"
        );
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
            "second_static+0x1/0x1000"
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
}
