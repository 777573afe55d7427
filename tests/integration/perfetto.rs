//! `--perfetto FILE`, read back by an independent reader: `tests/perfetto_reader.py`,
//! which decodes the trace with the classes Perfetto generates from its own
//! `perfetto_trace.proto` (the `perfetto` PyPI package) and pairs slices and resolves
//! interned data as Perfetto's trace processor does. A missing reader fails the test with
//! what to install.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{restore_with, snapshot, Run};
use hvprobe::perfetto::PerfettoWriter;
use hvprobe_arch::Gva;
use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::{HitRecord, StackFrame};
use serde_json::Value;

const RESTORE_TIMEOUT: Duration = Duration::from_secs(300);

const READER_INSTALL: &str = "the independent Perfetto reader (tests/perfetto_reader.py) needs Python 3 with \
     Perfetto's own trace protos: run tests/install-perfetto-reader.sh (.ci/run does), or set HVPROBE_PYTHON to a \
     Python that has `perfetto==0.59.1` and `protobuf`";

/// What the reader makes of the trace at `path`; fails on anything it found wrong.
fn read_trace(path: &Path) -> Value {
    // The virtualenv tests/install-perfetto-reader.sh makes, unless told otherwise.
    let venv = common::cache_dir().join("perfetto-reader/bin/python");
    let python = match std::env::var("HVPROBE_PYTHON") {
        Ok(python) => python,
        Err(_) if venv.exists() => venv.display().to_string(),
        Err(_) => "python3".into(),
    };
    let reader = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/perfetto_reader.py");
    let out = Command::new(&python)
        .arg(&reader)
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}; {READER_INSTALL}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        panic!("{}; {READER_INSTALL}", stderr.trim());
    }
    assert!(out.status.success(), "the Perfetto reader failed: {stderr}");
    let trace: Value = serde_json::from_slice(&out.stdout).expect("the reader prints JSON");
    assert_eq!(trace["errors"], Value::Array(Vec::new()), "the reader found problems");
    trace
}

fn temp_trace(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("hvprobe-{name}-{}.pftrace", std::process::id()))
}

fn track<'a>(trace: &'a Value, uuid: &Value) -> &'a Value {
    trace["tracks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| &t["uuid"] == uuid)
        .unwrap_or_else(|| panic!("no track {uuid}"))
}

/// A fetch-arg's value as ftrace prints it, from the reader's typed value. A string is
/// quoted, except `(fault)` (how the trace marks a fault): the tests use no `symbol` args,
/// whose text ftrace prints without quotes, and which the trace also holds as a string.
fn ftrace_value(value: &Value) -> String {
    let (kind, v) = value.as_object().unwrap().iter().next().unwrap();
    match kind.as_str() {
        "uint" | "int" => v.to_string(),
        "pointer" => format!("{:#x}", v.as_u64().unwrap()),
        "string" if v == "(fault)" => "(fault)".into(),
        "string" => format!("\"{}\"", v.as_str().unwrap()),
        "array" => format!(
            "{{{}}}",
            v.as_array()
                .unwrap()
                .iter()
                .map(ftrace_value)
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => panic!("unexpected value kind {other}"),
    }
}

/// The ftrace line of a hit the reader decoded (see `probes/src/output.rs`: `ftrace_line`),
/// written here from the trace's fields alone.
fn ftrace_line(event: &Value) -> String {
    let args = &event["args"];
    let ts = if event["kind"] == "slice" {
        event["end_ts"].as_u64().unwrap()
    } else {
        event["ts"].as_u64().unwrap()
    };
    let micros = (ts + 500) / 1000;
    let name = event["name"].as_str().unwrap();
    let (_, event_name) = name.split_once('/').unwrap();
    let location = args["location"]["string"].as_str().unwrap();
    let mut line = format!(
        "{:>16}-{:<7} [{:03}]  {:>5}.{:06}: {}: (",
        args["comm"]["string"].as_str().unwrap(),
        args["pid"]["int"].as_i64().unwrap(),
        args["cpu"]["uint"].as_u64().unwrap(),
        micros / 1_000_000,
        micros % 1_000_000,
        event_name
    );
    match args.get("caller") {
        Some(caller) => {
            line += &format!(
                "{} <- {})",
                caller["string"].as_str().unwrap(),
                location.split('+').next().unwrap()
            )
        }
        None => line += &format!("{location})"),
    }
    if let Some(fetched) = args.get("args") {
        for pair in fetched["dict"].as_array().unwrap() {
            line += &format!(" {}={}", pair[0].as_str().unwrap(), ftrace_value(&pair[1]));
        }
    }
    line
}

fn hit(cpu: usize, pid: i32, event: &str, timestamp_ns: u64) -> HitRecord {
    HitRecord {
        comm: "sh".into(),
        pid,
        cpu,
        timestamp_ns,
        group: "grp".into(),
        event: event.into(),
        location: "vfs_read+0x0/0x140".into(),
        retprobe_caller: None,
        args: Vec::new(),
        entry_timestamp_ns: None,
        stack: None,
    }
}

fn frame(address: u64, symbol: Option<&str>) -> StackFrame {
    StackFrame {
        address: Gva(address),
        symbol: symbol.map(Into::into),
    }
}

#[test]
fn the_independent_reader_decodes_instants_nested_slices_args_and_callstacks() {
    let mut open = hit(1, 42, "open", 5_000);
    open.args = vec![
        ("count".into(), ArgValue::Unsigned(3)),
        ("delta".into(), ArgValue::Signed(-2)),
        ("flags".into(), ArgValue::Hex(0x8000)),
        ("path".into(), ArgValue::String(b"/etc/passwd".to_vec())),
        ("bad".into(), ArgValue::Fault),
        (
            "arr".into(),
            ArgValue::Array(vec![ArgValue::Unsigned(1), ArgValue::Unsigned(2)]),
        ),
    ];
    open.stack = Some(vec![
        frame(0xffff_ffff_8115_707b, Some("vfs_read+0x0/0x140")),
        frame(0xffff_ffff_8115_7512, Some("ksys_read+0x6b/0x9c")),
        frame(0xffff_c900_0000_1234, None),
    ]);
    // A task's calls: the inner one returns first, so its record comes first; the task
    // migrated from vCPU 0 to vCPU 1 between the two returns.
    let returned = |cpu, entered, at, caller: &str| HitRecord {
        retprobe_caller: Some(caller.into()),
        entry_timestamp_ns: Some(entered),
        args: vec![("ret".into(), ArgValue::Signed(-11))],
        ..hit(cpu, 42, "ret", at)
    };
    let inner = returned(0, 2_000, 3_000, "vfs_read+0x50/0x140");
    let mut outer = returned(1, 1_000, 9_000, "ksys_read+0x6b/0x9c");
    outer.stack = Some(vec![frame(0xffff_ffff_8115_7512, Some("ksys_read+0x6b/0x9c"))]);
    let mut idle = returned(0, 4_000, 4_500, "do_idle+0x1/0x2");
    idle.pid = 0;
    idle.comm = "swapper/0".into();

    let path = temp_trace("synthetic");
    let file = std::fs::File::create(&path).unwrap();
    let mut writer = PerfettoWriter::new(std::io::BufWriter::new(file)).unwrap();
    for h in [&open, &inner, &outer, &idle] {
        writer.write_hit(h).unwrap();
    }
    writer.into_inner().unwrap();
    let trace = read_trace(&path);
    std::fs::remove_file(&path).unwrap();

    let events = trace["events"].as_array().unwrap();
    let kinds: Vec<(&str, u64, Option<u64>)> = events
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap(),
                e["ts"].as_u64().unwrap(),
                e["end_ts"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        // In the order they end, as the reader pairs them.
        [
            ("slice", 2_000, Some(3_000)),
            ("slice", 4_000, Some(4_500)),
            ("instant", 5_000, None),
            ("slice", 1_000, Some(9_000)),
        ]
    );
    let instant = &events[2];
    assert_eq!(instant["name"], "grp/open");
    assert_eq!(instant["categories"], serde_json::json!(["grp"]));
    assert_eq!(track(&trace, &instant["track"])["name"], "vCPU 1");
    assert_eq!(
        ftrace_line(instant),
        "              sh-42      [001]      0.000005: open: (vfs_read+0x0/0x140) count=3 delta=-2 \
         flags=0x8000 path=\"/etc/passwd\" bad=(fault) arr={1,2}"
    );
    let functions = |e: &Value| -> Vec<String> {
        e["callstack"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                assert_eq!(f["kernel"], true);
                format!(
                    "{}@{:#x}",
                    f["function"].as_str().unwrap(),
                    f["rel_pc"].as_u64().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(
        functions(instant),
        [
            "0xffffc90000001234@0xffffc90000001234",
            "ksys_read@0xffffffff81157512",
            "vfs_read@0xffffffff8115707b"
        ]
    );
    let (inner_slice, idle_slice, outer_slice) = (&events[0], &events[1], &events[3]);
    assert_eq!(outer_slice["track"], inner_slice["track"], "one task, one track");
    let task = track(&trace, &outer_slice["track"]);
    assert_eq!(task["thread"], serde_json::json!({"pid": 42, "tid": 42, "name": "sh"}));
    assert_eq!(functions(outer_slice), ["ksys_read@0xffffffff81157512"]);
    assert_eq!(
        ftrace_line(outer_slice),
        "              sh-42      [001]      0.000009: ret: (ksys_read+0x6b/0x9c <- vfs_read) ret=-11"
    );
    assert_eq!(track(&trace, &idle_slice["track"])["name"], "swapper/0 (pid 0)");
}

/// Probes with every kind of fetch-arg value but `symbol` (see [`ftrace_value`]), an entry
/// and a return on the same function.
const PROBES: &str = "\
p:pf/pfgetppid __x64_sys_getppid regs=%di comm=$comm
p:pf/pfread vfs_read count=%dx:u64 half=%dx:s16 nothing=@0x10:u64
r:pf/pfread_ret vfs_read ret=$retval:s64
";

#[test]
fn a_perfetto_trace_of_a_restored_guest_holds_what_the_text_output_printed() {
    let dir = snapshot(1);
    let probes = std::env::temp_dir().join(format!("hvprobe-perfetto-{}.probes", std::process::id()));
    std::fs::write(&probes, PROBES).unwrap();
    let path = temp_trace("guest");
    let run: Run = restore_with(
        &dir,
        1,
        "hvprobe-loop 3; read -r v < /proc/version; echo \"read ${#v}\"",
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--format",
            "text",
            "--perfetto",
            path.to_str().unwrap(),
        ],
        RESTORE_TIMEOUT,
    );
    std::fs::remove_file(&probes).unwrap();
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.stderr
            .contains(&format!("hvprobe: Perfetto trace {}: ", path.display())),
        "{}",
        run.tail()
    );
    let trace = read_trace(&path);
    std::fs::remove_file(&path).unwrap();

    let ours = [" pfgetppid: (", " pfread: (", " pfread_ret: ("];
    let mut text: Vec<String> = run
        .stdout
        .lines()
        .map(|l| l.trim_end_matches('\r').to_string())
        .filter(|l| ours.iter().any(|e| l.contains(e)))
        .collect();
    for event in ours {
        assert!(
            text.iter().any(|l| l.contains(event)),
            "no{event} line printed\n{}",
            run.tail()
        );
    }
    let events = trace["events"].as_array().unwrap();
    let mut rendered: Vec<String> = events.iter().map(ftrace_line).collect();
    // Same hits, same fields: the trace is sorted by time, the text by when hits arrived.
    assert_eq!(events.len(), text.len(), "one trace event per printed hit");
    text.sort();
    rendered.sort();
    assert_eq!(rendered, text);

    for event in events {
        assert_eq!(event["categories"], serde_json::json!(["pf"]));
        let args = &event["args"];
        let on = track(&trace, &event["track"]);
        if event["name"] == "pf/pfread_ret" {
            // The engine knew every call's entry: each return is a slice on its task's track.
            assert_eq!(event["kind"], "slice", "{event}");
            assert!(event["ts"].as_u64() <= event["end_ts"].as_u64(), "{event}");
            match args["pid"]["int"].as_i64().unwrap() {
                0 => assert_eq!(
                    on["name"],
                    format!("{} (pid 0)", args["comm"]["string"].as_str().unwrap())
                ),
                pid => assert_eq!(on["thread"]["tid"], pid, "{on}"),
            }
        } else {
            assert_eq!(event["kind"], "instant", "{event}");
            assert_eq!(on["name"], format!("vCPU {}", args["cpu"]["uint"]), "{on}");
            assert_eq!(track(&trace, &on["parent"])["name"], "hvprobe guest");
        }
    }
    // The fetch from address 0x10 faults, and the trace says so.
    let read = events.iter().find(|e| e["name"] == "pf/pfread").unwrap();
    assert_eq!(
        read["args"]["args"]["dict"][2],
        serde_json::json!(["nothing", {"string": "(fault)"}])
    );
}

#[test]
fn an_unwritable_trace_file_is_refused_before_the_guest_runs() {
    let dir = snapshot(1);
    let probes = std::env::temp_dir().join(format!("hvprobe-perfetto-refused-{}.probes", std::process::id()));
    std::fs::write(&probes, PROBES).unwrap();
    let run = restore_with(
        &dir,
        1,
        "echo the guest ran",
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--perfetto",
            "/nonexistent-dir/t.pftrace",
        ],
        RESTORE_TIMEOUT,
    );
    std::fs::remove_file(&probes).unwrap();
    assert_ne!(run.code, Some(0), "{}", run.tail());
    assert!(
        run.stderr
            .contains("cannot create the Perfetto trace /nonexistent-dir/t.pftrace: No such file or directory"),
        "{}",
        run.tail()
    );
    assert!(!run.console_has_line("the guest ran"), "{}", run.tail());
}

#[test]
fn sigterm_mid_run_leaves_a_complete_trace_of_every_hit_printed() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::Stdio;
    use std::sync::mpsc;
    use std::time::Instant;

    let dir = snapshot(1);
    let probes = std::env::temp_dir().join(format!("hvprobe-perfetto-stop-{}.probes", std::process::id()));
    std::fs::write(&probes, PROBES).unwrap();
    let path = temp_trace("stopped");
    let mut child = Command::new(common::hvprobe_bin())
        .args(["run", "--snapshot", dir.to_str().unwrap(), "--cpus", "1", "--probes"])
        .arg(&probes)
        .args(["--format", "text", "--perfetto"])
        .arg(&path)
        .args(["--workload", "while true; do read -r l < /proc/version; done"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvprobe");
    let (line_tx, line_rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains(" pfread_ret: (") {
                let _ = line_tx.send(());
            }
            lines.push(line);
        }
        lines
    });
    let mut stderr = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    // Busy: returns are being printed.
    for _ in 0..20 {
        line_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the trace printed returns");
    }
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "hvprobe did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let lines = reader.join().unwrap();
    let stderr = err_reader.join().unwrap();
    std::fs::remove_file(&probes).unwrap();
    assert_eq!(status.code(), Some(143), "--- stderr ---\n{stderr}");
    let trace = read_trace(&path);
    std::fs::remove_file(&path).unwrap();
    let ours = [" pfgetppid: (", " pfread: (", " pfread_ret: ("];
    let mut text: Vec<String> = lines
        .into_iter()
        .filter(|l| ours.iter().any(|e| l.contains(e)))
        .collect();
    let mut rendered: Vec<String> = trace["events"].as_array().unwrap().iter().map(ftrace_line).collect();
    assert!(text.len() >= 40, "{stderr}");
    text.sort();
    rendered.sort();
    assert_eq!(rendered, text, "every hit printed is in the trace, and nothing else");
}

#[test]
fn hvprobe_trace_writes_the_same_trace_from_a_running_guest() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::Stdio;
    use std::sync::mpsc;

    let dir = snapshot(1);
    let probes = std::env::temp_dir().join(format!("hvprobe-perfetto-live-{}.probes", std::process::id()));
    std::fs::write(&probes, PROBES).unwrap();
    let socket = std::env::temp_dir().join(format!("hvprobe-perfetto-live-{}.sock", std::process::id()));
    let path = temp_trace("client");
    // The run waits for a console line before its workload, so that the client is
    // subscribed when the hits come.
    let mut run = Command::new(common::hvprobe_bin())
        .args([
            "run",
            "--snapshot",
            dir.to_str().unwrap(),
            "--cpus",
            "1",
            "--console-input",
        ])
        .arg("--control")
        .arg(&socket)
        .arg("--probes")
        .arg(&probes)
        .args([
            "--workload",
            "echo WAIT; read -r go < /dev/ttyS0; hvprobe-loop 3; read -r v < /proc/version; echo DONE",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvprobe run");
    let (line_tx, line_rx) = mpsc::channel();
    let stdout = run.stdout.take().unwrap();
    let run_stdout = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = line_tx.send(line.clone());
            lines.push(line.trim_end_matches('\r').to_string());
        }
        lines
    });
    let mut stderr = run.stderr.take().unwrap();
    let run_stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    while !line_rx
        .recv_timeout(RESTORE_TIMEOUT)
        .expect("the workload says WAIT")
        .starts_with("WAIT")
    {}
    let client = Command::new(common::hvprobe_bin())
        .args(["trace", "--format", "text", "--perfetto"])
        .arg(&path)
        .arg("--control")
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvprobe trace");
    let client = std::thread::spawn(move || client.wait_with_output().unwrap());
    // Time for the client to subscribe (it says nothing when it has).
    std::thread::sleep(Duration::from_secs(2));
    let mut stdin = run.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    let status = run.wait().unwrap();
    drop(stdin);
    let run_lines = run_stdout.join().unwrap();
    let run_stderr = run_stderr.join().unwrap();
    let client = client.join().unwrap();
    let client_stderr = String::from_utf8_lossy(&client.stderr);
    std::fs::remove_file(&probes).unwrap();
    assert_eq!(status.code(), Some(0), "{run_stderr}");
    assert!(client.status.success(), "{client_stderr}");
    assert!(
        client_stderr.contains(&format!("hvprobe: Perfetto trace {}: ", path.display())),
        "{client_stderr}"
    );
    let trace = read_trace(&path);
    std::fs::remove_file(&path).unwrap();

    let mut text: Vec<String> = String::from_utf8_lossy(&client.stdout)
        .lines()
        .map(String::from)
        .collect();
    assert!(
        text.iter().filter(|l| l.contains(" pfgetppid: (")).count() >= 3,
        "{text:?}"
    );
    for line in &text {
        assert!(run_lines.contains(line), "the client's line is the run's: {line}");
    }
    let mut rendered: Vec<String> = trace["events"].as_array().unwrap().iter().map(ftrace_line).collect();
    text.sort();
    rendered.sort();
    assert_eq!(rendered, text);
    let slices = trace["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "slice")
        .count();
    assert!(slices > 0, "the returns are slices: the records carry their entry");
}
