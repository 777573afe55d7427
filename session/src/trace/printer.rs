//! The run's printer: hit lines on stdout, which the guest's console shares, never inside
//! a guest line.

use std::time::{Duration, Instant};

use hvprobe_functions::layout::{function_line, FunctionHit, GraphPrinter, FUNCTION_HEADER};
use hvprobe_functions::stats::{FunctionCounts, Log2Histogram};

use super::*;

/// One hit in `format`, without the last newline: a line, or for a text hit with a kernel
/// stack the event's line and the stack's lines (frames with offsets with `sym_offset`).
pub fn event_line(event: &HitEvent, format: OutputFormat, sym_offset: bool) -> String {
    match format {
        OutputFormat::Json => json_line(&event.record),
        OutputFormat::Text | OutputFormat::None => ftrace_text(&event.record, sym_offset),
    }
}

/// How the printer lays out hits on stdout.
pub(super) struct Layout {
    pub format: OutputFormat,
    /// `--sym-offset`: stack frames (and a function tracer's parents) with their offsets.
    pub sym_offset: bool,
    pub mode: PrintMode,
    /// A function tracer's `set_ftrace_pid`: its hits of other tasks are not printed.
    pub pids: Vec<i32>,
}

/// How long the printer waits for the next hit before it prints a function_graph entry it
/// holds back (to see whether the call is a leaf).
const GRAPH_HOLD: Duration = Duration::from_millis(200);

/// Prints events as they come, a batch of lines at a time, and writes them to the Perfetto
/// trace (if any), which is finished when the queue ends (the run's end, however it ends).
pub(super) fn print_events(
    rx: Receiver<HitEvent>,
    layout: Layout,
    console: ConsoleLog,
    mut perfetto: Option<PerfettoFile>,
) {
    let mut stdout = (layout.format != OutputFormat::None).then(|| StdoutPrinter::new(layout, console));
    loop {
        let first = match rx.recv_timeout(GRAPH_HOLD) {
            Ok(first) => first,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Some(printer) = &mut stdout {
                    printer.hold_no_longer();
                    if !printer.flush() && perfetto.is_none() {
                        return;
                    }
                }
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(event) = next {
            if let Some(printer) = &mut stdout {
                printer.push(&event);
            }
            if let Some(file) = &mut perfetto {
                file.write_hit(&event.record);
            }
            taken += 1;
            // A batch is printed (and the trace flushed) at 64 KiB of text or 4096 hits.
            let full = taken >= 4096 || stdout.as_ref().is_some_and(|p| p.batch.len() >= 1 << 16);
            next = if full { None } else { rx.try_recv().ok() };
        }
        if let Some(printer) = &mut stdout {
            if !printer.flush() {
                if perfetto.is_none() {
                    // stdout is gone (a closed pipe): the hits from now on are missed.
                    return;
                }
                // The trace file still takes every hit.
                stdout = None;
            }
        }
        if let Some(file) = &mut perfetto {
            file.flush();
        }
    }
    if let Some(printer) = &mut stdout {
        printer.hold_no_longer();
        printer.aggregates();
        printer.flush();
    }
    if let Some(file) = perfetto {
        let path = file.path().display().to_string();
        match file.finish() {
            Ok(summary) => eprintln!("hvprobe: {}", crate::perfetto::summary_line(&path, &summary)),
            Err(e) => eprintln!("hvprobe: error: {e}"),
        }
    }
}

/// Hit lines for stdout, a batch at a time. stdout is shared with the guest's console,
/// which prints a byte at a time: a batch goes out under stdout's lock, only when the
/// console is at the start of a line, so neither splits the other's lines.
pub(super) struct StdoutPrinter {
    format: OutputFormat,
    /// `--sym-offset`: stack frames with their offsets.
    sym_offset: bool,
    /// The function tracer's layout, when the run traces functions in text.
    functions: Option<FunctionLines>,
    pids: Vec<i32>,
    console: ConsoleLog,
    batch: String,
    /// The console's byte count when a batch of ours last broke one of its lines: as long
    /// as it has printed nothing since, stdout is at the start of a line (ours).
    broke_line_at: Option<u64>,
}

impl StdoutPrinter {
    fn new(layout: Layout, console: ConsoleLog) -> Self {
        let functions = match (layout.format, layout.mode) {
            (OutputFormat::Json, _) | (_, PrintMode::Probes) => None,
            (_, PrintMode::Function) => Some(FunctionLines::Function { header_done: false }),
            (_, PrintMode::Graph(options)) => Some(FunctionLines::Graph(Box::new(GraphPrinter::new(options)))),
            (_, PrintMode::Count) => Some(FunctionLines::Count(FunctionCounts::default())),
            (_, PrintMode::Latency(unit)) => Some(FunctionLines::Latency(Box::new(Log2Histogram::new(unit)))),
        };
        StdoutPrinter {
            format: layout.format,
            sym_offset: layout.sym_offset,
            functions,
            pids: layout.pids,
            console,
            batch: String::new(),
            broke_line_at: None,
        }
    }

    fn push(&mut self, event: &HitEvent) {
        let hit = &event.record;
        let (format, sym_offset) = (self.format, self.sym_offset);
        let is_function_hit = FunctionHit::of(hit).is_some();
        if is_function_hit && !self.pids.is_empty() && !self.pids.contains(&hit.pid) {
            return;
        }
        match &mut self.functions {
            Some(FunctionLines::Function { header_done }) => {
                if !*header_done {
                    *header_done = true;
                    self.batch.push_str(FUNCTION_HEADER);
                    self.batch.push('\n');
                }
                if is_function_hit {
                    self.batch.push_str(&function_line(hit, sym_offset));
                } else {
                    self.batch.push_str(&event_line(event, format, sym_offset));
                }
                self.batch.push('\n');
            }
            Some(FunctionLines::Graph(graph)) => {
                let lines = graph.push(hit, |h| ftrace_text(h, sym_offset));
                self.batch.push_str(&lines);
            }
            Some(FunctionLines::Count(counts)) if is_function_hit => {
                counts.add(hit.location.split('+').next().unwrap_or(&hit.location));
            }
            Some(FunctionLines::Latency(histogram)) if is_function_hit => {
                if let Some(entered) = hit.entry_timestamp_ns {
                    histogram.add_ns(hit.timestamp_ns.saturating_sub(entered));
                }
            }
            Some(FunctionLines::Count(_) | FunctionLines::Latency(_)) => {
                self.batch.push_str(&event_line(event, format, sym_offset));
                self.batch.push('\n');
            }
            None => {
                self.batch.push_str(&event_line(event, format, sym_offset));
                self.batch.push('\n');
            }
        }
    }

    /// funccount's table or funclatency's histogram, at the end of the run.
    fn aggregates(&mut self) {
        match &self.functions {
            Some(FunctionLines::Count(counts)) => {
                self.batch.push('\n');
                self.batch.push_str(&counts.table());
            }
            Some(FunctionLines::Latency(histogram)) => {
                self.batch.push('\n');
                self.batch.push_str(&histogram.table());
            }
            _ => {}
        }
    }

    /// Prints the function_graph entries held back to see whether they are leaves.
    fn hold_no_longer(&mut self) {
        if let Some(FunctionLines::Graph(graph)) = &mut self.functions {
            let lines = graph.flush();
            self.batch.push_str(&lines);
        }
    }

    /// Prints the batch; false when stdout cannot be written any more.
    fn flush(&mut self) -> bool {
        if self.batch.is_empty() {
            return true;
        }
        let console = &self.console;
        let broke_line_at = self.broke_line_at;
        let at_line_start = || console.at_line_start() || broke_line_at == Some(console.written());
        let (mut out, at_line) = lock_stdout_at_line(console, at_line_start);
        if !at_line {
            self.batch.insert(0, '\n');
            self.broke_line_at = Some(console.written());
        }
        let written = out.write_all(self.batch.as_bytes()).and_then(|()| out.flush()).is_ok();
        self.batch.clear();
        written
    }
}

/// The function tracers' text layouts.
enum FunctionLines {
    Function { header_done: bool },
    Graph(Box<GraphPrinter>),
    Count(FunctionCounts),
    Latency(Box<Log2Histogram>),
}

/// How long stdout waits for the guest's console to finish its line after the console's
/// last byte (a shell prompt never finishes its line), and at most in all. A line still
/// growing is waited for: an emulated console can take longer than the quiet time for one
/// line (one exit per byte), and a hit line printed into it would split it.
const CONSOLE_LINE_QUIET: Duration = Duration::from_millis(100);
const CONSOLE_LINE_LIMIT: Duration = Duration::from_secs(2);

/// Takes stdout's lock once the guest's console, which shares stdout, is at the start of a
/// line by `at_line_start`, waiting while its line still grows (see CONSOLE_LINE_QUIET).
/// The flag is whether it got there; if not, the caller starts a line of its own.
pub fn lock_stdout_at_line(
    console: &ConsoleLog,
    at_line_start: impl Fn() -> bool,
) -> (std::io::StdoutLock<'static>, bool) {
    lock_stdout_at_line_within(console, at_line_start, CONSOLE_LINE_QUIET, CONSOLE_LINE_LIMIT)
}

fn lock_stdout_at_line_within(
    console: &ConsoleLog,
    at_line_start: impl Fn() -> bool,
    quiet: Duration,
    limit: Duration,
) -> (std::io::StdoutLock<'static>, bool) {
    let started = Instant::now();
    let (mut seen, mut last_progress) = (console.written(), started);
    loop {
        let out = std::io::stdout().lock();
        if at_line_start() {
            return (out, true);
        }
        let now = Instant::now();
        if console.written() != seen {
            (seen, last_progress) = (console.written(), now);
        }
        if now - last_progress >= quiet || now - started >= limit {
            return (out, false);
        }
        drop(out);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes `text` to stdout, which the guest's console shares, starting on a line of its
/// own.
pub fn print_on_own_lines(text: &str, console: &ConsoleLog) {
    if text.is_empty() {
        return;
    }
    let (mut out, at_line_start) = lock_stdout_at_line(console, || console.at_line_start());
    let lead = if at_line_start { "" } else { "\n" };
    let _ = write!(out, "{lead}{text}");
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A console writing `parts` with `gap` between them, from its own thread.
    fn slow_console(parts: Vec<&'static str>, gap: Duration) -> (ConsoleLog, std::thread::JoinHandle<()>) {
        let log = ConsoleLog::default();
        let mut writer = hvprobe_vmm::console::ConsoleWriter::new(log.clone(), hvprobe_vmm::ConsoleOutput::Discard);
        let thread = std::thread::spawn(move || {
            for part in parts {
                writer.write_all(part.as_bytes()).unwrap();
                std::thread::sleep(gap);
            }
        });
        (log, thread)
    }

    #[test]
    fn stdout_waits_for_a_console_line_that_grows_longer_than_the_quiet_time() {
        // Twenty pieces 50 ms apart: a second for the line, twice the quiet time, each
        // gap a tenth of it (gaps of a third split the line on a loaded host).
        let mut parts = vec!["GUEST hvprobe-loop-23 [000] "; 19];
        parts.push("gk: (x)\n");
        let (console, writer) = slow_console(parts, Duration::from_millis(50));
        std::thread::sleep(Duration::from_millis(5));
        let started = Instant::now();
        let (out, at_line) = lock_stdout_at_line_within(
            &console,
            || console.at_line_start(),
            Duration::from_millis(500),
            Duration::from_secs(5),
        );
        drop(out);
        assert!(at_line, "the line was split after {:?}", started.elapsed());
        assert!(console.contents().ends_with("gk: (x)\n"));
        writer.join().unwrap();
    }

    #[test]
    fn stdout_breaks_a_console_line_that_stops_growing() {
        let (console, writer) = slow_console(vec!["~ # "], Duration::ZERO);
        writer.join().unwrap();
        let started = Instant::now();
        let (out, at_line) = lock_stdout_at_line_within(
            &console,
            || console.at_line_start(),
            Duration::from_millis(50),
            Duration::from_secs(5),
        );
        drop(out);
        let waited = started.elapsed();
        assert!(!at_line, "a prompt never ends its line");
        assert!(
            waited >= Duration::from_millis(50) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
    }
}
