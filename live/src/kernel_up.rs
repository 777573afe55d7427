//! The moment a booting guest kernel can be introspected and probed: its paging is final.

use std::sync::Arc;
use std::time::Duration;

use hvprobe_arch::Gva;
use hvprobe_vmm::{PausedVcpus, VcpuControl, VcpuState};
use vm_memory::GuestMemoryMmap;

use crate::memory::live_memory;

/// Waits until the guest kernel's paging is final — it has set up its syscall entry point
/// (LSTAR) and that address translates — and returns with all vCPUs paused and vCPU 0's
/// state. `None` if the VM stops first.
pub fn wait_for_kernel(
    control: &Arc<VcpuControl>,
    mem: &GuestMemoryMmap,
    poll: Duration,
) -> Option<(PausedVcpus, VcpuState)> {
    loop {
        if control.stop_reason().is_some() {
            return None;
        }
        match control.pause_all() {
            Ok(paused) => {
                if let Some(state) = paused.state(0) {
                    if state.lstar != 0 && live_memory(mem, &state).translate(Gva(state.lstar)).is_ok() {
                        return Some((paused, state));
                    }
                }
            }
            // Asked again at the next poll: the vCPU that did not stop may have by then.
            Err(e) => tracing::warn!("waiting for the guest kernel: {e}"),
        }
        std::thread::sleep(poll);
    }
}
