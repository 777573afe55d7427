//! `hvprobe bench filter`: what the host spends per hit on event filters and hist
//! triggers, measured on the code every hit runs (`AnalysisTable::observe`, the event's
//! lookup by name, its triggers, then its filter) with a hit like the ones `vfs_write`
//! probes record. No guest: a hit's own cost (one or two VM exits, tens of µs on kvm_pvm)
//! is measured by `bench probes`.

use std::process::ExitCode;
use std::time::Instant;

use hvprobe_analysis::request::{parse_flag, RequestKind};
use hvprobe_analysis::table::{AnalysisTable, EventSchema};
use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::HitRecord;
use hvprobe_probes::spec::{parse_line, ProbeSpec};

use crate::cli::FilterBenchArgs;

/// The probe the hits are of.
const PROBE: &str = "p:io/write vfs_write count=%dx:u64 file=%di name=$comm";

/// What is measured: a name and the `--filter`/`--trigger` flags (none: the lookup only).
const VARIANTS: [(&str, &[(RequestKind, &str)]); 7] = [
    (
        "a filter on another event (the lookup only)",
        &[(RequestKind::Filter, "io/other:count > 3")],
    ),
    (
        "filter `count > 3` (kept)",
        &[(RequestKind::Filter, "io/write:count > 3")],
    ),
    (
        "filter `comm == \"busybox\" && count > 3` (kept)",
        &[(RequestKind::Filter, "io/write:comm == \"busybox\" && count > 3")],
    ),
    (
        "filter `comm ~ \"sh*\" || count < 2` (discarded)",
        &[(RequestKind::Filter, "io/write:comm ~ \"sh*\" || count < 2")],
    ),
    (
        "filter of 6 comparisons with a glob (kept)",
        &[(
            RequestKind::Filter,
            "io/write:(count > 3 && count < 4096 || cpu == 7) && !(comm ~ \"*x[0-9]?\") && common_pid != 1 && file & 0xff00",
        )],
    ),
    (
        "hist `keys=count.log2`",
        &[(RequestKind::Trigger, "io/write:hist:keys=count.log2")],
    ),
    (
        "hist `keys=common_pid.execname,count:vals=count` + the filter above it",
        &[
            (RequestKind::Trigger, "io/write:hist:keys=common_pid.execname,count:vals=count"),
            (RequestKind::Filter, "io/write:comm == \"busybox\" && count > 3"),
        ],
    ),
];

/// `hvprobe bench filter`.
pub fn bench_filter(args: FilterBenchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let Ok(Some(ProbeSpec::Kprobe { args: fetch_args, .. })) = parse_line(PROBE) else {
        unreachable!("PROBE is a kprobe line")
    };
    let schema = [
        EventSchema {
            group: "io",
            event: "write",
            args: &fetch_args,
        },
        EventSchema {
            group: "io",
            event: "other",
            args: &fetch_args,
        },
    ];
    // 64 distinct counts, as a workload's writes would have.
    let mut hits: Vec<HitRecord> = (0..64u64)
        .map(|i| HitRecord {
            comm: "busybox".into(),
            pid: 23,
            cpu: 0,
            timestamp_ns: 0,
            group: "io".into(),
            event: "write".into(),
            location: "vfs_write+0x0/0x160".into(),
            retprobe_caller: None,
            args: vec![
                ("count".into(), ArgValue::Unsigned(4 + i * 37)),
                ("file".into(), ArgValue::Hex(0xffff_8880_0123_4500)),
                ("name".into(), ArgValue::String(b"busybox".to_vec())),
            ],
            entry_timestamp_ns: None,
            stack: None,
        })
        .collect();
    println!(
        "hvprobe: per-hit host cost of filters and hist triggers ({} hits per run, median of {} runs)",
        args.hits, args.runs
    );
    println!("{:<75} {:>10} {:>18}", "", "ns per hit", "range");
    for (name, flags) in VARIANTS {
        let requests = flags
            .iter()
            .map(|(kind, value)| parse_flag(*kind, value))
            .collect::<Result<Vec<_>, _>>()?;
        let mut per_hit: Vec<f64> = (0..args.runs.max(1))
            .map(|_| {
                let table = AnalysisTable::build(&requests, &schema).expect("the variants bind");
                let started = Instant::now();
                let mut kept = 0u64;
                for i in 0..args.hits {
                    let n = hits.len();
                    kept += u64::from(table.observe(std::hint::black_box(&mut hits[i as usize % n])));
                }
                std::hint::black_box(kept);
                started.elapsed().as_nanos() as f64 / f64::from(args.hits)
            })
            .collect();
        per_hit.sort_by(f64::total_cmp);
        let median = per_hit[per_hit.len() / 2];
        let range = format!("{:.0}..{:.0}", per_hit[0], per_hit[per_hit.len() - 1]);
        println!("{name:<75} {median:>10.0} {range:>18}");
    }
    Ok(ExitCode::SUCCESS)
}
