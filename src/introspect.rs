//! Introspection of a live guest: the glue between the VMM (paused vCPUs, guest memory)
//! and `hvprobe-introspection` (page walks, symbol tables, kernel facts).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hvprobe_arch::paging::{PagingMode, PhysRead, PhysWrite};
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError, PagedGuestMemory};
use hvprobe_introspection::symbols::{SymbolError, SymbolTable};
use hvprobe_introspection::task::{current_task, select_per_cpu_base, task_info, TaskError, TaskInfo, TaskLayout};
use hvprobe_vmm::{PausedVcpus, VcpuControl, VcpuState};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest-physical memory as the page walker reads and writes it.
#[derive(Clone)]
pub struct GuestPhys(pub GuestMemoryMmap);

impl PhysRead for GuestPhys {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), String> {
        self.0.read_slice(buf, GuestAddress(gpa.0)).map_err(|e| e.to_string())
    }
}

impl PhysWrite for GuestPhys {
    fn write_phys(&self, gpa: Gpa, data: &[u8]) -> Result<(), String> {
        self.0.write_slice(data, GuestAddress(gpa.0)).map_err(|e| e.to_string())
    }
}

/// Guest-virtual memory as a paused vCPU sees it (its CR3 and paging mode).
pub fn live_memory(mem: &GuestMemoryMmap, state: &VcpuState) -> PagedGuestMemory<GuestPhys> {
    PagedGuestMemory::new(
        GuestPhys(mem.clone()),
        state.sregs.cr3,
        PagingMode::from_cr4(state.sregs.cr4),
    )
}

/// Waits until the guest kernel's paging is final — it has set up its syscall entry point
/// (LSTAR) and that address translates — and returns with all vCPUs paused. `None` if the
/// VM stops first.
pub fn wait_for_kernel(
    control: &Arc<VcpuControl>,
    mem: &GuestMemoryMmap,
    poll: Duration,
) -> Option<(PausedVcpus, VcpuState)> {
    loop {
        if control.stop_reason().is_some() {
            return None;
        }
        {
            let paused = control.pause_all();
            if let Some(state) = paused.state(0) {
                if state.lstar != 0 && live_memory(mem, &state).translate(Gva(state.lstar)).is_ok() {
                    return Some((paused, state));
                }
            }
        }
        std::thread::sleep(poll);
    }
}

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

#[derive(Debug, thiserror::Error)]
pub enum IntrospectError {
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
) -> Result<KernelSymbols, IntrospectError> {
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
        .ok_or_else(|| IntrospectError::NoSyscallEntry { from: from.to_string() })?
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
            return Err(IntrospectError::Mismatch {
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

/// What it takes to name the task running on a vCPU: the `task_struct` layout (from the
/// guest kernel's BTF) and where the per-CPU `current_task` pointer is.
#[derive(Clone, Copy, Debug)]
pub struct TaskContext {
    pub layout: TaskLayout,
    /// `current_task`'s offset in a CPU's per-CPU area.
    pub current_task_offset: u64,
}

impl TaskContext {
    /// From the guest's BTF (`__start_BTF`..`__stop_BTF`) and per-CPU `current_task`.
    /// Fails with the reason `$comm` is unavailable (no BTF in the guest kernel, ...).
    pub fn read(mem: &(impl GuestVirtRead + ?Sized), symbols: &SymbolTable) -> Result<TaskContext, String> {
        let current = symbols
            .lookup("current_task")
            .ok_or("the kernel has no per-CPU current_task symbol (only Linux 6.1-style layouts are known)")?;
        let btf = match (symbols.lookup("__start_BTF"), symbols.lookup("__stop_BTF")) {
            (Some(start), Some(stop)) => Some((start.addr, stop.addr)),
            _ => None,
        };
        let layout = TaskLayout::from_guest(&mem, btf).map_err(|e| e.to_string())?;
        Ok(TaskContext {
            layout,
            current_task_offset: current.addr.0,
        })
    }

    /// The task running on a paused vCPU.
    pub fn current(&self, mem: &(impl GuestVirtRead + ?Sized), state: &VcpuState) -> Result<TaskInfo, TaskError> {
        let cpl = (state.sregs.cs.selector & 3) as u8;
        let base = select_per_cpu_base(cpl, state.sregs.gs.base, state.kernel_gs_base)?;
        let task = current_task(&mem, base, self.current_task_offset)?;
        task_info(&mem, &self.layout, task)
    }
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
