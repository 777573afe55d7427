//! The `hvprobe` command.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use hvprobe::guest::{initrd_with_workload, BundledGuest, BASE_CMDLINE};
use hvprobe::introspect::{live_memory, load_symbols, wait_for_kernel, KernelSymbols, SymbolsFrom, TaskContext};
use hvprobe::trace::{OutputFormat, TraceSession};
use hvprobe::vmm::{
    kernel_format, ConsoleOutput, DebugHandler, KernelFormat, NoProbes, StopReason, VcpuControl, VcpuState, Vm,
    VmConfig,
};
use hvprobe_introspection::symbols::{SymbolError, SymbolSource, SymbolTable};

#[derive(Parser)]
#[command(name = "hvprobe", version, about = "Linux kernel probes run from outside the guest")]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Boot a guest (the bundled one by default) and run it to the end.
    Run(RunArgs),
    /// Build the bundled guest (if its cache entry is missing) and print its directory.
    BuildGuest,
    /// Resolve kernel symbols offline, at link-time addresses (no KASLR slide).
    Symbols(SymbolsArgs),
    /// Save a booted guest waiting for a workload, to restore it with `run --snapshot`.
    Snapshot {
        #[command(subcommand)]
        command: hvprobe::snapshot::SnapshotCommand,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: hvprobe::snapshot::BenchCommand,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Kernel to boot: an ELF vmlinux with a PVH note, or a bzImage [default: the bundled guest's vmlinux].
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initrd (cpio) [default: the bundled guest's initramfs].
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Extra kernel command-line options, appended to the ones hvprobe sets.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem: u64,
    /// Shell command the guest runs instead of an interactive shell; hvprobe exits with its status.
    #[arg(long)]
    workload: Option<String>,
    /// Boot the bundled guest's bzImage with KASLR on (a PVH boot is never randomized).
    #[arg(long)]
    kaslr: bool,
    /// Print `SYM = 0xADDRESS (source)` for SYM[+OFFSET] once the guest kernel is up (repeatable).
    #[arg(long, value_name = "SYM")]
    resolve: Vec<String>,
    /// Where kernel symbols come from (repeatable: --resolve then prints each source's answer)
    /// [default: System.map if there is one, else the vmlinux, else the guest's kallsyms].
    #[arg(long = "symbols", value_enum, value_name = "SOURCE")]
    symbol_sources: Vec<SourceArg>,
    /// System.map of the kernel [default: the bundled guest's].
    #[arg(long)]
    system_map: Option<PathBuf>,
    /// The kernel's vmlinux ELF, for symbols [default: the bundled guest's, or --kernel if it is an ELF].
    #[arg(long)]
    vmlinux: Option<PathBuf>,
    /// Sample every vCPU's instruction pointer this often (ms) and print the hottest guest
    /// functions at exit.
    #[arg(long, value_name = "MS")]
    sample_ms: Option<u64>,
    /// Probes to arm, in the kernel's kprobe_events syntax (one per line: `p[:[GRP/]EVENT]
    /// SYM[+OFFS]|ADDR [FETCHARGS]`, `-:[GRP/]EVENT`, `#` comments). A booted guest gets
    /// them when it reaches /init; a restored one before it runs. Hits are printed on stdout,
    /// the listing (debugfs `list` layout, plus hits and nmissed) on stderr at exit and on SIGUSR1.
    #[arg(long, value_name = "FILE")]
    probes: Option<PathBuf>,
    /// How hits are printed.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text, requires = "probes")]
    output: OutputFormat,
    /// At exit (after every probe is removed), print the SHA-256 of the guest kernel's text.
    #[arg(long)]
    text_hash: bool,
    /// Restore the guest from a snapshot directory (`hvprobe snapshot create`) instead of
    /// booting; needs --workload, and --cpus equal to the snapshot's.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kernel", "initrd", "kaslr", "resolve", "sample_ms", "symbol_sources"])]
    snapshot: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SourceArg {
    SystemMap,
    Vmlinux,
    Kallsyms,
}

#[derive(Args)]
struct SymbolsArgs {
    /// The kernel's vmlinux ELF.
    #[arg(long)]
    kernel: PathBuf,
    /// Use this System.map instead of the vmlinux's symbol table.
    #[arg(long)]
    system_map: Option<PathBuf>,
    /// SYM, SYM+OFFSET, or a hex address (0x...) to describe as SYM+OFF/SIZE.
    #[arg(required = true)]
    names: Vec<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Run(args) => run(args),
        Commands::Symbols(args) => symbols(args),
        Commands::Snapshot {
            command: hvprobe::snapshot::SnapshotCommand::Create(args),
        } => hvprobe::snapshot::create(args),
        Commands::Bench {
            command: hvprobe::snapshot::BenchCommand::Snapshot(args),
        } => hvprobe::snapshot::bench(args),
        Commands::Bench {
            command: hvprobe::snapshot::BenchCommand::Probes(args),
        } => hvprobe::bench::bench_probes(args),
        Commands::BuildGuest => BundledGuest::ensure_built()
            .map(|g| {
                println!("{}", g.dir.display());
                ExitCode::SUCCESS
            })
            .map_err(Into::into),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hvprobe: error: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

fn run(args: RunArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if let Some(dir) = &args.snapshot {
        let trace = hvprobe::snapshot::RestoreTrace {
            probes: args.probes.clone(),
            output: args.output,
            text_hash: args.text_hash,
        };
        return hvprobe::snapshot::run_restored(dir, args.cpus, args.workload.as_deref(), &trace);
    }
    // Check what needs no guest build first, so bad input fails fast.
    VmConfig::validate_machine(args.cpus, args.mem)?;
    if let Some(kernel) = &args.kernel {
        kernel_format(kernel)?;
    }
    if let Some(initrd) = &args.initrd {
        std::fs::metadata(initrd).map_err(|e| format!("cannot read initrd {}: {e}", initrd.display()))?;
    }
    for spec in &args.resolve {
        check_symbol_spec(spec)?;
    }
    if args.kaslr && args.kernel.is_some() {
        return Err(
            "--kaslr boots the bundled guest's bzImage; for your own kernel pass a bzImage with --kernel \
                    (KASLR is on unless its command line says nokaslr)"
                .into(),
        );
    }
    let bundled = if args.kernel.is_none() || args.initrd.is_none() {
        Some(BundledGuest::ensure_built()?)
    } else {
        None
    };
    let bundled_kernel = bundled.as_ref().filter(|_| args.kernel.is_none());

    let (kernel, mut cmdline) = match (&args.kernel, bundled_kernel) {
        (Some(k), _) => (k.clone(), BASE_CMDLINE.to_string()),
        (None, Some(g)) if args.kaslr => (g.bzimage.clone(), format!("{BASE_CMDLINE} {}", g.cmdline)),
        (None, Some(g)) => (g.vmlinux.clone(), format!("{BASE_CMDLINE} {}", g.cmdline)),
        (None, None) => unreachable!("the bundled guest is built when no kernel is given"),
    };
    if !args.cmdline.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(&args.cmdline);
    }
    let initrd_path = match (&args.initrd, &bundled) {
        (Some(i), _) => i.clone(),
        (None, Some(g)) => g.initramfs.clone(),
        (None, None) => unreachable!("the bundled guest is built when no initrd is given"),
    };
    let sources = symbol_sources(&args, bundled_kernel)?;
    let config = VmConfig {
        kernel,
        initrd: initrd_with_workload(&initrd_path, args.workload.as_deref())?,
        cmdline,
        cpus: args.cpus,
        mem_mib: args.mem,
        console_output: ConsoleOutput::Stdout,
        console_input: args.workload.is_none(),
    };
    let vm = Vm::new(&config)?;
    let console = vm.console_log();
    let session = match &args.probes {
        Some(file) => Some(Arc::new(TraceSession::new(
            file,
            args.output,
            vm.backend(),
            vm.memory().clone(),
            usize::from(args.cpus),
            vm.console_log(),
        )?)),
        None => None,
    };
    if let Some(s) = &session {
        s.listing_on_sigusr1()?;
    }
    let tasks = Arc::new(OnceLock::new());
    let kernel_state = Arc::new(OnceLock::new());
    let introspection = {
        let (control, mem, resolve, tasks, session, kernel_state) = (
            vm.control(),
            vm.memory().clone(),
            args.resolve.clone(),
            Arc::clone(&tasks),
            session.clone(),
            Arc::clone(&kernel_state),
        );
        std::thread::spawn(move || {
            let found = Introspected {
                tasks: &tasks,
                kernel_state: &kernel_state,
            };
            introspect_when_up(&control, &mem, &sources, &resolve, session.as_ref(), found)
        })
    };
    let sampler = args.sample_ms.map(|ms| {
        hvprobe::sampler::Sampler::start(
            vm.control(),
            vm.memory().clone(),
            Duration::from_millis(ms.max(1)),
            tasks,
        )
    });
    let mem = vm.memory().clone();
    let handler: Arc<dyn DebugHandler> = match &session {
        Some(s) => s.handler.clone(),
        None => Arc::new(NoProbes),
    };
    let outcome = vm.run(handler)?;
    let introspection = introspection.join().map_err(|_| "the introspection thread panicked")?;
    if let Some(s) = &session {
        s.finish();
    }
    if let (true, Ok(kernels), Some(state)) = (args.text_hash, &introspection, kernel_state.get()) {
        if let Some(kernel) = kernels.first() {
            if let Err(e) = hvprobe::trace::print_kernel_text_hash(&mem, state, &kernel.table) {
                eprintln!("hvprobe: error: cannot hash the kernel text: {e}");
            }
        }
    }
    let arming_failed = session.as_ref().and_then(|s| s.failure());
    if let Some(sampler) = sampler {
        let samples = sampler.finish();
        match introspection.as_ref().ok().and_then(|k| k.first()) {
            Some(kernel) => {
                eprint!("{}", hvprobe::sampler::report(&samples, &kernel.table, 30));
                eprint!("{}", hvprobe::sampler::task_report(&samples, 10));
            }
            None => eprintln!(
                "hvprobe: {} samples taken, but no kernel symbols to name them",
                samples.len()
            ),
        }
    }

    let boot = match outcome.boot_to_init {
        Some(t) => format!("{:.2} s", t.as_secs_f64()),
        None => "not reached".into(),
    };
    eprintln!(
        "hvprobe: {}; boot to /init {boot} ({}), ran {:.2} s, {} exits ({} int3, {} single-step), {} instructions emulated, {} guest int3 re-injected",
        outcome.reason,
        outcome.kernel_format.map(|f| f.to_string()).unwrap_or_default(),
        outcome.run_time.as_secs_f64(),
        outcome.exits,
        outcome.breakpoints,
        outcome.single_steps,
        outcome.instructions_emulated,
        outcome.breakpoints_reinjected
    );
    let introspection_failed = match &introspection {
        Ok(kernels) => {
            for k in kernels {
                eprintln!("hvprobe: kernel symbols from {}: KASLR slide {:#x}", k.from, k.slide);
            }
            false
        }
        Err(IntrospectionFailure::NotUp) => {
            eprintln!("hvprobe: the guest kernel never came up far enough to be introspected");
            !args.resolve.is_empty()
        }
        Err(IntrospectionFailure::Error(e)) => {
            eprintln!("hvprobe: error: {e}");
            true
        }
    };
    if let Some(e) = arming_failed {
        eprintln!("hvprobe: error: {e}");
        return Ok(ExitCode::FAILURE);
    }
    if introspection_failed {
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

/// Rejects a malformed `SYM[+OFFSET]` before anything boots.
fn check_symbol_spec(spec: &str) -> Result<(), SymbolError> {
    match SymbolTable::from_symbols(SymbolSource::SystemMap, Vec::new()).resolve(spec) {
        Err(SymbolError::UnknownSymbol(_)) | Ok(_) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The symbol sources of a run, in the order asked for (or the default).
fn symbol_sources(
    args: &RunArgs,
    bundled: Option<&BundledGuest>,
) -> Result<Vec<SymbolsFrom>, Box<dyn std::error::Error>> {
    let system_map = args
        .system_map
        .clone()
        .or_else(|| bundled.map(|g| g.system_map.clone()));
    let kernel_is_elf = args.kernel.as_deref().map(kernel_format).transpose()? == Some(KernelFormat::ElfPvh);
    let vmlinux = args
        .vmlinux
        .clone()
        .or_else(|| bundled.map(|g| g.vmlinux.clone()))
        .or_else(|| args.kernel.clone().filter(|_| kernel_is_elf));
    for path in [&args.system_map, &args.vmlinux].into_iter().flatten() {
        std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    }
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

enum IntrospectionFailure {
    /// The VM stopped before the kernel set up its syscall entry.
    NotUp,
    Error(String),
}

/// Once the guest kernel is up: loads symbols from every source (checking file-based ones
/// against guest memory) and prints the `--resolve` answers. A failure stops the VM.
/// What the introspection thread found, for the rest of the run.
struct Introspected<'a> {
    tasks: &'a OnceLock<TaskContext>,
    /// vCPU 0's state once the kernel was up (its paging reaches the kernel's own tables).
    kernel_state: &'a OnceLock<VcpuState>,
}

fn introspect_when_up(
    control: &Arc<VcpuControl>,
    mem: &vm_memory::GuestMemoryMmap,
    sources: &[SymbolsFrom],
    resolve: &[String],
    session: Option<&Arc<TraceSession>>,
    found: Introspected,
) -> Result<Vec<KernelSymbols>, IntrospectionFailure> {
    let (paused, state) =
        wait_for_kernel(control, mem, Duration::from_millis(100)).ok_or(IntrospectionFailure::NotUp)?;
    let memory = live_memory(mem, &state);
    let _ = found.kernel_state.set(state);
    let mut kernels = Vec::new();
    let mut failure = None;
    for from in sources {
        let started = std::time::Instant::now();
        match load_symbols(from, &memory, state.lstar) {
            Ok(kernel) => {
                tracing::info!(
                    "{} symbols from {} in {:.0} ms",
                    kernel.table.len(),
                    kernel.from,
                    started.elapsed().as_secs_f64() * 1e3
                );
                for spec in resolve {
                    match kernel.table.resolve(spec) {
                        Ok(r) => eprintln!("{spec} = {:#x} ({})", r.addr.0, from.label()),
                        Err(e) => failure = Some(format!("{e} (in {from})")),
                    }
                }
                kernels.push(kernel);
            }
            Err(e) => failure = Some(e.to_string()),
        }
    }
    if let Some(kernel) = kernels.first() {
        match TaskContext::read(&memory, &kernel.table) {
            Ok(ctx) => {
                let _ = found.tasks.set(ctx);
            }
            Err(reason) => tracing::warn!("$comm and pid of guest tasks are unavailable: {reason}"),
        }
    }
    if let (Some(session), Some(kernel), None) = (session, kernels.first(), &failure) {
        let prepared = session.prepare(
            Arc::clone(control),
            mem,
            &state,
            &kernel.table,
            found.tasks.get().copied(),
        );
        match prepared {
            // Probes go in when the guest's boot-time text patching is over.
            Ok(()) if control.boot_to_init().is_some() => {
                if let Err(e) = session.arm() {
                    failure = Some(e);
                }
            }
            Ok(()) => session.arm_at_init(Arc::clone(control)),
            Err(e) => failure = Some(e),
        }
    } else if session.is_some() && kernels.is_empty() && failure.is_none() {
        failure = Some("no kernel symbols: the probes cannot be placed".into());
    }
    drop(paused);
    match failure {
        Some(message) => {
            control.stop(StopReason::Stopped);
            Err(IntrospectionFailure::Error(message))
        }
        None => Ok(kernels),
    }
}

/// `hvprobe symbols`: resolve names and describe addresses offline.
fn symbols(args: SymbolsArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let table = match &args.system_map {
        Some(map) => SymbolTable::from_system_map_file(map)?,
        None => SymbolTable::from_elf_file(&args.kernel)?,
    };
    let mut failed = false;
    for name in &args.names {
        if let Some(hex) = name.strip_prefix("0x") {
            let addr = u64::from_str_radix(hex, 16).map_err(|e| format!("{name}: not a hex address: {e}"))?;
            match table.describe(hvprobe_arch::Gva(addr)) {
                Some(d) => println!("{name} = {d} ({})", table.source()),
                None => {
                    eprintln!("hvprobe: error: {name} is below every symbol");
                    failed = true;
                }
            }
            continue;
        }
        match table.resolve(name) {
            Ok(r) => println!("{name} = {:#x} ({})", r.addr.0, table.source()),
            Err(e) => {
                eprintln!("hvprobe: error: {e}");
                failed = true;
            }
        }
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
