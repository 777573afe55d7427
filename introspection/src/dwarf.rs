//! A kernel's DWARF, for probes written against its source: the addresses of a function's
//! source lines, the variables visible at an address and where each one is, and the C types
//! that give their fields. What `perf probe` reads with libdw, read here with `gimli`.
//!
//! The vmlinux is the user's file, not guest memory, but it is still input: every DIE walk
//! is bounded (depth, origin chains, expression length), and anything gimli cannot parse is
//! a [`DwarfError`] naming the section or the DIE, never a panic.
//!
//! Addresses are the vmlinux's link-time ones; a caller that probes a running kernel turns
//! them into `function+offset`, which follows a KASLR slide.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use gimli::{AttributeValue, EndianArcSlice, Operation, Reader, RunTimeEndian, UnitOffset};
use goblin::elf::Elf;

type DwarfReader = EndianArcSlice<RunTimeEndian>;

/// Deepest nesting of DIEs followed (lexical blocks and inlined calls inside a function).
const MAX_DEPTH: usize = 64;
/// Longest chain of `DW_AT_abstract_origin`/`DW_AT_specification`/`DW_AT_type` links
/// followed for one name or type.
const MAX_CHAIN: usize = 16;
/// Most operations in one location expression.
const MAX_OPS: usize = 32;
/// Most sites one source line may stand for.
pub const MAX_LINE_SITES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum DwarfError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not an ELF file: {reason}")]
    NotElf { path: String, reason: String },
    #[error("{path}: has no DWARF (no .debug_info section): build the kernel with CONFIG_DEBUG_INFO")]
    NoDwarf { path: String },
    #[error("the kernel's DWARF is malformed ({what}): {source}")]
    Malformed {
        what: &'static str,
        #[source]
        source: gimli::Error,
    },
    #[error("the kernel's DWARF nests DIEs deeper than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("{path}: relocation {index} of {section} is not one a module's DWARF has ({reason})")]
    BadRelocation {
        path: String,
        section: String,
        index: usize,
        reason: String,
    },
}

fn malformed(what: &'static str) -> impl FnOnce(gimli::Error) -> DwarfError {
    move |source| DwarfError::Malformed { what, source }
}

/// A DIE: the unit it is in (an index into [`DebugInfo`]'s units) and its offset there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DieRef {
    unit: usize,
    offset: UnitOffset<usize>,
}

/// The x86-64 registers DWARF numbers 0–16 name (the psABI's DWARF register mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DwarfRegister {
    Ax,
    Dx,
    Cx,
    Bx,
    Si,
    Di,
    Bp,
    Sp,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
}

impl DwarfRegister {
    fn from_number(n: u16) -> Option<DwarfRegister> {
        use DwarfRegister::*;
        Some(match n {
            0 => Ax,
            1 => Dx,
            2 => Cx,
            3 => Bx,
            4 => Si,
            5 => Di,
            6 => Bp,
            7 => Sp,
            8 => R8,
            9 => R9,
            10 => R10,
            11 => R11,
            12 => R12,
            13 => R13,
            14 => R14,
            15 => R15,
            _ => return None,
        })
    }
}

/// Where a variable's value is at an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// In a register.
    Register(DwarfRegister),
    /// In memory at a register plus an offset.
    RegisterMemory { register: DwarfRegister, offset: i64 },
    /// In memory at the canonical frame address plus an offset (`DW_OP_fbreg` with a
    /// `DW_OP_call_frame_cfa` frame base): the caller turns the CFA into a register and an
    /// offset at the address (ORC or CFI).
    FrameMemory { offset: i64 },
    /// In memory at a fixed (link-time) address: a global or static variable.
    Memory(u64),
    /// Not stored anywhere: the compiler knows its value.
    Constant(u64),
}

/// Why a variable cannot be read at an address (perf probe's refusals, in its terms).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("it is optimized out at this address (no location covers it)")]
    OptimizedOut,
    #[error(
        "only its value at the function's entry is described (DW_OP_entry_value), which is not kept at this address"
    )]
    EntryValue,
    #[error("it is split across several places (DW_OP_piece)")]
    Pieces,
    #[error("its location is computed ({0}), which a fetch-arg cannot express")]
    Computed(String),
    #[error("its frame base is not the canonical frame address")]
    FrameBase,
    #[error("it is only declared here (`extern`), and no symbol names it")]
    Declaration,
}

/// A variable or parameter in scope at an address.
#[derive(Clone, Debug)]
pub struct Variable {
    pub name: String,
    pub is_parameter: bool,
    /// A variable of the unit's top level: a global or file-`static` one, or an `extern`
    /// declaration (whose location is [`Unavailable::Declaration`]: the symbol table has it).
    pub global: bool,
    pub ty: Option<DieRef>,
    pub location: Result<Location, Unavailable>,
}

/// A function's code in the DWARF: an out-of-line subprogram, or one inlined instance.
#[derive(Clone, Debug)]
pub struct Function {
    pub name: String,
    /// The file it is declared in, as the line table names it (directory and name).
    pub decl_file: Option<String>,
    pub decl_line: u64,
    /// Its code, in link-time addresses.
    pub ranges: Vec<Range<u64>>,
    /// An inlined instance rather than the function's own code.
    pub inlined: bool,
    /// `DW_AT_entry_pc`: where an inlined instance's code is entered, when the compiler
    /// says (its lowest address need not be).
    pub entry_pc: Option<u64>,
    die: DieRef,
}

impl Function {
    /// The address its code starts at (the lowest of its ranges).
    pub fn low_pc(&self) -> u64 {
        lowest(&self.ranges)
    }

    /// Where its code is entered: `DW_AT_entry_pc` inside its ranges, else its lowest
    /// address.
    pub fn entry(&self) -> u64 {
        self.entry_pc
            .filter(|&a| self.contains(a))
            .unwrap_or_else(|| self.low_pc())
    }

    pub fn contains(&self, address: u64) -> bool {
        self.ranges.iter().any(|r| r.contains(&address))
    }
}

/// A source line of a function and where its code starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceLine {
    pub file: String,
    pub line: u64,
    /// The first address of each run of code the line table gives this line (statement
    /// rows only), in address order; empty for a line with no code of its own.
    pub addresses: Vec<u64>,
}

/// What a C type is, as far as a fetch-arg needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TypeShape {
    /// An integer (and `bool`, `char`, an enum's underlying type).
    Integer {
        size: u8,
        signed: bool,
    },
    Pointer {
        pointee: Option<DieRef>,
    },
    Struct {
        size: u64,
    },
    Union {
        size: u64,
    },
    Array {
        element: Option<DieRef>,
    },
    Float {
        size: u8,
    },
    Void,
    Function,
}

/// A member of a struct or union.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Byte offset from the start of the struct.
    pub offset: u64,
    pub ty: Option<DieRef>,
    /// `(bit offset from `offset`, width)` for a bitfield.
    pub bits: Option<(u8, u8)>,
}

struct UnitEntry {
    unit: gimli::Unit<DwarfReader>,
    /// Where the unit's DIEs are in `.debug_info`, to resolve cross-unit references.
    section: Range<usize>,
    ranges: Vec<Range<u64>>,
}

/// A vmlinux's DWARF (or a module's: a relocatable `.ko`), indexed by unit.
pub struct DebugInfo {
    dwarf: gimli::Dwarf<DwarfReader>,
    units: Vec<UnitEntry>,
    /// For a relocatable object (a `.ko`): its functions and variables at the addresses
    /// its DWARF was relocated to (see [`DebugInfo::object_symbols`]).
    object_symbols: Option<crate::symbols::SymbolTable>,
}

impl std::fmt::Debug for DebugInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DebugInfo").field("units", &self.units.len()).finish()
    }
}

impl DebugInfo {
    /// The DWARF of the ELF file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<DebugInfo, DwarfError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let data = std::fs::read(path).map_err(|source| DwarfError::Io {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&data, &shown)
    }

    /// The DWARF of an ELF file's bytes (`name` for errors).
    pub fn parse(data: &[u8], name: &str) -> Result<DebugInfo, DwarfError> {
        let elf = Elf::parse(data).map_err(|e| DwarfError::NotElf {
            path: name.to_owned(),
            reason: e.to_string(),
        })?;
        let endian = if elf.little_endian {
            RunTimeEndian::Little
        } else {
            RunTimeEndian::Big
        };
        let section_bytes = |index: usize| -> Option<&[u8]> {
            let header = elf.section_headers.get(index)?;
            if header.sh_type == goblin::elf::section_header::SHT_NOBITS {
                return None;
            }
            let start = usize::try_from(header.sh_offset).ok()?;
            let end = start.checked_add(usize::try_from(header.sh_size).ok()?)?;
            data.get(start..end)
        };
        let index_of = |wanted: &str| {
            elf.section_headers
                .iter()
                .position(|h| elf.shdr_strtab.get_at(h.sh_name) == Some(wanted))
        };
        if index_of(".debug_info").and_then(section_bytes).is_none() {
            return Err(DwarfError::NoDwarf { path: name.to_owned() });
        }
        let object = (elf.header.e_type == goblin::elf::header::ET_REL).then(|| relocatable::Layout::of(&elf));
        let load = |id: gimli::SectionId| -> Result<DwarfReader, DwarfError> {
            let Some(index) = index_of(id.name()) else {
                return Ok(EndianArcSlice::new(Arc::from(&[][..]), endian));
            };
            let bytes = section_bytes(index).unwrap_or(&[]);
            let bytes: Arc<[u8]> = match &object {
                Some(layout) => Arc::from(layout.relocated(&elf, index, bytes, name)?),
                None => Arc::from(bytes),
            };
            Ok(EndianArcSlice::new(bytes, endian))
        };
        let dwarf = gimli::Dwarf::load(load)?;
        let mut units = Vec::new();
        let mut headers = dwarf.units();
        while let Some(header) = headers.next().map_err(malformed(".debug_info unit header"))? {
            let Some(start) = header.offset().to_debug_info_offset(&header).map(|o| o.0) else {
                continue;
            };
            let end = start.saturating_add(header.length_including_self());
            let unit = dwarf.unit(header).map_err(malformed(".debug_info unit"))?;
            let mut ranges = Vec::new();
            let mut iter = dwarf.unit_ranges(&unit).map_err(malformed("a unit's ranges"))?;
            while let Some(r) = iter.next().map_err(malformed("a unit's ranges"))? {
                if r.begin < r.end {
                    ranges.push(r.begin..r.end);
                }
            }
            units.push(UnitEntry {
                unit,
                section: start..end,
                ranges,
            });
        }
        let object_symbols = object.map(|layout| layout.symbols(&elf));
        Ok(DebugInfo {
            dwarf,
            units,
            object_symbols,
        })
    }

    /// For a relocatable object (a module's `.ko`): its symbols at the addresses its DWARF
    /// was relocated to — each allocated section laid out after the other from 0x1000, as
    /// no loader would, but consistently, so that an address the DWARF gives is a
    /// function of these symbols plus an offset (what a `MOD:SYM+OFF` probe needs). `None`
    /// for a linked image (its own symbol table has its addresses).
    pub fn object_symbols(&self) -> Option<&crate::symbols::SymbolTable> {
        self.object_symbols.as_ref()
    }

    fn unit_of_section_offset(&self, offset: usize) -> Option<usize> {
        self.units.iter().position(|u| u.section.contains(&offset))
    }

    fn entry(&self, die: DieRef) -> Option<gimli::DebuggingInformationEntry<DwarfReader>> {
        self.units.get(die.unit)?.unit.entry(die.offset).ok()
    }

    /// A reference attribute as a [`DieRef`].
    fn reference(&self, unit: usize, value: AttributeValue<DwarfReader>) -> Option<DieRef> {
        match value {
            AttributeValue::UnitRef(offset) => Some(DieRef { unit, offset }),
            AttributeValue::DebugInfoRef(offset) => {
                let unit = self.unit_of_section_offset(offset.0)?;
                let start = self.units[unit].section.start;
                Some(DieRef {
                    unit,
                    offset: UnitOffset(offset.0.checked_sub(start)?),
                })
            }
            _ => None,
        }
    }

    fn string(&self, unit: usize, value: AttributeValue<DwarfReader>) -> Option<String> {
        let entry = self.units.get(unit)?;
        let s = self.dwarf.attr_string(&entry.unit, value).ok()?;
        Some(s.to_string_lossy().ok()?.into_owned())
    }

    /// An attribute of a DIE, or of what it is an instance or the definition of
    /// (`DW_AT_abstract_origin`, `DW_AT_specification`), with the unit it was found in.
    fn inherited(&self, die: DieRef, at: gimli::DwAt) -> Option<(usize, AttributeValue<DwarfReader>)> {
        let mut die = die;
        for _ in 0..MAX_CHAIN {
            let entry = self.entry(die)?;
            if let Some(v) = entry.attr_value(at) {
                return Some((die.unit, v));
            }
            let origin = entry
                .attr_value(gimli::DW_AT_abstract_origin)
                .or_else(|| entry.attr_value(gimli::DW_AT_specification))?;
            die = self.reference(die.unit, origin)?;
        }
        None
    }

    fn name_of(&self, die: DieRef) -> Option<String> {
        let (unit, v) = self.inherited(die, gimli::DW_AT_name)?;
        self.string(unit, v)
    }

    fn type_of(&self, die: DieRef) -> Option<DieRef> {
        let (unit, v) = self.inherited(die, gimli::DW_AT_type)?;
        self.reference(unit, v)
    }

    fn udata(&self, die: DieRef, at: gimli::DwAt) -> Option<u64> {
        self.inherited(die, at).and_then(|(_, v)| v.udata_value())
    }

    /// A file index of a unit's line table as a path (`dir/name`).
    fn file_name(&self, unit: usize, index: u64) -> Option<String> {
        let entry = self.units.get(unit)?;
        let program = entry.unit.line_program.as_ref()?;
        let header = program.header();
        let file = header.file(index)?;
        let name = self.string(unit, file.path_name())?;
        if name.starts_with('/') {
            return Some(name);
        }
        let dir = file
            .directory(header)
            .and_then(|d| self.string(unit, d))
            .unwrap_or_default();
        Some(if dir.is_empty() { name } else { format!("{dir}/{name}") })
    }

    /// Whether the code of `die` (a function, an inlined call, a block) holds `address`.
    fn holds(&self, die: DieRef, address: u64) -> bool {
        self.die_ranges(die).iter().any(|r| r.contains(&address))
    }

    fn die_ranges(&self, die: DieRef) -> Vec<Range<u64>> {
        let Some(entry) = self.units.get(die.unit) else {
            return Vec::new();
        };
        let Some(de) = self.entry(die) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if let Ok(mut iter) = self.dwarf.die_ranges(&entry.unit, &de) {
            while let Ok(Some(r)) = iter.next() {
                if r.begin < r.end {
                    out.push(r.begin..r.end);
                }
            }
        }
        out
    }

    fn function(&self, die: DieRef, inlined: bool) -> Option<Function> {
        let name = self.name_of(die)?;
        let (file_unit, decl_file) = match self.inherited(die, gimli::DW_AT_decl_file) {
            Some((u, AttributeValue::FileIndex(i))) => (u, Some(i)),
            Some((u, v)) => (u, v.udata_value()),
            None => (die.unit, None),
        };
        let ranges = self.die_ranges(die);
        let low = lowest(&ranges);
        let entry_pc = self
            .entry(die)
            .and_then(|e| match e.attr_value(gimli::DW_AT_entry_pc)? {
                // DWARF 5: a constant is an offset from the lowest address.
                v @ (AttributeValue::Udata(_)
                | AttributeValue::Data1(_)
                | AttributeValue::Data2(_)
                | AttributeValue::Data4(_)
                | AttributeValue::Data8(_)) => v.udata_value().and_then(|o| low.checked_add(o)),
                v => self
                    .dwarf
                    .attr_address(&self.units.get(die.unit)?.unit, v)
                    .ok()
                    .flatten(),
            });
        Some(Function {
            name,
            decl_file: decl_file.and_then(|f| self.file_name(file_unit, f)),
            decl_line: self.udata(die, gimli::DW_AT_decl_line).unwrap_or(0),
            ranges,
            inlined,
            entry_pc,
            die,
        })
    }

    /// Visits the DIEs under `from` (the unit's root when `None`) depth first, with their
    /// depth below it, going into those `visit` says to; bounded by [`MAX_DEPTH`].
    fn walk(
        &self,
        unit: usize,
        from: Option<UnitOffset<usize>>,
        visit: &mut dyn FnMut(DieRef, gimli::DwTag, usize) -> Walk,
    ) -> Result<(), DwarfError> {
        let entry = &self.units[unit];
        let mut tree = entry.unit.entries_tree(from).map_err(malformed(".debug_info"))?;
        let root = tree.root().map_err(malformed(".debug_info"))?;
        fn recurse(
            node: gimli::EntriesTreeNode<'_, '_, DwarfReader>,
            unit: usize,
            depth: usize,
            visit: &mut dyn FnMut(DieRef, gimli::DwTag, usize) -> Walk,
        ) -> Result<(), DwarfError> {
            if depth > MAX_DEPTH {
                return Err(DwarfError::TooDeep);
            }
            let mut children = node.children();
            while let Some(child) = children.next().map_err(malformed(".debug_info"))? {
                let e = child.entry();
                let die = DieRef {
                    unit,
                    offset: e.offset(),
                };
                if visit(die, e.tag(), depth) == Walk::Into {
                    recurse(child, unit, depth + 1, visit)?;
                }
            }
            Ok(())
        }
        recurse(root, unit, 0, visit)
    }

    /// [`walk`](Self::walk) over a whole unit.
    fn walk_unit(&self, unit: usize, visit: &mut dyn FnMut(DieRef, gimli::DwTag) -> Walk) -> Result<(), DwarfError> {
        self.walk(unit, None, &mut |die, tag, _| visit(die, tag))
    }

    /// The functions named `name` whose own (out-of-line) code holds `address`, or, with no
    /// address, every out-of-line definition of that name.
    pub fn functions_named(&self, name: &str, address: Option<u64>) -> Result<Vec<Function>, DwarfError> {
        let mut found = Vec::new();
        for unit in 0..self.units.len() {
            if let Some(a) = address {
                if !self.units[unit].ranges.iter().any(|r| r.contains(&a)) {
                    continue;
                }
            }
            self.walk_unit(unit, &mut |die, tag| match tag {
                gimli::DW_TAG_subprogram => {
                    // The name first: a unit has thousands of functions, one of them this.
                    if self.name_of(die).as_deref() == Some(name) {
                        if let Some(f) = self.function(die, false) {
                            if !f.ranges.is_empty() && address.is_none_or(|a| f.contains(a)) {
                                found.push(f);
                            }
                        }
                    }
                    Walk::Skip
                }
                gimli::DW_TAG_namespace => Walk::Into,
                _ => Walk::Skip,
            })?;
        }
        Ok(found)
    }

    /// Every inlined instance of the function `name` (its `DW_TAG_inlined_subroutine`s).
    pub fn inlined_instances(&self, name: &str) -> Result<Vec<Function>, DwarfError> {
        let mut found = Vec::new();
        for unit in 0..self.units.len() {
            self.walk_unit(unit, &mut |die, tag| match tag {
                gimli::DW_TAG_inlined_subroutine => {
                    if self.name_of(die).as_deref() == Some(name) {
                        if let Some(f) = self.function(die, true).filter(|f| !f.ranges.is_empty()) {
                            found.push(f);
                        }
                    }
                    Walk::Into
                }
                gimli::DW_TAG_subprogram | gimli::DW_TAG_lexical_block | gimli::DW_TAG_namespace => Walk::Into,
                _ => Walk::Skip,
            })?;
        }
        Ok(found)
    }

    /// The source lines of `function` that have code in its ranges, by line: lines of its
    /// own file from its declaration on (those above it are helpers of the file inlined
    /// into it).
    pub fn lines(&self, function: &Function) -> Result<Vec<SourceLine>, DwarfError> {
        let unit = function.die.unit;
        let mut by_line: BTreeMap<(String, u64), Vec<u64>> = BTreeMap::new();
        let mut files: BTreeMap<u64, Option<String>> = BTreeMap::new();
        self.statement_starts(unit, &mut |line, file_index, address| {
            // Lines above the declaration are helpers of the same file inlined into it.
            if line < function.decl_line.max(1) || !function.contains(address) {
                return true;
            }
            let file = files
                .entry(file_index)
                .or_insert_with(|| self.file_name(unit, file_index))
                .clone();
            match file {
                Some(file) if function.decl_file.as_deref().is_none_or(|d| d == file) => {
                    let addrs = by_line.entry((file, line)).or_default();
                    if !addrs.contains(&address) {
                        addrs.push(address);
                    }
                }
                _ => {}
            }
            true
        })?;
        Ok(by_line
            .into_iter()
            .map(|((file, line), mut addresses)| {
                addresses.sort_unstable();
                SourceLine { file, line, addresses }
            })
            .collect())
    }

    /// The address of every statement start of line `line` of a file whose path ends with
    /// `file` (at a `/`), in every unit, at most [`MAX_LINE_SITES`] + 1 (the caller refuses
    /// more).
    pub fn file_line(&self, file: &str, line: u64) -> Result<Vec<u64>, DwarfError> {
        let mut found: Vec<u64> = Vec::new();
        for unit in 0..self.units.len() {
            let mut files: BTreeMap<u64, bool> = BTreeMap::new();
            self.statement_starts(unit, &mut |l, file_index, address| {
                if l != line {
                    return true;
                }
                let matches = *files.entry(file_index).or_insert_with(|| {
                    self.file_name(unit, file_index)
                        .is_some_and(|f| path_ends_with(&f, file))
                });
                if matches && !found.contains(&address) {
                    found.push(address);
                }
                found.len() <= MAX_LINE_SITES
            })?;
            if found.len() > MAX_LINE_SITES {
                break;
            }
        }
        Ok(found)
    }

    /// Calls `visit(line, file index, address)` for the first row of each run of a line's
    /// statement rows in `unit`'s line table (a run of rows of one line is one place to
    /// probe, at its first address), until it returns false.
    fn statement_starts(&self, unit: usize, visit: &mut dyn FnMut(u64, u64, u64) -> bool) -> Result<(), DwarfError> {
        let Some(program) = self.units[unit].unit.line_program.clone() else {
            return Ok(());
        };
        let mut rows = program.rows();
        // The previous row's (line, file) in this sequence.
        let mut previous: Option<(u64, u64)> = None;
        while let Some((_, row)) = rows.next_row().map_err(malformed(".debug_line"))? {
            if row.end_sequence() {
                previous = None;
                continue;
            }
            let line = row.line().map_or(0, |l| l.get());
            let key = (line, row.file_index());
            let same_run = previous == Some(key);
            previous = Some(key);
            if same_run || !row.is_stmt() || line == 0 {
                continue;
            }
            if !visit(line, row.file_index(), row.address()) {
                break;
            }
        }
        Ok(())
    }

    /// The innermost function (an inlined instance, or the subprogram) whose code holds
    /// `address`, and the subprogram itself.
    pub fn scope_at(&self, address: u64) -> Result<Option<(Function, Function)>, DwarfError> {
        for unit in 0..self.units.len() {
            if !self.units[unit].ranges.iter().any(|r| r.contains(&address)) {
                continue;
            }
            let mut subprogram = None;
            let mut innermost = None;
            self.walk_unit(unit, &mut |die, tag| match tag {
                gimli::DW_TAG_subprogram | gimli::DW_TAG_inlined_subroutine => {
                    if !self.holds(die, address) {
                        return Walk::Skip;
                    }
                    let inlined = tag == gimli::DW_TAG_inlined_subroutine;
                    let f = self.function(die, inlined);
                    if inlined {
                        innermost = f;
                    } else {
                        subprogram = f;
                    }
                    Walk::Into
                }
                gimli::DW_TAG_lexical_block if self.holds(die, address) => Walk::Into,
                gimli::DW_TAG_namespace => Walk::Into,
                _ => Walk::Skip,
            })?;
            if let Some(s) = subprogram {
                return Ok(Some((innermost.unwrap_or_else(|| s.clone()), s)));
            }
        }
        Ok(None)
    }

    /// The parameters and variables of `function` (a subprogram or an inlined instance)
    /// in scope at `address`, innermost first where names repeat (a block's variable
    /// hides the function's), parameters first, each with where it is at `address`.
    pub fn variables_at(&self, function: &Function, address: u64) -> Result<Vec<Variable>, DwarfError> {
        let frame_base_is_cfa = self.frame_base_is_cfa(function.die);
        let mut found: Vec<(usize, Variable)> = Vec::new();
        self.walk(
            function.die.unit,
            Some(function.die.offset),
            &mut |die, tag, depth| match tag {
                gimli::DW_TAG_formal_parameter | gimli::DW_TAG_variable => {
                    if let Some(name) = self.name_of(die) {
                        found.push((
                            depth,
                            Variable {
                                name,
                                is_parameter: tag == gimli::DW_TAG_formal_parameter,
                                global: false,
                                ty: self.type_of(die),
                                location: self.location_at(die, address, frame_base_is_cfa),
                            },
                        ));
                    }
                    Walk::Skip
                }
                gimli::DW_TAG_lexical_block if self.holds(die, address) => Walk::Into,
                // An inlined call's variables are its own, not the function's.
                _ => Walk::Skip,
            },
        )?;
        // Innermost first, then parameters before variables, then declaration order.
        found.sort_by_key(|(depth, v)| (std::cmp::Reverse(*depth), !v.is_parameter));
        let mut seen = std::collections::HashSet::new();
        Ok(found
            .into_iter()
            .map(|(_, v)| v)
            .filter(|v| seen.insert(v.name.clone()))
            .collect())
    }

    /// The variables at the top of `function`'s unit — its file's globals and statics,
    /// and the `extern`s it declares — for a name the function's scope does not have (as
    /// perf probe looks there too).
    pub fn unit_variables(&self, function: &Function) -> Result<Vec<Variable>, DwarfError> {
        let mut out = Vec::new();
        self.walk(function.die.unit, None, &mut |die, tag, _| {
            if tag != gimli::DW_TAG_variable {
                return Walk::Skip;
            }
            let Some(name) = self.name_of(die) else {
                return Walk::Skip;
            };
            let declaration = self
                .entry(die)
                .is_some_and(|e| matches!(e.attr_value(gimli::DW_AT_declaration), Some(AttributeValue::Flag(true))));
            let location = match self.location_at(die, 0, false) {
                Err(Unavailable::OptimizedOut) if declaration => Err(Unavailable::Declaration),
                other => other,
            };
            out.push(Variable {
                name,
                is_parameter: false,
                global: true,
                ty: self.type_of(die),
                location,
            });
            Walk::Skip
        })?;
        Ok(out)
    }

    fn frame_base_is_cfa(&self, function: DieRef) -> bool {
        // An inlined instance's frame is its caller's subprogram's.
        let Some((unit, v)) = self.inherited(function, gimli::DW_AT_frame_base) else {
            return false;
        };
        let Some(entry) = self.units.get(unit) else {
            return false;
        };
        match v {
            AttributeValue::Exprloc(e) => {
                let mut ops = e.operations(entry.unit.encoding());
                matches!(ops.next(), Ok(Some(Operation::CallFrameCFA))) && matches!(ops.next(), Ok(None))
            }
            _ => false,
        }
    }

    /// Where the variable `die` is at `address`.
    fn location_at(&self, die: DieRef, address: u64, frame_base_is_cfa: bool) -> Result<Location, Unavailable> {
        let entry = self.entry(die).ok_or(Unavailable::OptimizedOut)?;
        let unit = &self.units[die.unit].unit;
        let value = match entry.attr_value(gimli::DW_AT_location) {
            Some(v) => v,
            None => {
                // A constant the compiler kept as one.
                if let Some(v) = entry.attr_value(gimli::DW_AT_const_value) {
                    if let Some(c) = v.udata_value().or_else(|| v.sdata_value().map(|s| s as u64)) {
                        return Ok(Location::Constant(c));
                    }
                }
                return Err(Unavailable::OptimizedOut);
            }
        };
        let expression = match value {
            AttributeValue::Exprloc(e) => e,
            AttributeValue::LocationListsRef(offset) => {
                let mut iter = self
                    .dwarf
                    .locations(unit, offset)
                    .map_err(|_| Unavailable::OptimizedOut)?;
                let mut chosen = None;
                while let Ok(Some(l)) = iter.next() {
                    if l.range.begin <= address && address < l.range.end {
                        chosen = Some(l.data);
                        break;
                    }
                }
                chosen.ok_or(Unavailable::OptimizedOut)?
            }
            _ => return Err(Unavailable::OptimizedOut),
        };
        let mut ops = Vec::new();
        let mut iter = expression.operations(unit.encoding());
        loop {
            match iter.next() {
                Ok(Some(op)) if ops.len() < MAX_OPS => ops.push(op),
                Ok(Some(_)) => return Err(Unavailable::Computed(format!("more than {MAX_OPS} operations"))),
                Ok(None) => break,
                Err(e) => return Err(Unavailable::Computed(format!("an expression gimli cannot read: {e}"))),
            }
        }
        location_of(&ops, frame_base_is_cfa)
    }

    /// What the type `ty` is, through typedefs and qualifiers.
    pub fn shape(&self, ty: Option<DieRef>) -> TypeShape {
        let Some(ty) = self.strip(ty) else {
            return TypeShape::Void;
        };
        let Some(e) = self.entry(ty) else {
            return TypeShape::Void;
        };
        let size = e
            .attr_value(gimli::DW_AT_byte_size)
            .and_then(|v| v.udata_value())
            .unwrap_or(0);
        match e.tag() {
            gimli::DW_TAG_base_type => {
                let encoding = match e.attr_value(gimli::DW_AT_encoding) {
                    Some(AttributeValue::Encoding(enc)) => enc,
                    _ => gimli::DW_ATE_unsigned,
                };
                if encoding == gimli::DW_ATE_float {
                    return TypeShape::Float { size: size as u8 };
                }
                let signed = matches!(encoding, gimli::DW_ATE_signed | gimli::DW_ATE_signed_char);
                TypeShape::Integer {
                    size: size.clamp(1, 8) as u8,
                    signed,
                }
            }
            gimli::DW_TAG_enumeration_type => {
                let signed = match self.shape(self.type_of(ty)) {
                    TypeShape::Integer { signed, .. } => signed,
                    _ => false,
                };
                TypeShape::Integer {
                    size: size.clamp(1, 8) as u8,
                    signed,
                }
            }
            gimli::DW_TAG_pointer_type | gimli::DW_TAG_reference_type => TypeShape::Pointer {
                pointee: self.type_of(ty),
            },
            gimli::DW_TAG_structure_type | gimli::DW_TAG_class_type => TypeShape::Struct { size },
            gimli::DW_TAG_union_type => TypeShape::Union { size },
            gimli::DW_TAG_array_type => TypeShape::Array {
                element: self.type_of(ty),
            },
            gimli::DW_TAG_subroutine_type => TypeShape::Function,
            _ => TypeShape::Void,
        }
    }

    /// `ty` without typedefs and `const`/`volatile`/`restrict`/`atomic`.
    fn strip(&self, ty: Option<DieRef>) -> Option<DieRef> {
        let mut ty = ty?;
        for _ in 0..MAX_CHAIN {
            let e = self.entry(ty)?;
            match e.tag() {
                gimli::DW_TAG_typedef
                | gimli::DW_TAG_const_type
                | gimli::DW_TAG_volatile_type
                | gimli::DW_TAG_restrict_type
                | gimli::DW_TAG_atomic_type => ty = self.type_of(ty)?,
                _ => return Some(ty),
            }
        }
        None
    }

    /// The member `name` of the struct or union `ty` (through typedefs and qualifiers),
    /// searching anonymous members too, as C does.
    pub fn member(&self, ty: Option<DieRef>, name: &str) -> Option<Member> {
        self.member_in(self.strip(ty)?, name, 0)
    }

    fn member_in(&self, ty: DieRef, name: &str, depth: usize) -> Option<Member> {
        if depth > MAX_CHAIN {
            return None;
        }
        let unit = &self.units.get(ty.unit)?.unit;
        let mut tree = unit.entries_tree(Some(ty.offset)).ok()?;
        let root = tree.root().ok()?;
        let mut children = root.children();
        while let Ok(Some(child)) = children.next() {
            let e = child.entry();
            if e.tag() != gimli::DW_TAG_member {
                continue;
            }
            let die = DieRef {
                unit: ty.unit,
                offset: e.offset(),
            };
            let byte_offset = e
                .attr_value(gimli::DW_AT_data_member_location)
                .and_then(|v| v.udata_value())
                .unwrap_or(0);
            let bit_offset = e.attr_value(gimli::DW_AT_data_bit_offset).and_then(|v| v.udata_value());
            let bit_size = e.attr_value(gimli::DW_AT_bit_size).and_then(|v| v.udata_value());
            match self.name_of(die) {
                Some(n) if n == name => {
                    let ty = self.type_of(die);
                    let (offset, bits) = match (bit_size, bit_offset) {
                        (Some(width), Some(bit)) => {
                            // A bitfield: the byte its first bit is in, and the bit there.
                            (
                                byte_offset.checked_add(bit / 8)?,
                                Some(((bit % 8) as u8, width.min(64) as u8)),
                            )
                        }
                        _ => (byte_offset, None),
                    };
                    return Some(Member { offset, ty, bits });
                }
                Some(_) => {}
                None => {
                    // An anonymous struct or union: its members are the outer one's.
                    if let Some(inner) = self.strip(self.type_of(die)) {
                        if let Some(m) = self.member_in(inner, name, depth + 1) {
                            return Some(Member {
                                offset: m.offset.checked_add(byte_offset)?,
                                ..m
                            });
                        }
                    }
                }
            }
        }
        None
    }

    /// A type as C spells it (`struct file *`, `loff_t`, `const char *`), for listings.
    pub fn type_name(&self, ty: Option<DieRef>) -> String {
        self.type_name_depth(ty, 0)
    }

    fn type_name_depth(&self, ty: Option<DieRef>, depth: usize) -> String {
        let Some(ty) = ty else { return "void".into() };
        if depth > MAX_CHAIN {
            return "?".into();
        }
        let Some(e) = self.entry(ty) else { return "?".into() };
        let inner = || self.type_name_depth(self.type_of(ty), depth + 1);
        let named = |prefix: &str| format!("{prefix}{}", self.name_of(ty).unwrap_or_else(|| "(anon)".into()));
        match e.tag() {
            gimli::DW_TAG_pointer_type => format!("{}*", inner()),
            gimli::DW_TAG_const_type => format!("const {}", inner()),
            gimli::DW_TAG_volatile_type => format!("volatile {}", inner()),
            gimli::DW_TAG_restrict_type | gimli::DW_TAG_atomic_type => inner(),
            gimli::DW_TAG_structure_type => named("struct "),
            gimli::DW_TAG_union_type => named("union "),
            gimli::DW_TAG_enumeration_type => named("enum "),
            gimli::DW_TAG_array_type => format!("{}[]", inner()),
            gimli::DW_TAG_subroutine_type => "(function)".into(),
            _ => named(""),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Walk {
    Into,
    Skip,
}

/// The lowest address of `ranges` (0 for none).
fn lowest(ranges: &[Range<u64>]) -> u64 {
    ranges.iter().map(|r| r.start).min().unwrap_or(0)
}

/// Whether `path` ends with `tail` at a path component (`fs/read_write.c` matches
/// `/src/linux/fs/read_write.c`, not `xfs/read_write.c`'s `s/read_write.c`).
pub fn path_ends_with(path: &str, tail: &str) -> bool {
    path == tail || (path.ends_with(tail) && (tail.starts_with('/') || path[..path.len() - tail.len()].ends_with('/')))
}

/// A location expression's operations as a [`Location`].
fn location_of(ops: &[Operation<DwarfReader>], frame_base_is_cfa: bool) -> Result<Location, Unavailable> {
    use Operation::*;
    // One piece that covers the whole variable is the variable.
    let ops = match ops {
        [rest @ .., Piece { .. }] if !rest.iter().any(|o| matches!(o, Piece { .. })) => rest,
        _ if ops.iter().any(|o| matches!(o, Piece { .. })) => return Err(Unavailable::Pieces),
        _ => ops,
    };
    if ops.iter().any(|o| matches!(o, EntryValue { .. })) {
        return Err(Unavailable::EntryValue);
    }
    let register = |r: gimli::Register| {
        DwarfRegister::from_number(r.0).ok_or_else(|| Unavailable::Computed(format!("DWARF register {}", r.0)))
    };
    match ops {
        [] => Err(Unavailable::OptimizedOut),
        [Register { register: r }] => Ok(Location::Register(register(*r)?)),
        [RegisterOffset {
            register: r,
            offset,
            base_type,
        }] if base_type.0 == 0 => Ok(Location::RegisterMemory {
            register: register(*r)?,
            offset: *offset,
        }),
        [RegisterOffset {
            register: r,
            offset: 0,
            base_type,
        }, StackValue]
            if base_type.0 == 0 =>
        {
            Ok(Location::Register(register(*r)?))
        }
        [FrameOffset { offset }] if frame_base_is_cfa => Ok(Location::FrameMemory { offset: *offset }),
        [FrameOffset { .. }] => Err(Unavailable::FrameBase),
        [Address { address }] => Ok(Location::Memory(*address)),
        [UnsignedConstant { value }, StackValue] => Ok(Location::Constant(*value)),
        [SignedConstant { value }, StackValue] => Ok(Location::Constant(*value as u64)),
        [ImplicitValue { data }] if data.len() <= 8 => {
            let mut bytes = [0u8; 8];
            bytes[..data.len()].copy_from_slice(&data.to_slice().map_err(|_| Unavailable::OptimizedOut)?);
            Ok(Location::Constant(u64::from_le_bytes(bytes)))
        }
        other => Err(Unavailable::Computed(describe_ops(other))),
    }
}

fn describe_ops(ops: &[Operation<DwarfReader>]) -> String {
    let names: Vec<String> = ops
        .iter()
        .map(|o| {
            let d = format!("{o:?}");
            d.split([' ', '{', '(']).next().unwrap_or("?").to_owned()
        })
        .collect();
    names.join(" ")
}

mod relocatable;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_matches_at_a_component() {
        assert!(path_ends_with("/src/linux/fs/read_write.c", "fs/read_write.c"));
        assert!(path_ends_with("fs/read_write.c", "fs/read_write.c"));
        assert!(path_ends_with("/a/fs/read_write.c", "read_write.c"));
        assert!(!path_ends_with("/a/xfs/read_write.c", "s/read_write.c"));
        assert!(!path_ends_with("/a/fs/myread_write.c", "read_write.c"));
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused_by_name() {
        let e = DebugInfo::parse(b"not an elf", "bzImage").unwrap_err();
        assert!(e.to_string().starts_with("bzImage: not an ELF file"), "{e}");
    }
}
