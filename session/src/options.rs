//! What a run's tracing side is asked to do, as the command line gives it: the probes and
//! where their hits go, the filters and triggers, the control socket, where the kernel's
//! symbols come from, and the backend's default for jump optimization.

use std::path::PathBuf;
use std::sync::Arc;

use hvprobe_analysis::request::{self, Request, RequestError, RequestKind};
use hvprobe_live::SymbolsFrom;
use hvprobe_probes::clock::TraceClock;

use crate::kernel_source::KernelSourceFiles;

/// What a run traces and checks (`--probes`, `--format`, `--perfetto`, `--text-hash`, `--control`).
#[derive(Clone, Debug, Default)]
pub struct TraceOptions {
    pub probes: Option<PathBuf>,
    /// The kernel's DWARF, for probes on source lines.
    pub kernel_source: Arc<KernelSourceFiles>,
    pub output: HitOutputs,
    /// Stack frames as `func+0xoff/0xsize` (`--sym-offset`).
    pub sym_offset: bool,
    /// Print the SHA-256 of the kernel's text at the end, after the probes are removed.
    pub text_hash: bool,
    pub control: ControlSocket,
    /// Jump-optimize probes (`--optimize on|off`); `None`: the backend's default (`auto`).
    pub optimize: Option<bool>,
    /// `--filter` and `--trigger`.
    pub analysis: AnalysisFlags,
    /// The clock hits are stamped with (`--clock`).
    pub clock: TraceClock,
    /// Sample every vCPU's RIP and task this often (`--sample-ms`).
    pub sample_every: Option<std::time::Duration>,
    /// Where the kernel's symbols come from and which to print (`--symbols`, `--resolve`).
    pub symbols: SymbolRequest,
    /// ftrace's function or function_graph tracer (`--tracer`), if asked for.
    pub functions: Option<FunctionTracerOptions>,
}

/// Which of ftrace's function tracers a run runs from the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FunctionTracerKind {
    /// `function`: a line per call.
    Function,
    /// `function_graph`: calls and returns, nested, with durations.
    FunctionGraph,
    /// bcc's `funccount`: calls per function, printed at the end.
    FuncCount,
    /// bcc's `funclatency`: a log2 histogram of the calls' durations, printed at the end.
    FuncLatency(hvprobe_functions::stats::LatencyUnit),
}

/// `--tracer` and its filters and options, as ftrace's files and trace-cmd take them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionTracerOptions {
    pub kind: FunctionTracerKind,
    /// `set_ftrace_filter`'s globs.
    pub filter: Vec<String>,
    /// `set_ftrace_notrace`'s globs.
    pub notrace: Vec<String>,
    /// `set_graph_function`'s globs.
    pub graph_functions: Vec<String>,
    /// `set_graph_notrace`'s globs.
    pub graph_notrace: Vec<String>,
    /// `max_graph_depth` (0: no limit).
    pub max_graph_depth: usize,
    /// `funcgraph-*` options by name (`proc`, `abstime`, `tail`; `no` before one turns
    /// it off: `nooverhead`, `noduration`, `nocpu`).
    pub graph_options: Vec<String>,
    /// `set_ftrace_pid`: only these tasks' calls (empty: every task's).
    pub pids: Vec<i32>,
    /// function_graph: retsnoop's error chains (a graph function's call shown only when a
    /// call in it failed).
    pub errors: hvprobe_functions::layout::ErrorReport,
}

/// Whether a run has a control socket, and where.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ControlSocket {
    /// None (benchmarks, `--no-control`).
    #[default]
    Off,
    /// In the default directory, named after the process.
    Default,
    At(PathBuf),
}

/// Where a run's symbols come from and which symbols it prints (`--symbols`, `--resolve`).
#[derive(Clone, Debug)]
pub struct SymbolRequest {
    /// In the order asked for; the first one's table places the probes.
    pub sources: Vec<SymbolsFrom>,
    pub resolve: Vec<String>,
}

impl SymbolRequest {
    /// Whether the user asked for anything beyond the default (a source of their choice, a
    /// `--resolve`): a restore then introspects even when nothing else needs the kernel.
    pub fn asked(&self) -> bool {
        self.sources != [SymbolsFrom::Kallsyms] || !self.resolve.is_empty()
    }
}

impl Default for SymbolRequest {
    /// A restore's default: the restored kernel's own kallsyms, which no file has to
    /// match, and nothing printed. (A boot's default is its files': `hvprobe run` says.)
    fn default() -> SymbolRequest {
        SymbolRequest {
            sources: vec![SymbolsFrom::Kallsyms],
            resolve: Vec::new(),
        }
    }
}

/// How hits are printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputFormat {
    /// ftrace's `trace` layout.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
    /// Not at all (hits still count, and stream to `hvprobe trace`).
    None,
}

/// Where a run's hits go: a format on stdout (`--format`), a Perfetto trace file
/// (`--perfetto`), or both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HitOutputs {
    /// The format asked for on stdout, if one was.
    pub format: Option<OutputFormat>,
    /// A Perfetto trace file that also gets the hits.
    pub perfetto: Option<PathBuf>,
}

impl HitOutputs {
    /// The format of stdout: the one asked for; else none when a trace file takes the
    /// hits, text otherwise.
    pub fn stdout(&self) -> OutputFormat {
        match (self.format, &self.perfetto) {
            (Some(format), _) => format,
            (None, Some(_)) => OutputFormat::None,
            (None, None) => OutputFormat::Text,
        }
    }
}

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

/// Whether probes are jump-optimized unless the user says (docs/optimized-probes.md has the
/// measurements behind it): on hardware KVM the displaced instructions run
/// natively in the detour, so a hit never costs more than one exit and a stepped one saves
/// its second; on kvm_pvm they are emulated like all guest kernel code, and for the most
/// common probe (`push %rbp` after a function's ftrace NOP, which the host emulates in the
/// int3 exit) the detour costs more than it saves.
pub fn optimize_by_default(backend: hvprobe_vmm::Backend) -> bool {
    !matches!(backend, hvprobe_vmm::Backend::Pvm)
}
