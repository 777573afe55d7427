use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::HitRecord;

use super::*;
use crate::test_support::{args_of, hit};

const EVENT: &str = "p:g/e f small=%di:u8 count=%si:u32 delta=%dx:s32 flags=%cx:x64 name=+0(%r8):string";

fn sample() -> HitRecord {
    hit(
        "hvprobe-loop",
        25,
        1,
        vec![
            ("small", ArgValue::Unsigned(200)),
            ("count", ArgValue::Unsigned(4096)),
            ("delta", ArgValue::Signed(-3)),
            ("flags", ArgValue::Hex(0x8001)),
            ("name", ArgValue::String(b"/etc/passwd".to_vec())),
        ],
    )
}

fn bind(text: &str) -> Result<Filter, FilterError> {
    FilterExpr::parse(text)?.bind(&EventFields::new(&args_of(EVENT)))
}

fn passes(text: &str) -> bool {
    bind(text)
        .unwrap_or_else(|e| panic!("{text}: {e} at {}", e.offset))
        .matches(&sample())
}

fn error(text: &str) -> (usize, FilterErrorKind) {
    let e = bind(text).expect_err(text);
    (e.offset, e.kind)
}

#[test]
fn numeric_comparisons_follow_the_fields_type() {
    for (filter, expected) in [
        ("count == 4096", true),
        ("count != 4096", false),
        ("count >= 4096", true),
        ("count > 4096", false),
        ("count < 0x1001", true),
        ("count <= 010000", true),
        ("count & 0x1000", true),
        ("count & 0xfff", false),
        ("delta < 0", true),
        ("delta == -3", true),
        ("delta > -4", true),
        ("flags & 0x8000", true),
        // (u8)456 == 200: the literal is cut to the field's size, as the kernel's (u8)val.
        ("small == 456", true),
        ("common_pid == 25", true),
        ("cpu == 1", true),
        ("CPU != 1", false),
    ] {
        assert_eq!(passes(filter), expected, "{filter}");
    }
}

#[test]
fn string_comparisons_are_exact_or_kernel_globs() {
    for (filter, expected) in [
        ("comm == \"hvprobe-loop\"", true),
        ("comm == 'hvprobe'", false),
        ("comm != \"sh\"", true),
        ("comm ~ \"hvprobe*\"", true),
        ("comm ~ \"*loop\"", true),
        ("comm ~ \"*probe*\"", true),
        ("comm ~ \"*xyz*\"", false),
        ("comm ~ \"hv?robe-l[aeiou]op\"", true),
        ("comm ~ \"hv*-loop\"", true),
        ("comm ~ \"!sh*\"", true),
        ("comm ~ \"!hv*\"", false),
        ("COMM ~ \"*\"", true),
        ("name ~ \"/etc/*\"", true),
        ("name == \"/etc/passwd\"", true),
    ] {
        assert_eq!(passes(filter), expected, "{filter}");
    }
}

#[test]
fn and_binds_tighter_than_or_and_not_applies_to_what_follows() {
    // false || true && true
    assert!(passes("count == 1 || delta < 0 && cpu == 1"));
    // (false || true) && false
    assert!(!passes("(count == 1 || delta < 0) && cpu == 0"));
    assert!(passes("!(count == 1)"));
    assert!(!passes("!count == 4096"));
    assert!(passes("!!(comm == \"hvprobe-loop\")"));
    assert!(passes("!(cpu == 0 && comm ~ \"x*\") && (common_pid > 1 || cpu == 7)"));
}

#[test]
fn a_faulted_value_fails_every_comparison() {
    let f = bind("name != \"x\"").unwrap();
    let mut h = sample();
    h.args[4].1 = ArgValue::Fault;
    assert!(!f.matches(&h));
    assert!(f.matches(&sample()));
}

#[test]
fn syntax_errors_say_what_and_where() {
    assert_eq!(error("  "), (2, FilterErrorKind::Empty));
    assert_eq!(error("count = 3"), (6, FilterErrorKind::InvalidOperator));
    assert_eq!(error("count == 3 cpu == 1"), (11, FilterErrorKind::ExpectedLogical));
    assert_eq!(error("(count == 3"), (11, FilterErrorKind::MissingCloseParen));
    assert_eq!(error("count == 3)"), (10, FilterErrorKind::UnbalancedCloseParen));
    assert_eq!(error("comm == \"sh"), (11, FilterErrorKind::MissingQuote));
    assert_eq!(error("comm == sh"), (8, FilterErrorKind::InvalidValue));
    assert_eq!(error("&& cpu == 1"), (0, FilterErrorKind::ExpectedComparison));
    assert_eq!(error("cpu == 1 ||"), (11, FilterErrorKind::ExpectedComparison));
    let long = format!("comm == \"{}\"", "a".repeat(256));
    assert_eq!(error(&long).1, FilterErrorKind::OperandTooLong(256));
    assert_eq!(
        error("count == 123456789012345678901234").1,
        FilterErrorKind::OperandTooLong(24)
    );
    assert_eq!(error(&"!".repeat(300)).1, FilterErrorKind::TooDeep);
}

#[test]
fn field_and_type_errors_say_what_and_where() {
    assert!(matches!(
        error("cpu == 1 && nope == 2"),
        (12, FilterErrorKind::Field(FieldError::Unknown { .. }))
    ));
    assert_eq!(error("comm == 3"), (8, FilterErrorKind::ExpectString("comm".into())));
    assert_eq!(
        error("count == \"3\""),
        (9, FilterErrorKind::ExpectNumber("count".into()))
    );
    assert_eq!(
        error("count ~ 3"),
        (
            8,
            FilterErrorKind::IllegalOperator {
                op: "~",
                field: "count".into(),
                string: false
            }
        )
    );
    assert_eq!(
        error("comm < \"a\""),
        (
            7,
            FilterErrorKind::IllegalOperator {
                op: "<",
                field: "comm".into(),
                string: true
            }
        )
    );
    assert_eq!(
        error("count == -1"),
        (
            9,
            FilterErrorKind::IllegalInteger {
                text: "-1".into(),
                field: "count".into(),
                signed: false
            }
        )
    );
    assert_eq!(
        error("delta == 12abc").1,
        FilterErrorKind::IllegalInteger {
            text: "12abc".into(),
            field: "delta".into(),
            signed: true
        }
    );
}

#[test]
fn literals_read_as_kstrtoull_and_kstrtoll_read_them() {
    assert_eq!(parse_unsigned("0"), Some(0));
    assert_eq!(parse_unsigned("0x1F"), Some(31));
    assert_eq!(parse_unsigned("017"), Some(15));
    assert_eq!(parse_unsigned("08"), None);
    assert_eq!(parse_unsigned("0x"), None);
    assert_eq!(parse_unsigned("18446744073709551615"), Some(u64::MAX));
    assert_eq!(parse_unsigned("18446744073709551616"), None);
    assert_eq!(parse_unsigned("+5"), None);
    assert_eq!(parse_signed("-9223372036854775808"), Some(i64::MIN));
    assert_eq!(parse_signed("9223372036854775808"), None);
    assert_eq!(parse_signed("-0x10"), Some(-16));
}

#[test]
fn glob_match_is_the_kernels() {
    for (pattern, s, expected) in [
        ("a*c", "abbbc", true),
        ("a*c", "abbbd", false),
        ("*", "", true),
        ("?", "", false),
        ("a?c", "abc", true),
        ("[a-c]x", "bx", true),
        ("[!a-c]x", "bx", false),
        ("[]]x", "]x", true),
        ("[a-]x", "-x", true),
        ("\\*x", "*x", true),
        ("\\*x", "ax", false),
        ("[abc", "[abc", true),
        ("*aaaaa", "aaaaaaaaaa", true),
        ("a*b*c", "axxbyyc", true),
        ("a*b*c", "axxbyy", false),
    ] {
        assert_eq!(
            glob_match(pattern.as_bytes(), s.as_bytes()),
            expected,
            "{pattern} vs {s}"
        );
    }
}

#[test]
fn a_glob_operand_is_classified_as_filter_parse_regex_does() {
    let g = |s: &str| StringPattern::glob(s.as_bytes());
    assert_eq!(g("abc"), (StringPattern::Full(b"abc".to_vec()), false));
    assert_eq!(g("abc*"), (StringPattern::Prefix(b"abc".to_vec()), false));
    assert_eq!(g("*abc"), (StringPattern::Suffix(b"abc".to_vec()), false));
    assert_eq!(g("*abc*"), (StringPattern::Substring(b"abc".to_vec()), false));
    assert_eq!(g("a*c"), (StringPattern::Glob(b"a*c".to_vec()), false));
    assert_eq!(g("!ab?"), (StringPattern::Glob(b"ab?".to_vec()), true));
    assert_eq!(g("1*"), (StringPattern::Full(b"1*".to_vec()), false));
}

/// What an event detour is given: each comparison with its field and operand as the host
/// binds them, and what only the host can test (globs beyond a prefix, args the probe
/// lays out otherwise) as `HostOnly`.
#[test]
fn the_record_filter_is_the_bound_filter_with_host_only_tests_marked() {
    let args = args_of(EVENT);
    let filter = bind("delta < -2 && (comm ~ \"hvp*\" || name ~ \"*passwd\") && !(cpu == 1 || common_pid != 25)")
        .unwrap()
        .record_filter(&args);
    let number = |field, op, value, size, signed| {
        RecordFilter::Test(RecordTest {
            field,
            check: RecordCheck::Number {
                op,
                value,
                size,
                signed,
            },
        })
    };
    let and = |a, b| RecordFilter::And(Box::new(a), Box::new(b));
    let or = |a, b| RecordFilter::Or(Box::new(a), Box::new(b));
    let expected = and(
        and(
            number(RecordField::Arg(2), NumberOp::Lt, (-2i64) as u64, 4, true),
            or(
                RecordFilter::Test(RecordTest {
                    field: RecordField::Comm,
                    check: RecordCheck::Bytes {
                        pattern: b"hvp".to_vec(),
                        whole: false,
                        negate: false,
                    },
                }),
                RecordFilter::HostOnly,
            ),
        ),
        RecordFilter::Not(Box::new(or(
            number(RecordField::Cpu, NumberOp::Eq, 1, 4, true),
            number(RecordField::Pid, NumberOp::Ne, 25, 4, true),
        ))),
    );
    assert_eq!(filter, expected);
    // An arg found by name in the probe's own args; one with another type is the host's.
    let name_first = args_of("p:g/e f name=+0(%r8):string delta=%dx:s32");
    let name_eq = RecordFilter::Test(RecordTest {
        field: RecordField::Arg(0),
        check: RecordCheck::Bytes {
            pattern: b"/etc".to_vec(),
            whole: true,
            negate: true,
        },
    });
    assert_eq!(bind("name != \"/etc\"").unwrap().record_filter(&name_first), name_eq);
    let retyped = args_of("p:g/e f delta=%dx:u32");
    assert_eq!(
        bind("delta < 0").unwrap().record_filter(&retyped),
        RecordFilter::HostOnly
    );
    assert_eq!(
        bind("flags & 0x8000").unwrap().record_filter(&[]),
        RecordFilter::HostOnly
    );
}
