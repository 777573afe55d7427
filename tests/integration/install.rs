//! hvprobe outside its checkout: a copied binary (what `cargo install` puts on PATH) run
//! from another directory builds and boots the bundled guest from the build inputs it
//! carries (session/build.rs embeds them; `cache::inputs` writes them into the cache).

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use common::require_kvm;

#[test]
fn a_copied_binary_run_from_another_directory_builds_and_boots_the_bundled_guest() {
    require_kvm();
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("installed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let binary = root.join("bin/hvprobe");
    std::fs::copy(common::hvprobe_bin(), &binary).unwrap();
    let elsewhere = root.join("cwd");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(&binary)
            .args(args)
            .current_dir(&elsewhere)
            .output()
            .expect("run the copied hvprobe");
        let show = format!(
            "{args:?}: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{show}");
        (String::from_utf8_lossy(&out.stdout).into_owned(), show)
    };
    // The guest it builds is the one the checkout's guest/build.sh builds: the same key.
    let (built, show) = run(&["build-guest"]);
    let checkout = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/guest/build.sh"))
        .output()
        .expect("run guest/build.sh");
    assert!(
        checkout.status.success(),
        "{}",
        String::from_utf8_lossy(&checkout.stderr)
    );
    assert_eq!(
        built.lines().last(),
        String::from_utf8_lossy(&checkout.stdout).lines().last(),
        "{show}"
    );
    let (console, show) = run(&["run", "--workload", "echo installed-and-booted"]);
    assert!(
        console.lines().any(|l| l.trim_end() == "installed-and-booted"),
        "{show}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
