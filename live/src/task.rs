//! The task running on a vCPU (`$comm`, pid), named through the guest's own BTF.

use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::task::{current_task, select_per_cpu_base, task_info, TaskError, TaskInfo, TaskLayout};
use hvprobe_vmm::VcpuState;

/// Why guest tasks cannot be named.
#[derive(Debug, thiserror::Error)]
pub enum TaskContextError {
    #[error("the kernel has no per-CPU current_task symbol (only Linux 6.1-style layouts are known)")]
    NoCurrentTask,
    #[error(transparent)]
    Layout(#[from] TaskError),
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
    pub fn read(mem: &(impl GuestVirtRead + ?Sized), symbols: &SymbolTable) -> Result<TaskContext, TaskContextError> {
        let current = symbols.lookup("current_task").ok_or(TaskContextError::NoCurrentTask)?;
        let btf = match (symbols.lookup("__start_BTF"), symbols.lookup("__stop_BTF")) {
            (Some(start), Some(stop)) => Some((start.addr, stop.addr)),
            _ => None,
        };
        let layout = TaskLayout::from_guest(&mem, btf)?;
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
