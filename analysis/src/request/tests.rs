use super::*;

#[test]
fn a_flag_is_an_event_a_colon_and_the_filter_or_trigger() {
    let r = parse_flag(RequestKind::Filter, "vfs/p_vfs_*:common_pid == 1").unwrap();
    assert_eq!(r.event.to_string(), "vfs/p_vfs_*");
    assert!(matches!(r.body, RequestBody::Filter(_)));
    assert!(r.event.matches("vfs", "p_vfs_read_0"));
    assert!(!r.event.matches("vfs", "p_ksys_read_0"));
    let r = parse_flag(RequestKind::Trigger, "getppid:hist:keys=common_pid").unwrap();
    assert!(matches!(r.body, RequestBody::Hist(_)));
    assert!(r.event.matches("any", "getppid"));
    assert!(parse_flag(RequestKind::Trigger, "grp/:hist:keys=cpu")
        .unwrap()
        .event
        .matches("grp", "x"));
}

#[test]
fn flag_errors_name_the_flag_its_value_and_the_column() {
    let e = parse_flag(RequestKind::Filter, "g/e:cpu = 1").unwrap_err();
    assert_eq!(
        e.to_string(),
        "--filter 'g/e:cpu = 1': column 9: expected an operator after the field: ==, !=, <, <=, >, >=, & or ~"
    );
    let e = parse_flag(RequestKind::Trigger, "g/e:hist:keys=a.log3").unwrap_err();
    assert_eq!(
        e.to_string(),
        "--trigger 'g/e:hist:keys=a.log3': column 17: unknown modifier `.log3` (keys take .hex, .sym, .sym-offset, \
         .execname, .log2, .buckets=N)"
    );
    let e = parse_flag(RequestKind::Filter, "cpu == 1").unwrap_err();
    assert_eq!(
        e.to_string(),
        "--filter 'cpu == 1': column 9: expected GRP/EVENT:FILTER"
    );
    let e = parse_flag(RequestKind::Filter, "g/e v:cpu == 1").unwrap_err();
    assert_eq!(e.kind, RequestErrorKind::BadEvent("g/e v".into()));
}

#[test]
fn spec_file_lines_start_with_filter_or_trigger() {
    assert!(is_request_line("  filter g/e cpu == 0"));
    assert!(is_request_line("trigger g/e hist:keys=cpu"));
    assert!(!is_request_line("p:g/filter do_filter"));
    assert!(!is_request_line("# filter g/e cpu == 0"));
    let r = parse_line("f.probes", 3, "trigger g/e hist:keys=cpu if comm == \"sh\"").unwrap();
    assert_eq!(r.kind(), RequestKind::Trigger);
    let r = parse_line("f.probes", 3, "filter  g/e   cpu == 0   ").unwrap();
    assert_eq!(r.kind(), RequestKind::Filter);
}

#[test]
fn spec_file_errors_name_the_file_line_and_column() {
    let e = parse_line("f.probes", 7, "filter g/e comm == sh").unwrap_err();
    assert_eq!(
        e.to_string(),
        "f.probes:7:20: expected a number or a quoted string (did you forget the quotes?)"
    );
    let e = parse_line("f.probes", 2, "  trigger g/e").unwrap_err();
    assert_eq!(e.to_string(), "f.probes:2:14: expected `trigger GRP/EVENT TRIGGER`");
    let e = parse_line("f.probes", 2, "filter g/e comm == \"é\" && comm ~ 'x").unwrap_err();
    // Columns count characters: the é before the error is one.
    assert_eq!(e.to_string(), "f.probes:2:36: missing the closing quote");
}

#[test]
fn an_errors_event_offset_points_at_the_event() {
    let r = parse_line("f", 1, "filter   g/e cpu == 0").unwrap();
    let e = r.error_at_event(RequestErrorKind::NoSuchEvent("g/e".into()));
    assert_eq!(e.to_string(), "f:1:10: no probe event matches `g/e`");
    let r = parse_line("f", 1, "filter g/e cpu == 0").unwrap();
    let e = r.error_in_body(7, RequestErrorKind::NoSuchEvent("x".into()));
    assert_eq!(e.offset, 18);
}
