//! The bundled default guest: a small Linux kernel and a busybox initramfs built from
//! `guest/` by `guest/build.sh`, cached under `~/.cache/hvprobe` keyed by their inputs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cpio::{append_archive, CpioWriter};

/// Options the VMM's own devices need on every kernel command line.
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1";

/// Where the guest's init finds the workload (see `guest/README.md`).
pub const WORKLOAD_PATH: &str = "hvprobe/workload";

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("cannot run the guest build script {script}: {source}")]
    Spawn {
        script: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("building the bundled guest failed ({status}); its messages are above")]
    BuildFailed { status: std::process::ExitStatus },
    #[error("the guest build printed no artefact directory")]
    NoOutput,
    #[error("the bundled guest in {dir} lacks {file}")]
    Missing { dir: PathBuf, file: &'static str },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The files of a built bundled guest.
#[derive(Clone, Debug)]
pub struct BundledGuest {
    pub dir: PathBuf,
    pub vmlinux: PathBuf,
    pub bzimage: PathBuf,
    pub system_map: PathBuf,
    pub initramfs: PathBuf,
    /// Command-line options this kernel wants beyond [`BASE_CMDLINE`].
    pub cmdline: String,
}

/// The `guest/` directory of this source tree.
pub fn guest_source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("guest")
}

impl BundledGuest {
    /// Builds the bundled guest if its cache entry is missing (the build script prints its
    /// progress on stderr) and returns its files.
    pub fn ensure_built() -> Result<BundledGuest, GuestError> {
        let script = guest_source_dir().join("build.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|source| GuestError::Spawn {
                script: script.clone(),
                source,
            })?;
        if !out.status.success() {
            return Err(GuestError::BuildFailed { status: out.status });
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .ok_or(GuestError::NoOutput)?;
        Self::from_dir(Path::new(dir.trim()))
    }

    /// The guest built in `dir`.
    pub fn from_dir(dir: &Path) -> Result<BundledGuest, GuestError> {
        let file = |name: &'static str| {
            let p = dir.join(name);
            if p.exists() {
                Ok(p)
            } else {
                Err(GuestError::Missing {
                    dir: dir.into(),
                    file: name,
                })
            }
        };
        let cmdline_path = file("cmdline")?;
        let cmdline = std::fs::read_to_string(&cmdline_path)
            .map_err(|source| GuestError::Read {
                path: cmdline_path,
                source,
            })?
            .trim()
            .to_string();
        Ok(BundledGuest {
            dir: dir.into(),
            vmlinux: file("vmlinux")?,
            bzimage: file("bzImage")?,
            system_map: file("System.map")?,
            initramfs: file("initramfs.cpio")?,
            cmdline,
        })
    }
}

/// An initrd: `base` (a file) with, when there is a workload, an archive appended that
/// holds it as a shell script for the bundled init to run.
pub fn initrd_with_workload(base: &Path, workload: Option<&str>) -> Result<Vec<u8>, GuestError> {
    let mut initrd = std::fs::read(base).map_err(|source| GuestError::Read {
        path: base.into(),
        source,
    })?;
    if let Some(command) = workload {
        let mut archive = CpioWriter::new();
        archive.dir("hvprobe");
        let script = format!("{command}\n");
        archive.file(WORKLOAD_PATH, 0o755, script.as_bytes());
        append_archive(&mut initrd, &archive.finish());
    }
    Ok(initrd)
}
