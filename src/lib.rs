//! hvprobe: Linux kernel probes run from outside the guest.
//!
//! This crate wires the VMM (`hvprobe-vmm`) to the bundled guest and the command line.
//! The probe engine (`hvprobe-probes`) and guest introspection
//! (`hvprobe-introspection`) are built on top in later steps.

pub mod bench;
pub mod cpio;
pub mod guest;
pub mod introspect;
pub mod probing;
pub mod sampler;
pub mod snapshot;
pub mod trace;

pub use hvprobe_vmm as vmm;
