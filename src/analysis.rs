//! The run's event filters and hist triggers (`--filter`, `--trigger`, and the probe file's
//! `filter`/`trigger` lines; the grammar and the aggregation are `hvprobe-analysis`): read
//! with the probe file, bound to its events before any probe is armed, applied by the
//! trace session to every hit as it reaches the host, printed at the end and on SIGUSR1.

use std::io::Write as _;
use std::time::{Duration, Instant};

use hvprobe_analysis::request::{self, Request, RequestError, RequestKind};
use hvprobe_analysis::table::AnalysisTable;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_vmm::ConsoleLog;

use crate::cli::OutputFormat;

/// The `--filter` and `--trigger` values of a run, unparsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnalysisFlags {
    pub filters: Vec<String>,
    pub triggers: Vec<String>,
}

impl AnalysisFlags {
    pub fn is_empty(&self) -> bool {
        self.filters.is_empty() && self.triggers.is_empty()
    }

    /// Every flag parsed, or every flag's error.
    pub fn parse(&self) -> (Vec<Request>, Vec<RequestError>) {
        let flags = self
            .filters
            .iter()
            .map(|f| (RequestKind::Filter, f))
            .chain(self.triggers.iter().map(|t| (RequestKind::Trigger, t)));
        let (mut requests, mut errors) = (Vec::new(), Vec::new());
        for (kind, value) in flags {
            match request::parse_flag(kind, value) {
                Ok(r) => requests.push(r),
                Err(e) => errors.push(e),
            }
        }
        (requests, errors)
    }
}

/// A probe file's text with its `filter`/`trigger` lines blanked (so the kprobe_events
/// parser's line numbers stay the file's), and those lines parsed.
pub fn take_request_lines(text: &str, source: &str) -> (String, Vec<Request>, Vec<RequestError>) {
    let (mut probes, mut requests, mut errors) = (String::with_capacity(text.len()), Vec::new(), Vec::new());
    for (index, line) in text.lines().enumerate() {
        if request::is_request_line(line) {
            match request::parse_line(source, index + 1, line) {
                Ok(r) => requests.push(r),
                Err(e) => errors.push(e),
            }
        } else {
            probes.push_str(line);
        }
        probes.push('\n');
    }
    (probes, requests, errors)
}

/// The line a request error is on (0 for a flag: flags are reported first).
pub fn error_line(e: &RequestError) -> usize {
    origin_line(&e.origin)
}

/// The spec file's line of a request (0 for a flag).
pub fn origin_line(origin: &request::Origin) -> usize {
    match origin {
        request::Origin::File { line, .. } => *line,
        request::Origin::Flag { .. } => 0,
    }
}

/// The histograms as the run prints them: the `hist` files (text), or one JSON line each.
pub fn hist_report(table: &AnalysisTable, format: OutputFormat, symbols: Option<&SymbolTable>) -> String {
    match format {
        OutputFormat::Json => table
            .hist_json_lines(symbols)
            .into_iter()
            .map(|l| format!("{l}\n"))
            .collect(),
        OutputFormat::Text | OutputFormat::None => table.hist_files(symbols),
    }
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
        // Ten pieces 30 ms apart: 300 ms for the line, three times the quiet time.
        let mut parts = vec!["GUEST hvprobe-loop-23 [000] "; 9];
        parts.push("gk: (x)\n");
        let (console, writer) = slow_console(parts, Duration::from_millis(30));
        std::thread::sleep(Duration::from_millis(5));
        let started = Instant::now();
        let (out, at_line) = lock_stdout_at_line_within(
            &console,
            || console.at_line_start(),
            Duration::from_millis(100),
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

    #[test]
    fn request_lines_leave_blank_lines_so_the_probes_keep_their_numbers() {
        let text = "p:g/a f\nfilter g/a cpu == 0\n# trigger g/a hist:keys=cpu\ntrigger g/a hist:keys=cpu\np:g/b h\n";
        let (probes, requests, errors) = take_request_lines(text, "f");
        assert_eq!(probes, "p:g/a f\n\n# trigger g/a hist:keys=cpu\n\np:g/b h\n");
        assert_eq!(requests.len(), 2);
        assert!(errors.is_empty());
        assert_eq!(origin_line(&requests[1].origin), 4);
        let (_, _, errors) = take_request_lines("p:g/a f\n\nfilter g/a cpu = 0\n", "f");
        assert_eq!(errors.iter().map(error_line).collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn flags_parse_each_and_report_each() {
        let flags = AnalysisFlags {
            filters: vec!["g/a:cpu == 0".into(), "nocolon".into()],
            triggers: vec!["g/a:hist:keys=cpu".into()],
        };
        let (requests, errors) = flags.parse();
        assert_eq!(requests.len(), 2);
        assert_eq!(errors.len(), 1);
        assert_eq!(error_line(&errors[0]), 0);
    }
}
