//! The `hvprobe` command.

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use hvprobe::cli::{BenchCommand, Cli, Commands, SnapshotCommand, SymbolsArgs};
use hvprobe::guest::BundledGuest;
use hvprobe_introspection::symbols::SymbolTable;

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
        Commands::Run(args) => hvprobe::run::run(*args),
        Commands::Symbols(args) => symbols(args),
        Commands::Snapshot {
            command: SnapshotCommand::Create(args),
        } => hvprobe::snapshot::create(args),
        Commands::Probe { command } => hvprobe::control::client::probe(command),
        Commands::Trace(args) => hvprobe::control::client::trace(args),
        Commands::Bench {
            command: BenchCommand::Snapshot(args),
        } => hvprobe::snapshot::bench(args),
        Commands::Bench {
            command: BenchCommand::Probes(args),
        } => hvprobe::bench::bench_probes(args),
        Commands::Bench {
            command: BenchCommand::Arm(args),
        } => hvprobe::bench_arm::bench_arm(args),
        Commands::Bench {
            command: BenchCommand::Drain(args),
        } => hvprobe::bench_drain::bench_drain(args),
        Commands::Bench {
            command: BenchCommand::Filter(args),
        } => hvprobe::bench_filter::bench_filter(args),
        Commands::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "hvprobe", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Commands::Man { out_dir: None } => clap_mangen::Man::new(Cli::command())
            .render(&mut std::io::stdout())
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
        Commands::Man { out_dir: Some(dir) } => clap_mangen::generate_to(Cli::command(), &dir)
            .map(|()| ExitCode::SUCCESS)
            .map_err(|e| format!("cannot write the manual pages to {}: {e}", dir.display()).into()),
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

/// `hvprobe symbols`: resolve names and describe addresses offline.
fn symbols(args: SymbolsArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let table = match &args.system_map {
        Some(map) => SymbolTable::from_system_map_file(map)?,
        None => SymbolTable::from_elf_file(&args.vmlinux)?,
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
