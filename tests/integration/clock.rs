//! Hits stamped on the guest's own clock, checked against the guest's own events of the
//! same run: the guest's kprobe event in its `trace` file (ftrace's `local` clock), its
//! own `sched_clock()` read at the very call the host stamps, and its dmesg (`global`).
//! Each restores a cached snapshot (1 vCPU; 2 for the per-CPU test): the restored guest's
//! clock goes on from the snapshot's, which is the common path.
//!
//! Tolerances, and why:
//! - Printed stamps (ours and the guest's) are microseconds, rounded: two stamps of the
//!   same moment can differ by [`PRINT_RESOLUTION_NS`].
//! - A trapped hit is stamped with the host's TSC when the host handles the exit, so after
//!   the guest's moment by the exit and the handling (about 60–160 µs measured on
//!   kvm_pvm here, more when the host deschedules the vCPU thread): never before it, except by how well
//!   the guest TSC's offset from the host's is known, which is half the narrowest
//!   `KVM_GET_MSRS` bracket (a few µs): [`TRAPPED_SKEW_NS`] allows 20 µs.
//! - An event detour's record carries the guest TSC of the hit, converted with the guest's
//!   own formula: no offset to estimate, only KVM re-anchoring its kvm-clock page between
//!   the hit and the drain (never with its master clock, which it runs here; sub-µs to a
//!   few µs without): [`RECORD_SKEW_NS`] allows 5 µs.
//! - The stamp follows the guest's own reading by what runs between (the exit, or a few
//!   dozen emulated instructions: 55–75 µs measured for a record, 200–290 µs for a return
//!   that also runs the event detour after the clock read): the median must stay under [`MEDIAN_LAG_NS`].
//!   In the nested-SVM lane (`guest/l1/run`, which hands COMMAND the lane's `HVPROBE_L1_*`
//!   variables) hvprobe itself runs under QEMU's TCG: a trapped hit's exit and our handling
//!   before the stamp took 0.5–1.3 ms there (medians 0.54–1.26 ms with this debug build,
//!   0.12–0.13 ms with a release build, while records, which involve no exit, stayed
//!   3–15 µs after the guest's reading), so there the median may reach
//!   [`LANE_MEDIAN_LAG_NS`]. The other bounds are the same everywhere.

use crate::common;

use std::time::Duration;

use common::{probe_file, restore_with, snapshot, Run};

const RESTORE_TIMEOUT: Duration = Duration::from_secs(300);
const PRINT_RESOLUTION_NS: i64 = 1_000;
const TRAPPED_SKEW_NS: i64 = 20_000;
const RECORD_SKEW_NS: i64 = 5_000;
const MEDIAN_LAG_NS: i64 = 1_000_000;
const LANE_MEDIAN_LAG_NS: i64 = 5_000_000;

/// Fails, with the reason, on a host that does not keep time with its TSC: KVM then runs
/// without its master clock and, once the host has marked its TSC unstable, moves each
/// vCPU's TSC offset at every entry, which stamps taken from the host's TSC cannot follow
/// (the lane's L1 without `HVPROBE_L1_TSC_RELIABLE=1`: trapped hits 170–202 ms early).
fn require_a_tsc_clocksource() {
    let path = "/sys/devices/system/clocksource/clocksource0/current_clocksource";
    let current = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(
        current.trim(),
        "tsc",
        "this host keeps time with {}, not its TSC: KVM's guest clock is not a function of the host's \
         TSC there (in the nested-SVM lane, run with HVPROBE_L1_TSC_RELIABLE=1, see guest/l1/run)",
        current.trim()
    );
}

/// The bound on the median lag: TCG time inside the nested-SVM lane, else the host's.
fn median_lag_bound() -> i64 {
    if std::env::var_os("HVPROBE_L1_QEMU").is_some() {
        LANE_MEDIAN_LAG_NS
    } else {
        MEDIAN_LAG_NS
    }
}

/// The busybox loop's writes: one `echo` each, one `ksys_write` → `vfs_write` each.
const WORDS: [&str; 6] = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"];

/// One line of ftrace's `trace` layout: `TASK-PID [CPU] [FLAGS] SECS.USECS: EVENT: (...) ARGS`.
#[derive(Clone, Debug)]
struct Stamped {
    task: String,
    micros: i64,
    args: String,
}

impl Stamped {
    fn parse(line: &str, event: &str) -> Option<Stamped> {
        let line = line.trim_end_matches('\r');
        let marker = format!(": {event}: (");
        let at = line.find(&marker)?;
        let before = &line[..at];
        let (secs, usecs) = before.split_whitespace().last()?.split_once('.')?;
        Some(Stamped {
            task: before.split_whitespace().next()?.to_string(),
            micros: secs.parse::<i64>().ok()? * 1_000_000 + usecs.parse::<i64>().ok()?,
            args: line[at + marker.len()..].to_string(),
        })
    }

    fn ns(&self) -> i64 {
        self.micros * 1_000
    }

    /// A fetch-arg's value (`NAME=0x...` or decimal).
    fn arg(&self, name: &str) -> u64 {
        let key = format!("{name}=");
        let value = self
            .args
            .split_whitespace()
            .find_map(|a| a.strip_prefix(&key))
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.args));
        match value.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
            None => value.parse().unwrap(),
        }
    }
}

/// The host's lines of `event` by tasks named `comm` (the guest's console shares stdout).
fn host_lines(run: &Run, event: &str, comm: &str) -> Vec<Stamped> {
    run.stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(|l| Stamped::parse(l, event))
        .filter(|s| s.task.starts_with(&format!("{comm}-")))
        .collect()
}

/// The guest's own trace lines of `event` by tasks named `comm`.
fn guest_lines(run: &Run, event: &str, comm: &str) -> Vec<Stamped> {
    run.stdout
        .lines()
        .filter_map(|l| l.strip_prefix("GUEST "))
        .filter_map(|l| Stamped::parse(l, event))
        .filter(|s| s.task.starts_with(&format!("{comm}-")))
        .collect()
}

/// `kvm_sched_clock_read+OFF`, where OFF is its `sub kvm_sched_clock_offset(%rip),%rax`,
/// the instruction after the call that read the kvm-clock: `%rax - kvm_sched_clock_offset`
/// there is the guest's own `sched_clock()`.
fn after_the_kvm_clock_read() -> String {
    let (read, symbols) = common::GuestFunction::bundled("kvm_sched_clock_read");
    let offset = symbols
        .lookup("kvm_sched_clock_offset")
        .expect("kvm_sched_clock_offset");
    // 48 2b 05 disp32: sub disp32(%rip),%rax
    let at = read
        .find_rip_relative(&[0x48, 0x2b, 0x05], offset.addr.0)
        .unwrap_or_else(|| {
            panic!(
                "no `sub kvm_sched_clock_offset(%rip),%rax` in kvm_sched_clock_read: {:02x?}",
                read.code
            )
        });
    format!("kvm_sched_clock_read+{at:#x}")
}

fn run_ok(run: &Run) {
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(run, &[]);
    assert!(
        run.console_has_line("CONSOLE-END"),
        "the guest's console output was cut before its end\n{}",
        run.tail()
    );
}

/// The guest's own kprobe event on `vfs_write` around a busybox loop of writes; its trace
/// lines come back prefixed `GUEST `.
fn merge_workload() -> String {
    format!(
        "T=/sys/kernel/tracing; echo 'p:gw vfs_write' > $T/kprobe_events; echo 1 > $T/events/kprobes/gw/enable; \
         busybox sh -c 'for w in {}; do echo $w > /dev/null; done'; echo 0 > $T/events/kprobes/gw/enable; sleep 1; \
         while read -r l; do case $l in *' gw: '*) echo \"GUEST $l\";; esac; done < $T/trace; \
         echo CONSOLE-END; sleep 2",
        WORDS.join(" ")
    )
}

/// The host's `ksys_write` hits and the guest's `vfs_write` events of the loop, merged by
/// time, alternate: each `ksys_write` (host) before the `vfs_write` it calls (guest),
/// before the next `ksys_write`.
fn check_interleaving(run: &Run) {
    let host = host_lines(run, "write", "busybox");
    let guest = guest_lines(run, "gw", "busybox");
    let mut merged: Vec<(i64, &str)> = host
        .iter()
        .map(|s| (s.micros, "host ksys_write"))
        .chain(guest.iter().map(|s| (s.micros, "guest vfs_write")))
        .collect();
    merged.sort();
    let timeline = merged
        .iter()
        .map(|(us, what)| format!("{:>14.6} {what}", *us as f64 / 1e6))
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        (host.len(), guest.len()),
        (WORDS.len(), WORDS.len()),
        "one host and one guest event per write\n{timeline}\n{}",
        run.tail()
    );
    for i in 0..WORDS.len() {
        assert!(
            host[i].ns() <= guest[i].ns() + PRINT_RESOLUTION_NS,
            "write {i}: the host's ksys_write is stamped after the guest's vfs_write\n{timeline}"
        );
        if let Some(next) = host.get(i + 1) {
            assert!(
                guest[i].ns() <= next.ns() + PRINT_RESOLUTION_NS,
                "write {i}: the guest's vfs_write is stamped after the next ksys_write\n{timeline}"
            );
        }
    }
}

/// `stamp − the guest's own sched_clock() at the same call`, in ns, for every line:
/// never below `-skew`, and the median under [`median_lag_bound`].
fn check_lag(what: &str, lags: &mut [i64], skew: i64) {
    assert!(!lags.is_empty(), "{what}: no hits");
    lags.sort();
    let median = lags[lags.len() / 2];
    eprintln!(
        "{what}: {} hits, stamp − guest sched_clock: min {} ns, median {median} ns, max {} ns",
        lags.len(),
        lags[0],
        lags[lags.len() - 1]
    );
    assert!(
        lags[0] >= -skew,
        "{what}: a stamp {} ns before the guest's own clock read at the same call (allowed: {skew} ns)",
        -lags[0]
    );
    let bound = median_lag_bound();
    assert!(
        median <= bound,
        "{what}: the median stamp is {median} ns after the guest's own reading (allowed: {bound} ns)"
    );
}

/// The summary's count after `key` (`recorded in the guest 12`).
fn summary_count(run: &Run, key: &str) -> u64 {
    let summary = run.stderr.lines().find(|l| l.contains("probe hits")).unwrap();
    let at = summary.find(key).unwrap_or_else(|| panic!("no {key:?} in {summary}")) + key.len();
    summary[at..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn trapped_hits_merge_with_the_guests_own_events_on_its_trace_clock() {
    require_a_tsc_clocksource();
    let dir = snapshot(1);
    // The return of `kvm_sched_clock_read` (the guest's `sched_clock()`, its trace clock):
    // `$retval` is the guest's own reading, which the host's stamp of that return follows.
    let probes = probe_file(
        "clock-trapped",
        "p:clk/write ksys_write\n\
         r:clk/sched kvm_sched_clock_read ret=$retval\n\
         filter clk/write comm == \"busybox\"\n\
         filter clk/sched comm == \"busybox\"\n",
    );
    let run = restore_with(
        &dir,
        1,
        &merge_workload(),
        &["--probes", probes.to_str().unwrap(), "--optimize=off"],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    run_ok(&run);
    assert!(
        run.stderr.contains("guest trace clock: kvm-clock page"),
        "{}",
        run.tail()
    );
    check_interleaving(&run);
    let mut lags: Vec<i64> = host_lines(&run, "sched", "busybox")
        .iter()
        .map(|s| s.ns() - s.arg("ret") as i64)
        .collect();
    check_lag("trapped return of kvm_sched_clock_read", &mut lags, TRAPPED_SKEW_NS);
}

#[test]
fn event_detour_records_carry_their_hits_own_time_on_the_guests_trace_clock() {
    require_a_tsc_clocksource();
    let dir = snapshot(1);
    // Right after the call that read the kvm-clock, `raw - off` is the guest's own
    // `sched_clock()`.
    let probes = probe_file(
        "clock-records",
        &format!(
            "p:clk/write ksys_write\n\
             p:clk/raw {} raw=%ax:u64 off=@kvm_sched_clock_offset:u64\n\
             filter clk/write comm == \"busybox\"\n\
             filter clk/raw comm == \"busybox\"\n",
            after_the_kvm_clock_read()
        ),
    );
    let run = restore_with(
        &dir,
        1,
        &merge_workload(),
        &["--probes", probes.to_str().unwrap(), "--optimize=on"],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    run_ok(&run);
    for event in ["clk/write", "clk/raw"] {
        let listed = run
            .stderr
            .lines()
            .find(|l| l.contains(&format!("event={event}")))
            .unwrap_or_else(|| panic!("no listing line of {event}\n{}", run.tail()));
        assert!(listed.contains("[OPTIMIZED]"), "{listed}");
    }
    assert!(
        summary_count(&run, "recorded in the guest") >= WORDS.len() as u64,
        "{}",
        run.tail()
    );
    check_interleaving(&run);
    let mut lags: Vec<i64> = host_lines(&run, "raw", "busybox")
        .iter()
        .map(|s| s.ns() - s.arg("raw").wrapping_sub(s.arg("off")) as i64)
        .collect();
    check_lag(
        "event-detour record after kvm_sched_clock_read's clock read",
        &mut lags,
        RECORD_SKEW_NS,
    );
}

#[test]
fn the_global_clock_lines_up_with_the_guests_dmesg() {
    require_a_tsc_clocksource();
    let dir = snapshot(1);
    let probes = probe_file("clock-global", "p:clk/ppid __x64_sys_getppid\n");
    // Two messages in the guest's printk log (stamped with its local_clock()) around one
    // getppid() call. (Through a file: `dmesg | grep` segfaulted in 2 of 5 restores here,
    // with no probe at all, before the bundled init kept glibc off the AVX registers a
    // `noxsave` guest kernel does not switch; one process fewer all the same.)
    let workload = "echo clk-before > /dev/kmsg; hvprobe-loop 1; echo clk-after > /dev/kmsg; \
                    dmesg > /tmp/dmesg; grep clk- /tmp/dmesg; echo CONSOLE-END; sleep 2";
    let run = restore_with(
        &dir,
        1,
        workload,
        &["--probes", probes.to_str().unwrap(), "--clock", "global"],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    run_ok(&run);
    let dmesg_ns = |marker: &str| -> i64 {
        let line = run
            .stdout
            .lines()
            .find(|l| l.trim_end_matches('\r').ends_with(&format!("] {marker}")))
            .unwrap_or_else(|| panic!("no dmesg line {marker}\n{}", run.tail()));
        let stamp = line.split(']').next().unwrap().trim_start_matches('[').trim();
        let (secs, usecs) = stamp.split_once('.').unwrap();
        (secs.parse::<i64>().unwrap() * 1_000_000 + usecs.parse::<i64>().unwrap()) * 1_000
    };
    let (before, after) = (dmesg_ns("clk-before"), dmesg_ns("clk-after"));
    let calls = host_lines(&run, "ppid", "hvprobe-loop");
    assert_eq!(calls.len(), 1, "{}", run.tail());
    let at = calls[0].ns();
    assert!(
        before - PRINT_RESOLUTION_NS <= at && at <= after + PRINT_RESOLUTION_NS,
        "getppid stamped {at} ns on the global clock, outside the dmesg lines around it ({before}..{after})\n{}",
        run.tail()
    );
}

/// The vCPU (`[NNN]`) of a trace line.
fn cpu_of(line: &str) -> Option<usize> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    line[open + 1..close].trim().parse().ok()
}

#[test]
fn on_two_vcpus_each_cpus_stamps_follow_its_own_clock_reads() {
    require_a_tsc_clocksource();
    let dir = snapshot(2);
    // Both kinds on both vCPUs: the return traps (return probes trap at their trampoline), the
    // probe after the clock read is an event detour writing into its CPU's ring.
    let probes = probe_file(
        "clock-two",
        &format!(
            "r:clk/sched kvm_sched_clock_read ret=$retval\n\
             p:clk/raw {} raw=%ax:u64 off=@kvm_sched_clock_offset:u64\n\
             filter clk/sched comm == \"busybox\"\n\
             filter clk/raw comm == \"busybox\"\n",
            after_the_kvm_clock_read()
        ),
    );
    let one_cpu =
        |cpu: usize| format!("taskset -c {cpu} busybox sh -c 'for i in 1 2 3 4 5 6; do echo $i > /dev/null; done'");
    let workload = format!("{} & {} & wait; echo CONSOLE-END; sleep 2", one_cpu(0), one_cpu(1));
    let run = restore_with(
        &dir,
        2,
        &workload,
        &["--probes", probes.to_str().unwrap(), "--optimize=on"],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(probes);
    run_ok(&run);
    let on_cpu = |event: &str, cpu: usize| -> Vec<Stamped> {
        run.stdout
            .lines()
            .filter(|l| cpu_of(l) == Some(cpu))
            .filter_map(|l| Stamped::parse(l, event))
            .filter(|s| s.task.starts_with("busybox-"))
            .collect()
    };
    for cpu in 0..2 {
        // The return's stamp follows the guest's read by the event detour after it too.
        let mut returns: Vec<i64> = on_cpu("sched", cpu)
            .iter()
            .map(|s| s.ns() - s.arg("ret") as i64)
            .collect();
        check_lag(&format!("vCPU {cpu}: trapped return"), &mut returns, TRAPPED_SKEW_NS);
        let mut records: Vec<i64> = on_cpu("raw", cpu)
            .iter()
            .map(|s| s.ns() - s.arg("raw").wrapping_sub(s.arg("off")) as i64)
            .collect();
        check_lag(
            &format!("vCPU {cpu}: event-detour record"),
            &mut records,
            RECORD_SKEW_NS,
        );
    }
}
