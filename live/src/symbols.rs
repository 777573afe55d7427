//! The running kernel's symbols: from a System.map or vmlinux file (checked against guest
//! memory and relocated by the KASLR slide) or from the kallsyms tables in guest memory.

use std::path::PathBuf;

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::symbols::{SymbolError, SymbolTable};

/// Where kernel symbols come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymbolsFrom {
    SystemMap(PathBuf),
    Vmlinux(PathBuf),
    /// Decoded from the kallsyms tables in guest memory: needs no file at all.
    Kallsyms,
}

impl std::fmt::Display for SymbolsFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SymbolsFrom::SystemMap(p) => write!(f, "System.map {}", p.display()),
            SymbolsFrom::Vmlinux(p) => write!(f, "vmlinux {}", p.display()),
            SymbolsFrom::Kallsyms => write!(f, "guest kallsyms"),
        }
    }
}

impl SymbolsFrom {
    /// A short name for output lines.
    pub fn label(&self) -> &'static str {
        match self {
            SymbolsFrom::SystemMap(_) => "system-map",
            SymbolsFrom::Vmlinux(_) => "vmlinux",
            SymbolsFrom::Kallsyms => "kallsyms",
        }
    }
}

/// Why the running kernel's symbols could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KernelSymbolsError {
    #[error(transparent)]
    Symbols(#[from] SymbolError),
    #[error("{from} has no entry_SYSCALL_64, so the KASLR slide cannot be computed from MSR_LSTAR")]
    NoSyscallEntry { from: String },
    #[error(
        "{from} does not match the running kernel: at its linux_banner ({addr}) guest memory reads {found:?}{expected}"
    )]
    Mismatch {
        from: String,
        addr: Gva,
        found: String,
        expected: String,
    },
    #[error("reading guest memory: {0}")]
    Memory(#[from] MemoryError),
}

/// The kernel's symbols, at their run-time addresses.
pub struct KernelSymbols {
    pub table: SymbolTable,
    pub from: SymbolsFrom,
    /// The KASLR slide: run-time minus link-time address of the kernel.
    pub slide: i64,
}

/// `kernel symbols from SOURCE: KASLR slide 0x…`: the line a run's summary gives them (a
/// boot's and a restore's alike; tests read the slide from it).
impl std::fmt::Display for KernelSymbols {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kernel symbols from {}: KASLR slide {:#x}", self.from, self.slide)
    }
}

/// Link-time address of `_text` on x86-64 (`__START_KERNEL_map` + `CONFIG_PHYSICAL_START`
/// at its default). Only used to report the slide when symbols come from kallsyms, which
/// has run-time addresses and no link-time ones.
const DEFAULT_TEXT_LINK_ADDRESS: u64 = 0xffff_ffff_8100_0000;

/// Where to look for the kallsyms tables: the kernel image mapping around the syscall
/// entry (kernel text and rodata), up to where the module area starts.
fn kallsyms_search_range(lstar: u64) -> std::ops::Range<Gva> {
    const KERNEL_IMAGE_END: u64 = 0xffff_ffff_c000_0000;
    let start = (lstar & !0x1f_ffff).saturating_sub(16 << 20).max(0xffff_ffff_8000_0000);
    let end = start.saturating_add(512 << 20).min(KERNEL_IMAGE_END);
    Gva(start)..Gva(end)
}

/// Loads the kernel's symbols from `from`, relocated by the KASLR slide, and checks that a
/// file-based table belongs to the running kernel (its `linux_banner` must be where the
/// table says, and for a vmlinux read exactly as in the file).
pub fn load_symbols(
    from: &SymbolsFrom,
    mem: &(impl GuestVirtRead + ?Sized),
    lstar: u64,
) -> Result<KernelSymbols, KernelSymbolsError> {
    let (table, expected_banner) = match from {
        SymbolsFrom::SystemMap(path) => (SymbolTable::from_system_map_file(path)?, None),
        SymbolsFrom::Vmlinux(path) => {
            // One read of the (tens of MiB) file serves both the symbol table and the
            // banner the running kernel must match.
            let bytes = std::fs::read(path).map_err(|source| SymbolError::Io {
                path: path.display().to_string(),
                source,
            })?;
            let table = SymbolTable::parse_elf(&bytes)?;
            let banner = hvprobe_introspection::memory::ElfImage::from_bytes(bytes)
                .ok()
                .and_then(|image| table.lookup("linux_banner").map(|s| read_c_string(&image, s.addr)));
            (table, banner.and_then(Result::ok))
        }
        SymbolsFrom::Kallsyms => {
            let table = SymbolTable::from_kallsyms(mem, kallsyms_search_range(lstar))?;
            let text = table
                .lookup("_text")
                .map(|s| s.addr.0)
                .unwrap_or(DEFAULT_TEXT_LINK_ADDRESS);
            let slide = text.wrapping_sub(DEFAULT_TEXT_LINK_ADDRESS) as i64;
            return Ok(KernelSymbols {
                table,
                from: from.clone(),
                slide,
            });
        }
    };
    let entry = table
        .lookup("entry_SYSCALL_64")
        .ok_or_else(|| KernelSymbolsError::NoSyscallEntry { from: from.to_string() })?
        .addr;
    let slide = lstar.wrapping_sub(entry.0) as i64;
    let table = table.relocated(slide);
    if let Some(banner) = table.lookup("linux_banner") {
        let found = read_c_string(mem, banner.addr).unwrap_or_default();
        let matches = match &expected_banner {
            Some(expected) => &found == expected,
            None => found.starts_with("Linux version "),
        };
        if !matches {
            return Err(KernelSymbolsError::Mismatch {
                from: from.to_string(),
                addr: banner.addr,
                found: found.chars().take(60).collect(),
                expected: match expected_banner {
                    Some(e) => format!(", the file has {:?}", e.chars().take(60).collect::<String>()),
                    None => ", not \"Linux version ...\"".into(),
                },
            });
        }
    }
    Ok(KernelSymbols {
        table,
        from: from.clone(),
        slide,
    })
}

/// A NUL-terminated string of at most 256 bytes.
fn read_c_string(mem: &(impl GuestVirtRead + ?Sized), at: Gva) -> Result<String, MemoryError> {
    let mut buf = [0u8; 256];
    mem.read_virt(at, &mut buf)?;
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kallsyms_search_covers_the_kernel_image_around_the_syscall_entry() {
        let r = kallsyms_search_range(0xffff_ffff_a3c0_0040);
        assert!(r.start.0 <= 0xffff_ffff_a3c0_0000 && r.start.0 >= 0xffff_ffff_8000_0000);
        assert!(r.end.0 <= 0xffff_ffff_c000_0000);
        assert!(r.end.0 - r.start.0 >= 64 << 20);
        let low = kallsyms_search_range(0xffff_ffff_8100_0000);
        assert_eq!(low.start.0, 0xffff_ffff_8000_0000);
    }
}
