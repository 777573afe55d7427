//! Probes in kernel modules (`MOD:SYM`) on the bundled guest, with its test module
//! `hvprobe_test` (guest/modules/hvprobe_test.c), checked against the guest's own kprobe
//! event on the same `MOD:SYM` (the oracle): set before the module loads, armed before its
//! init runs, the same hits and values through an unload and a second load, `[GONE]`
//! after the unload, stacks through the module's frames (`[hvprobe_test]`) equal to the
//! guest's own `stacktrace` trigger, and the module's own kprobe blacklist honoured.

use crate::common;

use std::time::Duration;

use common::{parse_trace_line, probe_file, snapshot, Run, TraceLine};

const RESTORE_TIMEOUT: Duration = Duration::from_secs(480);
/// hvprobe_test_init calls hvprobe_test_work this many times (HVPROBE_TEST_INIT_CALLS).
const INIT_CALLS: usize = 3;
/// Each `read -r l < /proc/hvprobe_test` is two read() calls: one call each.
const CALLS_PER_READ: usize = 2;

/// The guest's own event `gk` on `hvprobe_test:hvprobe_test_work` (defined and enabled
/// before the module exists: Linux keeps it until the module comes), with a `stacktrace`
/// trigger, and its return probe `gr`; then the module loaded, `reads` reads of its file, unloaded, loaded again for
/// one more read and unloaded; then the guest's profile. The guest's trace is printed
/// (marked) and cleared before each unload: the kernel names a module's addresses when
/// the trace is read, and cannot once the module is gone.
fn workload(reads: usize) -> String {
    let dump = "while read -r l; do echo \"GUEST $l\"; done < $T/trace; echo > $T/trace";
    format!(
        "T=/sys/kernel/tracing; echo 1 > $T/options/sym-offset; \
         echo 'p:gk hvprobe_test:hvprobe_test_work n=%di' > $T/kprobe_events; \
         echo 'r:gr hvprobe_test:hvprobe_test_work ret=$retval' >> $T/kprobe_events; \
         echo stacktrace > $T/events/kprobes/gk/trigger; echo 1 > $T/events/kprobes/enable; \
         busybox insmod /usr/lib/hvprobe/hvprobe_test.ko; \
         i=0; while [ $i -lt {reads} ]; do read -r l < /proc/hvprobe_test; i=$((i+1)); done; \
         {dump}; busybox rmmod hvprobe_test; echo UNLOADED-1; \
         busybox insmod /usr/lib/hvprobe/hvprobe_test.ko; read -r l < /proc/hvprobe_test; \
         {dump}; busybox rmmod hvprobe_test; echo UNLOADED-2; \
         echo 0 > $T/events/kprobes/enable; \
         while read l; do echo \"PROFILE $l\"; done < $T/kprobe_profile; echo CONSOLE-END; sleep 1"
    )
}

const HOST_PROBES: &str = "\
p:host/work hvprobe_test:hvprobe_test_work n=%di
r:host/ret hvprobe_test:hvprobe_test_work ret=$retval
p:host/init hvprobe_test:hvprobe_test_init
";

fn run_with(cpus: u8, name: &str, probes: &str, workload: &str, extra: &[&str]) -> Run {
    let dir = snapshot(cpus);
    let file = probe_file(name, probes);
    let mut args = vec!["--probes", file.to_str().unwrap(), "--no-control", "--sym-offset"];
    args.extend_from_slice(extra);
    let run = common::restore_with(&dir, cpus, workload, &args, RESTORE_TIMEOUT);
    let _ = std::fs::remove_file(file);
    run
}

fn lines<'a>(run: &'a Run, guest: bool, event: &'a str) -> Vec<TraceLine> {
    run.stdout
        .lines()
        .filter(|l| l.starts_with("GUEST ") == guest)
        .filter_map(parse_trace_line)
        .filter(|l| l.event == event)
        .collect()
}

/// Each `<stack trace>` of the output (the host's, or the guest's), its frames in order.
fn stacks(run: &Run, guest: bool) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in run.stdout.lines() {
        let Some(line) = (if guest { line.strip_prefix("GUEST ") } else { Some(line) }) else {
            continue;
        };
        if !guest && line.starts_with("GUEST ") {
            continue;
        }
        let line = line.trim_start();
        if let Some(frame) = line.strip_prefix("=> ") {
            if let Some(s) = current.as_mut() {
                s.push(frame.trim().to_owned());
            }
            continue;
        }
        out.extend(current.take());
        if line.contains(": <stack trace>") {
            current = Some(Vec::new());
        }
    }
    out.extend(current);
    out
}

#[test]
fn a_module_probe_set_before_the_module_loads_sees_what_the_guests_own_sees_through_unload_and_reload() {
    let reads = 4;
    let run = run_with(
        1,
        "modules",
        HOST_PROBES,
        &workload(reads),
        &["--trigger", "host/work:stacktrace"],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.stdout.contains("UNLOADED-2"),
        "the workload did not finish\n{}",
        run.tail()
    );
    let expected = 2 * INIT_CALLS + (reads + 1) * CALLS_PER_READ;

    // The guest's own count, and its values in order, equal the host's.
    let profile = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("PROFILE "))
        .find(|l| l.split_whitespace().next() == Some("gk"))
        .unwrap_or_else(|| panic!("no kprobe_profile line of gk\n{}", run.tail()));
    let guest_hits: usize = profile.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(guest_hits, expected, "the guest's own probe: {profile}");
    let guest = lines(&run, true, "gk");
    let host = lines(&run, false, "work");
    let values = |l: &[TraceLine]| l.iter().map(|t| t.args["n"].clone()).collect::<Vec<_>>();
    assert_eq!(host.len(), expected, "host hits\n{}", run.tail());
    assert_eq!(values(&host), values(&guest), "fetched values differ");
    // The returns too, with the same values (the guest's own kretprobe on the module).
    let returned = |l: &[TraceLine]| l.iter().map(|t| t.args["ret"].clone()).collect::<Vec<_>>();
    let host_returns = lines(&run, false, "ret");
    assert_eq!(host_returns.len(), expected, "host returns\n{}", run.tail());
    let guest_returns = lines(&run, true, "gr");
    assert_eq!(
        returned(&host_returns),
        returned(&guest_returns),
        "return values differ"
    );
    // `(CALLER <- FUNCTION)`, both in the module, named as the guest names them.
    let at = |l: &[TraceLine]| l.iter().map(|t| t.location.clone()).collect::<Vec<_>>();
    assert_eq!(at(&host_returns), at(&guest_returns), "return locations differ");
    let read_return = &guest_returns[INIT_CALLS].location;
    assert!(
        read_return.starts_with("hvprobe_test_read+") && read_return.ends_with(" [hvprobe_test] <- hvprobe_test_work"),
        "{read_return}"
    );
    // The init calls come first, with 101, 102, 103, each load.
    assert_eq!(values(&host)[..INIT_CALLS], ["0x65", "0x66", "0x67"]);
    // `%pS` names the module, as the guest's own event does.
    let location = &guest[0].location;
    assert!(location.ends_with(" [hvprobe_test]"), "guest location {location}");
    assert!(
        host.iter().all(|l| &l.location == location),
        "host location, not {location}"
    );
    // The init function's probe fired once per load: armed before the init ran.
    assert_eq!(lines(&run, false, "init").len(), 2, "{}", run.tail());

    // Stacks through the module's frames, as the guest's own trigger unwinds them: the
    // callers of the probed function's frame (the guest's stack starts in its own kprobe
    // handler, called through ftrace from the function's entry).
    let callers = |stacks: Vec<Vec<String>>| {
        stacks
            .into_iter()
            .map(|s| {
                let at = s
                    .iter()
                    .position(|f| f.starts_with("hvprobe_test_work+"))
                    .unwrap_or_else(|| panic!("no hvprobe_test_work frame in {s:?}"));
                s[at + 1..].to_vec()
            })
            .collect::<Vec<_>>()
    };
    let host_stacks = callers(stacks(&run, false));
    let guest_stacks = callers(stacks(&run, true));
    assert_eq!(host_stacks.len(), expected, "host stacks\n{}", run.tail());
    assert_eq!(host_stacks, guest_stacks, "stacks differ");
    assert!(
        host_stacks[INIT_CALLS][0].starts_with("hvprobe_test_read+")
            && host_stacks[INIT_CALLS][0].ends_with(" [hvprobe_test]"),
        "a read's stack goes through the module's read: {:?}",
        host_stacks[INIT_CALLS]
    );
    assert!(
        host_stacks[0][0].starts_with("hvprobe_test_init+"),
        "{:?}",
        host_stacks[0]
    );

    // After the last unload both probes are listed [GONE] in the module.
    let listed: Vec<&str> = run.stderr.lines().filter(|l| l.contains(" hvprobe_test [")).collect();
    assert_eq!(listed.len(), 3, "listing\n{}", run.stderr);
    assert!(listed.iter().all(|l| l.contains("[GONE]")), "{listed:?}");
    common::assert_guest_healthy(&run, &[]);
}

#[test]
fn a_blacklisted_or_unknown_module_function_stays_pending_with_the_reason() {
    // Linux refuses to arm them when the module comes (and warns); so does hvprobe, and
    // the listing keeps them [PENDING] with no hits. A module that never loads: the same.
    let probes = "\
p:host/work hvprobe_test:hvprobe_test_work
p:host/noprobe hvprobe_test:hvprobe_test_noprobe
p:host/nosuch hvprobe_test:no_such_function
p:host/never no_such_module:f
";
    let workload = "busybox insmod /usr/lib/hvprobe/hvprobe_test.ko; read -r l < /proc/hvprobe_test; echo LOADED";
    let run = run_with(1, "modules-refused", probes, workload, &[]);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.stderr
            .contains("hvprobe_test:hvprobe_test_noprobe+0x0 is blacklisted: on the module's kprobe blacklist"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("module hvprobe_test has no text symbol \"no_such_function\""),
        "{}",
        run.stderr
    );
    let listed = |name: &str| {
        run.stderr
            .lines()
            .find(|l| l.contains(&format!("event=host/{name}")))
            .unwrap_or_else(|| panic!("no listing of {name}\n{}", run.stderr))
            .to_owned()
    };
    for name in ["noprobe", "nosuch", "never"] {
        let l = listed(name);
        assert!(l.contains("[PENDING]") && l.contains("hits=0"), "{l}");
    }
    // The module stayed loaded: its probe is armed, with its hits.
    let work = listed("work");
    assert!(
        !work.contains("[PENDING]")
            && work.contains(" hvprobe_test ")
            && work.contains(&format!("hits={}", INIT_CALLS + CALLS_PER_READ)),
        "{work}"
    );
    common::assert_guest_healthy(&run, &[]);
}

/// `hvprobe vars MOD:FUNC:N` on the test module's `.ko` (its DWARF, relocated): the site
/// (`FUNC+0xOFF`) and, per variable, the register it is in there.
fn module_vars(target: &str) -> (String, std::collections::BTreeMap<String, String>) {
    let run = common::hvprobe(&["vars", target], Duration::from_secs(300));
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let site = run
        .stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("@<")?.strip_suffix('>'))
        .unwrap_or_else(|| panic!("no site\n{}", run.stdout))
        .to_owned();
    let fetches = run
        .stdout
        .lines()
        .filter_map(|l| {
            let (_, fetch) = l.split_once(" var ").or_else(|| l.split_once(" param "))?;
            let (name, at) = fetch.trim().split_once('=')?;
            Some((name.to_owned(), at.to_owned()))
        })
        .collect();
    (site, fetches)
}

/// perf probe's `-m MOD` lines: `hvprobe_test:hvprobe_test_read:10` (`*pos += 1;`) with the
/// variables `len` and `*pos` by name, resolved from the module's `.ko` before the boot,
/// armed when the module loads, fetching what the guest's own kprobe event fetches with
/// the registers the DWARF names at that address (both int3s share the instruction: the
/// guest's kprobe optimization is off, or the guest would put its jump over both); and the
/// shell's reads say what those values must be (one byte a `read()`, the file position 0
/// then 1).
#[test]
fn a_module_source_line_reads_its_variables_as_the_guests_own_event_and_the_reads_say() {
    let (site, fetches) = module_vars("hvprobe_test:hvprobe_test_read:10");
    assert!(site.starts_with("hvprobe_test_read+0x"), "{site}");
    let (len, pos) = (&fetches["len"], &fetches["pos"]);
    let reg = |fetch: &str| fetch.split(':').next().unwrap().to_owned();
    let guest_event = format!("p:gl hvprobe_test:{site} len={len} fpos=+0({}):s64", reg(pos));
    let workload = format!(
        "T=/sys/kernel/tracing; echo 0 > /proc/sys/debug/kprobes-optimization; \
         echo '{guest_event}' > $T/kprobe_events; echo 1 > $T/events/kprobes/enable; \
         busybox insmod /usr/lib/hvprobe/hvprobe_test.ko; \
         i=0; while [ $i -lt 3 ]; do read -r l < /proc/hvprobe_test; i=$((i+1)); done; \
         echo 0 > $T/events/kprobes/enable; \
         while read -r l; do echo \"GUEST $l\"; done < $T/trace; busybox rmmod hvprobe_test; echo CONSOLE-END"
    );
    let run = run_with(
        1,
        "module-lines",
        "p:host/inc hvprobe_test:hvprobe_test_read:10 len fpos=+0(pos):s64\n",
        &workload,
        &[],
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let values = |l: &[TraceLine]| {
        l.iter()
            .map(|t| (t.location.clone(), t.args["len"].clone(), t.args["fpos"].clone()))
            .collect::<Vec<_>>()
    };
    let host = values(&lines(&run, false, "inc"));
    let guest = values(&lines(&run, true, "gl"));
    // Three `read -r l`, each two one-byte read()s that return data (the digit, then the
    // newline): the position is 0, then 1.
    assert_eq!(host.len(), 6, "{}", run.tail());
    assert_eq!(host, guest, "the host's and the guest's values differ");
    let positions: Vec<&str> = host.iter().map(|(_, _, p)| p.as_str()).collect();
    assert_eq!(positions, ["0", "1", "0", "1", "0", "1"]);
    assert!(
        host.iter()
            .all(|(at, len, _)| len == "1" && at.starts_with(&format!("{site}/"))),
        "{host:?}"
    );
    common::assert_guest_healthy(&run, &[]);
}

/// A `.ko` built for another kernel is refused before the boot (its `vermagic` names
/// another release: its code, and so its lines, would be elsewhere), as is a module the
/// run has no `.ko` for.
#[test]
fn a_modules_ko_for_another_kernel_or_none_is_refused_before_the_boot() {
    let guest = common::bundled_guest_dir();
    let mut ko = std::fs::read(guest.join("hvprobe_test.ko")).unwrap();
    let at = ko.windows(9).position(|w| w == b"vermagic=").expect("a vermagic") + 9;
    ko[at] = if ko[at] == b'5' { b'4' } else { b'5' };
    let other = std::env::temp_dir().join(format!("hvprobe-test-{}-other.ko", std::process::id()));
    std::fs::write(&other, &ko).unwrap();
    let probes = probe_file("module-other", "p:host/inc hvprobe_test:hvprobe_test_read:10 len\n");
    let refused = |extra: &[&str]| {
        let mut args = vec!["run", "--probes", probes.to_str().unwrap(), "--workload", "true"];
        args.extend_from_slice(extra);
        let run = common::hvprobe(&args, Duration::from_secs(300));
        assert_ne!(run.code, Some(0), "{}", run.tail());
        assert!(!run.stdout.contains("hvprobe-init"), "it booted\n{}", run.tail());
        run.stderr
    };
    let stderr = refused(&["--module-debuginfo", other.to_str().unwrap()]);
    assert!(
        stderr.contains("built for kernel 5.1.") || stderr.contains("built for kernel 4."),
        "{stderr}"
    );
    assert!(stderr.contains("(give the module of this kernel)"), "{stderr}");
    let _ = std::fs::remove_file(&other);
    std::fs::write(&probes, "p:host/x nosuch:f:3\n").unwrap();
    let stderr = refused(&[]);
    assert!(
        stderr.contains("source targets in module nosuch need its .ko with DWARF (--module-debuginfo FILE.ko)"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(probes);
}

/// A module function's BTF arguments (its parameters by name) are refused with the way to
/// read them: the module's own BTF is not read.
#[test]
fn btf_arguments_of_a_module_function_are_refused_with_the_alternatives() {
    let run = run_with(
        1,
        "module-btf",
        "p:host/work hvprobe_test:hvprobe_test_work n\n",
        "busybox insmod /usr/lib/hvprobe/hvprobe_test.ko",
        &[],
    );
    assert_ne!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.stderr.contains(
            "hvprobe_test:hvprobe_test_work: BTF arguments (parameter names, $arg*, ->fields) need the module's BTF"
        ),
        "{}",
        run.stderr
    );
}
