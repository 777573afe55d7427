//! Snapshots of the bundled guest: create once (cached), restore many times.
//!
//! A snapshot costs one boot (about a minute on kvm_pvm); it is cached under
//! `$HVPROBE_CACHE` (or `~/.cache/hvprobe`)`/snapshots/<guest key>-<N>cpu-v<format>`, so the
//! tests of one run, and later runs with the same guest, pay it once. Creation is
//! serialised with a `flock` and made visible by a rename, so parallel tests never see a
//! half-written snapshot.

use crate::common;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::{hvprobe, snapshot, Run};

const BOOT_TIMEOUT: Duration = Duration::from_secs(420);
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
const QUICK: Duration = Duration::from_secs(30);

fn restore(dir: &Path, cpus: u8, workload: &str) -> Run {
    common::restore_with(dir, cpus, workload, &[], RESTORE_TIMEOUT)
}

fn assert_clean(run: &Run) {
    for bad in ["Kernel panic", "BUG:", "Oops", "WARNING:", "panicked"] {
        assert!(
            !run.stdout.contains(bad) && !run.stderr.contains(bad),
            "output shows {bad:?}\n{}",
            run.tail()
        );
    }
}

fn linux_version_line(run: &Run) -> String {
    run.stdout
        .lines()
        .find(|l| l.starts_with("Linux version"))
        .unwrap_or_else(|| panic!("no /proc/version line\n{}", run.tail()))
        .trim_end_matches('\r')
        .to_string()
}

const WORKLOAD: &str = "cat /proc/version; echo marker; exit 3";

#[test]
fn a_restored_guest_runs_the_workload_like_a_fresh_boot() {
    let dir = snapshot(1);
    let fresh = std::thread::spawn(|| hvprobe(&["run", "--workload", WORKLOAD], BOOT_TIMEOUT));
    let restored = restore(&dir, 1, WORKLOAD);
    let fresh = fresh.join().unwrap();
    assert_eq!(restored.code, Some(3), "restored workload status\n{}", restored.tail());
    assert_eq!(fresh.code, Some(3), "fresh workload status\n{}", fresh.tail());
    assert!(restored.console_has_line("marker"), "{}", restored.tail());
    assert_eq!(linux_version_line(&restored), linux_version_line(&fresh));
    assert!(
        restored.stderr.contains("guest exited with status 3"),
        "{}",
        restored.tail()
    );
    assert_clean(&restored);
}

#[test]
fn a_restored_guests_clock_goes_on_from_the_snapshot_not_from_the_host() {
    let dir = snapshot(1);
    let age = SystemTime::now()
        .duration_since(std::fs::metadata(dir.join("state")).unwrap().modified().unwrap())
        .unwrap();
    let run = restore(
        &dir,
        1,
        "read c < /sys/devices/system/clocksource/clocksource0/current_clocksource; echo CLOCK=$c; \
         read u i < /proc/uptime; echo UPTIME=${u%.*}",
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let value = |key: &str| -> String {
        run.stdout
            .lines()
            .find_map(|l| l.trim_end_matches('\r').strip_prefix(key).map(str::to_string))
            .unwrap_or_else(|| panic!("no {key}\n{}", run.tail()))
    };
    // kvm_pvm runs guests on the host's TSC; only kvm-clock is restored to where it was.
    assert_eq!(value("CLOCK="), "kvm-clock");
    let uptime: u64 = value("UPTIME=").parse().unwrap();
    // The guest booted in well under 10 minutes; a clock that jumped by the snapshot's
    // age shows more whenever the snapshot is older than that.
    assert!(
        uptime < 600 || age.as_secs() < 600,
        "the guest's clock jumped: uptime {uptime} s, snapshot {} s old",
        age.as_secs()
    );
}

/// (modification time, content hash) of a file.
fn fingerprint(path: &Path) -> (SystemTime, u64) {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(&std::fs::read(path).unwrap());
    (std::fs::metadata(path).unwrap().modified().unwrap(), h.finish())
}

#[test]
fn two_restores_run_in_parallel_and_leave_the_snapshot_unchanged() {
    let dir = snapshot(1);
    let before = (fingerprint(&dir.join("memory")), fingerprint(&dir.join("state")));
    // Both write guest memory (a file in the initramfs, page cache, their stacks).
    let d = dir.clone();
    let a = std::thread::spawn(move || restore(&d, 1, "echo run-a > /tmp/x; cat /tmp/x; exit 5"));
    let b = restore(&dir, 1, "echo run-b > /tmp/x; cat /tmp/x; exit 6");
    let a = a.join().unwrap();
    assert_eq!(a.code, Some(5), "{}", a.tail());
    assert_eq!(b.code, Some(6), "{}", b.tail());
    assert!(
        a.console_has_line("run-a") && !a.stdout.contains("run-b"),
        "{}",
        a.tail()
    );
    assert!(
        b.console_has_line("run-b") && !b.stdout.contains("run-a"),
        "{}",
        b.tail()
    );
    assert_clean(&a);
    assert_clean(&b);
    let after = (fingerprint(&dir.join("memory")), fingerprint(&dir.join("state")));
    assert_eq!(before, after, "a restore modified the snapshot files");
}

/// User time of cpu0 and cpu1 from `/proc/stat` lines printed after `marker`.
fn user_ticks(run: &Run, marker: &str) -> Vec<u64> {
    let mut lines = run.stdout.lines().skip_while(|l| l.trim_end() != marker).skip(1);
    (0..2)
        .map(|cpu| {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("no cpu{cpu} line after {marker}\n{}", run.tail()));
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(fields[0], format!("cpu{cpu}"), "{}", run.tail());
            fields[1].parse().unwrap()
        })
        .collect()
}

#[test]
fn a_two_vcpu_snapshot_restores_with_two_cpus() {
    let dir = snapshot(2);
    let run = restore(&dir, 2, "nproc; exit 4");
    assert_eq!(run.code, Some(4), "{}", run.tail());
    assert!(run.console_has_line("2"), "nproc did not print 2\n{}", run.tail());
    assert_clean(&run);
}

/// Whether the guest's kvm-clock was flagged TSC-stable at the end of a restored run
/// (KVM sets the flag while its master clock is on: every vCPU's TSC of one generation).
fn kvm_clock_stable_after_restore(cpus: u8) -> bool {
    let dir = snapshot(cpus);
    let probes = std::env::temp_dir().join(format!("hvprobe-snapshot-clock-{}-{cpus}.probes", std::process::id()));
    std::fs::write(&probes, "p:t/getppid __x64_sys_getppid\n").unwrap();
    let run = common::restore_with(
        &dir,
        cpus,
        "hvprobe-loop 2",
        &["--probes", probes.to_str().unwrap()],
        RESTORE_TIMEOUT,
    );
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let end = run
        .stderr
        .lines()
        .find(|l| l.contains("guest trace clock at the end"))
        .unwrap_or_else(|| panic!("no clock summary\n{}", run.tail()));
    end.contains(" kHz, stable)")
}

/// A 2-vCPU guest restored vCPU by vCPU lost KVM's master clock (KVM took each vCPU's
/// creation for a TSC write, after the earlier vCPU's restored TSC: a new TSC generation),
/// so its kvm-clock was not flagged stable where a 1-vCPU restore's (and a fresh boot's)
/// is. Where the host keeps no master clock at all (the lane's L1 unless its TSC is
/// trusted), neither is.
#[test]
fn a_restored_two_vcpu_guest_keeps_the_master_clock_a_one_vcpu_guest_has() {
    let one = kvm_clock_stable_after_restore(1);
    let two = kvm_clock_stable_after_restore(2);
    assert_eq!(two, one, "kvm-clock flagged stable: 2 vCPUs {two}, 1 vCPU {one}");
}

// The 252-byte workload message is longer than what Linux's 8250 driver reads per interrupt
// (the FIFO refills meanwhile): it hung until the UART kept reporting pending data.
#[test]
fn a_two_vcpu_snapshot_restores_with_both_cpus_running() {
    let dir = snapshot(2);
    // Shell builtins only around the spinners: every exec costs ~1.4 s emulated on kvm_pvm.
    let stat = "while read l; do case $l in cpu0*|cpu1*) echo $l;; esac; done < /proc/stat";
    let workload = format!(
        "nproc; echo BEFORE; {stat}; hvprobe-spin 3 >/dev/null & hvprobe-spin 3 >/dev/null & wait; \
         echo AFTER; {stat}; echo CONSOLE-END; sleep 2; exit 0"
    );
    let run = restore(&dir, 2, &workload);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    // The guest's end stops the VM at once, while its tty may still hold lines for the
    // serial port (under the lane's TCG the last /proc/stat line was cut): a marker, then
    // time for the port to drain.
    assert!(
        run.console_has_line("CONSOLE-END"),
        "the guest's console output was cut before its end\n{}",
        run.tail()
    );
    assert!(run.console_has_line("2"), "nproc did not print 2\n{}", run.tail());
    let before = user_ticks(&run, "BEFORE");
    let after = user_ticks(&run, "AFTER");
    for cpu in 0..2 {
        assert!(
            after[cpu] > before[cpu] + 50,
            "cpu{cpu} did not run the spinners (user ticks {} -> {})\n{}",
            before[cpu],
            after[cpu],
            run.tail()
        );
    }
    assert_clean(&run);
}

fn assert_refused(run: &Run, expected: &str) {
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(run.stderr.contains("hvprobe: error:"), "no error line\n{}", run.tail());
    assert!(
        run.stderr.contains(expected),
        "error does not say {expected:?}\n{}",
        run.tail()
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.tail());
    assert!(
        !run.stderr.contains("restored and first guest instruction"),
        "{}",
        run.tail()
    );
}

/// A copy of the snapshot's state file next to the real memory file (a symlink: restores
/// only read it).
fn copy_with_state(dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let copy = std::env::temp_dir().join(format!("hvprobe-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    std::fs::create_dir_all(&copy).unwrap();
    let mut state = std::fs::read(dir.join("state")).unwrap();
    edit(&mut state);
    std::fs::write(copy.join("state"), state).unwrap();
    std::os::unix::fs::symlink(dir.join("memory"), copy.join("memory")).unwrap();
    copy
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[test]
fn bad_snapshots_are_refused_before_anything_is_restored() {
    let dir = snapshot(1);
    let quick = |d: &Path, cpus: &str| {
        hvprobe(
            &[
                "run",
                "--snapshot",
                d.to_str().unwrap(),
                "--cpus",
                cpus,
                "--workload",
                "exit 0",
            ],
            QUICK,
        )
    };

    let version = copy_with_state(&dir, "version", |s| s[8] += 1);
    let current = hvprobe_vmm::snapshot::SNAPSHOT_FORMAT_VERSION;
    assert_refused(
        &quick(&version, "1"),
        &format!(
            "has snapshot format version {}; this hvprobe reads version {current}",
            current + 1
        ),
    );

    let truncated_state = copy_with_state(&dir, "short-state", |s| s.truncate(s.len() / 2));
    assert_refused(&quick(&truncated_state, "1"), "is truncated");

    // The CPU feature hash follows the 32-byte header and the backend byte; the checksum
    // is fixed up, so only the hash check can refuse it.
    let other_host = copy_with_state(&dir, "cpuid", |s| {
        s[33] ^= 0xff;
        let sum = fnv1a(&s[32..]);
        s[24..32].copy_from_slice(&sum.to_le_bytes());
    });
    assert_refused(&quick(&other_host, "1"), "other CPU features");

    let short_memory = copy_with_state(&dir, "short-memory", |_| {});
    std::fs::remove_file(short_memory.join("memory")).unwrap();
    let f = File::create(short_memory.join("memory")).unwrap();
    f.set_len(std::fs::metadata(dir.join("memory")).unwrap().len() / 2)
        .unwrap();
    assert_refused(&quick(&short_memory, "1"), "is truncated");

    assert_refused(&quick(&dir, "2"), "--cpus must match the snapshot");

    let missing = std::env::temp_dir().join("hvprobe-test-no-such-snapshot");
    assert_refused(&quick(&missing, "1"), "cannot read snapshot state");

    for d in [version, truncated_state, other_host, short_memory] {
        let _ = std::fs::remove_dir_all(d);
    }
}
