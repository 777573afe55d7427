//! What of a filter the detour runs, and where in its code. Running the code against the
//! host's filter is the KVM tests' job (`live/tests/event_detour.rs`).

use iced_x86::{Code, Decoder, DecoderOptions, Instruction};

use super::super::tests::{facts, generate_params, rings, DETOUR, STRNCPY};
use super::super::EventDetour;
use super::*;

fn number(arg: usize, op: NumberOp, value: u64) -> RecordFilter {
    RecordFilter::Test(RecordTest {
        field: RecordField::Arg(arg),
        check: RecordCheck::Number {
            op,
            value,
            size: 4,
            signed: false,
        },
    })
}

fn bytes(field: RecordField, pattern: &[u8]) -> RecordFilter {
    RecordFilter::Test(RecordTest {
        field,
        check: RecordCheck::Bytes {
            pattern: pattern.to_vec(),
            whole: true,
            negate: false,
        },
    })
}

fn and(a: RecordFilter, b: RecordFilter) -> RecordFilter {
    RecordFilter::And(Box::new(a), Box::new(b))
}

fn or(a: RecordFilter, b: RecordFilter) -> RecordFilter {
    RecordFilter::Or(Box::new(a), Box::new(b))
}

fn not(a: RecordFilter) -> RecordFilter {
    RecordFilter::Not(Box::new(a))
}

const SPEC: &str = "x=%di:u32 s=+0(%si):string c=$comm bf=%dx:b4@2/32 sy=%cx:symstr";

fn generated(filter: &RecordFilter) -> EventDetour {
    generate_params(SPEC, 256, &facts(), true, Some(filter)).unwrap()
}

fn decode(code: &[u8]) -> Vec<Instruction> {
    Decoder::with_ip(64, code, DETOUR, DecoderOptions::NONE)
        .into_iter()
        .collect()
}

/// The `lock inc` of the detour's filter-table entry (slot 3), if the code has one.
fn filter_count(code: &[u8]) -> Option<Instruction> {
    let entry = rings(256).probe_filtered_gva(3).unwrap();
    decode(code)
        .into_iter()
        .find(|i| i.code() == Code::Inc_rm64 && i.has_lock_prefix() && i.memory_displacement64() == entry.0)
}

#[test]
fn a_filter_on_fields_the_record_holds_runs_whole_in_the_guest() {
    let filter = and(
        number(0, NumberOp::Gt, 3),
        or(bytes(RecordField::Arg(1), b"abc"), bytes(RecordField::Comm, b"sh")),
    );
    let d = generated(&filter);
    assert_eq!(d.filter, Some(FilterInGuest::Exact));
    assert!(filter_count(&d.code).is_some(), "the discarded hits are counted");
    let plain = generate_params(SPEC, 256, &facts(), true, None).unwrap();
    assert_eq!(plain.filter, None);
    assert!(filter_count(&plain.code).is_none());
    assert_eq!(plain.layout, d.layout, "the record is the same");
}

#[test]
fn tests_only_the_host_can_make_weaken_the_filter_and_are_never_negated() {
    let x = || number(0, NumberOp::Gt, 3);
    let host = || RecordFilter::HostOnly;
    let layout = generated(&x()).layout;
    let plan = |f: &RecordFilter| plan_filter(f, &layout).map(|(f, how, _)| (f, how));
    assert_eq!(plan(&and(host(), x())), Some((x(), FilterInGuest::Partial)));
    assert_eq!(plan(&and(x(), host())), Some((x(), FilterInGuest::Partial)));
    assert_eq!(plan(&or(host(), x())), None, "`||` with an unknown passes everything");
    assert_eq!(plan(&not(and(host(), x()))), None, "a weaker filter cannot be negated");
    assert_eq!(plan(&not(x())), Some((not(x()), FilterInGuest::Exact)));
    assert_eq!(
        plan(&or(and(x(), host()), x())),
        Some((or(x(), x()), FilterInGuest::Partial))
    );
    assert_eq!(plan(&host()), None);
    let d = generated(&or(host(), x()));
    assert_eq!(d.filter, None);
    assert!(filter_count(&d.code).is_none(), "no filter code when none of it runs");
}

#[test]
fn tests_the_record_cannot_answer_are_left_to_the_host() {
    let layout = generated(&number(0, NumberOp::Eq, 1)).layout;
    let alone = |f: RecordFilter| plan_filter(&f, &layout).is_none();
    // A bitfield's value is shifted and masked; a symstr is a symbol's name.
    assert!(alone(number(3, NumberOp::Eq, 1)));
    assert!(alone(bytes(RecordField::Arg(4), b"func")));
    // A number test on a string and a string test on a number.
    assert!(alone(number(1, NumberOp::Eq, 1)));
    assert!(alone(bytes(RecordField::Arg(0), b"1")));
    // No such arg.
    assert!(alone(number(9, NumberOp::Eq, 1)));
    // The string area is 32 bytes, the comm 16; the host shows a comm through a lossy
    // UTF-8 conversion.
    assert!(alone(bytes(RecordField::Arg(1), &[b'a'; 32])));
    assert!(!alone(bytes(RecordField::Arg(1), &[b'a'; 31])));
    assert!(alone(bytes(RecordField::Comm, &[b'a'; 16])));
    assert!(alone(bytes(RecordField::Comm, "é".as_bytes())));
    assert!(
        !alone(bytes(RecordField::Arg(2), "é".as_bytes())),
        "a $comm arg is raw bytes"
    );
    // An 8-byte test of a 4-byte value.
    let wide = RecordFilter::Test(RecordTest {
        field: RecordField::Arg(0),
        check: RecordCheck::Number {
            op: NumberOp::Eq,
            value: 1,
            size: 8,
            signed: false,
        },
    });
    assert!(alone(wide));
    // Without the task stamp there is no pid or comm in the record.
    let unstamped = generate_params(SPEC, 256, &facts(), false, None).unwrap().layout;
    let pid = RecordFilter::Test(RecordTest {
        field: RecordField::Pid,
        check: RecordCheck::Number {
            op: NumberOp::Eq,
            value: 1,
            size: 4,
            signed: true,
        },
    });
    assert!(plan_filter(&pid, &unstamped).is_none());
    assert!(plan_filter(&pid, &layout).is_some());
    assert!(plan_filter(&bytes(RecordField::Comm, b"sh"), &unstamped).is_none());
}

/// Index of the first instruction that branches to the filter's cold path, and of the
/// call to `strncpy_from_kernel_nofault`.
fn filter_and_string_fetch(code: &[u8]) -> (usize, usize) {
    let stub = filter_count(code).expect("a filter stub").ip();
    let insns = decode(code);
    let branch = insns
        .iter()
        .position(|i| i.is_jcc_short_or_near() && i.near_branch_target() == stub)
        .expect("a branch to the filter stub");
    let call = insns
        .iter()
        .position(|i| i.is_call_near() && i.near_branch_target() == STRNCPY)
        .expect("the string fetch");
    (branch, call)
}

#[test]
fn the_filter_runs_as_soon_as_the_fetch_args_it_reads_are_recorded() {
    let (branch, call) = filter_and_string_fetch(&generated(&number(0, NumberOp::Gt, 3)).code);
    assert!(branch < call, "a discarded hit does not fetch the string");
    let (branch, call) = filter_and_string_fetch(&generated(&bytes(RecordField::Arg(1), b"abc")).code);
    assert!(branch > call, "a filter on the string waits for it");
    let comm_only = generated(&bytes(RecordField::Comm, b"sh"));
    let (branch, call) = filter_and_string_fetch(&comm_only.code);
    assert!(branch < call);
    assert_eq!(last_arg(&bytes(RecordField::Comm, b"sh")), None);
    assert_eq!(
        last_arg(&and(number(2, NumberOp::Eq, 0), number(0, NumberOp::Eq, 0))),
        Some(2)
    );
}

#[test]
fn patterns_are_compared_in_words_then_smaller_pieces() {
    assert_eq!(chunks(b"busybox\0"), vec![(0, 8, u64::from_le_bytes(*b"busybox\0"))]);
    let eleven = b"hello-world";
    let pieces: Vec<(u32, u32)> = chunks(eleven).iter().map(|&(at, len, _)| (at, len)).collect();
    assert_eq!(pieces, vec![(0, 8), (8, 2), (10, 1)]);
    assert_eq!(chunks(eleven)[1].2, u64::from(u16::from_le_bytes(*b"rl")));
    assert!(chunks(b"").is_empty());
}
