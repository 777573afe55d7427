//! A spec file with several mistakes reports all of them at once, each with its line, and
//! arms nothing: syntax errors before the guest runs, placement refusals (unknown symbol,
//! not an instruction boundary, blacklisted) once its kernel is known.

mod common;

use std::time::Duration;

use common::{restore_with, snapshot};

const TIMEOUT: Duration = Duration::from_secs(300);

fn spec_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("hvprobe-refusals-{}-{name}.probes", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn every_syntax_error_is_reported_before_the_guest_runs() {
    let dir = snapshot(1);
    let file = spec_file("syntax", "p:a/ok vfs_read\np:a/z\nq vfs_read\np:a/ok vfs_write\n");
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
