//! The function tracers from the host against the guest's own: `hvprobe list functions`
//! against its `available_filter_functions`, `--tracer function` against its function
//! tracer on the same calls (both on at once: the guest patches the ftrace call sites our
//! probes sit after), `--tracer function_graph` against its function_graph tracer.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{self, hvprobe, restore_with, snapshot, Run};

const RESTORE_TIMEOUT: Duration = Duration::from_secs(300);

fn run_ok(run: &Run) {
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(
        run,
        &[
            "ftrace_bug",
            "ftrace failed",
            "ftrace faulted",
            "ftrace record",
            "WARNING:",
        ],
    );
    assert!(
        run.console_has_line("CONSOLE-END"),
        "the guest's console output was cut before its end\n{}",
        run.tail()
    );
}

/// `md5sum` of `text`, as the host's coreutils prints it (the hash alone).
fn md5(text: &str) -> String {
    let mut child = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("md5sum");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

#[test]
fn the_function_list_is_the_guests_available_filter_functions() {
    let list = hvprobe(&["list", "functions"], Duration::from_secs(600));
    assert_eq!(list.code, Some(0), "{}", list.tail());
    let count = list.stdout.lines().count();
    assert!(count > 10_000, "only {count} functions listed\n{}", list.tail());
    let dir = snapshot(1);
    let run = restore_with(
        &dir,
        1,
        "T=/sys/kernel/tracing/available_filter_functions; echo \"GUEST-COUNT $(wc -l < $T)\"; \
         echo \"GUEST-MD5 $(md5sum < $T)\"; echo CONSOLE-END",
        &[],
        RESTORE_TIMEOUT,
    );
    run_ok(&run);
    let field = |key: &str| {
        run.stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .unwrap_or_else(|| panic!("no {key} line\n{}", run.tail()))
            .to_owned()
    };
    assert_eq!(
        field("GUEST-COUNT "),
        count.to_string(),
        "the guest lists another number of functions"
    );
    assert_eq!(
        field("GUEST-MD5 "),
        md5(&list.stdout),
        "the guest lists other functions or another order"
    );
    // A glob narrows the list; one that matches nothing fails, naming it.
    let vfs = hvprobe(&["list", "functions", "vfs_*"], Duration::from_secs(120));
    assert!(vfs.stdout.lines().any(|l| l == "vfs_read"), "{}", vfs.tail());
    assert!(vfs.stdout.lines().all(|l| l.starts_with("vfs_")), "{}", vfs.tail());
    let none = hvprobe(&["list", "functions", "no_such_function_*"], Duration::from_secs(120));
    assert_eq!(none.code, Some(1), "{}", none.tail());
    assert!(none.stderr.contains("no traceable function matches"), "{}", none.tail());
}

/// One function tracer line: task, timestamp (ns), function, parent.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Call {
    task: String,
    ns: i64,
    function: String,
    parent: String,
}

impl Call {
    /// `TASK-PID [CPU] SECS.USECS: func <-parent` (with or without irq-info's column).
    fn parse(line: &str) -> Option<Call> {
        let (context, call) = line.rsplit_once(": ")?;
        let (function, parent) = call.split_once(" <-")?;
        let task = context.split_whitespace().next()?.to_owned();
        let stamp = context.split_whitespace().last()?;
        let (secs, usecs) = stamp.split_once('.')?;
        Some(Call {
            task,
            ns: secs.parse::<i64>().ok()? * 1_000_000_000 + usecs.parse::<i64>().ok()? * 1000,
            function: function.trim().to_owned(),
            parent: parent.trim().to_owned(),
        })
    }
}

/// The workload: the guest's own tracer `tracer` (set up by `setup`) while the shell reads
/// a line of a file a byte at a time, then its trace lines, prefixed `GUEST ` (read before the
/// tracer is switched off: that empties the buffer), then its kernel log's complaints.
fn with_the_guests_own_tracer(tracer: &str, setup: &str) -> String {
    format!(
        "T=/sys/kernel/tracing; {setup} echo {tracer} > $T/current_tracer; \
         read -r l < /proc/version; echo 0 > $T/tracing_on; \
         sed 's/^/GUEST /' $T/trace; echo nop > $T/current_tracer; \
         echo 1 > $T/tracing_on; dmesg | grep -i -e ftrace -e warning; echo CONSOLE-END"
    )
}

/// `FUNCTIONS` as `set_ftrace_filter` takes them fastest: their indices in
/// `available_filter_functions` (1-based), from `hvprobe list functions` — a glob makes
/// the guest look every record's name up, about a minute of emulated kallsyms on kvm_pvm.
/// The guest then traces the functions named only if the two lists are in the same order.
fn filter_indices() -> String {
    let list = hvprobe(&["list", "functions"], Duration::from_secs(600));
    assert_eq!(list.code, Some(0), "{}", list.tail());
    FUNCTIONS
        .iter()
        .map(|f| {
            let at = list
                .stdout
                .lines()
                .position(|l| l == *f)
                .unwrap_or_else(|| panic!("{f} is not listed"));
            (at + 1).to_string()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a shell's read of a proc file calls, each a traceable function of the bundled
/// kernel: the syscall, the VFS, the proc file and its seq_file.
const FUNCTIONS: [&str; 4] = ["ksys_read", "vfs_read", "proc_reg_read_iter", "seq_read_iter"];

#[test]
fn the_function_tracer_sees_the_calls_the_guests_own_function_tracer_sees() {
    let dir = snapshot(1);
    let workload = with_the_guests_own_tracer(
        "function",
        &format!("echo '{}' > $T/set_ftrace_filter;", filter_indices()),
    );
    let mut args = vec!["--tracer", "function", "--no-control"];
    for f in FUNCTIONS {
        args.extend(["--ftrace-filter", f]);
    }
    let run = restore_with(&dir, 1, &workload, &args, RESTORE_TIMEOUT);
    run_ok(&run);
    assert!(
        run.stderr.contains("function tracer: 4 of the kernel's") && run.stderr.contains(", 4 traced"),
        "{}",
        run.tail()
    );
    assert!(run.stdout.contains("# tracer: function"), "{}", run.tail());
    let guest: Vec<Call> = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("GUEST "))
        .filter_map(Call::parse)
        .collect();
    let task = guest
        .first()
        .map(|c| c.task.clone())
        .unwrap_or_else(|| panic!("no guest trace lines\n{}", run.tail()));
    let guest: Vec<Call> = guest.into_iter().filter(|c| c.task == task).collect();
    let host: Vec<Call> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(Call::parse)
        .filter(|c| c.task == task)
        .collect();
    // A ~100-byte line read a byte at a time: a hundred calls of each function.
    assert!(
        guest.len() >= 300,
        "{} guest lines of {task}\n{}",
        guest.len(),
        run.tail()
    );
    let shape = |calls: &[Call]| -> Vec<(String, String)> {
        calls.iter().map(|c| (c.function.clone(), c.parent.clone())).collect()
    };
    // The host's calls of that task from the guest's first: the same calls, in order.
    let start = host
        .iter()
        .position(|c| c.ns >= guest[0].ns - 1_000_000)
        .unwrap_or_else(|| panic!("no host line of {task} near the guest's first\n{}", run.tail()));
    let window = host.get(start..start + guest.len()).unwrap_or_else(|| {
        panic!(
            "the host has {} lines of {task} from the guest's first, the guest {}\n{}",
            host.len() - start,
            guest.len(),
            run.tail()
        )
    });
    assert_eq!(shape(window), shape(&guest), "host and guest saw other calls");
    // The same clock: the host stamps an int3 hit when it handles its exit, a few emulated
    // instructions after the guest's own stamp (more when the host is loaded).
    for (h, g) in window.iter().zip(&guest) {
        assert!(
            (h.ns - g.ns).abs() < 20_000_000,
            "host {h:?} and guest {g:?} are more than 20 ms apart"
        );
    }
}

/// The FUNCTION CALLS column of a function_graph line (`  vfs_read() {`), when it has one.
fn graph_calls(line: &str) -> Option<&str> {
    let (_, calls) = line.split_once("|  ")?;
    let calls = calls
        .rsplit_once('|')
        .map_or(calls, |(_, c)| c.strip_prefix("  ").unwrap_or(c));
    (calls.contains("()") || calls.trim() == "}").then_some(calls.trim_end())
}

#[test]
fn the_function_graph_tracer_nests_calls_as_the_guests_own_does() {
    let dir = snapshot(1);
    let setup = format!(
        "echo '{}' > $T/set_ftrace_filter; echo ksys_read > $T/set_graph_function; echo 0 > $T/options/funcgraph-irqs;",
        filter_indices()
    );
    let workload = with_the_guests_own_tracer("function_graph", &setup);
    let mut args = vec![
        "--tracer",
        "function_graph",
        "--graph-function",
        "ksys_read",
        "--no-control",
    ];
    for f in FUNCTIONS {
        args.extend(["--ftrace-filter", f]);
    }
    let run = restore_with(&dir, 1, &workload, &args, RESTORE_TIMEOUT);
    run_ok(&run);
    assert!(run.stdout.contains("# tracer: function_graph"), "{}", run.tail());
    let guest: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("GUEST "))
        .filter_map(graph_calls)
        .collect();
    let host: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter_map(graph_calls)
        .collect();
    assert!(guest.len() >= 300, "{} guest graph lines\n{}", guest.len(), run.tail());
    assert!(
        guest.iter().any(|l| l.starts_with("    ")),
        "the guest's own graph nests no call two deep: {:?}",
        &guest[..guest.len().min(12)]
    );
    // The host's graph holds the guest's as one run of lines (it goes on past the guest's
    // window: the shell's reads of the trace).
    let start = host
        .windows(guest.len())
        .position(|w| w == guest.as_slice())
        .map(Some)
        .unwrap_or(None);
    assert!(
        start.is_some(),
        "the host's graph ({} lines) does not hold the guest's ({} lines); host starts {:?}",
        host.len(),
        guest.len(),
        &host[..host.len().min(12)]
    );
}

fn text_hash(run: &Run) -> String {
    run.stderr
        .lines()
        .find_map(|l| l.strip_prefix("hvprobe: kernel text sha256 "))
        .unwrap_or_else(|| panic!("no text hash\n{}", run.tail()))
        .to_owned()
}

/// The count funccount's table gives `function`.
fn funccount_of(run: &Run, function: &str) -> u64 {
    run.stdout
        .lines()
        .find_map(|l| {
            let mut fields = l.split_whitespace();
            (fields.next() == Some(function))
                .then(|| fields.next()?.parse().ok())
                .flatten()
        })
        .unwrap_or_else(|| panic!("no count of {function}\n{}", run.tail()))
}

#[test]
fn every_function_at_once_leaves_the_guest_healthy_and_its_text_as_it_was() {
    let dir = snapshot(1);
    // File reads and writes, every function traced, while the guest's own ftrace-based
    // kprobe event on a traced function comes and goes (the guest patches the ftrace call
    // site our probe sits after, twice): it must count each read, and complain of nothing.
    let workload = "T=/sys/kernel/tracing; echo 'p:gk ksys_read' > $T/kprobe_events; \
                    echo 1 > $T/events/kprobes/gk/enable; \
                    for i in 1 2 3; do echo $i > /tmp/f; read -r l < /tmp/f; done; \
                    echo 0 > $T/events/kprobes/gk/enable; sed 's/^/PROFILE /' $T/kprobe_profile; \
                    echo > $T/kprobe_events; dmesg | grep -i -e ftrace_bug -e 'ftrace failed' -e warning; \
                    echo CONSOLE-END";
    // function_graph prints every call: the loop alone, no process started.
    let loop_only = "for i in 1 2 3; do echo $i > /tmp/f; read -r l < /tmp/f; done; echo CONSOLE-END";
    let plain = restore_with(&dir, 1, "true", &["--text-hash", "--no-control"], RESTORE_TIMEOUT);
    assert_eq!(plain.code, Some(0), "{}", plain.tail());
    for (tracer, optimize) in [
        ("funccount", "--optimize=off"),
        ("funccount", "--optimize=on"),
        ("function_graph", "--optimize=on"),
    ] {
        let run = restore_with(
            &dir,
            1,
            if tracer == "funccount" { workload } else { loop_only },
            &["--tracer", tracer, "--text-hash", "--no-control", optimize],
            Duration::from_secs(900),
        );
        run_ok(&run);
        let line = run
            .stderr
            .lines()
            .find(|l| l.contains(&format!("{tracer} tracer: ")))
            .unwrap_or_else(|| panic!("no tracer line\n{}", run.tail()));
        let traced: usize = line
            .split(", ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(
            traced > 10_000,
            "{tracer} {optimize}: only {traced} functions traced: {line}"
        );
        // Each `read` builtin reads "N\n" a byte at a time: two calls, three times.
        if tracer == "funccount" {
            let profile = run
                .stdout
                .lines()
                .find_map(|l| l.trim().strip_prefix("PROFILE "))
                .unwrap_or_else(|| panic!("no kprobe_profile line\n{}", run.tail()));
            assert_eq!(
                profile.split_whitespace().nth(1),
                Some("6"),
                "{tracer} {optimize}: the guest's own kprobe counted otherwise: {profile}"
            );
        }
        match tracer {
            "funccount" => {
                assert!(funccount_of(&run, "ksys_read") >= 6, "{}", run.tail());
                assert!(funccount_of(&run, "ksys_write") >= 3, "{}", run.tail());
            }
            _ => assert!(
                run.stdout.lines().any(|l| l.trim_end().ends_with(" ksys_read() {")),
                "{tracer}: no ksys_read call in the graph\n{}",
                run.tail()
            ),
        }
        if optimize == "--optimize=on" {
            assert!(
                run.stderr.contains("ftrace/") && !run.stderr.contains("optimized 0 "),
                "{tracer} {optimize}: no function's probe was optimized\n{}",
                run.tail()
            );
        }
        assert_eq!(
            text_hash(&run),
            text_hash(&plain),
            "{tracer} {optimize}: the text differs after the trace"
        );
    }
}

#[test]
fn the_function_tracer_finds_its_functions_in_a_randomized_kernel() {
    let dir = common::kaslr_snapshot(1);
    let run = restore_with(
        &dir,
        1,
        "read -r l < /proc/version; echo CONSOLE-END",
        &[
            "--tracer",
            "function",
            "--ftrace-filter",
            "vfs_read",
            "--ftrace-filter",
            "ksys_read",
            "--no-control",
        ],
        RESTORE_TIMEOUT,
    );
    run_ok(&run);
    common::assert_randomized(&run);
    let calls: Vec<Call> = run
        .stdout
        .lines()
        .filter_map(Call::parse)
        .filter(|c| c.task.starts_with("sh-"))
        .collect();
    // The line of /proc/version a byte at a time: each read is ksys_read, then vfs_read.
    assert!(calls.len() >= 100, "{} calls\n{}", calls.len(), run.tail());
    for pair in calls.chunks_exact(2).take(40) {
        assert_eq!(
            (
                pair[0].function.as_str(),
                pair[1].function.as_str(),
                pair[1].parent.as_str()
            ),
            ("ksys_read", "vfs_read", "ksys_read"),
            "{pair:?}"
        );
    }
}

#[test]
fn error_chains_show_a_real_programs_failing_syscall_and_nothing_else() {
    common::require_kvm();
    // The host's own `cat`, from --rootfs /, opens a file that is not there: openat fails
    // with -ENOENT deep in the path walk.
    let mut args = vec![
        "run",
        "--cpus",
        "1",
        "--no-control",
        "--rootfs",
        "/",
        "--tracer",
        "function_graph",
        "--graph-function",
        "do_sys_openat2",
        "--graph-errors",
        "--workload",
        "cat /no-such-file-here; echo CONSOLE-END",
    ];
    for f in [
        "do_sys_openat2",
        "do_filp_open",
        "path_openat",
        "*lookup*",
        "walk_component",
        "link_path_walk*",
    ] {
        args.extend(["--ftrace-filter", f]);
    }
    let run = hvprobe(&args, Duration::from_secs(600));
    run_ok(&run);
    let closes: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.split("} /* do_sys_openat2 = ").nth(1))
        .collect();
    assert!(!closes.is_empty(), "no failing openat shown\n{}", run.tail());
    assert!(
        closes.iter().all(|v| v.starts_with('-')),
        "a call that did not fail was shown: {closes:?}"
    );
    assert!(closes.contains(&"-2 */"), "no -ENOENT: {closes:?}");
    assert!(
        run.stdout.lines().any(|l| l.contains(", the first error */")),
        "the first failure is not marked\n{}",
        run.tail()
    );
    assert!(run.stdout.contains("No such file or directory"), "{}", run.tail());
}
