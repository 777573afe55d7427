//! What ftrace does with an event besides printing it, done on the host as hits arrive:
//! **event filters** (what one writes to `events/GRP/EVENT/filter`) and **hist triggers**
//! (`hist:keys=...` written to `events/GRP/EVENT/trigger`, read back from
//! `events/GRP/EVENT/hist`). The grammar, the semantics and the output layouts are Linux
//! 6.1's (`kernel/trace/trace_events_filter.c`, `trace_events_hist.c`, `tracing_map.c`),
//! so that what a user knows from `/sys/kernel/tracing` works here, and the tests can hold
//! the host's results against the guest's own.
//!
//! - [`fields`]: an event's fields (its fetch-args, `common_pid`, `comm`, `cpu`) and their
//!   values in a [`HitRecord`](hvprobe_probes::output::HitRecord).
//! - [`filter`]: the filter grammar, bound to an event's fields, evaluated per hit.
//! - [`hist`]: hist trigger specs, the bounded aggregation, the `hist` file's layout and JSON.
//! - [`kernel_sort`]: the kernel's heapsort, so that entries with equal sort keys come out
//!   in the order the guest prints them.
//! - [`request`]: `--filter GRP/EVENT:EXPR`, `--trigger GRP/EVENT:TRIGGER` and the spec
//!   file's `filter`/`trigger` lines, with errors naming the flag or the file, line and
//!   column.
//! - [`stacktrace`]: the `stacktrace` trigger (the stack is the probe engine's, unwound on
//!   the host).
//! - [`table`]: every event's filter and triggers, looked up per hit.

#![forbid(unsafe_code)]

pub mod fields;
pub mod filter;
pub mod hist;
pub mod kernel_sort;
pub mod request;
pub mod stacktrace;
pub mod table;

#[cfg(test)]
mod test_support;
