use hvprobe_probes::fetch::ArgValue;

use super::*;
use crate::request::{parse_flag, parse_line, RequestKind};
use crate::test_support::{args_of, hit};

fn events() -> Vec<(String, String, Vec<FetchArg>)> {
    vec![
        (
            "io".into(),
            "p_vfs_read_0".into(),
            args_of("p:io/ vfs_read count=%dx:u64"),
        ),
        (
            "io".into(),
            "p_vfs_write_0".into(),
            args_of("p:io/ vfs_write count=%dx:u64"),
        ),
        (
            "sys".into(),
            "getppid".into(),
            args_of("p:sys/getppid __x64_sys_getppid"),
        ),
    ]
}

fn build(requests: &[Request]) -> Result<AnalysisTable, Vec<RequestError>> {
    let events = events();
    let schemas: Vec<EventSchema> = events
        .iter()
        .map(|(g, e, a)| EventSchema {
            group: g,
            event: e,
            args: a,
        })
        .collect();
    AnalysisTable::build(requests, &schemas)
}

fn read(comm: &str, event: &str, count: u64) -> HitRecord {
    let mut h = hit(comm, 7, 0, vec![("count", ArgValue::Unsigned(count))]);
    h.group = "io".into();
    h.event = event.into();
    h
}

#[test]
fn a_pattern_applies_to_every_event_it_names_and_filters_count_per_event() {
    let table = build(&[parse_flag(RequestKind::Filter, "io/:count > 10").unwrap()]).unwrap();
    assert!(!table.observe(&mut read("sh", "p_vfs_read_0", 1)));
    assert!(table.observe(&mut read("sh", "p_vfs_read_0", 11)));
    assert!(!table.observe(&mut read("sh", "p_vfs_write_0", 2)));
    let mut other = read("sh", "getppid", 0);
    other.group = "sys".into();
    assert!(table.observe(&mut other), "an event without a filter passes");
    assert_eq!(table.get("io", "p_vfs_read_0").unwrap().filtered(), Some(1));
    assert_eq!(table.get("io", "p_vfs_write_0").unwrap().filtered(), Some(1));
    assert!(table.get("sys", "getppid").is_none());
    assert_eq!(table.total_filtered(), 2);
}

#[test]
fn triggers_see_the_hits_the_event_filter_discards() {
    let table = build(&[
        parse_flag(RequestKind::Filter, "io/p_vfs_read_0:comm == \"a\"").unwrap(),
        parse_flag(RequestKind::Trigger, "io/p_vfs_read_0:hist:keys=count").unwrap(),
    ])
    .unwrap();
    for comm in ["a", "b", "b"] {
        table.observe(&mut read(comm, "p_vfs_read_0", 5));
    }
    let file = table.hist_files(None);
    assert!(
        file.starts_with("==> events/io/p_vfs_read_0/hist <==\n# event histogram\n"),
        "{file}"
    );
    assert!(file.contains("{ count:          5 } hitcount:          3\n"), "{file}");
    assert_eq!(table.get("io", "p_vfs_read_0").unwrap().filtered(), Some(2));
}

#[test]
fn several_triggers_on_one_event_print_as_the_kernels_hist_file() {
    let table = build(&[
        parse_flag(RequestKind::Trigger, "io/p_vfs_read_0:hist:keys=count").unwrap(),
        parse_flag(RequestKind::Trigger, "io/p_vfs_read_0:hist:keys=common_pid").unwrap(),
    ])
    .unwrap();
    let file = table.get("io", "p_vfs_read_0").unwrap().hist_file(None);
    assert_eq!(file.matches("# event histogram").count(), 2);
    assert!(file.contains("Dropped: 0\n\n\n# event histogram"), "{file}");
    let json = table.hist_json_lines(None);
    assert_eq!(json.len(), 2);
    let first: serde_json::Value = serde_json::from_str(&json[0]).unwrap();
    assert_eq!(first["hist"]["event"], "io/p_vfs_read_0");
    assert_eq!(first["hist"]["totals"]["hits"], 0);
}

#[test]
fn every_problem_is_reported_at_once() {
    let problems = build(&[
        parse_flag(RequestKind::Filter, "io/nothing:count > 1").unwrap(),
        parse_line("f.probes", 4, "filter io/ nope == 1").unwrap(),
        parse_flag(RequestKind::Trigger, "sys/getppid:hist:keys=count").unwrap(),
        parse_flag(RequestKind::Filter, "io/p_vfs_read_0:count > 1").unwrap(),
        parse_line("f.probes", 9, "filter io/p_vfs_read_0 count < 9").unwrap(),
    ])
    .unwrap_err();
    let messages: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert_eq!(messages.len(), 4, "{messages:#?}");
    assert_eq!(
        messages[0],
        "--filter 'io/nothing:count > 1': column 1: no probe event matches `io/nothing`"
    );
    assert_eq!(
        messages[1],
        "f.probes:4:12: no field `nope` (this event has count, common_pid, comm, cpu)"
    );
    assert!(messages[2].starts_with("--trigger 'sys/getppid:hist:keys=count': column 23: no field `count`"));
    assert_eq!(
        messages[3],
        "f.probes:9:8: event io/p_vfs_read_0 already has a filter (from --filter 'io/p_vfs_read_0:count > 1'); \
         an event has one filter: join them with &&"
    );
}
