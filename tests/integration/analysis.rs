//! Host-side event filters and hist triggers on the bundled guest, checked against the
//! guest's own (the oracle): the same kprobe event (`vfs_write`, `count=%dx:u64`), the same
//! workload, the guest's `filter`/`trigger` files against `--filter`/`--trigger`: the same
//! hits kept, the same histogram files. Both restore a cached snapshot.
//!
//! The workload's writes are `echo WORD > /dev/null` in a `busybox sh -c` loop: one write
//! of `len(WORD) + 1` bytes each, from the only task called `busybox` (so `comm` picks
//! them out of everything else the guest writes, and the two tracers see the same set).

use crate::common;

use std::time::Duration;

use common::{hvprobe, probe_file, restore_with, snapshot, Run};

const RESTORE_TIMEOUT: Duration = Duration::from_secs(300);
/// A refusal comes before the guest boots.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(120);

/// The host's probe, with the fetch-arg the guest's probe `gw` has.
const HOST_PROBES: &str = "p:ana/write vfs_write count=%dx:u64\n";

/// Words whose writes (length + 1 bytes) spread over several log2 buckets, with repeats
/// (equal hitcounts, so the hist files' order of ties is checked too).
fn words() -> Vec<String> {
    let lengths = [
        1, 2, 3, 3, 5, 6, 6, 7, 15, 16, 16, 31, 40, 63, 64, 100, 2, 3, 130, 7, 5, 1, 200, 31,
    ];
    lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| std::iter::repeat_n(char::from(b'a' + (i % 26) as u8), n).collect())
        .collect()
}

fn write_loop() -> String {
    format!(
        "busybox sh -c 'for s in {}; do echo $s > /dev/null; done'",
        words().join(" ")
    )
}

/// The end of a workload whose last lines matter: init writes the exit status (and the VM
/// stops) as soon as the shell exits, while the tty may still hold lines for the serial
/// port (seen on this loaded host: a hist file's last lines never came). A marker, then
/// time for the port to drain; [`console_complete`] checks the marker came.
const CONSOLE_DRAIN: &str = "echo CONSOLE-END; sleep 2";

/// Fails clearly when the guest's console output was cut short.
fn console_complete(run: &Run) {
    assert!(
        run.console_has_line("CONSOLE-END"),
        "the guest's console output was cut before its end\n{}",
        run.tail()
    );
}

fn guest_problems(run: &Run) {
    common::assert_guest_healthy(run, &[]);
}

/// The `count=` of trace lines of `event` (ftrace's `trace` layout), in order.
fn counts(lines: impl Iterator<Item = String>, event: &str) -> Vec<u64> {
    let marker = format!(" {event}: (");
    lines
        .filter(|l| l.contains(&marker))
        .map(|l| {
            l.split("count=")
                .nth(1)
                .and_then(|v| v.split_whitespace().next())
                .unwrap_or_else(|| panic!("no count in {l}"))
                .parse()
                .unwrap()
        })
        .collect()
}

/// The host's filter and the guest's own on the same event and workload, with `extra`
/// options: the same hits kept; every other write a hit the filter discarded, counted
/// apart. Returns the listing's `filtered=` and the run.
fn filter_oracle(name: &str, extra: &[&str]) -> (u64, Run) {
    let dir = snapshot(1);
    let filter = "comm == \"busybox\" && count > 3 && !(count >= 32 && count < 64)";
    // The host prints the loop's hits (the only ones its filter keeps) on the stdout the
    // guest's console shares: the sleep lets it finish before the guest prints its trace.
    let workload = format!(
        "T=/sys/kernel/tracing; echo 'p:gw vfs_write count=%dx:u64' > $T/kprobe_events; \
         echo '{filter}' > $T/events/kprobes/gw/filter; echo 1 > $T/events/kprobes/gw/enable; \
         {}; echo 0 > $T/events/kprobes/gw/enable; sleep 1; \
         while read -r l; do case $l in *' gw: '*) echo \"GUEST $l\";; esac; done < $T/trace; {CONSOLE_DRAIN}",
        write_loop()
    );
    let probes = probe_file(name, HOST_PROBES);
    let host_filter = format!("ana/write:{filter}");
    let mut args = vec!["--probes", probes.to_str().unwrap(), "--filter", &host_filter];
    args.extend_from_slice(extra);
    let run = restore_with(&dir, 1, &workload, &args, RESTORE_TIMEOUT);
    let _ = std::fs::remove_file(probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    guest_problems(&run);
    console_complete(&run);

    let expected: Vec<u64> = words()
        .iter()
        .map(|w| w.len() as u64 + 1)
        .filter(|&c| c > 3 && !(32..64).contains(&c))
        .collect();
    let guest = counts(
        run.stdout
            .lines()
            .filter_map(|l| l.strip_prefix("GUEST "))
            .map(str::to_owned),
        "gw",
    );
    let host = counts(
        run.stdout
            .lines()
            .filter(|l| !l.starts_with("GUEST "))
            .map(str::to_owned),
        "write",
    );
    assert_eq!(guest, expected, "the guest's own filter\n{}", run.tail());
    assert_eq!(host, expected, "the host's filter\n{}", run.tail());
    assert!(
        run.stdout
            .lines()
            .filter(|l| l.contains(" write: ("))
            .all(|l| l.trim_start().starts_with("busybox-")),
        "{}",
        run.tail()
    );

    // Every other write of the run was a hit the filter discarded, counted apart.
    let listing = listing_line(&run);
    let (hits, filtered, missed) = (
        number_in(&listing, "hits="),
        number_in(&listing, "filtered="),
        number_in(&listing, "nmissed="),
    );
    assert_eq!(missed, 0, "{listing}");
    assert!(filtered > 0, "{listing}");
    assert_eq!(hits, filtered + host.len() as u64, "{listing}");
    assert!(
        run.stderr
            .contains(&format!("hvprobe: filters on 1 event(s) discarded {filtered} hits (")),
        "{}",
        run.tail()
    );
    (filtered, run)
}

/// The listing line of the probe of `ana/write`.
fn listing_line(run: &Run) -> String {
    run.stderr
        .lines()
        .find(|l| l.contains("event=ana/write"))
        .unwrap_or_else(|| panic!("no listing line\n{}", run.tail()))
        .to_owned()
}

/// The number after `key` in `line`.
fn number_in(line: &str, key: &str) -> u64 {
    line.split(key)
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[test]
fn filters_keep_the_hits_the_guests_own_filter_keeps() {
    let (filtered, run) = filter_oracle("filter", &["--optimize=off"]);
    assert!(
        run.stderr
            .contains(&format!("discarded {filtered} hits (0 of them in the guest")),
        "on the int3 path the host filters every hit\n{}",
        run.tail()
    );
}

/// The same filter run by the probe's event detour: every field it tests is in the
/// detour's record, so every hit it discards is discarded in the guest (no record, no
/// drain), and the hits it keeps are the guest's own filter's.
#[test]
fn filters_run_in_event_detours_keep_the_hits_the_guests_own_filter_keeps() {
    let (filtered, run) = filter_oracle("filter-detour", &["--optimize=on"]);
    let listing = listing_line(&run);
    assert!(listing.contains("[OPTIMIZED]"), "{listing}");
    assert!(
        run.stderr
            .contains(&format!("discarded {filtered} hits ({filtered} of them in the guest")),
        "every discarded hit was discarded in the guest\n{}",
        run.tail()
    );
}

/// Two hist triggers, as the guest and the host are given them.
const TRIGGERS: [&str; 2] = [
    "hist:keys=count.log2:sort=count if comm == \"busybox\"",
    "hist:keys=common_pid.execname,count:vals=hitcount,count:sort=hitcount.descending,count if comm ~ \"busy*\"",
];

fn hist_workload() -> String {
    format!(
        "T=/sys/kernel/tracing; echo 'p:gw vfs_write count=%dx:u64' > $T/kprobe_events; \
         echo '{}' > $T/events/kprobes/gw/trigger; echo '{}' >> $T/events/kprobes/gw/trigger; \
         {}; sleep 1; while read -r l; do echo \"GHIST $l\"; done < $T/events/kprobes/gw/hist; {CONSOLE_DRAIN}",
        TRIGGERS[0],
        TRIGGERS[1],
        write_loop()
    )
}

/// The host's run of the hist workload with both triggers and `extra` flags. (The host's
/// hit lines would share stdout with the guest's console: the flags keep them off it, or
/// to the loop's, which come before the guest prints; a hit line printed into a console
/// line that takes longer than the printer waits would break it.)
fn host_hist_run(name: &str, extra: &[&str]) -> Run {
    let dir = snapshot(1);
    let probes = probe_file(name, HOST_PROBES);
    let triggers: Vec<String> = TRIGGERS.iter().map(|t| format!("ana/write:{t}")).collect();
    let mut args = vec![
        "--probes",
        probes.to_str().unwrap(),
        "--trigger",
        &triggers[0],
        "--trigger",
        &triggers[1],
    ];
    args.extend_from_slice(extra);
    let run = restore_with(&dir, 1, &hist_workload(), &args, RESTORE_TIMEOUT);
    let _ = std::fs::remove_file(probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    guest_problems(&run);
    console_complete(&run);
    run
}

/// The guest's hist file, as the workload's `read -r` loop gives its lines (trimmed).
fn guest_hist(run: &Run) -> Vec<String> {
    run.stdout
        .lines()
        .filter_map(|l| l.strip_prefix("GHIST"))
        .map(|l| l.trim().to_owned())
        .collect()
}

#[test]
fn hist_triggers_give_the_guests_histograms() {
    // No hit lines: the histograms are all the host prints on stdout.
    let run = host_hist_run("hist", &["--format", "none"]);
    let guest = guest_hist(&run);
    let header = "==> events/ana/write/hist <==";
    let host: Vec<String> = run
        .stdout
        .split_once(header)
        .unwrap_or_else(|| panic!("no host histogram\n{}", run.tail()))
        .1
        .lines()
        .skip(1)
        .map(|l| l.trim().to_owned())
        .take(guest.len())
        .collect();
    assert!(
        guest.iter().any(|l| l.starts_with("{ count: ~ 2^")),
        "no guest histogram\n{}",
        run.tail()
    );
    // Line for line: trigger info, keys, buckets, hitcounts, sums, the order of entries
    // with equal hitcounts, totals.
    assert_eq!(host, guest, "{}", run.tail());
    let hits = words().len().to_string();
    assert_eq!(
        guest.iter().filter(|l| **l == format!("Hits: {hits}")).count(),
        2,
        "{guest:#?}"
    );
}

#[test]
fn hist_triggers_count_recorded_in_guest_hits_and_print_json() {
    // The filter keeps the loop's hits only (printed before the guest prints its
    // histogram); the triggers still see every hit.
    let run = host_hist_run(
        "hist-json",
        &[
            "--optimize=on",
            "--format",
            "json",
            "--filter",
            "ana/write:comm == \"busybox\"",
        ],
    );
    let listing = listing_line(&run);
    assert!(listing.contains("[OPTIMIZED]"), "{listing}");
    let guest = guest_hist(&run);
    let hists: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("{\"hist\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["hist"].clone())
        .collect();
    assert_eq!(hists.len(), 2, "{}", run.tail());
    // The log2 histogram: the guest's `{ count: ~ 2^N  } hitcount: H` lines, in order.
    let guest_buckets: Vec<(u64, u64)> = guest
        .iter()
        .take_while(|l| !l.starts_with("Totals:"))
        .filter_map(|l| {
            let n = l
                .strip_prefix("{ count: ~ 2^")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            let h = l.split("hitcount:").nth(1)?.trim().parse().ok()?;
            Some((n, h))
        })
        .collect();
    let host_buckets: Vec<(u64, u64)> = hists[0]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["keys"]["count.log2"]["log2"].as_u64().unwrap(),
                e["hitcount"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(!guest_buckets.is_empty(), "{}", run.tail());
    assert_eq!(host_buckets, guest_buckets, "{}", run.tail());
    assert_eq!(hists[0]["event"], "ana/write");
    assert_eq!(hists[0]["totals"]["hits"], words().len() as u64);
    assert_eq!(hists[0]["totals"]["dropped"], 0);
    // The execname histogram: one entry per distinct count, each the busybox task's.
    let entries = hists[1]["entries"].as_array().unwrap();
    let guest_entries = guest.iter().filter(|l| l.starts_with("{ common_pid: busybox")).count();
    assert_eq!(entries.len(), guest_entries, "{}", run.tail());
    assert!(entries
        .iter()
        .all(|e| e["keys"]["common_pid.execname"]["comm"] == "busybox"));
}

/// `hvprobe run --probes FILE ARGS` with a guest that would take minutes to boot: refused
/// before it does, with every problem.
fn refused(name: &str, file: &str, args: &[&str]) -> Run {
    let probes = probe_file(name, file);
    let mut all = vec!["run", "--workload", "true", "--probes", probes.to_str().unwrap()];
    all.extend_from_slice(args);
    let started = std::time::Instant::now();
    let run = hvprobe(&all, REFUSAL_TIMEOUT);
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(!run.stderr.contains("panicked"), "{}", run.tail());
    assert!(
        !run.stdout.contains("Linux version"),
        "the guest booted\n{}",
        run.tail()
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    run
}

#[test]
fn bad_filters_and_triggers_are_refused_before_boot_with_where_and_why() {
    let file = "p:ana/write vfs_write count=%dx:u64\n\
                filter ana/write count >> 3\n\
                trigger ana/nothing hist:keys=count\n\
                trigger ana/write hist:keys=count.log2:sort=bytes\n";
    let run = refused(
        "refusals",
        file,
        &[
            "--filter",
            "ana/write:comm == sh",
            "--trigger",
            "ana/write:hist:keys=nope",
        ],
    );
    let path = |l: &str| l.contains(".probes:");
    let lines: Vec<&str> = run.stderr.lines().collect();
    for expected in [
        "--filter 'ana/write:comm == sh': column 19: expected a number or a quoted string (did you forget the quotes?)",
        ":2:25: expected a number or a quoted string (did you forget the quotes?)",
        ":3:9: no probe event matches `ana/nothing`",
        ":4:45: sort key `bytes` is neither hitcount, a key nor a value",
        "--trigger 'ana/write:hist:keys=nope': column 21: no field `nope` (this event has count, common_pid, comm, cpu)",
    ] {
        assert!(
            lines.iter().any(|l| l.contains(expected) && (path(l) || expected.starts_with("--"))),
            "no {expected:?} in\n{}",
            run.stderr
        );
    }
    assert!(run.stderr.contains("5 problems in"), "{}", run.stderr);
}

#[test]
fn filters_need_a_probe_file_and_bad_stack_trace_triggers_say_where() {
    let run = hvprobe(
        &["run", "--workload", "true", "--filter", "a/b:cpu == 0"],
        REFUSAL_TIMEOUT,
    );
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(
        run.stderr
            .contains("--filter and --trigger apply to the events of --probes FILE"),
        "{}",
        run.tail()
    );
    let run = refused(
        "stacktrace",
        "p:ana/write vfs_write\n",
        &[
            "--trigger",
            "ana/write:stacktrace:0",
            "--trigger",
            "ana/write:hist:keys=stacktrace.sym",
        ],
    );
    for expected in [
        "--trigger 'ana/write:stacktrace:0': column 22: bad count `0`: expected a number above 0",
        "--trigger 'ana/write:hist:keys=stacktrace.sym': column 31: the `stacktrace` key takes no modifier",
    ] {
        assert!(run.stderr.contains(expected), "no {expected:?} in\n{}", run.tail());
    }
}
