//! Where a vCPU is: the kernel symbol at its RIP and the code there, read through the
//! vCPU's own page tables (or why they do not map it). One page walk and at most
//! [`BYTES_AT_RIP`] bytes of guest memory, whatever the guest's tables say.

use hvprobe_arch::paging::PhysRead;
use hvprobe_arch::Gva;

use crate::memory::{GuestVirtRead, MemoryError, PagedGuestMemory};
use crate::symbols::SymbolTable;

/// Bytes read at a RIP: the longest x86 instruction is 15.
pub const BYTES_AT_RIP: usize = 16;

/// A vCPU's place.
#[derive(Debug)]
pub struct Place {
    /// `symbol+offset/size` as the kernel's `%pS` prints it (the guest's own name, not
    /// escaped), for a kernel-mode RIP the symbols cover.
    pub symbol: Option<String>,
    pub code: Code,
}

/// The code at a RIP, as the vCPU's page tables map it.
#[derive(Debug)]
pub enum Code {
    /// Mapped; the bytes up to [`BYTES_AT_RIP`] or the end of the page.
    Mapped {
        executable: bool,
        bytes: Result<Vec<u8>, MemoryError>,
    },
    /// The walk's reason.
    Unmapped(MemoryError),
}

/// The place of a vCPU at `rip` (in kernel mode or not) whose page tables `mem` walks.
pub fn place<M: PhysRead>(
    mem: &PagedGuestMemory<M>,
    symbols: Option<&SymbolTable>,
    rip: Gva,
    kernel_mode: bool,
) -> Place {
    let symbol = match (kernel_mode, symbols) {
        (true, Some(table)) => table.describe(rip).map(|d| d.to_string()),
        _ => None,
    };
    let code = match mem.translate(rip) {
        Ok(t) => {
            let n = usize::try_from(t.bytes_to_page_end()).map_or(BYTES_AT_RIP, |n| n.min(BYTES_AT_RIP));
            let mut bytes = vec![0u8; n];
            Code::Mapped {
                executable: t.permissions.executable,
                bytes: mem.read_virt(rip, &mut bytes).map(|()| bytes),
            }
        }
        Err(e) => Code::Unmapped(e),
    };
    Place { symbol, code }
}
