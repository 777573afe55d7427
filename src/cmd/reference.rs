//! The command-line reference in Markdown (`hvprobe man --markdown`, kept as
//! `docs/cli.md`): every command and flag with its help text, made from the same clap
//! definitions as the command line, so a unit test sees the page drift.

use std::fmt::Write;

use clap::{Arg, Command};

/// The reference of `cmd` and every subcommand under it, depth first.
pub fn markdown(cmd: &Command) -> String {
    let mut page = String::from(
        "# Command-line reference\n\n\
         Every command and flag of `hvprobe`, from its help texts (`hvprobe man --markdown`\n\
         writes this page; `hvprobe COMMAND --help` says the same).\n",
    );
    let mut cmd = cmd.clone();
    cmd.build();
    write_command(&mut page, &cmd, cmd.get_name());
    page
}

fn write_command(page: &mut String, cmd: &Command, path: &str) {
    let _ = write!(page, "\n## `{path}`\n\n");
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = writeln!(page, "{}\n", about.to_string().trim_end());
    }
    let usage = cmd.clone().render_usage().to_string();
    let usage = usage.trim_start_matches("Usage: ").trim_end();
    let _ = writeln!(page, "```text\n{usage}\n```");
    let args: Vec<&Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        page.push('\n');
    }
    for arg in args {
        let _ = writeln!(page, "- {}", describe(arg));
    }
    for sub in cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        write_command(page, sub, &format!("{path} {}", sub.get_name()));
    }
}

/// One flag or positional argument: its spelling, then its help text and what it takes.
fn describe(arg: &Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| names.iter().map(|n| format!("<{n}>")).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| format!("<{}>", arg.get_id().as_str().to_uppercase()));
    let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values()) || arg.is_positional();
    let mut spelling = Vec::new();
    if let Some(short) = arg.get_short() {
        spelling.push(format!("-{short}"));
    }
    if let Some(long) = arg.get_long() {
        spelling.push(format!("--{long}"));
    }
    let mut text = match (spelling.is_empty(), takes_value) {
        (true, _) => format!("`{value}`"),
        (false, true) => format!("`{} {value}`", spelling.join(", ")),
        (false, false) => format!("`{}`", spelling.join(", ")),
    };
    let help = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let help = help.trim().replace("\n\n", "\n").replace('\n', "\n  ");
    if !help.is_empty() {
        let _ = write!(text, ": {help}");
    }
    let possible: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    if !possible.is_empty() && takes_value {
        let _ = write!(text, " (one of {})", possible.join(", "));
    }
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .filter(|v| takes_value && !v.is_empty())
        .map(|v| format!("`{}`", v.to_string_lossy()))
        .collect();
    if !defaults.is_empty() {
        let _ = write!(text, " (default {})", defaults.join(" "));
    }
    text
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use crate::cli::Cli;

    /// `docs/cli.md` is what `hvprobe man --markdown` prints now.
    #[test]
    fn the_reference_in_docs_is_the_one_the_help_texts_make() {
        let generated = super::markdown(&Cli::command());
        let committed = include_str!("../../docs/cli.md");
        assert!(
            committed == generated,
            "docs/cli.md is stale: run `cargo run -- man --markdown > docs/cli.md`"
        );
    }
}
