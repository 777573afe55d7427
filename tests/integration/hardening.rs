//! A probe never hurts the guest: return probes that share a stack slot (a tail call),
//! calls that never return, on the bundled guest restored from a cached snapshot.

use crate::common;

use std::time::Duration;

use common::{probe_file, restore_with, snapshot, Run};

const TIMEOUT: Duration = Duration::from_secs(300);

/// `(event, ret)` of every hit line with a `ret=` on the console, in order (ftrace's
/// layout names the event alone: `cat-30 [000] 1.23: krd: (ksys_read <- ...) ret=0x1`).
fn returns(run: &Run) -> Vec<(String, String)> {
    run.stdout
        .lines()
        .filter_map(|l| {
            let head = &l[..l.find(": (")?];
            let event = &head[head.rfind(' ')? + 1..];
            let ret = l.split_whitespace().find_map(|w| w.strip_prefix("ret="))?;
            Some((event.to_string(), ret.to_string()))
        })
        .collect()
}

fn assert_guest_unhurt(run: &Run) {
    common::assert_guest_healthy(run, &["int3"]);
}

/// The two return probes on a function and the one it tail-calls: `__x64_sys_read` ends
/// in `jmp ksys_read` (checked: a compiler may inline it instead), so both want the same
/// stack slot.
const TAIL_CALL_PROBES: &str = "r:a/rd __x64_sys_read ret=$retval\nr:a/krd ksys_read ret=$retval\n";

/// Reads of 1 byte and of 0 (`read` takes a byte per system call), and one of a directory
/// that fails with -EISDIR.
const READS: &str = "echo x > /tmp/one; for i in 1 2 3 4 5; do read -r l < /tmp/one; done; read -r l < /";

const EISDIR: &str = "0xffffffffffffffeb";

fn assert_sys_read_tail_calls_ksys_read() {
    let (sys_read, symbols) = common::GuestFunction::bundled("__x64_sys_read");
    let ksys_read = symbols.lookup("ksys_read").expect("ksys_read");
    assert!(
        sys_read.find_rip_relative(&[0xe9], ksys_read.addr.0).is_some(),
        "__x64_sys_read does not end in `jmp ksys_read` in this kernel: {:02x?}",
        sys_read.code
    );
}

#[test]
fn return_probes_on_a_function_and_the_one_it_tail_calls_both_fire_with_one_return_value() {
    assert_sys_read_tail_calls_ksys_read();
    let dir = snapshot(1);
    let probes = probe_file("hardening-tailcall", TAIL_CALL_PROBES);
    let run = restore_with(
        &dir,
        1,
        &format!("cat /proc/version; {READS}; true"),
        &["--probes", probes.to_str().unwrap()],
        TIMEOUT,
    );
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(run.stdout.contains("Linux version"), "{}", run.tail());
    assert_guest_unhurt(&run);
    let hits = returns(&run);
    // Every read fires both, the tail-called one first, with one return value.
    let mut reads = 0;
    for (i, (event, ret)) in hits.iter().enumerate() {
        if event != "rd" {
            continue;
        }
        reads += 1;
        assert!(i > 0, "{hits:?}");
        assert_eq!((hits[i - 1].0.as_str(), &hits[i - 1].1), ("krd", ret), "{hits:?}");
    }
    assert!(reads >= 11, "{hits:?}\n{}", run.tail());
    assert!(
        hits.iter().any(|(e, ret)| e == "rd" && ret == EISDIR),
        "the failed read's -EISDIR is among them: {hits:?}"
    );
}

#[test]
fn the_guests_own_return_probe_between_a_tail_call_and_ours_leaves_every_return_intact() {
    // The guest's kretprobe on `ksys_read` swaps our trampoline (put there by the return
    // probe on `__x64_sys_read`, which tail-calls it) for its own, then ours on `ksys_read`
    // swaps that for ours: the return goes through ours, the guest's, ours again. It
    // stopped the VM ("a return through the trampoline with no call on record").
    assert_sys_read_tail_calls_ksys_read();
    for optimize in ["--optimize=off", "--optimize=on"] {
        let dir = snapshot(1);
        let probes = probe_file("hardening-guest-rethook", TAIL_CALL_PROBES);
        let run = restore_with(
            &dir,
            1,
            &format!(
                "T=/sys/kernel/tracing; echo 'r:gr ksys_read' > $T/kprobe_events; \
                 echo 1 > $T/events/kprobes/gr/enable; {READS}; \
                 echo 0 > $T/events/kprobes/gr/enable; \
                 while read -r e h m; do echo \"PROFILE $e $h $m\"; done < $T/kprobe_profile; \
                 echo > $T/kprobe_events"
            ),
            &["--probes", probes.to_str().unwrap(), optimize],
            TIMEOUT,
        );
        let _ = std::fs::remove_file(&probes);
        assert_eq!(run.code, Some(0), "{optimize}\n{}", run.tail());
        assert_guest_unhurt(&run);
        let guest: usize = run
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("PROFILE gr "))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no profile of the guest's probe\n{}", run.tail()));
        assert!(guest >= 11, "the guest's own return probe fired on each read: {guest}");
        let hits = returns(&run);
        let reads = hits.iter().filter(|(e, _)| e == "rd").count();
        assert!(reads >= 11, "{optimize}: every read returned through ours: {hits:?}");
        for (i, (event, ret)) in hits.iter().enumerate() {
            if event == "rd" {
                assert_eq!((hits[i - 1].0.as_str(), &hits[i - 1].1), ("krd", ret), "{hits:?}");
            }
        }
        assert!(
            hits.iter().any(|(e, ret)| e == "rd" && ret == EISDIR),
            "{optimize}: the failed read's -EISDIR is among them: {hits:?}"
        );
    }
}

#[test]
fn calls_of_exiting_tasks_never_use_up_maxactive() {
    let dir = snapshot(1);
    // `do_group_exit` never returns: each exiting process leaves its call behind.
    let probes = probe_file("hardening-exits", "r3:x/ge do_group_exit\np:x/pe do_group_exit\n");
    let run = restore_with(
        &dir,
        1,
        "for i in 1 2 3 4 5 6 7; do /bin/true; done; echo done",
        &["--probes", probes.to_str().unwrap()],
        TIMEOUT,
    );
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert_guest_unhurt(&run);
    // The listing: `ADDRESS  k|r  do_group_exit+0x0  hits=N nmissed=M`.
    let listed = |kind: &str| -> (u64, u64) {
        let line = run
            .stderr
            .lines()
            .find(|l| l.contains("do_group_exit+0x0") && l.contains(kind))
            .unwrap_or_else(|| panic!("no {kind:?} listing line\n{}", run.tail()));
        let field = |name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {line:?}"))
        };
        (field("hits="), field("nmissed="))
    };
    let (entries, _) = listed("  k  ");
    assert!(entries >= 7, "seven processes exited: {entries}\n{}", run.tail());
    let (returned, missed) = listed("  r  ");
    assert_eq!(
        (returned, missed),
        (0, 0),
        "never returns, and never runs out of maxactive"
    );
}

#[test]
fn a_guest_process_keeps_its_vector_registers_while_busybox_runs_beside_it() {
    // On kvm_pvm the guest kernel runs with `noxsave` (its emulator cannot run XSAVE) and
    // switches only x87/SSE state, while AVX instructions execute in user mode: where
    // user mode's CPUID said AVX, glibc's string functions in busybox overwrote
    // (VZEROUPPER) the YMM upper halves of whatever process shared the CPU; a new
    // process's TLS copy came out corrupt now and then (a `general protection` in
    // busybox in a storm run, `dmesg | grep` segfaults before). What user mode's CPUID
    // says depends on the host (on the Intel host with CPUID faulting of 2026-11-28 it
    // said no AVX while AVX executed), so hvprobe-vecstate checks the widest register an
    // instruction reaches here: YMM where AVX executes, XMM otherwise.
    let host_has_avx = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.split_whitespace().any(|w| w == "avx"))
        .unwrap_or(false);
    let dir = snapshot(1);
    let run = restore_with(
        &dir,
        1,
        "echo \"noxsave=$(busybox grep -c noxsave /proc/cmdline) \
         tunables=$(busybox env | busybox grep -c '^GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX,')\"; \
         hvprobe-vecstate 15 & p=$!; \
         for i in 1 2 3 4 5 6; do busybox grep -c Linux /proc/version; \
         busybox sed -n 1p /proc/version > /dev/null; done; wait $p; echo vecstate-status=$?",
        &[],
        TIMEOUT,
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert_guest_unhurt(&run);
    let line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("hvprobe-vecstate "))
        .unwrap_or_else(|| panic!("no line from hvprobe-vecstate\n{}", run.tail()));
    // The fix: under a `noxsave` kernel the init keeps glibc (busybox) off its AVX code,
    // whatever the guest's user-mode CPUID says.
    let fix = run
        .stdout
        .lines()
        .find(|l| l.starts_with("noxsave="))
        .unwrap_or_else(|| panic!("no noxsave= line\n{}", run.tail()));
    assert!(
        fix == "noxsave=0 tunables=0" || fix == "noxsave=1 tunables=1",
        "a noxsave kernel's processes must get glibc's AVX code turned off (and only they): {fix}"
    );
    // AVX executes in the guest's user mode wherever the host has it (kvm_pvm: whatever
    // user mode's CPUID says; kvm_amd: the guest kernel enables XSAVE): the check must be
    // on YMM there. Whether busybox's glibc would take its AVX code is CPUID's word
    // (`cpuid-avx=`), so it shows through only where that says 1.
    let value = |name: &str| -> &str {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    let field = |name: &str| -> u64 {
        value(name)
            .parse()
            .unwrap_or_else(|_| panic!("{name} is not a number in {line:?}"))
    };
    assert!(
        !host_has_avx || value("regs=") == "ymm",
        "the host has AVX but no AVX instruction executes in the guest's user mode: {line}"
    );
    assert!(field("checks=") > 1000, "hvprobe-vecstate hardly ran: {line}");
    assert_eq!(
        field("clobbered="),
        0,
        "another process's vector state showed through: {line}\n{}",
        run.tail()
    );
    assert!(run.stdout.contains("vecstate-status=0"), "{}", run.tail());
    assert_eq!(
        run.stdout.lines().filter(|l| l.trim() == "1").count(),
        6,
        "{}",
        run.tail()
    );
}

/// A guest that floods its console can be silenced: `--no-console` keeps the guest's
/// output off stdout while the probes' hits still come.
#[test]
fn no_console_keeps_the_guests_output_off_stdout_and_prints_the_hits() {
    let dir = snapshot(1);
    let probes = probe_file("hardening-quiet", "p:q/gp __x64_sys_getppid\n");
    let run = restore_with(
        &dir,
        1,
        "echo GUEST-CONSOLE-LINE; hvprobe-loop 3",
        &["--probes", probes.to_str().unwrap(), "--no-console"],
        TIMEOUT,
    );
    let _ = std::fs::remove_file(&probes);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(!run.stdout.contains("GUEST-CONSOLE-LINE"), "{}", run.tail());
    let hits = run.stdout.lines().filter(|l| l.contains(" gp: (")).count();
    assert!(hits >= 3, "{hits} hits\n{}", run.tail());
}
