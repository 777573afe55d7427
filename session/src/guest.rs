//! The bundled default guest and how hvprobe talks to a guest's init: a small Linux kernel
//! and a busybox initramfs built from `guest/` by `guest/build.sh`, cached under
//! `~/.cache/hvprobe` keyed by their inputs; the kernel command line hvprobe boots with; the
//! workload, as a file in the initrd or (wait mode, for snapshots) as a console message.
//! `guest/README.md` is the guest side of this protocol.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cache::{cache_dir, inputs};

pub mod modules;
pub mod progress;

/// Options the VMM's own devices need on every kernel command line.
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1";

/// Where the guest's init finds the workload (see `guest/README.md`).
pub const WORKLOAD_PATH: &str = "hvprobe/workload";

/// The kernel command-line option that puts the bundled init in wait mode: init mounts what
/// it always mounts, signals "ready for a workload" (event 3) and reads the workload from
/// the serial console as a [`workload_message`].
pub const WAIT_OPTION: &str = "hvprobe.wait";

/// The kernel command line of a run: the options the VMM's devices need, the bundled
/// kernel's own (when `bundled_kernel` is the kernel that boots), then the user's `extra`.
pub fn kernel_cmdline(bundled_kernel: Option<&BundledGuest>, extra: &str) -> String {
    let mut cmdline = match bundled_kernel {
        Some(g) => format!("{BASE_CMDLINE} {}", g.cmdline),
        None => BASE_CMDLINE.to_string(),
    };
    if !extra.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    cmdline
}

/// The bundled init's option that mounts a disk as the workload's `/` (`--root`).
pub const ROOT_OPTION: &str = "hvprobe.root";

/// The guest's name of disk `index` (`/dev/vda` for the first `--disk`).
pub fn disk_name(index: usize) -> Option<String> {
    let letter = u8::try_from(index).ok().filter(|&i| i < 26)?;
    Some(format!("/dev/vd{}", (b'a' + letter) as char))
}

fn disk_names(count: usize) -> String {
    match count {
        0 => "none (--disk adds one)".into(),
        n => (0..n).filter_map(disk_name).collect::<Vec<_>>().join(", "),
    }
}

/// The init option for `--root`, checked against the disks given.
pub fn root_option(root: &str, disks: usize) -> Result<String, GuestError> {
    if !(0..disks).filter_map(disk_name).any(|name| name == root) {
        return Err(GuestError::NoSuchRoot {
            root: root.to_owned(),
            disks,
        });
    }
    Ok(format!("{ROOT_OPTION}={root}"))
}

/// The message the waiting init reads from its console: `<length>\n<script>`. The script is
/// the command and a newline, as the initrd workload file holds it.
pub fn workload_message(command: &str) -> Vec<u8> {
    let script = format!("{command}\n");
    let mut msg = format!("{}\n", script.len()).into_bytes();
    msg.extend_from_slice(script.as_bytes());
    msg
}

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error(
        "--kaslr boots the bundled guest's bzImage; for your own kernel pass a bzImage with --kernel \
         (KASLR is on unless its command line says nokaslr)"
    )]
    KaslrWithOwnKernel,
    #[error("cannot run the guest build script {script}: {source}")]
    Spawn {
        script: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("building the bundled guest failed ({status}); its messages are above")]
    BuildFailed { status: std::process::ExitStatus },
    #[error("no cache directory for the bundled guest: set HVPROBE_CACHE or HOME")]
    NoCache,
    #[error(transparent)]
    Inputs(#[from] inputs::InputsError),
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
    #[error(
        "--root {root}: not a disk of this guest; the disks are {}",
        disk_names(*disks)
    )]
    NoSuchRoot { root: String, disks: usize },
    #[error(transparent)]
    Disk(#[from] hvprobe_vmm::DiskError),
    #[error(transparent)]
    Share(#[from] crate::shares::ShareError),
    #[error(transparent)]
    Modules(#[from] modules::ModulesError),
    #[error("cannot read the kernel {path}: {source}")]
    Kernel {
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
    /// The vmlinux's DWARF (`objcopy --only-keep-debug`), for source-line probes.
    pub debuginfo: PathBuf,
    /// The test module (guest/modules), with its DWARF; the initramfs has it without.
    pub test_module: PathBuf,
    pub bzimage: PathBuf,
    pub system_map: PathBuf,
    pub initramfs: PathBuf,
    /// Command-line options this kernel wants beyond [`BASE_CMDLINE`].
    pub cmdline: String,
}

impl BundledGuest {
    /// Builds the bundled guest if its cache entry is missing (the build script prints its
    /// steps on stderr, and this the kernel build's progress: [`progress`]) and returns its
    /// files.
    pub fn ensure_built() -> Result<BundledGuest, GuestError> {
        let cache = cache_dir().ok_or(GuestError::NoCache)?;
        let script = inputs::ensure_written(&cache)?.join("build.sh");
        let child = Command::new("bash")
            .arg(&script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| GuestError::Spawn {
                script: script.clone(),
                source,
            })?;
        // The script's log, followed while it runs (the script itself stays as it is: its
        // hash is part of the cache key).
        let cache = progress::guest_cache_dir();
        let (stop, stopped) = std::sync::mpsc::channel();
        let follower = cache.clone().map(|cache| {
            std::thread::spawn(move || {
                progress::follow(&cache, &stopped, progress::PROGRESS_INTERVAL, &mut |line| {
                    eprintln!("{line}")
                })
            })
        });
        let out = child.wait_with_output();
        let _ = stop.send(());
        let followed = follower.and_then(|f| f.join().ok());
        let out = out.map_err(|source| GuestError::Spawn {
            script: script.clone(),
            source,
        })?;
        if !out.status.success() {
            return Err(GuestError::BuildFailed { status: out.status });
        }
        if let (Some(cache), Some(followed)) = (cache, followed) {
            progress::keep_total(&cache, &followed);
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
            debuginfo: file("vmlinux.debug")?,
            test_module: file("hvprobe_test.ko")?,
            bzimage: file("bzImage")?,
            system_map: file("System.map")?,
            initramfs: file("initramfs.cpio")?,
            cmdline,
        })
    }
}
