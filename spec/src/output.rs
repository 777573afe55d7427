//! Text forms of probe hits and of the probe listing.
//!
//! - [`ftrace_line`]: the `trace` file's line for a kprobe event, as Linux 6.x prints it
//!   (`trace_print_context` in `kernel/trace/trace_output.c`, `print_kprobe_event` /
//!   `print_kretprobe_event` in `kernel/trace/trace_kprobe.c`, `trace_probe_print_args`
//!   in `trace_probe.c`) with the `irq-info` and `record-tgid` options off, since the host
//!   does not know the guest's irq and preemption state at a hit.
//! - [`json_line`]: one JSON object per hit.
//! - [`listing_line`]: the debugfs `kprobes/list` line (`report_probe` in
//!   `kernel/kprobes.c`) plus the hit and miss counters.

use std::fmt::Write as _;

use hvprobe_arch::Gva;

use crate::fetch::{ArgValue, EscapedBytes};

/// Guest text (a task's `comm`) as text output shows it: control characters (C0, DEL, C1)
/// and invalid UTF-8 become `\xNN`, as in string fetch-args. Any guest process can name
/// itself (`prctl(PR_SET_NAME)`) with a newline, to forge trace lines, or an ESC, to drive
/// the analyst's terminal. JSON and Perfetto output encode these themselves.
pub fn escape_guest_text(text: &str) -> String {
    EscapedBytes(text.as_bytes()).to_string()
}

/// One probe hit, ready to print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HitRecord {
    /// The current task's name.
    pub comm: String,
    pub pid: i32,
    /// The vCPU that hit.
    pub cpu: usize,
    /// Guest trace-clock time of the hit, in nanoseconds.
    pub timestamp_ns: u64,
    pub group: String,
    pub event: String,
    /// Where the probe is, as `%pS` prints it: `do_sys_open+0x0/0xd6`. For a return probe,
    /// the probed function (only its name is printed, as the kernel does).
    pub location: String,
    /// For a return probe, the return address in the caller, as `%pS` prints it
    /// (`ksys_read+0x6b/0xf0`); `None` for a kprobe.
    pub retprobe_caller: Option<String>,
    /// The fetch-args, in the spec's order.
    pub args: Vec<(String, ArgValue)>,
    /// For a return probe, when the call entered the function (same clock as
    /// `timestamp_ns`), where the engine knows it.
    pub entry_timestamp_ns: Option<u64>,
    /// The guest kernel stack at the hit, innermost first, when the event asked for one
    /// (the `stacktrace` trigger); `None` otherwise.
    pub stack: Option<Vec<StackFrame>>,
}

/// One frame of a guest kernel stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackFrame {
    /// The return address (or, for the innermost frame, the probed address).
    pub address: Gva,
    /// `func+0xoff/0xsize` as `%pS` prints it; `None` where no symbol covers the address.
    pub symbol: Option<String>,
}

/// The hit as a line of ftrace's `trace` file, without the newline:
///
/// ```text
///             bash-1447    [001]   1073.249432: myprobe: (do_sys_open+0x0/0xd6) dfd=0x3
/// ```
///
/// `%16s-%-7d [%03d]  %5lu.%06lu: ` (timestamp rounded to the nearest microsecond, as
/// `ns2usecs` does), then `EVENT: (LOCATION)` and ` NAME=VALUE` per argument. A return
/// probe shows `(CALLER_RETURN_SITE <- FUNCTION)`: the kernel prints the return address
/// with its offset and the probed function by name only, so `location` is cut at its `+`.
pub fn ftrace_line(hit: &HitRecord) -> String {
    let mut line = context(hit);
    let _ = write!(line, "{}: (", hit.event);
    match &hit.retprobe_caller {
        Some(caller) => {
            let function = hit.location.split('+').next().unwrap_or(&hit.location);
            let _ = write!(line, "{caller} <- {function})");
        }
        None => {
            let _ = write!(line, "{})", hit.location);
        }
    }
    for (name, value) in &hit.args {
        let _ = write!(line, " {name}={value}");
    }
    line
}

/// `trace_print_context`: `%16s-%-7d [%03d]  %5lu.%06lu: `, the timestamp rounded to the
/// nearest microsecond, as `ns2usecs` does.
pub fn context(hit: &HitRecord) -> String {
    let micros = (u128::from(hit.timestamp_ns) + 500) / 1000;
    let (secs, usecs) = (micros / 1_000_000, micros % 1_000_000);
    format!(
        "{:>16}-{:<7} [{:03}]  {:>5}.{:06}: ",
        escape_guest_text(&hit.comm),
        hit.pid,
        hit.cpu,
        secs,
        usecs
    )
}

/// The hit's lines in ftrace's `trace` file, without the last newline: the event's line,
/// then, when it carries a kernel stack, the stack entry the `stacktrace` trigger adds
/// after it (`trace_stack_print`: the context and `<stack trace>`, then ` => ` and a
/// frame per line). A frame is its function's name (`kallsyms_lookup`'s: a module's
/// without its module), or `func+0xoff/0xsize` (`func+0xoff/0xsize [mod]`) with
/// `sym_offset` (ftrace's `sym-offset` option); `0x%08lx` where no symbol covers it.
pub fn ftrace_text(hit: &HitRecord, sym_offset: bool) -> String {
    let mut text = ftrace_line(hit);
    if let Some(stack) = &hit.stack {
        text.push('\n');
        text.push_str(&context(hit));
        text.push_str("<stack trace>");
        for frame in stack {
            text.push_str("\n => ");
            match &frame.symbol {
                Some(s) if sym_offset => text.push_str(s),
                Some(s) => text.push_str(s.split('+').next().unwrap_or(s)),
                None => {
                    let _ = write!(text, "{:#010x}", frame.address.0);
                }
            }
        }
    }
    text
}

/// The hit as one JSON object, without the newline. Fields, in this order: `comm`, `pid`,
/// `cpu`, `timestamp_ns`, `group`, `event`, `location`, `retprobe_caller` (`null` for a
/// kprobe), `args` (an object in the spec's order; values as [`ArgValue::to_json`]), and
/// `stack` when the hit carries a kernel stack: an array of `{"address","symbol"}`,
/// innermost first (`symbol` is `func+0xoff/0xsize`, or null).
pub fn json_line(hit: &HitRecord) -> String {
    // Written by hand so that the args keep their order whatever serde_json's map is.
    let s = |v: &str| serde_json::Value::from(v).to_string();
    let mut line = format!(
        "{{\"comm\":{},\"pid\":{},\"cpu\":{},\"timestamp_ns\":{},\"group\":{},\"event\":{},\"location\":{},\
         \"retprobe_caller\":{},\"args\":{{",
        s(&hit.comm),
        hit.pid,
        hit.cpu,
        hit.timestamp_ns,
        s(&hit.group),
        s(&hit.event),
        s(&hit.location),
        hit.retprobe_caller.as_deref().map_or_else(|| "null".to_owned(), s),
    );
    for (i, (name, value)) in hit.args.iter().enumerate() {
        if i > 0 {
            line.push(',');
        }
        let _ = write!(line, "{}:{}", s(name), value.to_json());
    }
    line.push('}');
    if let Some(stack) = &hit.stack {
        let frames: Vec<serde_json::Value> = stack
            .iter()
            .map(|f| serde_json::json!({ "address": format!("{:#x}", f.address.0), "symbol": f.symbol }))
            .collect();
        let _ = write!(line, ",\"stack\":{}", serde_json::Value::from(frames));
    }
    line.push('}');
    line
}

/// The kind column of the listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListKind {
    /// `k`
    Kprobe,
    /// `r`
    Kretprobe,
    /// `w`: a watch (a debug register; hvprobe's, the kernel's list has none).
    Watch,
}

impl ListKind {
    /// The letter the kernel prints.
    pub const fn letter(self) -> char {
        match self {
            ListKind::Kprobe => 'k',
            ListKind::Kretprobe => 'r',
            ListKind::Watch => 'w',
        }
    }
}

/// One registered probe, for the listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListEntry {
    pub address: Gva,
    pub kind: ListKind,
    /// `sym+0xoff`, as the kernel prints it (`%s+0x%x`).
    pub location: String,
    pub disabled: bool,
    /// On an address that is no longer valid.
    pub gone: bool,
    pub ftrace: bool,
    pub optimized: bool,
    pub hits: u64,
    pub nmissed: u64,
    /// Hits the probe's event detour discarded in the guest with the event's filter
    /// (counted in `hits`, as every filtered-out hit).
    pub filtered_in_guest: u64,
    /// `GRP/EVENT`, the name the probe was registered under.
    pub event: String,
    /// Why the probe is not jump-optimized, while optimization is on.
    pub not_optimized: Option<String>,
    /// An optimized return probe whose calls are followed on the host (its entry's detour
    /// traps, and so does its return): why it is not exit-free.
    pub return_trapped: Option<String>,
    /// The module the probe is in (`MOD:SYM` probes).
    pub module: Option<String>,
    /// A module probe whose module is not loaded (yet, or again): no address, nothing in
    /// the text. The kernel does not list these; hvprobe lists them `[PENDING]`.
    pub pending: bool,
}

/// The debugfs `kprobes/list` line, without the newline, exactly as `report_probe` prints
/// it: `%px  %s  %s+0x%x  %s ` (the last column is the module, a blank outside modules)
/// then the flags, unseparated, in the kernel's order `[GONE]`, `[DISABLED]` (not shown
/// when gone), `[OPTIMIZED]`, `[FTRACE]`; a module probe waiting for its module (which
/// the kernel does not list) is `[PENDING]` at address 0:
///
/// ```text
/// ffffffff81234560  k  do_sys_open+0x0    [DISABLED]
/// ffffffffc0002010  k  hvprobe_test_work+0x0  hvprobe_test [GONE]
/// ```
pub fn kernel_listing_line(entry: &ListEntry) -> String {
    let mut line = format!(
        "{:016x}  {}  {}  {} ",
        entry.address.0,
        entry.kind.letter(),
        entry.location,
        entry.module.as_deref().unwrap_or(" ")
    );
    if entry.pending {
        line.push_str("[PENDING]");
    }
    if entry.gone {
        line.push_str("[GONE]");
    }
    if entry.disabled && !entry.gone {
        line.push_str("[DISABLED]");
    }
    if entry.optimized {
        line.push_str("[OPTIMIZED]");
    }
    if entry.ftrace {
        line.push_str("[FTRACE]");
    }
    line
}

/// [`kernel_listing_line`] with three columns the kernel does not have appended (its
/// counters are in `kprobe_profile`, its event names in `kprobe_events`): `hits=N
/// nmissed=M event=GRP/EVENT`, separated from the flags by a space (the kernel's line
/// already ends in spaces when there are no flags):
///
/// ```text
/// ffffffff81234560  k  do_sys_open+0x0    [DISABLED] hits=3 nmissed=0 event=kprobes/p_do_sys_open_0
/// ffffffff81234560  r  do_sys_open+0x0    hits=3 nmissed=0 event=kprobes/r_do_sys_open_0
/// ```
pub fn listing_line(entry: &ListEntry) -> String {
    let mut line = kernel_listing_line(entry);
    if !line.ends_with(' ') {
        line.push(' ');
    }
    let _ = write!(
        line,
        "hits={} nmissed={} event={}",
        entry.hits, entry.nmissed, entry.event
    );
    if let Some(why) = &entry.not_optimized {
        let _ = write!(line, " (not optimized: {why})");
    }
    if let Some(why) = &entry.return_trapped {
        let _ = write!(line, " (return trapped: {why})");
    }
    line
}

#[cfg(test)]
mod tests;
