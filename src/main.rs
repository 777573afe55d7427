//! The `hvprobe` command.

use std::process::ExitCode;

use clap::Parser;
use hvprobe::cli::Cli;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // virtio-queue's own error lines come per request a guest breaks; the
                // devices report the same, rate-limited (vmm's `log_limit`).
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,virtio_queue=off")),
        )
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let result = hvprobe::cmd::dispatch(cli.command);
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hvprobe: error: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Colour only on a terminal, and not there when `NO_COLOR` is set (no-color.org): a log
/// redirected to a file or read by a pipe holds the text alone.
fn colour_on_stderr() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}
