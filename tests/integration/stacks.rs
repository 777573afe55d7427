//! Kernel stacks unwound on the host (the `stacktrace` trigger), checked against the
//! guest's own `stacktrace` trigger on the same hits (the oracle): the same callers,
//! function and offset, for every hit.
//!
//! - `vfs_write` from the only task called `busybox` (an `echo WORD > /dev/null` loop): a
//!   system call's stack, down to the entry from user mode.
//! - `update_process_times`, from the timer interrupt: the stack runs through the IRQ stack
//!   and the interrupt's register frame into whatever the CPU was doing.
//!
//! The guest's own trace has its trigger's frames on top (`kprobe_trace_func`, ...,
//! the ftrace trampoline) and the probed function at `+0x5` (its kprobe sits on the
//! function's ftrace call); the host's starts at the probe (`+0x0`). So the two are
//! compared from the probed function down: its name, then every caller exactly.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{probe_file, restore_with, snapshot, Run};

const RESTORE_TIMEOUT: Duration = Duration::from_secs(420);

const HOST_PROBES: &str = "p:ana/write vfs_write\np:ana/tick update_process_times\n";
/// Guest stack traces of timer ticks to compare (each costs the guest a lot of emulated
/// work and serial output).
const TICKS: usize = 5;

/// The guest's own probes with `stacktrace` triggers (frames with offsets), the workload
/// while they are on, then the guest's trace file, each line prefixed `GUEST `. A return
/// probe of the guest's own on `ksys_write` (its events discarded) swaps the return address
/// of `ksys_write`'s frame for its trampoline during the loop: the guest's unwinder finds
/// the real one in the task's rethook list, and so must the host's. The tick
/// probe's filter discards every event: the kernel runs a `stacktrace` trigger on a
/// discarded event too, so its trace holds just the first stacks. The trace is read by
/// `sed`, a page a call (the shell's `read` takes a system call a byte, and every timer tick
/// meanwhile is a host stack; busybox `cat` of the trace file repeated it endlessly), run
/// under the name `sed`: its writes are not the loop's `busybox` ones.
fn workload(ticks: bool) -> String {
    let (tick_on, tick_off) = if ticks {
        (
            format!(
                "echo 'p:gt update_process_times' >> $T/kprobe_events; \
                 echo 'common_pid < 0' > $T/events/kprobes/gt/filter; \
                 echo 'stacktrace:{TICKS}' > $T/events/kprobes/gt/trigger; echo 1 > $T/events/kprobes/gt/enable; "
            ),
            // Until the trigger has taken its stacks (the loop takes milliseconds on
            // hardware KVM), and no longer: each tick the guest's kprobe takes costs
            // thousands of emulated instructions on kvm_pvm, and on a loaded host that
            // left the guest no time between ticks. The trigger file says `count=0` then.
            // The wait reads the file a byte a system call: kernel code for the ticks to
            // interrupt. It gives up after a minute of the guest's uptime (the test then
            // counts too few stacks).
            "read -r up _ < /proc/uptime; end=$((${up%.*} + 60)); \
             while read -r t < $T/events/kprobes/gt/trigger; [ \"${t#*count=0}\" = \"$t\" ] \
             && read -r up _ < /proc/uptime && [ ${up%.*} -lt $end ]; do :; done; \
             echo 0 > $T/events/kprobes/gt/enable; ",
        )
    } else {
        (String::new(), "")
    };
    format!(
        "T=/sys/kernel/tracing; echo 1 > $T/options/sym-offset; \
         echo 'p:gw vfs_write' > $T/kprobe_events; \
         echo 'stacktrace if comm == \"busybox\"' > $T/events/kprobes/gw/trigger; \
         echo 'comm == \"busybox\"' > $T/events/kprobes/gw/filter; {tick_on}\
         echo 'r:gk ksys_write' >> $T/kprobe_events; echo 'common_pid < 0' > $T/events/kprobes/gk/filter; \
         echo 1 > $T/events/kprobes/gk/enable; echo 1 > $T/events/kprobes/gw/enable; \
         busybox sh -c 'for s in a bb ccc dddd; do echo $s > /dev/null; done'; \
         echo 0 > $T/events/kprobes/gw/enable; echo 0 > $T/events/kprobes/gk/enable; {tick_off}sleep 1; \
         ln -s /bin/busybox /tmp/sed; /tmp/sed 's/^/GUEST /' $T/trace; echo CONSOLE-END; sleep 2"
    )
}

/// One stack entry of a trace: the CPU it was taken on and its frames.
#[derive(Debug)]
struct Stack {
    cpu: u32,
    frames: Vec<String>,
}

/// Every `<stack trace>` entry of the lines (the host's, or with `GUEST ` stripped, the
/// guest's), in order.
fn stacks(lines: impl Iterator<Item = String>) -> Vec<Stack> {
    let mut out: Vec<Stack> = Vec::new();
    let mut current: Option<Stack> = None;
    for line in lines {
        if let Some(frame) = line.strip_prefix(" => ") {
            if let Some(s) = current.as_mut() {
                s.frames.push(frame.trim().to_owned());
            }
            continue;
        }
        out.extend(current.take());
        if line.contains(": <stack trace>") {
            let cpu = line
                .split('[')
                .nth(1)
                .and_then(|c| c.split(']').next())
                .and_then(|c| c.trim().parse().ok())
                .unwrap_or_else(|| panic!("no CPU in {line}"));
            current = Some(Stack {
                cpu,
                frames: Vec::new(),
            });
        }
    }
    out.extend(current);
    out
}

fn function(frame: &str) -> &str {
    frame.split('+').next().unwrap_or(frame)
}

/// The probed functions.
const PROBED: [&str; 2] = ["vfs_write", "update_process_times"];

/// The stacks of hits of `probed`, from its frame down: `(cpu, callers)`, the probed
/// function's own frame checked by name and dropped. A stack is a hit of the first probed
/// function in it (a tick can interrupt `vfs_write`: that stack is the tick's).
fn through(stacks: &[Stack], probed: &str) -> Vec<(u32, Vec<String>)> {
    stacks
        .iter()
        .filter_map(|s| {
            let at = s.frames.iter().position(|f| PROBED.contains(&function(f)))?;
            (function(&s.frames[at]) == probed).then(|| (s.cpu, s.frames[at + 1..].to_vec()))
        })
        .collect()
}

fn host_and_guest_stacks(run: &Run) -> (Vec<Stack>, Vec<Stack>) {
    let host = stacks(
        run.stdout
            .lines()
            .filter(|l| !l.starts_with("GUEST "))
            .map(str::to_owned),
    );
    let guest = stacks(
        run.stdout
            .lines()
            .filter_map(|l| l.strip_prefix("GUEST "))
            .map(|l| l.trim_start().to_owned())
            .map(|l| if l.starts_with("=> ") { format!(" {l}") } else { l }),
    );
    (host, guest)
}

fn check_run(run: &Run, ticks: bool) {
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.console_has_line("CONSOLE-END"),
        "the console was cut short\n{}",
        run.tail()
    );
    common::assert_guest_healthy(run, &[]);
    let (host, guest) = host_and_guest_stacks(run);
    for s in &host {
        let first = s.frames.first().map(String::as_str).unwrap_or("");
        assert!(
            first.starts_with("vfs_write+0x0/") || first.starts_with("update_process_times+0x0/"),
            "a host stack starts at the probe, not at {first:?}: {s:?}"
        );
    }

    // The loop's writes: the same callers, in the same order.
    let host_writes = through(&host, "vfs_write");
    let guest_writes = through(&guest, "vfs_write");
    assert_eq!(guest_writes.len(), 4, "the guest's write stacks\n{}", run.tail());
    assert_eq!(
        host_writes.iter().map(|(_, f)| f).collect::<Vec<_>>(),
        guest_writes.iter().map(|(_, f)| f).collect::<Vec<_>>(),
        "\n{}",
        run.tail()
    );
    assert!(
        guest_writes[0].1.iter().any(|f| function(f) == "ksys_write"),
        "{guest_writes:?}"
    );
    if !ticks {
        return;
    }

    // Ticks: the guest's first stacks in its window are consecutive hits of the host's on
    // the same CPU, through the interrupt frame into the interrupted code.
    let guest_ticks = through(&guest, "update_process_times");
    assert_eq!(guest_ticks.len(), TICKS, "the guest's tick stacks\n{}", run.tail());
    let mut host_by_cpu: BTreeMap<u32, Vec<Vec<String>>> = BTreeMap::new();
    for (cpu, frames) in through(&host, "update_process_times") {
        host_by_cpu.entry(cpu).or_default().push(frames);
    }
    let mut guest_by_cpu: BTreeMap<u32, Vec<Vec<String>>> = BTreeMap::new();
    let mut into_kernel_code = 0;
    for (cpu, frames) in guest_ticks {
        let entry = frames
            .iter()
            .position(|f| function(f) == "asm_sysvec_apic_timer_interrupt")
            .unwrap_or_else(|| panic!("not from the timer interrupt: {frames:?}"));
        // A tick that interrupted user mode ends at the interrupt's frame.
        if entry + 1 < frames.len() {
            into_kernel_code += 1;
        }
        guest_by_cpu.entry(cpu).or_default().push(frames);
    }
    assert!(
        into_kernel_code > 0,
        "no tick of the guest's interrupted kernel code (all {TICKS} came from user mode)"
    );
    for (cpu, guest) in guest_by_cpu {
        let host = host_by_cpu.get(&cpu).map(Vec::as_slice).unwrap_or(&[]);
        assert!(
            host.windows(guest.len()).any(|w| w == guest.as_slice()),
            "CPU {cpu}: the guest's tick stacks are not consecutive host stacks\nguest: {guest:#?}\nhost: {:#?}",
            &host[..host.len().min(20)]
        );
    }
}

fn restored_run(cpus: u8) -> Run {
    let dir = snapshot(cpus);
    let probes = probe_file(&format!("stacks-{cpus}"), HOST_PROBES);
    let run = restore_with(
        &dir,
        cpus,
        &workload(true),
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--no-control",
            "--sym-offset",
            "--filter",
            "ana/write:comm == \"busybox\"",
            "--trigger",
            "ana/write:stacktrace",
            "--trigger",
            "ana/tick:stacktrace",
        ],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    run
}

#[test]
fn host_stacks_equal_the_guests_own_on_one_vcpu_through_system_calls_and_interrupts() {
    let run = restored_run(1);
    check_run(&run, true);
    assert!(run.stderr.contains("kernel stacks unwound"), "{}", run.tail());
}

#[test]
fn host_stacks_equal_the_guests_own_on_two_vcpus() {
    check_run(&restored_run(2), true);
}

#[test]
fn host_stacks_equal_the_guests_own_under_kaslr_with_kallsyms_from_guest_memory_alone() {
    // A restore names the kernel's symbols from its kallsyms alone.
    let dir = common::kaslr_snapshot(1);
    let probes = probe_file("stacks-kaslr", "p:ana/write vfs_write\n");
    let workload = workload(false);
    let run = restore_with(
        &dir,
        1,
        &workload,
        &[
            "--no-control",
            "--sym-offset",
            "--probes",
            probes.to_str().unwrap(),
            "--filter",
            "ana/write:comm == \"busybox\"",
            "--trigger",
            "ana/write:stacktrace",
        ],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    common::assert_randomized(&run);
    assert!(
        run.stderr.contains("kernel symbols from guest kallsyms"),
        "{}",
        run.tail()
    );
    check_run(&run, false);
}

#[test]
fn stacks_come_as_a_frame_array_in_json_and_only_when_the_trigger_fires() {
    let dir = snapshot(1);
    let probes = probe_file("stacks-json", "p:ana/write vfs_write\n");
    let run = restore_with(
        &dir,
        1,
        "busybox sh -c 'for s in a bb ccc; do echo $s > /dev/null; done'",
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--no-control",
            "--format",
            "json",
            "--filter",
            "ana/write:comm == \"busybox\"",
            "--trigger",
            // The trigger sees every hit, also those the event's filter discards (as the
            // kernel's): its own `if` picks the loop's.
            "ana/write:stacktrace:2 if comm == \"busybox\"",
        ],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let hits: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("{\"comm\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(hits.len(), 3, "{}", run.tail());
    let with_stack: Vec<&serde_json::Value> = hits.iter().filter(|h| h.get("stack").is_some()).collect();
    assert_eq!(with_stack.len(), 2, "stacktrace:2 fires twice\n{}", run.tail());
    let frames = with_stack[0]["stack"].as_array().unwrap();
    assert!(frames[0]["symbol"].as_str().unwrap().starts_with("vfs_write+0x0/"));
    assert!(frames[0]["address"].as_str().unwrap().starts_with("0xffffffff"));
    assert!(
        frames
            .iter()
            .any(|f| f["symbol"].as_str().is_some_and(|s| s.starts_with("ksys_write+"))),
        "{frames:?}"
    );
}

/// The entries of a hist file keyed by `stacktrace` alone: (frames, hitcount), in order.
fn stack_hist(lines: impl Iterator<Item = String>) -> Vec<(Vec<String>, u64)> {
    let mut out = Vec::new();
    let mut frames: Option<Vec<String>> = None;
    for line in lines {
        let line = line.trim();
        if line == "{ stacktrace:" {
            frames = Some(Vec::new());
        } else if let Some(count) = line.strip_prefix("} hitcount:") {
            out.push((
                frames.take().expect("a stack before its count"),
                count.trim().parse().unwrap(),
            ));
        } else if let Some(f) = frames.as_mut() {
            f.push(line.to_owned());
        }
    }
    out
}

#[test]
fn a_hist_keyed_by_stacktrace_counts_the_stacks_the_guests_own_counts() {
    let dir = snapshot(1);
    let probes = probe_file("stack-hist", "p:ana/write vfs_write\n");
    // The loop's writes: one stack, three hits, on both sides.
    let workload = "T=/sys/kernel/tracing; echo 'p:gw vfs_write' > $T/kprobe_events; \
         echo 'hist:keys=stacktrace if comm == \"busybox\"' > $T/events/kprobes/gw/trigger; \
         echo 1 > $T/events/kprobes/gw/enable; \
         busybox sh -c 'for s in a bb ccc; do echo $s > /dev/null; done'; \
         echo 0 > $T/events/kprobes/gw/enable; \
         while read -r l; do echo \"GUEST $l\"; done < $T/events/kprobes/gw/hist; echo CONSOLE-END; sleep 2";
    let run = restore_with(
        &dir,
        1,
        workload,
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--no-control",
            "--format",
            "none",
            "--trigger",
            "ana/write:hist:keys=stacktrace if comm == \"busybox\"",
        ],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.console_has_line("CONSOLE-END"),
        "the console was cut short\n{}",
        run.tail()
    );
    let guest = stack_hist(
        run.stdout
            .lines()
            .filter_map(|l| l.strip_prefix("GUEST "))
            .map(str::to_owned),
    );
    let host = stack_hist(
        run.stdout
            .lines()
            .skip_while(|l| !l.starts_with("==> events/ana/write/hist <=="))
            .map(str::to_owned),
    );
    assert!(!guest.is_empty(), "{}", run.tail());
    // The guest's stacks start with its kprobe's own frames and the function at +0x5.
    let below = |frames: &[String]| -> Vec<String> {
        let at = frames
            .iter()
            .position(|f| function(f) == "vfs_write")
            .unwrap_or_else(|| panic!("vfs_write is not in {frames:?}"));
        frames[at + 1..].to_vec()
    };
    let guest: Vec<(Vec<String>, u64)> = guest.iter().map(|(f, n)| (below(f), *n)).collect();
    let host: Vec<(Vec<String>, u64)> = host
        .iter()
        .map(|(f, n)| {
            assert!(f[0].starts_with("vfs_write+0x0/"), "{f:?}");
            (f[1..].to_vec(), *n)
        })
        .collect();
    assert_eq!(host, guest, "\n{}", run.tail());
    assert_eq!(host.iter().map(|(_, n)| n).sum::<u64>(), 3);
}

/// An exit-free return probe on `ksys_write` (`--optimize on`): during every write its
/// stub is in `ksys_write`'s return slot — after the guest's own kretprobe on the same
/// function swapped in its trampoline, so the probe's entry found the caller in the task's
/// rethook list — and the host's stacks still name every caller, through the stub, down
/// to the entry from user mode. The guest's own unwinder does not know the stub (it is no
/// kernel text): its stacks stop at that frame, as they do at the trapped path's
/// trampoline (docs/known-issues.md); up to there they equal the host's.
#[test]
fn host_stacks_through_an_exit_free_return_probes_stub_equal_the_guests_own() {
    let dir = snapshot(1);
    let probes = probe_file(
        "stacks-exit-free",
        "p:ana/write vfs_write\nr:ana/ksysret ksys_write ret=$retval\n",
    );
    let run = restore_with(
        &dir,
        1,
        &workload(false),
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--no-control",
            "--sym-offset",
            "--filter",
            "ana/write:comm == \"busybox\"",
            // Its records would come between the lines of the guest's stacks.
            "--filter",
            "ana/ksysret:comm == \"nobody\"",
            "--trigger",
            "ana/write:stacktrace",
            "--optimize",
            "on",
        ],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &[]);
    let (host, guest) = host_and_guest_stacks(&run);
    let (host_writes, guest_writes) = (through(&host, "vfs_write"), through(&guest, "vfs_write"));
    assert_eq!(guest_writes.len(), 4, "the guest's write stacks\n{}", run.tail());
    assert_eq!(host_writes.len(), 4, "the host's write stacks\n{}", run.tail());
    for ((_, h), (_, g)) in host_writes.iter().zip(&guest_writes) {
        assert!(
            h.starts_with(g),
            "the guest's stack is the host's up to the stub\nhost {h:?}\nguest {g:?}"
        );
        assert_eq!(g.last().map(|f| function(f)), Some("ksys_write"), "{g:?}");
        assert!(
            h.iter()
                .any(|f| function(f) == "pvm_user_syscall_fault" || function(f) == "do_syscall_64"),
            "the host's goes on through the stub to the system call's entry: {h:?}"
        );
    }
    let listed = run
        .stderr
        .lines()
        .find(|l| l.contains("event=ana/ksysret"))
        .unwrap_or_else(|| panic!("no listing of the return probe\n{}", run.tail()));
    assert!(
        listed.contains("[OPTIMIZED]") && !listed.contains(" hits=0 "),
        "{listed}"
    );
}
