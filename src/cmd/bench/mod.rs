//! `hvprobe bench ...`: performance, printed as ratios measured side by side in one run
//! (never timed tests). One module per benchmark.

pub mod arm;
pub mod drain;
pub mod filter;
pub mod functions;
pub mod io;
pub mod probes;
pub mod snapshot;

/// The snapshot a guest benchmark restores: `given`, or the bundled guest's with `cpus`
/// vCPUs from hvprobe's cache (`snapshot create --cached`: made by one boot if missing).
pub(crate) fn bench_snapshot(
    given: Option<&std::path::Path>,
    cpus: u8,
) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    match given {
        Some(dir) => Ok(dir.to_path_buf()),
        None => Ok(hvprobe_session::snapshot::cached(cpus, false)?),
    }
}

/// A shell loop reading `/proc/version` on each of `cpus` vCPUs, in the background: the
/// guest busy on every vCPU, so that the pauses a benchmark measures are real.
pub(crate) fn read_loops(cpus: u8) -> String {
    (0..cpus)
        .map(|cpu| format!("taskset -c {cpu} sh -c 'while true; do read -r l < /proc/version; done' &"))
        .collect::<Vec<_>>()
        .join(" ")
}
