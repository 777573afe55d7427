//! The kernel's traceable functions, as its `available_filter_functions` file lists them.
//!
//! The compiler leaves a 5-byte call to `__fentry__` at the entry of every function it
//! instruments, and the build records each such call's address in the vmlinux's
//! `__mcount_loc` table (`__start_mcount_loc`..`__stop_mcount_loc`, in `.init.data`). At boot the kernel makes one ftrace record per entry
//! (`ftrace_process_locs`: zero entries skipped, sorted by address), and drops those of
//! init code when it frees it (`ftrace_free_init_mem`: `__init_begin`..`__init_end`).
//! `available_filter_functions` then prints every record in address order by the name
//! kallsyms gives its address; a record more than `ENDBR_INSN_SIZE` (4) bytes past its
//! symbol's start belongs to a weak function the linker replaced (its code is still there,
//! its symbol is not), is printed `__ftrace_invalid_address___OFFSET` and can never be
//! traced (`test_for_valid_rec`).
//!
//! The table is read from the vmlinux file, not from the guest, so that the listing needs no
//! boot; addresses are link-time ones, [`AvailableFunctions::relocated`] moves them by a
//! KASLR slide. Module functions are not in it (they come with the module).

use std::ops::Range;

use goblin::elf::Elf;
use hvprobe_arch::Gva;
use hvprobe_introspection::symbols::SymbolTable;

/// How far past its symbol's start a valid record may be (`FTRACE_MCOUNT_MAX_OFFSET`,
/// `ENDBR_INSN_SIZE` on x86: the `endbr64` before the call).
pub const MAX_RECORD_OFFSET: u64 = 4;
/// `FTRACE_INVALID_FUNCTION`: the kernel's name for a record of a replaced weak function.
pub const INVALID_FUNCTION: &str = "__ftrace_invalid_address__";

/// One ftrace record: a traceable function's `__fentry__` call site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceableFunction {
    /// The address of the 5-byte call (after the function's `endbr64`, if any).
    pub site: Gva,
    /// The function's name as kallsyms gives it, or `__ftrace_invalid_address___OFFSET`.
    pub name: String,
    /// False for a replaced weak function's record: listed, never traced.
    pub valid: bool,
}

/// Why the table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AvailableError {
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not an ELF file: {0}")]
    Elf(String),
    #[error(
        "the kernel has no __mcount_loc table (__start_mcount_loc..__stop_mcount_loc in a \
         section of the file): built without CONFIG_FUNCTION_TRACER and CONFIG_DYNAMIC_FTRACE, \
         or its symbols are stripped"
    )]
    NoMcountLoc,
    #[error("the __mcount_loc section ({offset:#x}, {size} bytes) lies outside the file ({file} bytes)")]
    SectionOutsideFile { offset: u64, size: u64, file: usize },
    #[error("the kernel's symbols have no {0} (needed to leave out the records of init code)")]
    NoInitBounds(&'static str),
    #[error("the kernel's symbols have no _text (needed to find its records in the running kernel)")]
    NoText,
}

/// The kernel's traceable functions in `available_filter_functions`' order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AvailableFunctions {
    functions: Vec<TraceableFunction>,
    /// The kernel's `_text` where the records' addresses put it (link-time for a vmlinux).
    text: Gva,
}

impl AvailableFunctions {
    /// The `__mcount_loc` entries of a vmlinux image, in the file's order (zeros kept):
    /// the words between its `__start_mcount_loc` and `__stop_mcount_loc` symbols (the
    /// linker script puts the table inside `.init.data`), read through the section that
    /// holds them.
    pub fn mcount_locations(vmlinux: &[u8], symbols: &SymbolTable) -> Result<Vec<Gva>, AvailableError> {
        let elf = Elf::parse(vmlinux).map_err(|e| AvailableError::Elf(e.to_string()))?;
        let start = symbols
            .lookup("__start_mcount_loc")
            .ok_or(AvailableError::NoMcountLoc)?
            .addr
            .0;
        let stop = symbols
            .lookup("__stop_mcount_loc")
            .ok_or(AvailableError::NoMcountLoc)?
            .addr
            .0;
        let size = stop.checked_sub(start).ok_or(AvailableError::NoMcountLoc)?;
        let section = elf
            .section_headers
            .iter()
            .find(|sh| {
                sh.sh_type != goblin::elf::section_header::SHT_NOBITS
                    && sh.sh_addr <= start
                    && stop <= sh.sh_addr.saturating_add(sh.sh_size)
            })
            .ok_or(AvailableError::NoMcountLoc)?;
        let outside = || AvailableError::SectionOutsideFile {
            offset: section.sh_offset,
            size,
            file: vmlinux.len(),
        };
        let offset = section
            .sh_offset
            .checked_add(start - section.sh_addr)
            .ok_or_else(outside)?;
        let from = usize::try_from(offset).map_err(|_| outside())?;
        let to = from
            .checked_add(usize::try_from(size).map_err(|_| outside())?)
            .ok_or_else(outside)?;
        let bytes = vmlinux.get(from..to).ok_or_else(outside)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| Gva(u64::from_le_bytes(c.try_into().expect("chunks of 8"))))
            .collect())
    }

    /// The records the kernel keeps of `locations` (a vmlinux's `__mcount_loc`), named
    /// by `symbols` (the same kernel's, at the same addresses).
    pub fn from_locations(locations: &[Gva], symbols: &SymbolTable) -> Result<Self, AvailableError> {
        let bound = |name: &'static str| {
            symbols
                .lookup(name)
                .map(|s| s.addr)
                .ok_or(AvailableError::NoInitBounds(name))
        };
        let init: Range<Gva> = bound("__init_begin")?..bound("__init_end")?;
        let text = symbols.lookup("_text").map(|s| s.addr).ok_or(AvailableError::NoText)?;
        let mut sites: Vec<Gva> = locations
            .iter()
            .copied()
            .filter(|&a| a.0 != 0 && !init.contains(&a))
            .collect();
        sites.sort_unstable();
        let functions = sites
            .into_iter()
            .map(|site| match symbols.describe(site) {
                Some(d) if d.offset <= MAX_RECORD_OFFSET => TraceableFunction {
                    site,
                    name: d.symbol.name.clone(),
                    valid: true,
                },
                Some(d) => TraceableFunction {
                    site,
                    name: format!("{INVALID_FUNCTION}_{}", d.offset),
                    valid: false,
                },
                None => TraceableFunction {
                    site,
                    name: format!("{INVALID_FUNCTION}_0"),
                    valid: false,
                },
            })
            .collect();
        Ok(AvailableFunctions { functions, text })
    }

    /// The table of a vmlinux image, named by its own symbol table.
    pub fn from_vmlinux(vmlinux: &[u8], symbols: &SymbolTable) -> Result<Self, AvailableError> {
        Self::from_locations(&Self::mcount_locations(vmlinux, symbols)?, symbols)
    }

    /// The table of the vmlinux at `path`.
    pub fn from_vmlinux_file(path: &std::path::Path) -> Result<Self, AvailableError> {
        let bytes = std::fs::read(path).map_err(|source| AvailableError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let symbols =
            SymbolTable::parse_elf(&bytes).map_err(|e| AvailableError::Elf(format!("{}: {e}", path.display())))?;
        Self::from_vmlinux(&bytes, &symbols)
    }

    /// How far the running kernel whose symbols are `running` moved from where the
    /// records say (its KASLR slide: run-time minus link-time); 0 when it has no `_text`.
    pub fn slide_to(&self, running: &SymbolTable) -> i64 {
        running
            .lookup("_text")
            .map_or(0, |s| s.addr.0.wrapping_sub(self.text.0) as i64)
    }

    /// Every record, in address order.
    pub fn all(&self) -> &[TraceableFunction] {
        &self.functions
    }

    /// The records that can be traced (not a replaced weak function's).
    pub fn valid(&self) -> impl Iterator<Item = &TraceableFunction> {
        self.functions.iter().filter(|f| f.valid)
    }

    pub fn len(&self) -> usize {
        self.functions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use hvprobe_introspection::symbols::{Symbol, SymbolSource};

    use super::*;

    fn sym(name: &str, addr: u64, kind: char, size: Option<u64>) -> Symbol {
        Symbol {
            name: name.to_owned(),
            addr: Gva(addr),
            kind,
            size,
        }
    }

    fn table() -> SymbolTable {
        SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![
                sym("_text", 0xffff_ffff_8100_0000, 'T', None),
                sym("_stext", 0xffff_ffff_8100_0000, 'T', None),
                sym("plain", 0xffff_ffff_8100_0000, 't', None),
                sym("with_endbr", 0xffff_ffff_8100_0040, 'T', None),
                sym("keeps_going", 0xffff_ffff_8100_0080, 't', None),
                sym("__init_begin", 0xffff_ffff_8200_0000, 'D', None),
                sym("init_fn", 0xffff_ffff_8200_0010, 't', None),
                sym("__init_end", 0xffff_ffff_8210_0000, 'D', None),
                sym("_etext", 0xffff_ffff_8300_0000, 'T', None),
            ],
        )
    }

    #[test]
    fn the_kernel_keeps_sorted_nonzero_records_outside_init_code() {
        let locations = [
            Gva(0xffff_ffff_8100_0044),
            Gva(0),
            Gva(0xffff_ffff_8200_0010),
            Gva(0xffff_ffff_8100_0000),
        ];
        let available = AvailableFunctions::from_locations(&locations, &table()).unwrap();
        let names: Vec<&str> = available.all().iter().map(|f| f.name.as_str()).collect();
        // _stext and plain share an address: kallsyms names it by the function.
        assert_eq!(names, ["plain", "with_endbr"]);
        assert!(available.all().iter().all(|f| f.valid));
    }

    #[test]
    fn a_record_past_its_symbols_endbr_is_a_replaced_weak_function() {
        let locations = [Gva(0xffff_ffff_8100_00c0)];
        let available = AvailableFunctions::from_locations(&locations, &table()).unwrap();
        assert_eq!(
            available.all(),
            [TraceableFunction {
                site: Gva(0xffff_ffff_8100_00c0),
                name: "__ftrace_invalid_address___64".to_owned(),
                valid: false,
            }]
        );
        assert_eq!(available.valid().count(), 0);
    }

    #[test]
    fn a_kernel_without_init_bounds_is_refused_with_their_name() {
        let symbols = SymbolTable::from_symbols(
            SymbolSource::SystemMap,
            vec![sym("f", 0xffff_ffff_8100_0000, 't', None)],
        );
        let err = AvailableFunctions::from_locations(&[], &symbols).unwrap_err();
        assert!(err.to_string().contains("__init_begin"), "{err}");
    }

    #[test]
    fn the_slide_is_the_running_kernels_text_less_the_tables() {
        let available = AvailableFunctions::from_locations(&[Gva(0xffff_ffff_8100_0000)], &table()).unwrap();
        let moved = table().relocated(0x20_0000);
        assert_eq!(available.slide_to(&moved), 0x20_0000);
        assert_eq!(available.slide_to(&table()), 0);
    }

    #[test]
    fn an_image_that_is_not_elf_or_has_no_table_is_refused() {
        assert!(matches!(
            AvailableFunctions::mcount_locations(b"not an elf", &table()),
            Err(AvailableError::Elf(_))
        ));
    }
}
