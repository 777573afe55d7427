//! `hvprobe bench arm`: how long arming and disarming N probes takes on a running,
//! restored guest (10 to 10,000 probes): one pause of the vCPUs per batch, the time the
//! engine spends placing and checking each probe, and the text writes.

use std::process::ExitCode;
use std::time::Instant;

use hvprobe_live::{build_tracer, live_memory, load_symbols, ProbeHandler, SymbolsFrom};
use hvprobe_probes::engine::{KprobeRequest, ProbePoint};
use hvprobe_vmm::{ConsoleOutput, StopReason, Vm};

use crate::cli::ArmBenchArgs;
use hvprobe_session::guest::workload_message;

use crate::cmd::CliResult;

/// A probe on `name+0` that only counts.
fn counting(name: &str) -> KprobeRequest {
    let point = ProbePoint::Symbol {
        name: name.to_string(),
        offset: 0,
    };
    KprobeRequest {
        emit_events: false,
        ..KprobeRequest::event(point, "arm", name, Vec::new())
    }
}

pub fn bench_arm(args: ArmBenchArgs) -> CliResult {
    let counts: Vec<usize> = args.counts.clone();
    let most = counts
        .iter()
        .copied()
        .max()
        .ok_or("--counts needs at least one number")?;
    let dir = super::bench_snapshot(args.snapshot.as_deref(), args.cpus)?;
    let mut vm = Vm::restore(&dir, Some(args.cpus), ConsoleOutput::Discard, &[])?;
    let state = vm.vcpu_state(0)?;
    let symbols = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), &state), state.lstar)?.table;
    let tracer = build_tracer(vm.control(), vm.memory(), &state, &symbols, None)?;
    // Functions a probe can go on, in address order, up to the largest count.
    let started = Instant::now();
    let mut names: Vec<&str> = symbols
        .symbols()
        .iter()
        .filter(|s| s.is_text() && symbols.lookup_all(&s.name).count() == 1)
        .map(|s| s.name.as_str())
        .collect();
    names.dedup();
    let mut usable = Vec::with_capacity(most);
    for chunk in names.chunks(512) {
        let requests: Vec<KprobeRequest> = chunk.iter().map(|n| counting(n)).collect();
        let refused: Vec<usize> = tracer.check_all(&requests).into_iter().map(|(i, _)| i).collect();
        usable.extend(
            chunk
                .iter()
                .enumerate()
                .filter(|(i, _)| !refused.contains(i))
                .map(|(_, n)| *n),
        );
        if usable.len() >= most {
            break;
        }
    }
    usable.truncate(most);
    eprintln!(
        "hvprobe: {} probeable functions found in {:.0} ms",
        usable.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    if usable.len() < most {
        return Err(format!("only {} functions can be probed, fewer than {most}", usable.len()).into());
    }
    // The guest runs a busy loop throughout, on every vCPU: the pauses are real.
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), None);
    let control = vm.control();
    let mut busy = super::read_loops(args.cpus);
    if let Some(mib) = args.memory_pressure {
        let bytes = u64::from(mib) << 20;
        busy.push_str(&format!(
            " sh -c 'while true; do v=$(head -c {bytes} /dev/zero | tr \\\\0 x); done' &"
        ));
    }
    vm.send_console_input(workload_message(&format!("{busy} wait")));
    let runner = std::thread::spawn(move || vm.run(handler));
    std::thread::sleep(std::time::Duration::from_secs(2));
    println!(
        "arming and disarming N probes on a running guest ({} vCPUs, backend {}), median of {} rounds:",
        args.cpus,
        hvprobe_vmm::Backend::detect(),
        args.runs
    );
    println!(
        "{:>8}  {:>10}  {:>10}  {:>12}  {:>12}",
        "N", "arm ms", "disarm ms", "arm µs/probe", "all removed"
    );
    let mut result = Ok(());
    for &n in &counts {
        let mut arm = Vec::new();
        let mut disarm = Vec::new();
        for _ in 0..args.runs {
            let requests: Vec<KprobeRequest> = usable[..n].iter().map(|name| counting(name)).collect();
            let t = Instant::now();
            if let Err((i, e)) = tracer.register_all(requests) {
                result = Err(format!("arming {n} probes: probe {i} ({}): {e}", usable[i]));
                break;
            }
            arm.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            if let Err(e) = tracer.unregister_all() {
                result = Err(format!("disarming {n} probes: {e}"));
                break;
            }
            disarm.push(t.elapsed().as_secs_f64() * 1e3);
        }
        if result.is_err() {
            break;
        }
        arm.sort_by(f64::total_cmp);
        disarm.sort_by(f64::total_cmp);
        let (a, d) = (arm[arm.len() / 2], disarm[disarm.len() / 2]);
        println!(
            "{n:>8}  {a:>10.1}  {d:>10.1}  {:>12.1}  {:>12}",
            a * 1e3 / n as f64,
            if tracer.listing().is_empty() { "yes" } else { "NO" }
        );
    }
    // Whatever hit the probes while they were armed was handled, not just counted: the
    // guest must still be running when the host stops it.
    control.stop(StopReason::Stopped);
    let outcome = runner.join().map_err(|_| "the VM's thread panicked")??;
    let s = &tracer.stats;
    use std::sync::atomic::Ordering::Relaxed;
    println!(
        "hits while armed {} (emulated {}, stepped out of line {}: {} interrupted by an exception or NMI, {} whose trap the backend lost)",
        s.hits.load(Relaxed),
        s.emulated.load(Relaxed),
        s.stepped.load(Relaxed),
        s.steps_interrupted.load(Relaxed),
        s.step_traps_lost.load(Relaxed)
    );
    result?;
    if outcome.reason != StopReason::Stopped {
        return Err(format!("the guest stopped during the benchmark: {}", outcome.reason).into());
    }
    Ok(ExitCode::SUCCESS)
}
