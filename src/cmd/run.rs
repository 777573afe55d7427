//! `hvprobe run`: boot a guest (or restore one, see [`hvprobe_session::snapshot`]),
//! introspect its kernel once it is up, trace it, and exit with the workload's status.

use std::path::Path;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hvprobe_introspection::symbols::{SymbolError, SymbolSource, SymbolTable};
use hvprobe_live::{wait_for_kernel, KernelSymbols, SymbolsFrom, TaskContext};
use hvprobe_session::guest::BundledGuest;
use hvprobe_session::guest_kernel::{introspect, ArmProbes, IntrospectionFailure};
use hvprobe_session::kernel_source::KernelSourceFiles;
use hvprobe_session::machine::{initrd_with_workload, Machine, MachineFiles};
use hvprobe_session::options::{AnalysisFlags, ControlSocket, SymbolRequest, TraceOptions};
use hvprobe_session::session::{exit_status_for_signal, RunSession};
use hvprobe_session::shares::{self, Daemons};
use hvprobe_session::snapshot::{restore_and_run, SnapshotError};
use hvprobe_vmm::{kernel_format, ConsoleOutput, DiskConfig, KernelFormat, StopReason, VcpuControl, Vm, VmConfig};

use crate::cli::{RunArgs, SourceArg};
use crate::cmd::CliResult;

/// `hvprobe run`: boots the guest, or restores it with `--snapshot`.
pub fn run(args: RunArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut trace = TraceOptions {
        probes: args.probes.clone(),
        kernel_source: Arc::new(KernelSourceFiles::none()),
        output: (&args.output).into(),
        sym_offset: args.sym_offset,
        text_hash: args.text_hash,
        control: match (&args.control, args.no_control) {
            (_, true) => ControlSocket::Off,
            (Some(path), false) => ControlSocket::At(path.clone()),
            (None, false) => ControlSocket::Default,
        },
        optimize: args.optimize.chosen(),
        analysis: AnalysisFlags {
            filters: args.filter.clone(),
            triggers: args.trigger.clone(),
        },
        clock: args.clock.into(),
        sample_every: args.sample_ms.map(|ms| Duration::from_millis(ms.max(1))),
        // Set below, for a boot or a restore.
        symbols: SymbolRequest::default(),
    };
    // A --control PATH that is not ours to bind fails now, not after a guest build and a boot.
    if let ControlSocket::At(path) = &trace.control {
        hvprobe_session::control::check_socket_path(path)?;
    }
    if let Some(dir) = &args.snapshot {
        // Source targets read the restored kernel's DWARF: --vmlinux's, or the bundled
        // guest's (what `snapshot create` saves by default).
        trace.kernel_source = Arc::new(
            match &args.vmlinux {
                Some(v) => KernelSourceFiles::new(v.clone(), v.clone()),
                None => KernelSourceFiles::bundled(),
            }
            .with_modules(args.module_debuginfo.clone()),
        );
        let workload = args.workload.as_deref().ok_or(SnapshotError::NoWorkload)?;
        trace.symbols = restored_symbols(&args)?;
        return run_restored(
            dir,
            args.machine.cpus,
            &args.machine.disks,
            workload,
            console_output(true, args.console_input, args.no_console),
            args.console_input,
            &trace,
        );
    }
    // Check what needs no guest build first, so bad input fails fast.
    VmConfig::validate_machine(args.machine.cpus, args.machine.mem)?;
    if let Some(kernel) = &args.machine.kernel {
        kernel_format(kernel)?;
    }
    if let Some(initrd) = &args.machine.initrd {
        std::fs::metadata(initrd).map_err(|e| format!("cannot read initrd {}: {e}", initrd.display()))?;
    }
    check_symbol_flags(&args)?;
    for file in &args.module_debuginfo {
        std::fs::metadata(file).map_err(|e| format!("--module-debuginfo {}: {e}", file.display()))?;
    }
    let files = MachineFiles::of(&Machine::from(&args.machine), args.kaslr)?;
    let bundled_kernel = files.bundled_kernel();
    trace.symbols = SymbolRequest {
        sources: symbol_sources(&args, bundled_kernel)?,
        resolve: args.resolve.clone(),
    };
    let sources = &trace.symbols.sources;
    let vmlinux = vmlinux_of(&args, bundled_kernel)?;
    if let Some(vmlinux) = &vmlinux {
        // The DWARF: a --vmlinux's own, else the bundled guest's file beside its vmlinux.
        let debuginfo = match (&args.vmlinux, bundled_kernel) {
            (None, Some(g)) => g.debuginfo.clone(),
            _ => vmlinux.clone(),
        };
        let files = match bundled_kernel {
            // The bundled guest's files are known by name: its test module's .ko too.
            Some(_) if args.vmlinux.is_none() => KernelSourceFiles::bundled(),
            _ => KernelSourceFiles::new(vmlinux.clone(), debuginfo),
        };
        trace.kernel_source = Arc::new(files.with_modules(args.module_debuginfo.clone()));
    }
    match &args.probes {
        Some(file) => check_probes_before_boot(
            file,
            args.machine.cpus,
            sources,
            vmlinux.as_deref(),
            &trace.kernel_source,
            &trace.analysis,
        )?,
        None if !trace.analysis.is_empty() => {
            return Err(hvprobe_session::error::SessionError::AnalysisWithoutProbes.into())
        }
        None => {}
    }
    // The shares' daemons, last before the VM: everything that can be refused has been.
    let daemons = match &files.virtiofsd {
        Some((virtiofsd, sandbox)) => Some(Daemons::start(
            virtiofsd,
            sandbox,
            &files.shares,
            &shares::runtime_dir(),
            shares::SOCKET_DEADLINE,
        )?),
        None => None,
    };
    let config = VmConfig {
        kernel: files.kernel.clone(),
        initrd: initrd_with_workload(&files, args.workload.as_deref())?,
        cmdline: files.cmdline.clone(),
        cpus: args.machine.cpus,
        mem_mib: args.machine.mem,
        console_output: console_output(args.workload.is_some(), args.console_input, args.no_console),
        console_input: args.workload.is_none() || args.console_input,
        disks: args.machine.disks.clone(),
        shares: daemons.as_ref().map(Daemons::fs_configs).unwrap_or_default(),
    };
    let vm = match Vm::new(&config) {
        Ok(vm) => vm,
        // A daemon that died says more than the socket it closed. (Only then: a VM that
        // failed for another reason closed its sockets, and its daemons left on their own.)
        Err(e @ hvprobe_vmm::Error::SharedDirectory(_)) => match daemons.as_ref().and_then(Daemons::death) {
            Some(died) => return Err(died.into()),
            None => return Err(e.into()),
        },
        Err(e) => return Err(e.into()),
    };
    if let Some(daemons) = &daemons {
        let control = vm.control();
        daemons.on_death(Box::new(move |died| {
            // A daemon that goes when the VM ends (its device closed the socket) did not die.
            if control.stop_reason().is_some() {
                return false;
            }
            // Its device answers the guest's requests with EIO from now on (the guest's
            // file operations on the share fail, its workload goes on); the run fails.
            eprintln!(
                "hvprobe: virtiofsd for {} {}: the guest's requests to its share fail with EIO from now on",
                died.share, died.status
            );
            true
        }));
    }
    let console = vm.console_log();
    let session = RunSession::start(&trace, &vm)?;
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
        .map(|every| hvprobe_session::sampler::Sampler::start(vm.control(), vm.memory().clone(), every, tasks));
    let memory = vm.memory().clone();
    let outcome = vm.run(session.handler())?;
    let introspection = introspection.join().map_err(|_| "the introspection thread panicked")?;
    let hvprobe_code =
        hvprobe_session::where_stopped::HvprobeCode::of(&outcome.vcpus_at_stop, |at| session.hvprobe_code_at(at));
    let finish_failed = session.finish().err();
    if let Some(e) = &finish_failed {
        eprintln!("hvprobe: error: {e}");
    }
    let arming_failed = session.failure();
    if let Some(sampler) = sampler {
        let symbols = introspection.as_ref().ok().and_then(|k| k.first()).map(|k| &k.table);
        eprint!("{}", hvprobe_session::sampler::summary(&sampler.finish(), symbols));
    }

    let boot = match outcome.boot_to_init {
        Some(t) => format!("{:.2} s", t.as_secs_f64()),
        None => "not reached".into(),
    };
    eprintln!(
        "hvprobe: {}; boot to /init {boot} ({}), ran {:.2} s, {}",
        outcome.reason,
        outcome.kernel_format.map(|f| f.to_string()).unwrap_or_default(),
        outcome.run_time.as_secs_f64(),
        hvprobe_session::report::exit_summary(&outcome),
    );
    hvprobe_session::report::report_refused_ool_writes(&outcome);
    if hvprobe_session::where_stopped::wanted(&outcome.reason) {
        let symbols = introspection.as_ref().ok().and_then(|k| k.first()).map(|k| &k.table);
        eprint!(
            "{}",
            hvprobe_session::where_stopped::report(&outcome.vcpus_at_stop, &memory, symbols, &hvprobe_code)
        );
    }
    let introspection_failed = match &introspection {
        Ok(kernels) => {
            for k in kernels {
                eprintln!("hvprobe: {k}");
            }
            false
        }
        Err(e @ IntrospectionFailure::NotUp) => {
            eprintln!("hvprobe: {e}");
            !args.resolve.is_empty()
        }
        Err(e) => {
            eprintln!("hvprobe: error: {e}");
            true
        }
    };
    if let Some(died) = daemons.as_ref().and_then(Daemons::death) {
        eprintln!("hvprobe: error: {died}");
        return Ok(ExitCode::FAILURE);
    }
    if let Some(e) = arming_failed {
        eprintln!("hvprobe: error: {e}");
        return Ok(ExitCode::FAILURE);
    }
    if introspection_failed || finish_failed.is_some() {
        return Ok(ExitCode::FAILURE);
    }
    let code = match &outcome.reason {
        StopReason::GuestExit(status) => *status,
        StopReason::Reset if console.contents().contains("Kernel panic") => {
            eprintln!(
                "hvprobe: the guest kernel panicked; console tail:\n{}",
                console.tail(30)
            );
            1
        }
        StopReason::Reset | StopReason::PowerOff | StopReason::Stopped if args.workload.is_none() => 0,
        StopReason::Signal(sig) => exit_status_for_signal(*sig),
        other => {
            eprintln!(
                "hvprobe: the guest did not finish its workload ({other}); console tail:\n{}",
                console.tail(30)
            );
            1
        }
    };
    Ok(ExitCode::from(code))
}

/// Checks a probe file before anything boots, so that a typo costs no boot: its syntax,
/// and when a symbol file (System.map or vmlinux) says what the kernel's symbols are, every
/// symbol and wildcard against them. Symbol names and offsets within their functions do
/// not depend on KASLR; what needs the running kernel (instruction boundaries, the
/// blacklist, patch sites, raw addresses) is checked once it is up.
fn check_probes_before_boot(
    file: &std::path::Path,
    cpus: u8,
    sources: &[SymbolsFrom],
    vmlinux: Option<&std::path::Path>,
    kernel_source: &KernelSourceFiles,
    analysis: &AnalysisFlags,
) -> Result<(), Box<dyn std::error::Error>> {
    let table = sources
        .iter()
        .find_map(|from| match from {
            SymbolsFrom::SystemMap(path) => Some(SymbolTable::from_system_map_file(path)),
            SymbolsFrom::Vmlinux(path) => Some(SymbolTable::from_elf_file(path)),
            SymbolsFrom::Kallsyms => None,
        })
        .transpose()?;
    hvprobe_session::trace::check_before_boot(
        file,
        usize::from(cpus),
        table.as_ref(),
        vmlinux,
        kernel_source,
        analysis,
    )?;
    Ok(())
}

/// Rejects, before anything boots or is restored, a malformed `--resolve SYM[+OFFSET]` and
/// a `--system-map` or `--vmlinux` that cannot be read.
fn check_symbol_flags(args: &RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    for spec in &args.resolve {
        match SymbolTable::from_symbols(SymbolSource::SystemMap, Vec::new()).resolve(spec) {
            Err(SymbolError::UnknownSymbol(_)) | Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
    }
    for path in [&args.system_map, &args.vmlinux].into_iter().flatten() {
        std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The run's vmlinux ELF, if it has one: `--vmlinux`, the bundled guest's, or `--kernel`
/// when that is an ELF.
fn vmlinux_of(
    args: &RunArgs,
    bundled: Option<&BundledGuest>,
) -> Result<Option<std::path::PathBuf>, Box<dyn std::error::Error>> {
    let kernel_is_elf = args.machine.kernel.as_deref().map(kernel_format).transpose()? == Some(KernelFormat::ElfPvh);
    Ok(args
        .vmlinux
        .clone()
        .or_else(|| bundled.map(|g| g.vmlinux.clone()))
        .or_else(|| args.machine.kernel.clone().filter(|_| kernel_is_elf)))
}

/// The symbol sources of a run, in the order asked for (or the default); the files named
/// on the command line were checked by [`check_symbol_flags`].
fn symbol_sources(
    args: &RunArgs,
    bundled: Option<&BundledGuest>,
) -> Result<Vec<SymbolsFrom>, Box<dyn std::error::Error>> {
    let system_map = args
        .system_map
        .clone()
        .or_else(|| bundled.map(|g| g.system_map.clone()));
    let vmlinux = vmlinux_of(args, bundled)?;
    let asked = if args.symbol_sources.is_empty() {
        vec![if system_map.is_some() {
            SourceArg::SystemMap
        } else if vmlinux.is_some() {
            SourceArg::Vmlinux
        } else {
            SourceArg::Kallsyms
        }]
    } else {
        args.symbol_sources.clone()
    };
    asked
        .into_iter()
        .map(|a| match a {
            SourceArg::SystemMap => system_map
                .clone()
                .map(SymbolsFrom::SystemMap)
                .ok_or_else(|| "--symbols system-map needs --system-map FILE".into()),
            SourceArg::Vmlinux => vmlinux
                .clone()
                .map(SymbolsFrom::Vmlinux)
                .ok_or_else(|| "--symbols vmlinux needs --vmlinux FILE".into()),
            SourceArg::Kallsyms => Ok(SymbolsFrom::Kallsyms),
        })
        .collect()
}

/// A restore's symbols: the restored kernel's kallsyms, unless `--symbols` names other
/// sources or `--system-map` gives a map (as on a boot, a map given is the default then).
/// A file-based source without its file is the bundled guest's, as most snapshots are;
/// the restore refuses a file whose `linux_banner` is not the restored kernel's.
fn restored_symbols(args: &RunArgs) -> Result<SymbolRequest, Box<dyn std::error::Error>> {
    check_symbol_flags(args)?;
    let sources = match (&args.system_map, args.symbol_sources.is_empty()) {
        (Some(map), true) => vec![SymbolsFrom::SystemMap(map.clone())],
        (None, true) => SymbolRequest::default().sources,
        (_, false) => {
            let wants_bundled = args.symbol_sources.iter().any(|s| match s {
                SourceArg::SystemMap => args.system_map.is_none(),
                SourceArg::Vmlinux => args.vmlinux.is_none(),
                SourceArg::Kallsyms => false,
            });
            let bundled = wants_bundled.then(BundledGuest::ensure_built).transpose()?;
            symbol_sources(args, bundled.as_ref())?
        }
    };
    Ok(SymbolRequest {
        sources,
        resolve: args.resolve.clone(),
    })
}

/// Once the guest kernel is up (all vCPUs paused): [`introspect`] it, arming the probes at
/// `/init` (or at once if the guest is past it). A failure stops the VM.
fn introspect_when_up(
    control: &Arc<VcpuControl>,
    mem: &vm_memory::GuestMemoryMmap,
    request: &SymbolRequest,
    session: &RunSession,
    tasks: &OnceLock<TaskContext>,
) -> Result<Vec<KernelSymbols>, IntrospectionFailure> {
    let (paused, state) =
        wait_for_kernel(control, mem, Duration::from_millis(100)).ok_or(IntrospectionFailure::NotUp)?;
    let arm = match control.boot_to_init() {
        Some(_) => ArmProbes::Now,
        None => ArmProbes::AtInit,
    };
    let introspected = introspect(control, mem, &state, request, session, tasks, arm);
    drop(paused);
    if introspected.is_err() {
        control.stop(StopReason::Stopped);
    }
    introspected
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

/// `hvprobe run --snapshot DIR`: restore, run the workload, exit with its status.
pub fn run_restored(
    dir: &Path,
    cpus: u8,
    disks: &[DiskConfig],
    workload: &str,
    output: ConsoleOutput,
    console_input: bool,
    trace: &TraceOptions,
) -> CliResult {
    let r = restore_and_run(dir, cpus, disks, workload, output, console_input, trace)?;
    eprintln!(
        "hvprobe: {}; restored and first guest instruction after {}, ran {:.2} s, {}",
        r.outcome.reason,
        r.to_first_entry
            .map(|t| format!("{:.1} ms", t.as_secs_f64() * 1e3))
            .unwrap_or_else(|| "never".into()),
        r.outcome.run_time.as_secs_f64(),
        hvprobe_session::report::exit_summary(&r.outcome),
    );
    hvprobe_session::report::report_refused_ool_writes(&r.outcome);
    if let Some(samples) = &r.samples {
        eprint!("{}", hvprobe_session::sampler::summary(samples, r.symbols.as_ref()));
    }
    if hvprobe_session::where_stopped::wanted(&r.outcome.reason) {
        eprint!("{}", r.where_stopped());
    }
    match r.outcome.reason {
        StopReason::GuestExit(status) => Ok(ExitCode::from(status)),
        StopReason::Signal(sig) => Ok(ExitCode::from(exit_status_for_signal(sig))),
        reason => Err(SnapshotError::WorkloadFailed {
            reason,
            tail: r.console.tail(30),
        }
        .into()),
    }
}
