//! `hvprobe completions SHELL` and `hvprobe man`: made from the same clap definitions as the
//! command line itself, so they cannot drift from it.

use std::process::Command;

use crate::common;

fn hvprobe(args: &[&str]) -> String {
    let out = Command::new(common::hvprobe_bin())
        .args(args)
        .output()
        .expect("run hvprobe");
    assert!(
        out.status.success(),
        "hvprobe {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// Bash loads the completion script and completes `hvprobe probe a` to `add` and
/// `hvprobe run --cp` to `--cpus`.
#[test]
fn bash_completes_subcommands_and_flags() {
    let script = hvprobe(&["completions", "bash"]);
    let complete = |words: &str| {
        let probe = format!(
            "{script}\nCOMP_WORDS=({words}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); \
             COMP_LINE=\"{words}\"; COMP_POINT=${{#COMP_LINE}}; _hvprobe hvprobe; printf '%s\\n' \"${{COMPREPLY[@]}}\""
        );
        let out = Command::new("bash").arg("-c").arg(&probe).output().expect("run bash");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(complete("hvprobe probe a").lines().any(|l| l == "add"));
    assert!(complete("hvprobe run --cp").lines().any(|l| l == "--cpus"));
}

#[test]
fn zsh_and_fish_scripts_name_every_command() {
    let zsh = hvprobe(&["completions", "zsh"]);
    let fish = hvprobe(&["completions", "fish"]);
    assert!(zsh.starts_with("#compdef hvprobe"));
    for command in ["run", "snapshot", "probe", "trace", "bench", "completions", "man"] {
        assert!(zsh.contains(&format!("'{command}:")), "zsh lacks {command}");
        assert!(fish.contains(&format!("-a \"{command}\"")), "fish lacks {command}");
    }
}

/// The main page lists the commands; `--out-dir` writes one page per command, each with
/// its own flags.
#[test]
fn manual_pages_cover_every_command_and_flag() {
    let main = hvprobe(&["man"]);
    assert!(main.contains(".TH hvprobe 1"), "{main}");
    assert!(main.contains("hvprobe\\-run(1)"), "{main}");
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("man-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    hvprobe(&["man", "--out-dir", dir.to_str().unwrap()]);
    let page = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(page("hvprobe-run.1").contains("\\-\\-cpus"));
    let add = page("hvprobe-probe-add.1");
    assert!(
        add.starts_with(".ie") && add.contains(".TH hvprobe-probe-add 1 ") && add.contains(env!("CARGO_PKG_VERSION")),
        "{add}"
    );
    assert!(page("hvprobe-snapshot-create.1").contains("\\-\\-out"));
    let _ = std::fs::remove_dir_all(&dir);
}
