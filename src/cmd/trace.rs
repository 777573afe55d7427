//! `hvprobe trace`: a running `hvprobe run`'s hit events streamed to this terminal (or a
//! Perfetto file) until the run ends.

use std::io::Write;
use std::process::ExitCode;

use hvprobe_probes::output::{ftrace_line, json_line, HitRecord};
use hvprobe_session::control::client::Connection;
use hvprobe_session::control::record::WireRecord;
use hvprobe_session::control::{Request, StreamEnd, StreamFormat, STREAM_END_KEY};
use hvprobe_session::options::{HitOutputs, OutputFormat};
use hvprobe_session::perfetto::PerfettoFile;

use crate::cli::TraceArgs;
use crate::cmd::probe::report;
use crate::cmd::CliResult;

/// `hvprobe trace`: prints the run's hit events as they come, until it ends; then how
/// many this client missed by reading too slowly (on stderr). With `--perfetto
/// FILE` it asks for whole records and writes the trace itself (and prints them too, when
/// a stdout format is also given); the file is created before anything is asked.
pub fn trace(args: TraceArgs) -> CliResult {
    let output = HitOutputs::from(&args.output);
    let mut perfetto = output.perfetto.as_deref().map(PerfettoFile::create).transpose()?;
    let stdout_format = output.stdout();
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
        let n = connection.read_line(&mut line)?;
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
        if !connection.has_buffered() {
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
        eprintln!("hvprobe: {}", hvprobe_session::perfetto::summary_line(&path, &summary));
    }
    Ok(status)
}
