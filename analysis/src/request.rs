//! Where a filter or a trigger comes from, and which events it is for.
//!
//! - `--filter GRP/EVENT:FILTER`: what one writes to `events/GRP/EVENT/filter`.
//! - `--trigger GRP/EVENT:TRIGGER`: what one writes to `events/GRP/EVENT/trigger`
//!   (`hist:...[ if FILTER]`, `stacktrace[:COUNT][ if FILTER]`).
//! - In a spec file, lines `filter GRP/EVENT FILTER` and `trigger GRP/EVENT TRIGGER` (the
//!   kprobe_events lines around them are the kernel's syntax; these two words start no
//!   kprobe_events line).
//!
//! `GRP/EVENT` may also be `EVENT` (any group) or `GRP/` (every event of the group), each
//! part a glob (`vfs/p_vfs_*`), as `hvprobe probe remove` takes them. Errors name the flag
//! and its value, or the file and line, and the column.

use std::fmt;

use hvprobe_probes::spec::wildcard_matches;

use crate::filter::{FilterError, FilterErrorKind, FilterExpr};
use crate::hist::{HistError, HistErrorKind, HistSpec};
use crate::stacktrace::StacktraceSpec;

/// A filter or a trigger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Filter,
    Trigger,
}

impl RequestKind {
    /// The command-line flag.
    pub const fn flag(self) -> &'static str {
        match self {
            RequestKind::Filter => "--filter",
            RequestKind::Trigger => "--trigger",
        }
    }

    /// The spec file's word.
    pub const fn word(self) -> &'static str {
        match self {
            RequestKind::Filter => "filter",
            RequestKind::Trigger => "trigger",
        }
    }
}

/// Where a request was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag and its value.
    Flag { kind: RequestKind, value: String },
    /// A spec file's line (1-based) and its text.
    File { path: String, line: usize, text: String },
}

impl Origin {
    fn text(&self) -> &str {
        match self {
            Origin::Flag { value, .. } => value,
            Origin::File { text, .. } => text,
        }
    }

    /// The 1-based column, in characters, of a byte offset into the text.
    fn column(&self, offset: usize) -> usize {
        let text = self.text();
        text.char_indices().take_while(|&(at, _)| at < offset).count() + 1
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag { kind, value } => write!(f, "{} '{value}'", kind.flag()),
            Origin::File { path, line, .. } => write!(f, "{path}:{line}"),
        }
    }
}

/// What is wrong with a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestErrorKind {
    #[error("expected GRP/EVENT:{0}")]
    FlagLayout(&'static str),
    #[error("expected `{0} GRP/EVENT {1}`")]
    LineLayout(&'static str, &'static str),
    #[error("bad event `{0}`: expected GRP/EVENT, EVENT or GRP/ (globs allowed)")]
    BadEvent(String),
    #[error(transparent)]
    Filter(FilterErrorKind),
    #[error(transparent)]
    Trigger(HistErrorKind),
    #[error("no probe event matches `{0}`")]
    NoSuchEvent(String),
    #[error("event {event} already has a filter (from {first}); an event has one filter: join them with &&")]
    TwoFilters { event: String, first: String },
}

/// A request's error, where it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct RequestError {
    pub origin: Box<Origin>,
    /// Byte offset into the flag's value or the file's line.
    pub offset: usize,
    pub kind: RequestErrorKind,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let column = self.origin.column(self.offset);
        match &*self.origin {
            Origin::File { .. } => write!(f, "{}:{column}: {}", self.origin, self.kind),
            Origin::Flag { .. } => write!(f, "{}: column {column}: {}", self.origin, self.kind),
        }
    }
}

/// Which events a request is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventPattern(String);

impl EventPattern {
    fn parse(text: &str) -> Option<EventPattern> {
        let ok = |part: &str| {
            part.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"_-*?{},".contains(&c))
        };
        let valid = match text.split_once('/') {
            Some((group, event)) => !group.is_empty() && ok(group) && ok(event),
            None => !text.is_empty() && ok(text),
        };
        valid.then(|| EventPattern(text.to_owned()))
    }

    /// Whether `GRP/EVENT` matches.
    pub fn matches(&self, group: &str, event: &str) -> bool {
        match self.0.split_once('/') {
            Some((g, "")) => wildcard_matches(g, group),
            Some((g, e)) => wildcard_matches(g, group) && wildcard_matches(e, event),
            None => wildcard_matches(&self.0, event),
        }
    }
}

impl fmt::Display for EventPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A parsed filter or trigger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestBody {
    Filter(FilterExpr),
    Hist(HistSpec),
    Stacktrace(StacktraceSpec),
}

/// A filter or a trigger for the events a pattern names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub origin: Origin,
    pub event: EventPattern,
    pub body: RequestBody,
    /// Where the filter or trigger starts in the origin's text.
    body_at: usize,
}

impl Request {
    /// An error of this request at `offset` into its filter or trigger.
    pub fn error_in_body(&self, offset: usize, kind: RequestErrorKind) -> RequestError {
        RequestError {
            origin: Box::new(self.origin.clone()),
            offset: self.body_at + offset,
            kind,
        }
    }

    /// An error about the request's event.
    pub fn error_at_event(&self, kind: RequestErrorKind) -> RequestError {
        let offset = match &self.origin {
            Origin::Flag { .. } => 0,
            Origin::File { text, .. } => text.find(&self.event.0).unwrap_or(0),
        };
        RequestError {
            origin: Box::new(self.origin.clone()),
            offset,
            kind,
        }
    }

    pub fn kind(&self) -> RequestKind {
        match self.body {
            RequestBody::Filter(_) => RequestKind::Filter,
            RequestBody::Hist(_) | RequestBody::Stacktrace(_) => RequestKind::Trigger,
        }
    }

    fn new(
        origin: Origin,
        kind: RequestKind,
        event: &str,
        event_at: usize,
        body_at: usize,
    ) -> Result<Request, RequestError> {
        let error = |offset, kind| RequestError {
            origin: Box::new(origin.clone()),
            offset,
            kind,
        };
        let pattern =
            EventPattern::parse(event).ok_or_else(|| error(event_at, RequestErrorKind::BadEvent(event.to_owned())))?;
        let body_text = &origin.text()[body_at..];
        let body = match kind {
            RequestKind::Filter => RequestBody::Filter(
                FilterExpr::parse(body_text)
                    .map_err(|FilterError { offset, kind }| error(body_at + offset, RequestErrorKind::Filter(kind)))?,
            ),
            RequestKind::Trigger => {
                let trigger_error =
                    |HistError { offset, kind }| error(body_at + offset, RequestErrorKind::Trigger(kind));
                match StacktraceSpec::parse(body_text) {
                    Some(stacktrace) => RequestBody::Stacktrace(stacktrace.map_err(trigger_error)?),
                    None => RequestBody::Hist(HistSpec::parse(body_text).map_err(trigger_error)?),
                }
            }
        };
        Ok(Request {
            origin,
            event: pattern,
            body,
            body_at,
        })
    }
}

/// Parses the value of `--filter` or `--trigger`: `GRP/EVENT:FILTER` or
/// `GRP/EVENT:TRIGGER`.
pub fn parse_flag(kind: RequestKind, value: &str) -> Result<Request, RequestError> {
    let origin = Origin::Flag {
        kind,
        value: value.to_owned(),
    };
    let Some((event, _)) = value.split_once(':') else {
        let what = match kind {
            RequestKind::Filter => "FILTER",
            RequestKind::Trigger => "TRIGGER",
        };
        return Err(RequestError {
            origin: Box::new(origin),
            offset: value.len(),
            kind: RequestErrorKind::FlagLayout(what),
        });
    };
    Request::new(origin, kind, event, 0, event.len() + 1)
}

/// Whether a spec file's line is a `filter` or `trigger` line (not a kprobe_events line).
pub fn is_request_line(line: &str) -> bool {
    let first = line.split_whitespace().next();
    first == Some(RequestKind::Filter.word()) || first == Some(RequestKind::Trigger.word())
}

/// Parses a spec file's `filter GRP/EVENT FILTER` or `trigger GRP/EVENT TRIGGER` line.
pub fn parse_line(path: &str, number: usize, line: &str) -> Result<Request, RequestError> {
    let origin = Origin::File {
        path: path.to_owned(),
        line: number,
        text: line.to_owned(),
    };
    let word_at = line.len() - line.trim_start().len();
    let kind = if line[word_at..].starts_with(RequestKind::Filter.word()) {
        RequestKind::Filter
    } else {
        RequestKind::Trigger
    };
    let after_word = word_at + kind.word().len();
    let rest = &line[after_word..];
    let event_at = after_word + (rest.len() - rest.trim_start().len());
    let event = line[event_at..].split_whitespace().next().unwrap_or("");
    let event_end = event_at + event.len();
    let tail = &line[event_end..];
    let body_at = event_end + (tail.len() - tail.trim_start().len());
    if event.is_empty() || body_at == line.trim_end().len() {
        let body = match kind {
            RequestKind::Filter => "FILTER",
            RequestKind::Trigger => "TRIGGER",
        };
        return Err(RequestError {
            origin: Box::new(origin),
            offset: line.trim_end().len(),
            kind: RequestErrorKind::LineLayout(kind.word(), body),
        });
    }
    Request::new(origin, kind, event, event_at, body_at)
}

#[cfg(test)]
mod tests;
