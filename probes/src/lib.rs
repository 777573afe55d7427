//! The probe engine: kprobes, kretprobes and jump-optimized probes written into the guest
//! kernel's text by the host, the probe-spec parser (kprobe_events syntax), fetch-args,
//! counters, the listing, and the sync and async handler APIs.
//!
//! The engine ([`engine`]) runs on an abstract machine ([`machine`]: the VMM side
//! implements it over KVM, the tests over a fake), so that everything here is tested
//! without KVM. Jump optimization's safety checks, the relocation of displaced
//! instructions and the event detours (guest code that records hits into per-CPU rings
//! the host drains) are [`detour`].

pub mod clock;
pub mod detour;
pub mod engine;
pub mod fetch;
pub mod insn;
pub mod machine;
pub mod output;
pub mod regs;
pub mod spec;
