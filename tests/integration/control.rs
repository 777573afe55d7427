//! Steering a running guest through its control socket: probes added, listed, disabled,
//! enabled and removed while a workload runs (checked per window against the guest's own
//! kprobe event), two event streams at once with one that does not read, and the
//! refusals of a bad `add`.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{restore_with, snapshot, Run};

const TIMEOUT: Duration = Duration::from_secs(300);
/// getppid() calls per window (`hvprobe-loop` is the bundled guest's loop of them).
const CALLS: usize = 50;

/// A running `hvprobe run --snapshot` with its control socket, its console lines as they
/// come, and its stdin on the guest's console.
struct LiveRun {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stdout: std::thread::JoinHandle<Vec<String>>,
    stderr: std::thread::JoinHandle<String>,
    socket: PathBuf,
    /// While set, nobody reads hvprobe's stdout: its pipe fills, and the vCPU writing the
    /// guest's console blocks.
    stalled: Arc<AtomicBool>,
}

impl LiveRun {
    fn start(dir: &Path, cpus: u8, name: &str, workload: &str, extra: &[&str]) -> LiveRun {
        let socket = std::env::temp_dir().join(format!("hvprobe-control-{}-{name}.sock", std::process::id()));
        let mut args = vec![
            "run".to_string(),
            "--snapshot".into(),
            dir.to_str().unwrap().into(),
            "--cpus".into(),
            cpus.to_string(),
            "--control".into(),
            socket.to_str().unwrap().into(),
            "--console-input".into(),
            "--workload".into(),
            workload.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(common::hvprobe_bin())
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn hvprobe run");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let stalled = Arc::new(AtomicBool::new(false));
        let stall = Arc::clone(&stalled);
        let stdout = std::thread::spawn(move || {
            let mut all = Vec::new();
            let mut out = BufReader::new(out);
            loop {
                while stall.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let mut line = String::new();
                match out.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let line = line.trim_end_matches('\n').to_string();
                        let _ = tx.send(line.clone());
                        all.push(line);
                    }
                }
            }
            all
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        LiveRun {
            stdin: child.stdin.take(),
            child,
            lines,
            stdout,
            stderr,
            socket,
            stalled,
        }
    }

    /// Stops reading hvprobe's stdout (`true`) or reads it again.
    fn stall_stdout(&self, stall: bool) {
        self.stalled.store(stall, Ordering::SeqCst);
    }

    /// Waits for a console line starting with `prefix`; returns it. When none comes, the
    /// VM is stopped and the failure shows its console and its log.
    fn wait_for(&mut self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(TIMEOUT) {
                Ok(line) if line.trim_end_matches('\r').starts_with(prefix) => {
                    return line.trim_end_matches('\r').to_string()
                }
                Ok(_) => {}
                Err(e) => {
                    // Read on, so that hvprobe's last lines (where its vCPUs were) get out.
                    self.stall_stdout(false);
                    common::stop_at_deadline(&mut self.child);
                    panic!("no console line {prefix:?}: {e}\n{}", self.output(None).tail());
                }
            }
        }
    }

    /// Tells the waiting workload to go on (a line on its console).
    fn go(&mut self) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }

    /// `hvprobe probe ARGS --control SOCKET`.
    fn probe(&self, args: &[&str]) -> Run {
        let mut all = vec!["probe"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--control", self.socket.to_str().unwrap()]);
        common::hvprobe(&all, TIMEOUT)
    }

    fn finish(mut self) -> Run {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        self.output(status.code())
    }

    /// What the ended run printed, with its exit `code`.
    fn output(&mut self, code: Option<i32>) -> Run {
        let stdout = std::mem::replace(&mut self.stdout, std::thread::spawn(Vec::new));
        let stderr = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        Run {
            code,
            stdout: stdout.join().unwrap().join("\n"),
            stderr: stderr.join().unwrap(),
        }
    }
}

/// A test that fails half-way must not leave its VM waiting for input forever.
impl Drop for LiveRun {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `(event, hits)` of every listing line.
fn listed(run: &Run) -> Vec<(String, u64, bool)> {
    assert_eq!(run.code, Some(0), "probe list failed\n{}", run.tail());
    run.stdout
        .lines()
        .filter(|l| l.contains(" hits="))
        .map(|l| {
            let field = |k: &str| {
                l.split(k)
                    .nth(1)
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .to_string()
            };
            (
                field("event="),
                field("hits=").parse().unwrap(),
                l.contains("[DISABLED]"),
            )
        })
        .collect()
}

/// The guest's own kprobe event on `__x64_sys_getppid`, enabled throughout; before each
/// window the workload waits for the host, then makes CALLS getppid() calls and prints
/// its count so far. After the last window it waits for the host once more (`WAIT END`),
/// so that the host's checks of that window find the run still there: on hardware KVM the
/// guest reached its end, and the run closed its control socket, before the host's
/// `probe list` of the last window (7 of 7 runs in the nested-SVM lane).
fn windows_workload(windows: usize) -> String {
    format!(
        "T=/sys/kernel/tracing; echo 'p:gk __x64_sys_getppid' > $T/kprobe_events; \
         echo 1 > $T/events/kprobes/gk/enable; stty -echo < /dev/ttyS0; \
         for w in $(seq 1 {windows}); do echo \"WAIT $w\"; read -r go < /dev/ttyS0; hvprobe-loop {CALLS}; \
         while read -r e h m; do echo \"WINDOW $w $h\"; done < $T/kprobe_profile; done; \
         echo 'WAIT END'; read -r go < /dev/ttyS0; \
         echo 0 > $T/events/kprobes/gk/enable; echo > $T/kprobe_events; echo DONE"
    )
}

#[test]
fn probes_added_disabled_enabled_and_removed_live_count_what_the_guest_counts_per_window() {
    let dir = snapshot(1);
    let mut live = LiveRun::start(&dir, 1, "windows", &windows_workload(6), &["--text-hash"]);
    let mut guest_before = 0;
    let mut host_before = 0;
    // (what the host does before the window, whether its probe counts in the window)
    let steps: [(&[&str], Option<bool>); 6] = [
        (&[], None),
        (&["add", "p:live/gp __x64_sys_getppid"], Some(true)),
        (&["disable", "live/gp"], Some(false)),
        (&["enable", "live/"], Some(true)),
        (&["disable", "--all"], Some(false)),
        (&["remove", "gp"], None),
    ];
    for (w, (command, counts)) in steps.iter().enumerate() {
        let w = w + 1;
        live.wait_for(&format!("WAIT {w}"));
        if !command.is_empty() {
            let run = live.probe(command);
            assert_eq!(run.code, Some(0), "{command:?}\n{}", run.tail());
        }
        live.go();
        let window = live.wait_for(&format!("WINDOW {w} "));
        let guest: usize = window.rsplit(' ').next().unwrap().parse().unwrap();
        let guest_delta = guest - guest_before;
        guest_before = guest;
        assert_eq!(
            guest_delta, CALLS,
            "the guest's own probe counts every call of window {w}"
        );
        let listing = listed(&live.probe(&["list"]));
        match counts {
            None => assert!(listing.is_empty(), "window {w}: no probe listed: {listing:?}"),
            Some(counts) => {
                assert_eq!(listing.len(), 1, "window {w}: {listing:?}");
                let (event, hits, _) = &listing[0];
                assert_eq!(event, "live/gp");
                let delta = *hits as usize - host_before;
                host_before = *hits as usize;
                let expected = if *counts { guest_delta } else { 0 };
                assert_eq!(delta, expected, "window {w}: host hits {delta}, guest {guest_delta}");
            }
        }
        if w == 5 {
            // The global switch on again: the probe keeps its own state (enabled).
            let run = live.probe(&["enable", "--all"]);
            assert_eq!(run.code, Some(0), "{}", run.tail());
            assert!(listed(&live.probe(&["list"])).iter().all(|(_, _, disabled)| !disabled));
        }
    }
    live.wait_for("WAIT END");
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
    // The text after the live probes is the text of a run that never had any.
    let hash = |run: &Run| {
        run.stderr
            .lines()
            .find_map(|l| l.strip_prefix("hvprobe: kernel text sha256 "))
            .unwrap_or_else(|| panic!("no text hash\n{}", run.tail()))
            .to_string()
    };
    let plain = restore_with(&dir, 1, "true", &["--text-hash", "--no-control"], TIMEOUT);
    assert_eq!(plain.code, Some(0), "{}", plain.tail());
    assert_eq!(hash(&run), hash(&plain));
    common::assert_guest_healthy(&run, &[]);
}

#[test]
fn a_stream_that_does_not_read_drops_its_own_events_and_nobody_elses() {
    let dir = snapshot(1);
    let calls = 2000;
    let probes = std::env::temp_dir().join(format!("hvprobe-control-{}-streams.probes", std::process::id()));
    std::fs::write(&probes, "p:s/gp __x64_sys_getppid di=%di s0=$stack0\n").unwrap();
    let workload = format!(
        "T=/sys/kernel/tracing; echo 'p:gk __x64_sys_getppid' > $T/kprobe_events; \
         echo 1 > $T/events/kprobes/gk/enable; echo WAIT; read -r go < /dev/ttyS0; hvprobe-loop {calls}; \
         while read -r e h m; do echo \"PROFILE $h $m\"; done < $T/kprobe_profile; echo DONE"
    );
    let mut live = LiveRun::start(
        &dir,
        1,
        "streams",
        &workload,
        // On the int3 path: every hit reaches the streams. (At hardware speed this loop
        // outruns an event detour's ring: what the rings miss is another test's, stop.rs.)
        &[
            "--probes",
            probes.to_str().unwrap(),
            "--format",
            "none",
            "--optimize=off",
        ],
    );
    live.wait_for("WAIT");
    // The reader: `hvprobe trace`, JSON lines.
    let fast = Command::new(common::hvprobe_bin())
        .args(["trace", "--format", "json", "--control", live.socket.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // It reads as the events come (its output is drained by this thread all along).
    let fast = std::thread::spawn(move || fast.wait_with_output().unwrap());
    // The one that does not read (until the run is over): its own connection, a small queue.
    let mut slow = UnixStream::connect(&live.socket).unwrap();
    slow.write_all(b"{\"op\":\"trace\",\"format\":\"text\",\"queue\":4}\n")
        .unwrap();
    let mut slow = BufReader::new(slow);
    let mut ok = String::new();
    slow.read_line(&mut ok).unwrap();
    assert_eq!(ok.trim(), r#"{"ok":true}"#);
    // Give `hvprobe trace` time to subscribe.
    std::thread::sleep(Duration::from_secs(2));
    live.go();
    live.wait_for("DONE");
    let mut slow_text = String::new();
    slow.read_to_string(&mut slow_text).unwrap();
    let run = live.finish();
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let fast_out = fast.join().unwrap();
    let fast_lines = String::from_utf8_lossy(&fast_out.stdout);
    let fast_err = String::from_utf8_lossy(&fast_out.stderr);

    let profile = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("PROFILE "))
        .unwrap_or_else(|| panic!("no profile\n{}", run.tail()));
    let guest: usize = profile.split_whitespace().next().unwrap().parse().unwrap();
    assert_eq!(guest, calls, "the guest's own probe saw every call");
    let host_total: usize = run
        .stderr
        .lines()
        .find(|l| l.contains("event=s/gp"))
        .and_then(|l| l.split("hits=").nth(1))
        .and_then(|h| h.split_whitespace().next())
        .and_then(|h| h.parse().ok())
        .unwrap_or_else(|| panic!("no listing line\n{}", run.tail()));
    // Both streams started before the loop; the workload's shell calls getppid() once
    // before that too, for $PPID (the listing counts it, the streams do not have it).
    let fast_events: Vec<&str> = fast_lines.lines().filter(|l| l.contains("\"event\":\"gp\"")).collect();
    let from_loop = fast_events
        .iter()
        .filter(|l| l.contains("\"comm\":\"hvprobe-loop\""))
        .count();
    assert_eq!(
        from_loop, calls,
        "the reading client got every call the guest's own probe saw"
    );
    assert!(
        host_total - fast_events.len() <= 1,
        "only the shell's call is not streamed"
    );
    assert!(
        fast_err.contains(&format!("{} events received, 0 dropped", fast_events.len())),
        "{fast_err}"
    );

    let end = slow_text
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("{\"stream_end\":"))
        .unwrap_or_else(|| panic!("no end line in the slow stream: {:?}", slow_text.lines().last()));
    let field = |k: &str| -> usize {
        end.split(&format!("\"{k}\":"))
            .nth(1)
            .unwrap()
            .split([',', '}'])
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (sent, dropped) = (field("sent"), field("dropped"));
    let slow_events = slow_text.lines().filter(|l| l.contains(" gp: (")).count();
    assert_eq!(slow_events, sent, "the end line counts what was sent");
    assert!(dropped > 0, "a stream that does not read drops events: sent {sent}");
    assert_eq!(
        sent + dropped,
        fast_events.len(),
        "every event was sent or counted as dropped"
    );
}

#[test]
fn a_bad_add_reports_every_problem_and_changes_nothing() {
    let dir = snapshot(1);
    let mut live = LiveRun::start(&dir, 1, "bad-add", "echo WAIT; read -r go < /dev/ttyS0; echo DONE", &[]);
    live.wait_for("WAIT");
    let bad = live.probe(&[
        "add",
        "p:ok/a vfs_read",
        "p:bad/typo vfs_raed",
        "p:bad/split vfs_read+0x1",
        "q nonsense",
        "p:bad/ nothing_matches_this_*",
    ]);
    assert_eq!(bad.code, Some(1), "{}", bad.tail());
    for (line, reason) in [
        (2, "unknown symbol \"vfs_raed\""),
        (3, "not an instruction boundary"),
        (4, ""),
        (5, "matches no kernel function"),
    ] {
        let prefix = format!("<command line>:{line}:");
        assert!(
            bad.stderr.lines().any(|l| l.contains(&prefix) && l.contains(reason)),
            "line {line} ({reason})\n{}",
            bad.stderr
        );
    }
    assert!(listed(&live.probe(&["list"])).is_empty(), "nothing was added");
    let missing = live.probe(&["remove", "no/such"]);
    assert_eq!(missing.code, Some(1));
    assert!(
        missing.stderr.contains("no probe event matches \"no/such\""),
        "{}",
        missing.stderr
    );
    // A malformed request gets an answer, and the VM goes on.
    let mut raw = UnixStream::connect(&live.socket).unwrap();
    raw.write_all(b"{\"op\":\"format_disk\"}\nnot json\n").unwrap();
    let mut answers = BufReader::new(raw);
    for _ in 0..2 {
        let mut answer = String::new();
        answers.read_line(&mut answer).unwrap();
        assert!(
            answer.starts_with("{\"ok\":false,\"errors\":[\"malformed request"),
            "{answer}"
        );
    }
    // A request line past the limit is answered with the reason, and the server hangs up
    // without reading (and keeping) the rest of it.
    let mut raw = UnixStream::connect(&live.socket).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let long = vec![b'x'; hvprobe::control::MAX_REQUEST_BYTES + 1];
    let _ = raw.write_all(&long);
    let mut answer = String::new();
    BufReader::new(&raw).read_line(&mut answer).unwrap();
    assert!(
        answer.contains(&format!(
            "request longer than {} bytes",
            hvprobe::control::MAX_REQUEST_BYTES
        )),
        "{answer}"
    );
    let good = live.probe(&["add", "p:ok/a vfs_read"]);
    assert_eq!(good.code, Some(0), "{}", good.tail());
    assert!(good.stdout.contains("armed 1 probes in 1 pause(s)"), "{}", good.stdout);
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
}

/// `--control PATH` naming what is not a socket (a file of the user's, a directory, a
/// symlink) is refused before the boot, and what is there stays as it was.
#[test]
fn a_control_path_that_is_not_a_socket_is_refused_before_boot_and_left_alone() {
    let dir = common::scratch("control", "not-a-socket");
    let file = dir.join("notes.txt");
    std::fs::write(&file, "keep me\n").unwrap();
    let subdir = dir.join("subdir");
    std::fs::create_dir(&subdir).unwrap();
    let link = dir.join("link.sock");
    std::os::unix::fs::symlink(&file, &link).unwrap();
    for (path, what) in [
        (&file, "a regular file"),
        (&subdir, "a directory"),
        (&link, "a symbolic link"),
    ] {
        common::assert_refused_before_boot(
            &["--control", path.to_str().unwrap()],
            &format!("control socket {}: {what} is there, not a socket", path.display()),
        );
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me\n");
    assert!(subdir.is_dir());
    assert_eq!(std::fs::read_link(&link).unwrap(), file);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A vCPU blocked on the host, writing the guest's console to a stdout nobody reads, used
/// to hold every operation that pauses the vCPUs for as long as it was blocked. Now the
/// pause gives up at its deadline and the operation fails, naming the vCPU and what held
/// it; the run goes on once stdout is read again.
#[test]
fn a_vcpu_blocked_on_a_stalled_stdout_fails_a_pause_at_its_deadline_with_the_reason() {
    let dir = snapshot(1);
    let flood = "i=0; while [ $i -lt 1500 ]; do \
                 echo \"flood $i ..............................................................\"; i=$((i+1)); done";
    let mut live = LiveRun::start(
        &dir,
        1,
        "stalled-stdout",
        &format!("echo WAIT; read -r go < /dev/ttyS0; {flood}; echo FLOODED; read -r go < /dev/ttyS0; echo DONE"),
        &[],
    );
    live.wait_for("WAIT");
    live.stall_stdout(true);
    live.go();
    // Until the pipe is full a pause works; then the console write blocks the vCPU.
    let give_up = Instant::now() + Duration::from_secs(180);
    let (failed, took) = loop {
        let started = Instant::now();
        let run = live.probe(&["optimize", "off"]);
        if run.code != Some(0) {
            break (run, started.elapsed());
        }
        assert!(Instant::now() < give_up, "every pause worked: was stdout never full?");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        failed.stderr.contains(
            "the vCPUs did not stop for a pause within 10.0 s: vCPU 0 handling its write to I/O port 0x3f8 for"
        ),
        "{}",
        failed.tail()
    );
    assert!(took < Duration::from_secs(60), "the failed pause took {took:?}");
    live.stall_stdout(false);
    live.wait_for("FLOODED");
    let again = live.probe(&["optimize", "off"]);
    assert_eq!(
        again.code,
        Some(0),
        "a pause after stdout moved again\n{}",
        again.tail()
    );
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
}

#[test]
fn a_wildcard_over_hundreds_of_functions_is_armed_live_in_one_pause() {
    let dir = snapshot(1);
    let mut live = LiveRun::start(
        &dir,
        1,
        "wildcard",
        "echo WAIT; read -r go < /dev/ttyS0; echo DONE",
        &[],
    );
    live.wait_for("WAIT");
    let add = live.probe(&["add", "p:sys/ __x64_sys_*", "p:io/ {vfs_read,vfs_write,ksys_read}"]);
    assert_eq!(add.code, Some(0), "{}", add.tail());
    // "<command line>:1: __x64_sys_*: M functions match, A to arm, S skipped (...)"
    let summary = add
        .stdout
        .lines()
        .find(|l| l.starts_with("<command line>:1:"))
        .unwrap_or_else(|| panic!("no summary\n{}", add.stdout));
    let numbers: Vec<usize> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (matched, to_arm, skipped) = (numbers[2], numbers[3], numbers[4]);
    assert!(matched >= 200, "a few hundred syscalls: {summary}");
    assert_eq!(to_arm + skipped, matched, "{summary}");
    if skipped > 0 {
        assert!(
            summary.contains(" skipped ("),
            "the skipped ones have reasons: {summary}"
        );
    }
    let armed = to_arm + 3;
    assert!(
        add.stdout
            .contains(&format!("armed {armed} probes in 1 pause(s) of the vCPUs")),
        "{}",
        add.stdout
    );
    let listing = listed(&live.probe(&["list"]));
    assert_eq!(listing.len(), armed, "every armed probe is listed");
    assert_eq!(listing.iter().filter(|(e, _, _)| e.starts_with("sys/")).count(), to_arm);
    let removed = live.probe(&["remove", "sys/", "io/"]);
    assert_eq!(removed.code, Some(0), "{}", removed.tail());
    assert!(listed(&live.probe(&["list"])).is_empty());
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
}

#[test]
fn optimizing_and_unoptimizing_in_a_loop_under_two_busy_vcpus_loses_and_doubles_nothing() {
    let dir = snapshot(2);
    // Each vCPU calls getppid() in batches of BATCH, at least 4 batches, and on until the
    // host says stop (after its rounds of changes: at hardware speed a fixed count of
    // calls is over in milliseconds), then prints how many batches it made.
    const BATCH: usize = 100;
    let probes = std::env::temp_dir().join(format!("hvprobe-control-{}-stress.probes", std::process::id()));
    std::fs::write(&probes, "p:s/gp __x64_sys_getppid\np:s/pid __task_pid_nr_ns\n").unwrap();
    let workload = format!(
        "T=/sys/kernel/tracing; echo 'p:gk __x64_sys_getppid' > $T/kprobe_events; \
         echo 1 > $T/events/kprobes/gk/enable; stty -echo < /dev/ttyS0; rm -f /tmp/stop; echo WAIT; \
         read -r go < /dev/ttyS0; \
         for c in 0 1; do (n=0; while [ $n -lt 4 ] || [ ! -e /tmp/stop ]; do \
         taskset -c $c hvprobe-loop {BATCH} > /dev/null; n=$((n+1)); done; echo BATCHES $n) & done; \
         read -r stop < /dev/ttyS0; touch /tmp/stop; wait; \
         echo 0 > $T/events/kprobes/gk/enable; \
         while read -r e h m; do echo \"PROFILE $h $m\"; done < $T/kprobe_profile; \
         echo 'WAIT END'; read -r go < /dev/ttyS0; echo > $T/kprobe_events; echo DONE"
    );
    let mut live = LiveRun::start(
        &dir,
        2,
        "stress",
        &workload,
        &["--probes", probes.to_str().unwrap(), "--optimize=on", "--text-hash"],
    );
    live.wait_for("WAIT");
    live.go();
    // While both vCPUs call getppid(): the switch off and on, the other probe disabled,
    // enabled, removed and added again, over and over.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rounds_done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let socket = live.socket.clone();
    let toggler = {
        let done = done.clone();
        let rounds_done = rounds_done.clone();
        std::thread::spawn(move || {
            let steps: [&[&str]; 6] = [
                &["optimize", "off"],
                &["optimize", "on"],
                &["disable", "s/pid"],
                &["enable", "s/pid"],
                &["remove", "s/pid"],
                &["add", "p:s/pid __task_pid_nr_ns"],
            ];
            let mut rounds = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for step in steps {
                    let mut args = vec!["probe"];
                    args.extend_from_slice(step);
                    args.extend_from_slice(&["--control", socket.to_str().unwrap()]);
                    let run = common::hvprobe(&args, TIMEOUT);
                    if run.code != Some(0) && !done.load(std::sync::atomic::Ordering::Relaxed) {
                        return Err(format!("{step:?} failed after {rounds} rounds\n{}", run.tail()));
                    }
                }
                rounds += 1;
                rounds_done.store(rounds, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(rounds)
        })
    };
    // Three rounds of changes while the loops run, then the loops stop.
    let deadline = std::time::Instant::now() + TIMEOUT;
    while rounds_done.load(std::sync::atomic::Ordering::Relaxed) < 3 && !toggler.is_finished() {
        assert!(std::time::Instant::now() < deadline, "the changes took too long");
        std::thread::sleep(Duration::from_millis(50));
    }
    live.go();
    let profile = live.wait_for("PROFILE");
    // The guest waits until the changes have stopped: a change that fails while it still
    // runs is a failure, and one racing its end would be the socket's going away.
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = toggler.join().unwrap();
    live.wait_for("WAIT END");
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    // A change that failed: the run's own account of it.
    let rounds = rounds.unwrap_or_else(|e| panic!("{e}\n--- the run:\n{}", run.tail()));
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(rounds >= 3, "only {rounds} rounds of changes while the loops ran");
    let batches: usize = run
        .stdout
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("BATCHES "))
        .map(|n| n.parse::<usize>().unwrap())
        .sum();
    assert!(batches >= 8, "{batches} batches\n{}", run.tail());
    let guest: usize = profile.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(guest, batches * BATCH, "the guest's own probe saw every call");
    let host = run
        .stdout
        .lines()
        .filter(|l| l.contains(" gp: (") && l.trim_start().starts_with("hvprobe-loop-"))
        .count();
    // What the host's probe did not take is counted: at hardware speed its event detour's
    // ring overflows (its misses are nmissed); on kvm_pvm nothing is missed.
    let listing = run
        .stderr
        .lines()
        .find(|l| l.contains("event=s/gp"))
        .unwrap_or_else(|| panic!("no listing line of s/gp\n{}", run.tail()));
    let nmissed: usize = listing
        .split("nmissed=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no nmissed= in {listing}"));
    if hvprobe_vmm::Backend::detect() == hvprobe_vmm::Backend::Pvm {
        assert_eq!(nmissed, 0, "{listing}");
    }
    assert_eq!(
        host + nmissed,
        guest,
        "the host's probe, optimized and not by turns, saw each call once or counted it missed ({listing}); \
         hit lines of other tasks or broken: {:?}; hits of one task with the same timestamp: {:?}; \
         the loops' hits per task: {:?}; the run's counts: {:?}",
        run.stdout
            .lines()
            .filter(|l| l.contains("gp: (") && !l.trim_start().starts_with("hvprobe-loop-"))
            .take(5)
            .collect::<Vec<_>>(),
        repeated_hits(&run.stdout, " gp: (")
            .into_iter()
            .take(10)
            .collect::<Vec<_>>(),
        hits_per_task(&run.stdout, " gp: ("),
        run.stderr
            .lines()
            .filter(|l| l.starts_with("hvprobe: probe hits") || l.starts_with("hvprobe: probes gone"))
            .collect::<Vec<_>>(),
    );
    common::assert_guest_healthy(&run, &[]);
    let hash = |run: &Run| {
        run.stderr
            .lines()
            .find_map(|l| l.strip_prefix("hvprobe: kernel text sha256 "))
            .unwrap_or_else(|| panic!("no text hash\n{}", run.tail()))
            .to_string()
    };
    let plain = restore_with(&dir, 2, "true", &["--text-hash", "--no-control"], TIMEOUT);
    assert_eq!(plain.code, Some(0), "{}", plain.tail());
    assert_eq!(
        hash(&run),
        hash(&plain),
        "the text is as a run without probes leaves it"
    );
}

/// An event of the run's probe file removed and added again live keeps what the run gave
/// it by name: its `stacktrace` trigger still gets a kernel stack at every hit, and its
/// filter still runs in its event detour (every hit of `re/pid` is discarded, all of them
/// in the guest).
#[test]
fn an_event_added_again_live_keeps_its_stack_trigger_and_its_filter_in_the_detour() {
    let dir = snapshot(1);
    let probes = std::env::temp_dir().join(format!("hvprobe-control-{}-readd.probes", std::process::id()));
    std::fs::write(
        &probes,
        "p:re/gp __x64_sys_getppid\np:re/pid __task_pid_nr_ns\n\
         trigger re/gp stacktrace\nfilter re/pid comm == \"no-such-task\"\n",
    )
    .unwrap();
    let workload = "stty -echo < /dev/ttyS0; for w in 1 2; do echo \"WAIT $w\"; read -r go < /dev/ttyS0; \
                    hvprobe-loop 5; echo \"WINDOW $w\"; done; echo DONE";
    let mut live = LiveRun::start(
        &dir,
        1,
        "readd",
        workload,
        &["--probes", probes.to_str().unwrap(), "--optimize=on"],
    );
    live.wait_for("WAIT 1");
    live.go();
    live.wait_for("WINDOW 1");
    live.wait_for("WAIT 2");
    for command in [
        &["remove", "re/"][..],
        &["add", "p:re/gp __x64_sys_getppid"],
        &["add", "p:re/pid __task_pid_nr_ns"],
    ] {
        let run = live.probe(command);
        assert_eq!(run.code, Some(0), "{command:?}\n{}", run.tail());
    }
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    // The loop's hits of re/gp in each window, each followed by its stack.
    let window = |w: usize| -> &str {
        let start = if w == 1 {
            run.stdout.find("WAIT 1").unwrap()
        } else {
            run.stdout.find("WINDOW 1").unwrap()
        };
        let end = run.stdout.find(&format!("WINDOW {w}")).unwrap();
        &run.stdout[start..end]
    };
    for w in [1, 2] {
        let text = window(w);
        let hits = text
            .lines()
            .filter(|l| l.contains(" gp: (") && l.trim_start().starts_with("hvprobe-loop-"))
            .count();
        let stacks = text.lines().filter(|l| l.ends_with("<stack trace>")).count();
        assert_eq!(hits, 5, "window {w}: hits of re/gp from the loop\n{}", run.tail());
        assert!(
            stacks >= hits,
            "window {w}: {stacks} stacks for {hits} hits of re/gp\n{text}"
        );
    }
    // Every discarded hit (the filter keeps none) was discarded in the guest.
    let summary = run
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("hvprobe: filters on 1 event(s) discarded "))
        .unwrap_or_else(|| panic!("no filter summary\n{}", run.tail()));
    let number = |text: &str| -> u64 {
        text.split_whitespace()
            .next()
            .unwrap()
            .trim_start_matches('(')
            .parse()
            .unwrap()
    };
    let (discarded, in_guest) = (number(summary), number(summary.split("hits ").nth(1).unwrap()));
    assert!(discarded >= 10, "{summary}");
    assert_eq!(in_guest, discarded, "{summary}\n{}", run.tail());
}

/// BTF arguments added live are resolved against the guest's own BTF: a parameter by name
/// and a field through a pointer are fetched; a name the function lacks, the `$retval` of
/// a `void` function, or a fetch-arg symbol the kernel lacks, is refused with the reason; a wildcard's function without the
/// parameter is skipped and counted.
#[test]
fn btf_arguments_added_live_are_resolved_against_the_guests_btf() {
    let dir = snapshot(1);
    let mut live = LiveRun::start(
        &dir,
        1,
        "btf-live",
        "echo WAIT; read -r go < /dev/ttyS0; read -r l < /proc/version; echo DONE",
        &[],
    );
    live.wait_for("WAIT");
    let bad = live.probe(&["add", "p:b/bad vfs_read hoge"]);
    assert_eq!(bad.code, Some(1), "{}", bad.tail());
    // At Linux's column: `hoge`'s, in "p:b/bad vfs_read hoge".
    assert!(
        bad.stderr.contains(":1:18: `hoge` is not a parameter of vfs_read"),
        "{}",
        bad.stderr
    );
    let bad = live.probe(&["add", "r:b/void kfree $retval"]);
    assert_eq!(bad.code, Some(1), "{}", bad.tail());
    assert!(
        bad.stderr.contains(":1:16: kfree returns void: there is no $retval"),
        "{}",
        bad.stderr
    );
    let bad = live.probe(&["add", "p:b/sym vfs_read @nosuchsymbol"]);
    assert_eq!(bad.code, Some(1), "{}", bad.tail());
    assert!(
        bad.stderr.contains("no symbol `nosuchsymbol` in the kernel"),
        "{}",
        bad.stderr
    );
    let good = live.probe(&[
        "add",
        "p:b/rd vfs_read count pos=file->f_pos",
        "p:w/ {vfs_read,kfree} count",
    ]);
    assert_eq!(good.code, Some(0), "{}", good.tail());
    assert!(
        good.stdout
            .contains("2 functions match, 1 to arm, 1 skipped (1 without those BTF arguments)"),
        "{}",
        good.stdout
    );
    live.go();
    live.wait_for("DONE");
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
    // The shell's `read` reads one byte at a time: count=1, the position moving on.
    let positions: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.contains(" rd: (vfs_read+0x0/") && l.contains(" count=1 "))
        .filter_map(|l| l.split(" pos=").nth(1))
        .collect();
    assert!(positions.len() > 10, "{}", run.tail());
    assert!(positions.windows(2).any(|w| w[0] != w[1]), "{positions:?}");
}

/// perf probe's `vfs_read:17 count`, added live after the guest put its own kprobe event on
/// the line's address (the guest's int3 is there first; ours shares it, as Linux refuses
/// to probe an int3 it did not write): in each child shell's one-byte reads, the source
/// probe fetches the same `count`, in the same order, as a hand-written probe at that
/// address with DWARF's register and as the guest's own event — and that count is 1, what
/// the shell's `read` asks for.
#[test]
fn a_source_line_probe_fetches_what_the_guests_event_and_a_hand_written_probe_fetch() {
    // Where DWARF puts `vfs_read:17` (`if (file->f_op->read)`) and `count` there.
    let vars = common::hvprobe(&["vars", "vfs_read:17"], TIMEOUT);
    assert_eq!(vars.code, Some(0), "{}", vars.tail());
    let site = vars
        .stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("@<").and_then(|s| s.strip_suffix('>')))
        .unwrap_or_else(|| panic!("{}", vars.stdout))
        .to_owned();
    let fetch = vars
        .stdout
        .lines()
        .find_map(|l| l.split_once(" count=").map(|(_, f)| f.to_owned()))
        .unwrap_or_else(|| panic!("count is readable at vfs_read:17\n{}", vars.stdout));
    let workload = format!(
        "T=/sys/kernel/tracing; echo 'p:gl {site} count={fetch}' > $T/kprobe_events; \
         echo 1 > $T/events/kprobes/gl/enable; stty -echo < /dev/ttyS0; \
         echo 'WAIT 1'; read -r go < /dev/ttyS0; \
         i=0; while [ $i -lt 2 ]; do sh -c 'read -r l < /proc/version'; i=$((i+1)); done; \
         echo 0 > $T/events/kprobes/gl/enable; \
         busybox grep ' gl: ' $T/trace | busybox sed 's/^/GUEST /'; \
         echo 'WAIT END'; read -r go < /dev/ttyS0; echo > $T/kprobe_events; echo DONE"
    );
    let dir = snapshot(1);
    // Optimization on, as on hardware KVM: the guest has jump-optimized its own kprobe by
    // the time ours comes, and a jump of ours over its jump was lost when it went.
    let mut live = LiveRun::start(&dir, 1, "source-line", &workload, &["--optimize", "on"]);
    live.wait_for("WAIT 1");
    for spec in [
        "p:live/src vfs_read:17 count".to_owned(),
        format!("p:live/hand {site} count={fetch}"),
    ] {
        let run = live.probe(&["add", &spec]);
        assert_eq!(run.code, Some(0), "{spec}\n{}", run.tail());
    }
    live.go();
    live.wait_for("WAIT END");
    live.go();
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
    // Per task, the counts each event fetched, in order.
    let counts = |guest: bool, event: &str| -> std::collections::BTreeMap<String, Vec<String>> {
        let mut m = std::collections::BTreeMap::<String, Vec<String>>::new();
        for l in run
            .stdout
            .lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(common::parse_trace_line)
            .filter(|l| l.event == event)
        {
            assert_eq!(l.location.split('/').next(), Some(site.as_str()), "{}", l.location);
            m.entry(l.task).or_default().push(l.args["count"].clone());
        }
        m
    };
    let guest = counts(true, "gl");
    let (source, hand) = (counts(false, "src"), counts(false, "hand"));
    // The child shells: the tasks whose reads the guest saw ask for one byte each.
    let children: Vec<&String> = guest
        .iter()
        .filter(|(_, c)| c.len() > 100 && c.iter().all(|c| c == "1"))
        .map(|(t, _)| t)
        .collect();
    assert_eq!(children.len(), 2, "{guest:?}\n{}", run.tail());
    for task in children {
        assert_eq!(source.get(task), guest.get(task), "{task}");
        assert_eq!(hand.get(task), guest.get(task), "{task}");
    }
}

/// A wildcard over a module's functions (`MOD:PATTERN`, bpftrace's `kprobe:MOD:PATTERN`)
/// covers what the loaded module has when it is added: here every function of the test
/// module whose name matches, each its own event, counting the module's calls; the same
/// wildcard while the module is not loaded is refused with the reason, and the probes go
/// `[GONE]` when the module unloads.
#[test]
fn a_wildcard_over_a_loaded_modules_functions_probes_each_of_them() {
    let workload = "stty -echo < /dev/ttyS0; echo 'WAIT 1'; read -r go < /dev/ttyS0; \
                    busybox insmod /usr/lib/hvprobe/hvprobe_test.ko; \
                    echo 'WAIT 2'; read -r go < /dev/ttyS0; \
                    i=0; while [ $i -lt 2 ]; do read -r l < /proc/hvprobe_test; i=$((i+1)); done; \
                    busybox rmmod hvprobe_test; echo 'WAIT END'; read -r go < /dev/ttyS0; echo DONE";
    let dir = snapshot(1);
    let mut live = LiveRun::start(&dir, 1, "module-wildcard", workload, &[]);
    live.wait_for("WAIT 1");
    let refused = live.probe(&["add", "p:live/ hvprobe_test:hvprobe_test_{work,read}"]);
    assert_ne!(refused.code, Some(0), "{}", refused.tail());
    assert!(
        refused
            .stderr
            .contains("module hvprobe_test is not loaded: a wildcard covers the functions of a loaded module"),
        "{}",
        refused.stderr
    );
    live.go();
    live.wait_for("WAIT 2");
    let added = live.probe(&["add", "p:live/ hvprobe_test:hvprobe_test_{work,read}"]);
    assert_eq!(added.code, Some(0), "{}", added.tail());
    let nothing = live.probe(&["add", "p:live/ hvprobe_test:nothing_like_this*"]);
    assert_ne!(nothing.code, Some(0), "{}", nothing.tail());
    assert!(
        nothing.stderr.contains("matches no function of module hvprobe_test"),
        "{}",
        nothing.stderr
    );
    live.go();
    live.wait_for("WAIT END");
    let listed = live.probe(&["list"]);
    live.go();
    let run = live.finish();
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let hits = |event: &str| {
        run.stdout
            .lines()
            .filter_map(common::parse_trace_line)
            .filter(|l| l.event == event)
            .count()
    };
    // Two `read -r l`, two read() calls each.
    assert_eq!(hits("p_hvprobe_test_hvprobe_test_read_0"), 4, "{}", run.tail());
    assert_eq!(hits("p_hvprobe_test_hvprobe_test_work_0"), 4, "{}", run.tail());
    let module_lines: Vec<&str> = listed
        .stdout
        .lines()
        .filter(|l| l.contains(" hvprobe_test ["))
        .collect();
    assert_eq!(module_lines.len(), 2, "{}", listed.stdout);
    assert!(module_lines.iter().all(|l| l.contains("[GONE]")), "{module_lines:?}");
}

/// Hit lines (containing `event`) of one task at one timestamp, with how often each came:
/// a call the host reported twice.
fn repeated_hits(stdout: &str, event: &str) -> Vec<(String, usize)> {
    let mut seen: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for line in stdout.lines().filter(|l| l.contains(event)) {
        let mut fields = line.split_whitespace();
        let (Some(task), Some(_cpu), Some(stamp)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        *seen.entry(format!("{task} {stamp}")).or_default() += 1;
    }
    seen.into_iter().filter(|(_, n)| *n > 1).collect()
}

/// How many hit lines (containing `event`) each task has.
fn hits_per_task(stdout: &str, event: &str) -> std::collections::BTreeMap<String, usize> {
    let mut per_task = std::collections::BTreeMap::new();
    for line in stdout.lines().filter(|l| l.contains(event)) {
        if let Some(task) = line.split_whitespace().next() {
            *per_task.entry(task.to_owned()).or_default() += 1;
        }
    }
    per_task
}
