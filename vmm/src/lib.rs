//! The KVM machine of hvprobe: guest memory, boot of a Linux kernel (PVH or bzImage),
//! vCPU threads and their exit loop, the few devices a console guest needs, and pause /
//! resume / stop of all vCPUs. It knows nothing about probes: debug exits go to a
//! [`DebugHandler`].

mod acpi;
mod backend;
mod boot;
mod breakpoint;
pub mod console;
mod cpuid;
mod devices;
mod error;
pub mod layout;
pub mod log_limit;
mod mptable;
pub mod regs;
pub mod snapshot;
pub mod stats;
mod vcpu;
pub mod virtio;
mod vm;

pub use backend::{segments_as_held, Backend};
pub use boot::{kernel_format, KernelFormat};
pub use breakpoint::reinject_breakpoint;
pub use console::{ConsoleLog, ConsoleOutput};
pub use cpuid::PVM_HIDDEN_FEATURES;
pub use devices::{GuestEvent, GUEST_EVENT_PORT, GUEST_EXIT_PORT};
pub(crate) use error::kvm_err;
pub use error::Error;
pub use mptable::MAX_CPUS;
pub use snapshot::{snapshot_cache_name, snapshot_disks, SnapshotError, SnapshotInfo, SNAPSHOT_FORMAT_VERSION};
pub use vcpu::exit_regs;
pub use vcpu::{
    set_guest_debug, BreakpointDisposition, DebugHandler, ExitCounters, NoProbes, PanicStop, PauseTimeout, PausedVcpus,
    PendingException, StopReason, StuckVcpu, VcpuActivity, VcpuAtStop, VcpuControl, VcpuState, DEFAULT_PAUSE_DEADLINE,
};
pub use virtio::block::{DiskConfig, DiskError};
pub use virtio::fs::{FsConfig, FsError};
pub use vm::{CodeBlob, ConsoleInput, Vm, VmConfig, VmOutcome, CODE_BLOB_START, MAX_MEM_MIB, MIN_MEM_MIB};
