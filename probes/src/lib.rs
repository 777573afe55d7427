//! The probe engine: kprobes, kretprobes and jump-optimized probes written into the guest
//! kernel's text by the host, the probe-spec parser (kprobe_events syntax), fetch-args,
//! counters, the listing, and the sync and async handler APIs.
//!
//! Not built yet: this crate is the kprobes issue's. Only the probe-spec parser ([`spec`])
//! exists so far.

pub mod regs;
pub mod spec;
