//! A run (`hvprobe run`): a guest booted, or restored from a snapshot, traced from its
//! kernel's start (or the restore) to its end; what the run found is handed back
//! ([`Booted`], [`Restored`]) for the caller to report and turn into an exit status.
//!
//! A boot goes in steps, each a function here, ordered so that bad input fails before
//! anything is built or started: [`check_before_build`] (what needs no guest), the
//! machine's files ([`MachineFiles::of`], which may build the bundled guest), the kernel's
//! symbols and DWARF ([`choose_kernel_files`]), the probe file against them
//! ([`check_probes_before_boot`]), then the shares' daemons ([`start_daemons`], last before
//! the VM: everything that can be refused has been), the VM ([`create_vm`],
//! [`watch_daemons`]), and the run itself ([`run_booted`]: the session, the kernel's
//! introspection once it is up, the sampler, the guest to its end, the session's end).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use hvprobe_introspection::symbols::{SymbolError, SymbolTable};
use hvprobe_live::{KernelSymbols, SymbolsFrom};
use hvprobe_vmm::{ConsoleLog, ConsoleOutput, Vm, VmConfig, VmOutcome};
use vm_memory::GuestMemoryMmap;

use crate::control::ControlError;
use crate::error::SessionError;
use crate::guest::GuestError;
use crate::guest_kernel::{introspect_when_up, IntrospectionFailure};
use crate::machine::{initrd_with_workload, Machine, MachineFiles};
use crate::options::{ControlSocket, TraceOptions};
use crate::sampler::{Sample, Sampler};
use crate::session::{RunSession, RunSessionError};
use crate::shares::{self, DaemonDied, Daemons, ShareError};
use crate::snapshot::{restore_and_run, Restored, SnapshotError};
use crate::symbol_sources::{SymbolFlags, SymbolFlagsError};
use crate::where_stopped::HvprobeCode;

/// What a run is asked: the machine (or a snapshot), the workload, the console, where the
/// kernel's symbols come from, and what to trace.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub machine: Machine,
    /// The shell command the guest runs instead of an interactive shell (`--workload`).
    pub workload: Option<String>,
    /// Boot the bundled guest's bzImage with KASLR on (`--kaslr`).
    pub kaslr: bool,
    pub symbols: SymbolFlags,
    /// The probes, their outputs, the control socket. Its `kernel_source` and `symbols` are
    /// the run's to choose, from `symbols` and the kernel that boots or is restored.
    pub trace: TraceOptions,
    /// Feed stdin to the guest's console also with a workload (`--console-input`).
    pub console_input: bool,
    /// Print nothing of the guest's console (`--no-console`).
    pub no_console: bool,
    /// Restore the guest from this snapshot instead of booting (`--snapshot`).
    pub snapshot: Option<PathBuf>,
}

/// How a run ended: a booted guest's or a restored one's account.
pub enum Ended {
    Booted(Booted),
    Restored(Restored),
}

/// Why a run could not be made or run to its end.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Vm(#[from] hvprobe_vmm::Error),
    #[error("cannot read initrd {}: {source}", path.display())]
    Initrd { path: PathBuf, source: std::io::Error },
    #[error("--module-debuginfo {}: {source}", path.display())]
    ModuleDebuginfo { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    SymbolFlags(#[from] SymbolFlagsError),
    #[error(transparent)]
    SymbolFile(#[from] SymbolError),
    #[error(transparent)]
    Guest(#[from] GuestError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error(transparent)]
    DaemonDied(#[from] DaemonDied),
    #[error(transparent)]
    RunSession(#[from] RunSessionError),
    #[error("the introspection thread panicked")]
    IntrospectionPanicked,
}

/// What a booted guest's run found, for its report.
pub struct Booted {
    pub outcome: VmOutcome,
    /// The kernels introspected, the first one's symbols the probes'; or why none was.
    pub kernels: Result<Vec<KernelSymbols>, IntrospectionFailure>,
    /// What of hvprobe's code in the guest the vCPUs stopped in, named before the probes went.
    pub hvprobe_code: HvprobeCode,
    /// Why the session's end (the probes' removal, the text hash) failed, if it did.
    pub finish_failed: Option<RunSessionError>,
    /// Why arming the probes at `/init` failed, if it did.
    pub arming_failed: Option<Arc<SessionError>>,
    /// With `--sample-ms`, the samples taken.
    pub samples: Option<Vec<Sample>>,
    /// The guest's memory, where its vCPUs stopped.
    pub memory: GuestMemoryMmap,
    pub console: ConsoleLog,
    /// The session and the shares' daemons last until the report is made, as they did when
    /// the command made it: the session first, then the daemons are stopped.
    _session: Arc<RunSession>,
    daemons: Option<Daemons>,
}

impl Booted {
    /// The symbols the probes were placed with (the first source's), if the kernel was read.
    pub fn symbols(&self) -> Option<&SymbolTable> {
        self.kernels.as_ref().ok().and_then(|k| k.first()).map(|k| &k.table)
    }

    /// Where each vCPU was when the run stopped ([`crate::where_stopped::report`]).
    pub fn where_stopped(&self) -> String {
        crate::where_stopped::report(
            &self.outcome.vcpus_at_stop,
            &self.memory,
            self.symbols(),
            &self.hvprobe_code,
        )
    }

    /// The first shares' daemon that died on its own, if one did: the run failed then.
    pub fn daemon_died(&self) -> Option<DaemonDied> {
        self.daemons.as_ref().and_then(Daemons::death)
    }
}

/// Runs the guest `options` asks for: restored from its snapshot, or booted.
pub fn run(mut options: RunOptions) -> Result<Ended, RunError> {
    // A --control PATH that is not ours to bind fails now, not after a guest build and a boot.
    if let ControlSocket::At(path) = &options.trace.control {
        crate::control::check_socket_path(path)?;
    }
    match options.snapshot.take() {
        Some(dir) => restore(&dir, options).map(Ended::Restored),
        None => boot(options).map(Ended::Booted),
    }
}

/// Restores the snapshot in `dir` and runs `options`' workload in it ([`restore_and_run`]),
/// with the restored kernel's symbols and DWARF.
pub fn restore(dir: &Path, mut options: RunOptions) -> Result<Restored, RunError> {
    // Source targets read the restored kernel's DWARF: --vmlinux's, or the bundled
    // guest's (what `snapshot create` saves by default).
    options.trace.kernel_source = Arc::new(options.symbols.restore_source_files());
    let workload = options.workload.as_deref().ok_or(SnapshotError::NoWorkload)?;
    options.trace.symbols = options.symbols.for_restore(options.machine.kernel.as_deref())?;
    Ok(restore_and_run(
        dir,
        options.machine.cpus,
        &options.machine.disks,
        workload,
        console_output(true, options.console_input, options.no_console),
        options.console_input,
        &options.trace,
    )?)
}

/// Boots the machine `options` asks for and runs it to its end, step by step (the module's
/// account).
pub fn boot(mut options: RunOptions) -> Result<Booted, RunError> {
    check_before_build(&options)?;
    let files = MachineFiles::of(&options.machine, options.kaslr)?;
    let vmlinux = choose_kernel_files(&mut options, &files)?;
    check_probes_before_boot(&options, vmlinux.as_deref())?;
    let daemons = start_daemons(&files)?;
    let config = vm_config(&options, &files, daemons.as_ref())?;
    let vm = create_vm(&config, daemons.as_ref())?;
    if let Some(daemons) = &daemons {
        watch_daemons(daemons, &vm);
    }
    let booted = run_booted(vm, &options.trace)?;
    Ok(Booted { daemons, ..booted })
}

/// Checks what needs no guest build first, so bad input fails fast: the machine's size, a
/// `--kernel`'s format, that a `--initrd` can be read, the symbol flags and the modules'
/// `.ko` files.
pub fn check_before_build(options: &RunOptions) -> Result<(), RunError> {
    let machine = &options.machine;
    VmConfig::validate_machine(machine.cpus, machine.mem)?;
    if let Some(kernel) = &machine.kernel {
        hvprobe_vmm::kernel_format(kernel)?;
    }
    if let Some(initrd) = &machine.initrd {
        std::fs::metadata(initrd).map_err(|source| RunError::Initrd {
            path: initrd.clone(),
            source,
        })?;
    }
    options.symbols.check()?;
    for file in &options.symbols.module_debuginfo {
        std::fs::metadata(file).map_err(|source| RunError::ModuleDebuginfo {
            path: file.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Chooses, for the kernel that boots (`files`), where the run's symbols come from and the
/// DWARF of its source targets (into `options.trace`); returns its vmlinux, if it has one.
pub fn choose_kernel_files(options: &mut RunOptions, files: &MachineFiles) -> Result<Option<PathBuf>, RunError> {
    let (kernel, bundled_kernel) = (options.machine.kernel.as_deref(), files.bundled_kernel());
    options.trace.symbols = options.symbols.for_boot(kernel, bundled_kernel)?;
    let vmlinux = options.symbols.vmlinux(kernel, bundled_kernel)?;
    if let Some(vmlinux) = &vmlinux {
        options.trace.kernel_source = Arc::new(options.symbols.boot_source_files(vmlinux, bundled_kernel));
    }
    Ok(vmlinux)
}

/// Checks the probe file before anything boots, so that a typo costs no boot: its syntax,
/// and when a symbol file (System.map or vmlinux) says what the kernel's symbols are, every
/// symbol and wildcard against them. Symbol names and offsets within their functions do
/// not depend on KASLR; what needs the running kernel (instruction boundaries, the
/// blacklist, patch sites, raw addresses) is checked once it is up. Filters and triggers
/// without a probe file are refused.
pub fn check_probes_before_boot(options: &RunOptions, vmlinux: Option<&Path>) -> Result<(), RunError> {
    let trace = &options.trace;
    let Some(file) = &trace.probes else {
        return match trace.analysis.is_empty() {
            true => Ok(()),
            false => Err(SessionError::AnalysisWithoutProbes.into()),
        };
    };
    let table = trace
        .symbols
        .sources
        .iter()
        .find_map(|from| match from {
            SymbolsFrom::SystemMap(path) => Some(SymbolTable::from_system_map_file(path)),
            SymbolsFrom::Vmlinux(path) => Some(SymbolTable::from_elf_file(path)),
            SymbolsFrom::Kallsyms => None,
        })
        .transpose()?;
    crate::trace::check_before_boot(
        file,
        usize::from(options.machine.cpus),
        table.as_ref(),
        vmlinux,
        &trace.kernel_source,
        &trace.analysis,
    )?;
    Ok(())
}

/// Starts a virtiofsd for each of the machine's shares, if it has any.
pub fn start_daemons(files: &MachineFiles) -> Result<Option<Daemons>, RunError> {
    Ok(match &files.virtiofsd {
        Some((virtiofsd, sandbox)) => Some(Daemons::start(
            virtiofsd,
            sandbox,
            &files.shares,
            &shares::runtime_dir(),
            shares::SOCKET_DEADLINE,
        )?),
        None => None,
    })
}

/// The VM's configuration: the machine's files, the initrd with the workload, the console,
/// the disks and the daemons' shares.
pub fn vm_config(options: &RunOptions, files: &MachineFiles, daemons: Option<&Daemons>) -> Result<VmConfig, RunError> {
    let workload = options.workload.as_deref();
    Ok(VmConfig {
        kernel: files.kernel.clone(),
        initrd: initrd_with_workload(files, workload)?,
        cmdline: files.cmdline.clone(),
        cpus: options.machine.cpus,
        mem_mib: options.machine.mem,
        console_output: console_output(workload.is_some(), options.console_input, options.no_console),
        console_input: workload.is_none() || options.console_input,
        disks: options.machine.disks.clone(),
        shares: daemons.map(Daemons::fs_configs).unwrap_or_default(),
    })
}

/// Creates the VM of `config`. When a shared directory fails it, a daemon that died says
/// more than the socket it closed. (Only then: a VM that failed for another reason closed
/// its sockets, and its daemons left on their own.)
pub fn create_vm(config: &VmConfig, daemons: Option<&Daemons>) -> Result<Vm, RunError> {
    match Vm::new(config) {
        Ok(vm) => Ok(vm),
        Err(e @ hvprobe_vmm::Error::SharedDirectory(_)) => match daemons.and_then(Daemons::death) {
            Some(died) => Err(died.into()),
            None => Err(e.into()),
        },
        Err(e) => Err(e.into()),
    }
}

/// Says so when a daemon dies while `vm` runs: its device answers the guest's requests
/// with EIO from then on (the guest's file operations on the share fail, its workload goes
/// on), and the run fails ([`Booted::daemon_died`]).
pub fn watch_daemons(daemons: &Daemons, vm: &Vm) {
    let control = vm.control();
    daemons.on_death(Box::new(move |died| {
        // A daemon that goes when the VM ends (its device closed the socket) did not die.
        if control.stop_reason().is_some() {
            return false;
        }
        eprintln!(
            "hvprobe: virtiofsd for {} {}: the guest's requests to its share fail with EIO from now on",
            died.share, died.status
        );
        true
    }));
}

/// Runs the booted `vm` to its end, traced as `trace` says: starts the run's session, the
/// thread that introspects the kernel once it is up ([`introspect_when_up`]) and the
/// sampler; then, the guest gone, names where its vCPUs stopped in hvprobe's code and ends
/// the session (every probe removed, the listing and the counters printed). The account has
/// no daemons: [`boot`] hands it those it started.
pub fn run_booted(vm: Vm, trace: &TraceOptions) -> Result<Booted, RunError> {
    let console = vm.console_log();
    let session = RunSession::start(trace, &vm)?;
    let tasks = Arc::new(OnceLock::new());
    let introspection = {
        let (control, mem, tasks, session) = (
            vm.control(),
            vm.memory().clone(),
            Arc::clone(&tasks),
            Arc::clone(&session),
        );
        let request = trace.symbols.clone();
        std::thread::spawn(move || introspect_when_up(&control, &mem, &request, &session, &tasks))
    };
    let sampler = trace
        .sample_every
        .map(|every| Sampler::start(vm.control(), vm.memory().clone(), every, tasks));
    let memory = vm.memory().clone();
    let outcome = vm.run(session.handler())?;
    let kernels = introspection.join().map_err(|_| RunError::IntrospectionPanicked)?;
    let hvprobe_code = HvprobeCode::of(&outcome.vcpus_at_stop, |at| session.hvprobe_code_at(at));
    let finish_failed = session.finish().err();
    let arming_failed = session.failure();
    let samples = sampler.map(Sampler::finish);
    Ok(Booted {
        outcome,
        kernels,
        hvprobe_code,
        finish_failed,
        arming_failed,
        samples,
        memory,
        console,
        _session: session,
        daemons: None,
    })
}

/// Where the guest's console goes: nowhere with `--no-console`; as it is for an
/// interactive console (no workload, or `--console-input`); else escaped, since nobody
/// types into a workload run and its programs must not drive the terminal or forge
/// hvprobe's lines (issue 24).
pub fn console_output(workload: bool, console_input: bool, no_console: bool) -> ConsoleOutput {
    if no_console {
        ConsoleOutput::Discard
    } else if !workload || console_input {
        ConsoleOutput::Stdout
    } else {
        ConsoleOutput::StdoutEscaped
    }
}
