//! A spec file with several mistakes reports all of them at once, each with its line, and
//! arms nothing: syntax errors before the guest runs, placement refusals (unknown symbol,
//! not an instruction boundary, blacklisted) once its kernel is known.

use crate::common;

use std::time::Duration;

use common::{restore_with, snapshot};

const TIMEOUT: Duration = Duration::from_secs(300);

fn spec_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("hvprobe-refusals-{}-{name}.probes", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

/// Line 4 names line 1's event with another field: one event's probes record the same
/// fields (Linux 5.7's multi-probe events append only those).
#[test]
fn every_syntax_error_is_reported_before_the_guest_runs() {
    let dir = snapshot(1);
    let file = spec_file(
        "syntax",
        "p:a/ok vfs_read\np:a/z\nq vfs_read\np:a/ok vfs_write fd=%di\n",
    );
    let run = restore_with(&dir, 1, "echo RAN", &["--probes", file.to_str().unwrap()], TIMEOUT);
    let _ = std::fs::remove_file(&file);
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(run.stderr.contains("3 problems in"), "{}", run.tail());
    for line in [2, 3, 4] {
        assert!(
            run.stderr.contains(&format!("{}:{line}:", file.display())),
            "line {line}\n{}",
            run.tail()
        );
    }
    assert!(!run.console_has_line("RAN"), "the guest never ran the workload");
}

#[test]
fn every_placement_refusal_is_reported_and_nothing_is_armed() {
    let dir = snapshot(1);
    let file = spec_file(
        "placement",
        "p:a/ok vfs_read\np:a/typo vfs_raed\np:a/split vfs_read+0x1\np:a/black do_user_addr_fault\n",
    );
    let run = restore_with(&dir, 1, "echo RAN", &["--probes", file.to_str().unwrap()], TIMEOUT);
    let _ = std::fs::remove_file(&file);
    assert_eq!(run.code, Some(1), "{}", run.tail());
    for (line, reason) in [
        (2, "unknown symbol \"vfs_raed\""),
        (3, "not an instruction boundary"),
        (4, "blacklisted"),
    ] {
        let expected = format!("{}:{line}:", file.display());
        let found = run.stderr.lines().find(|l| l.contains(&expected));
        assert!(
            found.is_some_and(|l| l.contains(reason)),
            "line {line}: {reason}\n{}",
            run.tail()
        );
    }
    assert!(!run.stderr.contains("armed"), "nothing armed\n{}", run.tail());
}

#[test]
fn a_wildcard_arms_every_probeable_match_and_counts_the_skipped_ones() {
    let dir = snapshot(1);
    let file = spec_file(
        "wildcard",
        "p:vfs/ vfs_*\nr:vfsr/ vfs_read*\np:one/getppid __x64_sys_getppid\n",
    );
    let run = restore_with(
        &dir,
        1,
        "read -r l < /proc/version; echo RAN",
        &["--probes", file.to_str().unwrap()],
        TIMEOUT,
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(run.console_has_line("RAN"), "{}", run.tail());
    let summary = |line: usize| -> (usize, usize, usize) {
        let text = run
            .stderr
            .lines()
            .find(|l| l.contains(&format!("{}:{line}:", file.display())) && l.contains("functions match"))
            .unwrap_or_else(|| panic!("no summary for line {line}\n{}", run.tail()));
        let numbers: Vec<usize> = text
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        // "...:LINE: PATTERN: M functions match, A to arm, S skipped (...)"
        let at = numbers.iter().position(|n| *n == line).unwrap() + 1;
        (numbers[at], numbers[at + 1], numbers[at + 2])
    };
    let (matched, to_arm, skipped) = summary(1);
    assert!(matched > 20, "vfs_* matches many functions: {matched}");
    assert_eq!(to_arm + skipped, matched);
    let listed_k = run.stderr.lines().filter(|l| l.contains("  k  vfs_")).count();
    assert_eq!(listed_k, to_arm, "every armed one is listed\n{}", run.tail());
    let (r_matched, r_to_arm, _) = summary(2);
    assert!(r_matched >= 1 && r_to_arm >= 1, "{}", run.tail());
    assert!(run.stderr.contains("  k  __x64_sys_getppid+0x0"), "{}", run.tail());
    // The read of /proc/version went through vfs_read: its probe counted it.
    let vfs_read = run
        .stderr
        .lines()
        .find(|l| l.contains("  k  vfs_read+0x0"))
        .unwrap_or_else(|| panic!("vfs_read listed\n{}", run.tail()));
    assert!(!vfs_read.contains("hits=0 "), "{vfs_read}");
}

#[test]
fn a_spec_file_is_checked_against_the_symbol_file_before_the_guest_boots() {
    common::require_kvm();
    let file = spec_file(
        "before-boot",
        "p:a/ok vfs_read\np:a/typo vfs_raed\np:a/far vfs_read+0x100000\nq vfs_read\np:b/ nothing_matches_this_*\n\
         p:c/ {vfs_read,no_such_function}\n",
    );
    // A cold boot: nothing may boot, so this is quick (a boot takes tens of seconds).
    let started = std::time::Instant::now();
    let run = common::hvprobe(
        &["run", "--probes", file.to_str().unwrap(), "--workload", "echo RAN"],
        TIMEOUT,
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(run.stderr.contains("4 problems in"), "{}", run.tail());
    for (line, reason) in [
        (2, "unknown symbol \"vfs_raed\""),
        (3, "is outside vfs_read"),
        (4, "unknown probe type"),
        (5, "matches no kernel function"),
    ] {
        let expected = format!("{}:{line}:", file.display());
        assert!(
            run.stderr.lines().any(|l| l.contains(&expected) && l.contains(reason)),
            "line {line}: {reason}\n{}",
            run.tail()
        );
    }
    // (A list matches whatever of it exists: line 6 is fine.)
    assert!(
        run.stdout.is_empty(),
        "no guest console: nothing booted\n{}",
        run.tail()
    );
    assert!(!run.stderr.contains("control socket"), "no VM was made\n{}", run.tail());
    eprintln!("refused in {:.1} s", started.elapsed().as_secs_f64());
}

/// Watches this host cannot serve, or that no CPU could, are refused before the boot: a
/// length x86's debug registers do not have, an execution watch longer than a byte, a
/// read-only watch, and — on kvm_pvm, whose emulator checks no data breakpoints — any data
/// watch (on hardware KVM the lane's watch tests show them firing).
#[test]
fn watches_no_debug_register_can_serve_are_refused_before_boot() {
    for (text, message) in [
        ("w:a/len jiffies/3:w\n", "bad watch length `3`: 1, 2, 4 or 8 bytes"),
        ("w:a/x vfs_read/8:x\n", "an execution watch (`x`) covers one byte"),
        ("w:a/r jiffies/8:r\n", "cannot watch reads alone"),
    ] {
        let file = spec_file("watch", text);
        common::assert_refused_before_boot(&["--probes", file.to_str().unwrap()], message);
        let _ = std::fs::remove_file(&file);
    }
    let file = spec_file("data-watch", "w:a/jiffies jiffies/8:w\n");
    if hvprobe::vmm::Backend::detect().data_breakpoints_fire() {
        let run = common::hvprobe(
            &["run", "--workload", "true", "--probes", file.to_str().unwrap()],
            TIMEOUT,
        );
        assert!(!run.stderr.contains("data watch would never fire"), "{}", run.tail());
    } else {
        common::assert_refused_before_boot(
            &["--probes", file.to_str().unwrap()],
            "a/jiffies: kvm_pvm emulates guest kernel code, and its emulator checks only execution breakpoints",
        );
    }
    let _ = std::fs::remove_file(&file);
}

/// A source target that DWARF cannot place, or a variable it cannot read there, is refused
/// before the boot with what perf probe would say: a line with no code of its own (with the
/// nearest lines that have some), a variable not visible there (with those that are), one
/// whose value at the site is only described at the function's entry, a field its type
/// does not have, a function no file defines, `$argN` at a line.
#[test]
fn source_targets_dwarf_cannot_place_or_read_are_refused_before_boot() {
    for (text, message) in [
        (
            "p vfs_read:10\n",
            "has no code of its own (nearest lines with code: vfs_read:8, vfs_read:11)",
        ),
        ("p vfs_read:23 nosuch\n", "no variable `nosuch` is visible at vfs_read+0x80 (visible there: "),
        (
            "p vfs_read:23 buf\n",
            "`buf` at vfs_read+0x80 cannot be read: only its value at the function's entry is described (DW_OP_entry_value)",
        ),
        (
            "p vfs_read@fs/read_write.c ret\n",
            "`ret` at vfs_read+0x0 cannot be read: it is optimized out at this address",
        ),
        ("p vfs_read:23 file->f_nosuch\n", "`file`: struct file has no member `f_nosuch`"),
        ("p vfs_read:23 ret->x\n", "`ret`: is not a pointer (ssize_t)"),
        ("p vfs_read@fs/nosuch.c\n", "no function `vfs_read` in a file ending `fs/nosuch.c`"),
        ("p no_such_function_here:3\n", "no function `no_such_function_here` in the kernel's DWARF"),
        ("p fs/read_write.c:1\n", "no line 1 with code in a file ending `fs/read_write.c`"),
        // A symbol target on an inlined function says how to reach it.
        (
            "p fsnotify_access\n",
            "unknown symbol \"fsnotify_access\" (the kernel's DWARF has it inlined: probe its \
             instances with fsnotify_access@include/linux/fsnotify.h)",
        ),
    ] {
        let file = spec_file("source", text);
        common::assert_refused_before_boot(&["--probes", file.to_str().unwrap()], message);
        let _ = std::fs::remove_file(&file);
    }
}
