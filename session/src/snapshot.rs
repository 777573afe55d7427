//! Snapshots (`hvprobe snapshot create`, `hvprobe run --snapshot`, `hvprobe bench
//! snapshot`): boot the guest once to the point where its init waits for a workload, save
//! it, and restore it in milliseconds as often as wanted.
//!
//! The guest side is the bundled init's wait mode ([`WAIT_OPTION`] on the kernel command
//! line, see `guest/README.md`): init signals "ready for a workload" and reads it from the
//! serial console ([`workload_message`]). `snapshot create` stops the VM at that event and
//! saves it; a restore puts the message into the UART and lets the guest go on.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{live_memory, load_symbols, SymbolsFrom};
use hvprobe_vmm::{ConsoleLog, ConsoleOutput, DiskConfig, StopReason, Vm, VmConfig, VmOutcome};
use vm_memory::GuestMemoryMmap;

use crate::cache::cache_dir;
use crate::guest::{workload_message, BundledGuest, GuestError, WAIT_OPTION};
use crate::guest_kernel::{introspect, ArmProbes, IntrospectionFailure};
use crate::machine::{initrd_with_workload, Machine, MachineFiles};
use crate::options::TraceOptions;
use crate::session::{RunSession, RunSessionError};

/// Why a snapshot could not be made, found or restored.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(
        "the guest stopped before its init was ready for a workload ({reason}); does its /init have \
         hvprobe's wait mode? Console tail:\n{tail}"
    )]
    NeverReady { reason: StopReason, tail: String },
    #[error(
        "snapshots of a guest with shared directories are not supported: its virtiofsd's state \
         (the guest's open files) cannot be saved with it; snapshot create takes no --rootfs or --rwdir"
    )]
    Shares,
    #[error("a restored guest needs a workload: pass --workload CMD (the snapshotted init waits for one)")]
    NoWorkload,
    #[error("the restored guest did not finish its workload ({reason}); console tail:\n{tail}")]
    WorkloadFailed { reason: StopReason, tail: String },
    #[error(
        "KASLR left the kernel at its link address in {boots} boots in a row (about 1 boot in 500 \
         draws it): is the guest's randomness broken?"
    )]
    KaslrNeverMoved { boots: u32 },
    #[error("no cache directory for snapshots: set HVPROBE_CACHE or HOME, or pass --out DIR")]
    NoCache,
    #[error("the snapshot cache {}: {source}", path.display())]
    Cache { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Guest(#[from] GuestError),
    #[error(transparent)]
    Vm(#[from] hvprobe_vmm::Error),
    #[error(transparent)]
    File(#[from] hvprobe_vmm::SnapshotError),
    #[error(transparent)]
    Symbols(#[from] hvprobe_live::KernelSymbolsError),
    #[error(transparent)]
    Session(#[from] RunSessionError),
    #[error(transparent)]
    Introspection(#[from] IntrospectionFailure),
}

/// What `snapshot create` boots: the machine, and whether its kernel must have moved.
#[derive(Clone, Debug)]
pub struct SnapshotOptions {
    pub machine: Machine,
    /// Boot the bundled guest's bzImage with KASLR, until a boot moves the kernel.
    pub kaslr: bool,
}

/// Boots of `snapshot create --kaslr` until one moves the kernel.
const KASLR_BOOTS: u32 = 3;

/// The machine `snapshot create` boots.
pub fn wait_mode_config(args: &SnapshotOptions, console_output: ConsoleOutput) -> Result<VmConfig, SnapshotError> {
    VmConfig::validate_machine(args.machine.cpus, args.machine.mem)?;
    if args.machine.rootfs.is_some() || !args.machine.rwdirs.is_empty() {
        return Err(SnapshotError::Shares);
    }
    if let Some(kernel) = &args.machine.kernel {
        hvprobe_vmm::kernel_format(kernel)?;
    }
    let files = MachineFiles::of(&args.machine, args.kaslr)?;
    let cmdline = format!("{} {WAIT_OPTION}", files.cmdline);
    let initrd = initrd_with_workload(&files, None)?;
    Ok(VmConfig {
        kernel: files.kernel,
        initrd,
        cmdline,
        cpus: args.machine.cpus,
        mem_mib: args.machine.mem,
        console_output,
        console_input: false,
        disks: args.machine.disks.clone(),
        shares: Vec::new(),
    })
}

/// Boots until the guest's init waits for a workload.
fn boot_until_ready(config: &VmConfig) -> Result<(Vm, VmOutcome), SnapshotError> {
    let mut vm = Vm::new(config)?;
    let console = vm.console_log();
    let outcome = vm.run_until_ready()?;
    if outcome.reason != StopReason::GuestReady {
        return Err(SnapshotError::NeverReady {
            reason: outcome.reason,
            tail: console.tail(30),
        });
    }
    Ok((vm, outcome))
}

/// Boots until the guest is ready and saves it; returns the boot's outcome.
pub fn boot_and_save(config: &VmConfig, out: &Path) -> Result<(VmOutcome, hvprobe_vmm::SnapshotInfo), SnapshotError> {
    let (vm, outcome) = boot_until_ready(config)?;
    let info = vm.save_snapshot(out)?;
    Ok((outcome, info))
}

/// Boots the machine of `args` until the guest is ready (with `--kaslr`, until its kernel
/// has moved) and saves it to `out`.
pub fn save(args: &SnapshotOptions, out: &Path) -> Result<(), SnapshotError> {
    let config = wait_mode_config(args, ConsoleOutput::Discard)?;
    let mut boots = 0;
    let (vm, outcome, started) = loop {
        boots += 1;
        eprintln!("hvprobe: booting the guest until its init waits for a workload");
        let started = Instant::now();
        let (vm, outcome) = boot_until_ready(&config)?;
        if !args.kaslr {
            break (vm, outcome, started);
        }
        let state = vm.vcpu_state(0)?;
        let kernel = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), &state), state.lstar)?;
        eprintln!("hvprobe: {kernel}");
        if kernel.slide != 0 {
            break (vm, outcome, started);
        }
        if boots == KASLR_BOOTS {
            return Err(SnapshotError::KaslrNeverMoved { boots });
        }
        eprintln!("hvprobe: KASLR left the kernel at its link address: booting again");
    };
    let info = vm.save_snapshot(out)?;
    eprintln!(
        "hvprobe: snapshot of {} vCPU(s), {} MiB in {}: guest ready after {:.2} s (boot to /init {}), \
         {} MiB of non-zero memory saved, {:.2} s in all",
        info.vcpus,
        info.mem_bytes >> 20,
        info.dir.display(),
        outcome.run_time.as_secs_f64(),
        outcome
            .boot_to_init
            .map(|t| format!("{:.2} s", t.as_secs_f64()))
            .unwrap_or_else(|| "not seen".into()),
        info.memory_written >> 20,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The snapshot of the bundled guest with `cpus` vCPUs (of a KASLR boot with `kaslr`) in
/// hvprobe's cache (`snapshots/`), made if it is missing: one maker at a time (a lock per
/// snapshot, which the kernel drops when its holder dies), each snapshot written beside
/// its place and renamed into it, so that no reader sees half of one. Its name holds the
/// bundled guest's key, the format and the backend: a snapshot of another build of the
/// guest, or made on another backend, is never restored.
pub fn cached(cpus: u8, kaslr: bool) -> Result<PathBuf, SnapshotError> {
    let guest = BundledGuest::ensure_built()?;
    let key = guest.dir.file_name().unwrap_or_default().to_string_lossy();
    let mut name = hvprobe_vmm::snapshot_cache_name(&key, cpus, hvprobe_vmm::Backend::detect());
    if kaslr {
        name.push_str("-kaslr");
    }
    let root = cache_dir().ok_or(SnapshotError::NoCache)?.join("snapshots");
    let in_cache = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Cache { path, source }
    };
    std::fs::create_dir_all(&root).map_err(in_cache(&root))?;
    let dir = root.join(&name);
    let lock_path = root.join(format!(".lock-{name}"));
    let lock = std::fs::File::create(&lock_path).map_err(in_cache(&lock_path))?;
    let flock = |how| {
        // SAFETY: flock on the descriptor `lock` owns, while it is open; no memory is
        // involved, and the kernel drops the lock when the descriptor closes.
        match unsafe { libc::flock(lock.as_raw_fd(), how) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    if flock(libc::LOCK_EX | libc::LOCK_NB).is_err() {
        eprintln!("hvprobe: waiting for another maker of the snapshot {}", dir.display());
        flock(libc::LOCK_EX).map_err(in_cache(&lock_path))?;
    }
    if !dir.join(hvprobe_vmm::snapshot::STATE_FILE).exists() {
        let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let args = SnapshotOptions {
            machine: Machine::bundled_guest(cpus),
            kaslr,
        };
        save(&args, &tmp)?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).map_err(in_cache(&dir))?;
    }
    Ok(dir)
}

/// What one restore did, with its timings.
pub struct Restored {
    pub outcome: VmOutcome,
    pub console: ConsoleLog,
    /// From the start of the restore to vCPU 0's first KVM_RUN.
    pub to_first_entry: Option<Duration>,
    /// From the start of the restore to the guest's "workload started" event.
    pub to_workload_started: Option<Duration>,
    pub total: Duration,
    /// The guest's memory and, when the run read them, its kernel's symbols: where its
    /// vCPUs stopped is named with them ([`crate::where_stopped`]).
    pub memory: GuestMemoryMmap,
    pub symbols: Option<SymbolTable>,
    /// What of hvprobe's code in the guest the vCPUs stopped in, named before the probes went.
    pub hvprobe_code: crate::where_stopped::HvprobeCode,
    /// With `--sample-ms`, the samples taken.
    pub samples: Option<Vec<crate::sampler::Sample>>,
}

impl Restored {
    /// Where each vCPU was when the run stopped ([`crate::where_stopped::report`]), named
    /// by the symbols the run read; a run that read none (no probes, no `--resolve`) reads
    /// the guest's kallsyms now.
    pub fn where_stopped(&self) -> String {
        let loaded;
        let symbols = match &self.symbols {
            Some(table) => Some(table),
            None => {
                loaded = self.outcome.vcpus_at_stop.first().and_then(|at| {
                    let state = &at.state;
                    load_symbols(&SymbolsFrom::Kallsyms, &live_memory(&self.memory, state), state.lstar)
                        .map(|k| k.table)
                        .ok()
                });
                loaded.as_ref()
            }
        };
        crate::where_stopped::report(&self.outcome.vcpus_at_stop, &self.memory, symbols, &self.hvprobe_code)
    }
}

/// Restores the snapshot in `dir` with `cpus` vCPUs (and its disks, or `disks` in its
/// order), hands the guest `workload` and runs it to the end, traced as `trace` says.
pub fn restore_and_run(
    dir: &Path,
    cpus: u8,
    disks: &[DiskConfig],
    workload: &str,
    console_output: ConsoleOutput,
    console_input: bool,
    trace: &TraceOptions,
) -> Result<Restored, SnapshotError> {
    if disks.is_empty() {
        // The snapshot names these: the user sees what is opened, and how.
        for (i, disk) in hvprobe_vmm::snapshot_disks(dir)?.iter().enumerate() {
            eprintln!(
                "hvprobe: the snapshot's disk {}: {}{}",
                crate::guest::disk_name(i).unwrap_or_default(),
                hvprobe_probes::output::escape_guest_text(&disk.path.display().to_string()),
                if disk.read_only {
                    " (read-only)"
                } else {
                    " (read-write)"
                }
            );
        }
    }
    let started = Instant::now();
    let mut vm = Vm::restore(dir, Some(cpus), console_output, disks)?;
    if console_input {
        vm.feed_stdin_to_console();
    }
    let session = RunSession::start(trace, &vm)?;
    let tasks = Arc::new(OnceLock::new());
    let mut table = None;
    if session.needs_kernel() || trace.sample_every.is_some() || trace.symbols.asked() {
        let state = vm.vcpu_state(0)?;
        let introspected = introspect(
            &vm.control(),
            vm.memory(),
            &state,
            &trace.symbols,
            &session,
            &tasks,
            ArmProbes::Now,
        );
        let kernels = match introspected {
            Ok(kernels) => kernels,
            Err(e) => {
                // The guest never runs: what the session opened (a Perfetto trace, the
                // control socket) is closed as at the end of a run.
                if let Err(finish) = session.finish() {
                    eprintln!("hvprobe: error: {finish}");
                }
                return Err(e.into());
            }
        };
        for kernel in &kernels {
            // As a boot's summary names it: a snapshot of a KASLR boot keeps its slide.
            eprintln!("hvprobe: {kernel}");
        }
        table = kernels.into_iter().next().map(|k| k.table);
    }
    let sampler = trace
        .sample_every
        .map(|every| crate::sampler::Sampler::start(vm.control(), vm.memory().clone(), every, tasks));
    vm.send_console_input(workload_message(workload));
    let console = vm.console_log();
    let control = vm.control();
    let memory = vm.memory().clone();
    let outcome = vm.run(session.handler())?;
    let hvprobe_code = crate::where_stopped::HvprobeCode::of(&outcome.vcpus_at_stop, |at| session.hvprobe_code_at(at));
    session.finish()?;
    Ok(Restored {
        memory,
        hvprobe_code,
        samples: sampler.map(crate::sampler::Sampler::finish),
        symbols: table,
        outcome,
        console,
        to_first_entry: control.first_entry().map(|t| t - started),
        to_workload_started: control.workload_started().map(|t| t - started),
        total: started.elapsed(),
    })
}
