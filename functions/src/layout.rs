//! The function and function_graph tracers' layouts, from the hits of the probes a run
//! puts on each traced function.
//!
//! A run's function tracer is one kprobe event, [`GROUP`]/[`FUNCTION_EVENT`], with a probe
//! at every traced function's entry recording `parent` (the return address, `$stack0`);
//! the function-graph tracer adds [`GROUP`]/[`GRAPH_EXIT_EVENT`], a return probe on each
//! (its hit carries the call's entry time), and names its entries
//! [`GRAPH_ENTRY_EVENT`] — ftrace's own event names (`ftrace:function`,
//! `ftrace:funcgraph_entry`, `ftrace:funcgraph_exit`).
//!
//! - [`function_line`]: `trace_fn_trace`'s line, `CONTEXT func <-parent`.
//! - [`GraphPrinter`]: `print_graph_function`'s layout (`kernel/trace/trace_functions_graph.c`):
//!   the CPU column, the duration with its overhead mark, `func() {` / `}` nested two
//!   spaces a level, a leaf call as `func();` when its return is the next hit of its CPU,
//!   the context-switch block when a CPU's task changes, other events as `/* … */`
//!   comments at the depth they happened, and the options `funcgraph-proc`,
//!   `funcgraph-abstime`, `funcgraph-tail`, `funcgraph-duration`, `funcgraph-overhead`,
//!   `funcgraph-cpu`, `max_graph_depth`, `set_graph_function` and `set_graph_notrace`.
//!   Depth is kept per task (ftrace keeps it in each task's return stack), so a task that
//!   moves to another CPU in a call closes it at the depth it opened it.

use std::collections::HashMap;
use std::fmt::Write as _;

use hvprobe_spec::fetch::ArgValue;
use hvprobe_spec::output::{context, escape_guest_text, HitRecord};

use crate::filter::GlobList;

/// The group of the tracers' events.
pub const GROUP: &str = "ftrace";
/// The function tracer's entry event.
pub const FUNCTION_EVENT: &str = "function";
/// The function-graph tracer's entry event.
pub const GRAPH_ENTRY_EVENT: &str = "funcgraph_entry";
/// The function-graph tracer's return event.
pub const GRAPH_EXIT_EVENT: &str = "funcgraph_exit";
/// The entry probes' one fetch-arg: the return address into the caller.
pub const PARENT_ARG: &str = "parent";
/// The return probes' fetch-arg with the return value (`$retval`), when asked for.
pub const RETVAL_ARG: &str = "retval";

/// `TRACE_GRAPH_INDENT`: spaces per level of nesting.
const INDENT: usize = 2;
/// `TRACE_GRAPH_PROCINFO_LENGTH`: the width `comm-pid` is centred in.
const PROCINFO_LENGTH: usize = 14;

/// What a hit of the tracers' events is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FunctionHit<'a> {
    Entry { function: &'a str },
    Exit { function: &'a str },
}

impl<'a> FunctionHit<'a> {
    /// The tracer's view of `hit`, or `None` for another event's hit.
    pub fn of(hit: &'a HitRecord) -> Option<Self> {
        if hit.group != GROUP {
            return None;
        }
        let function = hit.location.split('+').next().unwrap_or(&hit.location);
        match hit.event.as_str() {
            FUNCTION_EVENT | GRAPH_ENTRY_EVENT if hit.retprobe_caller.is_none() => {
                Some(FunctionHit::Entry { function })
            }
            GRAPH_EXIT_EVENT if hit.retprobe_caller.is_some() => Some(FunctionHit::Exit { function }),
            _ => None,
        }
    }
}

/// `%ps` (or `%pS` with `sym_offset`) of the entry's `parent`.
fn parent_of(hit: &HitRecord, sym_offset: bool) -> String {
    match hit.args.iter().find(|(name, _)| name == PARENT_ARG).map(|(_, v)| v) {
        Some(ArgValue::Symbol {
            description: Some(d), ..
        }) if !sym_offset => d.split('+').next().unwrap_or(d).to_owned(),
        Some(value) => value.to_string(),
        None => "0x0".to_owned(),
    }
}

/// The function tracer's header, as its `trace` file starts (irq-info off: the host does
/// not know the guest's irq and preemption state at a hit).
pub const FUNCTION_HEADER: &str = "# tracer: function\n#\n#           TASK-PID     CPU#     TIMESTAMP  FUNCTION\n#              | |         |         |         |";

/// The function tracer's line for an entry hit: `CONTEXT func <-parent`.
pub fn function_line(hit: &HitRecord, sym_offset: bool) -> String {
    let function = hit.location.split('+').next().unwrap_or(&hit.location);
    let mut line = context(hit);
    let _ = write!(line, "{function} <-{}", parent_of(hit, sym_offset));
    line
}

/// The function_graph tracer's display options (its `funcgraph-*` tracer options) and
/// filters applied on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphOptions {
    /// The CPU column (`funcgraph-cpu`, on by default).
    pub cpu: bool,
    /// `comm-pid` (`funcgraph-proc`).
    pub proc: bool,
    /// The duration column (`funcgraph-duration`, on by default).
    pub duration: bool,
    /// The `+ ! # * @ $` marks (`funcgraph-overhead`, on by default).
    pub overhead: bool,
    /// The entry's time (`funcgraph-abstime`).
    pub abstime: bool,
    /// `} /* func */` on every close (`funcgraph-tail`).
    pub tail: bool,
    /// `max_graph_depth`: calls this deep or deeper are not shown (0: no limit).
    pub max_depth: usize,
    /// `set_graph_function`: show only inside calls of these (empty: everywhere).
    pub graph_functions: GlobList,
    /// `set_graph_notrace`: do not show these calls, nor anything inside them.
    pub graph_notrace: GlobList,
    /// How many vCPUs the guest has (the CPU column's width).
    pub cpus: usize,
    /// Each return's value (`funcgraph-retval`, Linux 6.5+): `func(); /* = -22 */`,
    /// `} /* func = 0x0 */`, an error code in decimal, anything else in hex.
    pub retval: bool,
    /// retsnoop's error chains: a graph function's call is shown only when it returned an
    /// error.
    pub errors: ErrorReport,
}

/// What of a graph function's call the error mode shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorReport {
    /// Every call (no error mode).
    #[default]
    Off,
    /// The whole call tree, when the call failed; the first failure in it marked.
    Trees,
    /// Only the returns that failed, nested as they were (retsnoop's `--errors-only`'s
    /// chain).
    Chain,
}

/// A return probe's hit's `retval`, when it fetched one.
fn returned_value(hit: &HitRecord) -> Option<u64> {
    hit.args.iter().find(|(n, _)| n == RETVAL_ARG).map(|(_, v)| match v {
        ArgValue::Unsigned(v) | ArgValue::Hex(v) => *v,
        ArgValue::Signed(v) => *v as u64,
        _ => 0,
    })
}

/// The error code a function returned, as `funcgraph-retval` reads one from `rax`: a
/// value in `-MAX_ERRNO..-1`, as a long or as an int (its upper half zero).
pub fn error_code(retval: u64) -> Option<i64> {
    const MAX_ERRNO: i64 = 4095;
    let long = retval as i64;
    if (-MAX_ERRNO..0).contains(&long) {
        return Some(long);
    }
    let int = i64::from(retval as u32 as i32);
    (retval >> 32 == 0 && (-MAX_ERRNO..0).contains(&int)).then_some(int)
}

impl Default for GraphOptions {
    fn default() -> Self {
        GraphOptions {
            cpu: true,
            proc: false,
            duration: true,
            overhead: true,
            abstime: false,
            tail: false,
            max_depth: 0,
            graph_functions: GlobList::default(),
            graph_notrace: GlobList::default(),
            cpus: 1,
            retval: false,
            errors: ErrorReport::Off,
        }
    }
}

/// One call the graph is inside, in its task.
#[derive(Clone, Debug)]
struct OpenCall {
    function: String,
    entered_ns: u64,
    /// Shown (its entry printed), so its close is printed too.
    shown: bool,
}

/// A task's calls, innermost last.
#[derive(Clone, Debug, Default)]
struct TaskCalls {
    calls: Vec<OpenCall>,
    /// The depth of the outermost graph function it is inside (`set_graph_function`).
    graph_base: Option<usize>,
    /// The depth of the graph-notrace call it is inside.
    hidden_from: Option<usize>,
    /// Error mode: the lines of its graph function's call so far, and whether a call in
    /// it failed yet (the first failure is marked).
    held_lines: String,
    failed: bool,
}

/// An entry held back until the next hit of its CPU shows whether it is a leaf.
#[derive(Clone, Debug)]
struct Pending {
    hit: HitRecord,
    depth: usize,
}

/// Turns the tracers' hits (and other events' hits) into function_graph's lines.
#[derive(Debug)]
pub struct GraphPrinter {
    options: GraphOptions,
    tasks: HashMap<i32, TaskCalls>,
    /// Per CPU: the last task seen, and its entry waiting for its next hit.
    last_pid: HashMap<usize, i32>,
    pending: HashMap<u64, Pending>,
    /// Per CPU: the depth comments are shown at (ftrace's `cpu_data->depth`).
    comment_depth: HashMap<usize, usize>,
    /// Each task's name as its last hit gave it (the context-switch block names both).
    comms: HashMap<i32, String>,
    header_done: bool,
}

impl GraphPrinter {
    pub fn new(options: GraphOptions) -> Self {
        GraphPrinter {
            options,
            tasks: HashMap::new(),
            last_pid: HashMap::new(),
            pending: HashMap::new(),
            comment_depth: HashMap::new(),
            comms: HashMap::new(),
            header_done: false,
        }
    }

    /// The header ftrace's `trace` file starts with (`__print_graph_headers_flags`).
    pub fn header(&self) -> String {
        let o = &self.options;
        let mut first = String::from("# tracer: function_graph\n#\n#");
        let mut second = String::from("#");
        if o.abstime {
            first.push_str("     TIME       ");
            second.push_str("      |         ");
        }
        if o.cpu {
            first.push_str(" CPU");
            second.push_str(" |  ");
        }
        if o.proc {
            first.push_str("  TASK/PID       ");
            second.push_str("   |    |        ");
        }
        if o.duration {
            first.push_str("  DURATION   ");
            second.push_str("   |   |      ");
        }
        first.push_str("               FUNCTION CALLS\n");
        second.push_str("               |   |   |   |");
        first + &second
    }

    /// The lines `hit` makes (none, or several), each ending in a newline. `other_line`
    /// is how a hit of another event prints, for its comment.
    pub fn push(&mut self, hit: &HitRecord, other_line: impl FnOnce(&HitRecord) -> String) -> String {
        let mut out = String::new();
        if !self.header_done {
            self.header_done = true;
            out.push_str(&self.header());
            out.push('\n');
        }
        if self.comms.get(&hit.pid) != Some(&hit.comm) {
            self.comms.insert(hit.pid, hit.comm.clone());
        }
        let mut lines = String::new();
        let mut base_closed = false;
        let key = self.pending_key(hit);
        match FunctionHit::of(hit) {
            Some(FunctionHit::Entry { function }) => {
                if let Some(depth) = self.enter(hit, function) {
                    self.resolve_pending(&mut lines, hit);
                    self.switch_if_new_task(&mut lines, hit);
                    self.pending.insert(
                        key,
                        Pending {
                            hit: hit.clone(),
                            depth,
                        },
                    );
                }
            }
            Some(FunctionHit::Exit { function }) => {
                let (shown, closed) = self.leave(hit, function);
                base_closed = closed;
                if let Some((depth, entered_ns)) = shown {
                    let duration = hit
                        .timestamp_ns
                        .saturating_sub(hit.entry_timestamp_ns.unwrap_or(entered_ns));
                    let returned = self.returned(hit);
                    let leaf = self.pending.get(&key).is_some_and(|p| {
                        p.hit.pid == hit.pid && p.depth == depth && p.hit.location.split('+').next() == Some(function)
                    });
                    if leaf {
                        let pending = self.pending.remove(&key).expect("checked above");
                        self.leaf(&mut lines, &pending, duration, returned);
                    } else {
                        self.resolve_pending(&mut lines, hit);
                        self.close(&mut lines, hit, function, depth, duration, returned);
                    }
                }
            }
            None => {
                self.resolve_pending(&mut out, hit);
                self.comment(&mut out, hit, other_line(hit));
                return out;
            }
        }
        if self.options.errors == ErrorReport::Off {
            out.push_str(&lines);
            return out;
        }
        // Error mode: a task's lines wait for its graph function's return.
        let errors = self.options.errors;
        let task = self.tasks.entry(hit.pid).or_default();
        task.held_lines.push_str(&lines);
        if base_closed {
            let held = std::mem::take(&mut task.held_lines);
            task.failed = false;
            // Shown when the graph function's own call failed, as retsnoop reports a
            // failing entry function (a failure inside that it recovered from is not one).
            if returned_value(hit).and_then(error_code).is_some() {
                match errors {
                    ErrorReport::Chain => {
                        for line in held.lines().filter(|l| l.contains(" = -")) {
                            out.push_str(line);
                            out.push('\n');
                        }
                    }
                    _ => out.push_str(&held),
                }
            }
        }
        out
    }

    /// Where an entry waits to be found a leaf: its CPU's next hit, or in error mode its
    /// task's (whose lines are kept apart).
    fn pending_key(&self, hit: &HitRecord) -> u64 {
        match self.options.errors {
            ErrorReport::Off => hit.cpu as u64,
            _ => (1 << 32) | u64::from(hit.pid as u32),
        }
    }

    /// The return value's comment text, when the options show it (`= -22`, `= 0x0`),
    /// and whether it is the first error of the task's graph call.
    fn returned(&mut self, hit: &HitRecord) -> Option<String> {
        if !self.options.retval && self.options.errors == ErrorReport::Off {
            return None;
        }
        let value = returned_value(hit)?;
        let code = error_code(value);
        let task = self.tasks.entry(hit.pid).or_default();
        let first = code.is_some() && !task.failed;
        task.failed |= code.is_some();
        Some(match (code, first && self.options.errors == ErrorReport::Trees) {
            (Some(code), true) => format!("= {code}, the first error"),
            (Some(code), false) => format!("= {code}"),
            (None, _) => format!("= {value:#x}"),
        })
    }

    /// Lines of entries still held (at the run's end, or when hits stop for a while).
    pub fn flush(&mut self) -> String {
        let mut out = String::new();
        let mut held: Vec<Pending> = self.pending.drain().map(|(_, p)| p).collect();
        held.sort_by_key(|p| p.hit.timestamp_ns);
        for pending in held {
            self.nested(&mut out, &pending);
        }
        out
    }

    /// Prints, as calls that go on, the entries held on `hit`'s CPU and those of its task
    /// held on other CPUs (it moved): a shown hit follows them.
    fn resolve_pending(&mut self, out: &mut String, hit: &HitRecord) {
        let key = self.pending_key(hit);
        let mut held: Vec<u64> = self
            .pending
            .iter()
            .filter(|(&k, p)| k == key || p.hit.pid == hit.pid)
            .map(|(&k, _)| k)
            .collect();
        held.sort_unstable();
        for k in held {
            if let Some(pending) = self.pending.remove(&k) {
                self.nested(out, &pending);
            }
        }
    }

    /// The task enters `function`: its depth as shown, or `None` when it is not shown.
    fn enter(&mut self, hit: &HitRecord, function: &str) -> Option<usize> {
        let o = &self.options;
        let task = self.tasks.entry(hit.pid).or_default();
        let depth = task.calls.len();
        let in_graph = o.graph_functions.is_empty()
            || task.graph_base.is_some()
            || (o.graph_functions.mentions(function) && o.graph_functions.chooses(function));
        if in_graph && task.graph_base.is_none() && (!o.graph_functions.is_empty() || o.errors != ErrorReport::Off) {
            task.graph_base = Some(depth);
        }
        if task.hidden_from.is_none() && o.graph_notrace.mentions(function) && o.graph_notrace.chooses(function) {
            task.hidden_from = Some(depth);
        }
        let shown_depth = depth - task.graph_base.unwrap_or(0);
        let shown = in_graph && task.hidden_from.is_none() && (o.max_depth == 0 || shown_depth < o.max_depth);
        task.calls.push(OpenCall {
            function: function.to_owned(),
            entered_ns: hit.timestamp_ns,
            shown,
        });
        shown.then_some(shown_depth)
    }

    /// The task returns from `function`: the call's depth as shown and its entry time
    /// (`None` when it was not shown, or its entry was never seen), and whether this
    /// closed the graph function's call it was in.
    fn leave(&mut self, hit: &HitRecord, function: &str) -> (Option<(usize, u64)>, bool) {
        let task = self.tasks.entry(hit.pid).or_default();
        // The innermost open call of this function: calls above it lost their returns.
        let Some(at) = task.calls.iter().rposition(|c| c.function == function) else {
            return (None, false);
        };
        let call = task.calls[at].clone();
        task.calls.truncate(at);
        let shown_depth = at - task.graph_base.unwrap_or(0).min(at);
        let base_closed = task.graph_base.is_some_and(|b| at <= b);
        if base_closed {
            task.graph_base = None;
        }
        if task.hidden_from.is_some_and(|h| at <= h) {
            task.hidden_from = None;
        }
        (call.shown.then_some((shown_depth, call.entered_ns)), base_closed)
    }

    fn close(
        &mut self,
        out: &mut String,
        hit: &HitRecord,
        function: &str,
        depth: usize,
        duration_ns: u64,
        returned: Option<String>,
    ) {
        self.switch_if_new_task(out, hit);
        self.prologue(out, hit);
        self.duration(out, Some(duration_ns));
        out.push_str(&" ".repeat(depth * INDENT));
        match returned {
            Some(value) => {
                let _ = writeln!(out, "}} /* {function} {value} */");
            }
            None if self.options.tail => {
                let _ = writeln!(out, "}} /* {function} */");
            }
            None => out.push_str("}\n"),
        }
        self.comment_depth.insert(hit.cpu, depth.saturating_sub(1));
    }

    fn leaf(&mut self, out: &mut String, pending: &Pending, duration_ns: u64, returned: Option<String>) {
        let function = pending.hit.location.split('+').next().unwrap_or(&pending.hit.location);
        self.prologue(out, &pending.hit);
        self.duration(out, Some(duration_ns));
        out.push_str(&" ".repeat(pending.depth * INDENT));
        match returned {
            Some(value) => {
                let _ = writeln!(out, "{function}(); /* {value} */");
            }
            None => {
                let _ = writeln!(out, "{function}();");
            }
        }
        self.comment_depth
            .insert(pending.hit.cpu, pending.depth.saturating_sub(1));
    }

    fn nested(&mut self, out: &mut String, pending: &Pending) {
        let function = pending.hit.location.split('+').next().unwrap_or(&pending.hit.location);
        self.prologue(out, &pending.hit);
        self.duration(out, None);
        out.push_str(&" ".repeat(pending.depth * INDENT));
        let _ = writeln!(out, "{function}() {{");
        self.comment_depth.insert(pending.hit.cpu, pending.depth);
    }

    fn comment(&mut self, out: &mut String, hit: &HitRecord, text: String) {
        self.switch_if_new_task(out, hit);
        self.prologue(out, hit);
        self.duration(out, None);
        let depth = self.comment_depth.get(&hit.cpu).copied().unwrap_or(0);
        if depth > 0 {
            out.push_str(&" ".repeat((depth + 1) * INDENT));
        }
        // The event's own line without its context, as `print_graph_comment` prints it.
        let context_len = context(hit).len();
        let body = text.get(context_len..).unwrap_or(&text);
        let _ = writeln!(out, "/* {} */", body.trim_end_matches('\n'));
    }

    /// `verif_pid`: the context-switch block when the CPU's task changed.
    fn switch_if_new_task(&mut self, out: &mut String, hit: &HitRecord) {
        // Error mode prints a task's calls together, later: a CPU's switches mean nothing there.
        if self.options.errors != ErrorReport::Off {
            return;
        }
        let previous = self.last_pid.insert(hit.cpu, hit.pid);
        let Some(previous) = previous.filter(|&p| p != hit.pid) else {
            return;
        };
        let previous_comm = self.comm_of(previous);
        out.push_str(" ------------------------------------------\n");
        self.cpu_column(out, hit.cpu);
        out.push_str(&proc_column(&previous_comm, previous));
        out.push_str(" => ");
        out.push_str(&proc_column(&hit.comm, hit.pid));
        out.push_str("\n ------------------------------------------\n\n");
    }

    fn comm_of(&self, pid: i32) -> String {
        self.comms.get(&pid).cloned().unwrap_or_else(|| "<...>".to_owned())
    }

    fn cpu_column(&self, out: &mut String, cpu: usize) {
        let width = self.options.cpus.saturating_sub(1).max(1).to_string().len();
        let _ = write!(out, " {cpu:>width$}) ");
    }

    fn prologue(&self, out: &mut String, hit: &HitRecord) {
        if self.options.abstime {
            let micros = hit.timestamp_ns / 1000;
            let _ = write!(out, "{:5}.{:06} |  ", micros / 1_000_000, micros % 1_000_000);
        }
        if self.options.cpu {
            self.cpu_column(out, hit.cpu);
        }
        if self.options.proc {
            out.push_str(&proc_column(&hit.comm, hit.pid));
            out.push_str(" | ");
        }
    }

    /// `print_graph_duration`: the mark and the time, or the column's blanks.
    fn duration(&self, out: &mut String, duration_ns: Option<u64>) {
        if !self.options.duration {
            return;
        }
        let Some(ns) = duration_ns else {
            out.push_str("              |  ");
            return;
        };
        if self.options.overhead {
            let _ = write!(out, "{} ", mark(ns));
        } else {
            out.push_str("  ");
        }
        out.push_str(&graph_duration(ns));
        out.push_str("|  ");
    }
}

/// `print_graph_proc`: `comm-pid` (comm cut to 7 bytes) centred in 14 columns.
fn proc_column(comm: &str, pid: i32) -> String {
    let comm: String = escape_guest_text(comm).chars().take(7).collect();
    let text = format!("{comm}-{pid}");
    let spaces = PROCINFO_LENGTH.saturating_sub(text.len());
    format!("{}{text}{}", " ".repeat(spaces / 2), " ".repeat(spaces - spaces / 2))
}

/// `trace_find_mark`: how long a call took, as one character.
pub fn mark(duration_ns: u64) -> char {
    const MARKS: [(u64, char); 6] = [
        (1_000_000_000, '$'),
        (100_000_000, '@'),
        (10_000_000, '*'),
        (1_000_000, '#'),
        (100_000, '!'),
        (10_000, '+'),
    ];
    MARKS
        .iter()
        .find(|(limit, _)| duration_ns > *limit)
        .map_or(' ', |(_, c)| *c)
}

/// `trace_print_graph_duration`: microseconds with up to three decimals (no more than 7
/// digits in all), ` us `, padded to the column.
pub fn graph_duration(duration_ns: u64) -> String {
    let (usecs, nsecs) = (duration_ns / 1000, duration_ns % 1000);
    let usecs_text = usecs.to_string();
    let mut out = usecs_text.clone();
    let mut len = usecs_text.len();
    if len < 7 {
        // snprintf("%03lu") into min(5, 8 - len) bytes: at most 8 - len - 1 digits.
        let digits = (8 - len).min(5) - 1;
        let nsecs_text = format!("{nsecs:03}");
        let cut = &nsecs_text[..digits.min(nsecs_text.len())];
        out.push('.');
        out.push_str(cut);
        len += cut.len() + 1;
    }
    out.push_str(" us ");
    for _ in len..8 {
        out.push(' ');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(cpu: usize, pid: i32, ns: u64, event: &str, function: &str) -> HitRecord {
        HitRecord {
            comm: "sh".to_owned(),
            pid,
            cpu,
            timestamp_ns: ns,
            group: GROUP.to_owned(),
            event: event.to_owned(),
            location: format!("{function}+0x0/0x100"),
            retprobe_caller: (event == GRAPH_EXIT_EVENT).then(|| "caller+0x10/0x40".to_owned()),
            args: if event == GRAPH_EXIT_EVENT {
                vec![]
            } else {
                vec![(
                    PARENT_ARG.to_owned(),
                    ArgValue::Symbol {
                        address: 0xffff_ffff_8100_0010,
                        description: Some("ksys_read+0x6b/0xf0".to_owned()),
                    },
                )]
            },
            entry_timestamp_ns: None,
            stack: None,
        }
    }

    fn graph(events: &[HitRecord], options: GraphOptions) -> String {
        let mut printer = GraphPrinter::new(options);
        let mut out = String::new();
        for e in events {
            out.push_str(&printer.push(e, |h| format!("{}probe: (x)", context(h))));
        }
        out.push_str(&printer.flush());
        out.lines().skip(4).map(|l| format!("{l}\n")).collect()
    }

    #[test]
    fn the_function_line_is_ftraces() {
        let line = function_line(&hit(1, 42, 1_073_249_432_000, FUNCTION_EVENT, "vfs_read"), false);
        assert_eq!(
            line,
            "              sh-42      [001]   1073.249432: vfs_read <-ksys_read"
        );
        let with_offset = function_line(&hit(1, 42, 1_000, FUNCTION_EVENT, "vfs_read"), true);
        assert!(with_offset.ends_with("vfs_read <-ksys_read+0x6b/0xf0"), "{with_offset}");
    }

    #[test]
    fn durations_and_marks_are_ftraces() {
        assert_eq!(graph_duration(417), "0.417 us    ");
        assert_eq!(graph_duration(2_100), "2.100 us    ");
        assert_eq!(graph_duration(12_345_678), "12345.67 us ");
        assert_eq!(graph_duration(1_234_567_890), "1234567 us  ");
        assert_eq!(mark(10_000), ' ');
        assert_eq!(mark(10_001), '+');
        assert_eq!(mark(150_000), '!');
        assert_eq!(mark(2_000_000), '#');
        assert_eq!(mark(2_000_000_000), '$');
    }

    #[test]
    fn calls_nest_and_a_call_returning_next_is_a_leaf() {
        let events = [
            hit(0, 7, 1_000, GRAPH_ENTRY_EVENT, "vfs_read"),
            hit(0, 7, 1_200, GRAPH_ENTRY_EVENT, "rw_verify_area"),
            hit(0, 7, 1_617, GRAPH_EXIT_EVENT, "rw_verify_area"),
            hit(0, 7, 3_100, GRAPH_EXIT_EVENT, "vfs_read"),
        ];
        assert_eq!(
            graph(&events, GraphOptions::default()),
            " 0)               |  vfs_read() {\n \
             0)   0.417 us    |    rw_verify_area();\n \
             0)   2.100 us    |  }\n"
        );
    }

    #[test]
    fn the_header_has_the_columns_of_the_options() {
        let printer = GraphPrinter::new(GraphOptions::default());
        assert_eq!(
            printer.header(),
            "# tracer: function_graph\n#\n# CPU  DURATION                  FUNCTION CALLS\n# |     |   |                     |   |   |   |"
        );
    }

    #[test]
    fn graph_functions_limit_what_is_shown_and_depth_starts_at_them() {
        let options = GraphOptions {
            graph_functions: GlobList::parse(&["vfs_read"]).unwrap(),
            tail: true,
            ..Default::default()
        };
        let events = [
            hit(0, 7, 0, GRAPH_ENTRY_EVENT, "ksys_read"),
            hit(0, 7, 1_000, GRAPH_ENTRY_EVENT, "vfs_read"),
            hit(0, 7, 1_100, GRAPH_ENTRY_EVENT, "a"),
            hit(0, 7, 1_200, GRAPH_ENTRY_EVENT, "b"),
            hit(0, 7, 1_300, GRAPH_EXIT_EVENT, "b"),
            hit(0, 7, 1_400, GRAPH_EXIT_EVENT, "a"),
            hit(0, 7, 1_500, GRAPH_EXIT_EVENT, "vfs_read"),
            hit(0, 7, 1_600, GRAPH_ENTRY_EVENT, "c"),
            hit(0, 7, 1_700, GRAPH_EXIT_EVENT, "c"),
            hit(0, 7, 1_800, GRAPH_EXIT_EVENT, "ksys_read"),
        ];
        let out = graph(&events, options);
        assert_eq!(
            out,
            " 0)               |  vfs_read() {\n \
             0)               |    a() {\n \
             0)   0.100 us    |      b();\n \
             0)   0.300 us    |    } /* a */\n \
             0)   0.500 us    |  } /* vfs_read */\n"
        );
    }

    #[test]
    fn max_depth_and_graph_notrace_hide_calls_and_what_is_inside_them() {
        let events = [
            hit(0, 7, 0, GRAPH_ENTRY_EVENT, "outer"),
            hit(0, 7, 10, GRAPH_ENTRY_EVENT, "hidden"),
            hit(0, 7, 20, GRAPH_ENTRY_EVENT, "inside_hidden"),
            hit(0, 7, 30, GRAPH_EXIT_EVENT, "inside_hidden"),
            hit(0, 7, 40, GRAPH_EXIT_EVENT, "hidden"),
            hit(0, 7, 50, GRAPH_ENTRY_EVENT, "shown"),
            hit(0, 7, 60, GRAPH_ENTRY_EVENT, "too_deep"),
            hit(0, 7, 70, GRAPH_EXIT_EVENT, "too_deep"),
            hit(0, 7, 80, GRAPH_EXIT_EVENT, "shown"),
            hit(0, 7, 90, GRAPH_EXIT_EVENT, "outer"),
        ];
        let options = GraphOptions {
            graph_notrace: GlobList::parse(&["hidden"]).unwrap(),
            max_depth: 2,
            ..Default::default()
        };
        let out = graph(&events, options);
        let functions: Vec<&str> = out.lines().map(|l| l.split('|').nth(1).unwrap().trim()).collect();
        assert_eq!(functions, ["outer() {", "shown();", "}"]);
    }

    #[test]
    fn a_new_task_on_a_cpu_gets_the_context_switch_block_and_other_events_are_comments() {
        let mut other = hit(0, 9, 500, "p_x", "x");
        other.group = "kprobes".to_owned();
        let events = [
            hit(0, 7, 0, GRAPH_ENTRY_EVENT, "schedule"),
            other,
            hit(0, 7, 900, GRAPH_EXIT_EVENT, "schedule"),
        ];
        let out = graph(&events, GraphOptions::default());
        assert_eq!(
            out,
            " 0)               |  schedule() {\n \
             ------------------------------------------\n \
             0)      sh-7      =>      sh-9     \n \
             ------------------------------------------\n\
             \n \
             0)               |  /* probe: (x) */\n \
             ------------------------------------------\n \
             0)      sh-9      =>      sh-7     \n \
             ------------------------------------------\n\
             \n \
             0)   0.900 us    |  }\n"
        );
    }

    fn exit_with(cpu: usize, pid: i32, ns: u64, function: &str, retval: u64) -> HitRecord {
        let mut h = hit(cpu, pid, ns, GRAPH_EXIT_EVENT, function);
        h.args = vec![(RETVAL_ARG.to_owned(), ArgValue::Hex(retval))];
        h
    }

    #[test]
    fn error_codes_are_longs_or_ints_in_the_errno_range() {
        assert_eq!(error_code(-22i64 as u64), Some(-22));
        assert_eq!(error_code(0xffff_ffea), Some(-22), "an int's -EINVAL, upper half zero");
        assert_eq!(error_code(0), None);
        assert_eq!(error_code(-4096i64 as u64), None);
        assert_eq!(error_code(0xffff_8880_0000_1000), None, "a pointer");
        assert_eq!(error_code(0x1234_ffff_ffea), None, "garbage above an int is no int");
    }

    #[test]
    fn retval_is_printed_as_funcgraph_retval_does() {
        let events = [
            hit(0, 7, 0, GRAPH_ENTRY_EVENT, "outer"),
            hit(0, 7, 10, GRAPH_ENTRY_EVENT, "leaf"),
            exit_with(0, 7, 20, "leaf", 0),
            exit_with(0, 7, 30, "outer", -2i64 as u64),
        ];
        let out = graph(
            &events,
            GraphOptions {
                retval: true,
                ..Default::default()
            },
        );
        let shapes: Vec<&str> = out.lines().filter_map(|l| l.split('|').nth(1)).collect();
        assert_eq!(
            shapes,
            ["  outer() {", "    leaf(); /* = 0x0 */", "  } /* outer = -2 */"]
        );
    }

    #[test]
    fn error_mode_shows_a_graph_call_only_when_a_call_in_it_failed() {
        let calls = |pid: i32, failing: bool| {
            vec![
                hit(0, pid, 0, GRAPH_ENTRY_EVENT, "sys"),
                hit(0, pid, 10, GRAPH_ENTRY_EVENT, "ok"),
                exit_with(0, pid, 20, "ok", 0),
                hit(0, pid, 30, GRAPH_ENTRY_EVENT, "check"),
                exit_with(0, pid, 40, "check", if failing { 0xffff_ffea } else { 0 }),
                exit_with(0, pid, 50, "sys", if failing { -22i64 as u64 } else { 3 }),
            ]
        };
        let mut events = calls(7, false);
        events.extend(calls(8, true));
        // An inner failure the graph function recovered from is no error of it.
        let mut recovered = calls(9, true);
        recovered[5] = exit_with(0, 9, 50, "sys", 0);
        events.extend(recovered);
        let trees = graph(
            &events,
            GraphOptions {
                errors: ErrorReport::Trees,
                ..Default::default()
            },
        );
        let shapes: Vec<&str> = trees.lines().filter_map(|l| l.split('|').nth(1)).collect();
        assert_eq!(
            shapes,
            [
                "  sys() {",
                "    ok(); /* = 0x0 */",
                "    check(); /* = -22, the first error */",
                "  } /* sys = -22 */"
            ]
        );
        let chain = graph(
            &events,
            GraphOptions {
                errors: ErrorReport::Chain,
                ..Default::default()
            },
        );
        let shapes: Vec<&str> = chain.lines().filter_map(|l| l.split('|').nth(1)).collect();
        assert_eq!(shapes, ["    check(); /* = -22 */", "  } /* sys = -22 */"]);
    }

    #[test]
    fn a_task_that_moved_cpus_closes_its_call_at_the_depth_it_opened_it() {
        let events = [
            hit(0, 7, 0, GRAPH_ENTRY_EVENT, "outer"),
            hit(0, 7, 10, GRAPH_ENTRY_EVENT, "inner"),
            hit(1, 7, 20, GRAPH_ENTRY_EVENT, "leaf"),
            hit(1, 7, 30, GRAPH_EXIT_EVENT, "leaf"),
            hit(1, 7, 40, GRAPH_EXIT_EVENT, "inner"),
            hit(1, 7, 50, GRAPH_EXIT_EVENT, "outer"),
        ];
        let out = graph(
            &events,
            GraphOptions {
                cpus: 2,
                ..Default::default()
            },
        );
        let shapes: Vec<&str> = out.lines().filter_map(|l| l.split('|').nth(1)).collect();
        assert_eq!(
            shapes,
            ["  outer() {", "    inner() {", "      leaf();", "    }", "  }"]
        );
    }

    proptest::proptest! {
        /// Hits come from the guest: any order of entries, returns (lost ones included),
        /// tasks, CPUs and return values, in every mode, prints without a panic.
        #[test]
        fn any_sequence_of_hits_prints(
            events in proptest::collection::vec((0usize..3, 1i32..4, 0usize..5, proptest::bool::ANY, proptest::num::u64::ANY), 0..200),
            errors in 0u8..3,
            max_depth in 0usize..4,
        ) {
            let names = ["a", "b", "c", "d", "e"];
            let options = GraphOptions {
                errors: [ErrorReport::Off, ErrorReport::Trees, ErrorReport::Chain][errors as usize],
                max_depth,
                graph_functions: if errors == 2 { GlobList::parse(&["a"]).unwrap() } else { GlobList::default() },
                retval: true,
                cpus: 3,
                ..Default::default()
            };
            let mut printer = GraphPrinter::new(options);
            for (i, (cpu, pid, f, entry, value)) in events.into_iter().enumerate() {
                let hit = if entry {
                    hit(cpu, pid, i as u64 * 10, GRAPH_ENTRY_EVENT, names[f])
                } else {
                    exit_with(cpu, pid, i as u64 * 10, names[f], value)
                };
                let _ = printer.push(&hit, context);
            }
            let _ = printer.flush();
        }
    }
}
