//! The bundled default guest and how hvprobe talks to a guest's init: a small Linux kernel
//! and a busybox initramfs built from `guest/` by `guest/build.sh`, cached under
//! `~/.cache/hvprobe` keyed by their inputs; the kernel command line hvprobe boots with; the
//! workload, as a file in the initrd or (wait mode, for snapshots) as a console message.
//! `guest/README.md` is the guest side of this protocol.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cache::inputs;
use crate::cpio::{append_archive, CpioWriter};

/// hvprobe's cache (where it was before it had a module of its own).
pub use crate::cache::cache_dir;

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

/// An initrd: `files`' with the archive of kernel modules its devices need appended (see
/// [`modules`]), and, when there is a workload, an archive that holds it as a shell
/// script for the bundled init to run.
pub fn initrd_with_workload(files: &MachineFiles, workload: Option<&str>) -> Result<Vec<u8>, GuestError> {
    let base = &files.initrd;
    let mut initrd = std::fs::read(base).map_err(|source| GuestError::Read {
        path: base.clone(),
        source,
    })?;
    if let Some(archive) = &files.modules {
        append_archive(&mut initrd, archive);
    }
    if let Some(command) = workload {
        let mut archive = CpioWriter::new();
        archive.dir("hvprobe");
        let script = format!("{command}\n");
        archive.file(WORKLOAD_PATH, 0o755, script.as_bytes());
        append_archive(&mut initrd, &archive.finish());
    }
    Ok(initrd)
}

/// The archive of the modules `kernel` needs for `needs`, from `tree` or, by default,
/// `/lib/modules/RELEASE` of the release the image names; `None` when nothing is needed or
/// there is no tree to take them from (said: the drivers must then be built in).
fn modules_for(kernel: &Path, tree: Option<&Path>, needs: modules::Needs) -> Result<Option<Vec<u8>>, GuestError> {
    if needs == modules::Needs::default() {
        return Ok(None);
    }
    let release = modules::kernel_release_of(kernel).map_err(|source| GuestError::Kernel {
        path: kernel.into(),
        source,
    })?;
    let dir = match tree {
        Some(dir) => dir.to_path_buf(),
        None => match release
            .as_ref()
            .map(|r| Path::new("/lib/modules").join(r))
            .filter(|d| d.is_dir())
        {
            Some(dir) => dir,
            None => {
                tracing::warn!(
                    "no module tree for --kernel {} (give --modules DIR): its drivers for the devices must be built in",
                    kernel.display()
                );
                return Ok(None);
            }
        },
    };
    let tree = modules::ModuleTree::open(&dir)?;
    let order = tree.resolve(needs)?;
    if order.is_empty() {
        return Ok(None);
    }
    let names: Vec<&str> = order.iter().map(|(name, _)| name.as_str()).collect();
    tracing::info!("modules for the devices, from {}: {}", dir.display(), names.join(" "));
    Ok(Some(tree.archive(&order, release.as_deref())?))
}

/// The files a machine boots from: the user's `--kernel`/`--initrd`, or the bundled
/// guest's for those not given (built first if its cache entry is missing).
pub struct MachineFiles {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// The kernel command line: the VMM's options, the bundled kernel's own when it boots,
    /// the user's `--cmdline`, then the devices' options for the bundled init.
    pub cmdline: String,
    /// The shared directories (`--rootfs`, `--rwdir`), checked.
    pub shares: Vec<crate::shares::Share>,
    /// The virtiofsd that serves them and its sandbox, when there are any.
    pub virtiofsd: Option<(PathBuf, crate::shares::Sandbox)>,
    /// The archive of the kernel modules the devices need, for the initrd.
    pub modules: Option<Vec<u8>>,
    bundled: Option<BundledGuest>,
    bundled_boots: bool,
}

impl MachineFiles {
    /// The files of `machine`; `bzimage` boots the bundled guest's bzImage (KASLR) rather
    /// than its vmlinux.
    pub fn of(machine: &crate::cli::MachineArgs, bzimage: bool) -> Result<MachineFiles, GuestError> {
        if bzimage && machine.kernel.is_some() {
            return Err(GuestError::KaslrWithOwnKernel);
        }
        // The devices first: a missing or busy image fails before a guest build.
        let root = machine
            .root
            .as_deref()
            .map(|root| root_option(root, machine.disks.len()))
            .transpose()?;
        drop(hvprobe_vmm::virtio::block::DiskImage::open_all(&machine.disks)?);
        let shares = crate::shares::shares(machine.rootfs.as_deref(), &machine.rootfs_hide, &machine.rwdirs)?;
        let devices = machine.disks.len() + shares.len();
        if devices > hvprobe_vmm::virtio::MAX_DEVICES {
            return Err(crate::shares::ShareError::TooManyDevices {
                count: devices,
                max: hvprobe_vmm::virtio::MAX_DEVICES,
            }
            .into());
        }
        // virtiofsd found (or built) and tried before the guest build, as the disks are.
        let virtiofsd = match shares.is_empty() {
            true => None,
            false => {
                let (path, from) = crate::shares::find_virtiofsd(machine.virtiofsd.as_deref())?;
                let refused = crate::shares::check_virtiofsd(&path, from)?;
                let sandbox = crate::shares::choose_sandbox(machine.share_sandbox, refused, &shares)?;
                for share in &shares {
                    crate::shares::check_hidden(share)?;
                }
                Some((path, sandbox))
            }
        };
        let bundled = match (&machine.kernel, &machine.initrd) {
            (Some(_), Some(_)) => None,
            _ => Some(BundledGuest::ensure_built()?),
        };
        let bundled_kernel = bundled.as_ref().filter(|_| machine.kernel.is_none());
        let kernel = match (&machine.kernel, bundled_kernel) {
            (Some(k), _) => k.clone(),
            (None, Some(g)) if bzimage => g.bzimage.clone(),
            (None, Some(g)) => g.vmlinux.clone(),
            (None, None) => unreachable!("the bundled guest is built when no kernel is given"),
        };
        let initrd = match (&machine.initrd, &bundled) {
            (Some(i), _) => i.clone(),
            (None, Some(g)) => g.initramfs.clone(),
            (None, None) => unreachable!("the bundled guest is built when no initrd is given"),
        };
        let mut cmdline = kernel_cmdline(bundled_kernel, &machine.cmdline);
        if let Some(root) = root {
            cmdline = format!("{cmdline} {root}");
        }
        for share in &shares {
            cmdline = format!("{cmdline} {}", share.cmdline_option());
        }
        let bundled_boots = bundled_kernel.is_some();
        let needs = modules::Needs {
            disks: !machine.disks.is_empty(),
            shares: !shares.is_empty(),
            shared_root: machine.rootfs.is_some(),
            disk_root: machine.root.is_some(),
        };
        let modules = match bundled_boots {
            // Its drivers are built in.
            true => None,
            false => modules_for(&kernel, machine.modules.as_deref(), needs)?,
        };
        Ok(MachineFiles {
            kernel,
            initrd,
            cmdline,
            shares,
            virtiofsd,
            modules,
            bundled,
            bundled_boots,
        })
    }

    /// The bundled guest, when its kernel is the one that boots (its symbol files then
    /// describe the running kernel).
    pub fn bundled_kernel(&self) -> Option<&BundledGuest> {
        self.bundled.as_ref().filter(|_| self.bundled_boots)
    }
}
