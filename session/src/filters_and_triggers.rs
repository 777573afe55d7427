//! The run's event filters and hist triggers (`--filter`, `--trigger`, and the probe file's
//! `filter`/`trigger` lines; the grammar and the aggregation are `hvprobe-analysis`): read
//! with the probe file, bound to its events before any probe is armed, applied by the
//! trace session to every hit as it reaches the host, printed at the end and on SIGUSR1.

use hvprobe_analysis::request::{self, Request, RequestError};
use hvprobe_analysis::table::AnalysisTable;
use hvprobe_introspection::symbols::SymbolTable;

use crate::options::OutputFormat;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::AnalysisFlags;

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
