//! The run session of hvprobe: what `hvprobe run` does with a guest, as a library a host tool
//! can drive as the `hvprobe` binary does (which only turns its flags into these options and
//! prints the outcome).
//!
//! From the bottom up:
//! - the guest and its machine: hvprobe's [`cache`] and the build inputs written into it,
//!   the bundled [`guest`] (its build, progress, modules, and the protocol of its init), the
//!   [`machine`] a command boots, the host directories [`shares`] it gets (virtiofsd found,
//!   confined, supervised) and the initrd's [`cpio`] archives;
//! - what a run is asked: the tracing [`options`], the kernel's DWARF on the host
//!   ([`kernel_source`]) and where its symbols come from ([`symbol_sources`]);
//! - the probes of a run ([`trace`]: spec files, live add and remove, the hit printer), its
//!   event [`filters_and_triggers`], [`perfetto`] traces, and the [`error`] of it all;
//! - the [`control`] socket (protocol, server, client, wire records) through which other
//!   terminals change the probes of a running guest;
//! - the [`session`] around a guest (probes, control socket, text hash), the
//!   [`guest_kernel`] it introspects once up, the [`sampler`], and where vCPUs stopped
//!   ([`where_stopped`]);
//! - the runs: a [`snapshot`] made and restored, a [`run`] (booted step by step, or
//!   restored), and the lines of their end ([`report`]).

pub mod cache;
pub mod control;
pub mod cpio;
pub mod error;
pub mod filters_and_triggers;
pub mod guest;
pub mod guest_kernel;
pub mod kernel_source;
pub mod machine;
pub mod options;
pub mod perfetto;
pub mod report;
pub mod run;
pub mod sampler;
pub mod session;
pub mod shares;
pub mod snapshot;
pub mod symbol_sources;
pub mod trace;
pub mod where_stopped;
