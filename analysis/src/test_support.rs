//! Helpers of the unit tests: events from kprobe_events lines, and hits.

use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::HitRecord;
use hvprobe_probes::spec::{parse_line, FetchArg, ProbeSpec};

/// The fetch-args of a kprobe_events line.
pub(crate) fn args_of(line: &str) -> Vec<FetchArg> {
    match parse_line(line).unwrap().unwrap() {
        ProbeSpec::Kprobe { args, .. } | ProbeSpec::Kretprobe { args, .. } | ProbeSpec::Watch { args, .. } => args,
        ProbeSpec::Remove { .. } => panic!("not a probe: {line}"),
    }
}

/// A hit of task `comm`/`pid` on `cpu` with these arg values.
pub(crate) fn hit(comm: &str, pid: i32, cpu: usize, args: Vec<(&str, ArgValue)>) -> HitRecord {
    HitRecord {
        comm: comm.into(),
        pid,
        cpu,
        timestamp_ns: 0,
        group: "g".into(),
        event: "e".into(),
        location: "f+0x0/0x10".into(),
        retprobe_caller: None,
        args: args.into_iter().map(|(n, v)| (n.to_owned(), v)).collect(),
        entry_timestamp_ns: None,
        stack: None,
    }
}
