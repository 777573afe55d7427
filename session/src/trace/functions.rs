//! A run's function tracer (`--tracer function|function_graph`): the kernel's traceable
//! functions read from its vmlinux before the boot, chosen by ftrace's filters, and one
//! entry probe (function_graph: and one return probe) on each, all armed in the pause that
//! arms the run's other probes. Best effort per function: one that cannot be probed is
//! left out and counted with the reason, never failing the others.

use hvprobe_arch::Gva;
use hvprobe_functions::filter::GlobList;
use hvprobe_functions::layout::{
    ErrorReport, GraphOptions, FUNCTION_EVENT, GRAPH_ENTRY_EVENT, GRAPH_EXIT_EVENT, GROUP, PARENT_ARG, RETVAL_ARG,
};
use hvprobe_functions::stats::LatencyUnit;
use hvprobe_functions::{AvailableFunctions, FunctionFilter, Selection};
use hvprobe_probes::spec::{ArgType, FetchArg, FetchExpr};

use super::*;
use crate::options::{FunctionTracerKind, FunctionTracerOptions};

/// How the printer lays out the run's hits.
#[derive(Clone, Debug)]
pub(super) enum PrintMode {
    /// Every hit in its event's own layout.
    Probes,
    /// The function tracer's events as its lines, others as their own.
    Function,
    /// function_graph's layout; other events as comments in it.
    Graph(GraphOptions),
    /// Calls per function, printed at the end.
    Count,
    /// A histogram of the calls' durations, printed at the end.
    Latency(LatencyUnit),
}

/// The functions a run traces and how.
#[derive(Debug)]
pub(super) struct FunctionPlan {
    kind: FunctionTracerKind,
    selection: Selection,
    /// The kernel's table (link-time addresses), for the running kernel's slide.
    available: AvailableFunctions,
    graph: GraphOptions,
    pids: Vec<i32>,
}

impl FunctionPlan {
    /// Reads the kernel's table and applies the filters: a filter that matches nothing,
    /// an unknown option or a kernel without the table fails here, before the boot.
    pub(super) fn new(
        options: &FunctionTracerOptions,
        kernel: &KernelSourceFiles,
        cpus: usize,
    ) -> Result<Self, SessionError> {
        let vmlinux = kernel.vmlinux().ok_or(SessionError::FunctionsWithoutVmlinux)?;
        let available = AvailableFunctions::from_vmlinux_file(&vmlinux)?;
        let filter = FunctionFilter {
            filter: GlobList::parse(&options.filter)?,
            notrace: GlobList::parse(&options.notrace)?,
            graph: GlobList::parse(&options.graph_functions)?,
            graph_notrace: GlobList::parse(&options.graph_notrace)?,
        };
        let selection = filter.select(&available)?;
        if selection.traced.is_empty() {
            return Err(SessionError::NoFunctionTraced(format!(
                "the filters leave none of the kernel's {} functions",
                available.len()
            )));
        }
        let graph = graph_options(options, filter, cpus)?;
        Ok(FunctionPlan {
            kind: options.kind,
            selection,
            graph,
            pids: options.pids.clone(),
            available,
        })
    }

    /// The probes to arm on the running kernel, whose `_text` `symbols` give.
    pub(super) fn probes(&self, symbols: &SymbolTable, cpus: usize) -> Vec<SpecProbe> {
        let slide = self.available.slide_to(symbols);
        let mut probes = Vec::with_capacity(self.selection.traced.len() * 2);
        let retval = self.graph.retval || self.graph.errors != ErrorReport::Off;
        for function in &self.selection.traced {
            let site = Gva(function.site.0.wrapping_add_signed(slide));
            probes.extend(
                function_requests(self.kind, site, cpus, retval)
                    .into_iter()
                    .map(|request| SpecProbe {
                        line: 0,
                        text: function.name.clone(),
                        request,
                    }),
            );
        }
        probes
    }

    /// The line the run prints about what it traces (the denied functions by reason).
    pub(super) fn summary(&self, armed: usize, skipped: &BTreeMap<&'static str, usize>) -> String {
        let mut why: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, reason) in &self.selection.denied {
            *why.entry(reason).or_default() += 1;
        }
        let denied = why.iter().map(|(r, n)| format!("{n} left out: {r}"));
        let refused = skipped.iter().map(|(r, n)| format!("{n} {r}"));
        let reasons: Vec<String> = denied.chain(refused).collect();
        let per_function = match self.kind {
            FunctionTracerKind::FunctionGraph => 2,
            _ => 1,
        };
        format!(
            "{} tracer: {} of the kernel's {} functions chosen, {} traced{}",
            match self.kind {
                FunctionTracerKind::Function => "function",
                FunctionTracerKind::FunctionGraph => "function_graph",
                FunctionTracerKind::FuncCount => "funccount",
                FunctionTracerKind::FuncLatency(_) => "funclatency",
            },
            self.selection.traced.len() + self.selection.denied.len(),
            self.available.len(),
            armed / per_function,
            if reasons.is_empty() {
                String::new()
            } else {
                format!(" ({})", reasons.join(", "))
            }
        )
    }

    pub(super) fn print_mode(&self) -> PrintMode {
        match self.kind {
            FunctionTracerKind::Function => PrintMode::Function,
            FunctionTracerKind::FunctionGraph => PrintMode::Graph(self.graph.clone()),
            FunctionTracerKind::FuncCount => PrintMode::Count,
            FunctionTracerKind::FuncLatency(unit) => PrintMode::Latency(unit),
        }
    }

    pub(super) fn pids(&self) -> &[i32] {
        &self.pids
    }
}

/// The probes a tracer of `kind` puts on the function whose ftrace call is at `site`
/// (run-time address): the entry's (recording the caller, `parent=$stack0`), the
/// return's (recording `retval=$retval` when asked), or both.
pub fn function_requests(kind: FunctionTracerKind, site: Gva, cpus: usize, retval: bool) -> Vec<KprobeRequest> {
    let point = ProbePoint::Address(site);
    let parent = || FetchArg {
        name: PARENT_ARG.to_owned(),
        expr: FetchExpr::StackEntry(0),
        ty: ArgType::Symbol,
        array_len: None,
        typed: false,
    };
    let returned = || FetchArg {
        name: RETVAL_ARG.to_owned(),
        expr: FetchExpr::Retval,
        ty: ArgType::X64,
        array_len: None,
        typed: false,
    };
    let exit = |point: ProbePoint| KprobeRequest {
        kind: ProbeKind::Kretprobe {
            maxactive: default_maxactive(cpus),
        },
        ..KprobeRequest::event(
            point,
            GROUP,
            GRAPH_EXIT_EVENT,
            if retval { vec![returned()] } else { Vec::new() },
        )
    };
    match kind {
        FunctionTracerKind::Function => vec![KprobeRequest::event(point, GROUP, FUNCTION_EVENT, vec![parent()])],
        // Counting needs the calls, not their callers.
        FunctionTracerKind::FuncCount => vec![KprobeRequest::event(point, GROUP, FUNCTION_EVENT, Vec::new())],
        // A return's hit carries its call's entry time: the return probe alone.
        FunctionTracerKind::FuncLatency(_) => vec![exit(point)],
        FunctionTracerKind::FunctionGraph => vec![
            KprobeRequest::event(point.clone(), GROUP, GRAPH_ENTRY_EVENT, vec![parent()]),
            exit(point),
        ],
    }
}

/// function_graph's display options from `--funcgraph-opts` and its filters.
fn graph_options(
    options: &FunctionTracerOptions,
    filter: FunctionFilter,
    cpus: usize,
) -> Result<GraphOptions, SessionError> {
    let mut graph = GraphOptions {
        max_depth: options.max_graph_depth,
        graph_functions: filter.graph,
        graph_notrace: filter.graph_notrace,
        cpus,
        errors: options.errors,
        ..GraphOptions::default()
    };
    for name in options.graph_options.iter().flat_map(|o| o.split(',')) {
        let (on, bare) = match name.trim().strip_prefix("no") {
            Some(rest) => (false, rest),
            None => (true, name.trim()),
        };
        let bare = bare.strip_prefix("funcgraph-").unwrap_or(bare);
        let flag = match bare {
            "proc" => &mut graph.proc,
            "abstime" => &mut graph.abstime,
            "tail" => &mut graph.tail,
            "overhead" => &mut graph.overhead,
            "duration" => &mut graph.duration,
            "cpu" => &mut graph.cpu,
            "retval" => &mut graph.retval,
            _ => return Err(SessionError::GraphOption(name.to_owned())),
        };
        *flag = on;
    }
    Ok(graph)
}
