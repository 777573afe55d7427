//! The probe engine: kprobes, kretprobes and jump-optimized probes written into the guest
//! kernel's text by the host; counters, the listing, and the sync and async handler APIs.
//!
//! The engine ([`engine`]) runs on an abstract machine ([`machine`]: the VMM side
//! implements it over KVM, the tests over a fake), so that everything here is tested
//! without KVM. It stands on three crates, each with one job: the kprobe_events language
//! (`hvprobe-spec`: specs, their checks, fetch-args, event lines), x86 instructions at a
//! probe (`hvprobe-insn`: decoding, stepping, emulation) and the guest code we write
//! (`hvprobe-detour`: jump optimization's safety checks, relocation, event detours and
//! their rings).

#![forbid(unsafe_code)]

pub mod clock;
pub mod engine;
pub mod machine;

// The layers below the engine, under the paths they had when they were modules of this
// crate.
pub use hvprobe_arch::pt_regs as regs;
pub use hvprobe_detour as detour;
pub use hvprobe_insn as insn;
pub use hvprobe_spec as spec;
pub use hvprobe_spec::{fetch, output};
