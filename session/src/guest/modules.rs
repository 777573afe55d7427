//! The kernel modules a guest kernel needs for hvprobe's devices, from that kernel's own
//! module tree (`/lib/modules/RELEASE`, or a build's `INSTALL_MOD_PATH/lib/modules/RELEASE`),
//! put in the initrd for the bundled init to load before it mounts anything — as
//! virtme-ng's and a distribution's initramfs do. The bundled kernel has every driver
//! built in and needs none; a distribution kernel has them as modules (Debian's virtio
//! drivers, fuse, virtiofs and overlay are).
//!
//! A driver the kernel has built in (`modules.builtin`) needs nothing; one it has
//! neither built in nor as a module is an error before the boot, naming it. Dependencies
//! come from `modules.dep` (depmod's) and are loaded first.
//!
//! In the initrd: `lib/modules/hvprobe/NN-FILE` and `lib/modules/hvprobe/load`, the file
//! names in load order (guest/README.md). Compressed modules (`.ko.xz`, `.ko.zst`,
//! `.ko.gz`) go as they are: the init asks the kernel to decompress them
//! (`MODULE_INIT_COMPRESSED_FILE`, which needs `CONFIG_MODULE_DECOMPRESS`).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use crate::cpio::CpioWriter;

/// Where the init looks (guest/README.md).
pub const MODULES_DIR: &str = "lib/modules/hvprobe";
/// The load order, one file name of [`MODULES_DIR`] per line.
pub const LOAD_LIST: &str = "lib/modules/hvprobe/load";

/// The largest `modules.dep`/`modules.builtin` read (Debian's full `modules.dep` is ~500 KB).
const INDEX_LIMIT: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ModulesError {
    #[error("--modules {dir}: not a kernel's module tree (no {file}): {source}")]
    NotATree {
        dir: PathBuf,
        file: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("--modules {dir}: {file} is larger than {INDEX_LIMIT} bytes")]
    IndexTooBig { dir: PathBuf, file: &'static str },
    #[error(
        "the kernel's module tree {dir} has no {module} (neither built in nor a module): \
         this kernel cannot serve {what}"
    )]
    Missing {
        dir: PathBuf,
        module: String,
        what: &'static str,
    },
    #[error("--modules {dir}: modules.dep names {module}, whose file {path} cannot be read: {source}")]
    Read {
        dir: PathBuf,
        module: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--modules {dir}: modules.dep has a dependency loop through {module}")]
    Loop { dir: PathBuf, module: String },
    #[error(
        "--modules {dir}: {module} is built for kernel {built_for}, the kernel is {kernel} \
         (give the module tree of this kernel)"
    )]
    WrongRelease {
        dir: PathBuf,
        module: String,
        built_for: String,
        kernel: String,
    },
}

/// What the devices of a run need of the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    pub disks: bool,
    pub shares: bool,
    /// `--rootfs`: an overlay over the share.
    pub shared_root: bool,
    /// `--root`: a disk's filesystem (ext4 is the one tried first).
    pub disk_root: bool,
}

impl Needs {
    /// The drivers, each with what needs it (for the error that names it).
    fn drivers(&self) -> Vec<(&'static str, &'static str)> {
        let mut drivers = Vec::new();
        if self.disks || self.shares {
            drivers.push(("virtio_mmio", "virtio-mmio devices (--disk, --rootfs, --rwdir)"));
        }
        if self.disks {
            drivers.push(("virtio_blk", "--disk"));
        }
        if self.shares {
            drivers.push(("virtiofs", "--rootfs or --rwdir"));
        }
        if self.shared_root {
            drivers.push(("overlay", "--rootfs (an overlay over the share)"));
        }
        drivers
    }

    /// Modules loaded when the kernel has them, not needed otherwise: ext4 for a disk (a
    /// root disk, or one the workload mounts; it may hold another filesystem).
    fn optional(&self) -> Vec<&'static str> {
        if self.disks || self.disk_root {
            vec!["ext4"]
        } else {
            Vec::new()
        }
    }
}

/// A kernel's module tree: which modules are built in, and each module's file and
/// dependencies.
#[derive(Debug)]
pub struct ModuleTree {
    dir: PathBuf,
    builtin: BTreeSet<String>,
    /// Module name → (path relative to the tree, dependencies' names).
    modules: HashMap<String, (String, Vec<String>)>,
    /// Module name → the modules `modules.softdep` says to load before it (ext4's
    /// crc32c): modprobe loads them, and the guest has no modprobe.
    soft_pre: HashMap<String, Vec<String>>,
}

/// A module's name from its path: `kernel/fs/fuse/virtiofs.ko.xz` → `virtiofs`, with `-`
/// as `_`, as the kernel names it.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

impl ModuleTree {
    pub fn open(dir: &Path) -> Result<ModuleTree, ModulesError> {
        let read = |file: &'static str| -> Result<String, ModulesError> {
            let path = dir.join(file);
            let meta = std::fs::metadata(&path).map_err(|source| ModulesError::NotATree {
                dir: dir.into(),
                file,
                source,
            })?;
            if meta.len() > INDEX_LIMIT {
                return Err(ModulesError::IndexTooBig { dir: dir.into(), file });
            }
            std::fs::read_to_string(&path).map_err(|source| ModulesError::NotATree {
                dir: dir.into(),
                file,
                source,
            })
        };
        let dep = read("modules.dep")?;
        let builtin = read("modules.builtin")?;
        // depmod writes it; an older or hand-made tree may not have one.
        let softdep = match read("modules.softdep") {
            Ok(text) => text,
            Err(ModulesError::NotATree { .. }) => String::new(),
            Err(e) => return Err(e),
        };
        Ok(ModuleTree::parse(dir, &dep, &builtin, &softdep))
    }

    fn parse(dir: &Path, dep: &str, builtin: &str, softdep: &str) -> ModuleTree {
        let builtin = builtin
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(module_name)
            .collect();
        let mut modules = HashMap::new();
        for line in dep.lines() {
            let Some((path, deps)) = line.split_once(':') else {
                continue;
            };
            let deps = deps.split_whitespace().map(module_name).collect();
            modules.insert(module_name(path.trim()), (path.trim().to_owned(), deps));
        }
        // `softdep MODULE pre: A B post: C`: the `pre:` ones.
        let mut soft_pre: HashMap<String, Vec<String>> = HashMap::new();
        for line in softdep.lines() {
            let mut words = line.split_whitespace();
            let (Some("softdep"), Some(module)) = (words.next(), words.next()) else {
                continue;
            };
            let mut pre = false;
            for word in words {
                match word {
                    "pre:" => pre = true,
                    "post:" => pre = false,
                    name if pre => soft_pre.entry(module_name(module)).or_default().push(module_name(name)),
                    _ => {}
                }
            }
        }
        ModuleTree {
            dir: dir.into(),
            builtin,
            modules,
            soft_pre,
        }
    }

    /// The modules to load for `needs`, dependencies first, each once: (name, path in the
    /// tree). Built-in drivers need nothing; a driver the kernel lacks is an error.
    pub fn resolve(&self, needs: Needs) -> Result<Vec<(String, PathBuf)>, ModulesError> {
        let mut order = Vec::new();
        let mut placed = BTreeSet::new();
        for (driver, what) in needs.drivers() {
            if self.builtin.contains(driver) {
                continue;
            }
            if !self.modules.contains_key(driver) {
                return Err(ModulesError::Missing {
                    dir: self.dir.clone(),
                    module: driver.to_owned(),
                    what,
                });
            }
            self.place(driver, &mut placed, &mut Vec::new(), &mut order)?;
        }
        for module in needs.optional() {
            if !self.builtin.contains(module) && self.modules.contains_key(module) {
                self.place(module, &mut placed, &mut Vec::new(), &mut order)?;
            }
        }
        Ok(order)
    }

    /// Places `name` after its dependencies (depth first); `path` is the chain being
    /// placed, for loops.
    fn place(
        &self,
        name: &str,
        placed: &mut BTreeSet<String>,
        path: &mut Vec<String>,
        order: &mut Vec<(String, PathBuf)>,
    ) -> Result<(), ModulesError> {
        if placed.contains(name) || self.builtin.contains(name) {
            return Ok(());
        }
        if path.iter().any(|p| p == name) {
            return Err(ModulesError::Loop {
                dir: self.dir.clone(),
                module: name.to_owned(),
            });
        }
        // A dependency modules.dep names but does not list: the kernel finds out.
        let Some((file, deps)) = self.modules.get(name) else {
            return Ok(());
        };
        path.push(name.to_owned());
        // Soft dependencies first, when the tree has them as modules.
        for dep in self.soft_pre.get(name).into_iter().flatten() {
            if self.modules.contains_key(dep) {
                self.place(dep, placed, path, order)?;
            }
        }
        for dep in deps {
            self.place(dep, placed, path, order)?;
        }
        path.pop();
        placed.insert(name.to_owned());
        order.push((name.to_owned(), PathBuf::from(file)));
        Ok(())
    }

    /// A cpio archive of the modules in `order` and their load list, for the initrd; each
    /// uncompressed module built for another release than `kernel` (its `vermagic`) is
    /// refused.
    pub fn archive(&self, order: &[(String, PathBuf)], kernel: Option<&str>) -> Result<Vec<u8>, ModulesError> {
        let mut archive = CpioWriter::new();
        for dir in ["lib", "lib/modules", MODULES_DIR] {
            archive.dir(dir);
        }
        let mut list = String::new();
        for (index, (name, file)) in order.iter().enumerate() {
            let path = self.dir.join(file);
            let bytes = std::fs::read(&path).map_err(|source| ModulesError::Read {
                dir: self.dir.clone(),
                module: name.clone(),
                path: path.clone(),
                source,
            })?;
            if let Some(kernel) = kernel {
                if let Some(built_for) = built_for_another(&bytes, kernel) {
                    return Err(ModulesError::WrongRelease {
                        dir: self.dir.clone(),
                        module: name.clone(),
                        built_for,
                        kernel: kernel.to_owned(),
                    });
                }
            }
            let base = file
                .file_name()
                .map_or_else(|| name.clone(), |f| f.to_string_lossy().into_owned());
            let entry = format!("{index:02}-{base}");
            archive.file(&format!("{MODULES_DIR}/{entry}"), 0o644, &bytes);
            list.push_str(&entry);
            list.push('\n');
        }
        archive.file(LOAD_LIST, 0o644, list.as_bytes());
        Ok(archive.finish())
    }
}

/// The release a kernel image names (`6.1.0-56-cloud-amd64`): a bzImage's setup header
/// points at its version string; an ELF vmlinux holds the banner `Linux version RELEASE `.
/// `None` when the image names none.
pub fn kernel_release(image: &[u8]) -> Option<String> {
    // bzImage: "HdrS" at 0x202, the version string's offset (from 0x200) at 0x20e.
    if image.get(0x202..0x206) == Some(b"HdrS") {
        let offset = u16::from_le_bytes(image.get(0x20e..0x210)?.try_into().ok()?) as usize;
        let text = image.get(offset.checked_add(0x200)?..)?;
        return release_word(text);
    }
    let at = image.windows(BANNER.len()).position(|w| w == BANNER)?;
    release_word(&image[at + BANNER.len()..])
}

const BANNER: &[u8] = b"Linux version ";

/// [`kernel_release`] of the image in `path`, read a piece at a time (a vmlinux with its
/// debug information can be hundreds of megabytes).
pub fn kernel_release_of(path: &Path) -> std::io::Result<Option<String>> {
    use std::io::Read;
    const CHUNK: usize = 4 << 20;
    // What a banner and its release need past a chunk's end.
    const OVERLAP: usize = 256;
    let mut file = std::fs::File::open(path)?;
    let mut window: Vec<u8> = Vec::with_capacity(CHUNK + OVERLAP);
    let mut first = true;
    loop {
        let kept = window.len();
        window.resize(kept + CHUNK, 0);
        let n = file.read(&mut window[kept..])?;
        window.truncate(kept + n);
        // The setup header and its version string are in a bzImage's first 64 KiB.
        if first && (window.get(0x202..0x206) == Some(b"HdrS") || n == 0) {
            return Ok(kernel_release(&window));
        }
        first = false;
        if let Some(at) = window.windows(BANNER.len()).position(|w| w == BANNER) {
            if window.len() - at >= BANNER.len() + 128 || n == 0 {
                return Ok(release_word(&window[at + BANNER.len()..]));
            }
        }
        if n == 0 {
            return Ok(None);
        }
        let keep_from = window.len().saturating_sub(OVERLAP);
        window.drain(..keep_from);
    }
}

/// The release a module was built for, when its `vermagic` names one other than the
/// kernel's `release` (a module of another build has other code).
pub(crate) fn built_for_another(module: &[u8], release: &str) -> Option<String> {
    vermagic_release(module).filter(|built_for| built_for != release)
}

/// The release in a module's `vermagic=RELEASE …` (its .modinfo), when it has one.
fn vermagic_release(module: &[u8]) -> Option<String> {
    const VERMAGIC: &[u8] = b"vermagic=";
    let at = module.windows(VERMAGIC.len()).position(|w| w == VERMAGIC)?;
    release_word(&module[at + VERMAGIC.len()..])
}

/// The module's own name, as the kernel will call it (`name=` in its .modinfo).
pub(crate) fn modinfo_name(module: &[u8]) -> Option<String> {
    const NAME: &[u8] = b"\0name=";
    let at = module.windows(NAME.len()).position(|w| w == NAME)?;
    release_word(&module[at + NAME.len()..])
}

fn release_word(text: &[u8]) -> Option<String> {
    let end = text.iter().take(128).position(|&b| b == b' ' || b == 0)?;
    let word = std::str::from_utf8(&text[..end]).ok()?;
    let fits = !word.is_empty() && word.bytes().all(|b| b.is_ascii_alphanumeric() || b"._+-~".contains(&b));
    fits.then(|| word.to_owned())
}

#[cfg(test)]
mod tests;
