//! vCPU threads: why a VM stops ([`stop`]), what they hand to the probe side
//! ([`handler`]), pausing, resuming and stopping them all ([`control`]), the state a parked
//! vCPU publishes ([`state`]) and the exit loop ([`runner`]). Guest-owned breakpoints are
//! delivered by [`crate::breakpoint`].

mod control;
pub mod exit_regs;
mod handler;
mod runner;
mod state;
mod stop;

pub use control::{PauseTimeout, PausedVcpus, StuckVcpu, VcpuActivity, VcpuControl, DEFAULT_PAUSE_DEADLINE};
pub use handler::{set_guest_debug, BreakpointDisposition, DebugHandler, NoProbes};
pub use runner::{ExitCounters, VcpuRunner};
pub use state::{PendingException, VcpuAtStop, VcpuState};
pub use stop::{PanicStop, StopReason};

use control::*;
use stop::*;
