//! The nested-SVM lane: hvprobe on hardware KVM (kvm_amd), tested on machines whose own
//! `/dev/kvm` is kvm_pvm. Each test boots an L1 guest with `guest/l1/run` (QEMU's TCG with
//! nested SVM and the lane's INT3 patch, Debian's cloud kernel with kvm_amd) and runs one
//! of this workspace's own test binaries in it, built by the same `cargo test`: the tests
//! that need real KVM debug exits pass on both backends from one source.
//!
//! The lane's prerequisites (guest/l1/install-deps.sh, then guest/l1/build.sh; `.ci/run`
//! does both) are not optional: without them every test here fails with the reason
//! `guest/l1/run` gives. A binary built before this one is refused, so that a partial
//! build cannot run stale tests in the L1.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use common::{repo, Run};

/// One L1 at a time: each takes both cores.
static LANE: Mutex<()> = Mutex::new(());

/// Longest one L1 run may take. The probe suite took about 10 minutes in a CI-equivalent
/// run that also made the guest's snapshots, so this stays well above that.
const LANE_TIMEOUT: Duration = Duration::from_secs(1800);

/// Runs `command` in the L1 with this build's `hvprobe` on its PATH; `env` goes to
/// `guest/l1/run` (its `HVPROBE_L1_*` settings). When the L1 kernel itself panics (seen in
/// about one lane run of fifteen, in the L1's own entry code under QEMU's TCG emulation of
/// nested SVM: not the code under test, which runs in the L1's guest), or loses a CPU's
/// timer interrupts from its boot on (its RCU says so; `guest/l1/run` ends it then),
/// COMMAND runs once more, and the reason is printed and counted ([`second_try`]).
fn in_l1(command: &str, env: &[(&str, &str)]) -> Run {
    let _one_at_a_time = LANE.lock().unwrap_or_else(|e| e.into_inner());
    let run = in_l1_once(command, env);
    let sick = [
        ("Kernel panic - not syncing", "the L1 kernel panicked"),
        (
            "the L1 kernel lost a CPU's timer",
            "the L1 kernel lost a CPU's timer interrupts",
        ),
    ]
    .into_iter()
    .find(|(said, _)| run.code == Some(125) && run.stderr.contains(said));
    if let Some((_, what)) = sick {
        second_try(&format!("{what} under `{}`", first_line(command)), &tail(&run));
        return in_l1_once(command, env);
    }
    run
}

/// The second tries of this run of the lane, one line each.
static SECOND_TRIES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// More second tries than this in one run of the lane fail it: a lane that needs them is
/// not a test of hvprobe any more.
const MAX_SECOND_TRIES: usize = 1;

/// Records that something of the lane needs a second try: printed at once past libtest's
/// capture (a passing test's own output is never shown), appended to
/// `target/tmp/hvprobe-lane-second-tries.txt` (`.ci/run` prints the file in its summary),
/// and over [`MAX_SECOND_TRIES`] in this run the test fails here.
fn second_try(what: &str, evidence: &str) {
    use std::io::Write;
    let mut tries = SECOND_TRIES.lock().unwrap_or_else(|e| e.into_inner());
    tries.push(what.to_string());
    let line = format!(
        "hvprobe-lane: SECOND TRY {} of at most {MAX_SECOND_TRIES}: {what}",
        tries.len()
    );
    let _ = writeln!(
        std::io::stderr(),
        "{line}
{evidence}"
    );
    let record = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hvprobe-lane-second-tries.txt");
    if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(&record) {
        let _ = writeln!(file, "{line}");
    }
    assert!(
        tries.len() <= MAX_SECOND_TRIES,
        "more than {MAX_SECOND_TRIES} second tries in this run of the lane: {tries:?}\n{evidence}"
    );
}

fn first_line(command: &str) -> &str {
    command.lines().next().unwrap_or_default()
}

fn in_l1_once(command: &str, env: &[(&str, &str)]) -> Run {
    // The L1 must find kvm_amd; say so plainly if it does not.
    let script = format!(
        "[ -e /sys/module/kvm_amd ] || {{ echo 'hvprobe-lane: no kvm_amd in the L1' >&2; exit 125; }}\n{command}"
    );
    let child = Command::new(repo().join("guest/l1/run"))
        .arg(&script)
        .env("HVPROBE_BIN", env!("CARGO_BIN_EXE_hvprobe"))
        .env("HVPROBE_L1_TIMEOUT", LANE_TIMEOUT.as_secs().to_string())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run guest/l1/run: {e}"));
    let out = child.wait_with_output().expect("wait for guest/l1/run");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The newest test binary `name` of this target directory (cargo names them
/// `NAME-HASH` in the directory of this one). `cargo test` builds every test binary before
/// it runs any, so under it this is the current one.
fn test_binary(name: &str) -> PathBuf {
    test_binary_having(name, None)
}

/// [`test_binary`], of those that have test `test` (two crates of the workspace may
/// each have a test binary of one name: `stacks`).
fn test_binary_having(name: &str, test: Option<&str>) -> PathBuf {
    let me = std::env::current_exe().expect("current_exe");
    let deps = me.parent().expect("the test binary's directory");
    let mut found: Vec<(SystemTime, PathBuf)> = std::fs::read_dir(deps)
        .expect("read the test binaries' directory")
        .filter_map(|e| e.ok())
        .filter(|e| {
            let file = e.file_name();
            let file = file.to_string_lossy();
            file.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|hash| hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    found.sort();
    let has_test = |path: &PathBuf| {
        test.is_none_or(|test| {
            Command::new(path)
                .args(["--list", "--format", "terse"])
                .output()
                .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(&format!("{test}: test")))
        })
    };
    let path = found.into_iter().rev().map(|(_, p)| p).find(has_test);
    path.unwrap_or_else(|| {
        panic!(
            "no test binary {name}{} in {}: build the workspace's tests (cargo test --workspace)",
            test.map(|t| format!(" with test {t}")).unwrap_or_default(),
            deps.display()
        )
    })
}

/// Runs test binary `name` in the L1 (`args` are libtest's: filters, `--skip`), and
/// checks that it passed and ran at least `at_least` tests there.
fn suite_in_l1(name: &str, args: &str, at_least: usize, env: &[(&str, &str)]) -> Run {
    suite_of_binary_in_l1(test_binary(name), name, args, at_least, env)
}

fn suite_of_binary_in_l1(binary: PathBuf, name: &str, args: &str, at_least: usize, env: &[(&str, &str)]) -> Run {
    // The L1 runs COMMAND on a serial port, which libtest takes for a terminal.
    // One test, so one L2 guest, at a time: the restored L2s that triple-faulted in lane
    // runs ran beside another L2 (25 restores in a row alone did not fail), and the L1's
    // own panics show QEMU's nested SVM mixing up its guests' state and its own (docs/known-issues.md).
    let threads = if args.contains("--test-threads") {
        ""
    } else {
        "--test-threads=1"
    };
    let run = in_l1(&format!("{} {threads} --color never {args}", binary.display()), env);
    let first = Verdicts::of(&run.stdout);
    let mut passed = first.passed.len();
    if run.code != Some(0) {
        // A test that failed or never finished runs once more, alone, and must pass then:
        // the lane itself is not reliable yet (an L2 that hangs or triple-faults about once
        // in a full lane run, docs/known-issues.md). Each such test is a second try of the lane's few.
        assert!(
            !first.failed.is_empty(),
            "{name} failed on kvm_amd in the L1 with no test failing: no second try\n{}",
            tail(&run)
        );
        for test in &first.failed {
            second_try(
                &format!("{name}::{test} failed or did not finish on kvm_amd"),
                &tail(&run),
            );
        }
        let rerun = in_l1(
            &format!(
                "{} --test-threads=1 --color never --exact {}",
                binary.display(),
                first.failed.join(" ")
            ),
            env,
        );
        let again = Verdicts::of(&rerun.stdout);
        assert!(
            rerun.code == Some(0) && again.passed.len() == first.failed.len(),
            "{name} failed on kvm_amd in the L1, and again when {:?} ran once more\n--- first run ---\n{}\n--- rerun ---\n{}",
            first.failed,
            tail(&run),
            tail(&rerun)
        );
        passed += again.passed.len();
    }
    assert!(
        passed >= at_least,
        "{name} ran {passed} tests in the L1, expected at least {at_least}\n{}",
        tail(&run)
    );
    run
}

/// The tests of a libtest run (`--test-threads=1`) that passed, and those that failed or
/// never finished (the last `test NAME ... ` line with no verdict, when the L1 died or
/// timed out under it).
#[derive(Debug, PartialEq)]
struct Verdicts {
    passed: Vec<String>,
    failed: Vec<String>,
}

impl Verdicts {
    fn of(output: &str) -> Verdicts {
        let mut verdicts = Verdicts {
            passed: Vec::new(),
            failed: Vec::new(),
        };
        for line in output.lines() {
            let Some(rest) = line.trim_end_matches('\r').strip_prefix("test ") else {
                continue;
            };
            let Some((test, verdict)) = rest.split_once(" ... ") else {
                continue;
            };
            match verdict.trim() {
                "ok" => verdicts.passed.push(test.to_string()),
                "ignored" => {}
                v if v.starts_with("ignored,") => {}
                _ => verdicts.failed.push(test.to_string()),
            }
        }
        verdicts
    }
}

#[test]
fn the_lane_reads_which_tests_passed_failed_or_never_finished() {
    let output = "running 4 tests\r\n\
                  test a_first ... ok\r\n\
                  test a_second ... FAILED\r\n\
                  test an_ignored ... ignored, needs a thing\r\n\
                  test the_hung_one ... \r\n";
    assert_eq!(
        Verdicts::of(output),
        Verdicts {
            passed: vec!["a_first".into()],
            failed: vec!["a_second".into(), "the_hung_one".into()],
        }
    );
    assert_eq!(
        Verdicts::of("test result: ok. 3 passed; 0 failed"),
        Verdicts {
            passed: vec![],
            failed: vec![]
        }
    );
}

/// The end of each stream, after every panic message of the suite in the L1 (a failing
/// test's message is often further up than the tail reaches).
fn tail(run: &Run) -> String {
    let lines: Vec<&str> = run.stdout.lines().collect();
    let panics: Vec<String> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("panicked at "))
        .map(|(i, _)| lines[i..(i + 6).min(lines.len())].join("\n"))
        .collect();
    let panics = if panics.is_empty() {
        String::new()
    } else {
        format!("--- panics in the L1 ---\n{}\n", panics.join("\n"))
    };
    format!("{panics}{}", run.tail_of(("output", 80), ("guest/l1/run", 90)))
}

/// The number after `key` in `text`, e.g. 7.01 in `boot to /init 7.01 s`.
fn number_after(text: &str, key: &str) -> Option<f64> {
    let at = text.find(key)? + key.len();
    text[at..].split_whitespace().next()?.trim_end_matches(',').parse().ok()
}

// ---- The lane's set-up ----

/// Four lane runs that start together on a fresh machine (`cargo test` runs this test
/// beside the first suite that boots an L1) build each part of the lane once, and each
/// gets the same `lane.env`, whole: one line on stdout, naming a file whose every part
/// exists. On a warm cache nothing is built and the same holds.
#[test]
fn the_lane_builds_once_when_four_runs_start_it_together() {
    let builders: Vec<_> = (0..4)
        .map(|_| {
            Command::new(repo().join("guest/l1/build.sh"))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run guest/l1/build.sh: {e}"))
        })
        .collect();
    let outputs: Vec<_> = builders.into_iter().map(|b| b.wait_with_output().unwrap()).collect();
    let show = |out: &std::process::Output| {
        format!(
            "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    for out in &outputs {
        assert!(
            out.status.success(),
            "guest/l1/build.sh failed (its dependencies: guest/l1/install-deps.sh)\n{}",
            show(out)
        );
        assert_eq!(out.stdout, outputs[0].stdout, "the builders disagree\n{}", show(out));
    }
    let stdout = String::from_utf8_lossy(&outputs[0].stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "build.sh printed more than its result\n{}",
        show(&outputs[0])
    );
    let env = std::fs::read_to_string(lines[0]).unwrap_or_else(|e| panic!("{}: {e}", lines[0]));
    for var in [
        "HVPROBE_L1_QEMU",
        "HVPROBE_L1_VIRTIOFSD",
        "HVPROBE_L1_KERNEL",
        "HVPROBE_L1_INITRAMFS",
    ] {
        let value = env
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{var}=")))
            .unwrap_or_else(|| panic!("lane.env has no {var}:\n{env}"));
        assert!(Path::new(value).is_file(), "{var}={value} is not a file\n{env}");
    }
    let stderr: String = outputs.iter().map(|o| String::from_utf8_lossy(&o.stderr)).collect();
    for build in [
        "building patched QEMU",
        "building virtiofsd",
        "downloading linux-image",
        "building the L1 initramfs",
    ] {
        let times = stderr.matches(build).count();
        assert!(times <= 1, "{times} builders said '{build}'\n{stderr}");
    }
}

// ---- The workspace's own suites, on kvm_amd ----

#[test]
fn exit_loop_code_blobs_on_kvm_amd() {
    suite_in_l1("exit_loop", "", 4, &[]);
}

/// Registers through kvm_run's sync area (`vmm::exit_regs`) on hardware KVM.
#[test]
fn registers_through_the_sync_area_on_kvm_amd() {
    suite_in_l1("exit_regs", "", 1, &[]);
}

/// Hardware breakpoints the host sets (`KVM_GUESTDBG_USE_HW_BP`) on hardware KVM: there,
/// unlike on kvm_pvm, a write watchpoint fires, and RF passes an execution breakpoint; and
/// the watches of `tests/probes.rs` on the bundled guest (a write watch on a sysctl's
/// variable reports every write there; kvm_pvm refuses it).
#[test]
fn hardware_breakpoints_on_kvm_amd() {
    suite_in_l1("debug_regs", "", 2, &[]);
    suite_of_binary_in_l1(test_binary("probes"), "probes", "watch", 3, &[]);
}

/// The guest-kprobe oracle on 1 and 2 vCPUs and under KASLR, exit counts, return probes,
/// JSON, the kernel's text intact after probes, and the jump-optimized probes beside the
/// guest's own ftrace-based kprobe on the same function (skipped in the lane until one
/// run saw the guest's probe miss 6 of 30 hits; not seen again in 2 runs since).
#[test]
fn kprobe_oracle_on_kvm_amd() {
    suite_in_l1("probes", "--skip watch", 11, &[]);
}

/// SIGINT and SIGTERM in a busy trace: every hit taken is printed, and what an event
/// detour's ring could not hold at hardware speed is counted (the loop outruns the drain).
#[test]
fn a_busy_trace_stops_cleanly_on_kvm_amd() {
    suite_in_l1("stop", "", 2, &[]);
}

/// Hits on the guest's trace clock against its own trace, `sched_clock()` and dmesg. The
/// L1 keeps time with its TSC (`HVPROBE_L1_TSC_RELIABLE=1`): TCG's TSC is the host's
/// invariant one, but QEMU cannot advertise invtsc, so without it the L1 distrusts its TSC
/// and its KVM moves the L2's TSC offset at every vCPU load, as no invariant-TSC host does.
#[test]
fn guest_clock_stamps_on_kvm_amd() {
    suite_in_l1("clock", "", 4, &[("HVPROBE_L1_TSC_RELIABLE", "1")]);
}

/// Probes added, listed, disabled, enabled and removed while the guest runs, event
/// streams, optimization switched in a loop under two busy vCPUs.
#[test]
fn live_control_on_kvm_amd() {
    // Skipped here, with the reason in docs/known-issues.md: the two-streams test
    // hung twice in full lane runs (its L2 looping on #PF injections from the L1's KVM),
    // the optimize-loop stress test failed in 3 of 4 full lane runs; both pass alone there
    // and run on kvm_pvm in tests/control.rs. Not diagnosed. The stalled-stdout test
    // (hvprobe's vCPU thread blocked writing to a full pipe while the test pauses the VM
    // every half second) panics the L1 kernel (a task stack overflow in its page-fault
    // entry, on the vCPU thread): 3 of 4 runs there; it runs on kvm_pvm.
    suite_in_l1(
        "control",
        "--skip a_stream_that_does_not_read --skip optimizing_and_unoptimizing_in_a_loop \
         --skip a_vcpu_blocked_on_a_stalled_stdout",
        4,
        &[],
    );
}

/// Kernel stacks unwound on the host against the guest's own `stacktrace` trigger through
/// system calls, under KASLR with kallsyms alone, as JSON and as a hist key. The two tests
/// that also compare the timer tick's stacks are skipped: on hardware KVM the guest's own
/// `stacktrace:5` trigger on its tick kprobe records 1 or 2 stacks for its 5 fires, with no
/// host probe at all (its kprobe_profile counts 127-130 hits, 0 missed, and the trigger's
/// count reaches 0), so there is nothing to compare with (docs/known-issues.md).
#[test]
fn kernel_stacks_on_kvm_amd() {
    // tests/stacks.rs, not live/tests/stacks.rs.
    let binary = test_binary_having(
        "stacks",
        Some("host_stacks_equal_the_guests_own_under_kaslr_with_kallsyms_from_guest_memory_alone"),
    );
    suite_of_binary_in_l1(
        binary,
        "stacks",
        "--skip host_stacks_equal_the_guests_own_on_one_vcpu --skip host_stacks_equal_the_guests_own_on_two_vcpus",
        3,
        &[],
    );
}

/// Event detours on code blobs (records written by the guest at native speed, full rings,
/// nested hits, two vCPUs, filters run in the detour), from `live/tests/event_detour.rs`.
#[test]
fn event_detours_on_kvm_amd() {
    suite_in_l1("event_detour", "", 10, &[]);
}

/// Event filters and hist triggers against the guest's own, on the int3 path and in event
/// detours.
#[test]
fn filters_and_hist_triggers_on_kvm_amd() {
    suite_in_l1("analysis", "", 6, &[]);
}

/// A virtio-blk root disk on hardware KVM: read, written, read-only disk refused, ext4 and
/// block-layer probes against the guest's own events (`tests/disks.rs`).
#[test]
fn disks_on_kvm_amd() {
    suite_in_l1("disks", "a_root_disk_is_read_and_written", 1, &[]);
}

/// `hvprobe bench io --qemu`: the bundled guest's disk benchmark in hvprobe and, with the
/// same kernel, initrd, image and vCPUs, in QEMU with KVM (Debian's, in the L1), each
/// phase printed with both and their ratio. The numbers are not checked (a benchmark, and
/// the lane's are TCG's); that both machines ran the workload to its end is.
#[test]
fn bench_io_runs_beside_qemu_on_kvm_amd() {
    let run = in_l1(
        "hvprobe bench io --qemu /usr/bin/qemu-system-x86_64 --size-mib 8 --randreads 200 --dir /tmp 2>&1",
        &[],
    );
    assert_eq!(run.code, Some(0), "{}", tail(&run));
    assert!(
        run.stdout.contains("qemu: the same guest in QEMU's microvm with KVM"),
        "{}",
        tail(&run)
    );
    for phase in ["read", "write", "randread"] {
        let row = run
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(phase))
            .unwrap_or_else(|| panic!("no {phase} row\n{}", tail(&run)));
        // phase, guest, unit, host, unit, ratio, qemu, unit, vs qemu, exits/request
        assert_eq!(row.split_whitespace().count(), 10, "{row}");
    }
}

#[test]
fn snapshots_and_restore_on_kvm_amd() {
    suite_in_l1("snapshot", "", 7, &[]);
}

/// The library API (sync handlers, the async stream) on code blobs and the bundled guest,
/// among them a #GP raised in a stepped copy: hardware delivers it through the guest's IDT
/// without stopping at its handler, which the step guard's IDT catches.
#[test]
fn library_api_on_kvm_amd() {
    suite_in_l1("probe_api", "", 7, &[]);
}

#[test]
fn boots_and_hardening_on_kvm_amd() {
    let binaries = [test_binary("boot"), test_binary("hardening"), test_binary("vcpu_panic")];
    let command = binaries
        .iter()
        .map(|b| format!("{} --test-threads=1 --color never || exit $?", b.display()))
        .collect::<Vec<_>>()
        .join("\n");
    let run = in_l1(&command, &[]);
    assert_eq!(run.code, Some(0), "{}", tail(&run));
}

/// The guest's boot-time int3 self-test (`int3_selftest`) goes through our #BP
/// re-injection at every boot with probes armed; an injected #BP lost to an interrupt
/// killed the boot with `invalid opcode` in 3 of 13 runs before it went back as pending.
#[test]
fn the_guests_int3_self_test_survives_every_boot_on_kvm_amd() {
    const BOOTS: usize = 8;
    let probes = std::env::temp_dir().join(format!("hvprobe-lane-{}.probes", std::process::id()));
    std::fs::write(&probes, "p:lane/getppid __x64_sys_getppid\n").unwrap();
    let command = format!(
        "for i in $(seq {BOOTS}); do cpus=$(( i % 2 + 1 )); \
         hvprobe run --cpus $cpus --probes {} --workload 'hvprobe-loop 3' > /tmp/boot.log 2>&1; rc=$?; \
         grep -E 'invalid opcode|int3_selftest|Kernel panic|BUG:|Oops' /tmp/boot.log && exit 1; \
         grep -q 'KVM backend: hardware KVM' /tmp/boot.log || {{ echo 'not the hardware backend'; exit 1; }}; \
         grep 'guest int3 re-injected' /tmp/boot.log; [ $rc = 0 ] || {{ tail -30 /tmp/boot.log; exit $rc; }}; done",
        probes.display()
    );
    let run = in_l1(&command, &[]);
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", tail(&run));
    let boots = run
        .stdout
        .lines()
        .filter(|l| l.contains("guest exited with status 0"))
        .count();
    assert_eq!(boots, BOOTS, "{}", tail(&run));
    assert!(
        run.stdout
            .lines()
            .all(|l| !l.contains("guest exited") || l.contains("re-injected")),
        "every boot re-injected the self-test's int3\n{}",
        tail(&run)
    );
}

/// Debian's unmodified `linux-image-cloud-amd64` (the L1's own bzImage) as the L2, with
/// the bundled initramfs, symbols from kallsyms in guest memory alone (its KASLR on): our
/// entry and return probes on `__x64_sys_getppid` count what that kernel's own kprobe
/// event counts.
/// The one-byte reads of the three child shells: each whole line of the kernel's own event
/// `grd` has the host's hit of `rd` (BTF arguments: `$arg*` and `file->f_pos`) with the
/// same values at the same file position.
fn btf_arguments_fetch_what_the_stock_kernels_own_event_fetches(out: &str, run: &Run) {
    use std::collections::{BTreeMap, BTreeSet};
    let hits = |guest: bool, event: &str| -> Vec<common::TraceLine> {
        out.lines()
            .filter(|l| l.starts_with("GUEST ") == guest)
            .filter_map(common::parse_trace_line)
            .filter(|l| l.event == event)
            .collect()
    };
    let pid = |task: &str| task.rsplit('-').next().unwrap_or_default().to_string();
    let guest = hits(true, "grd");
    let readers: BTreeSet<String> = guest
        .iter()
        .filter(|l| l.args.get("count").map(String::as_str) == Some("1"))
        .map(|l| pid(&l.task))
        .collect();
    assert!(readers.len() >= 3, "three shells read /proc/version\n{}", tail(run));
    let mut host: BTreeMap<(String, String), Vec<BTreeMap<String, String>>> = BTreeMap::new();
    for l in hits(false, "rd")
        .into_iter()
        .filter(|l| readers.contains(&pid(&l.task)))
    {
        if let Some(fpos) = l.args.get("fpos").cloned() {
            host.entry((pid(&l.task), fpos)).or_default().push(l.args);
        }
    }
    let whole: Vec<&common::TraceLine> = guest
        .iter()
        .filter(|l| readers.contains(&pid(&l.task)) && l.args.len() == 5)
        .collect();
    assert!(
        whole.len() >= 3 * 10,
        "{} whole guest lines\n{}",
        whole.len(),
        tail(run)
    );
    for line in whole {
        let key = (pid(&line.task), line.args["fpos"].clone());
        let at = host.get(&key).map(Vec::as_slice).unwrap_or_default();
        assert!(
            at.contains(&line.args),
            "the kernel's own event {:?} at {key:?}; the host's hits there: {at:?}\n{}",
            line.args,
            tail(run)
        );
    }
}

/// Debian's stock kernel with hvprobe's devices. Its virtio drivers, fuse, virtiofs and
/// overlay are modules, which `--modules` (the kernel's own tree) puts in the initrd for
/// the bundled init to load; built without `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`, it finds
/// the devices in the ACPI tables. The L1's root as `/` (--rootfs), a directory the guest
/// writes (--rwdir), an ext4 disk read and written, and our probe on `do_sys_openat2`
/// seeing the disk's file opened.
#[test]
fn a_stock_debian_kernel_runs_with_a_disk_and_shared_directories_on_kvm_amd() {
    let workload = "cat /etc/debian_version; mkdir -p /mnt; mount /dev/vda /mnt && cat /mnt/hello && \
                    echo from-the-guest > /mnt/new && umount /mnt; echo through-rwdir > /out/r; \
                    echo \"UNAME $(uname -r)\"; echo \"ACPI-DEVICES $(grep -c LNRO0005 /proc/iomem)\"";
    let command = format!(
        "d=$(mktemp -d) && mkdir $d/img $d/out && echo on-the-disk > $d/img/hello && \
         truncate -s 32M $d/disk.img && mkfs.ext4 -q -d $d/img $d/disk.img && \
         printf 'p:stock/open do_sys_openat2 path=+0(%%si):ustring\\n' > $d/probes || exit 1; \
         hvprobe run --kernel \"$HVPROBE_L1_KERNEL\" --modules \"$HVPROBE_L1_MODULES\" --symbols kallsyms \
           --probes $d/probes --rootfs / --rwdir /out=$d/out --disk $d/disk.img --workload '{workload}' 2>&1; \
         echo \"RC=$?\"; echo \"RWDIR $(cat $d/out/r)\"; echo \"DISK $(debugfs -R 'cat /new' $d/disk.img 2>/dev/null)\""
    );
    let run = in_l1(&command, &[]);
    let out = &run.stdout;
    assert!(out.contains("RC=0"), "{}", tail(&run));
    assert!(out.contains("KVM backend: hardware KVM"), "{}", tail(&run));
    assert!(
        out.lines()
            .any(|l| l.starts_with("UNAME ") && l.trim_end().ends_with("-cloud-amd64")),
        "not Debian's cloud kernel\n{}",
        tail(&run)
    );
    // The drivers came from the kernel's own tree.
    assert!(
        out.contains("modules for the devices, from ") && out.contains("virtio_mmio virtio_blk fuse virtiofs overlay"),
        "{}",
        tail(&run)
    );
    assert!(!out.contains("cannot load module"), "{}", tail(&run));
    // The kernel found the disk and both shares in the DSDT (it has no command-line devices).
    let acpi_devices: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("ACPI-DEVICES "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no ACPI-DEVICES line\n{}", tail(&run)));
    assert!(acpi_devices >= 3, "{acpi_devices} LNRO0005 regions\n{}", tail(&run));
    // --rootfs: the L1's own files; the disk read and, after the run, written; --rwdir.
    assert!(out.lines().any(|l| l.trim_end() == "on-the-disk"), "{}", tail(&run));
    assert!(out.contains("RWDIR through-rwdir"), "{}", tail(&run));
    assert!(out.contains("DISK from-the-guest"), "{}", tail(&run));
    // Our probe saw the disk's file opened.
    assert!(
        out.lines()
            .any(|l| l.contains(" open: (") && l.contains("path=\"/mnt/hello\"")),
        "no hit opening /mnt/hello\n{}",
        tail(&run)
    );
    if let Some(line) = out
        .lines()
        .find(|l| l.contains("WARNING: CPU:") || l.contains("BUG:") || l.contains("Oops"))
    {
        panic!("the stock kernel warned: {line}\n{}", tail(&run));
    }
}

#[test]
fn a_stock_debian_kernel_is_traced_with_symbols_from_its_memory() {
    const CALLS: usize = 30;
    let probes = std::env::temp_dir().join(format!("hvprobe-lane-stock-{}.probes", std::process::id()));
    std::fs::write(
        &probes,
        "p:stock/getppid __x64_sys_getppid di=%di comm=$comm\nr:stock/getppid_ret __x64_sys_getppid ret=$retval\n\
         p:stock/rd vfs_read $arg* fpos=file->f_pos\n",
    )
    .unwrap();
    // The kernel's own event on vfs_read, in registers: its 6.1 has no BTF arguments. The
    // file position through `pos` (`*pos` is a copy of `file->f_pos` when vfs_read starts)
    // checks `file->f_pos`, which the host resolves with this kernel's own BTF.
    let guest_event = "p:grd vfs_read file=%di:x64 buf=%si:x64 count=%dx:u64 pos=%cx:x64 fpos=+0(%cx):s64";
    let workload = format!(
        "T=/sys/kernel/tracing; [ -d $T/events ] || mount -t tracefs t $T; \
         echo \"p:gk __x64_sys_getppid\" > $T/kprobe_events; echo 1 > $T/events/kprobes/enable; \
         hvprobe-loop {CALLS}; echo 0 > $T/events/kprobes/enable; \
         while read l; do echo \"PROFILE $l\"; done < $T/kprobe_profile; echo \"UNAME $(uname -r)\"; \
         echo \"{guest_event}\" >> $T/kprobe_events; echo 1 > $T/events/kprobes/grd/enable; \
         for i in 1 2 3; do sh -c \"read -r l < /proc/version\"; done; echo 0 > $T/events/kprobes/grd/enable; \
         busybox grep \" grd: \" $T/trace | busybox sed \"s/^/GUEST /\""
    );
    let command = format!(
        "hvprobe run --kernel \"$HVPROBE_L1_KERNEL\" --symbols kallsyms --probes {} --workload '{}' 2>&1",
        probes.display(),
        workload
    );
    let run = in_l1(&command, &[]);
    let _ = std::fs::remove_file(&probes);
    let out = &run.stdout;
    assert_eq!(run.code, Some(0), "{}", tail(&run));
    assert!(out.contains("KVM backend: hardware KVM"), "{}", tail(&run));
    assert!(out.contains("loaded as bzImage"), "{}", tail(&run));
    assert!(
        out.lines()
            .any(|l| l.starts_with("UNAME ") && l.trim_end().ends_with("-cloud-amd64")),
        "not Debian's cloud kernel\n{}",
        tail(&run)
    );
    assert!(out.contains("symbols from guest kallsyms"), "{}", tail(&run));
    let profile = out
        .lines()
        .find_map(|l| l.strip_prefix("PROFILE "))
        .unwrap_or_else(|| panic!("no kprobe_profile line\n{}", tail(&run)));
    let fields: Vec<&str> = profile.split_whitespace().collect();
    assert_eq!(
        fields[..3],
        ["gk", &CALLS.to_string(), "0"],
        "the kernel's own count\n{}",
        tail(&run)
    );
    let ours = |event: &str| {
        out.lines()
            .filter(|l| l.trim_start().starts_with("hvprobe-loop-") && l.contains(&format!(" {event}: (")))
            .count()
    };
    assert_eq!(ours("getppid"), CALLS, "entry hits\n{}", tail(&run));
    assert_eq!(ours("getppid_ret"), CALLS, "returns\n{}", tail(&run));
    assert!(
        out.contains("the guest kernel's BTF: "),
        "no BTF read from its memory\n{}",
        tail(&run)
    );
    btf_arguments_fetch_what_the_stock_kernels_own_event_fetches(out, &run);
    let boot = number_after(out, "boot to /init").unwrap_or_else(|| panic!("no boot time\n{}", tail(&run)));
    eprintln!("the stock Debian kernel reached /init after {boot} s in the lane");
    // The kernel's W+X check (CONFIG_DEBUG_WX) runs before /init, after the out-of-line
    // area was mapped (symbols from kallsyms: the engine is built while the kernel boots).
    // It found the area when it was one 2 MiB W+X page; now it must pass, and no warning at
    // all may appear. (The kernel's own `Speculative Return Stack Overflow: WARNING:` about
    // the CPU model is not a WARN splat.)
    assert!(
        out.contains("Checked W+X mappings: passed"),
        "the kernel's W+X check did not pass\n{}",
        tail(&run)
    );
    if let Some(line) = out
        .lines()
        .find(|l| l.contains("WARNING: CPU:") || l.contains("BUG:") || l.contains("Oops"))
    {
        panic!("the stock kernel warned: {line}\n{}", tail(&run));
    }
}
