//! The set-up's builders (guest/cache.sh and the scripts that use it; `hvprobe
//! build-guest`) started several times at once, as `cargo test` starts suites side by
//! side on a fresh machine: each part is built once, every builder prints its result and
//! nothing else, and no reader sees half of a part.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::repo;

fn temp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn show(what: &str, out: &Output) -> String {
    format!(
        "{what}: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// On an empty cache the lane's QEMU is downloaded first. The tarball check before the
/// download printed `…: FAILED open or read` on stdout, which `guest/l1/build.sh` took for
/// QEMU's path and wrote into `lane.env` (a fresh machine's first lane test then failed
/// with `lane.env: line 1: FAILED: command not found`). Here the download fails (a `curl`
/// that cannot reach the network), so nothing is built: the scripts must fail with a
/// message on stderr, print nothing on stdout and leave no `lane.env`.
#[test]
fn a_lane_build_on_an_empty_cache_prints_nothing_but_its_result() {
    let cache = temp_dir("empty-cache");
    let bin = temp_dir("offline-bin");
    let curl = bin.join("curl");
    std::fs::write(&curl, "#!/bin/sh\necho 'curl: (6) offline for this test' >&2\nexit 6\n").unwrap();
    std::fs::set_permissions(&curl, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    for script in ["guest/l1/build-qemu.sh", "guest/l1/build.sh"] {
        let out = Command::new(repo().join(script))
            .env("HVPROBE_CACHE", &cache)
            .env("PATH", &path)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
        assert!(!out.status.success(), "{}", show(script, &out));
        assert!(
            out.stdout.is_empty(),
            "a failed build printed on stdout, where its caller reads a path\n{}",
            show(script, &out)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("offline for this test"),
            "{}",
            show(script, &out)
        );
    }
    assert!(
        !cache.join("l1/lane.env").exists(),
        "a failed lane build wrote lane.env"
    );
    let _ = std::fs::remove_dir_all(&cache);
    let _ = std::fs::remove_dir_all(&bin);
}

/// The script every builder follows (guest/cache.sh), with a builder that writes its part
/// slowly: four builders started together on an empty cache build it once, each prints
/// the part's path and nothing else, and a reader that polls the part without a lock
/// never sees it half-written.
#[test]
fn four_builders_at_once_on_an_empty_cache_build_once_and_no_reader_sees_half_a_part() {
    let cache = temp_dir("four-builders");
    let script = format!(
        r#"set -euo pipefail
. {cache_sh}
cache_stdout_is_the_result
part="$hvprobe_cache/part"
if [ ! -f "$part" ]; then
    cache_lock "$hvprobe_cache/.lock" 9 "the test part"
    if [ ! -f "$part" ]; then
        echo "built by $$" >> "$hvprobe_cache/builds"
        tmp=$(mktemp "$part.XXXXXX")
        for i in $(seq 40); do echo "line $i" >> "$tmp"; sleep 0.01; done
        echo END >> "$tmp"
        cache_publish "$tmp" "$part"
    fi
fi
echo "chatter that must not reach stdout"
cache_result "$part"
"#,
        cache_sh = repo().join("guest/cache.sh").display()
    );
    let part = cache.join("part");
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (part, stop) = (part.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut seen_whole, mut seen_half) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                if let Ok(text) = std::fs::read_to_string(&part) {
                    if text.ends_with("END\n") && text.lines().count() == 41 {
                        seen_whole += 1;
                    } else {
                        seen_half.push(text);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            (seen_whole, seen_half)
        })
    };
    let builders: Vec<_> = (0..4)
        .map(|_| {
            Command::new("bash")
                .arg("-c")
                .arg(&script)
                .env("HVPROBE_CACHE", &cache)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn bash")
        })
        .collect();
    let outputs: Vec<Output> = builders.into_iter().map(|b| b.wait_with_output().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    let (seen_whole, seen_half) = reader.join().unwrap();
    for out in &outputs {
        assert!(out.status.success(), "{}", show("a builder", out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("{}\n", part.display()),
            "{}",
            show("a builder", out)
        );
    }
    let builds = std::fs::read_to_string(cache.join("builds")).unwrap();
    assert_eq!(
        builds.lines().count(),
        1,
        "the part was built more than once:\n{builds}"
    );
    assert!(
        seen_half.is_empty(),
        "a reader saw the part half-written: {:?}",
        seen_half.first()
    );
    assert!(seen_whole > 0, "the reader never saw the part");
    let waited = outputs
        .iter()
        .filter(|o| String::from_utf8_lossy(&o.stderr).contains("waiting for another build of the test part"))
        .count();
    assert!(waited >= 1, "no builder waited for the lock: the four did not overlap");
    let _ = std::fs::remove_dir_all(&cache);
}

/// `hvprobe build-guest` four times at once (on a cold cache, the first test of a fresh
/// machine that needs the guest): one kernel build, the same guest directory for all four.
#[test]
fn four_guest_builds_at_once_build_the_guest_once() {
    let builders: Vec<_> = (0..4)
        .map(|_| {
            Command::new(common::hvprobe_bin())
                .arg("build-guest")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn hvprobe build-guest")
        })
        .collect();
    let outputs: Vec<Output> = builders.into_iter().map(|b| b.wait_with_output().unwrap()).collect();
    let dirs: Vec<String> = outputs
        .iter()
        .map(|out| {
            assert!(out.status.success(), "{}", show("hvprobe build-guest", out));
            let stdout = String::from_utf8_lossy(&out.stdout);
            stdout.lines().last().unwrap_or_default().trim().to_string()
        })
        .collect();
    assert!(dirs.iter().all(|d| d == &dirs[0]), "the builders disagree: {dirs:?}");
    let dir = Path::new(&dirs[0]);
    for file in [
        ".complete",
        "bzImage",
        "vmlinux",
        "System.map",
        "initramfs.cpio",
        "cmdline",
    ] {
        assert!(dir.join(file).is_file(), "{} has no {file}", dir.display());
    }
    let kernel_builds = outputs
        .iter()
        .filter(|o| String::from_utf8_lossy(&o.stderr).contains("building kernel"))
        .count();
    assert!(
        kernel_builds <= 1,
        "{kernel_builds} of the four builders built the kernel"
    );
}

/// `hvprobe snapshot create --cached` twice at once on a cache without snapshots (the
/// bundled guest's build linked in from the real cache): one boot, the other waits for it,
/// both print the same directory, which holds a whole snapshot; a third call finds it and
/// boots nothing.
#[test]
fn two_cached_snapshots_made_at_once_boot_once_and_print_one_directory() {
    common::require_kvm();
    common::bundled_guest_dir();
    let real = common::cache_dir();
    let cache = temp_dir("snapshot-cache");
    for entry in std::fs::read_dir(&real).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "snapshots" {
            std::os::unix::fs::symlink(entry.path(), cache.join(entry.file_name())).unwrap();
        }
    }
    let maker = || {
        Command::new(common::hvprobe_bin())
            .args(["snapshot", "create", "--cached", "--cpus", "1"])
            .env("HVPROBE_CACHE", &cache)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn hvprobe snapshot create --cached")
    };
    let makers = [maker(), maker()];
    let outputs: Vec<Output> = makers.into_iter().map(|m| m.wait_with_output().unwrap()).collect();
    let dir_of = |out: &Output| {
        assert!(
            out.status.success(),
            "{}",
            show("hvprobe snapshot create --cached", out)
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            stdout.lines().count(),
            1,
            "{}",
            show("stdout is the directory alone", out)
        );
        PathBuf::from(stdout.trim())
    };
    let dirs: Vec<PathBuf> = outputs.iter().map(dir_of).collect();
    assert_eq!(dirs[0], dirs[1]);
    assert!(dirs[0].starts_with(cache.join("snapshots")), "{}", dirs[0].display());
    for file in ["state", "memory"] {
        assert!(dirs[0].join(file).is_file(), "{} has no {file}", dirs[0].display());
    }
    let booted = |out: &Output| String::from_utf8_lossy(&out.stderr).contains("booting the guest");
    assert_eq!(
        outputs.iter().filter(|o| booted(o)).count(),
        1,
        "{}\n{}",
        show("first", &outputs[0]),
        show("second", &outputs[1])
    );
    // Only the snapshot and its lock are left: no temporary directory.
    let mut left: Vec<String> = std::fs::read_dir(cache.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let name = dirs[0].file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(left, [format!(".lock-{name}"), name]);
    let again = maker().wait_with_output().unwrap();
    assert_eq!(dir_of(&again), dirs[0]);
    assert!(!booted(&again), "{}", show("the third call booted", &again));
    let _ = std::fs::remove_dir_all(&cache);
}
