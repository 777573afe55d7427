//! hvprobe's integration suites, one module each, in one test binary: cargo runs test
//! binaries one after another, and a suite whose last test boots a guest alone (a KASLR
//! boot, a minute of /proc/kallsyms) left a core idle for it. In one binary libtest keeps
//! every core busy with the next suite's tests (docs/testing.md). A test's name starts with
//! its suite: `cargo test --test integration probes::` runs one suite.
//!
//! The nested-SVM lane (tests/hardware_lane.rs) stays a binary of its own and runs
//! modules of this one in its L1.

mod common;

mod analysis;
mod boot;
mod cli_docs;
mod cli_errors;
mod clock;
mod control;
mod disks;
mod docs;
mod functions;
mod fuzz_targets;
mod hardening;
mod install;
mod introspection;
mod modules;
mod pause;
mod perfetto;
mod probe_api;
mod probes;
mod refusals;
mod setup;
mod shares;
mod snapshot;
mod stacks;
mod stop;
