//! hvprobe: Linux kernel probes run from outside the guest.
//!
//! This crate is the `hvprobe` command: its flags ([`cli`]) and the subcommands ([`cmd`]),
//! each turning its flags into the options of `hvprobe-session` (the run session: the
//! bundled guest, the run's probes, the control socket, shares and snapshots) and printing
//! what comes back. The probe engine (`hvprobe-probes`) runs on a VM (`hvprobe-vmm`)
//! through `hvprobe-live`, which host tools use directly.

pub mod cli;
pub mod cmd;

pub use hvprobe_session::{control, perfetto};
pub use hvprobe_vmm as vmm;

/// The bundled guest ([`hvprobe_session::guest`]), with hvprobe's cache directory
/// ([`hvprobe_session::cache::cache_dir`]) where the tests have always found it.
pub mod guest {
    pub use hvprobe_session::cache::cache_dir;
    pub use hvprobe_session::guest::*;
}
