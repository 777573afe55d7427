//! What a request to a run's probes could not do ([`SessionError`]): the error of the trace
//! session, which the run session, the kernel's introspection and the control socket pass
//! on.

use hvprobe_probes::engine::ProbeError;
use hvprobe_probes::machine::PauseFailed;

use crate::perfetto::PerfettoError;

/// What a request to the running session could not do.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Every problem of a spec text (or of its probes against the kernel), one per line,
    /// each `SOURCE:LINE:[COLUMN:] reason`.
    #[error("{}", all_problems(origin, problems))]
    Spec { origin: String, problems: Vec<String> },
    #[error("the guest kernel is not up yet: probes can be added once it is")]
    KernelNotUp,
    #[error("the guest has not reached /init yet: probes go in once its boot-time text patching is over")]
    NotReady,
    #[error("no kernel symbols, so no probes can be placed: {0}")]
    NoSymbols(String),
    #[error("cannot start the probe engine: {0}")]
    Engine(String),
    #[error("the probe engine is not attached")]
    NotAttached,
    #[error("the probes were not checked against the kernel")]
    NotChecked,
    #[error("cannot start the {what} thread: {source}")]
    Thread {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot watch {signal}: {source}")]
    Signal {
        signal: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the run has ended")]
    Finished,
    #[error("no probe event matches {0:?}")]
    NoSuchEvent(String),
    #[error("{event}: {source}")]
    Probe { event: String, source: Box<ProbeError> },
    #[error("--filter and --trigger apply to the events of --probes FILE, and there is none")]
    AnalysisWithoutProbes,
    #[error("--perfetto records probe hits, and this run has no probes: give --probes FILE, or a control socket to add them")]
    PerfettoWithoutProbes,
    #[error(transparent)]
    Perfetto(#[from] PerfettoError),
    #[error("--tracer: {0}")]
    FunctionTable(#[from] hvprobe_functions::AvailableError),
    #[error("--tracer: {0}")]
    FunctionFilter(#[from] hvprobe_functions::FilterError),
    #[error(
        "--tracer needs the kernel's vmlinux (its __mcount_loc table names the traceable functions): give --vmlinux"
    )]
    FunctionsWithoutVmlinux,
    #[error("--funcgraph-opts: unknown option {0:?} (proc, abstime, tail, overhead, duration, cpu, retval; `no` before one turns it off)")]
    GraphOption(String),
    #[error("--tracer: no function to trace: {0}")]
    NoFunctionTraced(String),
    /// The vCPUs could not be paused for a change (one was held on the host past the
    /// pause's deadline); nothing changed.
    #[error(transparent)]
    Pause(#[from] PauseFailed),
}

impl SessionError {
    /// A change to every probe at once (the global switch, optimization) that failed.
    pub(crate) fn of_all_probes(e: ProbeError) -> SessionError {
        match e {
            ProbeError::Pause(e) => SessionError::Pause(e),
            e => SessionError::Probe {
                event: "every probe".into(),
                source: Box::new(e),
            },
        }
    }
}

/// Several problems of one spec text as one message: a count, then one per line.
fn all_problems(source: &str, problems: &[String]) -> String {
    match problems {
        [one] => one.clone(),
        many => format!("{} problems in {source}:\n{}", many.len(), many.join("\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_problems_read_as_a_count_then_one_per_line() {
        let e = SessionError::Spec {
            origin: "f".into(),
            problems: vec!["f:1: a".into(), "f:3: b".into()],
        };
        assert_eq!(e.to_string(), "2 problems in f:\nf:1: a\nf:3: b");
        let e = SessionError::Spec {
            origin: "f".into(),
            problems: vec!["f:1: a".into()],
        };
        assert_eq!(e.to_string(), "f:1: a");
    }
}
