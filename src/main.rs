//! The `hvprobe` command.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use hvprobe::guest::{initrd_with_workload, BundledGuest, BASE_CMDLINE};
use hvprobe::vmm::{kernel_format, ConsoleOutput, NoProbes, StopReason, Vm, VmConfig};

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
    /// Sample every vCPU's instruction pointer this often (ms) and print the hottest guest
    /// functions at exit (symbols from the bundled guest's System.map, or --system-map).
    #[arg(long, value_name = "MS")]
    sample_ms: Option<u64>,
    /// System.map of the kernel, for --sample-ms with your own kernel.
    #[arg(long)]
    system_map: Option<PathBuf>,
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
    // Check what needs no guest build first, so bad input fails fast.
    VmConfig::validate_machine(args.cpus, args.mem)?;
    if let Some(kernel) = &args.kernel {
        kernel_format(kernel)?;
    }
    if let Some(initrd) = &args.initrd {
        std::fs::metadata(initrd).map_err(|e| format!("cannot read initrd {}: {e}", initrd.display()))?;
    }
    let bundled = if args.kernel.is_none() || args.initrd.is_none() {
        Some(BundledGuest::ensure_built()?)
    } else {
        None
    };

    let (kernel, mut cmdline) = match (&args.kernel, &bundled) {
        (Some(k), _) => (k.clone(), BASE_CMDLINE.to_string()),
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
    let sampler = args
        .sample_ms
        .map(|ms| hvprobe::sampler::Sampler::start(vm.control(), Duration::from_millis(ms.max(1))));
    let outcome = vm.run(Arc::new(NoProbes))?;
    if let Some(sampler) = sampler {
        let samples = sampler.finish();
        let map = args.system_map.clone().or_else(|| {
            bundled
                .as_ref()
                .filter(|_| args.kernel.is_none())
                .map(|g| g.system_map.clone())
        });
        match map {
            Some(map) => eprint!("{}", hvprobe::sampler::report(&samples, &map, 30)?),
            None => eprintln!(
                "hvprobe: {} samples taken, but no System.map to name them (--system-map)",
                samples.len()
            ),
        }
    }

    let boot = match outcome.boot_to_init {
        Some(t) => format!("{:.2} s", t.as_secs_f64()),
        None => "not reached".into(),
    };
    eprintln!(
        "hvprobe: {}; boot to /init {boot} ({}), ran {:.2} s, {} exits, {} instructions emulated, {} guest int3 re-injected",
        outcome.reason,
        outcome.kernel_format.map(|f| f.to_string()).unwrap_or_default(),
        outcome.run_time.as_secs_f64(),
        outcome.exits,
        outcome.instructions_emulated,
        outcome.breakpoints_reinjected
    );
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
