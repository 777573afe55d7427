//! The `stacktrace` trigger: `stacktrace[:COUNT] [if FILTER]`, what one writes to
//! `events/GRP/EVENT/trigger` for a kernel stack after the event (Linux 6.1's
//! `trigger_stacktrace_cmd` in `kernel/trace/trace_events_trigger.c`: at most `COUNT`
//! times when one is given, only for hits its filter matches). The stack itself is unwound
//! by the probe engine at the hit ([`HitRecord::stack`]); the trigger decides whether the
//! event keeps it.

use std::sync::atomic::{AtomicU64, Ordering};

use hvprobe_probes::output::HitRecord;

use crate::fields::EventFields;
use crate::filter::{Filter, FilterExpr};
use crate::hist::{HistError, HistErrorKind};

/// A `stacktrace` trigger as parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StacktraceSpec {
    /// `:COUNT`: fire this many times, then no more; `None` for always.
    pub count: Option<u64>,
    /// The filter after `if`, and where its text starts.
    filter: Option<(FilterExpr, usize)>,
}

impl StacktraceSpec {
    /// Parses a trigger text that starts with `stacktrace`; `None` for another trigger.
    pub fn parse(text: &str) -> Option<Result<StacktraceSpec, HistError>> {
        let lead = text.len() - text.trim_start().len();
        let rest = text.trim_start().strip_prefix("stacktrace")?;
        if !(rest.is_empty() || rest.starts_with([':', ' ', '\t'])) {
            return None;
        }
        Some(Self::parse_rest(rest, lead + "stacktrace".len()))
    }

    fn parse_rest(rest: &str, at: usize) -> Result<StacktraceSpec, HistError> {
        let (count, after, after_at) = match rest.strip_prefix(':') {
            Some(c) => {
                let end = c.find([' ', '\t']).unwrap_or(c.len());
                let n = &c[..end];
                let count = n
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| HistError::at(at + 1, HistErrorKind::BadCount(n.to_owned())))?;
                (Some(count), &c[end..], at + 1 + end)
            }
            None => (None, rest, at),
        };
        let trimmed = after.trim_start();
        let if_at = after_at + (after.len() - trimmed.len());
        let filter = if trimmed.is_empty() {
            None
        } else {
            let body = trimmed
                .strip_prefix("if")
                .filter(|b| b.starts_with([' ', '\t']))
                .ok_or(HistError::at(if_at, HistErrorKind::ExpectedIf))?;
            let body_at = if_at + 2;
            let expr = FilterExpr::parse(body).map_err(|e| HistError::from_filter(body_at, e))?;
            Some((expr, body_at))
        };
        Ok(StacktraceSpec { count, filter })
    }

    /// The trigger for an event with these fields.
    pub fn bind(&self, fields: &EventFields) -> Result<StacktraceTrigger, HistError> {
        let filter = match &self.filter {
            Some((expr, at)) => Some(expr.bind(fields).map_err(|e| HistError::from_filter(*at, e))?),
            None => None,
        };
        Ok(StacktraceTrigger {
            remaining: self.count.map(AtomicU64::new),
            filter,
        })
    }
}

/// A `stacktrace` trigger bound to its event.
#[derive(Debug)]
pub struct StacktraceTrigger {
    remaining: Option<AtomicU64>,
    filter: Option<Filter>,
}

impl StacktraceTrigger {
    /// Whether this hit gets its stack (and, with a count, uses one up).
    pub fn fires(&self, hit: &HitRecord) -> bool {
        if self.filter.as_ref().is_some_and(|f| !f.matches(hit)) {
            return false;
        }
        match &self.remaining {
            None => true,
            Some(n) => n
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(1))
                .is_ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use hvprobe_probes::fetch::ArgValue;

    use super::*;
    use crate::test_support::{args_of, hit};

    fn fields() -> EventFields {
        let args: &'static [hvprobe_probes::spec::FetchArg] =
            Box::leak(args_of("p f count=%dx:u64").into_boxed_slice());
        EventFields::new(args)
    }

    #[test]
    fn stacktrace_takes_a_count_and_a_filter() {
        assert_eq!(
            StacktraceSpec::parse("stacktrace").unwrap().unwrap(),
            StacktraceSpec {
                count: None,
                filter: None
            }
        );
        assert_eq!(StacktraceSpec::parse("  stacktrace:3").unwrap().unwrap().count, Some(3));
        let spec = StacktraceSpec::parse("stacktrace:2 if count > 1").unwrap().unwrap();
        let t = spec.bind(&fields()).unwrap();
        let small = hit("sh", 1, 0, vec![("count", ArgValue::Unsigned(1))]);
        let big = hit("sh", 1, 0, vec![("count", ArgValue::Unsigned(5))]);
        assert!(!t.fires(&small));
        assert!(t.fires(&big));
        assert!(t.fires(&big));
        assert!(!t.fires(&big), "the count is used up");
        assert!(StacktraceSpec::parse("hist:keys=count").is_none());
        assert!(StacktraceSpec::parse("stacktraces").is_none());
    }

    #[test]
    fn bad_stacktrace_triggers_say_where() {
        let err = |t: &str| StacktraceSpec::parse(t).unwrap().unwrap_err();
        assert_eq!(
            err("stacktrace:0"),
            HistError::at(11, HistErrorKind::BadCount("0".into()))
        );
        assert_eq!(
            err("stacktrace:x"),
            HistError::at(11, HistErrorKind::BadCount("x".into()))
        );
        assert_eq!(err("stacktrace when"), HistError::at(11, HistErrorKind::ExpectedIf));
        let e = err("stacktrace if count >");
        assert!(matches!(e.kind, HistErrorKind::Filter(_)), "{e:?}");
        let spec = StacktraceSpec::parse("stacktrace if nope == 1").unwrap().unwrap();
        let e = spec.bind(&fields()).unwrap_err();
        assert_eq!(e.offset, 14, "{e:?}");
    }
}
