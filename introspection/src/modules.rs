//! The guest's loaded kernel modules, read from its memory: the kernel's `modules` list,
//! and of each `struct module` its name, state, where its code is (the core and init
//! text), its symbols (the module's own kallsyms: an ELF symbol table, string table and
//! type letters the loader keeps), its ORC tables, and what it forbids kprobes on (its
//! `NOKPROBE_SYMBOL` list, `.kprobes.text` and `.noinstr.text`). The layout of `struct
//! module` comes from the kernel's BTF (Linux 6.1's `core_layout`/`init_layout`).
//!
//! Every byte is the guest's: a list that loops or runs long, a symbol count in the
//! millions, a name without its NUL are refused by the budget ([`ModuleBudget`]) with an
//! error naming what was over it, and names are kept escaped. The budget counts both the
//! bytes read and what they decode to on the host (charged before it is made): a few bytes
//! of guest memory can become many more of host memory (a symbol entry shared by many
//! symbols, a name of unprintable bytes escaped four to one).

use std::fmt::Write as _;
use std::ops::Range;

use hvprobe_arch::Gva;

use crate::btf::{Btf, BtfError};
use crate::facts::{ExTableEntry, ExceptionTable};
use crate::memory::{GuestVirtRead, MemoryError};
use crate::symbols::{Symbol, SymbolSource, SymbolTable};
use crate::unwind::{OrcError, OrcTable};

/// The kernel's `KSYM_NAME_LEN`: the longest symbol name read.
const KSYM_NAME_LEN: usize = 512;
/// `sizeof(Elf64_Sym)`.
const ELF64_SYM_SIZE: u64 = 24;
/// `sizeof(struct orc_entry)`.
const ORC_ENTRY_SIZE: u64 = 6;
/// What one kept symbol takes on the host besides its name's two copies (the symbol's and
/// the table's by-name key): the `Symbol`, its by-name entry, and a margin for that entry's
/// index list, the by-address indices and the map's spare room. On the high side: a guest
/// with many symbols of short names must not slip under the budget.
const SYMBOL_HOST_BYTES: u64 = (std::mem::size_of::<Symbol>() + std::mem::size_of::<(String, Vec<u32>)>()) as u64 + 64;

/// How much a module list may make the host read: a real kernel needs a small fraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleBudget {
    /// Modules in the list (a list that loops runs into this).
    pub max_modules: usize,
    /// Symbols of one module (the largest Linux modules have a few tens of thousands).
    pub max_symbols: u64,
    /// Bytes of one module's string table.
    pub max_strtab: u64,
    /// ORC entries of one module.
    pub max_orc_entries: u64,
    /// Entries of one module's kprobe blacklist, and of its exception table.
    pub max_blacklist: u64,
    /// Bytes read for all modules together: at most the guest's memory.
    pub max_total_bytes: u64,
    /// Host bytes one module's decoded tables may take (its name, its symbols with their
    /// escaped names, its ORC, exception and blacklist tables): what the guest's bytes
    /// become, not how many were read — a byte of a name that is not printable is four
    /// escaped ones, kept twice, and a symbol of a few bytes read is a hundred and more.
    pub max_decoded: u64,
    /// Host bytes the decoded tables of all modules together may take: in one read of the
    /// list, and in the list the probe engine keeps.
    pub max_total_decoded: u64,
}

impl ModuleBudget {
    /// The budget for a guest with `memory_bytes` of RAM.
    pub fn for_memory(memory_bytes: u64) -> ModuleBudget {
        // A quarter of the guest's memory, 256 MiB at most: a real kernel's modules decode
        // to a few MiB (the largest module's symbols to ~15 MiB), and this is what a guest
        // can make one read of its list cost the host.
        let max_total_decoded = (memory_bytes / 4).min(256 << 20);
        ModuleBudget {
            max_modules: 4096,
            max_symbols: 1 << 18,
            max_strtab: 16 << 20,
            max_orc_entries: 1 << 20,
            max_blacklist: 1 << 16,
            max_total_bytes: memory_bytes.min(1 << 30),
            max_decoded: max_total_decoded.min(64 << 20),
            max_total_decoded,
        }
    }
}

/// Why the module list or a module could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    #[error("the guest kernel's BTF describes no usable struct module: {0}")]
    Btf(#[from] BtfError),
    #[error(
        "struct module.{member} in the guest's BTF is {size} bytes, expected {expected} (a kernel whose module \
         layout hvprobe does not read: Linux 6.1's core_layout/init_layout is)"
    )]
    UnexpectedLayout {
        member: &'static str,
        size: u64,
        expected: &'static str,
    },
    #[error("the guest kernel has no symbol `modules` (built without CONFIG_MODULES?)")]
    NoModuleList,
    #[error("the module list has more than {limit} modules (a loop in the list, or hostile guest memory)")]
    TooManyModules { limit: usize },
    #[error("module {module}: {what} is {value}, over the limit of {limit} (hostile or corrupt guest memory?)")]
    OverBudget {
        module: String,
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("the modules' tables would take more than {limit} bytes of host memory (hostile guest memory?)")]
    TotalOverBudget { limit: u64 },
    #[error(
        "module {module}: its decoded tables would take more than {limit} bytes of host memory (hostile guest \
         memory?)"
    )]
    DecodedOverBudget { module: String, limit: u64 },
    #[error("the modules' decoded tables would take more than {limit} bytes of host memory (hostile guest memory?)")]
    TotalDecodedOverBudget { limit: u64 },
    #[error("module {module}: {what} at {at:#x}+{len:#x} wraps the address space")]
    Wraps {
        module: String,
        what: &'static str,
        at: u64,
        len: u64,
    },
    #[error("module {module}: reading its {what} at {at}: {source}")]
    Memory {
        module: String,
        what: &'static str,
        at: Gva,
        #[source]
        source: MemoryError,
    },
    #[error("module {module}: its ORC tables: {source}")]
    Orc {
        module: String,
        #[source]
        source: OrcError,
    },
}

/// `enum module_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleState {
    Live,
    /// Loaded and relocated, its init not yet run.
    Coming,
    Going,
    /// Still being set up (or torn down): nothing of it is to be used.
    Unformed,
    Other(u32),
}

impl ModuleState {
    fn from_raw(raw: u32) -> ModuleState {
        match raw {
            0 => ModuleState::Live,
            1 => ModuleState::Coming,
            2 => ModuleState::Going,
            3 => ModuleState::Unformed,
            n => ModuleState::Other(n),
        }
    }
}

/// Where the fields hvprobe reads are in the guest kernel's `struct module`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleLayout {
    state: u64,
    list: u64,
    name: u64,
    name_len: u64,
    core_base: u64,
    core_size: u64,
    core_text_size: u64,
    init_base: u64,
    init_size: u64,
    init_text_size: u64,
    kallsyms: u64,
    kallsyms_symtab: u64,
    kallsyms_num_symtab: u64,
    kallsyms_strtab: u64,
    kallsyms_typetab: u64,
    /// `arch.num_orcs`, `arch.orc_unwind_ip`, `arch.orc_unwind` (CONFIG_UNWINDER_ORC).
    orc: Option<(u64, u64, u64)>,
    /// `kprobe_blacklist`, `num_kprobe_blacklist`, `kprobes_text_start`,
    /// `kprobes_text_size` (CONFIG_KPROBES).
    kprobes: Option<(u64, u64, u64, u64)>,
    /// `noinstr_text_start`, `noinstr_text_size`.
    noinstr: Option<(u64, u64)>,
    /// `extable`, `num_exentries`.
    extable: Option<(u64, u64)>,
    /// `jump_entries`, `num_jump_entries` (CONFIG_JUMP_LABEL).
    jump_entries: Option<(u64, u64)>,
    /// `static_call_sites`, `num_static_call_sites` (CONFIG_HAVE_STATIC_CALL_INLINE).
    static_call_sites: Option<(u64, u64)>,
}

impl ModuleLayout {
    /// The layout as the kernel's BTF describes it.
    pub fn from_btf(btf: &Btf) -> Result<ModuleLayout, ModuleError> {
        let field = |strukt: &str, path: &'static str, expected: u64, what: &'static str| {
            let m = btf.member_offset(strukt, path)?;
            if m.size != expected || m.bitfield_size != 0 {
                return Err(ModuleError::UnexpectedLayout {
                    member: path,
                    size: m.size,
                    expected: what,
                });
            }
            Ok(m.offset)
        };
        let member = |path, expected, what| field("module", path, expected, what);
        let ks = |path, expected, what| field("mod_kallsyms", path, expected, what);
        let name = btf.member_offset("module", "name")?;
        if name.size == 0 || name.size > 256 {
            return Err(ModuleError::UnexpectedLayout {
                member: "name",
                size: name.size,
                expected: "1..=256 (MODULE_NAME_LEN is 56)",
            });
        }
        const PTR: &str = "8 (a pointer)";
        const UINT: &str = "4 (unsigned int)";
        let orc = match (
            member("arch.num_orcs", 4, UINT),
            member("arch.orc_unwind_ip", 8, PTR),
            member("arch.orc_unwind", 8, PTR),
        ) {
            (Ok(n), Ok(ips), Ok(entries)) => Some((n, ips, entries)),
            _ => None,
        };
        let kprobes = match (
            member("kprobe_blacklist", 8, PTR),
            member("num_kprobe_blacklist", 4, UINT),
            member("kprobes_text_start", 8, PTR),
            member("kprobes_text_size", 4, UINT),
        ) {
            (Ok(list), Ok(n), Ok(start), Ok(size)) => Some((list, n, start, size)),
            _ => None,
        };
        let noinstr = match (
            member("noinstr_text_start", 8, PTR),
            member("noinstr_text_size", 4, UINT),
        ) {
            (Ok(start), Ok(size)) => Some((start, size)),
            _ => None,
        };
        let extable = match (member("extable", 8, PTR), member("num_exentries", 4, UINT)) {
            (Ok(table), Ok(n)) => Some((table, n)),
            _ => None,
        };
        let jump_entries = match (member("jump_entries", 8, PTR), member("num_jump_entries", 4, UINT)) {
            (Ok(table), Ok(n)) => Some((table, n)),
            _ => None,
        };
        let static_call_sites = match (
            member("static_call_sites", 8, PTR),
            member("num_static_call_sites", 4, UINT),
        ) {
            (Ok(table), Ok(n)) => Some((table, n)),
            _ => None,
        };
        Ok(ModuleLayout {
            extable,
            jump_entries,
            static_call_sites,
            state: member("state", 4, "4 (enum module_state)")?,
            list: member("list", 16, "16 (struct list_head)")?,
            name: name.offset,
            name_len: name.size,
            core_base: member("core_layout.base", 8, PTR)?,
            core_size: member("core_layout.size", 4, UINT)?,
            core_text_size: member("core_layout.text_size", 4, UINT)?,
            init_base: member("init_layout.base", 8, PTR)?,
            init_size: member("init_layout.size", 4, UINT)?,
            init_text_size: member("init_layout.text_size", 4, UINT)?,
            kallsyms: member("kallsyms", 8, PTR)?,
            kallsyms_symtab: ks("symtab", 8, PTR)?,
            kallsyms_num_symtab: ks("num_symtab", 4, UINT)?,
            kallsyms_strtab: ks("strtab", 8, PTR)?,
            kallsyms_typetab: ks("typetab", 8, PTR)?,
            orc,
            kprobes,
            noinstr,
        })
    }
}

/// One loaded module, as the host read it.
#[derive(Clone, Debug)]
pub struct LoadedModule {
    /// Its name, escaped (`\xNN` for a byte that is not printable ASCII).
    pub name: String,
    /// Its `struct module`.
    pub address: Gva,
    pub state: ModuleState,
    /// The core layout (code, then read-only data, then data).
    pub core: Range<Gva>,
    /// The core layout's code.
    pub core_text: Range<Gva>,
    /// The init layout's code, until the loader frees it after the module's init ran.
    pub init_text: Option<Range<Gva>>,
    /// The init layout (empty when freed).
    pub init: Option<Range<Gva>>,
    pub symbols: SymbolTable,
    /// Its unwind tables, when the kernel has ORC and they could be read.
    pub orc: Option<OrcTable>,
    /// Code kprobes must not touch: each `NOKPROBE_SYMBOL` function, `.kprobes.text`,
    /// `.noinstr.text`.
    pub blacklist: Vec<(Range<Gva>, ModuleBlacklistReason)>,
    /// Its instructions that may fault, with their fixups.
    pub extable: ExceptionTable,
    /// Its jump table (`struct jump_entry`, 16 bytes each) and static-call site table
    /// (8 bytes each): where the kernel rewrites the module's code itself.
    pub jump_table: Option<Range<Gva>>,
    pub static_call_table: Option<Range<Gva>>,
    /// Host bytes its decoded tables take, as charged to the budget (the probe engine caps
    /// its list of modules by their sum).
    pub decoded_bytes: u64,
}

/// Why a module's code is off limits to kprobes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleBlacklistReason {
    /// `NOKPROBE_SYMBOL()` in the module.
    Nokprobe,
    /// The module's `.kprobes.text`.
    KprobesText,
    /// The module's `.noinstr.text`.
    NoinstrText,
}

impl std::fmt::Display for ModuleBlacklistReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModuleBlacklistReason::Nokprobe => "on the module's kprobe blacklist (NOKPROBE_SYMBOL)",
            ModuleBlacklistReason::KprobesText => "in the module's .kprobes.text",
            ModuleBlacklistReason::NoinstrText => "in the module's .noinstr.text",
        })
    }
}

impl LoadedModule {
    /// Whether `at` is in the module's code (core or init).
    pub fn is_text(&self, at: Gva) -> bool {
        self.core_text.contains(&at) || self.init_text.as_ref().is_some_and(|r| r.contains(&at))
    }

    /// Whether `at` is anywhere in the module's memory.
    pub fn contains(&self, at: Gva) -> bool {
        self.core.contains(&at) || self.init.as_ref().is_some_and(|r| r.contains(&at))
    }

    /// Why kprobes may not go at `at`, if the module forbids it.
    pub fn blacklisted(&self, at: Gva) -> Option<ModuleBlacklistReason> {
        self.blacklist
            .iter()
            .find(|(r, _)| r.contains(&at))
            .map(|(_, why)| *why)
    }
}

/// Whether a guest string's byte is kept as is (printable ASCII but the backslash).
fn kept_as_is(b: u8) -> bool {
    (0x21..0x7f).contains(&b) && b != b'\\'
}

/// The length of [`escaped`]`(bytes)`, without making it: what it will cost is charged
/// first.
fn escaped_len(bytes: &[u8]) -> u64 {
    bytes.iter().map(|&b| if kept_as_is(b) { 1 } else { 4 }).sum()
}

/// A guest string's bytes as text: printable ASCII as is, every other byte `\xNN`.
fn escaped(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(escaped_len(bytes) as usize);
    for &b in bytes {
        if kept_as_is(b) {
            s.push(b as char);
        } else {
            let _ = write!(s, "\\x{b:02x}");
        }
    }
    s
}

/// Reads the guest's modules: the list at `modules` (the kernel symbol), each one whole.
/// A module that cannot be read fails the whole list: a caller that wants the others
/// reads them one by one with [`read_module`].
pub fn read_modules(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &ModuleLayout,
    modules: Gva,
    budget: &ModuleBudget,
) -> Result<Vec<LoadedModule>, ModuleError> {
    let mut spent = Spent::default();
    module_addresses(mem, layout, modules, budget)?
        .into_iter()
        .map(|at| read_module_charged(mem, layout, at, budget, &mut spent))
        .collect()
}

/// The `struct module` addresses of the list at `modules`, in list order (the newest
/// module first, as the kernel adds them at the head).
pub fn module_addresses(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &ModuleLayout,
    modules: Gva,
    budget: &ModuleBudget,
) -> Result<Vec<Gva>, ModuleError> {
    let list_memory = |at: Gva, source| ModuleError::Memory {
        module: "(list)".into(),
        what: "list link",
        at,
        source,
    };
    let mut found = Vec::new();
    let mut node = mem.read_u64(modules).map_err(|e| list_memory(modules, e))?;
    while node != modules.0 {
        if found.len() == budget.max_modules {
            return Err(ModuleError::TooManyModules {
                limit: budget.max_modules,
            });
        }
        let module = node.checked_sub(layout.list).ok_or_else(|| ModuleError::Wraps {
            module: "(list)".into(),
            what: "list node",
            at: node,
            len: layout.list,
        })?;
        found.push(Gva(module));
        node = mem.read_u64(Gva(node)).map_err(|e| list_memory(Gva(node), e))?;
    }
    Ok(found)
}

/// Reads the `struct module` at `at`.
pub fn read_module(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &ModuleLayout,
    at: Gva,
    budget: &ModuleBudget,
) -> Result<LoadedModule, ModuleError> {
    read_module_charged(mem, layout, at, budget, &mut Spent::default())
}

/// What one read of the list has cost so far: guest bytes read, host bytes decoded.
#[derive(Default)]
struct Spent {
    read: u64,
    decoded: u64,
}

/// Reads `len` bytes at `base + offset` of module `module`, charged to `spent`, and
/// charges what they decode to.
struct Reader<'a, M: ?Sized> {
    mem: &'a M,
    module: String,
    budget: &'a ModuleBudget,
    spent: &'a mut Spent,
    /// Host bytes this module's decoded tables take so far.
    decoded: u64,
}

impl<M: GuestVirtRead + ?Sized> Reader<'_, M> {
    fn at(&self, base: Gva, offset: u64, what: &'static str) -> Result<Gva, ModuleError> {
        base.0.checked_add(offset).map(Gva).ok_or_else(|| ModuleError::Wraps {
            module: self.module.clone(),
            what,
            at: base.0,
            len: offset,
        })
    }

    fn bytes(&mut self, at: Gva, len: u64, what: &'static str) -> Result<Vec<u8>, ModuleError> {
        at.0.checked_add(len).ok_or_else(|| ModuleError::Wraps {
            module: self.module.clone(),
            what,
            at: at.0,
            len,
        })?;
        self.spent.read = self.spent.read.saturating_add(len);
        if self.spent.read > self.budget.max_total_bytes {
            return Err(ModuleError::TotalOverBudget {
                limit: self.budget.max_total_bytes,
            });
        }
        let mut buf = vec![0u8; len as usize];
        self.mem.read_virt(at, &mut buf).map_err(|source| ModuleError::Memory {
            module: self.module.clone(),
            what,
            at,
            source,
        })?;
        Ok(buf)
    }

    /// Charges `bytes` of host memory about to be allocated for what was read, to this
    /// module and to the whole read; over either budget is an error before the allocation.
    fn decode(&mut self, bytes: u64) -> Result<(), ModuleError> {
        self.decoded = self.decoded.saturating_add(bytes);
        if self.decoded > self.budget.max_decoded {
            return Err(ModuleError::DecodedOverBudget {
                module: self.module.clone(),
                limit: self.budget.max_decoded,
            });
        }
        self.spent.decoded = self.spent.decoded.saturating_add(bytes);
        if self.spent.decoded > self.budget.max_total_decoded {
            return Err(ModuleError::TotalDecodedOverBudget {
                limit: self.budget.max_total_decoded,
            });
        }
        Ok(())
    }

    fn u64(&mut self, base: Gva, offset: u64, what: &'static str) -> Result<u64, ModuleError> {
        let b = self.bytes(self.at(base, offset, what)?, 8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn u32(&mut self, base: Gva, offset: u64, what: &'static str) -> Result<u32, ModuleError> {
        let b = self.bytes(self.at(base, offset, what)?, 4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    fn limit(&self, what: &'static str, value: u64, limit: u64) -> Result<u64, ModuleError> {
        if value > limit {
            return Err(ModuleError::OverBudget {
                module: self.module.clone(),
                what,
                value,
                limit,
            });
        }
        Ok(value)
    }

    fn range(&self, base: u64, len: u64, what: &'static str) -> Result<Range<Gva>, ModuleError> {
        let end = base.checked_add(len).ok_or_else(|| ModuleError::Wraps {
            module: self.module.clone(),
            what,
            at: base,
            len,
        })?;
        Ok(Gva(base)..Gva(end))
    }
}

fn read_module_charged(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &ModuleLayout,
    at: Gva,
    budget: &ModuleBudget,
    spent: &mut Spent,
) -> Result<LoadedModule, ModuleError> {
    let mut r = Reader {
        mem,
        module: format!("at {at}"),
        budget,
        spent,
        decoded: 0,
    };
    let raw_name = r.bytes(r.at(at, layout.name, "name")?, layout.name_len, "name")?;
    let name_end = raw_name.iter().position(|&b| b == 0).unwrap_or(raw_name.len());
    r.decode(escaped_len(&raw_name[..name_end]))?;
    let name = escaped(&raw_name[..name_end]);
    r.module = name.clone();
    let state = ModuleState::from_raw(r.u32(at, layout.state, "state")?);

    let core_base = r.u64(at, layout.core_base, "core layout")?;
    let core_size = u64::from(r.u32(at, layout.core_size, "core layout")?);
    let core_text_size = u64::from(r.u32(at, layout.core_text_size, "core layout")?).min(core_size);
    let core = r.range(core_base, core_size, "core layout")?;
    let core_text = r.range(core_base, core_text_size, "core text")?;
    let init_base = r.u64(at, layout.init_base, "init layout")?;
    let init_size = u64::from(r.u32(at, layout.init_size, "init layout")?);
    let init_text_size = u64::from(r.u32(at, layout.init_text_size, "init layout")?).min(init_size);
    let (init, init_text) = if init_base != 0 && init_size != 0 {
        (
            Some(r.range(init_base, init_size, "init layout")?),
            Some(r.range(init_base, init_text_size, "init text")?).filter(|t| !t.is_empty()),
        )
    } else {
        (None, None)
    };

    let symbols = read_symbols(&mut r, layout, at)?;

    let orc = match layout.orc {
        Some((num, ips, entries)) => {
            let count = u64::from(r.u32(at, num, "ORC count")?);
            let count = r.limit("its ORC entry count", count, budget.max_orc_entries)?;
            let ip_table = Gva(r.u64(at, ips, "ORC address table")?);
            let entry_table = Gva(r.u64(at, entries, "ORC entry table")?);
            if count == 0 || ip_table.0 == 0 || entry_table.0 == 0 {
                None
            } else {
                let text_len = core_text.end.0 - core_text.start.0;
                r.decode(OrcTable::host_bytes(count, text_len))?;
                let ip_bytes = r.bytes(ip_table, count * 4, "ORC address table")?;
                let orc_bytes = r.bytes(entry_table, count * ORC_ENTRY_SIZE, "ORC entry table")?;
                let table =
                    OrcTable::from_tables(ip_table, &ip_bytes, &orc_bytes, core_text.clone(), init_text.clone())
                        .map_err(|source| ModuleError::Orc {
                            module: name.clone(),
                            source,
                        })?;
                Some(table)
            }
        }
        None => None,
    };

    let mut blacklist = Vec::new();
    if let Some((list, num, text_start, text_size)) = layout.kprobes {
        let count = u64::from(r.u32(at, num, "kprobe blacklist")?);
        let count = r.limit("its kprobe blacklist", count, budget.max_blacklist)?;
        let list = Gva(r.u64(at, list, "kprobe blacklist")?);
        if count > 0 && list.0 != 0 {
            r.decode(count * std::mem::size_of::<(Range<Gva>, ModuleBlacklistReason)>() as u64)?;
            let bytes = r.bytes(list, count * 8, "kprobe blacklist")?;
            for b in bytes.chunks_exact(8) {
                let addr = Gva(u64::from_le_bytes(b.try_into().expect("8 bytes")));
                // Linux blacklists the whole function the address is in.
                if let Some(d) = symbols.describe(addr) {
                    let start = addr.0 - d.offset;
                    blacklist.push((
                        r.range(start, d.size, "blacklisted function")?,
                        ModuleBlacklistReason::Nokprobe,
                    ));
                }
            }
        }
        let start = r.u64(at, text_start, ".kprobes.text")?;
        let size = u64::from(r.u32(at, text_size, ".kprobes.text")?);
        if start != 0 && size != 0 {
            blacklist.push((
                r.range(start, size, ".kprobes.text")?,
                ModuleBlacklistReason::KprobesText,
            ));
        }
    }
    if let Some((text_start, text_size)) = layout.noinstr {
        let start = r.u64(at, text_start, ".noinstr.text")?;
        let size = u64::from(r.u32(at, text_size, ".noinstr.text")?);
        if start != 0 && size != 0 {
            blacklist.push((
                r.range(start, size, ".noinstr.text")?,
                ModuleBlacklistReason::NoinstrText,
            ));
        }
    }

    let mut extable = ExceptionTable::default();
    if let Some((table, num)) = layout.extable {
        let count = u64::from(r.u32(at, num, "exception table")?);
        let count = r.limit("its exception table", count, budget.max_blacklist)?;
        let table = Gva(r.u64(at, table, "exception table")?);
        if count > 0 && table.0 != 0 {
            r.decode(count * std::mem::size_of::<ExTableEntry>() as u64)?;
            extable = ExceptionTable::parse(table, &r.bytes(table, count * 12, "exception table")?);
        }
    }

    let mut table =
        |fields: Option<(u64, u64)>, size: u64, what: &'static str| -> Result<Option<Range<Gva>>, ModuleError> {
            let Some((table, num)) = fields else { return Ok(None) };
            let count = u64::from(r.u32(at, num, what)?);
            let count = r.limit(what, count, budget.max_blacklist)?;
            let start = r.u64(at, table, what)?;
            if count == 0 || start == 0 {
                return Ok(None);
            }
            Ok(Some(r.range(start, count * size, what)?))
        };
    let jump_table = table(layout.jump_entries, 16, "its jump table")?;
    let static_call_table = table(layout.static_call_sites, 8, "its static call sites")?;

    Ok(LoadedModule {
        decoded_bytes: r.decoded,
        jump_table,
        static_call_table,
        extable,
        name,
        address: at,
        state,
        core,
        core_text,
        init_text,
        init,
        symbols,
        orc,
        blacklist,
    })
}

/// The module's kallsyms (`mod->kallsyms`: every symbol while its init runs, the core
/// ones after): absolute addresses, ELF sizes, the loader's type letters.
fn read_symbols<M: GuestVirtRead + ?Sized>(
    r: &mut Reader<'_, M>,
    layout: &ModuleLayout,
    at: Gva,
) -> Result<SymbolTable, ModuleError> {
    let kallsyms = Gva(r.u64(at, layout.kallsyms, "kallsyms")?);
    if kallsyms.0 == 0 {
        return Ok(SymbolTable::from_symbols(SymbolSource::Kallsyms, Vec::new()));
    }
    let count = u64::from(r.u32(kallsyms, layout.kallsyms_num_symtab, "kallsyms")?);
    let count = r.limit("its symbol count", count, r.budget.max_symbols)?;
    let symtab = Gva(r.u64(kallsyms, layout.kallsyms_symtab, "kallsyms")?);
    let strtab = Gva(r.u64(kallsyms, layout.kallsyms_strtab, "kallsyms")?);
    let typetab = Gva(r.u64(kallsyms, layout.kallsyms_typetab, "kallsyms")?);
    if count == 0 {
        return Ok(SymbolTable::from_symbols(SymbolSource::Kallsyms, Vec::new()));
    }
    let syms = r.bytes(symtab, count * ELF64_SYM_SIZE, "symbol table")?;
    let types = r.bytes(typetab, count, "symbol types")?;
    let max_name = syms
        .chunks_exact(ELF64_SYM_SIZE as usize)
        .map(|s| u64::from(u32::from_le_bytes([s[0], s[1], s[2], s[3]])))
        .max()
        .unwrap_or(0);
    let strtab_len = r.limit(
        "its string table",
        max_name.saturating_add(KSYM_NAME_LEN as u64),
        r.budget.max_strtab,
    )?;
    let strings = read_up_to(r, strtab, strtab_len, "string table")?;
    let mut symbols = Vec::new();
    for (sym, kind) in syms.chunks_exact(ELF64_SYM_SIZE as usize).zip(types) {
        let name_off = u32::from_le_bytes([sym[0], sym[1], sym[2], sym[3]]) as usize;
        let value = u64::from_le_bytes(sym[8..16].try_into().expect("8 bytes"));
        let size = u64::from_le_bytes(sym[16..24].try_into().expect("8 bytes"));
        let Some(rest) = strings.get(name_off..) else { continue };
        let rest = &rest[..rest.len().min(KSYM_NAME_LEN)];
        let Some(len) = rest.iter().position(|&b| b == 0) else {
            continue;
        };
        if len == 0 || value == 0 {
            continue;
        }
        r.decode(2 * escaped_len(&rest[..len]) + SYMBOL_HOST_BYTES)?;
        symbols.push(Symbol {
            name: escaped(&rest[..len]),
            addr: Gva(value),
            kind: if kind.is_ascii_alphabetic() {
                char::from(kind)
            } else {
                '?'
            },
            size: Some(size).filter(|&s| s != 0),
        });
    }
    Ok(SymbolTable::from_symbols(SymbolSource::Kallsyms, symbols))
}

/// Up to `len` bytes at `at`: a string table's end is not recorded, so its last page may
/// be the end of the mapping; what can be read of it is enough.
fn read_up_to<M: GuestVirtRead + ?Sized>(
    r: &mut Reader<'_, M>,
    at: Gva,
    len: u64,
    what: &'static str,
) -> Result<Vec<u8>, ModuleError> {
    match r.bytes(at, len, what) {
        Ok(b) => Ok(b),
        Err(ModuleError::Memory { .. }) => {
            // Up to the end of the last page that can be read.
            let page_end = (at.0 | 0xfff).saturating_add(1);
            let mut readable = page_end.saturating_sub(at.0).min(len);
            let mut out = r.bytes(at, readable, what)?;
            while readable < len {
                let chunk = (len - readable).min(0x1000);
                match r.bytes(Gva(at.0 + readable), chunk, what) {
                    Ok(b) => out.extend_from_slice(&b),
                    Err(ModuleError::Memory { .. }) => break,
                    Err(e) => return Err(e),
                }
                readable += chunk;
            }
            Ok(out)
        }
        Err(e) => Err(e),
    }
}

#[cfg(any(test, feature = "test-support"))]
pub mod synthetic;
#[cfg(test)]
mod tests;
