//! The `hvprobe` commands, one module each; [`dispatch`] runs the one the command line
//! names.

pub mod bench;
pub mod list;
pub mod probe;
pub mod reference;
pub mod run;
pub mod snapshot;
pub mod source;
pub mod symbols;
pub mod trace;

use std::process::ExitCode;

use clap::CommandFactory;

use crate::cli::{BenchCommand, Cli, Commands, ListCommand, SnapshotCommand};
use hvprobe_session::guest::BundledGuest;

/// What a command ends with: its exit status, or the error `main` prints.
pub type CliResult = Result<ExitCode, Box<dyn std::error::Error>>;

/// Runs the command `command`.
pub fn dispatch(command: Commands) -> CliResult {
    match command {
        Commands::Run(args) => run::run(*args),
        Commands::Symbols(args) => symbols::symbols(args),
        Commands::List {
            command: ListCommand::Functions(args),
        } => list::functions(args),
        Commands::Lines(args) => source::lines(args),
        Commands::Vars(args) => source::vars(args),
        Commands::Snapshot {
            command: SnapshotCommand::Create(args),
        } => snapshot::create(args),
        Commands::Probe { command } => probe::probe(command),
        Commands::Trace(args) => trace::trace(args),
        Commands::Bench {
            command: BenchCommand::Snapshot(args),
        } => bench::snapshot::bench(args),
        Commands::Bench {
            command: BenchCommand::Io(args),
        } => bench::io::bench(args),
        Commands::Bench {
            command: BenchCommand::Probes(args),
        } => bench::probes::bench_probes(args),
        Commands::Bench {
            command: BenchCommand::Arm(args),
        } => bench::arm::bench_arm(args),
        Commands::Bench {
            command: BenchCommand::Functions(args),
        } => bench::functions::bench_functions(args),
        Commands::Bench {
            command: BenchCommand::Drain(args),
        } => bench::drain::bench_drain(args),
        Commands::Bench {
            command: BenchCommand::Filter(args),
        } => bench::filter::bench_filter(args),
        Commands::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "hvprobe", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Commands::Man { markdown: true, .. } => {
            print!("{}", reference::markdown(&Cli::command()));
            Ok(ExitCode::SUCCESS)
        }
        Commands::Man { out_dir: None, .. } => clap_mangen::Man::new(Cli::command())
            .render(&mut std::io::stdout())
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
        Commands::Man { out_dir: Some(dir), .. } => clap_mangen::generate_to(Cli::command(), &dir)
            .map(|()| ExitCode::SUCCESS)
            .map_err(|e| format!("cannot write the manual pages to {}: {e}", dir.display()).into()),
        Commands::BuildGuest => BundledGuest::ensure_built()
            .map(|g| {
                println!("{}", g.dir.display());
                ExitCode::SUCCESS
            })
            .map_err(Into::into),
    }
}
