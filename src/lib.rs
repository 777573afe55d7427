//! hvprobe: Linux kernel probes run from outside the guest.
//!
//! This crate is the `hvprobe` command: its flags ([`cli`]), the bundled guest and how
//! hvprobe talks to it ([`guest`]), and the subcommands. The probe engine
//! (`hvprobe-probes`) runs on a VM (`hvprobe-vmm`) through `hvprobe-live`, which host tools
//! use directly.

pub mod cache;
pub mod cli;
pub mod cmd;
pub mod control;
pub mod cpio;
pub mod error;
pub mod filters_and_triggers;
pub mod guest;
pub mod guest_kernel;
pub mod kernel_source;
pub mod options;
pub mod perfetto;
pub mod report;
pub mod sampler;
pub mod session;
pub mod shares;
pub mod trace;
pub mod where_stopped;

pub use hvprobe_vmm as vmm;
