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

#[cfg(test)]
mod tests {
    /// Guest values reach every library crate of the workspace, and each one's release
    /// build panics on an overflow rather than wrapping (Cargo.toml says why). A crate
    /// split off or added without its profile line would wrap silently.
    #[test]
    fn every_workspace_crate_checks_overflows_in_release() {
        let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
        let members = manifest
            .lines()
            .find_map(|l| l.strip_prefix("members = ["))
            .expect("a members line");
        let mut unchecked = Vec::new();
        for member in members
            .trim_end_matches(']')
            .split(',')
            .map(|m| m.trim().trim_matches('"'))
        {
            let section = format!("[profile.release.package.hvprobe-{member}]\noverflow-checks = true\n");
            if !manifest.contains(&section) {
                unchecked.push(member);
            }
        }
        assert!(unchecked.is_empty(), "no release overflow checks for {unchecked:?}");
    }
}
