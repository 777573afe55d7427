//! `hvprobe snapshot create`: the guest booted until its init waits for a workload and
//! saved, to a directory or to hvprobe's cache ([`hvprobe_session::snapshot`]).

use std::process::ExitCode;

use hvprobe_session::snapshot::{self, SnapshotOptions};

use crate::cli::CreateArgs;
use crate::cmd::CliResult;

/// `hvprobe snapshot create`.
pub fn create(args: CreateArgs) -> CliResult {
    match &args.out {
        Some(out) => snapshot::save(&SnapshotOptions::from(&args), out)?,
        None => println!("{}", snapshot::cached(args.machine.cpus, args.kaslr)?.display()),
    }
    Ok(ExitCode::SUCCESS)
}
