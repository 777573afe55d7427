//! `hvprobe bench functions`: the function tracers' costs, side by side in one run.
//!
//! 1. Arming and removing the probes of N functions (the tracer's own requests: an entry
//!    probe, or an entry and a return probe, on the instruction after each ftrace call) on
//!    a restored guest busy in read loops on every vCPU, int3 probes and optimized, up to
//!    every function the tracer takes: one pause each way, its time, and how many sites
//!    were jump-optimized.
//! 2. What one traced call costs the guest: `hvprobe-loop` calls getppid() N and 2N times
//!    under each configuration (nothing, the host's function tracer on
//!    `__do_sys_getppid`, its function_graph tracer, the guest's own function_graph
//!    tracer on the same function); the difference of the two runs' exits and emulated
//!    instructions, over N, is one call's, without the fixed costs of a run (the guest's
//!    own tracer's filter write alone emulates tens of millions of instructions).

use std::process::{Command, ExitCode};
use std::time::Instant;

use hvprobe_functions::filter::denied_reason;
use hvprobe_functions::AvailableFunctions;
use hvprobe_live::{build_tracer, live_memory, load_symbols, ProbeHandler, SymbolsFrom};
use hvprobe_probes::engine::KprobeRequest;
use hvprobe_session::guest::{workload_message, BundledGuest};
use hvprobe_session::options::FunctionTracerKind;
use hvprobe_session::trace::function_requests;
use hvprobe_vmm::{ConsoleOutput, StopReason, Vm};

use crate::cli::FunctionsBenchArgs;
use crate::cmd::CliResult;

pub fn bench_functions(args: FunctionsBenchArgs) -> CliResult {
    let dir = super::bench_snapshot(args.snapshot.as_deref(), args.cpus)?;
    let guest = BundledGuest::ensure_built()?;
    let available = AvailableFunctions::from_vmlinux_file(&guest.vmlinux)?;
    let mut vm = Vm::restore(&dir, Some(args.cpus), ConsoleOutput::Discard, &[])?;
    let state = vm.vcpu_state(0)?;
    let symbols = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), &state), state.lstar)?.table;
    let slide = available.slide_to(&symbols);
    let tracer = build_tracer(vm.control(), vm.memory(), &state, &symbols, None)?;
    let cpus = usize::from(args.cpus);
    // The functions the tracer takes with no filter, those the engine places.
    let candidates: Vec<hvprobe_arch::Gva> = available
        .valid()
        .filter(|f| denied_reason(&f.name).is_none())
        .map(|f| hvprobe_arch::Gva(f.site.0.wrapping_add_signed(slide)))
        .collect();
    let started = Instant::now();
    let entry = |site| function_requests(FunctionTracerKind::Function, site, cpus, false);
    let checks: Vec<KprobeRequest> = candidates.iter().flat_map(|&s| entry(s)).collect();
    let refused: std::collections::BTreeSet<usize> = tracer.check_all(&checks).into_iter().map(|(i, _)| i).collect();
    let sites: Vec<hvprobe_arch::Gva> = candidates
        .iter()
        .enumerate()
        .filter(|(i, _)| !refused.contains(i))
        .map(|(_, s)| *s)
        .collect();
    eprintln!(
        "hvprobe: {} of the kernel's {} functions can be traced (checked in {:.0} ms)",
        sites.len(),
        available.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    let counts: Vec<usize> = args
        .counts
        .iter()
        .map(|c| match c.as_str() {
            "all" => Ok(sites.len()),
            n => n.parse::<usize>().map_err(|e| format!("--counts {n}: {e}")),
        })
        .collect::<Result<_, _>>()?;
    if let Some(&n) = counts.iter().find(|&&n| n > sites.len()) {
        return Err(format!("--counts {n}: only {} functions can be traced", sites.len()).into());
    }
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), None);
    let control = vm.control();
    let busy = super::read_loops(args.cpus);
    vm.send_console_input(workload_message(&format!("{busy} wait")));
    let runner = std::thread::spawn(move || vm.run(handler));
    std::thread::sleep(std::time::Duration::from_secs(2));
    println!(
        "arming and removing N functions' probes on a running guest ({} vCPUs, backend {}), median of {} rounds:",
        args.cpus,
        hvprobe_vmm::Backend::detect(),
        args.runs
    );
    println!(
        "{:>7}  {:<14}  {:>8}  {:>8}  {:>10}  {:>10}  {:>9}",
        "N", "probes", "optimize", "arm ms", "remove ms", "µs/func", "optimized"
    );
    let mut result = Ok(());
    'rows: for &n in &counts {
        for (kind, what) in [
            (FunctionTracerKind::Function, "entry"),
            (FunctionTracerKind::FunctionGraph, "entry+return"),
        ] {
            for optimize in [false, true] {
                tracer.set_optimization(optimize)?;
                let (mut arm, mut remove, mut optimized) = (Vec::new(), Vec::new(), 0);
                for _ in 0..args.runs {
                    let requests: Vec<KprobeRequest> = sites[..n]
                        .iter()
                        .flat_map(|&s| function_requests(kind, s, cpus, false))
                        .collect();
                    let t = Instant::now();
                    if let Err((i, e)) = tracer.register_all(requests) {
                        result = Err(format!("arming {n} functions: probe {i}: {e}"));
                        break 'rows;
                    }
                    arm.push(t.elapsed().as_secs_f64() * 1e3);
                    optimized = tracer.listing().iter().filter(|e| e.optimized).count();
                    let t = Instant::now();
                    if let Err(e) = tracer.unregister_all() {
                        result = Err(format!("removing {n} functions: {e}"));
                        break 'rows;
                    }
                    remove.push(t.elapsed().as_secs_f64() * 1e3);
                }
                arm.sort_by(f64::total_cmp);
                remove.sort_by(f64::total_cmp);
                let (a, r) = (arm[arm.len() / 2], remove[remove.len() / 2]);
                println!(
                    "{n:>7}  {what:<14}  {:>8}  {a:>8.1}  {r:>10.1}  {:>10.1}  {optimized:>9}",
                    if optimize { "on" } else { "off" },
                    a * 1e3 / n as f64,
                );
            }
        }
    }
    control.stop(StopReason::Stopped);
    let outcome = runner.join().map_err(|_| "the VM's thread panicked")??;
    result?;
    if outcome.reason != StopReason::Stopped {
        return Err(format!("the guest stopped during the benchmark: {}", outcome.reason).into());
    }
    if !args.no_per_call {
        per_call(&dir, args.cpus, args.calls)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One run's exits and emulated instructions, from its summary line.
fn run_costs(dir: &std::path::Path, cpus: u8, workload: &str, extra: &[&str]) -> Result<(u64, u64), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["run", "--snapshot"])
        .arg(dir)
        .args([
            "--cpus",
            &cpus.to_string(),
            "--no-control",
            "--format",
            "none",
            "--workload",
            workload,
        ])
        .args(extra)
        .output()
        .map_err(|e| e.to_string())?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{workload} {extra:?} failed:\n{stderr}"));
    }
    let summary = stderr
        .lines()
        .find(|l| l.contains(" instructions emulated"))
        .ok_or_else(|| format!("no summary line:\n{stderr}"))?;
    let number_before = |word: &str| -> Option<u64> {
        let at = summary.find(word)?;
        summary[..at].split_whitespace().last()?.parse().ok()
    };
    match (number_before(" exits"), number_before(" instructions emulated")) {
        (Some(exits), Some(insns)) => Ok((exits, insns)),
        _ => Err(format!("unreadable summary: {summary}")),
    }
}

/// The workload of a per-call run with N calls.
type Workload = Box<dyn Fn(u32) -> String>;

/// Exits and emulated instructions per traced call, per configuration.
fn per_call(dir: &std::path::Path, cpus: u8, calls: u32) -> Result<(), Box<dyn std::error::Error>> {
    const FUNCTION: &str = "__do_sys_getppid";
    let function = FUNCTION;
    let guest_graph = |n: u32| {
        format!(
            "T=/sys/kernel/tracing; echo {FUNCTION} > $T/set_ftrace_filter; echo function_graph > $T/current_tracer; \
             taskset -c 0 hvprobe-loop {n}; echo nop > $T/current_tracer"
        )
    };
    let host = |n: u32| format!("taskset -c 0 hvprobe-loop {n}");
    let mut configs: Vec<(String, Workload, Vec<&str>)> = vec![("untraced".to_owned(), Box::new(host), vec![])];
    for tracer in ["function", "function_graph"] {
        for (optimize, path) in [("off", "int3"), ("on", "optimized")] {
            configs.push((
                format!("host {tracer}, {path}"),
                Box::new(host),
                vec!["--tracer", tracer, "--ftrace-filter", FUNCTION, "--optimize", optimize],
            ));
        }
    }
    configs.push(("guest's own function_graph".to_owned(), Box::new(guest_graph), vec![]));
    println!();
    println!("one getppid() call with {function} traced ({calls} and {} calls a run; per call: the difference over {calls}):", 2 * calls);
    println!(
        "{:<32}  {:>10}  {:>14}  {:>12}  {:>14}",
        "configuration", "exits", "instructions", "exits added", "insns added"
    );
    let mut base = None;
    for (name, workload, extra) in &configs {
        let (e1, i1) = run_costs(dir, cpus, &workload(calls), extra)?;
        let (e2, i2) = run_costs(dir, cpus, &workload(2 * calls), extra)?;
        let per = |a: u64, b: u64| (b as f64 - a as f64) / f64::from(calls);
        let (exits, insns) = (per(e1, e2), per(i1, i2));
        let (base_exits, base_insns) = *base.get_or_insert((exits, insns));
        println!(
            "{name:<32}  {exits:>10.2}  {insns:>14.1}  {:>12.2}  {:>14.1}",
            exits - base_exits,
            insns - base_insns
        );
    }
    Ok(())
}
