//! The probe engine (`hvprobe-probes`) and guest introspection (`hvprobe-introspection`)
//! on a running VM of `hvprobe-vmm`.
//!
//! - [`memory`]: guest memory as the page walker and the engine read and write it, through
//!   a vCPU's page tables or the kernel's own;
//! - [`symbols`], [`task`], [`kernel_up`]: the kernel's symbols, its current task, and the
//!   moment its paging is final;
//! - [`machine`]: the engine's `Machine` and `Vcpu` over KVM;
//! - [`handler`]: the VMM's debug handler that hands int3 and single-step exits to the engine;
//! - [`ool`]: the out-of-line area mapped into the kernel's page tables;
//! - [`stacks`]: the guest's kernel stacks narrowed with the paused vCPUs' registers;
//! - [`clock`]: the guest's trace clock (kvm-clock's `sched_clock()`) read on the host;
//! - [`tracer`]: a [`Tracer`](hvprobe_probes::engine::Tracer) for a booted kernel or a code blob.
//!
//! No command line here: host tools, examples and tests build on this crate.

#![forbid(unsafe_code)]

pub mod clock;
pub mod handler;
pub mod kernel_up;
pub mod machine;
pub mod memory;
pub mod ool;
pub mod stacks;
pub mod symbols;
pub mod task;
pub mod tracer;

pub use clock::{guest_clock, GuestClockError};
pub use handler::ProbeHandler;
pub use kernel_up::wait_for_kernel;
pub use machine::VmMachine;
pub use memory::{
    kernel_memory, live_memory, GuestPhys, HostArea, KernelPageTables, KernelTablesError, KernelText, LiveKernel,
};
pub use ool::{map_out_of_line_area, out_of_line_gpa, place_out_of_line_area, OutOfLineError};
pub use stacks::narrow_to_vcpus;
pub use symbols::{load_symbols, KernelSymbols, KernelSymbolsError, SymbolsFrom};
pub use task::{TaskContext, TaskContextError};
pub use tracer::{build_tracer, code_blob_tracer, TracerError, CODE_BLOB_OOL_VA};
