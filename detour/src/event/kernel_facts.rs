//! What an event detour needs to know about the guest kernel (per-CPU offsets, task
//! fields, the nofault copy functions, THREAD_SIZE), from its symbols and BTF.

use super::*;

/// `THREAD_SIZE` of an x86-64 kernel without KASAN.
pub const DEFAULT_THREAD_SIZE: u32 = 16 << 10;

/// What the detour needs to know about the guest kernel, filled by the integrator from its
/// symbols and BTF ([`GuestKernelFacts::from_symbols`]). Every `Option` is needed only by
/// the fetch-args that use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestKernelFacts {
    /// The `%gs` displacement of the per-CPU `int cpu_number`.
    pub cpu_number: i32,
    /// The `%gs` displacement of the per-CPU `struct task_struct *current_task` (`$comm`).
    pub current_task: Option<i32>,
    /// `offsetof(struct task_struct, comm)` (`$comm`, the task stamp).
    pub comm_offset: Option<u32>,
    /// `offsetof(struct task_struct, pid)` (the task stamp).
    pub pid_offset: Option<u32>,
    pub copy_from_kernel_nofault: Option<Gva>,
    pub strncpy_from_kernel_nofault: Option<Gva>,
    pub copy_from_user_nofault: Option<Gva>,
    pub strncpy_from_user_nofault: Option<Gva>,
    /// `THREAD_SIZE`, a power of two: the kernel's bound for `$stackN` (16 KiB; 32 KiB
    /// with KASAN).
    pub thread_size: u32,
    /// The guest's kretprobes' per-task list (`CONFIG_RETHOOK`), for an exit-free return
    /// probe's caller when the guest swapped the return address first (from BTF; set by
    /// the integrator).
    pub rethooks: Option<hvprobe_introspection::stacks::RethookLayout>,
}

/// Why [`GuestKernelFacts::from_symbols`] could not fill the facts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FactsError {
    #[error("the kernel has neither a cpu_number nor a pcpu_hot per-CPU symbol")]
    NoCpuNumber,
    #[error("the per-CPU symbol {name} at {addr} is not a %gs displacement (a sign-extended 32-bit value)")]
    NotPerCpu { name: &'static str, addr: Gva },
}

impl GuestKernelFacts {
    /// The facts a kernel's symbols give: `cpu_number` and `current_task` (Linux ≤ 6.1 and
    /// ≥ 6.15, zero-based per-CPU symbols or absolute ones, both a `%gs` displacement) or
    /// `pcpu_hot` (6.2 to 6.14: `current_task` at +0, `cpu_number` at +12), the nofault
    /// routines by name, and `comm` from the task layout (BTF).
    pub fn from_symbols(symbols: &SymbolTable, task: Option<&TaskLayout>) -> Result<Self, FactsError> {
        let displacement = |name: &'static str, plus: i64| -> Result<Option<i32>, FactsError> {
            let Some(s) = symbols.lookup(name) else {
                return Ok(None);
            };
            i32::try_from((s.addr.0 as i64).wrapping_add(plus))
                .map(Some)
                .map_err(|_| FactsError::NotPerCpu { name, addr: s.addr })
        };
        let (cpu_number, current_task) = match displacement("cpu_number", 0)? {
            Some(cpu) => (cpu, displacement("current_task", 0)?),
            None => match displacement("pcpu_hot", 12)? {
                Some(cpu) => (cpu, displacement("pcpu_hot", 0)?),
                None => return Err(FactsError::NoCpuNumber),
            },
        };
        let function = |name: &str| symbols.lookup(name).map(|s| s.addr);
        Ok(GuestKernelFacts {
            cpu_number,
            current_task,
            comm_offset: task.and_then(|t| u32::try_from(t.comm_offset).ok()),
            pid_offset: task.and_then(|t| u32::try_from(t.pid_offset).ok()),
            copy_from_kernel_nofault: function("copy_from_kernel_nofault"),
            strncpy_from_kernel_nofault: function("strncpy_from_kernel_nofault"),
            copy_from_user_nofault: function("copy_from_user_nofault"),
            strncpy_from_user_nofault: function("strncpy_from_user_nofault"),
            thread_size: DEFAULT_THREAD_SIZE,
            rethooks: None,
        })
    }
}
