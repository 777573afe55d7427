//! `hvprobe probe add|remove|enable|disable|list|optimize`: one request to a running
//! `hvprobe run` through its control socket.

use std::io::{Read, Write};
use std::process::ExitCode;

use crate::cli::{ProbeAddArgs, ProbeCommand};
use crate::cmd::CliResult;
use hvprobe_session::control::client::Connection;
use hvprobe_session::control::{Request, Response};

/// Prints a response (lines on stdout, errors on stderr) and turns it into an exit status.
pub(crate) fn report(response: Response) -> ExitCode {
    let mut out = std::io::stdout().lock();
    for line in &response.lines {
        let _ = writeln!(out, "{line}");
    }
    for line in &response.errors {
        eprintln!("hvprobe: {line}");
    }
    if response.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `hvprobe probe ...`.
pub fn probe(command: ProbeCommand) -> CliResult {
    let (control, request) = match command {
        ProbeCommand::Add(args) => {
            let (text, source) = add_text(&args)?;
            (args.control.control, Request::Add { text, source })
        }
        ProbeCommand::Remove(args) => (args.control.control, Request::Remove { events: args.events }),
        ProbeCommand::Enable(args) => (args.control.control, Request::Enable { events: args.events }),
        ProbeCommand::Disable(args) => (args.control.control, Request::Disable { events: args.events }),
        ProbeCommand::List(args) => (args.control, Request::List),
        ProbeCommand::Optimize(args) => (args.control.control, Request::Optimize { on: args.mode.chosen() }),
    };
    let mut connection = Connection::open(control.as_deref())?;
    Ok(report(connection.request(&request)?))
}

/// The spec text of `probe add`, and its name for error messages: the lines given, or a
/// file (`-` for stdin).
fn add_text(args: &ProbeAddArgs) -> Result<(String, String), Box<dyn std::error::Error>> {
    match (&args.file, args.lines.as_slice()) {
        (Some(file), []) if file.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text)?;
            Ok((text, "<stdin>".into()))
        }
        (Some(file), []) => {
            let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            Ok((text, file.display().to_string()))
        }
        (None, []) => Err("give kprobe_events lines, or --file FILE (- for stdin)".into()),
        (None, lines) => Ok((lines.join("\n") + "\n", "<command line>".into())),
        (Some(_), _) => Err("give either lines or --file, not both".into()),
    }
}
