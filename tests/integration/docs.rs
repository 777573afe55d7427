//! The commands README.md and docs/ show run as shown: every `hvprobe` command in them
//! parses with today's command line (a renamed flag fails here, not in a reader's
//! terminal), and the blocks marked ```` ```sh runnable ```` run and print what they say.

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use clap::Parser;
use common::repo;
use hvprobe::cli::Cli;

/// README.md and every page of docs/.
fn pages() -> Vec<(PathBuf, String)> {
    let mut paths = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, text)
        })
        .collect()
}

/// A fenced block: its info string (`sh runnable`) and its lines, continuations joined.
struct Block {
    info: String,
    lines: Vec<String>,
}

fn blocks(text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<Block> = None;
    for line in text.lines() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(info)) => {
                open = Some(Block {
                    info: info.trim().to_string(),
                    lines: Vec::new(),
                })
            }
            (Some(_), Some(_)) => blocks.push(open.take().unwrap()),
            (Some(block), None) => match block.lines.last_mut() {
                Some(last) if last.ends_with('\\') => {
                    last.pop();
                    last.push_str(line.trim_start());
                }
                _ => block.lines.push(line.to_string()),
            },
            (None, None) => {}
        }
    }
    blocks
}

/// The words of the `hvprobe ...` command of a shell line: after a `$ ` prompt in any
/// block, or the line itself in a `sh` block; up to the first pipe, redirection, `&&` or
/// `;` outside quotes.
fn hvprobe_command(line: &str, in_sh: bool) -> Option<Vec<String>> {
    let command = match line.find("$ hvprobe ") {
        Some(at) => &line[at + 2..],
        None if in_sh && line.trim_start().starts_with("hvprobe ") => line.trim_start(),
        None => return None,
    };
    let words = shlex::split(command)?;
    let operator =
        |w: &String| ["|", "&&", ";", "||"].contains(&w.as_str()) || w.starts_with('>') || w.starts_with("2>");
    Some(words.into_iter().take_while(|w| !operator(w)).collect())
}

#[test]
fn every_hvprobe_command_in_the_docs_parses() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for (path, text) in pages() {
        for block in blocks(&text) {
            let in_sh = block.info.split_whitespace().next() == Some("sh");
            for line in &block.lines {
                let Some(words) = hvprobe_command(line, in_sh) else {
                    continue;
                };
                checked += 1;
                if let Err(e) = Cli::try_parse_from(&words) {
                    let first = e.to_string().lines().next().unwrap_or_default().to_string();
                    bad.push(format!("{}: `{}`: {first}", path.display(), words.join(" ")));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "commands in the docs that do not parse:\n{}",
        bad.join("\n")
    );
    assert!(checked >= 10, "only {checked} hvprobe commands found in the docs");
}

/// The blocks marked `sh runnable` run with this build's `hvprobe` first on PATH, in a
/// directory of their own; a block followed by an output block must print each of that
/// output's `name: (` event lines at least once.
#[test]
fn runnable_blocks_run_and_print_their_shown_events() {
    common::require_kvm();
    let bin = common::hvprobe_bin().parent().unwrap().to_path_buf();
    let mut ran = 0;
    for (path, text) in pages() {
        let blocks = blocks(&text);
        for (i, block) in blocks.iter().enumerate() {
            if block.info != "sh runnable" {
                continue;
            }
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("docs-{}-{i}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let path_var = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
            let out = Command::new("bash")
                .args(["-euo", "pipefail", "-c", &block.lines.join("\n")])
                .current_dir(&dir)
                .env("PATH", path_var)
                .output()
                .expect("run bash");
            let stdout = String::from_utf8_lossy(&out.stdout);
            let show = format!(
                "{} block {i}: {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
                path.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "{show}");
            if let Some(shown) = blocks.get(i + 1).filter(|b| b.info.is_empty()) {
                for event in shown.lines.iter().filter_map(|l| event_name(l)) {
                    assert!(stdout.contains(&format!(" {event}: (")), "no `{event}:` line\n{show}");
                }
            }
            ran += 1;
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    assert!(ran >= 1, "no block is marked `sh runnable`");
}

/// The event of a hit line in ftrace's layout: `comm-pid [cpu] stamp: EVENT: (...`.
fn event_name(line: &str) -> Option<&str> {
    let (_, rest) = line.split_once("]")?;
    let mut parts = rest.split(": ");
    parts.next()?;
    let event = parts.next()?;
    (!event.contains(' ') && rest.contains(": (")).then_some(event)
}
