//! Messages a guest can cause, rate-limited per place in the code. A guest that makes a
//! device warn on every request (a transfer that fails, a queue set up wrong, again and
//! again) would otherwise fill the terminal or the log's disk, and a stderr that stalls
//! would hold the thread that writes to it (a vCPU's, for the transport's messages). As
//! Linux's printk_ratelimit does: the first [`BURST`] messages of each [`PERIOD`] are
//! written, the rest counted, and the count goes out with the next one written.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Messages written per place and period.
pub const BURST: u32 = 10;
/// The period the burst is counted over.
pub const PERIOD: Duration = Duration::from_secs(5);

/// One place's limit: a `static` beside the message (see [`warn_limited!`]).
pub struct LogLimit {
    window: Mutex<Window>,
}

struct Window {
    started: Option<Instant>,
    written: u32,
    /// Left out since the last message written.
    suppressed: u64,
}

impl LogLimit {
    pub const fn new() -> LogLimit {
        LogLimit {
            window: Mutex::new(Window {
                started: None,
                written: 0,
                suppressed: 0,
            }),
        }
    }

    /// Whether a message may be written now; if so, how many were left out before it.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        if w.started.is_none_or(|s| now.saturating_duration_since(s) >= PERIOD) {
            w.started = Some(now);
            w.written = 0;
        }
        if w.written >= BURST {
            w.suppressed = w.suppressed.saturating_add(1);
            return None;
        }
        w.written += 1;
        Some(std::mem::take(&mut w.suppressed))
    }
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit::new()
    }
}

/// `tracing::warn!` for a message a guest can cause, limited per call site by a
/// [`LogLimit`](crate::log_limit::LogLimit) of its own.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {{
        static LIMIT: $crate::log_limit::LogLimit = $crate::log_limit::LogLimit::new();
        if let Some(suppressed) = LIMIT.allow() {
            if suppressed > 0 {
                tracing::warn!("{} ({suppressed} more like it left out)", format_args!($($arg)+));
            } else {
                tracing::warn!($($arg)+);
            }
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_gives_a_burst_per_period_and_then_says_how_many_were_left_out() {
        let limit = LogLimit::new();
        let start = Instant::now();
        let allowed: Vec<Option<u64>> = (0..1000).map(|_| limit.allow_at(start)).collect();
        assert_eq!(allowed.iter().filter(|a| a.is_some()).count(), BURST as usize);
        assert!(allowed[..BURST as usize].iter().all(|a| *a == Some(0)));
        assert_eq!(limit.allow_at(start + PERIOD / 2), None, "still the same period");
        assert_eq!(
            limit.allow_at(start + PERIOD),
            Some(1000 - u64::from(BURST) + 1),
            "the next period's first message counts the ones left out"
        );
        assert_eq!(limit.allow_at(start + PERIOD), Some(0));
    }
}
