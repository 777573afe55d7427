//! The machine a command boots (`run`, `snapshot create`, the benchmarks): what it is asked
//! ([`Machine`]: kernel, initrd, vCPUs, memory, disks, shared directories), and the files it
//! boots from ([`MachineFiles`]: the user's or the bundled guest's, the kernel command line,
//! the shares checked and their virtiofsd, the modules its devices need; the initrd with the
//! workload).

use std::path::{Path, PathBuf};

use hvprobe_vmm::DiskConfig;

use crate::cpio::{append_archive, CpioWriter};
use crate::guest::{kernel_cmdline, modules, root_option, BundledGuest, GuestError, WORKLOAD_PATH};
use crate::shares::{self, RootfsHide, RwDir, Sandbox};

/// The guest machine a command boots: `run` and `snapshot create` share these (and the
/// devices a guest gets go here too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// Kernel to boot: an ELF vmlinux with a PVH note, or a bzImage; the bundled guest's
    /// vmlinux when `None`.
    pub kernel: Option<PathBuf>,
    /// Initrd (a cpio archive); the bundled guest's initramfs when `None`.
    pub initrd: Option<PathBuf>,
    /// Extra kernel command-line options, appended to the ones hvprobe sets.
    pub cmdline: String,
    /// Number of vCPUs, 1 to 32.
    pub cpus: u8,
    /// Guest memory in MiB.
    pub mem: u64,
    /// Raw disk images, as virtio-blk disks (/dev/vda, /dev/vdb, … in order).
    pub disks: Vec<DiskConfig>,
    /// The disk whose filesystem is the workload's `/` (`--root /dev/vdX`).
    pub root: Option<String>,
    /// A host directory shared read-only as the workload's `/` (`--rootfs`).
    pub rootfs: Option<PathBuf>,
    /// Host directories the guest reads and writes (`--rwdir`).
    pub rwdirs: Vec<RwDir>,
    /// The kernel's module tree, for the drivers the devices need (`--modules`).
    pub modules: Option<PathBuf>,
    /// The virtiofsd that serves the shares (`--virtiofsd`); found when `None`.
    pub virtiofsd: Option<PathBuf>,
    /// What of `rootfs` the guest does not see (`--rootfs-hide`).
    pub rootfs_hide: Vec<RootfsHide>,
    /// How virtiofsd is isolated (`--share-sandbox`); the namespace sandbox when `None`.
    pub share_sandbox: Option<Sandbox>,
}

impl Machine {
    pub const DEFAULT_MEM_MIB: u64 = 128;

    /// The bundled guest with `cpus` vCPUs and the default memory: the benchmarks' machine.
    pub fn bundled_guest(cpus: u8) -> Machine {
        Machine {
            kernel: None,
            initrd: None,
            cmdline: String::new(),
            cpus,
            mem: Machine::DEFAULT_MEM_MIB,
            disks: Vec::new(),
            root: None,
            rootfs: None,
            rwdirs: Vec::new(),
            modules: None,
            virtiofsd: None,
            rootfs_hide: Vec::new(),
            share_sandbox: None,
        }
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
    pub shares: Vec<shares::Share>,
    /// The virtiofsd that serves them and its sandbox, when there are any.
    pub virtiofsd: Option<(PathBuf, shares::Sandbox)>,
    /// The archive of the kernel modules the devices need, for the initrd.
    pub modules: Option<Vec<u8>>,
    bundled: Option<BundledGuest>,
    bundled_boots: bool,
}

impl MachineFiles {
    /// The files of `machine`; `bzimage` boots the bundled guest's bzImage (KASLR) rather
    /// than its vmlinux.
    pub fn of(machine: &Machine, bzimage: bool) -> Result<MachineFiles, GuestError> {
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
        let shares = shares::shares(machine.rootfs.as_deref(), &machine.rootfs_hide, &machine.rwdirs)?;
        let devices = machine.disks.len() + shares.len();
        if devices > hvprobe_vmm::virtio::MAX_DEVICES {
            return Err(shares::ShareError::TooManyDevices {
                count: devices,
                max: hvprobe_vmm::virtio::MAX_DEVICES,
            }
            .into());
        }
        // virtiofsd found (or built) and tried before the guest build, as the disks are.
        let virtiofsd = match shares.is_empty() {
            true => None,
            false => {
                let (path, from) = shares::find_virtiofsd(machine.virtiofsd.as_deref())?;
                let refused = shares::check_virtiofsd(&path, from)?;
                let sandbox = shares::choose_sandbox(machine.share_sandbox, refused, &shares)?;
                for share in &shares {
                    shares::check_hidden(share)?;
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
