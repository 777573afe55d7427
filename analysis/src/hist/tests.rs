use hvprobe_introspection::symbols::{Symbol, SymbolSource};
use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::HitRecord;

use super::*;
use crate::test_support::{args_of, hit};

const EVENT: &str = "p:g/e f bytes=%di:u32 delta=%si:s32 caller=%dx:x64 name=+0(%cx):string arr=+0(%r8):u8[2]";

fn fields() -> EventFields {
    EventFields::new(&args_of(EVENT))
}

fn trigger(text: &str) -> HistTrigger {
    HistSpec::parse(text)
        .and_then(|s| s.bind(&fields()))
        .unwrap_or_else(|e| panic!("{text}: {e} at {}", e.offset))
}

fn error(text: &str) -> (usize, HistErrorKind) {
    let e = HistSpec::parse(text).and_then(|s| s.bind(&fields())).expect_err(text);
    (e.offset, e.kind)
}

fn read_hit(comm: &str, pid: i32, bytes: u64, delta: i64) -> HitRecord {
    hit(
        comm,
        pid,
        0,
        vec![
            ("bytes", ArgValue::Unsigned(bytes)),
            ("delta", ArgValue::Signed(delta)),
            ("caller", ArgValue::Hex(0xffff_ffff_8100_0010)),
            ("name", ArgValue::String(format!("/f{}", bytes % 3).into_bytes())),
        ],
    )
}

fn histogram(text: &str, hits: &[HitRecord]) -> Histogram {
    let mut h = Histogram::new(trigger(text));
    for hit in hits {
        h.record(hit);
    }
    h
}

#[test]
fn the_trigger_info_is_printed_as_the_kernel_prints_it() {
    assert_eq!(
        trigger("hist:keys=bytes").info(),
        "hist:keys=bytes:vals=hitcount:sort=hitcount:size=2048"
    );
    assert_eq!(
        trigger("hist:key=common_pid.execname,bytes.log2:values=hitcount,delta.hex:sort=bytes.descending,hitcount:size=200 if comm ~ \"x*\"")
            .info(),
        "hist:keys=common_pid.execname,bytes.log2:vals=hitcount,delta.hex:sort=bytes.log2.descending,hitcount:size=256 if comm ~ \"x*\""
    );
    assert_eq!(
        trigger("hist:keys=cpu,caller.sym-offset,bytes.buckets=10").info(),
        "hist:keys=common_cpu,caller.sym-offset,bytes.buckets=10:vals=hitcount:sort=hitcount:size=2048"
    );
}

#[test]
fn log2_is_order_base_2() {
    let expected = [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 2),
        (5, 3),
        (4096, 12),
        (4097, 13),
        (u64::MAX, 64),
    ];
    for (value, log2) in expected {
        assert_eq!(order_base_2(value), log2, "{value}");
    }
}

#[test]
fn hits_aggregate_by_key_with_summed_values() {
    let hits = [
        read_hit("a", 10, 1, 5),
        read_hit("a", 10, 3, -1),
        read_hit("b", 11, 4, 2),
        read_hit("a", 10, 100, 1),
    ];
    let h = histogram("hist:keys=bytes.log2:vals=delta:sort=bytes", &hits);
    assert_eq!(
        h.render(None),
        "# event histogram\n\
         #\n\
         # trigger info: hist:keys=bytes.log2:vals=hitcount,delta:sort=bytes.log2:size=2048 [active]\n\
         #\n\
         \n\
         { bytes: ~ 2^0  } hitcount:          1  delta:          5\n\
         { bytes: ~ 2^2  } hitcount:          2  delta:          1\n\
         { bytes: ~ 2^7  } hitcount:          1  delta:          1\n\
         \n\
         Totals:\n    Hits: 4\n    Entries: 3\n    Dropped: 0\n"
    );
    assert_eq!((h.hits(), h.len(), h.dropped()), (4, 3, 0));
}

#[test]
fn execname_shows_the_first_hits_task_and_pid() {
    let hits = [
        read_hit("sh", 29, 1, 0),
        read_hit("renamed", 29, 1, 0),
        read_hit("loop", 31, 1, 0),
    ];
    let h = histogram("hist:keys=common_pid.execname:sort=common_pid.descending", &hits);
    let text = h.render(None);
    assert!(
        text.contains("{ common_pid: loop            [        31] } hitcount:          1\n{ common_pid: sh              [        29] } hitcount:          2\n"),
        "{text}"
    );
    let idle = histogram("hist:keys=common_pid.execname", &[read_hit("swapper/0", 0, 1, 0)]);
    assert!(idle
        .render(None)
        .contains("{ common_pid: <idle>          [         0] }"));
}

#[test]
fn keys_print_as_their_modifier_says() {
    let symbols = SymbolTable::from_symbols(
        SymbolSource::SystemMap,
        vec![Symbol {
            name: "do_thing".into(),
            addr: Gva(0xffff_ffff_8100_0000),
            size: Some(0x40),
            kind: 'T',
        }],
    );
    let hits = [read_hit("a", 1, 7, -2)];
    let render = |t: &str| histogram(t, &hits).render(Some(&symbols));
    let key_line = |t: &str| render(t).lines().find(|l| l.starts_with('{')).unwrap().to_owned();
    assert_eq!(
        key_line("hist:keys=bytes"),
        "{ bytes:          7 } hitcount:          1"
    );
    assert_eq!(key_line("hist:keys=bytes.hex"), "{ bytes: 7 } hitcount:          1");
    // A signed field's key is its sign-extended 64 bits, printed unsigned (%llu).
    assert_eq!(
        key_line("hist:keys=delta"),
        "{ delta: 18446744073709551614 } hitcount:          1"
    );
    assert_eq!(
        key_line("hist:keys=caller.sym"),
        format!(
            "{{ caller: [ffffffff81000010] {:<45} }} hitcount:          1",
            "do_thing"
        )
    );
    assert_eq!(
        key_line("hist:keys=caller.sym-offset"),
        format!(
            "{{ caller: [ffffffff81000010] {:<55} }} hitcount:          1",
            "do_thing+0x10/0x40"
        )
    );
    assert_eq!(
        key_line("hist:keys=name"),
        format!("{{ name: {:<50} }} hitcount:          1", "/f1")
    );
    assert_eq!(
        key_line("hist:keys=bytes.buckets=5"),
        "{ bytes: ~ 5-9 } hitcount:          1"
    );
    assert_eq!(
        key_line("hist:keys=cpu,bytes:vals=bytes.hex"),
        "{ cpu:          0, bytes:          7 } hitcount:          1  bytes:          7"
    );
    // No symbol: %ps prints the address.
    let none = histogram("hist:keys=bytes.sym", &hits).render(Some(&symbols));
    assert!(none.contains(&format!("{{ bytes: [7] {:<45} }}", "0x7")), "{none}");
}

#[test]
fn a_full_table_drops_new_keys_and_counts_them() {
    let mut h = Histogram::new(trigger("hist:keys=bytes:size=100"));
    assert_eq!(h.trigger().capacity(), 128);
    for i in 0..130 {
        h.record(&read_hit("a", 1, i, 0));
    }
    // Known keys still count once the table is full.
    h.record(&read_hit("a", 1, 5, 0));
    assert_eq!((h.len(), h.hits(), h.dropped()), (128, 129, 2));
    assert!(h
        .render(None)
        .ends_with("Totals:\n    Hits: 129\n    Entries: 128\n    Dropped: 2\n"));
}

#[test]
fn the_triggers_filter_picks_the_hits_it_counts() {
    let hits = [read_hit("a", 1, 1, 0), read_hit("b", 2, 2, 0), read_hit("a", 1, 3, 0)];
    let h = histogram("hist:keys=common_pid if comm == \"a\" && bytes > 1", &hits);
    assert_eq!((h.hits(), h.len()), (1, 1));
}

#[test]
fn entries_sort_by_hitcount_then_ties_as_the_kernel_orders_them() {
    // bytes 1..=6, hitcounts 2,1,2,1,2,1: ties resolved by the kernel's heapsort over
    // entries first ordered by their key bytes. The expected orders are what a C program
    // running `tracing_map_sort_entries`' steps (`lib/sort.c`, `detect_dups`,
    // `sort_secondary`) printed for the same entries.
    let mut hits = Vec::new();
    for b in 1..=6u64 {
        for _ in 0..(if b % 2 == 1 { 2 } else { 1 }) {
            hits.push(read_hit("a", 1, b, 0));
        }
    }
    let order = |t: &str| -> Vec<u64> {
        histogram(t, &hits)
            .render(None)
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(order("hist:keys=bytes"), [6, 2, 4, 3, 5, 1]);
    assert_eq!(order("hist:keys=bytes:sort=hitcount.descending"), [3, 5, 1, 6, 4, 2]);
    // The secondary key orders each run of equal hitcounts.
    assert_eq!(
        order("hist:keys=bytes:sort=hitcount,bytes.descending"),
        [6, 4, 2, 5, 3, 1]
    );
    assert_eq!(order("hist:keys=bytes:sort=bytes.descending"), [6, 5, 4, 3, 2, 1]);

    // Keys across 256: their little-endian bytes order them otherwise than their values.
    let hits: Vec<HitRecord> = (0..20u64)
        .flat_map(|i| std::iter::repeat_n(read_hit("a", 1, 250 + 3 * i, 0), (i % 4 + 1) as usize))
        .collect();
    let order = |t: &str| -> Vec<u64> {
        histogram(t, &hits)
            .render(None)
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(
        order("hist:keys=bytes"),
        [274, 298, 262, 286, 250, 265, 277, 289, 253, 301, 292, 268, 280, 304, 256, 295, 271, 283, 307, 259]
    );
    assert_eq!(
        order("hist:keys=bytes:sort=hitcount.descending"),
        [259, 307, 283, 295, 271, 280, 292, 256, 304, 268, 289, 253, 265, 301, 277, 298, 274, 262, 286, 250]
    );
}

#[test]
fn parse_errors_say_what_and_where() {
    assert_eq!(
        error("traceon"),
        (0, HistErrorKind::UnsupportedTrigger("traceon".into()))
    );
    // Not a hist trigger: a request routes it to the stacktrace trigger (stacktrace.rs).
    assert_eq!(
        error("stacktrace"),
        (0, HistErrorKind::UnsupportedTrigger("stacktrace".into()))
    );
    assert_eq!(
        error("hist:keys=count:vals=stacktrace"),
        (21, HistErrorKind::Stacktrace)
    );
    assert_eq!(
        error("hist:keys=stacktrace.hex"),
        (20, HistErrorKind::StacktraceModifier)
    );
    assert_eq!(error("hist:vals=bytes"), (5, HistErrorKind::MissingKeys));
    assert_eq!(error("hist:keys="), (5, HistErrorKind::EmptyAssignment("keys=".into())));
    assert_eq!(
        error("hist:keys=bytes.log3"),
        (16, HistErrorKind::UnknownModifier("log3".into()))
    );
    assert_eq!(error("hist:keys=a,b,c,d"), (16, HistErrorKind::TooManyKeys));
    assert_eq!(error("hist:keys=bytes:vals=a,b,c"), (25, HistErrorKind::TooManyValues));
    assert_eq!(
        error("hist:keys=bytes:sort=a,b,c"),
        (25, HistErrorKind::TooManySortKeys)
    );
    assert_eq!(
        error("hist:keys=bytes:sort=bytes.up"),
        (27, HistErrorKind::SortModifier("up".into()))
    );
    assert_eq!(
        error("hist:keys=bytes:size=64"),
        (21, HistErrorKind::BadSize("64".into()))
    );
    assert_eq!(
        error("hist:keys=bytes:size=200000"),
        (21, HistErrorKind::BadSize("200000".into()))
    );
    assert_eq!(
        error("hist:keys=bytes:kyes=x"),
        (16, HistErrorKind::UnknownAttribute("kyes=x".into()))
    );
    assert_eq!(
        error("hist:keys=bytes:pause").1,
        HistErrorKind::NotSupported("pause, cont and clear")
    );
    assert_eq!(
        error("hist:keys=bytes:onmax($x).save(a)").1,
        HistErrorKind::NotSupported("actions (onmatch, onmax, onchange)")
    );
    assert_eq!(
        error("hist:keys=bytes+1").1,
        HistErrorKind::NotSupported("expressions and variable references in keys and values")
    );
    assert_eq!(error("hist:keys=bytes junk"), (16, HistErrorKind::ExpectedIf));
    assert_eq!(
        error("hist:keys=bytes if comm = 1"),
        (
            24,
            HistErrorKind::Filter(Box::new(crate::filter::FilterErrorKind::InvalidOperator))
        )
    );
}

#[test]
fn bind_errors_say_what_and_where() {
    assert!(matches!(
        error("hist:keys=bytes,nope"),
        (16, HistErrorKind::Field(FieldError::Unknown { .. }))
    ));
    assert_eq!(
        error("hist:keys=arr"),
        (10, HistErrorKind::Field(FieldError::Array("arr".into())))
    );
    assert_eq!(
        error("hist:keys=bytes.execname"),
        (10, HistErrorKind::ExecnameNotPid("bytes".into()))
    );
    assert_eq!(
        error("hist:keys=bytes:vals=name"),
        (21, HistErrorKind::StringValue("name".into()))
    );
    assert_eq!(
        error("hist:keys=bytes:sort=delta"),
        (21, HistErrorKind::SortField("delta".into()))
    );
    assert_eq!(
        error("hist:keys=name.hex"),
        (
            10,
            HistErrorKind::ModifierOnString {
                field: "name".into(),
                modifier: ".hex".into()
            }
        )
    );
    assert_eq!(error("hist:keys=name,comm,name"), (20, HistErrorKind::KeysTooLarge));
    assert!(matches!(
        error("hist:keys=bytes if nope == 1"),
        (19, HistErrorKind::Filter(_))
    ));
}

#[test]
fn json_has_the_entries_keys_values_and_totals() {
    let hits = [read_hit("sh", 29, 3, -4), read_hit("sh", 29, 4, -4)];
    let h = histogram("hist:keys=common_pid.execname,bytes.log2:vals=delta", &hits);
    assert_eq!(
        h.to_json(None),
        serde_json::json!({
            "trigger": "hist:keys=common_pid.execname,bytes.log2:vals=hitcount,delta:sort=hitcount:size=2048",
            "entries": [{
                "keys": {"common_pid.execname": {"pid": 29, "comm": "sh"}, "bytes.log2": {"log2": 2}},
                "hitcount": 2,
                "delta": (-8i64) as u64,
            }],
            "totals": {"hits": 2, "entries": 1, "dropped": 0},
        })
    );
}

#[test]
fn a_stacktrace_key_counts_each_stack_and_prints_a_frame_per_line() {
    use hvprobe_arch::Gva;
    use hvprobe_probes::output::StackFrame;
    let table = hvprobe_introspection::symbols::SymbolTable::parse_system_map(
        "ffffffff81000000 T vfs_write\nffffffff81000100 T ksys_write\nffffffff81000200 T do_syscall_64\nffffffff81000300 T next_function\n",
    )
    .unwrap();
    let mut hist = Histogram::new(trigger("hist:keys=stacktrace"));
    assert!(hist.trigger().needs_stack());
    let with_stack = |frames: &[u64]| {
        let mut hit = read_hit("sh", 1, 4, 0);
        hit.stack = Some(
            frames
                .iter()
                .map(|&a| StackFrame {
                    address: Gva(a),
                    symbol: None,
                })
                .collect(),
        );
        hit
    };
    let deep: Vec<u64> = (0..20).map(|i| 0xffff_ffff_8100_0200 + i).collect();
    for frames in [
        &[0xffff_ffff_8100_0000, 0xffff_ffff_8100_0110][..],
        &[0xffff_ffff_8100_0000, 0xffff_ffff_8100_0110][..],
        &deep[..],
    ] {
        hist.record(&with_stack(frames));
    }
    let text = hist.render(Some(&table));
    assert!(
        text.contains(
            "{ stacktrace:\n         vfs_write+0x0/0x100\n         ksys_write+0x10/0x100\n} hitcount:          2\n"
        ),
        "{text}"
    );
    // At most 16 frames, as the kernel's HIST_STACKTRACE_DEPTH.
    assert!(text.contains("do_syscall_64+0xf/"), "{text}");
    assert!(!text.contains("do_syscall_64+0x10/"), "{text}");
    assert!(text.contains("    Hits: 3\n    Entries: 2\n"), "{text}");
    let json = hist.to_json(Some(&table));
    let first = &json["entries"][0]["keys"]["stacktrace"];
    assert!(first.is_array(), "{json}");
    assert!(
        json["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["keys"]["stacktrace"][1]["symbol"] == "ksys_write+0x10/0x100"),
        "{json}"
    );
}
