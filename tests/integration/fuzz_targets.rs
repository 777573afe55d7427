//! Every fuzz target in `fuzz/Cargo.toml` runs in CI's bounded fuzz step (`.ci/run`) from a
//! seed committed to git: libFuzzer refuses a corpus directory that does not exist, and
//! `fuzz/.gitignore` keeps everything but `corpus/<target>/seed-*` out of a clean clone,
//! so a target whose seeds live only in a working tree fails CI after an hour, not here.

use crate::common;

use std::collections::BTreeSet;
use std::process::Command;

use common::repo;

/// The `[[bin]]` names of `fuzz/Cargo.toml`.
fn fuzz_targets() -> BTreeSet<String> {
    let manifest = std::fs::read_to_string(repo().join("fuzz/Cargo.toml")).expect("fuzz/Cargo.toml");
    let mut targets = BTreeSet::new();
    let mut in_bin = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
        } else if let Some(value) = line.strip_prefix("name").filter(|_| in_bin) {
            let name = value.trim_start().trim_start_matches('=').trim().trim_matches('"');
            targets.insert(name.to_string());
        }
    }
    assert!(!targets.is_empty(), "fuzz/Cargo.toml names no [[bin]] target");
    targets
}

/// The targets `.ci/run`'s fuzz step runs: its `fuzz_targets=(…)` list, which its
/// `for target in "${fuzz_targets[@]}"; do` loop goes through.
fn ci_targets() -> BTreeSet<String> {
    let script = std::fs::read_to_string(repo().join(".ci/run")).expect(".ci/run");
    assert!(
        script
            .lines()
            .any(|l| l.trim() == r#"for target in "${fuzz_targets[@]}"; do"#),
        ".ci/run's fuzz step does not loop over fuzz_targets"
    );
    let line = script
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("fuzz_targets=(") && l.ends_with(')'))
        .expect(".ci/run has no `fuzz_targets=(…)` line (the bounded fuzz step)");
    line["fuzz_targets=(".len()..line.len() - 1]
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[test]
fn ci_fuzzes_every_target() {
    let (targets, ci) = (fuzz_targets(), ci_targets());
    assert_eq!(
        targets, ci,
        "fuzz/Cargo.toml's targets (left) and those .ci/run fuzzes (right) differ"
    );
}

#[test]
fn every_fuzz_target_has_a_seed_committed_to_git() {
    let out = Command::new("git")
        .args(["ls-files", "fuzz/corpus"])
        .current_dir(repo())
        .output()
        .expect("run git: this test reads which seeds are committed");
    assert!(
        out.status.success(),
        "git ls-files fuzz/corpus: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|path| {
            let mut parts = path.strip_prefix("fuzz/corpus/")?.split('/');
            let (target, file) = (parts.next()?, parts.next()?);
            file.starts_with("seed-").then(|| target.to_string())
        })
        .collect();
    let missing: Vec<_> = fuzz_targets().into_iter().filter(|t| !committed.contains(t)).collect();
    assert!(
        missing.is_empty(),
        "fuzz targets with no committed fuzz/corpus/<target>/seed-* (a clean clone has no corpus \
         directory for them and CI's fuzz step fails): {missing:?}"
    );
}
