//! The client side of the control socket: `hvprobe probe add|remove|enable|disable|list`
//! and `hvprobe trace`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use hvprobe_probes::output::{ftrace_line, json_line, HitRecord};

use super::record::WireRecord;
use super::{default_socket_dir, ControlError, Request, Response, StreamEnd, StreamFormat, STREAM_END_KEY};
use crate::cli::{OutputFormat, ProbeAddArgs, ProbeCommand, TraceArgs};
use crate::perfetto::PerfettoFile;

/// The environment variable that names the control socket when `--control` does not.
pub const CONTROL_ENV: &str = "HVPROBE_CONTROL";

/// The socket to talk to: `--control`, else `$HVPROBE_CONTROL`, else the one live socket
/// in the default directory.
pub fn find_socket(given: Option<&Path>) -> Result<PathBuf, ControlError> {
    if let Some(path) = given {
        return Ok(path.to_path_buf());
    }
    if let Some(path) = std::env::var_os(CONTROL_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let dir = default_socket_dir();
    let mut live: Vec<PathBuf> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sock") && UnixStream::connect(p).is_ok())
        .collect();
    live.sort();
    match live.len() {
        0 => Err(ControlError::NoneRunning { dir }),
        1 => Ok(live.remove(0)),
        _ => Err(ControlError::SeveralRunning { sockets: live }),
    }
}

/// A connection to a run's control socket.
pub struct Connection {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Connection {
    pub fn open(given: Option<&Path>) -> Result<Connection, ControlError> {
        let path = find_socket(given)?;
        let io = |source| ControlError::Io {
            path: path.clone(),
            source,
        };
        let writer = UnixStream::connect(&path).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        Ok(Connection { path, reader, writer })
    }

    /// Sends one request and reads its answer.
    pub fn request(&mut self, request: &Request) -> Result<Response, ControlError> {
        let io = |source| ControlError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_string(request).map_err(|source| ControlError::Protocol {
            path: self.path.clone(),
            source,
        })?;
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(io)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer).map_err(io)? == 0 {
            return Err(ControlError::Closed {
                path: self.path.clone(),
            });
        }
        serde_json::from_str(&answer).map_err(|source| ControlError::Protocol {
            path: self.path.clone(),
            source,
        })
    }
}

/// Prints a response (lines on stdout, errors on stderr) and turns it into an exit status.
fn report(response: Response) -> ExitCode {
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
pub fn probe(command: ProbeCommand) -> Result<ExitCode, Box<dyn std::error::Error>> {
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

/// `hvprobe trace`: prints the run's hit events as they come, until it ends; then how
/// many this client missed by reading too slowly (on stderr). With `--perfetto
/// FILE` it asks for whole records and writes the trace itself (and prints them too, when
/// a stdout format is also given); the file is created before anything is asked.
pub fn trace(args: TraceArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut perfetto = args.output.perfetto.as_deref().map(PerfettoFile::create).transpose()?;
    let stdout_format = args.output.stdout();
    let format = match (&perfetto, stdout_format) {
        (None, OutputFormat::Text) => StreamFormat::Text,
        (None, OutputFormat::Json) => StreamFormat::Json,
        // Lines rendered here from the records, as the run's own printer does.
        (Some(_), _) | (None, OutputFormat::None) => StreamFormat::Record,
    };
    let mut connection = Connection::open(args.control.control.as_deref())?;
    let response = connection.request(&Request::Trace {
        format,
        queue: args.queue,
    })?;
    if !response.ok {
        return Ok(report(response));
    }
    let end_prefix = format!("{{\"{STREAM_END_KEY}\":");
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut stdout_open = stdout_format != OutputFormat::None;
    let mut line = String::new();
    let status = loop {
        line.clear();
        let n = connection
            .reader
            .read_line(&mut line)
            .map_err(|source| ControlError::Io {
                path: connection.path.clone(),
                source,
            })?;
        if n == 0 {
            let _ = out.flush();
            eprintln!("hvprobe: the stream was cut off before its end");
            break ExitCode::FAILURE;
        }
        if line.starts_with(&end_prefix) {
            let _ = out.flush();
            let end: serde_json::Value = serde_json::from_str(&line)?;
            let end: StreamEnd = serde_json::from_value(end[STREAM_END_KEY].clone())?;
            eprintln!(
                "hvprobe: {}; {} events received, {} dropped because this client read too slowly",
                end.reason, end.sent, end.dropped
            );
            break ExitCode::SUCCESS;
        }
        let written = match format {
            StreamFormat::Record => {
                let hit: HitRecord = serde_json::from_str::<WireRecord>(&line)
                    .map_err(|e| format!("a malformed record from the run: {e}"))?
                    .into();
                if let Some(file) = &mut perfetto {
                    file.write_hit(&hit);
                }
                let text = match stdout_format {
                    OutputFormat::Json => json_line(&hit),
                    _ => ftrace_line(&hit),
                };
                !stdout_open || writeln!(out, "{text}").is_ok()
            }
            StreamFormat::Text | StreamFormat::Json => out.write_all(line.as_bytes()).is_ok(),
        };
        if !written {
            if perfetto.is_none() {
                // Our reader went away (`hvprobe trace | head`): that is the end.
                return Ok(ExitCode::SUCCESS);
            }
            // The trace file still takes every hit.
            stdout_open = false;
        }
        if connection.reader.buffer().is_empty() {
            if stdout_open {
                out.flush()?;
            }
            if let Some(file) = &mut perfetto {
                file.flush();
            }
        }
    };
    if let Some(file) = perfetto {
        let path = file.path().display().to_string();
        let summary = file.finish()?;
        eprintln!("hvprobe: {}", crate::perfetto::summary_line(&path, &summary));
    }
    Ok(status)
}
