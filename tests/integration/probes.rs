//! Host-side kprobes on the bundled guest, checked against the guest's own kprobe events
//! (the oracle): the same hits, the same fetched values, no ftrace complaint, the kernel's
//! text intact afterwards. The tests restore cached snapshots (those under KASLR the KASLR snapshot).

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{hvprobe, parse_trace_line, probe_file, snapshot, Run, TraceLine};

const RESTORE_TIMEOUT: Duration = Duration::from_secs(480);
const LOOP_CALLS: usize = 30;

/// The host's probes: `__x64_sys_getppid` at +0 (an ftrace NOP, so the int3 goes on the
/// next instruction, `mov %gs:...,%rax`, which is stepped out of line) with the fetch-args
/// the guest's probe has, and `__task_pid_nr_ns` at +0 (next instruction `mov $0x1,%ecx`,
/// emulated on the host).
const HOST_PROBES: &str = "\
# the oracle pair: the guest puts its own kprobe event on the same function
p:host/getppid __x64_sys_getppid di=%di s0=$stack0 comm=$comm
p:host/pidns __task_pid_nr_ns type=%si
";

/// The guest's own kprobe event on `__x64_sys_getppid` (ftrace-based at +0), enabled only
/// around the loops; then its hit count and its trace, marked for the test.
fn oracle_workload(loops: usize) -> String {
    oracle_workload_with(loops, &[])
}

/// [`oracle_workload`] with more of the guest's own events (`KIND:NAME DEFINITION` lines
/// of `kprobe_events`), enabled with `gk`, and ten reads of `/proc/version` (one open
/// each) after the loops.
fn oracle_workload_with(loops: usize, guest_events: &[String]) -> String {
    // Each loop pinned to its own CPU: with two vCPUs, the probes are hit concurrently.
    let run = (0..loops)
        .map(|cpu| format!("taskset -c {cpu} hvprobe-loop {LOOP_CALLS} &"))
        .collect::<Vec<_>>()
        .join(" ");
    let define: String = guest_events
        .iter()
        .map(|e| format!("echo '{e}' >> $T/kprobe_events; "))
        .collect();
    let opens = if guest_events.is_empty() {
        ""
    } else {
        "i=0; while [ $i -lt 10 ]; do read -r l < /proc/version; i=$((i+1)); done; "
    };
    format!(
        "T=/sys/kernel/tracing; echo 'p:gk __x64_sys_getppid di=%di s0=$stack0' > $T/kprobe_events; {define}\
         echo 1 > $T/events/kprobes/enable; {run} wait; {opens}echo 0 > $T/events/kprobes/enable; \
         while read l; do echo \"PROFILE $l\"; done < $T/kprobe_profile; \
         while read l; do case $l in *' g'*': ('*) echo \"GUEST $l\";; esac; done < $T/trace"
    )
}

fn restore_with(dir: &Path, cpus: u8, workload: &str, extra: &[&str]) -> Run {
    common::restore_with(dir, cpus, workload, extra, RESTORE_TIMEOUT)
}

/// The oracle's checks on one run: the guest's hit count equals the host's hits in the
/// loop tasks, every hit's fetched values are equal in order, and the guest's ftrace did
/// not complain. Returns the host's hits of `getppid`.
fn check_oracle(run: &Run, loops: usize) -> usize {
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let expected = loops * LOOP_CALLS;
    let profile = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("PROFILE "))
        .find(|l| l.split_whitespace().next() == Some("gk"))
        .unwrap_or_else(|| panic!("no kprobe_profile line of gk\n{}", run.tail()));
    let fields: Vec<&str> = profile.split_whitespace().collect();
    let guest_hits: usize = fields[1].parse().unwrap();
    let guest_missed: usize = fields[2].parse().unwrap();
    assert_eq!(guest_hits, expected, "the guest's own probe saw {guest_hits} hits");
    assert_eq!(guest_missed, 0);

    // By pid: the guest's trace names a task by the comm its saved_cmdlines cache still
    // holds for the pid, `<...>` once another task took that entry (seen on two vCPUs).
    let by_task = |lines: Vec<TraceLine>| {
        let mut m: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for l in lines {
            let pid = l.task.rsplit('-').next().unwrap_or_default().to_string();
            m.entry(pid)
                .or_default()
                .push((l.args["di"].clone(), l.args["s0"].clone()));
        }
        m
    };
    let guest: Vec<TraceLine> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("GUEST "))
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "gk")
        .collect();
    let host: Vec<TraceLine> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "getppid" && l.task.starts_with("hvprobe-loop-"))
        .collect();
    assert_eq!(
        host.len(),
        expected,
        "host hits in the loop tasks != the guest's count\n{}",
        run.tail()
    );
    // Named as the guest's kallsyms names it: `__x64_sys_getppid` and its alias
    // `__do_sys_getppid` share the address, and the size is the distance to the next symbol.
    let location = &guest.first().expect("the guest's trace lines").location;
    assert!(
        ["__x64_sys_getppid+0x0/", "__do_sys_getppid+0x0/"]
            .iter()
            .any(|f| location.starts_with(f)),
        "guest location {location}"
    );
    assert!(
        host.iter().all(|l| &l.location == location),
        "host location, not {location}"
    );
    assert!(host.iter().all(|l| l.args["comm"] == "\"hvprobe-loop\""), "host $comm");
    // The guest's trace buffer keeps every hit (a few hundred bytes each, far below its
    // size); per task, the sequences of fetched values must be equal.
    assert_eq!(guest.len(), expected, "guest trace lines\n{}", run.stdout);
    assert_eq!(by_task(host), by_task(guest), "fetched values differ");

    common::assert_guest_healthy(run, &[]);
    expected
}

/// The pids the workload's loops printed (`LOOP $$`), in order.
fn loop_pids(run: &Run) -> Vec<String> {
    run.stdout
        .lines()
        .filter_map(|l| l.strip_prefix("LOOP "))
        .map(|p| p.trim().to_string())
        .collect()
}

/// The run's hits and int3 exits, once no hit was emulated or stepped: every probe is
/// jump-optimized (recorded in the guest, or one exit into a sync detour).
fn nothing_emulated_or_stepped(run: &Run) -> (u64, u64) {
    let (hits, emulated, stepped, int3, steps) = exit_counts(run);
    assert_eq!(
        (emulated, stepped, steps),
        (0, 0, 0),
        "no hit emulated or stepped\n{}",
        run.tail()
    );
    (hits, int3)
}

/// `hvprobe: probe hits N (emulated E, stepped out of line S, ...)` and the run line's
/// `(I int3, T single-step)`.
fn exit_counts(run: &Run) -> (u64, u64, u64, u64, u64) {
    let number_after = |text: &str, key: &str| -> u64 {
        let at = text.find(key).unwrap_or_else(|| panic!("no {key:?} in\n{text}")) + key.len();
        text[at..]
            .trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let summary = run
        .stderr
        .lines()
        .find(|l| l.contains("probe hits"))
        .unwrap_or_else(|| panic!("no probe summary\n{}", run.tail()));
    let exits = run
        .stderr
        .lines()
        .find(|l| l.contains(" int3, "))
        .unwrap_or_else(|| panic!("no exit counts\n{}", run.tail()));
    let int3 = exits.split(" int3").next().unwrap().rsplit('(').next().unwrap();
    let steps = exits.split(" single-step").next().unwrap().rsplit(", ").next().unwrap();
    (
        number_after(summary, "probe hits"),
        number_after(summary, "emulated"),
        number_after(summary, "stepped out of line"),
        int3.parse().unwrap(),
        steps.parse().unwrap(),
    )
}

/// The run line's `N guest int3 re-injected`.
fn guest_int3s_reinjected(run: &Run) -> u64 {
    let line = run
        .stderr
        .lines()
        .find(|l| l.contains(" guest int3 re-injected"))
        .unwrap_or_else(|| panic!("no re-injection count\n{}", run.tail()));
    let before = line.split(" guest int3 re-injected").next().unwrap();
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

/// `ADDRESS  k  sym+off    [FLAGS] hits=N nmissed=M` lines of the listing.
fn listing(run: &Run) -> Vec<(String, u64, u64)> {
    run.stderr
        .lines()
        .filter(|l| l.contains("  k  ") && l.contains(" hits="))
        .map(|l| {
            let location = l.split("  k  ").nth(1).unwrap().split_whitespace().next().unwrap();
            let get = |k: &str| {
                l.split(k)
                    .nth(1)
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            (location.to_string(), get("hits="), get("nmissed="))
        })
        .collect()
}

#[test]
fn host_and_guest_kprobes_see_the_same_hits_and_values_on_one_vcpu() {
    let dir = snapshot(1);
    let probes = probe_file("oracle1", HOST_PROBES);
    // The int3 path (hardware KVM optimizes by default).
    let run = restore_with(
        &dir,
        1,
        &oracle_workload(1),
        &["--probes", probes.to_str().unwrap(), "--optimize=off"],
    );
    let loop_hits = check_oracle(&run, 1) as u64;

    let (hits, emulated, stepped, int3, steps) = exit_counts(&run);
    // getppid's probe is stepped (two exits per hit), __task_pid_nr_ns's emulated (one).
    assert!(stepped >= loop_hits && emulated >= loop_hits, "{}", run.tail());
    assert_eq!(hits, emulated + stepped);
    // Plus the guest's own int3s that exited and went back (on hardware KVM every guest
    // int3 exits once a handler is attached: the guest's text_poke_bp() when it arms its
    // own probe can be one).
    let reinjected = guest_int3s_reinjected(&run);
    assert_eq!(int3, hits + reinjected, "one int3 exit per hit\n{}", run.tail());
    assert_eq!(steps, stepped, "one single-step exit per stepped hit");

    let list = listing(&run);
    assert_eq!(list.len(), 2, "{}", run.tail());
    assert!(list[0].0.ends_with("getppid+0x0") && list[0].1 == stepped && list[0].2 == 0);
    assert!(list[1].0 == "__task_pid_nr_ns+0x0" && list[1].1 == emulated && list[1].2 == 0);
    let _ = std::fs::remove_file(probes);
}

#[test]
fn host_and_guest_kprobes_see_the_same_hits_on_two_vcpus() {
    let dir = snapshot(2);
    let probes = probe_file("oracle2", HOST_PROBES);
    let run = restore_with(
        &dir,
        2,
        &oracle_workload(2),
        &["--probes", probes.to_str().unwrap(), "--optimize=off"],
    );
    check_oracle(&run, 2);
    let cpus: std::collections::BTreeSet<&str> = run
        .stdout
        .lines()
        .filter(|l| l.contains(" getppid: "))
        .filter_map(|l| l.split('[').nth(1)?.split(']').next())
        .collect();
    assert_eq!(cpus.len(), 2, "hits came from CPUs {cpus:?}");
    let _ = std::fs::remove_file(probes);
}

/// The oracle under KASLR; with a source-line probe beside it, whose `SYM+OFF` site follows
/// the slide: at `vfs_read:23` (after the read) `ret` is a size and `file` a pointer that
/// reads.
#[test]
fn host_and_guest_kprobes_agree_under_kaslr() {
    let probes = format!("{HOST_PROBES}p:src/after vfs_read:23 ret was=+0(file):x64 next=+0(pos):s64\n");
    let run = kaslr_oracle_run("kaslr", &probes, &oracle_workload(1), &["--optimize=off"]);
    check_oracle(&run, 1);
    let after: Vec<TraceLine> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "after")
        .collect();
    assert!(after.len() >= 10, "{}", run.tail());
    for l in &after {
        assert!(l.location.starts_with("vfs_read+0x"), "{}", l.location);
        assert!(l.args["ret"].parse::<i64>().unwrap() >= 0, "{:?}", l.args);
        // `file` is a kernel pointer read through: its first word is read, not faulted.
        assert_ne!(l.args["was"], "(fault)", "{:?}", l.args);
    }
}

/// A restore of the bundled guest's KASLR snapshot ([`common::kaslr_snapshot`]), running the
/// oracle workload with the host's probes and `extra` flags; checked to have been randomized.
fn kaslr_oracle_run(name: &str, probes: &str, workload: &str, extra: &[&str]) -> Run {
    let dir = common::kaslr_snapshot(1);
    let probes = probe_file(name, probes);
    let mut args = vec!["--probes", probes.to_str().unwrap()];
    args.extend_from_slice(extra);
    let run = restore_with(&dir, 1, workload, &args);
    let _ = std::fs::remove_file(probes);
    common::assert_randomized(&run);
    run
}

#[test]
fn the_kernel_text_after_probes_hashes_like_a_run_without_them() {
    let dir = snapshot(1);
    let probes = probe_file("hash", HOST_PROBES);
    let workload = "hvprobe-loop 5";
    let hash = |run: &Run| {
        assert_eq!(run.code, Some(0), "{}", run.tail());
        run.stderr
            .lines()
            .find_map(|l| l.strip_prefix("hvprobe: kernel text sha256 "))
            .unwrap_or_else(|| panic!("no text hash\n{}", run.tail()))
            .to_string()
    };
    let with = restore_with(
        &dir,
        1,
        workload,
        &["--probes", probes.to_str().unwrap(), "--text-hash", "--optimize=off"],
    );
    let without = restore_with(&dir, 1, workload, &["--text-hash"]);
    assert!(listing(&with).iter().all(|(_, hits, _)| *hits >= 5), "{}", with.tail());
    assert_eq!(hash(&with), hash(&without));
    let _ = std::fs::remove_file(probes);
}

#[test]
fn json_output_has_one_object_per_hit() {
    let dir = snapshot(1);
    let probes = probe_file("json", "p:getppid __x64_sys_getppid di=%di comm=$comm\n");
    let run = restore_with(
        &dir,
        1,
        "hvprobe-loop 3",
        &["--probes", probes.to_str().unwrap(), "--format", "json"],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let hits: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter(|v: &serde_json::Value| v["comm"] == "hvprobe-loop")
        .collect();
    assert_eq!(hits.len(), 3, "{}", run.tail());
    for hit in &hits {
        assert_eq!(hit["event"], "getppid");
        assert_eq!(hit["group"], "kprobes");
        assert!(hit["args"]["di"].as_str().unwrap().starts_with("0xffff"), "{hit}");
        assert_eq!(hit["args"]["comm"], "hvprobe-loop");
        assert!(hit["pid"].as_i64().unwrap() > 1);
    }
    let _ = std::fs::remove_file(probes);
}

#[test]
fn bad_probes_are_refused_with_the_reason_and_the_line() {
    let dir = snapshot(1);
    let cases = [
        ("p:a no_such_function_xyz\n", "unknown symbol \"no_such_function_xyz\""),
        (
            "# ok\np:a __task_pid_nr_ns+0x7\n",
            ":2: kprobes/a: __task_pid_nr_ns+0x7 is not an instruction boundary",
        ),
        ("p:a do_int3\n", "is marked NOKPROBE_SYMBOL"),
        ("p:a __x64_sys_getppid+0x400\n", "is outside"),
        ("p:a __x64_sys_getppid %zz\n", ":1:"),
        (
            "r:a __x64_sys_getppid+0x5\n",
            "a return probe must be on a function entry",
        ),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let probes = probe_file(&format!("bad{i}"), text);
        let run = restore_with(&dir, 1, "exit 0", &["--probes", probes.to_str().unwrap()]);
        assert_eq!(run.code, Some(1), "{text:?}\n{}", run.tail());
        assert!(
            run.stderr.contains(expected) && run.stderr.contains(probes.to_str().unwrap()),
            "{text:?}: expected {expected:?}\n{}",
            run.tail()
        );
        let _ = std::fs::remove_file(probes);
    }
}

#[test]
fn host_and_guest_return_probes_see_the_same_returns_and_values() {
    let run = return_oracle("kretprobe", "off");
    let list = listing(&run);
    assert!(run.stderr.contains("  r  "), "{}", run.tail());
    assert_eq!(list.len(), 0, "the kretprobe is listed with r, not k");
}

/// The return oracle with the return probe jump-optimized: an exit-free return probe (its
/// entry's detour keeps the call in the guest, the return writes the record) sees the
/// same returns, values and callers as the guest's own kretprobe on the same function and
/// as the trapped path, with no exit for any call.
#[test]
fn exit_free_return_probes_see_what_the_guest_sees_with_no_exit() {
    let run = return_oracle("kretprobe-exit-free", "on");
    let (hits, int3) = nothing_emulated_or_stepped(&run);
    assert!(hits >= LOOP_CALLS as u64, "{}", run.tail());
    let reinjected = guest_int3s_reinjected(&run);
    // The only exits of ours are the engine's task hooks' (do_exit, free_task: one per
    // task that goes).
    assert!(
        int3 - reinjected < LOOP_CALLS as u64 / 4,
        "{} int3 exits of ours for {LOOP_CALLS} calls\n{}",
        int3 - reinjected,
        run.tail()
    );
    assert!(
        run.stderr
            .lines()
            .any(|l| l.contains("  r  ") && l.contains("[OPTIMIZED]")),
        "the return probe is optimized\n{}",
        run.tail()
    );
}

/// The guest's own kretprobe event and ours on `__x64_sys_getppid` around the loop, with
/// `--optimize OPTIMIZE`: the same returns, values and callers.
fn return_oracle(name: &str, optimize: &str) -> Run {
    let dir = snapshot(1);
    let probes = probe_file(name, "r:host/getppid_ret __x64_sys_getppid ret=$retval\n");
    let workload = format!(
        "T=/sys/kernel/tracing; echo 'r:gr __x64_sys_getppid ret=$retval' > $T/kprobe_events; \
         echo 1 > $T/events/kprobes/gr/enable; hvprobe-loop {LOOP_CALLS}; echo 0 > $T/events/kprobes/gr/enable; \
         while read l; do echo \"PROFILE $l\"; done < $T/kprobe_profile; \
         while read l; do case $l in *' gr: '*) echo \"GUEST $l\";; esac; done < $T/trace"
    );
    let run = restore_with(
        &dir,
        1,
        &workload,
        &["--probes", probes.to_str().unwrap(), &format!("--optimize={optimize}")],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let profile = run.stdout.lines().find_map(|l| l.strip_prefix("PROFILE ")).unwrap();
    assert_eq!(profile.split_whitespace().nth(1), Some(LOOP_CALLS.to_string().as_str()));
    // The values, and where each call returned to: the guest's own kretprobe swapped the
    // return address first, so the host finds the caller in the task's rethook list (it
    // must not name the guest's return trampoline).
    let returns = |guest: bool| -> Vec<(String, String)> {
        run.stdout
            .lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(parse_trace_line)
            .filter(|l| l.task.starts_with("hvprobe-loop-") && l.event.starts_with("g"))
            .map(|l| {
                assert!(l.location.ends_with("<- __do_sys_getppid"), "{}", l.location);
                (l.location.clone(), l.args["ret"].clone())
            })
            .collect()
    };
    let guest = returns(true);
    let host = returns(false);
    assert_eq!(guest.len(), LOOP_CALLS, "{}", run.tail());
    assert_eq!(host, guest, "return values or callers differ");
    let _ = std::fs::remove_file(probes);
    run
}

/// `$duration` and `$argN` at a return, against the guest's own clock: `sleep 0.2` sleeps
/// in `hrtimer_nanosleep(rqtp, …)`, whose first argument is the requested time in
/// nanoseconds. Every return reports the entry's `$arg1` (its register is long clobbered)
/// and a latency of at least that, within what the emulated guest needs besides; the
/// hist trigger on `lat.log2` puts every call in the bucket of 0.2 s.
#[test]
fn a_return_reports_its_entrys_arguments_and_the_calls_latency() {
    return_latency("latency", "off");
}

/// The same with `--optimize on`: the kprobe and the return probe on `hrtimer_nanosleep`
/// share one jump to their event detours, the return probe is exit-free, and `$duration`
/// is the guest's TSC at the entry and at the return, on the guest's clock.
#[test]
fn an_exit_free_return_reports_its_entrys_arguments_and_the_calls_latency() {
    let run = return_latency("latency-exit-free", "on");
    nothing_emulated_or_stepped(&run);
    let listed = run
        .stderr
        .lines()
        .find(|l| l.contains("event=lat/sleep"))
        .unwrap_or_else(|| panic!("no listing\n{}", run.tail()));
    assert!(
        listed.contains("[OPTIMIZED]") && !listed.contains("return trapped"),
        "{listed}"
    );
}

/// `sleep 0.2` three times under `p:lat/enter` and `r:lat/sleep` on `hrtimer_nanosleep`
/// with `--optimize OPTIMIZE`: see [`a_return_reports_its_entrys_arguments_and_the_calls_latency`].
fn return_latency(name: &str, optimize: &str) -> Run {
    let dir = snapshot(1);
    let probes = probe_file(
        name,
        "p:lat/enter hrtimer_nanosleep req=$arg1:u64
         r:lat/sleep hrtimer_nanosleep req=$arg1:u64 lat=$duration
         trigger lat/sleep hist:keys=lat.log2:vals=hitcount
",
    );
    let run = restore_with(
        &dir,
        1,
        "sleep 0.2; sleep 0.2; sleep 0.2",
        &["--probes", probes.to_str().unwrap(), &format!("--optimize={optimize}")],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &[]);
    let lines: Vec<_> = run.stdout.lines().filter_map(parse_trace_line).collect();
    let entries: Vec<&str> = lines
        .iter()
        .filter(|l| l.event == "enter")
        .map(|l| l.args["req"].as_str())
        .collect();
    let returns: Vec<(u64, u64)> = lines
        .iter()
        .filter(|l| l.event == "sleep")
        .map(|l| (l.args["req"].parse().unwrap(), l.args["lat"].parse().unwrap()))
        .collect();
    assert_eq!(entries, ["200000000"; 3], "{}", run.tail());
    assert_eq!(returns.len(), 3, "{}", run.tail());
    for (req, lat) in returns {
        assert_eq!(req, 200_000_000, "the return reports the entry's $arg1");
        // The timer cannot fire early; an emulated guest takes its time to wake up and
        // return (a few ms of kernel code here), never a whole second.
        assert!((200_000_000..1_200_000_000).contains(&lat), "lat={lat}\n{}", run.tail());
    }
    // 0.2 s is between 2^27 and 2^28 ns: ftrace's log2 bucket `~ 2^28`.
    let bucket = run
        .stdout
        .lines()
        .find(|l| l.contains("{ lat: ~ 2^"))
        .unwrap_or_default();
    assert!(
        bucket.contains("{ lat: ~ 2^28 } hitcount:          3"),
        "{bucket:?}\n{}",
        run.tail()
    );
    let _ = std::fs::remove_file(probes);
    run
}

/// The optimized oracle's probes beyond [`HOST_PROBES`], each with the guest's own event
/// named with a `g` in front: one mid-function, a user string, a kernel string two pointers
/// away (`struct filename`'s `name`), and a return probe. The guest's probe cannot share
/// the address of our jump (its `int3` would go over it), so its mid-function probe is on
/// the next instruction after our region, where the arguments are the same: `mov
/// 0x5d8(%rdi),%rax` (`task->signal`, on getppid's way to `signal->pids[type]`) is ours,
/// `mov %esi,%esi` the guest's ([`MID_FUNCTION`] checks that the kernel has them there).
const OPTIMIZED_EXTRA: [(&str, &str); 4] = [
    (
        "p:pidmid __task_pid_nr_ns+0x45 task=%di type=%si",
        "p:gpidmid __task_pid_nr_ns+0x4c task=%di type=%si",
    ),
    (
        "p:open do_sys_openat2 path=+0(%si):ustring",
        "p:gopen do_sys_openat2 path=+0(%si):ustring",
    ),
    (
        "p:filp do_filp_open name=+0(+0(%si)):string",
        "p:gfilp do_filp_open name=+0(+0(%si)):string",
    ),
    (
        "r:ppidret __task_pid_nr_ns ret=$retval",
        "r:gppidret __task_pid_nr_ns ret=$retval",
    ),
];

/// The instructions of `__task_pid_nr_ns` that [`OPTIMIZED_EXTRA`]'s mid-function probes
/// are written for, at their offsets: another compiler or configuration moves them, and
/// this says so before the oracle compares values fetched from the wrong registers.
const MID_FUNCTION: [(usize, &[u8], &str); 2] = [
    (
        0x45,
        &[0x48, 0x8b, 0x87, 0xd8, 0x05, 0x00, 0x00],
        "mov 0x5d8(%rdi),%rax",
    ),
    (0x4c, &[0x89, 0xf6], "mov %esi,%esi"),
];

/// [`HOST_PROBES`] and [`OPTIMIZED_EXTRA`] in group `host`.
fn optimized_probes() -> String {
    let (function, _) = common::GuestFunction::bundled("__task_pid_nr_ns");
    for (at, bytes, insn) in MID_FUNCTION {
        assert!(
            function.starts.contains(&at) && function.code[at..].starts_with(bytes),
            "__task_pid_nr_ns+{at:#x} is not `{insn}` in the bundled guest: update OPTIMIZED_EXTRA to its code {:02x?}",
            function.code
        );
    }
    let mut text = HOST_PROBES.to_string();
    for (host, _) in OPTIMIZED_EXTRA {
        text.push_str(&host.replacen(':', ":host/", 1));
        text.push('\n');
    }
    text
}

/// Which of the guest's own events of [`OPTIMIZED_EXTRA`] a run defines. Each event of
/// the guest's costs ~10 s of guest time to enable on one vCPU and ~90 s on two (kvm_pvm
/// emulates the guest's cross-CPU text patching, its spinning included; measured with
/// `/proc/uptime` around each `echo`), so with two vCPUs the guest's `gk` at `+0` is the
/// only oracle: the other host probes are armed and optimized the same, their exits
/// counted, and compared with the guest's own events on one vCPU and under KASLR.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GuestEvents {
    All,
    EntryOnly,
}

fn optimized_guest_events(which: GuestEvents) -> Vec<String> {
    match which {
        GuestEvents::All => OPTIMIZED_EXTRA.iter().map(|(_, guest)| guest.to_string()).collect(),
        GuestEvents::EntryOnly => Vec::new(),
    }
}

fn optimized_workload(loops: usize, which: GuestEvents) -> String {
    oracle_workload_with(loops, &optimized_guest_events(which))
}

/// The oracle with every probe jump-optimized (`--optimize on`): the same hits and values as
/// the guest's own kprobe events. The probes only record, so their detours are event
/// ones: every hit written into a ring by the guest itself, no exit at all — the return
/// probe's too (an exit-free return probe), also where a kprobe shares its address
/// (`pidns` and `ppidret` on `__task_pid_nr_ns`: one jump, the two detours one after the
/// other).
fn check_optimized(run: &Run, loops: usize, which: GuestEvents) {
    check_oracle(run, loops);
    let calls = loops * LOOP_CALLS;
    let lines = |guest: bool, event: &str| -> Vec<TraceLine> {
        run.stdout
            .lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(parse_trace_line)
            .filter(|l| l.event == if guest { format!("g{event}") } else { event.to_string() })
            .collect()
    };
    // In the loop tasks (forked, run and gone inside the guest's window): the same values,
    // task by task. By pid: the guest's trace names a task by its last comm (from its
    // saved_cmdlines, when printed), ours by the comm at the hit ("sh" before the exec).
    let pid = |task: &str| task.rsplit('-').next().unwrap().to_string();
    let compared: &[&str] = match which {
        GuestEvents::All => &["pidmid", "ppidret"],
        GuestEvents::EntryOnly => &[],
    };
    for &event in compared {
        let loop_pids: std::collections::BTreeSet<String> = lines(true, event)
            .iter()
            .filter(|l| l.task.starts_with("hvprobe-loop-"))
            .map(|l| pid(&l.task))
            .collect();
        let by_task = |guest: bool| {
            let mut m: BTreeMap<String, Vec<BTreeMap<String, String>>> = BTreeMap::new();
            for l in lines(guest, event) {
                if loop_pids.contains(&pid(&l.task)) {
                    m.entry(pid(&l.task)).or_default().push(l.args);
                }
            }
            m
        };
        let (host, guest) = (by_task(false), by_task(true));
        let n: usize = guest.values().map(Vec::len).sum();
        assert!(
            n >= calls,
            "{event}: {n} hits of the guest's in the loop tasks\n{}",
            run.tail()
        );
        assert_eq!(host, guest, "{event}: the values differ");
    }
    // The strings: ten opens of /proc/version, in the guest's window and nowhere else.
    let strings: &[(&str, &str)] = match which {
        GuestEvents::All => &[("open", "path"), ("filp", "name")],
        GuestEvents::EntryOnly => &[],
    };
    for &(event, arg) in strings {
        let count = |guest: bool| {
            lines(guest, event)
                .iter()
                .filter(|l| l.args.get(arg).map(String::as_str) == Some("\"/proc/version\""))
                .count()
        };
        assert_eq!((count(false), count(true)), (10, 10), "{event}\n{}", run.tail());
    }

    let (hits, int3) = nothing_emulated_or_stepped(run);
    let number_after = |key: &str| -> u64 {
        let summary = run.stderr.lines().find(|l| l.contains("probe hits")).unwrap();
        let at = summary.find(key).unwrap_or_else(|| panic!("no {key:?} in {summary}")) + key.len();
        summary[at..]
            .trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (recorded, sync) = (number_after("recorded in the guest"), number_after("sync"));
    let listed: Vec<&str> = run.stderr.lines().filter(|l| l.contains(" hits=")).collect();
    let listed_hits = |kind: &str| -> u64 {
        listed
            .iter()
            .filter(|l| l.contains(kind))
            .map(|l| {
                l.split(" hits=")
                    .nth(1)
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            })
            .sum()
    };
    let (kprobe_hits, returns) = (listed_hits("  k  "), listed_hits("  r  "));
    assert!(returns > 0, "{}", run.tail());
    assert_eq!(
        recorded,
        kprobe_hits + returns,
        "every kprobe hit and every return recorded in the guest\n{}",
        run.tail()
    );
    // The only exits: the engine's hidden do_exit hook (a sync detour), once per task
    // that exits while return probes exist.
    assert_eq!(hits, recorded + sync);
    assert!(sync < 20, "{sync} sync hits\n{}", run.tail());
    assert_eq!(number_after("rings missed"), 0);
    // (A booted guest's own int3s, its text_poke at boot, are re-injected to it.)
    let reinjected = guest_int3s_reinjected(run);
    assert_eq!(
        int3 - reinjected,
        sync,
        "one exit per sync hit, none for a recorded hit or a return\n{}",
        run.tail()
    );
    let optimized = listed.iter().filter(|l| l.contains("[OPTIMIZED]")).count();
    assert_eq!(optimized, 6, "every probe is optimized\n{}", run.tail());
}

#[test]
fn optimized_probes_see_what_the_guest_sees_on_two_vcpus() {
    let dir = snapshot(2);
    let probes = probe_file("optimized2", &optimized_probes());
    let run = restore_with(
        &dir,
        2,
        &optimized_workload(2, GuestEvents::EntryOnly),
        &["--probes", probes.to_str().unwrap(), "--optimize=on"],
    );
    check_optimized(&run, 2, GuestEvents::EntryOnly);
    let _ = std::fs::remove_file(probes);
}

/// One vCPU, every guest event as the oracle, under KASLR (the relocation of every detour
/// with it; the same run on the PVH snapshot proved nothing more and cost ~2 minutes).
#[test]
fn optimized_probes_see_what_the_guest_sees_with_no_exit_on_one_vcpu_under_kaslr() {
    let run = kaslr_oracle_run(
        "optimized-kaslr",
        &optimized_probes(),
        &optimized_workload(1, GuestEvents::All),
        &["--optimize=on"],
    );
    check_optimized(&run, 1, GuestEvents::All);
}

#[test]
fn the_kernel_text_after_optimized_probes_hashes_like_a_run_without_them() {
    let dir = snapshot(1);
    let probes = probe_file("optimized-hash", HOST_PROBES);
    let hash = |run: &Run| {
        assert_eq!(run.code, Some(0), "{}", run.tail());
        run.stderr
            .lines()
            .find_map(|l| l.strip_prefix("hvprobe: kernel text sha256 "))
            .unwrap_or_else(|| panic!("no hash\n{}", run.tail()))
            .to_string()
    };
    let with = restore_with(
        &dir,
        1,
        "hvprobe-loop 5",
        &["--probes", probes.to_str().unwrap(), "--optimize=on", "--text-hash"],
    );
    assert!(with.stderr.contains("[OPTIMIZED]"), "{}", with.tail());
    let without = restore_with(&dir, 1, "hvprobe-loop 5", &["--text-hash"]);
    assert_eq!(hash(&with), hash(&without));
    let _ = std::fs::remove_file(probes);
}

/// The byte offsets of `struct file`'s `f_pos` and `f_flags` in the bundled guest, from its
/// vmlinux's BTF (to give the guest's own 6.1 event, which has no BTF arguments, the same
/// fetches by offset).
fn bundled_file_offsets() -> (u64, u64) {
    use hvprobe_introspection::btf::Btf;
    use hvprobe_introspection::memory::ElfImage;
    use hvprobe_introspection::symbols::SymbolTable;
    let guest_dir = common::bundled_guest_dir();
    let bytes = std::fs::read(guest_dir.join("vmlinux")).unwrap();
    let symbols = SymbolTable::parse_elf(&bytes).unwrap();
    let image = ElfImage::from_bytes(bytes).unwrap();
    let start = symbols.lookup("__start_BTF").unwrap().addr;
    let stop = symbols.lookup("__stop_BTF").unwrap().addr;
    let btf = Btf::from_guest(&image, start, stop).unwrap();
    let offset = |member: &str| btf.member_offset("file", member).unwrap().offset;
    (offset("f_pos"), offset("f_flags"))
}

/// BTF arguments (Linux 6.5+: parameters by name, `$arg*`, `->` fields), resolved against
/// the guest's own BTF when armed, fetch what the guest's own 6.1 kprobe event fetches
/// with the registers and offsets they stand for, hit for hit, printed alike.
#[test]
fn btf_arguments_fetch_what_the_guests_own_event_fetches_by_register_and_offset() {
    check_btf_arguments(&[]);
}

/// The same with the probe jump-optimized: the resolved fetches run in the event detour.
#[test]
fn optimized_btf_arguments_fetch_what_the_guests_own_event_fetches() {
    let run = check_btf_arguments(&["--optimize=on"]);
    assert!(
        run.stderr.contains("optimized: recorded in the guest ") && !run.stderr.contains("recorded in the guest 0,"),
        "the detour recorded the hits\n{}",
        run.tail()
    );
}

fn check_btf_arguments(extra: &[&str]) -> Run {
    let (f_pos, f_flags) = bundled_file_offsets();
    let guest_event = format!(
        "p:grd vfs_read file=%di:x64 buf=%si:x64 count=%dx:u64 pos=%cx:x64 fpos=+{f_pos}(%di):s64 \
         flags=+{f_flags}(%di):u32"
    );
    compare_vfs_reads(
        "p:host/rd vfs_read $arg* fpos=file->f_pos flags=file->f_flags",
        &guest_event,
        extra,
    )
}

/// Immediate strings, bitfields and arrays (which the 6.1 guest has too) fetch and print
/// what the guest's own event does.
#[test]
fn immediate_strings_bitfields_and_arrays_print_as_the_guests_own_event() {
    let (f_pos, _) = bundled_file_offsets();
    let args = "s=\\\"hello\" c=+0(%di):b4@2/32 a=+0(%di):x8[4] u=+u0(%si):x8 count=%dx:u64";
    compare_vfs_reads(
        &format!("p:host/rd vfs_read {args} fpos=file->f_pos"),
        &format!("p:grd vfs_read {args} fpos=+{f_pos}(%di):s64"),
        &[],
    );
}

/// perf probe's source targets, with variables by name from the kernel's DWARF: at
/// `vfs_read@fs/read_write.c` (the entry) `count` and `file->f_pos` read what the guest's own
/// event reads through the calling convention; at `vfs_read:23` (`if (ret > 0)`, after the
/// read: checked by `source_lines_and_variables_are_where_the_dwarf_and_addr2line_put_them`)
/// `ret` is what each read returned (one byte), `*pos` has moved on by it, and `file->f_pos`
/// (named `f_pos`, as perf probe names it) has not yet: `ksys_read` passes a copy and writes
/// it back after `vfs_read` returns; a global of the file reads by name too.
#[test]
fn source_line_probes_read_variables_as_the_guests_event_and_the_read_itself_say() {
    let (f_pos, _) = bundled_file_offsets();
    let run = compare_vfs_reads(
        "p:host/rd vfs_read@fs/read_write.c count fpos=file->f_pos\n\
         p:host/after vfs_read:23 ret file->f_pos next=+0(pos):s64 ri=generic_ro_fops.read_iter:symbol",
        &format!("p:grd vfs_read count=%dx:u64 fpos=+{f_pos}(%di):s64"),
        &[],
    );
    let host: Vec<TraceLine> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(parse_trace_line)
        .collect();
    // The one-byte reads of the child shells: each is followed by its line-23 hit, which
    // says the read returned 1 and its position moved on by one.
    let reads: Vec<&TraceLine> = host
        .iter()
        .filter(|l| l.event == "rd" && l.args["count"] == "1")
        .collect();
    assert!(reads.len() >= 30, "{}", run.tail());
    for read in &reads {
        let at: i64 = read.args["fpos"].parse().unwrap();
        let after = host
            .iter()
            .find(|l| l.event == "after" && l.task == read.task && l.args["f_pos"] == at.to_string())
            .unwrap_or_else(|| panic!("no line-23 hit of {} at f_pos {at}\n{}", read.task, run.tail()));
        assert_eq!(after.args["ret"], "1", "{}", run.tail());
        assert_eq!(after.args["next"], (at + 1).to_string(), "{}", run.tail());
        // A global of the function's file, by name (fs/read_write.c's
        // `generic_ro_fops = { .read_iter = generic_file_read_iter, ... }`).
        assert!(
            after.args["ri"].starts_with("generic_file_read_iter+0x0/"),
            "{:?}",
            after.args
        );
        assert!(after.location.starts_with("vfs_read+0x"), "{}", after.location);
    }
}

/// A struct on the stack, by member: `__do_sys_newfstatat`'s `struct kstat stat` lives at
/// `DW_OP_fbreg` (the frame's CFA, which ORC gives at the site, plus an offset); at its
/// line 7 (after `vfs_fstatat` filled it) `stat.size` and `stat.ino` are what the guest's
/// own `stat` prints for the file.
#[test]
fn a_struct_on_the_stack_reads_by_member_what_the_guests_stat_prints() {
    let dir = snapshot(1);
    let probes = probe_file(
        "stack-struct",
        "p:s/st __do_sys_newfstatat:7 size=stat.size ino=stat.ino error\n",
    );
    let run = restore_with(
        &dir,
        1,
        "busybox stat -c 'STAT %s %i' /init /hvprobe /proc/version",
        &["--probes", probes.to_str().unwrap()],
    );
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let printed: Vec<(String, String)> = run
        .stdout
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("STAT "))
        .map(|l| {
            let (size, ino) = l.split_once(' ').unwrap();
            (size.to_owned(), ino.to_owned())
        })
        .collect();
    assert_eq!(printed.len(), 3, "{}", run.tail());
    let hits: Vec<(String, String)> = run
        .stdout
        .lines()
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "st" && l.task.starts_with("busybox-") && l.args["error"] == "0")
        .map(|l| (l.args["size"].clone(), l.args["ino"].clone()))
        .collect();
    for file in &printed {
        assert!(hits.contains(file), "{file:?} not among {hits:?}\n{}", run.tail());
    }
}

/// `hvprobe lines` numbers `vfs_read`'s lines from its declaration as perf probe's `-L`
/// does (line 23 is `if (ret > 0)` in the source the bundled kernel was built from), and
/// `hvprobe vars` puts `vfs_read:23` at an address binutils' `addr2line` maps to that
/// line, with `ret` readable there and `buf` refused (only its entry value is described).
#[test]
fn source_lines_and_variables_are_where_the_dwarf_and_addr2line_put_them() {
    let timeout = Duration::from_secs(120);
    let lines = hvprobe(&["lines", "vfs_read"], timeout);
    assert_eq!(lines.code, Some(0), "{}", lines.tail());
    let header = lines.stdout.lines().next().unwrap_or_default().to_owned();
    assert!(
        header.starts_with("<vfs_read@") && header.ends_with("fs/read_write.c:0>"),
        "{header}"
    );
    let numbered = |n: &str| {
        lines
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(n))
            .map(|l| l[9..].trim().to_owned())
    };
    assert_eq!(numbered("23").as_deref(), Some("if (ret > 0) {"), "{}", lines.stdout);
    assert!(lines
        .stdout
        .lines()
        .nth(1)
        .unwrap()
        .contains("ssize_t vfs_read(struct file *file"));

    let vars = hvprobe(&["vars", "vfs_read:23"], timeout);
    assert_eq!(vars.code, Some(0), "{}", vars.tail());
    let site = vars
        .stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("@<vfs_read+").and_then(|o| o.strip_suffix('>')))
        .unwrap_or_else(|| panic!("{}", vars.stdout));
    let offset = u64::from_str_radix(site.trim_start_matches("0x"), 16).unwrap();
    let (function, _) = common::GuestFunction::bundled("vfs_read");
    let debug = common::bundled_guest_dir().join("vmlinux.debug");
    let out = std::process::Command::new("addr2line")
        .arg("-e")
        .arg(&debug)
        .arg(format!("{:#x}", function.addr + offset))
        .output()
        .expect("addr2line (binutils)");
    let place = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // Line 23 counts from the declaration's line in the source file itself.
    let file = header.trim_start_matches("<vfs_read@").trim_end_matches(":0>");
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file}: {e}"));
    let decl = 1 + text
        .lines()
        .position(|l| l.starts_with("ssize_t vfs_read(struct file *file"))
        .expect("vfs_read's declaration");
    assert!(
        place.ends_with(&format!("fs/read_write.c:{}", decl + 23)),
        "addr2line says {place}"
    );
    assert!(
        vars.stdout
            .lines()
            .any(|l| l.contains("ssize_t") && l.contains("ret=%") && l.ends_with(":s64")),
        "{}",
        vars.stdout
    );
    assert!(
        vars.stdout
            .lines()
            .any(|l| l.contains(" buf (") && l.contains("DW_OP_entry_value")),
        "{}",
        vars.stdout
    );
}

/// An inlined function (perf probe's reach): `fsnotify_access@include/linux/fsnotify.h`, a
/// `static inline` with no code of its own, is one event over every instance the DWARF
/// knows (each site one binutils `addr2line -i` also puts inside `fsnotify_access`), listed
/// under that event; in two child shells' reads and writes, the hits at the instances in
/// `vfs_read` and `vfs_write` are, task by task, the calls the guest's own return probes on
/// those functions see return more than 0 (both call `fsnotify_access`'s code when
/// `ret > 0`). (The guest cannot put its own kprobe on the instances' addresses while our
/// int3s are there: Linux refuses an int3 it did not write.)
#[test]
fn an_inlined_function_is_one_event_over_its_instances_counting_what_the_guest_counts() {
    let timeout = Duration::from_secs(180);
    let vars = hvprobe(&["vars", "fsnotify_access@include/linux/fsnotify.h"], timeout);
    assert_eq!(vars.code, Some(0), "{}", vars.tail());
    let sites: Vec<String> = vars
        .stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("@<").and_then(|s| s.strip_suffix('>')))
        .map(str::to_owned)
        .collect();
    assert!(sites.len() >= 2, "{}", vars.stdout);
    // Each site is inside an inlined fsnotify_access, as binutils reads the DWARF.
    let symbols = common::bundled_guest_dir().join("System.map");
    let map = std::fs::read_to_string(&symbols).unwrap();
    let address_of = |site: &str| -> u64 {
        let (name, offset) = site.split_once("+0x").unwrap();
        let base = map
            .lines()
            .find(|l| l.ends_with(&format!(" {name}")) && l.contains(" t ") || l.ends_with(&format!(" T {name}")))
            .and_then(|l| u64::from_str_radix(l.split(' ').next().unwrap(), 16).ok())
            .unwrap_or_else(|| panic!("{name} in System.map"));
        base + u64::from_str_radix(offset, 16).unwrap()
    };
    let debug = common::bundled_guest_dir().join("vmlinux.debug");
    for site in &sites {
        let out = std::process::Command::new("addr2line")
            .args(["-i", "-f", "-e"])
            .arg(&debug)
            .arg(format!("{:#x}", address_of(site)))
            .output()
            .expect("addr2line (binutils)");
        let chain = String::from_utf8_lossy(&out.stdout);
        assert!(chain.lines().any(|l| l == "fsnotify_access"), "{site}: {chain}");
    }
    let in_read = sites
        .iter()
        .find(|s| s.starts_with("vfs_read+"))
        .expect("an instance in vfs_read");
    let in_write = sites
        .iter()
        .find(|s| s.starts_with("vfs_write+"))
        .expect("an instance in vfs_write");

    let dir = snapshot(1);
    let probes = probe_file("inlined", "p:inl/acc fsnotify_access@include/linux/fsnotify.h\n");
    let workload = "T=/sys/kernel/tracing; echo 'r:gr vfs_read ret=$retval:s64' > $T/kprobe_events; \
         echo 'r:gw vfs_write ret=$retval:s64' >> $T/kprobe_events; \
         echo 1 > $T/events/kprobes/enable; \
         i=0; while [ $i -lt 2 ]; do sh -c 'read -r l < /proc/version; echo x > /dev/null'; i=$((i+1)); done; \
         echo 0 > $T/events/kprobes/enable; \
         busybox grep -E ' g[rw]: ' $T/trace | busybox sed 's/^/GUEST /'";
    let run = restore_with(&dir, 1, workload, &["--probes", probes.to_str().unwrap()]);
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let listed = run.stderr.lines().filter(|l| l.contains("event=inl/acc")).count();
    assert_eq!(
        listed,
        sites.len(),
        "every instance listed under the one event\n{}",
        run.stderr
    );
    let count = |guest: bool| -> BTreeMap<(String, String), usize> {
        let mut m = BTreeMap::new();
        for l in run
            .stdout
            .lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(parse_trace_line)
        {
            let site = match (guest, l.event.as_str()) {
                (true, "gr") if l.args["ret"].parse::<i64>().unwrap() > 0 => in_read.clone(),
                (true, "gw") if l.args["ret"].parse::<i64>().unwrap() > 0 => in_write.clone(),
                (false, "acc") => l.location.split('/').next().unwrap_or_default().to_owned(),
                _ => continue,
            };
            if &site == in_read || &site == in_write {
                *m.entry((l.task, site)).or_default() += 1;
            }
        }
        m
    };
    let guest = count(true);
    let host = count(false);
    // The child shells: tasks the guest saw read /proc/version a byte at a time.
    let children: Vec<&(String, String)> = guest.keys().filter(|(_, s)| s == in_read).collect();
    assert!(children.len() >= 2, "{}", run.tail());
    assert!(
        guest.keys().any(|(_, s)| s == in_write),
        "the shells' writes\n{}",
        run.tail()
    );
    for (task, _) in children {
        for site in [in_read, in_write] {
            let key = (task.clone(), site.clone());
            assert_eq!(host.get(&key), guest.get(&key), "{task} at {site}\n{}", run.tail());
        }
    }
}

/// Three shells each read `/proc/version` one byte at a time, with the host's probe `host`
/// (event `rd`, on `vfs_read`) armed and the guest's own `guest` (event `grd`) enabled
/// around them: each read's values, keyed by the file position (`fpos`), are the same.
fn compare_vfs_reads(host: &str, guest_event: &str, extra: &[&str]) -> Run {
    let dir = snapshot(1);
    let probes = probe_file("vfs-reads", &format!("{host}\n"));
    let arg_count = guest_event.split_whitespace().count() - 2;
    let workload = format!(
        "T=/sys/kernel/tracing; echo '{guest_event}' > $T/kprobe_events; echo 1 > $T/events/kprobes/grd/enable; \
         i=0; while [ $i -lt 3 ]; do sh -c 'read -r l < /proc/version'; i=$((i+1)); done; \
         echo 0 > $T/events/kprobes/grd/enable; \
         busybox grep ' grd: ' $T/trace | busybox sed 's/^/GUEST /'"
    );
    let mut args = vec!["--probes", probes.to_str().unwrap()];
    args.extend_from_slice(extra);
    let run = restore_with(&dir, 1, &workload, &args);
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let lines = |guest: bool| -> Vec<TraceLine> {
        run.stdout
            .lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(parse_trace_line)
            .filter(|l| l.event == if guest { "grd" } else { "rd" })
            .collect()
    };
    let pid = |task: &str| task.rsplit('-').next().unwrap().to_string();
    // The child shells (forked, run and gone inside the guest's window): every read of
    // theirs, in order, with the same values.
    let guest = lines(true);
    let children: std::collections::BTreeSet<String> = guest
        .iter()
        .filter(|l| l.args.get("count").map(String::as_str) == Some("1"))
        .map(|l| pid(&l.task))
        .collect();
    assert!(children.len() >= 3, "three shells read /proc/version\n{}", run.tail());
    let by_pid = |lines: Vec<TraceLine>| {
        let mut m: BTreeMap<String, Vec<BTreeMap<String, String>>> = BTreeMap::new();
        for l in lines {
            if children.contains(&pid(&l.task)) {
                m.entry(pid(&l.task)).or_default().push(l.args);
            }
        }
        m
    };
    let (host, guest) = (by_pid(lines(false)), by_pid(guest));
    assert_eq!(host.keys().collect::<Vec<_>>(), guest.keys().collect::<Vec<_>>());
    for (pid, guest_hits) in &guest {
        let host_hits = &host[pid];
        // Each whole guest line is compared with the host's hit at the same file position
        // (one byte per read, so each read has its own), and nearly all must be whole. The
        // host's own output no longer cuts guest lines (a piped console is printed a whole
        // line at a time); the tolerance stays until runs show nothing else cuts them.
        let at = |hits: &Vec<BTreeMap<String, String>>, fpos: &str| {
            hits.iter()
                .find(|h| h.get("fpos").map(String::as_str) == Some(fpos))
                .cloned()
        };
        let whole: Vec<&BTreeMap<String, String>> = guest_hits.iter().filter(|g| g.len() == arg_count).collect();
        for g in &whole {
            assert_eq!(
                at(host_hits, &g["fpos"]).as_ref(),
                Some(*g),
                "pid {pid}\n{}",
                run.tail()
            );
        }
        assert!(guest_hits.len() <= host_hits.len(), "pid {pid}\n{}", run.tail());
        assert!(
            whole.len() * 10 >= host_hits.len() * 9,
            "pid {pid}: {} of the host's {} hits in whole guest lines",
            whole.len(),
            host_hits.len()
        );
    }
    // The file position moves as the shell reads its one byte at a time.
    let positions: Vec<&str> = guest
        .values()
        .next()
        .unwrap()
        .iter()
        .filter_map(|a| a.get("fpos").map(String::as_str))
        .collect();
    assert!(positions.windows(2).any(|w| w[0] != w[1]), "{positions:?}");
    run
}

/// An execution watch (a debug register) on `__x64_sys_getppid`'s ftrace site — where an
/// int3 probe may not go, and which the guest rewrites into a call while its own
/// ftrace-based kprobe event on the function is on — counts every call, as that event and
/// an int3 probe further in do; the listing shows it as `w`, and the guest stays healthy.
#[test]
fn an_execution_watch_on_an_ftrace_site_counts_what_the_guests_own_kprobe_counts() {
    let dir = snapshot(1);
    let probes = probe_file(
        "xwatch",
        "w:host/xsite __x64_sys_getppid:x comm=$comm\np:host/getppid __x64_sys_getppid di=%di s0=$stack0 comm=$comm\n",
    );
    let run = restore_with(
        &dir,
        1,
        &oracle_workload(1),
        &["--probes", probes.to_str().unwrap(), "--optimize=off"],
    );
    // The guest's event and the int3 probe agree, hit for hit and value for value.
    let expected = check_oracle(&run, 1);
    let watch: Vec<TraceLine> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "xsite" && l.task.starts_with("hvprobe-loop-"))
        .collect();
    assert_eq!(watch.len(), expected, "watch hits in the loop tasks\n{}", run.tail());
    let location = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("GUEST "))
        .filter_map(parse_trace_line)
        .find(|l| l.event == "gk")
        .map(|l| l.location)
        .expect("the guest's own event");
    assert!(
        watch.iter().all(|l| l.location == location),
        "the watch's location, not {location}\n{}",
        run.tail()
    );
    let listed = run
        .stderr
        .lines()
        .find(|l| l.contains("  w  __x64_sys_getppid+0x0/1:x"))
        .unwrap_or_else(|| panic!("no listing line of the watch\n{}", run.tail()));
    assert!(listed.contains("nmissed=0 event=host/xsite"), "{listed}");
    // Every hit of the watch was one debug-register exit, and none was an int3's.
    let hits: u64 = listed
        .split(" hits=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{listed}"));
    let exits = run
        .stderr
        .lines()
        .find(|l| l.contains(" debug-register)"))
        .unwrap_or_else(|| panic!("no exit counts\n{}", run.tail()));
    let debug_register: u64 = exits
        .split(" debug-register)")
        .next()
        .and_then(|s| s.rsplit(", ").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{exits}"));
    assert!(hits >= expected as u64, "{listed}");
    assert_eq!(debug_register, hits, "{exits}\n{listed}");
    let _ = std::fs::remove_file(probes);
}

/// A write watch on `kptr_restrict`, which the workload sets three times through its
/// sysctl: on hardware KVM every write is reported, by the instruction that wrote it, with
/// the value it wrote; on kvm_pvm, whose emulator checks no data breakpoints, the watch is
/// refused with the reason.
#[test]
fn a_write_watch_reports_every_write_of_a_sysctl_variable_where_data_breakpoints_fire() {
    let dir = snapshot(1);
    let probes = probe_file("wwatch", "w:host/kptr kptr_restrict/4:w val=@kptr_restrict:s32\n");
    let workload = "for v in 1 2 0; do echo $v > /proc/sys/kernel/kptr_restrict; done; echo WROTE";
    let run = restore_with(&dir, 1, workload, &["--probes", probes.to_str().unwrap()]);
    let _ = std::fs::remove_file(probes);
    if !hvprobe::vmm::Backend::detect().data_breakpoints_fire() {
        assert_ne!(run.code, Some(0), "{}", run.tail());
        assert!(
            run.stderr
                .contains("kptr_restrict+0x0: kvm_pvm emulates guest kernel code")
                && run.stderr.contains("a data watch would never fire there"),
            "the refusal's reason\n{}",
            run.tail()
        );
        return;
    }
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let hits: Vec<TraceLine> = run
        .stdout
        .lines()
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "kptr")
        .collect();
    let values: Vec<&str> = hits.iter().map(|l| l.args["val"].as_str()).collect();
    assert_eq!(values, ["1", "2", "0"], "one hit per write, after it\n{}", run.tail());
    // The writer: the sysctl's integer conversion, not the instruction after it.
    for hit in &hits {
        assert!(hit.location.contains("dointvec"), "{}\n{}", hit.location, run.tail());
    }
    common::assert_guest_healthy(&run, &[]);
}

/// Four watches at once, one per debug register, each firing on its own function; a fifth
/// is refused with the four named, and nothing of its file is armed.
#[test]
fn four_watches_fire_together_and_a_fifth_is_refused_naming_them() {
    let dir = snapshot(1);
    let four = "w:host/getppid __x64_sys_getppid:x\nw:host/pidns __task_pid_nr_ns:x\n\
                w:host/vfsread vfs_read:x\nw:host/ksysread ksys_read:x\n";
    let probes = probe_file("four-watches", four);
    let workload = "hvprobe-loop 3; read -r l < /proc/version; echo READ";
    let run = restore_with(&dir, 1, workload, &["--probes", probes.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    for event in ["getppid", "pidns", "vfsread", "ksysread"] {
        let line = run
            .stderr
            .lines()
            .find(|l| l.contains("  w  ") && l.ends_with(&format!("event=host/{event}")))
            .unwrap_or_else(|| panic!("no listing line of {event}\n{}", run.tail()));
        let hits: u64 = line
            .split(" hits=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(hits >= 1, "{event} never fired: {line}");
    }
    let loop_hits = run
        .stdout
        .lines()
        .filter_map(parse_trace_line)
        .filter(|l| l.event == "getppid" && l.task.starts_with("hvprobe-loop-"))
        .count();
    assert_eq!(loop_hits, 3, "one getppid watch hit per call\n{}", run.tail());

    let five = probe_file("five-watches", &format!("{four}w:host/fifth vfs_write:x\n"));
    let run = restore_with(&dir, 1, "echo RAN", &["--probes", five.to_str().unwrap()]);
    assert_ne!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.stderr
            .contains("all four debug registers are in use (by host/getppid at __x64_sys_getppid+0x0/1:x")
            && run.stderr.contains("host/ksysread at ksys_read+0x0/1:x"),
        "{}",
        run.tail()
    );
    assert!(!run.console_has_line("RAN"), "nothing runs after a refused file");
    let _ = std::fs::remove_file(probes);
    let _ = std::fs::remove_file(five);
}

/// Exit-free return probes on `vfs_read` and on `ksys_read`, which `__x64_sys_read`
/// tail-calls (`jmp ksys_read`: its return goes through the same stack slot as
/// `__x64_sys_read`'s), beside the guest's own kretprobe events on both: a shell's
/// one-byte `read -r` loop gives the same returns, values and callers, in order, with no
/// exit for any call.
#[test]
fn exit_free_return_probes_on_read_and_a_tail_called_function_agree_with_the_guests() {
    let dir = snapshot(1);
    let probes = probe_file(
        "exit-free-read",
        "r:host/vfs vfs_read ret=$retval\nr:host/ksys ksys_read ret=$retval\n",
    );
    let workload = "T=/sys/kernel/tracing; echo 'r:gvfs vfs_read ret=$retval' > $T/kprobe_events; \
         echo 'r:gksys ksys_read ret=$retval' >> $T/kprobe_events; echo abc > /tmp/f; \
         sh -c 'echo LOOP $$; echo 1 > /sys/kernel/tracing/events/kprobes/enable; i=0; \
         while [ $i -lt 10 ]; do read -r l < /tmp/f; i=$((i+1)); done; \
         echo 0 > /sys/kernel/tracing/events/kprobes/enable'; \
         while read l; do case $l in *' gvfs: '*|*' gksys: '*) echo \"GUEST $l\";; esac; done < $T/trace";
    let run = restore_with(
        &dir,
        1,
        workload,
        &["--probes", probes.to_str().unwrap(), "--optimize=on"],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &[]);
    let pids = loop_pids(&run);
    assert_eq!(pids.len(), 1, "{}", run.tail());
    let pid = &pids[0];
    let returns = |guest: bool| -> Vec<(String, String, String)> {
        run.stdout
            .lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(parse_trace_line)
            .filter(|l| l.task.rsplit('-').next() == Some(pid.as_str()))
            .map(|l| {
                (
                    l.event.trim_start_matches('g').to_string(),
                    l.location,
                    l.args["ret"].clone(),
                )
            })
            .collect()
    };
    let (host, guest) = (returns(false), returns(true));
    // Ten loops of four one-byte reads ("abc\n"), each a ksys_read and a vfs_read.
    assert!(
        guest.len() >= 80,
        "{} returns in the guest's trace\n{}",
        guest.len(),
        run.tail()
    );
    assert_eq!(host, guest, "returns, callers or values differ");
    assert!(
        guest
            .iter()
            .any(|(e, at, _)| e == "ksys" && !at.contains("rethook") && !at.contains("0xffffffff82")),
        "{guest:?}"
    );
    let (_, int3) = nothing_emulated_or_stepped(&run);
    assert!(
        int3 < 40,
        "{int3} int3 exits for {} returns\n{}",
        host.len(),
        run.tail()
    );
    let _ = std::fs::remove_file(probes);
}

/// Exit-free return probes on two vCPUs: two shells pinned to the two CPUs each run a
/// one-byte `read -r` loop at once; every `ksys_read` of each is followed and returns its
/// value — to both return probes on it (their detours one after the other: the second's
/// entry finds the first's stub and takes its caller) — as does the `vfs_read` inside it,
/// with the callers named, and no call traps.
#[test]
fn exit_free_return_probes_follow_both_vcpus_calls() {
    let dir = snapshot(2);
    let probes = probe_file(
        "exit-free-2cpu",
        "r:host/vfs vfs_read ret=$retval\nr:host/ksys ksys_read ret=$retval\nr:host/ksys2 ksys_read ret=$retval\n",
    );
    let workload = "echo abc > /tmp/f; for c in 0 1; do taskset -c $c sh -c 'echo LOOP $$; i=0; \
         while [ $i -lt 20 ]; do read -r l < /tmp/f; i=$((i+1)); done' & done; wait";
    let run = restore_with(
        &dir,
        2,
        workload,
        &["--probes", probes.to_str().unwrap(), "--optimize=on"],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &[]);
    let pids = loop_pids(&run);
    assert_eq!(pids.len(), 2, "{}", run.tail());
    let lines: Vec<TraceLine> = run.stdout.lines().filter_map(parse_trace_line).collect();
    let mut cpus = std::collections::BTreeSet::new();
    for pid in &pids {
        let of = |event: &str| -> Vec<&TraceLine> {
            lines
                .iter()
                .filter(|l| l.event == event && l.task.rsplit('-').next() == Some(pid.as_str()))
                .collect()
        };
        let (ksys, vfs, ksys2) = (of("ksys"), of("vfs"), of("ksys2"));
        // Twenty loops of one-byte reads up to the newline of "abc\n".
        assert!(
            ksys.len() >= 80,
            "task {pid}: {} ksys_read returns\n{}",
            ksys.len(),
            run.tail()
        );
        let values = |v: &[&TraceLine]| v.iter().map(|l| l.args["ret"].clone()).collect::<Vec<_>>();
        assert_eq!(values(&ksys), values(&vfs), "task {pid}: the values differ");
        let callers = |v: &[&TraceLine]| v.iter().map(|l| l.location.clone()).collect::<Vec<_>>();
        assert_eq!(
            (values(&ksys2), callers(&ksys2)),
            (values(&ksys), callers(&ksys)),
            "task {pid}: the second return probe on ksys_read"
        );
        for l in &ksys {
            assert!(
                l.location.ends_with("<- ksys_read") && l.location.starts_with("pvm_user_syscall")
                    || l.location.starts_with("do_syscall_64"),
                "{}",
                l.location
            );
        }
        assert!(
            vfs.iter().all(|l| l.location.starts_with("ksys_read+")),
            "{:?}",
            vfs[0].location
        );
        cpus.extend(
            run.stdout
                .lines()
                .filter(|l| l.contains(&format!("-{pid} ")))
                .filter_map(|l| l.split('[').nth(1)?.split(']').next()?.trim().parse::<u32>().ok()),
        );
    }
    assert_eq!(cpus.len(), 2, "the loops ran on both vCPUs");
    let (_, int3) = nothing_emulated_or_stepped(&run);
    assert!(int3 < 40, "{int3} int3 exits\n{}", run.tail());
    assert!(run.stderr.contains("nmissed=0 event=host/ksys"), "{}", run.tail());
    let _ = std::fs::remove_file(probes);
}
