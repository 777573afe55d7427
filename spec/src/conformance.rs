//! Conformance with Linux's probe parser: the refused lines of Linux's own selftest of its
//! error log (`tools/testing/selftests/ftrace/test.d/kprobe/kprobe_syntax_errors.tc`),
//! each with the error code and the column of Linux's `^` caret, and accepted lines from
//! Linux's kprobes documentation. Lines whose verdict needs the kernel's symbols, text or
//! BTF are in `check`'s tests, with a made-up kernel.

use super::*;

/// A refused line, with `^` where Linux's error log puts its caret: the line without the
/// `^`, and the 1-based column of the caret.
pub(super) fn caret(marked: &str) -> (String, usize) {
    let at = marked.find('^').expect("a ^ marks the column");
    (marked.replacen('^', "", 1), marked[..at].chars().count() + 1)
}

/// The selftest's refused lines that the syntax alone decides, with Linux's code.
pub(super) const REFUSED: &[(&str, LinuxError)] = &[
    ("p^100 vfs_read", LinuxError::BAD_MAXACT_TYPE),
    ("r^1a111 vfs_read", LinuxError::BAD_MAXACT),
    ("r^100000 vfs_read", LinuxError::MAXACT_TOO_BIG),
    ("p ^hoge-fuga", LinuxError::BAD_PROBE_ADDR),
    ("p ^hoge+1000-1000", LinuxError::BAD_PROBE_ADDR),
    ("r ^vfs_read+10", LinuxError::BAD_RETPROBE),
    ("p:^/bar vfs_read", LinuxError::NO_GROUP_NAME),
    (
        "p:^12345678901234567890123456789012345678901234567890123456789012345/bar vfs_read",
        LinuxError::GROUP_TOO_LONG,
    ),
    ("p:^foo.1/bar vfs_read", LinuxError::BAD_GROUP_NAME),
    ("p:^ vfs_read", LinuxError::NO_EVENT_NAME),
    (
        "p:foo/^12345678901234567890123456789012345678901234567890123456789012345 vfs_read",
        LinuxError::EVENT_TOO_LONG,
    ),
    ("p:foo/^bar.1 vfs_read", LinuxError::BAD_EVENT_NAME),
    ("p vfs_read ^$retval", LinuxError::RETVAL_ON_PROBE),
    ("p vfs_read ^$stack10000", LinuxError::BAD_STACK_NUM),
    ("p vfs_read ^$arg10000", LinuxError::BAD_ARG_NUM),
    ("p vfs_read ^$none_var", LinuxError::BAD_VAR),
    ("p vfs_read ^%none_reg", LinuxError::BAD_REG_NAME),
    ("p vfs_read ^@12345678abcde", LinuxError::BAD_MEM_ADDR),
    ("p vfs_read ^@+10", LinuxError::FILE_ON_KPROBE),
    ("p vfs_read arg1=\\^x", LinuxError::BAD_IMM),
    ("p vfs_read arg1=\\\"abcd^", LinuxError::IMMSTR_NO_CLOSE),
    ("p vfs_read ^+0@0)", LinuxError::DEREF_NEED_BRACE),
    ("p vfs_read ^+0ab1(@0)", LinuxError::BAD_DEREF_OFFS),
    ("p vfs_read +0(+0(@0^)", LinuxError::DEREF_OPEN_BRACE),
    ("p vfs_read +0(^$comm)", LinuxError::COMM_CANT_DEREF),
    ("p vfs_read ^&1", LinuxError::BAD_FETCH_ARG),
    (
        "p vfs_read +0(^+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(@0))))))))))))))",
        LinuxError::TOO_MANY_OPS,
    ),
    ("p vfs_read +0(@11):u8[10^", LinuxError::ARRAY_NO_CLOSE),
    ("p vfs_read +0(@11):u8[10]^a", LinuxError::BAD_ARRAY_SUFFIX),
    ("p vfs_read +0(@11):u8[^10a]", LinuxError::BAD_ARRAY_NUM),
    ("p vfs_read +0(@11):u8[^256]", LinuxError::ARRAY_TOO_BIG),
    ("p vfs_read @11:^unknown_type", LinuxError::BAD_TYPE),
    ("p vfs_read $stack0:^string", LinuxError::BAD_STRING),
    ("p vfs_read @11:^b10@a/16", LinuxError::BAD_BITFIELD),
    (
        "p vfs_read ^arg123456789012345678901234567890=@11",
        LinuxError::ARG_NAME_TOO_LONG,
    ),
    ("p vfs_read ^=@11", LinuxError::NO_ARG_NAME),
    ("p vfs_read ^var.1=@11", LinuxError::BAD_ARG_NAME),
    ("p vfs_read var1=@11 ^var1=@12", LinuxError::USED_ARG_NAME),
    (
        "p vfs_read ^+1234567(+1234567(+1234567(+1234567(+1234567(+1234567(@1234))))))",
        LinuxError::ARG_TOO_LONG,
    ),
    ("p vfs_read arg1=^", LinuxError::NO_ARG_BODY),
    ("p vfs_read^%hoge", LinuxError::BAD_ADDR_SUFFIX),
    ("p ^vfs_read+10%return", LinuxError::BAD_RETPROBE),
    ("p vfs_read args=^$arg*", LinuxError::BAD_VAR_ARGS),
    ("p vfs_read +0(^$arg*)", LinuxError::BAD_VAR_ARGS),
    ("p vfs_read $arg* ^$arg*", LinuxError::DOUBLE_ARGS),
    ("p vfs_read+20 ^$arg*", LinuxError::NOFENTRY_ARGS),
];

/// More refusals, one for each code the selftest has no line for (the caret where Linux's
/// parser puts it).
pub(super) const MORE_REFUSED: &[(&str, LinuxError)] = &[
    ("p vfs_read file.^f_pos", LinuxError::NOSUP_DAT_ARG),
    ("p vfs_read file^-f_pos", LinuxError::BAD_HYPHEN),
    ("p vfs_read file->f_path^-dentry", LinuxError::BAD_HYPHEN),
    ("p vfs_read $stack:^symstr", LinuxError::BAD_SYMSTRING),
    ("p vfs_read $comm:^u32", LinuxError::NEED_STRING_TYPE),
    ("p vfs_read \\\"abc\":^u8", LinuxError::NEED_STRING_TYPE),
    ("p vfs_read +0(^\\\"abc\")", LinuxError::COMM_CANT_DEREF),
    ("p vfs_read %ax:^string", LinuxError::BAD_STRING),
    ("p vfs_read+4 ^count", LinuxError::NOFENTRY_ARGS),
    ("p vfs_read ^$retval->f", LinuxError::RETVAL_ON_PROBE),
];

/// Lines Linux accepts, from its kprobes documentation and its selftests' valid forms.
const ACCEPTED: &[&str] = &[
    // Linux 6.9+ (its selftest refuses the first for older kernels): return probes take
    // the entry's arguments.
    "r vfs_read $arg*",
    "r vfs_read count",
    "r vfs_read $arg2",
    "p:myprobe do_sys_open dfd=%ax filename=%dx flags=%cx mode=+4($stack)",
    "r:myretprobe do_sys_open $retval",
    "-:myprobe",
    "p:myprobe do_sys_open+0 $arg1 $arg2 $arg3",
    "p:testprobe vfs_read +0(%di):u8[8] +8(%di):x16 @jiffies:u64",
    "p:testprobe vfs_read +0(%di):b4@4/32 +0(+8(%di)):string +u0(%si):ustring -u8(%si):x8",
    "p:testprobe vfs_read %ip:symbol %ip:symstr $stack0:symstr $comm $COMM:string",
    "p:testprobe vfs_read \\1 \\-1:s32 \\0x10:x8 str=\\\"hello\" +0(%si):char",
    "p:testprobe vfs_read +0(%si):char[4] $stack $stack2048 $arg2048",
    "p:testprobe vfs_read%return $retval:s64 $retval:symstr",
    "r64:grp/ev vfs_read $retval",
    "p:grp/ vfs_read",
    "p vfs_read $arg*",
    "p vfs_read count buf file",
    "p vfs_read file->f_pos pos->__x:u32",
    "p vfs_read $arg1->f_pos",
    "r vfs_read $retval->foo",
    "p vfs_read +0(file):u32 +8(file->f_inode):x64",
];

#[test]
fn the_selftest_refusals_have_linux_codes_and_columns() {
    for (marked, code) in REFUSED {
        let (line, column) = caret(marked);
        match parse_line(&line) {
            Err(e) => {
                assert_eq!(e.kind.linux_error(), Some(*code), "{marked:?}: {e}");
                assert_eq!(e.column, column, "{marked:?}: {e}");
            }
            Ok(spec) => panic!("{marked:?} accepted: {spec:?}"),
        }
    }
}

#[test]
fn more_refusals_have_linux_codes_and_columns() {
    for (marked, code) in MORE_REFUSED {
        let (line, column) = caret(marked);
        match parse_line(&line) {
            Err(e) => {
                assert_eq!(e.kind.linux_error(), Some(*code), "{marked:?}: {e}");
                assert_eq!(e.column, column, "{marked:?}: {e}");
            }
            Ok(spec) => panic!("{marked:?} accepted: {spec:?}"),
        }
    }
    // More arguments than Linux takes, and more data than one event holds.
    let many: Vec<String> = (0..=MAX_ARGS).map(|i| format!("a{i}=%ax")).collect();
    let line = format!("p f {}", many.join(" "));
    let e = parse_line(&line).unwrap_err();
    assert_eq!(e.kind.linux_error(), Some(LinuxError::TOO_MANY_ARGS));
    assert_eq!(e.column, line.rfind(' ').unwrap() + 2);
    let seven: Vec<String> = (0..7).map(|i| format!("a{i}=+0(%ax):x64[64]")).collect();
    let e = parse_line(&format!("p f {}", seven.join(" "))).unwrap_err();
    assert_eq!(e.kind.linux_error(), Some(LinuxError::EVENT_TOO_BIG));
}

#[test]
fn documented_lines_are_accepted_and_round_trip() {
    for line in ACCEPTED {
        match parse_line(line) {
            Ok(Some(spec)) => {
                let text = spec.to_string();
                assert_eq!(parse_line(&text), Ok(Some(spec)), "{line:?} shown as {text:?}");
            }
            other => panic!("{line:?}: {other:?}"),
        }
    }
}

/// Every code of the table above has a kind that gives it, so each refusal is tested.
#[test]
fn every_error_kind_maps_to_one_linux_code_or_is_an_extension() {
    let extension = [
        SpecErrorKind::NamedWildcard,
        SpecErrorKind::TooManyAlternatives("x".into()),
        SpecErrorKind::UnknownProbeType("x".into()),
        SpecErrorKind::JunkAfterProbeType("x".into()),
        SpecErrorKind::MissingTarget,
        SpecErrorKind::BadModuleTarget("x".into()),
        SpecErrorKind::UprobeNotSupported("x".into()),
        SpecErrorKind::ArgsOnRemove,
        SpecErrorKind::JunkAfterDeref("x".into()),
    ];
    for kind in extension {
        assert_eq!(kind.linux_error(), None, "{kind:?}");
    }
}
