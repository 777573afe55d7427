//! ftrace's function and function_graph tracers, run from the host (KVM-free).
//!
//! - [`available`]: the functions the kernel can trace, as its
//!   `available_filter_functions` lists them: the `__mcount_loc` table of its vmlinux, less
//!   what the kernel drops (init code, weak functions' stale entries).
//! - [`filter`]: which of them a run traces, as ftrace's `set_ftrace_filter`,
//!   `set_ftrace_notrace`, `set_graph_function` and `set_graph_notrace` files take them,
//!   and the functions hvprobe leaves out of a whole-kernel trace.
//! - [`layout`]: the function tracer's line and the function_graph tracer's nested layout,
//!   built from the hits of the entry and return probes a run puts on each function.
#![forbid(unsafe_code)]

pub mod available;
pub mod filter;
pub mod layout;
pub mod stats;

pub use available::{AvailableError, AvailableFunctions, TraceableFunction};
pub use filter::{FilterError, FunctionFilter, Selection};
