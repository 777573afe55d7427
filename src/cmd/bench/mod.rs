//! `hvprobe bench ...`: performance, printed as ratios measured side by side in one run
//! (never timed tests). One module per benchmark.

pub mod arm;
pub mod drain;
pub mod filter;
pub mod io;
pub mod probes;
pub mod snapshot;

use crate::cli::{CreateArgs, MachineArgs};

/// The snapshot a guest benchmark restores: `given`, or one made now by booting the
/// bundled guest with `cpus` vCPUs into a temporary directory (the caller removes it when
/// `given` is `None`).
pub(crate) fn bench_snapshot(
    given: Option<&std::path::Path>,
    cpus: u8,
    bench: &str,
) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    if let Some(dir) = given {
        return Ok(dir.to_path_buf());
    }
    let out = std::env::temp_dir().join(format!("hvprobe-bench-{bench}-{}", std::process::id()));
    eprintln!("hvprobe: booting the bundled guest once for a snapshot (use --snapshot DIR to skip)");
    crate::cmd::snapshot::create(CreateArgs {
        out: out.clone(),
        machine: MachineArgs::bundled_guest(cpus),
        kaslr: false,
    })?;
    Ok(out)
}
