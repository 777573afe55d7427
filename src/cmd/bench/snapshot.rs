//! `hvprobe bench snapshot`: a cold boot of the bundled guest against restores of its
//! snapshot.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use hvprobe_session::machine::Machine;
use hvprobe_session::options::TraceOptions;
use hvprobe_session::snapshot::{boot_and_save, restore_and_run, wait_mode_config, SnapshotError, SnapshotOptions};
use hvprobe_vmm::{ConsoleOutput, StopReason, VmConfig};

use crate::cli::SnapshotBenchArgs;
use crate::cmd::CliResult;

/// `hvprobe bench snapshot`.
pub fn bench(args: SnapshotBenchArgs) -> CliResult {
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let out = std::env::temp_dir().join(format!("hvprobe-bench-snapshot-{}", std::process::id()));
    let create = SnapshotOptions {
        machine: Machine::bundled_guest(args.cpus),
        kaslr: false,
    };
    let config = wait_mode_config(&create, ConsoleOutput::Discard)?;
    eprintln!(
        "hvprobe: cold boot of the bundled guest ({} vCPU(s)) to its ready point",
        args.cpus
    );
    let result = bench_with(&config, &out, &args);
    let _ = std::fs::remove_dir_all(&out);
    result
}

fn bench_with(config: &VmConfig, dir: &Path, args: &SnapshotBenchArgs) -> CliResult {
    let (boot, _) = boot_and_save(config, dir)?;
    let cold = boot.boot_to_init.ok_or("the cold boot never signalled /init")?;
    let mut first = Vec::new();
    let mut started = Vec::new();
    for i in 0..args.runs {
        let r = restore_and_run(
            dir,
            args.cpus,
            &[],
            "exit 0",
            ConsoleOutput::Discard,
            false,
            &TraceOptions::default(),
        )?;
        if r.outcome.reason != StopReason::GuestExit(0) {
            return Err(SnapshotError::WorkloadFailed {
                reason: r.outcome.reason,
                tail: r.console.tail(30),
            }
            .into());
        }
        let t = r.to_first_entry.ok_or("vCPU 0 never entered the guest")?;
        eprintln!(
            "hvprobe: restore {}: {:.2} ms to the first guest instruction, {:.0} ms to workload start, {:.0} ms to its exit",
            i + 1,
            ms(t),
            r.to_workload_started.map(ms).unwrap_or(f64::NAN),
            ms(r.total)
        );
        first.push(t);
        if let Some(w) = r.to_workload_started {
            started.push(w);
        }
    }
    first.sort();
    started.sort();
    let median = |v: &[Duration]| v[v.len() / 2];
    println!(
        "snapshot benchmark, bundled guest, {} vCPU(s), {} MiB",
        args.cpus,
        Machine::DEFAULT_MEM_MIB
    );
    println!(
        "restore = host time from the start of Vm::restore (reading the snapshot's state file) until vCPU 0 \
         first enters KVM_RUN with the workload message already in the UART's receive FIFO: KVM VM and vCPUs \
         created, guest memory mapped copy-on-write, all vCPU/VM/device state set, workload delivered. The \
         guest's first instruction follows immediately. Snapshot files in the page cache (after the first run)."
    );
    println!("cold boot to /init (1 boot):   {:9.1} ms", ms(cold));
    println!(
        "restore, {} runs:              median {:.2} ms, min {:.2} ms, max {:.2} ms",
        first.len(),
        ms(median(&first)),
        ms(first[0]),
        ms(first[first.len() - 1])
    );
    println!(
        "cold boot / median restore:    {:9.0}x",
        cold.as_secs_f64() / median(&first).as_secs_f64()
    );
    if !started.is_empty() {
        println!(
            "for reference, restore to the guest's \"workload started\" event (init reads the message, writes \
             the script, vfork+exec of /bin/sh; emulated guest code on kvm_pvm): median {:.0} ms",
            ms(median(&started))
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
