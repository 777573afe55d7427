//! Boots the bundled guest under real KVM through the `hvprobe` binary.
//!
//! Each boot costs about a minute on kvm_pvm (guest kernel code is emulated), so every
//! test checks as much as one boot can show.

use crate::common;

use std::time::Duration;

use common::{hvprobe, require_kvm, Run};

const BOOT_TIMEOUT: Duration = Duration::from_secs(420);

/// The "N guest int3 re-injected" count hvprobe prints at exit.
fn reinjected_int3(run: &Run) -> u64 {
    let line = run
        .stderr
        .lines()
        .find(|l| l.contains("guest int3 re-injected"))
        .unwrap_or_else(|| {
            panic!("no run summary on stderr\n{}", run.tail());
        });
    let before = line.split(" guest int3 re-injected").next().unwrap();
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

fn on_kvm_pvm() -> bool {
    std::path::Path::new("/sys/module/kvm_pvm").exists()
}

fn assert_booted_cleanly(run: &Run) {
    assert!(
        run.stderr.contains("boot to /init ") && !run.stderr.contains("boot to /init not reached"),
        "{}",
        run.tail()
    );
    common::assert_guest_healthy(run, &["int3 selftest"]);
}

#[test]
fn one_vcpu_runs_the_workload_and_its_exit_status_comes_back() {
    require_kvm();
    let run = hvprobe(
        &[
            "run",
            "--cpus",
            "1",
            "--sample-ms",
            "500",
            "--workload",
            "echo hvprobe-marker-$((6*7)); nproc; exit 7",
        ],
        BOOT_TIMEOUT,
    );
    assert_eq!(
        run.code,
        Some(7),
        "workload exit status did not propagate\n{}",
        run.tail()
    );
    assert!(
        run.console_has_line("hvprobe-marker-42"),
        "marker missing\n{}",
        run.tail()
    );
    assert!(run.console_has_line("1"), "nproc did not print 1\n{}", run.tail());
    assert!(run.stderr.contains("guest exited with status 7"), "{}", run.tail());
    assert_booted_cleanly(&run);
    // The boot sampled from the host: its hottest places named from the kernel's symbols.
    let hottest = run
        .stderr
        .split("samples; hottest guest functions:\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no sample report\n{}", run.tail()));
    let named = hottest
        .lines()
        .take_while(|l| !l.starts_with("hvprobe:"))
        .filter(|l| l.split_whitespace().nth(2).is_some_and(|name| !name.starts_with('[')))
        .count();
    assert!(named >= 1, "no sampled place named a kernel function\n{}", run.tail());
    // The kernel's boot-time int3 self-test (and text_poke_bp) executed int3 at CPL0: on
    // kvm_pvm each one came to us and went back to the guest, which got on with its boot.
    if on_kvm_pvm() {
        assert!(
            reinjected_int3(&run) >= 1,
            "no guest int3 went through the VMM\n{}",
            run.tail()
        );
    }
}

#[test]
fn two_vcpus_are_both_online() {
    require_kvm();
    let run = hvprobe(
        &["run", "--cpus", "2", "--workload", "nproc; cat /proc/version"],
        BOOT_TIMEOUT,
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(run.console_has_line("2"), "nproc did not print 2\n{}", run.tail());
    assert!(run.stdout.contains("Linux version 6.1"), "{}", run.tail());
    assert_booted_cleanly(&run);
}

#[test]
fn a_guest_kernel_panic_fails_the_run_with_the_console_tail() {
    require_kvm();
    // No init anywhere: the kernel panics at the end of its boot.
    let run = hvprobe(
        &[
            "run",
            "--workload",
            "true",
            "--cmdline",
            "rdinit=/no-such-init init=/no-such-init",
        ],
        BOOT_TIMEOUT,
    );
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(run.stderr.contains("the guest kernel panicked"), "{}", run.tail());
    assert!(
        run.stderr.contains("Kernel panic - not syncing"),
        "console tail missing from the error\n{}",
        run.tail()
    );
}

#[test]
fn the_interactive_console_takes_input_and_the_shell_exit_status_ends_the_run() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    require_kvm();
    let mut child = Command::new(common::hvprobe_bin())
        .args(["run", "--cpus", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvprobe");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let stderr_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    // Type only once the shell runs: the guest's UART driver resets its FIFO at probe time.
    let (lines_tx, lines_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + BOOT_TIMEOUT;
    let mut console = Vec::new();
    let mut typed = false;
    let code = loop {
        while let Ok(line) = lines_rx.try_recv() {
            if !typed && line.contains("hvprobe-init: interactive shell") {
                stdin
                    .write_all(b"echo typed-$((40+2))\nexit 5\n")
                    .expect("type into the console");
                stdin.flush().unwrap();
                typed = true;
            }
            console.push(line);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(200));
    console.extend(lines_rx.try_iter());
    let run = Run {
        code,
        stdout: console.join("\n"),
        stderr: stderr_reader.join().unwrap(),
    };
    assert!(typed, "the interactive shell never started\n{}", run.tail());
    assert_eq!(run.code, Some(5), "{}", run.tail());
    assert!(
        run.stdout.lines().any(|l| l.trim_end_matches('\r') == "typed-42"),
        "typed command's output missing\n{}",
        run.tail()
    );
}
