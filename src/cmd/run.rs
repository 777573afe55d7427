//! `hvprobe run`: the flags made into a run ([`hvprobe_session::run`]: a guest booted, or
//! restored from a snapshot, introspected once its kernel is up, traced to its end), then
//! its account printed and the workload's status made the exit status.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use hvprobe_session::guest_kernel::IntrospectionFailure;
use hvprobe_session::kernel_source::KernelSourceFiles;
use hvprobe_session::machine::Machine;
use hvprobe_session::options::{AnalysisFlags, ControlSocket, SymbolRequest, TraceOptions};
use hvprobe_session::run::{Booted, Ended, RunOptions};
use hvprobe_session::session::exit_status_for_signal;
use hvprobe_session::snapshot::{Restored, SnapshotError};
use hvprobe_session::symbol_sources::{SourceKind, SymbolFlags};
use hvprobe_session::{report, sampler, where_stopped};
use hvprobe_vmm::{StopReason, VmOutcome};

use crate::cli::RunArgs;
use crate::cmd::CliResult;

/// `hvprobe run`: boots the guest, or restores it with `--snapshot`.
pub fn run(args: RunArgs) -> CliResult {
    match hvprobe_session::run::run(run_options(&args))? {
        Ended::Booted(booted) => Ok(report_boot(&booted, &args)),
        Ended::Restored(restored) => report_restore(restored),
    }
}

/// What `hvprobe run` asks of the run session.
fn run_options(args: &RunArgs) -> RunOptions {
    RunOptions {
        machine: Machine::from(&args.machine),
        workload: args.workload.clone(),
        kaslr: args.kaslr,
        symbols: SymbolFlags {
            sources: args.symbol_sources.iter().copied().map(SourceKind::from).collect(),
            system_map: args.system_map.clone(),
            vmlinux: args.vmlinux.clone(),
            module_debuginfo: args.module_debuginfo.clone(),
            resolve: args.resolve.clone(),
        },
        trace: TraceOptions {
            probes: args.probes.clone(),
            // Chosen by the run, for a boot or a restore, as `symbols`.
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
            symbols: SymbolRequest::default(),
            functions: args.functions.options(),
        },
        console_input: args.console_input,
        no_console: args.no_console,
        snapshot: args.snapshot.clone(),
    }
}

/// A boot's account: why the session's end failed, the samples, the run's line, where the
/// vCPUs stopped, the kernels read; then the exit status: a failure of the run (a daemon
/// died, the probes could not be armed, the kernel could not be read as asked, the session
/// did not end well), or the workload's status.
fn report_boot(booted: &Booted, args: &RunArgs) -> ExitCode {
    if let Some(e) = &booted.finish_failed {
        eprintln!("hvprobe: error: {e}");
    }
    if let Some(samples) = &booted.samples {
        eprint!("{}", sampler::summary(samples, booted.symbols()));
    }
    let outcome = &booted.outcome;
    let boot = match outcome.boot_to_init {
        Some(t) => format!("{:.2} s", t.as_secs_f64()),
        None => "not reached".into(),
    };
    eprintln!(
        "hvprobe: {}; boot to /init {boot} ({}), ran {:.2} s, {}",
        outcome.reason,
        outcome.kernel_format.map(|f| f.to_string()).unwrap_or_default(),
        outcome.run_time.as_secs_f64(),
        report::exit_summary(outcome),
    );
    report_refused_ool_writes(outcome);
    if where_stopped::wanted(&outcome.reason) {
        eprint!("{}", booted.where_stopped());
    }
    let introspection_failed = match &booted.kernels {
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
    if let Some(died) = booted.daemon_died() {
        eprintln!("hvprobe: error: {died}");
        return ExitCode::FAILURE;
    }
    if let Some(e) = &booted.arming_failed {
        eprintln!("hvprobe: error: {e}");
        return ExitCode::FAILURE;
    }
    if introspection_failed || booted.finish_failed.is_some() {
        return ExitCode::FAILURE;
    }
    let console = &booted.console;
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
    ExitCode::from(code)
}

/// A restore's account (`run --snapshot DIR`): the run's line, the samples, where the vCPUs
/// stopped; then the workload's status, or why it has none.
fn report_restore(r: Restored) -> CliResult {
    eprintln!(
        "hvprobe: {}; restored and first guest instruction after {}, ran {:.2} s, {}",
        r.outcome.reason,
        r.to_first_entry
            .map(|t| format!("{:.1} ms", t.as_secs_f64() * 1e3))
            .unwrap_or_else(|| "never".into()),
        r.outcome.run_time.as_secs_f64(),
        report::exit_summary(&r.outcome),
    );
    report_refused_ool_writes(&r.outcome);
    if let Some(samples) = &r.samples {
        eprint!("{}", sampler::summary(samples, r.symbols.as_ref()));
    }
    if where_stopped::wanted(&r.outcome.reason) {
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

fn report_refused_ool_writes(outcome: &VmOutcome) {
    if let Some(line) = report::refused_ool_writes(outcome) {
        eprintln!("{line}");
    }
}
