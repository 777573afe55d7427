//! `hvprobe bench probes`: what a probe hit costs, measured side by side in one run.
//!
//! Two parts. On a code blob (no kernel), a loop of known instructions runs with no probe,
//! with a bare int3 (the floor: exit, move RIP, resume), with a probe whose instruction the
//! host emulates and with one that is stepped out of line: host time and exits per hit,
//! exact. On the bundled guest, `getppid()` in a loop runs with no probe, with the guest's
//! own kprobe event, and with host probes on the same function: host time and guest
//! instructions per call.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_arch::debugreg::Access;
use hvprobe_arch::Gva;
use hvprobe_live::{build_tracer, code_blob_tracer, live_memory, load_symbols, ProbeHandler, SymbolsFrom};
use hvprobe_probes::engine::{KprobeRequest, ProbeKind, ProbePoint};
use hvprobe_vmm::{BreakpointDisposition, CodeBlob, ConsoleOutput, DebugHandler, NoProbes, StopReason, Vm, VmOutcome};
use kvm_ioctls::VcpuFd;

use crate::cli::ProbeBenchArgs;
use hvprobe_session::guest::workload_message;

use crate::cmd::CliResult;

/// The blob's loop: `mov $N,%ecx`, then per iteration `nop` (an `int3` for the floor),
/// `push %rbp` (emulated), `mov disp(%rip),%rax` (stepped), `pop %rbp`, `dec %ecx`, `jnz`.
fn loop_blob(iterations: u32, with_int3: bool) -> Vec<u8> {
    let mut code = vec![0xb9];
    code.extend_from_slice(&iterations.to_le_bytes()); // 0x00 mov $N,%ecx
    code.push(if with_int3 { 0xcc } else { 0x90 }); // 0x05
    code.push(0x55); // 0x06 push %rbp
    code.extend_from_slice(&[0x48, 0x8b, 0x05, 0xf2, 0x0f, 0x00, 0x00]); // 0x07 mov 0xff2(%rip),%rax
    code.push(0x5d); // 0x0e pop %rbp
    code.extend_from_slice(&[0xff, 0xc9]); // 0x0f dec %ecx
    code.extend_from_slice(&[0x75, 0xf2]); // 0x11 jnz 0x05
    code.extend_from_slice(&[0x66, 0xba, 0xf1, 0x0e, 0x30, 0xc0, 0xee, 0xf4]); // exit 0
    debug_assert_eq!(code.len() as u64, LOOP_BLOB_LEN);
    code.resize(0x1000, 0);
    code.extend_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
    code
}
/// The blob's code (the `blob` symbol the probes name), without the padding after it.
const LOOP_BLOB_LEN: u64 = 0x1b;
const PUSH_OFFSET: u64 = 0x06;
const LOAD_OFFSET: u64 = 0x07;

/// A floor: an int3 nobody owns, passed over by moving RIP (what every hit needs at least),
/// its registers through kvm_run's sync area (the bare floor: no ioctl) or by
/// KVM_GET_REGS/KVM_SET_REGS.
struct SkipInt3 {
    ioctls: bool,
}

impl DebugHandler for SkipInt3 {
    fn on_breakpoint(&self, _cpu: usize, vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition {
        if self.ioctls {
            if let Ok(mut regs) = vcpu.get_regs() {
                regs.rip = at.0 + 1;
                let _ = vcpu.set_regs(&regs);
            }
        } else if let Ok(mut regs) = hvprobe_vmm::exit_regs::read(vcpu) {
            regs.rip = at.0 + 1;
            let _ = hvprobe_vmm::exit_regs::write(vcpu, &regs);
        }
        BreakpointDisposition::Handled
    }
}

enum BlobVariant {
    Baseline,
    /// The int3 floor, its registers by ioctl (`true`) or through the sync area.
    Floor(bool),
    Probe(u64),
    /// A probe jump-optimized (a sync detour).
    Optimized(u64),
    /// An execution watch (a debug register) on the instruction at the offset.
    Watch(u64),
}

fn run_blob(iterations: u32, variant: &BlobVariant) -> Result<(VmOutcome, Duration), Box<dyn std::error::Error>> {
    let vm = Vm::new_code_blob(&CodeBlob {
        code: loop_blob(iterations, matches!(variant, BlobVariant::Floor(_))),
        cpus: 1,
        handlers: Vec::new(),
    })?;
    let handler: Arc<dyn DebugHandler> = match variant {
        BlobVariant::Baseline => Arc::new(NoProbes),
        BlobVariant::Floor(ioctls) => Arc::new(SkipInt3 { ioctls: *ioctls }),
        BlobVariant::Probe(offset) | BlobVariant::Optimized(offset) | BlobVariant::Watch(offset) => {
            let tracer = code_blob_tracer(&vm, LOOP_BLOB_LEN)?;
            tracer.set_optimization(matches!(variant, BlobVariant::Optimized(_)))?;
            let point = ProbePoint::Symbol {
                name: "blob".into(),
                offset: *offset,
            };
            let kind = match variant {
                BlobVariant::Watch(_) => ProbeKind::Watch {
                    access: Access::Execute,
                    len: 1,
                },
                _ => ProbeKind::Kprobe,
            };
            let id = tracer.register(KprobeRequest {
                kind,
                emit_events: false,
                ..KprobeRequest::event(point, "bench", "blob", Vec::new())
            })?;
            if let (BlobVariant::Optimized(_), Some(why)) = (variant, tracer.why_not_optimized(id)) {
                return Err(format!("the blob's probe at +{offset:#x} is not optimized: {why}").into());
            }
            let handler = ProbeHandler::new(&vm);
            handler.attach(tracer, None);
            handler
        }
    };
    let started = Instant::now();
    let outcome = vm.run(handler)?;
    let elapsed = started.elapsed();
    if outcome.reason != StopReason::GuestExit(0) {
        return Err(format!("the benchmark blob ended with {}", outcome.reason).into());
    }
    Ok((outcome, elapsed))
}

/// One guest variant: host probes to register (symbol, offset) and which of the guest's own
/// kprobe events is enabled.
struct GuestVariant {
    label: &'static str,
    host_probes: &'static [(&'static str, u64)],
    /// The guest's own event enabled ([`GUEST_EVENTS`]).
    guest_event: Option<&'static str>,
    /// The host probes jump-optimized.
    optimize: bool,
    /// The host probes only record (event probes with four register/stack fetch-args):
    /// optimized, their detours write each hit into a ring in the guest.
    record: bool,
    /// The event filter of the recording probes (their detours run it in the guest), and
    /// whether it discards every call's hit (else it keeps every one).
    filter: Option<(&'static str, bool)>,
    /// The host probes are return probes recording `$retval` and `$duration` (trapped: an
    /// exit at the entry, one at the return; exit-free when optimized).
    ret: bool,
}

const GUEST_VARIANTS: [GuestVariant; 14] = [
    GuestVariant {
        label: "no probe",
        host_probes: &[],
        guest_event: None,
        optimize: false,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "guest's own kprobe event on __x64_sys_getppid+0 (ftrace-based)",
        host_probes: &[],
        guest_event: Some("gk"),
        optimize: false,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "host probe on __x64_sys_getppid+0 (int3 at +5, stepped out of line)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: false,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "host probe on __task_pid_nr_ns+0 (int3 at +5, push emulated)",
        host_probes: &[("__task_pid_nr_ns", 0)],
        guest_event: None,
        optimize: false,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "optimized sync host probe on __x64_sys_getppid+0 (jump at +5 to a detour, one exit)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: true,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "optimized sync host probe on __task_pid_nr_ns+0 (jump at +5 to a detour, one exit)",
        host_probes: &[("__task_pid_nr_ns", 0)],
        guest_event: None,
        optimize: true,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "optimized event host probe on __x64_sys_getppid+0, 4 fetch-args (recorded in the guest, no exit)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: true,
        record: true,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "the same, filter `di != 0` run in the detour (keeps every hit)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: true,
        record: true,
        filter: Some(("di != 0", false)),
        ret: false,
    },
    GuestVariant {
        label: "the same, filter `di == 0` run in the detour (discards every hit in the guest: no record)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: true,
        record: true,
        filter: Some(("di == 0", true)),
        ret: false,
    },
    GuestVariant {
        label: "guest's own kprobe event on __task_pid_nr_ns+0x45 (mid-function: its optprobe, a jump)",
        host_probes: &[],
        guest_event: Some("go"),
        optimize: false,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "optimized event host probe on __task_pid_nr_ns+0x45, 4 fetch-args (recorded in the guest, no exit)",
        host_probes: &[("__task_pid_nr_ns", MID_FUNCTION)],
        guest_event: None,
        optimize: true,
        record: true,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "guest's own kretprobe event on __x64_sys_getppid, $retval (per call: entry and return)",
        host_probes: &[],
        guest_event: Some("gr"),
        optimize: false,
        record: false,
        filter: None,
        ret: false,
    },
    GuestVariant {
        label: "host return probe on __x64_sys_getppid, $retval and $duration, trapped (per call: entry and return)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: false,
        record: true,
        filter: None,
        ret: true,
    },
    GuestVariant {
        label:
            "exit-free host return probe on __x64_sys_getppid, $retval and $duration (recorded in the guest, no exit)",
        host_probes: &[("__x64_sys_getppid", 0)],
        guest_event: None,
        optimize: true,
        record: true,
        filter: None,
        ret: true,
    },
];
/// Indexes in [`GUEST_VARIANTS`] of the return probes' rows, for the ratios.
const GUEST_KRETPROBE: usize = 11;
const TRAPPED_RETURN: usize = 12;
const EXIT_FREE_RETURN: usize = 13;

/// The mid-function probes' offset in `__task_pid_nr_ns`: `mov 0x5d8(%rdi),%rax` in the
/// bundled guest (getppid's path, 7 bytes: the guest's optprobe and our jump both fit);
/// `tests/integration/probes.rs` checks the instruction is there.
const MID_FUNCTION: u64 = 0x45;

/// The guest's own kprobe events every variant defines (only one enables one): `gk` at
/// the entry of getppid (ftrace-based, as the kernel does at `+0`), `go` mid-function,
/// where the kernel jump-optimizes its probe (checked in its `kprobes/list`).
const GUEST_EVENTS: [&str; 3] = [
    "p:gk __x64_sys_getppid",
    "p:go __task_pid_nr_ns+0x45",
    "r:gr __x64_sys_getppid ret=$retval",
];
/// What the guest prints when its `go` probe is `[OPTIMIZED]`.
const GUEST_OPTIMIZED: &str = "GUEST-OPTPROBE-OPTIMIZED";

struct GuestRun {
    /// The getppid() loop alone, as the guest's `hvprobe-loop` timed it (CLOCK_MONOTONIC:
    /// no exec, no shell).
    loop_time: Duration,
    instructions: u64,
    exits: u64,
    /// Host probes' hits and the host time spent handling them.
    hits: u64,
    handling: Duration,
}

fn run_guest(
    dir: &std::path::Path,
    calls: u32,
    variant: &GuestVariant,
) -> Result<GuestRun, Box<dyn std::error::Error>> {
    let mut vm = Vm::restore(dir, Some(1), ConsoleOutput::Discard, &[])?;
    let mut tracer_used = None;
    let handler: Arc<dyn DebugHandler> = if variant.host_probes.is_empty() {
        Arc::new(NoProbes)
    } else {
        let state = vm.vcpu_state(0)?;
        let symbols = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), &state), state.lstar)?.table;
        let tracer = build_tracer(vm.control(), vm.memory(), &state, &symbols, None)?;
        tracer.set_optimization(variant.optimize)?;
        for (name, offset) in variant.host_probes {
            let point = ProbePoint::Symbol {
                name: name.to_string(),
                offset: *offset,
            };
            let args = match (variant.record, variant.ret) {
                (true, false) => match hvprobe_probes::spec::parse_line("p x di=%di si=%si s0=$stack0 s1=$stack1") {
                    Ok(Some(hvprobe_probes::spec::ProbeSpec::Kprobe { args, .. })) => args,
                    other => return Err(format!("the benchmark's fetch-args: {other:?}").into()),
                },
                (true, true) => match hvprobe_probes::spec::parse_line("r x ret=$retval lat=$duration") {
                    Ok(Some(hvprobe_probes::spec::ProbeSpec::Kretprobe { args, .. })) => args,
                    other => return Err(format!("the benchmark's fetch-args: {other:?}").into()),
                },
                (false, _) => Vec::new(),
            };
            let filter = match variant.filter {
                Some((text, _)) => {
                    let fields = hvprobe_analysis::fields::EventFields::new(&args);
                    let bound = hvprobe_analysis::filter::FilterExpr::parse(text).and_then(|f| f.bind(&fields))?;
                    Some(bound.record_filter(&args))
                }
                None => None,
            };
            let kind = match variant.ret {
                true => hvprobe_probes::engine::ProbeKind::Kretprobe { maxactive: 16 },
                false => hvprobe_probes::engine::ProbeKind::Kprobe,
            };
            let id = tracer.register(KprobeRequest {
                emit_events: variant.record,
                filter,
                kind,
                ..KprobeRequest::event(point, "bench", name, args)
            })?;
            if let (true, Some(why)) = (variant.optimize, tracer.why_not_optimized(id)) {
                return Err(format!("{name}+{offset}: not optimized: {why}").into());
            }
        }
        let handler = ProbeHandler::new(&vm);
        handler.attach(tracer.clone(), None);
        tracer_used = Some(tracer);
        handler
    };
    // Every variant defines the guest's events, waits a second (the kernel optimizes a
    // kprobe some jiffies after it is enabled) and reads its probe list; one enables one.
    let define: String = GUEST_EVENTS
        .iter()
        .map(|e| format!("echo '{e}' >> $T/kprobe_events; "))
        .collect();
    let enable = variant
        .guest_event
        .map(|e| format!("echo 1 > $T/events/kprobes/{e}/enable; "))
        .unwrap_or_default();
    let workload = format!(
        "T=/sys/kernel/tracing; {define}{enable}busybox sleep 1; \
         while read l; do case $l in *'[OPTIMIZED]'*) echo {GUEST_OPTIMIZED};; esac; done < /sys/kernel/debug/kprobes/list; \
         hvprobe-loop {calls}"
    );
    vm.send_console_input(workload_message(&workload));
    let console = vm.console_log();
    let outcome = vm.run(handler)?;
    if outcome.reason != StopReason::GuestExit(0) {
        return Err(format!("the guest run ended with {}\n{}", outcome.reason, console.tail(20)).into());
    }
    if variant.guest_event == Some("go") && !console.contents().contains(GUEST_OPTIMIZED) {
        return Err(format!(
            "the guest did not jump-optimize its probe on __task_pid_nr_ns+0x45\n{}",
            console.tail(20)
        )
        .into());
    }
    let (hits, handling, filtered_in_guest) = tracer_used.map_or((0, Duration::ZERO, 0), |t| {
        use std::sync::atomic::Ordering::Relaxed;
        t.drain_events();
        (
            t.stats.hits.load(Relaxed),
            Duration::from_nanos(t.stats.handling_ns.load(Relaxed)),
            t.stats.filtered_in_guest.load(Relaxed),
        )
    });
    if let Some((text, discards_all)) = variant.filter {
        let expected = if discards_all { hits } else { 0 };
        if hits < u64::from(calls) || filtered_in_guest != expected {
            return Err(format!(
                "filter `{text}`: {filtered_in_guest} of {hits} hits discarded in the guest, expected {expected} of at least {calls}"
            )
            .into());
        }
    }
    let loop_us: u64 = console
        .contents()
        .lines()
        .find_map(|l| {
            l.split(" getppid calls in ")
                .nth(1)?
                .strip_suffix(" us")?
                .trim()
                .parse()
                .ok()
        })
        .ok_or_else(|| format!("hvprobe-loop printed no loop time\n{}", console.tail(10)))?;
    Ok(GuestRun {
        loop_time: Duration::from_micros(loop_us),
        instructions: outcome.instructions_emulated,
        exits: outcome.exits,
        hits,
        handling,
    })
}

pub fn bench_probes(args: ProbeBenchArgs) -> CliResult {
    if args.iterations == 0 || args.calls == 0 || args.runs == 0 {
        return Err("--iterations, --calls and --runs must be at least 1".into());
    }
    let n = f64::from(args.iterations);
    println!("probe benchmark (backend: {})", hvprobe_vmm::Backend::detect());
    println!();
    println!(
        "code blob, {} loop iterations, one hit per iteration, median of {} runs (variants interleaved):",
        args.iterations, args.runs
    );
    let variants = [
        BlobVariant::Baseline,
        BlobVariant::Floor(false),
        BlobVariant::Probe(PUSH_OFFSET),
        BlobVariant::Probe(LOAD_OFFSET),
        BlobVariant::Optimized(PUSH_OFFSET),
        BlobVariant::Optimized(LOAD_OFFSET),
        BlobVariant::Floor(true),
        BlobVariant::Watch(PUSH_OFFSET),
    ];
    // Per variant: (time per iteration, exits per iteration) of every run.
    let mut per_iteration: Vec<Vec<(f64, f64)>> = vec![Vec::new(); variants.len()];
    for _ in 0..args.runs {
        for (i, variant) in variants.iter().enumerate() {
            let (outcome, time) = run_blob(args.iterations, variant)?;
            per_iteration[i].push((time.as_secs_f64() / n * 1e6, outcome.exits as f64 / n));
        }
    }
    // Each run's cost over the baseline run of the same round, then the median.
    let over_baseline = |i: usize| -> (f64, f64) {
        let mut us: Vec<f64> = (0..per_iteration[i].len())
            .map(|r| per_iteration[i][r].0 - per_iteration[0][r].0)
            .collect();
        us.sort_by(f64::total_cmp);
        (us[us.len() / 2], per_iteration[i][0].1 - per_iteration[0][0].1)
    };
    let floor = over_baseline(1);
    let emulated = over_baseline(2);
    let stepped = over_baseline(3);
    let optimized_push = over_baseline(4);
    let optimized_load = over_baseline(5);
    let ioctl_floor = over_baseline(6);
    let watch = over_baseline(7);
    let mut base: Vec<f64> = per_iteration[0].iter().map(|p| p.0).collect();
    base.sort_by(f64::total_cmp);
    println!(
        "  no probe:                                  {:8.2} µs per iteration",
        base[base.len() / 2]
    );
    for (label, (us, exits)) in [
        ("int3 exit + resume floor (bare)", floor),
        ("int3 floor with KVM_GET/SET_REGS ioctls", ioctl_floor),
        ("host probe, emulated (push %rbp)", emulated),
        ("host probe, stepped (RIP-relative load)", stepped),
        ("optimized sync probe (push %rbp)", optimized_push),
        ("optimized sync probe (RIP-relative load)", optimized_load),
        ("execution watch, debug register (push %rbp)", watch),
    ] {
        println!(
            "  {label:<42} {us:8.2} µs per hit   {exits:5.2} exits per hit   {:5.2}x the floor",
            us / floor.0
        );
    }

    println!();
    let dir = super::bench_snapshot(args.snapshot.as_deref(), 1)?;
    println!(
        "bundled guest, a getppid() loop of {} calls timed by the guest itself, median of {} runs (variants \
         interleaved); per hit = (variant - no probe in the same round) / calls:",
        args.calls, args.runs
    );
    let calls = f64::from(args.calls);
    // Per variant and round: (loop µs per call, guest instructions per call, exits per
    // call, host handling µs per hit).
    let mut rounds: Vec<Vec<(f64, f64, f64, f64)>> = vec![Vec::new(); GUEST_VARIANTS.len()];
    for _ in 0..args.runs {
        for (i, variant) in GUEST_VARIANTS.iter().enumerate() {
            let r = run_guest(&dir, args.calls, variant)?;
            rounds[i].push((
                r.loop_time.as_secs_f64() * 1e6 / calls,
                r.instructions as f64 / calls,
                r.exits as f64 / calls,
                r.handling.as_secs_f64() * 1e6 / r.hits.max(1) as f64,
            ));
        }
    }
    // Median and range over the rounds, relative to the same round's run without probes.
    let stat = |i: usize, pick: fn(&(f64, f64, f64, f64)) -> f64, relative: bool| -> (f64, f64, f64) {
        let mut v: Vec<f64> = (0..rounds[i].len())
            .map(|r| pick(&rounds[i][r]) - if relative { pick(&rounds[0][r]) } else { 0.0 })
            .collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (base_us, lo, hi) = stat(0, |s| s.0, false);
    println!("  no probe: {base_us:.0} µs per getppid() call ({lo:.0}..{hi:.0})");
    let mut guest_kprobe_us = f64::NAN;
    // Per return variant: (µs, guest instructions, exits) per call.
    let mut returns = [(f64::NAN, f64::NAN, f64::NAN); 3];
    for (i, variant) in GUEST_VARIANTS.iter().enumerate().skip(1) {
        let (us, ulo, uhi) = stat(i, |s| s.0, true);
        let (instr, ilo, ihi) = stat(i, |s| s.1, true);
        let (exits, _, _) = stat(i, |s| s.2, true);
        let (handling, _, _) = stat(i, |s| s.3, false);
        if i == 1 {
            guest_kprobe_us = us;
        }
        if let Some(k) = [GUEST_KRETPROBE, TRAPPED_RETURN, EXIT_FREE_RETURN]
            .iter()
            .position(|&r| r == i)
        {
            returns[k] = (us, instr, exits);
        }
        println!("  {}", variant.label);
        let host = if variant.host_probes.is_empty() {
            String::new()
        } else {
            format!(", {handling:.1} µs of host handling per hit")
        };
        println!(
            "      {us:+.1} µs ({ulo:+.1}..{uhi:+.1}) per hit, {exits:+.2} exits per hit{host}; \
             {instr:+.0} ({ilo:+.0}..{ihi:+.0}) guest instructions per call over the whole run"
        );
    }
    println!();
    println!(
        "ratios per hit, the guest's own kprobe event / a host probe (the host probe's cost measured on the blob):"
    );
    println!(
        "  guest kprobe event / stepped host probe:  {:8.1}x",
        guest_kprobe_us / stepped.0
    );
    println!(
        "  guest kprobe event / emulated host probe: {:8.1}x",
        guest_kprobe_us / emulated.0
    );
    println!(
        "  (kvm_pvm emulates every guest kernel instruction, so the guest's in-kernel probe pays ~1 µs per \
         instruction; on hardware KVM the kernel runs natively and a host probe's exits dominate instead)"
    );
    println!();
    println!("return probes per call (entry and return), side by side:");
    let [guest, trapped, exit_free] = returns;
    for (label, (us, instr, exits)) in [
        ("guest's own kretprobe event", guest),
        ("host return probe, trapped", trapped),
        ("host return probe, exit-free", exit_free),
    ] {
        println!("  {label:<30} {us:+9.1} µs   {exits:+6.2} exits   {instr:+8.0} guest instructions");
    }
    println!(
        "  guest kretprobe / exit-free: {:.1}x the time, {:.1}x the instructions; trapped / exit-free: {:.1}x the time",
        guest.0 / exit_free.0,
        guest.1 / exit_free.1,
        trapped.0 / exit_free.0
    );
    Ok(ExitCode::SUCCESS)
}
