//! Where a run's kernel symbols and source lines come from: the flags as given (`--symbols`,
//! `--system-map`, `--vmlinux`, `--module-debuginfo`, `--resolve`), checked before anything
//! boots or is restored, and what they choose for a boot (the files of the kernel that
//! boots, the bundled guest's by default) and for a restore (the restored kernel's own
//! kallsyms by default, which no file has to match).

use std::path::{Path, PathBuf};

use hvprobe_introspection::symbols::{SymbolError, SymbolSource, SymbolTable};
use hvprobe_live::SymbolsFrom;
use hvprobe_vmm::{kernel_format, KernelFormat};

use crate::guest::{BundledGuest, GuestError};
use crate::kernel_source::KernelSourceFiles;
use crate::options::SymbolRequest;

/// A source of kernel symbols as `--symbols` names it (the file is the run's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    SystemMap,
    Vmlinux,
    Kallsyms,
}

/// The flags that say where a run's kernel symbols and DWARF come from, as given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SymbolFlags {
    /// The sources, in the order asked for (`--symbols`); none: the run's default.
    pub sources: Vec<SourceKind>,
    /// The kernel's System.map (`--system-map`).
    pub system_map: Option<PathBuf>,
    /// The kernel's vmlinux ELF (`--vmlinux`), for symbols and with its DWARF for source lines.
    pub vmlinux: Option<PathBuf>,
    /// Modules' `.ko` files with their DWARF (`--module-debuginfo`).
    pub module_debuginfo: Vec<PathBuf>,
    /// `SYM[+OFFSET]` to print the address of once the kernel is up (`--resolve`).
    pub resolve: Vec<String>,
}

/// Why the symbol flags cannot be followed.
#[derive(Debug, thiserror::Error)]
pub enum SymbolFlagsError {
    #[error(transparent)]
    Resolve(#[from] SymbolError),
    #[error("cannot read {}: {source}", path.display())]
    Unreadable { path: PathBuf, source: std::io::Error },
    #[error("--symbols system-map needs --system-map FILE")]
    NoSystemMap,
    #[error("--symbols vmlinux needs --vmlinux FILE")]
    NoVmlinux,
    #[error(transparent)]
    Kernel(#[from] hvprobe_vmm::Error),
    #[error(transparent)]
    Guest(#[from] GuestError),
}

impl SymbolFlags {
    /// Rejects, before anything boots or is restored, a malformed `--resolve SYM[+OFFSET]`
    /// and a `--system-map` or `--vmlinux` that cannot be read.
    pub fn check(&self) -> Result<(), SymbolFlagsError> {
        for spec in &self.resolve {
            match SymbolTable::from_symbols(SymbolSource::SystemMap, Vec::new()).resolve(spec) {
                Err(SymbolError::UnknownSymbol(_)) | Ok(_) => {}
                Err(e) => return Err(e.into()),
            }
        }
        for path in [&self.system_map, &self.vmlinux].into_iter().flatten() {
            std::fs::metadata(path).map_err(|source| SymbolFlagsError::Unreadable {
                path: path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// The run's vmlinux ELF, if it has one: `--vmlinux`, the bundled guest's, or `kernel`
    /// (`--kernel`) when that is an ELF.
    pub fn vmlinux(
        &self,
        kernel: Option<&Path>,
        bundled: Option<&BundledGuest>,
    ) -> Result<Option<PathBuf>, SymbolFlagsError> {
        let kernel_is_elf = kernel.map(kernel_format).transpose()? == Some(KernelFormat::ElfPvh);
        Ok(self
            .vmlinux
            .clone()
            .or_else(|| bundled.map(|g| g.vmlinux.clone()))
            .or_else(|| kernel.map(Path::to_path_buf).filter(|_| kernel_is_elf)))
    }

    /// The symbol sources of a run, in the order asked for (or the default: System.map if
    /// there is one, else the vmlinux, else the guest's kallsyms); the files named on the
    /// command line were checked by [`SymbolFlags::check`].
    pub fn sources(
        &self,
        kernel: Option<&Path>,
        bundled: Option<&BundledGuest>,
    ) -> Result<Vec<SymbolsFrom>, SymbolFlagsError> {
        let system_map = self
            .system_map
            .clone()
            .or_else(|| bundled.map(|g| g.system_map.clone()));
        let vmlinux = self.vmlinux(kernel, bundled)?;
        let asked = if self.sources.is_empty() {
            vec![if system_map.is_some() {
                SourceKind::SystemMap
            } else if vmlinux.is_some() {
                SourceKind::Vmlinux
            } else {
                SourceKind::Kallsyms
            }]
        } else {
            self.sources.clone()
        };
        asked
            .into_iter()
            .map(|a| match a {
                SourceKind::SystemMap => system_map
                    .clone()
                    .map(SymbolsFrom::SystemMap)
                    .ok_or(SymbolFlagsError::NoSystemMap),
                SourceKind::Vmlinux => vmlinux
                    .clone()
                    .map(SymbolsFrom::Vmlinux)
                    .ok_or(SymbolFlagsError::NoVmlinux),
                SourceKind::Kallsyms => Ok(SymbolsFrom::Kallsyms),
            })
            .collect()
    }

    /// A boot's symbols: [`SymbolFlags::sources`] of the kernel that boots (`kernel`, or the
    /// bundled guest's), and the `--resolve` list.
    pub fn for_boot(
        &self,
        kernel: Option<&Path>,
        bundled: Option<&BundledGuest>,
    ) -> Result<SymbolRequest, SymbolFlagsError> {
        Ok(SymbolRequest {
            sources: self.sources(kernel, bundled)?,
            resolve: self.resolve.clone(),
        })
    }

    /// A boot's DWARF for source targets, given its `vmlinux`: a `--vmlinux`'s own, else the
    /// bundled guest's file beside its vmlinux (the bundled guest's files are known by name:
    /// its test module's `.ko` too), with the `--module-debuginfo` files.
    pub fn boot_source_files(&self, vmlinux: &Path, bundled_kernel: Option<&BundledGuest>) -> KernelSourceFiles {
        let debuginfo = match (&self.vmlinux, bundled_kernel) {
            (None, Some(g)) => g.debuginfo.clone(),
            _ => vmlinux.to_path_buf(),
        };
        let files = match bundled_kernel {
            Some(_) if self.vmlinux.is_none() => KernelSourceFiles::bundled(),
            _ => KernelSourceFiles::new(vmlinux.to_path_buf(), debuginfo),
        };
        files.with_modules(self.module_debuginfo.clone())
    }

    /// A restore's symbols: the restored kernel's kallsyms, unless `--symbols` names other
    /// sources or `--system-map` gives a map (as on a boot, a map given is the default then).
    /// A file-based source without its file is the bundled guest's, as most snapshots are;
    /// the restore refuses a file whose `linux_banner` is not the restored kernel's.
    /// (`kernel` is `--kernel`, which `hvprobe run` refuses with a snapshot.)
    pub fn for_restore(&self, kernel: Option<&Path>) -> Result<SymbolRequest, SymbolFlagsError> {
        self.check()?;
        let sources = match (&self.system_map, self.sources.is_empty()) {
            (Some(map), true) => vec![SymbolsFrom::SystemMap(map.clone())],
            (None, true) => SymbolRequest::default().sources,
            (_, false) => {
                let wants_bundled = self.sources.iter().any(|s| match s {
                    SourceKind::SystemMap => self.system_map.is_none(),
                    SourceKind::Vmlinux => self.vmlinux.is_none(),
                    SourceKind::Kallsyms => false,
                });
                let bundled = wants_bundled.then(BundledGuest::ensure_built).transpose()?;
                self.sources(kernel, bundled.as_ref())?
            }
        };
        Ok(SymbolRequest {
            sources,
            resolve: self.resolve.clone(),
        })
    }

    /// A restore's DWARF for source targets: `--vmlinux`'s, or the bundled guest's (what
    /// `snapshot create` saves by default), with the `--module-debuginfo` files.
    pub fn restore_source_files(&self) -> KernelSourceFiles {
        match &self.vmlinux {
            Some(v) => KernelSourceFiles::new(v.clone(), v.clone()),
            None => KernelSourceFiles::bundled(),
        }
        .with_modules(self.module_debuginfo.clone())
    }
}
