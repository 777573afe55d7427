//! The kernel's DWARF on the host, for spec lines with source targets (`vfs_read:12
//! count`, `MOD:FUNC:N`): the vmlinux and the file with its DWARF, modules' `.ko` files,
//! each loaded when a line first needs it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use hvprobe_introspection::dwarf::DebugInfo;
use hvprobe_introspection::memory::ElfImage;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::unwind::OrcTable;
use hvprobe_probes::spec::source::KernelSource;

/// The kernel's DWARF for spec lines with source targets (`vfs_read:12 count`), loaded when
/// a line first needs it: the vmlinux (its symbols name each site, its ORC table gives a
/// stack variable's frame) and the file with its DWARF (the vmlinux itself, or the bundled
/// guest's `vmlinux.debug`).
#[derive(Default)]
pub struct KernelSourceFiles {
    files: SourceFiles,
    loaded: OnceLock<Result<KernelSource, Arc<KernelSourceError>>>,
    /// Modules' `.ko` files with their DWARF (`--module-debuginfo`), for `MOD:` source
    /// targets; with the bundled guest, its test module's too.
    module_files: Vec<PathBuf>,
    modules: OnceLock<Vec<ModuleSource>>,
}

/// A module's `.ko`, by the name the kernel gives the module, its source read when a
/// line first needs it.
struct ModuleSource {
    name: String,
    path: PathBuf,
    loaded: OnceLock<Result<KernelSource, Arc<KernelSourceError>>>,
}

#[derive(Debug, Default)]
enum SourceFiles {
    #[default]
    None,
    /// The vmlinux and the file with its DWARF.
    Paths(PathBuf, PathBuf),
    /// The bundled guest's (a restored snapshot of it, by default).
    Bundled,
}

impl std::fmt::Debug for KernelSourceFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelSourceFiles").field("files", &self.files).finish()
    }
}

impl KernelSourceFiles {
    pub fn new(vmlinux: PathBuf, debuginfo: PathBuf) -> KernelSourceFiles {
        KernelSourceFiles {
            files: SourceFiles::Paths(vmlinux, debuginfo),
            ..KernelSourceFiles::default()
        }
    }

    /// The bundled guest's, found (or built) when a line first needs them.
    pub fn bundled() -> KernelSourceFiles {
        KernelSourceFiles {
            files: SourceFiles::Bundled,
            ..KernelSourceFiles::default()
        }
    }

    /// With these modules' `.ko` files (each with its DWARF), for `MOD:` source targets.
    /// The vmlinux, when the run has one (the bundled guest's is built if need be).
    pub fn vmlinux(&self) -> Option<PathBuf> {
        match &self.files {
            SourceFiles::Paths(vmlinux, _) => Some(vmlinux.clone()),
            SourceFiles::Bundled => crate::guest::BundledGuest::ensure_built().ok().map(|g| g.vmlinux),
            SourceFiles::None => None,
        }
    }

    pub fn with_modules(mut self, files: Vec<PathBuf>) -> KernelSourceFiles {
        self.module_files = files;
        self
    }

    /// The source of module `name`: its `.ko` among those given (or the bundled guest's
    /// test module), checked to be built for this kernel.
    pub fn get_module(&self, name: &str) -> Result<&KernelSource, Arc<KernelSourceError>> {
        let modules = self.modules.get_or_init(|| self.module_sources());
        let module = modules.iter().find(|m| m.name == name).ok_or_else(|| {
            Arc::new(KernelSourceError::NoModuleFile {
                module: name.to_owned(),
            })
        })?;
        module
            .loaded
            .get_or_init(|| self.load_module(&module.name, &module.path).map_err(Arc::new))
            .as_ref()
            .map_err(Arc::clone)
    }

    /// The given `.ko` files by their modules' names (a file whose name cannot be read
    /// goes by its file name, `-` as `_`, as the kernel names modules).
    fn module_sources(&self) -> Vec<ModuleSource> {
        let mut paths = self.module_files.clone();
        if let SourceFiles::Bundled = self.files {
            if let Ok(guest) = crate::guest::BundledGuest::ensure_built() {
                paths.push(guest.test_module);
            }
        }
        paths
            .into_iter()
            .map(|path| {
                let by_file = || {
                    let stem = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    stem.split(".ko").next().unwrap_or_default().replace('-', "_")
                };
                let name = std::fs::read(&path)
                    .ok()
                    .and_then(|bytes| crate::guest::modules::modinfo_name(&bytes))
                    .unwrap_or_else(by_file);
                ModuleSource {
                    name,
                    path,
                    loaded: OnceLock::new(),
                }
            })
            .collect()
    }

    fn load_module(&self, name: &str, path: &Path) -> Result<KernelSource, KernelSourceError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| KernelSourceError::ModuleFile {
            path: shown.clone(),
            source,
        })?;
        // A module of another build of the kernel has other code: its lines would be
        // somewhere else in the running module.
        let kernel = self.vmlinux();
        let release = kernel.and_then(|k| crate::guest::modules::kernel_release_of(&k).ok().flatten());
        if let Some(release) = release {
            if let Some(built_for) = crate::guest::modules::built_for_another(&bytes, &release) {
                return Err(KernelSourceError::ModuleForAnotherKernel {
                    path: shown,
                    built_for,
                    release,
                });
            }
        }
        let debug = DebugInfo::parse(&bytes, &shown)?;
        KernelSource::for_module(name, debug).map_err(|source| KernelSourceError::Module {
            path: shown,
            source: Box::new(source),
        })
    }

    /// None: source targets are refused with the reason.
    pub fn none() -> KernelSourceFiles {
        KernelSourceFiles::default()
    }

    pub fn get(&self) -> Result<&KernelSource, Arc<KernelSourceError>> {
        self.loaded
            .get_or_init(|| self.load().map_err(Arc::new))
            .as_ref()
            .map_err(Arc::clone)
    }

    fn load(&self) -> Result<KernelSource, KernelSourceError> {
        let (vmlinux, debuginfo) = match &self.files {
            SourceFiles::None => return Err(KernelSourceError::NoFiles),
            SourceFiles::Paths(v, d) => (v.clone(), d.clone()),
            SourceFiles::Bundled => {
                let guest = crate::guest::BundledGuest::ensure_built()?;
                (guest.vmlinux, guest.debuginfo)
            }
        };
        let debug = DebugInfo::open(&debuginfo)?;
        let symbols = SymbolTable::from_elf_file(&vmlinux).map_err(|source| KernelSourceError::Symbols {
            path: vmlinux.display().to_string(),
            source,
        })?;
        let orc = match ElfImage::open(&vmlinux) {
            Ok(image) => OrcTable::read(&image, &symbols)
                .map_err(|e| tracing::warn!("{}: its ORC table: {e}; stack variables are refused", vmlinux.display()))
                .ok(),
            Err(e) => {
                tracing::warn!("{}: {e}; stack variables are refused", vmlinux.display());
                None
            }
        };
        Ok(KernelSource::new(debug, symbols, orc))
    }
}

/// Why the kernel's DWARF for source targets is not there.
#[derive(Debug, thiserror::Error)]
pub enum KernelSourceError {
    #[error("source targets need the kernel's vmlinux with its DWARF (--vmlinux FILE)")]
    NoFiles,
    #[error(transparent)]
    Guest(#[from] crate::guest::GuestError),
    #[error(transparent)]
    Dwarf(#[from] hvprobe_introspection::dwarf::DwarfError),
    #[error("{path}: {source}")]
    Symbols {
        path: String,
        #[source]
        source: hvprobe_introspection::symbols::SymbolError,
    },
    #[error("source targets in module {module} need its .ko with DWARF (--module-debuginfo FILE.ko)")]
    NoModuleFile { module: String },
    #[error("{path}: {source}")]
    ModuleFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: built for kernel {built_for}, the kernel is {release} (give the module of this kernel)")]
    ModuleForAnotherKernel {
        path: String,
        built_for: String,
        release: String,
    },
    #[error("{path}: {source}")]
    Module {
        path: String,
        #[source]
        source: Box<hvprobe_probes::spec::source::SourceError>,
    },
}
