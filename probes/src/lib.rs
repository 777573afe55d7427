//! The probe engine: kprobes, kretprobes and jump-optimized probes written into the guest
//! kernel's text by the host, the probe-spec parser (kprobe_events syntax), fetch-args,
//! counters, the listing, and the sync and async handler APIs.
//!
//! Jump-optimized probes are not built yet: [`detour`] has their safety checks, the
//! relocation of the displaced instructions, and the event detour (guest code recording
//! hits into per-CPU rings that the host drains), which the engine does not use so far.

pub mod clock;
pub mod detour;
pub mod engine;
pub mod fetch;
pub mod insn;
pub mod machine;
pub mod output;
pub mod regs;
pub mod spec;
