use hvprobe_arch::Gva;

use super::*;
use crate::fetch::ArgValue;

fn kprobe_hit() -> HitRecord {
    HitRecord {
        comm: "bash".into(),
        pid: 1447,
        cpu: 1,
        timestamp_ns: 1_073_249_432_100,
        group: "kprobes".into(),
        event: "myprobe".into(),
        location: "do_sys_open+0x0/0xd6".into(),
        retprobe_caller: None,
        args: vec![
            ("dfd".into(), ArgValue::Hex(0xffff_ff9c)),
            ("filename".into(), ArgValue::String(b"/etc/ld.so.cache".to_vec())),
            ("flags".into(), ArgValue::Signed(-1)),
            ("mode".into(), ArgValue::Unsigned(0x1b6)),
        ],
        entry_timestamp_ns: None,
        stack: None,
    }
}

#[test]
fn ftrace_line_matches_the_trace_file_layout() {
    assert_eq!(
        ftrace_line(&kprobe_hit()),
        "            bash-1447    [001]   1073.249432: myprobe: (do_sys_open+0x0/0xd6) \
         dfd=0xffffff9c filename=\"/etc/ld.so.cache\" flags=-1 mode=438"
    );
}

#[test]
fn ftrace_line_pads_and_rounds_like_the_kernel() {
    let hit = HitRecord {
        comm: "kworker/u16:3-events_unbound".chars().take(15).collect(),
        pid: 12_345_678,
        cpu: 1234,
        // 123456.7894995 s rounds down, ...4995 + 500 ns -> ...499 us
        timestamp_ns: 123_456_789_499_499,
        args: vec![],
        ..kprobe_hit()
    };
    assert_eq!(
        ftrace_line(&hit),
        " kworker/u16:3-e-12345678 [1234]  123456.789499: myprobe: (do_sys_open+0x0/0xd6)"
    );
    let hit = HitRecord {
        comm: "<idle>".into(),
        pid: 0,
        cpu: 0,
        timestamp_ns: 999_999_500, // rounds up to the next second
        args: vec![("x".into(), ArgValue::Fault)],
        ..kprobe_hit()
    };
    assert_eq!(
        ftrace_line(&hit),
        "          <idle>-0       [000]      1.000000: myprobe: (do_sys_open+0x0/0xd6) x=(fault)"
    );
    let hit = HitRecord { timestamp_ns: 0, ..hit };
    assert!(ftrace_line(&hit).contains("[000]      0.000000: myprobe:"));
}

#[test]
fn ftrace_line_of_a_return_probe_shows_return_site_and_function() {
    let hit = HitRecord {
        event: "myretprobe".into(),
        retprobe_caller: Some("do_sys_openat2+0x1a/0xca".into()),
        args: vec![("ret".into(), ArgValue::Signed(3))],
        ..kprobe_hit()
    };
    assert_eq!(
        ftrace_line(&hit),
        "            bash-1447    [001]   1073.249432: myretprobe: (do_sys_openat2+0x1a/0xca <- do_sys_open) ret=3"
    );
}

#[test]
fn ftrace_line_prints_arrays_and_symbols() {
    let hit = HitRecord {
        args: vec![
            (
                "a".into(),
                ArgValue::Array(vec![ArgValue::Hex(1), ArgValue::Fault, ArgValue::Hex(0xff)]),
            ),
            (
                "s".into(),
                ArgValue::Array(vec![ArgValue::String(b"x".to_vec()), ArgValue::String(vec![])]),
            ),
            (
                "f".into(),
                ArgValue::Symbol {
                    address: 0xffff_ffff_8123_4570,
                    description: Some("do_sys_open+0x10/0xd6".into()),
                },
            ),
            (
                "g".into(),
                ArgValue::Symbol {
                    address: 0x10,
                    description: None,
                },
            ),
        ],
        ..kprobe_hit()
    };
    assert!(
        ftrace_line(&hit).ends_with(") a={0x1,(fault),0xff} s={\"x\",\"\"} f=do_sys_open+0x10/0xd6 g=0x10"),
        "{}",
        ftrace_line(&hit)
    );
}

#[test]
fn json_line_is_one_ordered_object() {
    let line = json_line(&kprobe_hit());
    assert_eq!(
        line,
        "{\"comm\":\"bash\",\"pid\":1447,\"cpu\":1,\"timestamp_ns\":1073249432100,\"group\":\"kprobes\",\
         \"event\":\"myprobe\",\"location\":\"do_sys_open+0x0/0xd6\",\"retprobe_caller\":null,\"args\":{\
         \"dfd\":\"0xffffff9c\",\"filename\":\"/etc/ld.so.cache\",\"flags\":-1,\"mode\":438}}"
    );
    assert!(!line.contains('\n'));
    let parsed: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
    assert_eq!(parsed["args"]["mode"], 438);
}

#[test]
fn json_line_escapes_and_keeps_arg_order() {
    let hit = HitRecord {
        comm: "we\"ird\n".into(),
        retprobe_caller: Some("f+0x1/0x2".into()),
        args: vec![
            ("z".into(), ArgValue::Unsigned(u64::MAX)),
            ("a".into(), ArgValue::Fault),
            (
                "m".into(),
                ArgValue::Array(vec![ArgValue::Signed(-128), ArgValue::Fault]),
            ),
            ("s".into(), ArgValue::String(b"\x01\xff".to_vec())),
        ],
        ..kprobe_hit()
    };
    let line = json_line(&hit);
    assert!(line.starts_with("{\"comm\":\"we\\\"ird\\n\","), "{line}");
    assert!(
        line.ends_with(
            "\"retprobe_caller\":\"f+0x1/0x2\",\"args\":{\"z\":18446744073709551615,\"a\":null,\"m\":[-128,null],\
             \"s\":\"\\u0001\\\\xff\"}}"
        ),
        "{line}"
    );
    let parsed: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
    assert_eq!(parsed["comm"], "we\"ird\n");
    assert_eq!(parsed["args"]["z"], u64::MAX);
}

fn entry() -> ListEntry {
    ListEntry {
        address: Gva(0xffff_ffff_8123_4560),
        kind: ListKind::Kprobe,
        location: "do_sys_open+0x0".into(),
        disabled: false,
        gone: false,
        ftrace: false,
        optimized: false,
        hits: 3,
        nmissed: 0,
        filtered_in_guest: 0,
        event: "kprobes/p_do_sys_open_0".into(),
        not_optimized: None,
        return_trapped: None,
        module: None,
        pending: false,
    }
}

#[test]
fn module_probes_list_their_module_as_report_probe_does() {
    let armed = ListEntry {
        address: Gva(0xffff_ffff_c000_2010),
        location: "hvprobe_test_work+0x0".into(),
        module: Some("hvprobe_test".into()),
        ..entry()
    };
    assert_eq!(
        kernel_listing_line(&armed),
        "ffffffffc0002010  k  hvprobe_test_work+0x0  hvprobe_test "
    );
    assert_eq!(
        kernel_listing_line(&ListEntry {
            gone: true,
            ..armed.clone()
        }),
        "ffffffffc0002010  k  hvprobe_test_work+0x0  hvprobe_test [GONE]"
    );
    let pending = ListEntry {
        address: Gva(0),
        pending: true,
        ..armed
    };
    assert_eq!(
        kernel_listing_line(&pending),
        "0000000000000000  k  hvprobe_test_work+0x0  hvprobe_test [PENDING]"
    );
}

#[test]
fn listing_lines_follow_report_probe() {
    assert_eq!(
        kernel_listing_line(&ListEntry {
            disabled: true,
            ..entry()
        }),
        "ffffffff81234560  k  do_sys_open+0x0    [DISABLED]"
    );
    assert_eq!(
        kernel_listing_line(&entry()),
        "ffffffff81234560  k  do_sys_open+0x0    "
    );
    assert_eq!(
        kernel_listing_line(&ListEntry {
            kind: ListKind::Kretprobe,
            location: "tcp_v4_rcv+0x0".into(),
            address: Gva(0xffff_ffff_8199_0000),
            optimized: true,
            ftrace: true,
            ..entry()
        }),
        "ffffffff81990000  r  tcp_v4_rcv+0x0    [OPTIMIZED][FTRACE]"
    );
    // GONE hides DISABLED.
    assert_eq!(
        kernel_listing_line(&ListEntry {
            gone: true,
            disabled: true,
            ..entry()
        }),
        "ffffffff81234560  k  do_sys_open+0x0    [GONE]"
    );
    assert_eq!(
        kernel_listing_line(&ListEntry {
            address: Gva(0x1000),
            ..entry()
        }),
        "0000000000001000  k  do_sys_open+0x0    "
    );
}

#[test]
fn listing_lines_append_the_counters() {
    assert_eq!(
        listing_line(&ListEntry {
            disabled: true,
            hits: 3,
            nmissed: 1,
            ..entry()
        }),
        "ffffffff81234560  k  do_sys_open+0x0    [DISABLED] hits=3 nmissed=1 event=kprobes/p_do_sys_open_0"
    );
    assert_eq!(
        listing_line(&ListEntry {
            hits: u64::MAX,
            ..entry()
        }),
        "ffffffff81234560  k  do_sys_open+0x0    hits=18446744073709551615 nmissed=0 event=kprobes/p_do_sys_open_0"
    );
    assert_eq!(ListKind::Kprobe.letter(), 'k');
    assert_eq!(ListKind::Kretprobe.letter(), 'r');
}

/// A guest task named `e<ESC>[2Jx` (run at daf5f30: the raw ESC
/// reached the terminal) or with a newline (a forged trace line) is escaped in text
/// output, with the stack entry's context too; JSON encodes the same name itself.
#[test]
fn a_guest_comm_with_control_bytes_is_escaped_in_text() {
    let hit = HitRecord {
        comm: "e\u{1b}[2Jx\nfake-1 [000]\u{9b}".into(),
        stack: Some(vec![]),
        ..kprobe_hit()
    };
    let text = ftrace_text(&hit, false);
    assert!(
        text.starts_with("e\\x1b[2Jx\\x0afake-1 [000]\\xc2\\x9b-1447    [001]"),
        "{text}"
    );
    assert_eq!(
        text.lines().count(),
        2,
        "the event and its stack entry, no forged line: {text}"
    );
    assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
    let parsed: serde_json::Value = serde_json::from_str(&json_line(&hit)).unwrap();
    assert_eq!(parsed["comm"], hit.comm);
}

/// ftrace prints a name without its offset with `kallsyms_lookup`, which gives a module's
/// symbol without its module (`trace_seq_print_sym`): a return probe's function, and stack
/// frames without `sym-offset`; with `sym-offset` (`sprint_symbol`) the module is there.
#[test]
fn a_module_symbol_is_named_as_ftrace_names_it() {
    let ret = HitRecord {
        location: "hvprobe_test_work+0x0/0x20 [hvprobe_test]".into(),
        retprobe_caller: Some("hvprobe_test_read+0x1c/0x97 [hvprobe_test]".into()),
        args: Vec::new(),
        stack: Some(vec![
            StackFrame {
                address: Gva(0xffff_ffff_c000_0000),
                symbol: Some("hvprobe_test_work+0x0/0x20 [hvprobe_test]".into()),
            },
            StackFrame {
                address: Gva(0xffff_ffff_8123_4560),
                symbol: Some("vfs_read+0x80/0x260".into()),
            },
        ]),
        ..kprobe_hit()
    };
    let text = ftrace_text(&ret, false);
    assert!(
        text.contains("myprobe: (hvprobe_test_read+0x1c/0x97 [hvprobe_test] <- hvprobe_test_work)"),
        "{text}"
    );
    assert!(text.ends_with(" => hvprobe_test_work\n => vfs_read"), "{text}");
    let with_offsets = ftrace_text(&ret, true);
    assert!(
        with_offsets.ends_with(" => hvprobe_test_work+0x0/0x20 [hvprobe_test]\n => vfs_read+0x80/0x260"),
        "{with_offsets}"
    );
}
