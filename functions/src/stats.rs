//! Aggregations over the traced functions, in bcc's layouts: per-function call counts
//! (`funccount`) and a log2 histogram of call durations (`funclatency`, the libbpf-tools
//! version's `print_log2_hist`: `usecs : count distribution` with 40-star bars).

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Slots of a log2 histogram (`MAX_SLOTS` of libbpf-tools' funclatency).
pub const LOG2_SLOTS: usize = 64;
/// Width of the bars (`stars_max`).
const STARS_MAX: u64 = 40;

/// Calls per function, as bcc's `funccount` counts them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionCounts {
    counts: BTreeMap<String, u64>,
}

impl FunctionCounts {
    pub fn add(&mut self, function: &str) {
        match self.counts.get_mut(function) {
            Some(n) => *n = n.saturating_add(1),
            None => {
                self.counts.insert(function.to_owned(), 1);
            }
        }
    }

    pub fn total(&self) -> u64 {
        self.counts.values().fold(0u64, |a, n| a.saturating_add(*n))
    }

    /// funccount's table: `FUNC COUNT` (`%-36s %8s`), then a line per function called,
    /// fewest calls first (ties by name).
    pub fn table(&self) -> String {
        let mut rows: Vec<(&String, &u64)> = self.counts.iter().collect();
        rows.sort_by(|a, b| a.1.cmp(b.1).then_with(|| a.0.cmp(b.0)));
        let mut out = format!("{:<36} {:>8}\n", "FUNC", "COUNT");
        for (name, count) in rows {
            let _ = writeln!(out, "{name:<36} {count:>8}");
        }
        out
    }

    pub fn clear(&mut self) {
        self.counts.clear();
    }
}

/// The unit funclatency reports in (`-u`, `-m`; nanoseconds by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatencyUnit {
    Nsecs,
    Usecs,
    Msecs,
}

impl LatencyUnit {
    pub fn name(self) -> &'static str {
        match self {
            LatencyUnit::Nsecs => "nsecs",
            LatencyUnit::Usecs => "usecs",
            LatencyUnit::Msecs => "msecs",
        }
    }

    fn of_ns(self, ns: u64) -> u64 {
        match self {
            LatencyUnit::Nsecs => ns,
            LatencyUnit::Usecs => ns / 1_000,
            LatencyUnit::Msecs => ns / 1_000_000,
        }
    }
}

/// Call durations in log2 slots, as libbpf-tools' funclatency keeps them: slot `log2(d)`
/// (0 for 0 and 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log2Histogram {
    unit: LatencyUnit,
    slots: [u64; LOG2_SLOTS],
    total: u64,
    count: u64,
}

impl Log2Histogram {
    pub fn new(unit: LatencyUnit) -> Self {
        Log2Histogram {
            unit,
            slots: [0; LOG2_SLOTS],
            total: 0,
            count: 0,
        }
    }

    pub fn add_ns(&mut self, duration_ns: u64) {
        let value = self.unit.of_ns(duration_ns);
        let slot = value.checked_ilog2().unwrap_or(0) as usize;
        self.slots[slot.min(LOG2_SLOTS - 1)] += 1;
        self.total = self.total.saturating_add(value);
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// `print_log2_hist` (libbpf-tools' `trace_helpers.c`), then funclatency's
    /// `avg = …, total: …, count: …` line. Nothing when no call was counted.
    pub fn table(&self) -> String {
        let Some(idx_max) = self.slots.iter().rposition(|&v| v > 0) else {
            return String::new();
        };
        let val_max = self.slots.iter().copied().max().unwrap_or(0);
        let (pad, label, width, stars) = if idx_max <= 32 {
            (5, 19, 10, STARS_MAX)
        } else {
            (15, 29, 20, STARS_MAX / 2)
        };
        let mut out = format!("{:pad$}{:<label$} : count    distribution\n", "", self.unit.name());
        for (i, &val) in self.slots.iter().enumerate().take(idx_max + 1) {
            let high = (1u128 << (i + 1)) - 1;
            let mut low = (1u128 << (i + 1)) >> 1;
            if low == high {
                low -= 1;
            }
            let _ = write!(out, "{low:>width$} -> {high:<width$} : {val:<8} |");
            let shown = val.min(val_max);
            let num_stars = shown.saturating_mul(stars) / val_max.max(1);
            out.push_str(&"*".repeat(num_stars as usize));
            out.push_str(&" ".repeat((stars - num_stars) as usize));
            out.push_str("|\n");
        }
        let unit = self.unit.name();
        let _ = writeln!(
            out,
            "\navg = {} {unit}, total: {} {unit}, count: {}",
            self.total / self.count.max(1),
            self.total,
            self.count
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_printed_fewest_first_in_funccounts_columns() {
        let mut counts = FunctionCounts::default();
        for f in ["vfs_read", "vfs_write", "vfs_read", "vfs_read"] {
            counts.add(f);
        }
        assert_eq!(
            counts.table(),
            "FUNC                                    COUNT\n\
             vfs_write                                   1\n\
             vfs_read                                    3\n"
        );
        assert_eq!(counts.total(), 4);
    }

    #[test]
    fn the_histogram_is_libbpf_tools_print_log2_hist() {
        let mut hist = Log2Histogram::new(LatencyUnit::Usecs);
        for us in [0, 1, 2, 3, 3, 5, 900] {
            hist.add_ns(us * 1000);
        }
        let table = hist.table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "     usecs               : count    distribution");
        assert_eq!(
            lines[1],
            "         0 -> 1          : 2        |**************************              |"
        );
        assert_eq!(
            lines[2],
            "         2 -> 3          : 3        |****************************************|"
        );
        assert_eq!(
            lines[3],
            "         4 -> 7          : 1        |*************                           |"
        );
        assert_eq!(
            lines[10],
            "       512 -> 1023       : 1        |*************                           |"
        );
        assert_eq!(lines.len(), 13);
        assert_eq!(lines[12], "avg = 130 usecs, total: 914 usecs, count: 7");
        assert!(Log2Histogram::new(LatencyUnit::Nsecs).table().is_empty());
    }
}
