//! Running the `hvprobe` binary from integration tests.

#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What one `hvprobe` invocation did.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// The end of both streams, for assertion messages.
    pub fn tail(&self) -> String {
        let last = |s: &str, n: usize| {
            let lines: Vec<&str> = s.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        };
        format!(
            "exit code {:?}\n--- stdout (guest console), last 40 lines ---\n{}\n--- stderr, last 20 lines ---\n{}",
            self.code,
            last(&self.stdout, 40),
            last(&self.stderr, 20)
        )
    }

    /// Whether the guest console shows a line equal to `line`.
    pub fn console_has_line(&self, line: &str) -> bool {
        self.stdout.lines().any(|l| l.trim_end_matches('\r') == line)
    }
}

/// Runs `hvprobe ARGS` and kills it after `timeout`.
pub fn hvprobe(args: &[&str], timeout: Duration) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hvprobe"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvprobe");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for hvprobe") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let run = Run {
        code: status.and_then(|s| s.code()),
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    };
    assert!(
        status.is_some(),
        "hvprobe {args:?} did not finish within {timeout:?}\n{}",
        run.tail()
    );
    run
}

/// Fails with a clear message when this machine has no usable KVM.
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        panic!("this test boots a guest and needs /dev/kvm, which cannot be opened: {e}");
    }
}
