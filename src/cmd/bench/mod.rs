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
