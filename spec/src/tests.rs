use proptest::prelude::*;

use super::*;

fn ok(line: &str) -> ProbeSpec {
    match parse_line(line) {
        Ok(Some(spec)) => spec,
        other => panic!("{line:?}: expected a probe, got {other:?}"),
    }
}

/// The (column, kind) of the error `line` must give.
fn err(line: &str) -> (usize, SpecErrorKind) {
    match parse_line(line) {
        Err(e) => {
            assert_eq!(e.line, 1);
            (e.column, e.kind)
        }
        other => panic!("{line:?}: expected an error, got {other:?}"),
    }
}

/// The fetch-args of `line`.
fn args(line: &str) -> Vec<FetchArg> {
    match ok(line) {
        ProbeSpec::Kprobe { args, .. } | ProbeSpec::Kretprobe { args, .. } | ProbeSpec::Watch { args, .. } => args,
        ProbeSpec::Remove { .. } => panic!("{line:?} is a remove"),
    }
}

/// The only fetch-arg of `p:e f ARG` (a function entry, so `$argN` works).
fn arg(text: &str) -> FetchArg {
    let mut all = args(&format!("p:e f {text}"));
    assert_eq!(all.len(), 1);
    all.remove(0)
}

fn expr(text: &str) -> FetchExpr {
    arg(text).expr
}

/// The (column, kind) of the error of the fetch-arg in `p:e f ARG`; the column is counted
/// from the fetch-arg's first character (1).
fn arg_err(text: &str) -> (usize, SpecErrorKind) {
    let (column, kind) = err(&format!("p:e f {text}"));
    (column - "p:e f ".len(), kind)
}

fn sym(name: &str, offset: u64) -> Target {
    Target::Symbol {
        name: name.to_owned(),
        offset,
    }
}

fn deref(offset: i64, base: FetchExpr) -> FetchExpr {
    FetchExpr::Deref {
        offset,
        user: false,
        base: Box::new(base),
    }
}

fn round_trip(spec: &ProbeSpec) {
    let text = spec.to_string();
    assert_eq!(parse_line(&text), Ok(Some(spec.clone())), "canonical text {text:?}");
}

// ---- probe lines ----

#[test]
fn kprobe_with_group_event_offset_and_args() {
    assert_eq!(
        ok("p:mygrp/myevent do_sys_open+16 dfd=%ax"),
        ProbeSpec::Kprobe {
            group: "mygrp".into(),
            event: "myevent".into(),
            target: sym("do_sys_open", 16),
            args: vec![FetchArg {
                name: "dfd".into(),
                expr: FetchExpr::Register(Register::Ax),
                ty: ArgType::X64,
                array_len: None,
                typed: false
            }],
        }
    );
}

#[test]
fn kprobe_defaults_group_and_event_like_the_kernel() {
    assert_eq!(
        ok("p do_sys_open"),
        ProbeSpec::Kprobe {
            group: "kprobes".into(),
            event: "p_do_sys_open_0".into(),
            target: sym("do_sys_open", 0),
            args: vec![]
        }
    );
    assert!(matches!(ok("p:ev f"), ProbeSpec::Kprobe { group, event, .. } if group == "kprobes" && event == "ev"));
    assert!(
        matches!(ok("p:grp/ f+0x10"), ProbeSpec::Kprobe { group, event, .. } if group == "grp" && event == "p_f_16")
    );
    // The kernel also takes `.` between group and event.
    assert!(matches!(ok("p:g-1.ev f"), ProbeSpec::Kprobe { group, event, .. } if group == "g-1" && event == "ev"));
    // Dots in symbols (compiler clones) become `_` in the generated name.
    assert!(matches!(ok("p foo.isra.0+4"), ProbeSpec::Kprobe { event, .. } if event == "p_foo_isra_0_4"));
}

#[test]
fn generated_event_name_is_truncated_like_the_kernel() {
    let long = "a".repeat(80);
    let ProbeSpec::Kprobe { event, .. } = ok(&format!("p {long}")) else {
        panic!()
    };
    assert_eq!(event.len(), MAX_EVENT_NAME_LEN);
    assert!(event.starts_with("p_aaa"));
}

#[test]
fn address_targets() {
    assert!(matches!(
        ok("p 0xffffffff81000000"),
        ProbeSpec::Kprobe { target: Target::Address(Gva(0xffff_ffff_8100_0000)), event, .. }
            if event == "p_0xffffffff81000000"
    ));
    assert!(matches!(
        ok("p 4096"),
        ProbeSpec::Kprobe {
            target: Target::Address(Gva(4096)),
            ..
        }
    ));
    // kstrtoul takes a leading `+`, so the kernel reads this as an address too.
    assert!(matches!(
        ok("p +4"),
        ProbeSpec::Kprobe {
            target: Target::Address(Gva(4)),
            ..
        }
    ));
    assert!(matches!(
        ok("p 010"),
        ProbeSpec::Kprobe {
            target: Target::Address(Gva(8)),
            ..
        }
    ));
    assert!(matches!(
        ok("r 0x1000"),
        ProbeSpec::Kretprobe {
            target: Target::Address(Gva(0x1000)),
            ..
        }
    ));
}

#[test]
fn kretprobes() {
    assert_eq!(
        ok("r do_exit $retval"),
        ProbeSpec::Kretprobe {
            group: "kprobes".into(),
            event: "r_do_exit_0".into(),
            target: sym("do_exit", 0),
            maxactive: None,
            args: vec![FetchArg {
                name: "arg1".into(),
                expr: FetchExpr::Retval,
                ty: ArgType::X64,
                array_len: None,
                typed: false
            }],
        }
    );
    assert!(matches!(
        ok("r10:ev f"),
        ProbeSpec::Kretprobe {
            maxactive: Some(10),
            ..
        }
    ));
    assert!(matches!(
        ok("r0x10 f+0"),
        ProbeSpec::Kretprobe {
            maxactive: Some(16),
            ..
        }
    ));
    assert!(matches!(
        ok("r4096 f"),
        ProbeSpec::Kretprobe {
            maxactive: Some(4096),
            ..
        }
    ));
    assert!(matches!(
        ok("p:ev f%return $retval"),
        ProbeSpec::Kretprobe { maxactive: None, event, .. } if event == "ev"
    ));
    assert!(matches!(ok("p f+0%return"), ProbeSpec::Kretprobe { event, .. } if event == "r_f_0"));
}

#[test]
fn removes() {
    assert_eq!(
        ok("-:ev"),
        ProbeSpec::Remove {
            group: None,
            event: "ev".into()
        }
    );
    assert_eq!(
        ok("-:grp/ev"),
        ProbeSpec::Remove {
            group: Some("grp".into()),
            event: "ev".into()
        }
    );
}

#[test]
fn blank_lines_comments_and_whitespace() {
    for line in ["", "   ", "\t", "# p f", "   # comment", "#"] {
        assert_eq!(parse_line(line), Ok(None), "{line:?}");
    }
    assert_eq!(ok("p:e f # %rxx is ignored"), ok("p:e f"));
    assert_eq!(ok("p:e f#comment"), ok("p:e f"));
    assert_eq!(ok("\tp:e\tf \t %ax  "), ok("p:e f %ax"));
}

#[test]
fn parse_file_returns_all_probes_in_order() {
    let text = "# probes\n\np:a f %ax\nr:b g $retval\r\n-:a\n";
    let specs = parse_file(text, "x.spec").unwrap();
    assert_eq!(specs.len(), 3);
    assert!(matches!(&specs[0], ProbeSpec::Kprobe { event, .. } if event == "a"));
    assert!(matches!(&specs[1], ProbeSpec::Kretprobe { event, .. } if event == "b"));
    assert!(matches!(&specs[2], ProbeSpec::Remove { event, .. } if event == "a"));
    assert_eq!(parse_file("", "x.spec"), Ok(vec![]));
}

#[test]
fn parse_file_names_file_line_and_column() {
    let e = parse_file("p f\n# ok\np sys_open a=%rxx\np g %nope\n", "file.spec").unwrap_err();
    assert_eq!((e.file.as_deref(), e.line, e.column), (Some("file.spec"), 3, 14));
    assert_eq!(e.to_string(), "file.spec:3:14: unknown register %rxx");
    let e = parse_line("p f %rax").unwrap_err();
    assert_eq!(e.to_string(), "1:5: unknown register %rax (the kernel calls it %ax)");
}

#[test]
fn columns_count_characters_not_bytes() {
    // `é` is two bytes; the missing `]` is reported just past it: character 17, byte 18.
    assert_eq!(err("p f +0(%ax):x8[é"), (17, SpecErrorKind::ArrayNotClosed));
    assert_eq!(err("p:e f é=%rxx"), (7, SpecErrorKind::BadArgName("é".into())));
    assert_eq!(err("p f +0(%ax):x8[1é"), (18, SpecErrorKind::ArrayNotClosed));
}

// ---- fetch-args ----

#[test]
fn every_register_the_kernel_knows() {
    for register in Register::ALL {
        assert_eq!(expr(&format!("%{register}")), FetchExpr::Register(register));
        assert_eq!(Register::from_name(register.name()), Some(register));
    }
    assert_eq!(Register::R15.pt_regs_offset(), 0);
    assert_eq!(Register::Ax.pt_regs_offset(), 80);
    assert_eq!(Register::OrigAx.pt_regs_offset(), 120);
    assert_eq!(Register::Ss.pt_regs_offset(), 160);
}

#[test]
fn memory_fetchargs() {
    assert_eq!(expr("@0x1000"), FetchExpr::Memory(Gva(0x1000)));
    assert_eq!(expr("@1234"), FetchExpr::Memory(Gva(1234)));
    assert_eq!(
        expr("@jiffies"),
        FetchExpr::SymbolMemory {
            name: "jiffies".into(),
            offset: 0
        }
    );
    assert_eq!(
        expr("@jiffies+8"),
        FetchExpr::SymbolMemory {
            name: "jiffies".into(),
            offset: 8
        }
    );
    assert_eq!(
        expr("@init_task-0x10"),
        FetchExpr::SymbolMemory {
            name: "init_task".into(),
            offset: -16
        }
    );
}

#[test]
fn variables() {
    assert_eq!(expr("$stack"), FetchExpr::StackPointer);
    assert_eq!(expr("$stack0"), FetchExpr::StackEntry(0));
    assert_eq!(expr("$stack2048"), FetchExpr::StackEntry(2048));
    // Named, the register or stack slot; unnamed, the parameter as BTF has it, if it has
    // (see `check::resolve_btf_args`).
    assert_eq!(expr("a=$arg1"), FetchExpr::Arg(1));
    assert_eq!(expr("a=$arg2048"), FetchExpr::Arg(2048));
    let plain = |n| {
        FetchExpr::Btf(BtfRef {
            base: BtfBase::Arg(n),
            fields: Vec::new(),
        })
    };
    assert_eq!(expr("$arg1"), plain(1));
    assert_eq!(expr("$comm"), FetchExpr::Comm);
    assert_eq!(expr("$COMM"), FetchExpr::Comm);
    assert_eq!(arg("$comm").ty, ArgType::String);
    assert_eq!(args("r f $retval")[0].expr, FetchExpr::Retval);
    assert_eq!(args("p f+0 $arg3")[0].expr, plain(3));
}

#[test]
fn dereferences() {
    assert_eq!(expr("+8(%di)"), deref(8, FetchExpr::Register(Register::Di)));
    assert_eq!(expr("-8(%sp)"), deref(-8, FetchExpr::Register(Register::Sp)));
    assert_eq!(expr("+0x10(+8($stack))"), deref(16, deref(8, FetchExpr::StackPointer)));
    assert_eq!(
        expr("+0(@jiffies)"),
        deref(
            0,
            FetchExpr::SymbolMemory {
                name: "jiffies".into(),
                offset: 0
            }
        )
    );
    assert_eq!(
        expr("+u4(%si)"),
        FetchExpr::Deref {
            offset: 4,
            user: true,
            base: Box::new(FetchExpr::Register(Register::Si))
        }
    );
    assert_eq!(
        expr("-u4(%si)"),
        FetchExpr::Deref {
            offset: -4,
            user: true,
            base: Box::new(FetchExpr::Register(Register::Si))
        }
    );
    assert_eq!(
        expr("-0x8000000000000000(%ax)"),
        deref(i64::MIN, FetchExpr::Register(Register::Ax))
    );
    assert_eq!(expr("+0(\\0x1000)"), deref(0, FetchExpr::Immediate(0x1000)));
}

#[test]
fn immediates() {
    assert_eq!(expr("\\123"), FetchExpr::Immediate(123));
    assert_eq!(expr("\\0x10"), FetchExpr::Immediate(16));
    assert_eq!(expr("\\-1"), FetchExpr::Immediate(u64::MAX));
    assert_eq!(expr("\\+5"), FetchExpr::Immediate(5));
}

#[test]
fn argument_names_default_to_their_position() {
    let names: Vec<String> = args("p f %ax x=%bx %cx").into_iter().map(|a| a.name).collect();
    assert_eq!(names, ["arg1", "x", "arg3"]);
    assert_eq!(arg(&format!("{}=%ax", "n".repeat(32))).name.len(), 32);
}

#[test]
fn types() {
    let plain = [
        ("u8", ArgType::U8),
        ("u16", ArgType::U16),
        ("u32", ArgType::U32),
        ("u64", ArgType::U64),
        ("s8", ArgType::S8),
        ("s16", ArgType::S16),
        ("s32", ArgType::S32),
        ("s64", ArgType::S64),
        ("x8", ArgType::X8),
        ("x16", ArgType::X16),
        ("x32", ArgType::X32),
        ("x64", ArgType::X64),
        ("symbol", ArgType::Symbol),
        ("symstr", ArgType::SymStr),
    ];
    for (name, ty) in plain {
        assert_eq!(arg(&format!("%ax:{name}")).ty, ty, "{name}");
        assert_eq!(ty.to_string(), name);
    }
    assert_eq!(arg("%ax").ty, ArgType::X64);
    for string in ["+0(%di)", "@0x1000", "@sym", "\\0x1000", "$comm", "+u0(%si)"] {
        assert_eq!(arg(&format!("{string}:string")).ty, ArgType::String, "{string}");
    }
    for string in ["+0(%di)", "@0x1000", "@sym", "\\0x1000", "+u0(%si)"] {
        assert_eq!(arg(&format!("{string}:ustring")).ty, ArgType::UString, "{string}");
    }
    for symstr in ["$stack3", "$arg1", "+8(%di)", "@sym"] {
        assert_eq!(arg(&format!("{symstr}:symstr")).ty, ArgType::SymStr, "{symstr}");
    }
    assert_eq!(args("r f $retval:symstr")[0].ty, ArgType::SymStr);
    assert_eq!(
        arg("+0(%di):b4@2/32").ty,
        ArgType::Bitfield {
            width: 4,
            offset: 2,
            container_bits: 32
        }
    );
    assert_eq!(
        arg("%ax:b64@0/64").ty,
        ArgType::Bitfield {
            width: 64,
            offset: 0,
            container_bits: 64
        }
    );
    assert_eq!(
        arg("%ax:b1@0x7/8").ty,
        ArgType::Bitfield {
            width: 1,
            offset: 7,
            container_bits: 8
        }
    );
}

#[test]
fn arrays() {
    let a = arg("+0(%di):x16[4]");
    assert_eq!((a.ty, a.array_len), (ArgType::X16, Some(4)));
    assert_eq!(arg("@sym:u8[64]").array_len, Some(64));
    assert_eq!(arg("+0(%di):string[2]").array_len, Some(2));
    assert_eq!(arg("+0(%di):b2@0/8[3]").array_len, Some(3));
}

#[test]
fn limits_that_just_fit() {
    let many: Vec<String> = (0..MAX_ARGS).map(|i| format!("a{i}=%ax")).collect();
    assert_eq!(args(&format!("p f {}", many.join(" "))).len(), MAX_ARGS);
    // 63 characters of fetch-arg.
    let body = format!("+{}(%ax)", "0".repeat(MAX_ARG_BODY_LEN - 6));
    assert_eq!(body.len(), MAX_ARG_BODY_LEN);
    arg(&body);
    let six: Vec<&str> = vec!["+0(%ax):x64[64]"; 6];
    let six: Vec<String> = six.iter().enumerate().map(|(i, a)| format!("a{i}={a}")).collect();
    assert_eq!(args(&format!("p f {}", six.join(" "))).len(), 6);
    let nested = format!("{}%ax{}", "+0(".repeat(14), ")".repeat(14));
    assert_eq!(nested.len(), 59);
    arg(&nested);
    let group = "g".repeat(63);
    let event = "e".repeat(63);
    ok(&format!("p:{group}/{event} f"));
}

// ---- errors, with their columns ----

#[test]
fn probe_type_errors() {
    assert_eq!(err("x f"), (1, SpecErrorKind::UnknownProbeType("x".into())));
    assert_eq!(err("  - f"), (3, SpecErrorKind::UnknownProbeType("-".into())));
    assert_eq!(err("pfoo f"), (2, SpecErrorKind::JunkAfterProbeType("foo".into())));
    assert_eq!(err("rx:e f"), (2, SpecErrorKind::JunkAfterProbeType("x".into())));
    assert_eq!(err("p1:e f"), (2, SpecErrorKind::MaxactiveOnKprobe));
    assert_eq!(err("r0 f"), (2, SpecErrorKind::BadMaxactive("0".into())));
    assert_eq!(err("r4097 f"), (2, SpecErrorKind::MaxactiveTooBig("4097".into())));
    assert_eq!(err("r12x:e f"), (2, SpecErrorKind::BadMaxactive("12x".into())));
}

#[test]
fn group_and_event_errors() {
    assert_eq!(err("p:/e f"), (3, SpecErrorKind::NoGroupName));
    assert_eq!(err("p:g!/e f"), (3, SpecErrorKind::BadGroupName("g!".into())));
    assert_eq!(err("p:a.b/e f"), (3, SpecErrorKind::BadGroupName("a.b".into())));
    assert_eq!(
        err(&format!("p:{}/e f", "g".repeat(64))),
        (3, SpecErrorKind::GroupNameTooLong)
    );
    assert_eq!(err("p: f"), (3, SpecErrorKind::NoEventName));
    assert_eq!(err("p:grp/9ev f"), (7, SpecErrorKind::BadEventName("9ev".into())));
    assert_eq!(err("p:e-v f"), (3, SpecErrorKind::BadEventName("e-v".into())));
    assert_eq!(
        err(&format!("p:g/{} f", "e".repeat(64))),
        (5, SpecErrorKind::EventNameTooLong)
    );
}

#[test]
fn target_errors() {
    assert_eq!(err("p"), (2, SpecErrorKind::MissingTarget));
    assert_eq!(err("p:ev   "), (5, SpecErrorKind::MissingTarget));
    assert_eq!(err("p 9sym"), (3, SpecErrorKind::BadTarget("9sym".into())));
    assert_eq!(err("p f!"), (3, SpecErrorKind::BadTarget("f!".into())));
    assert_eq!(err("p f+x"), (3, SpecErrorKind::BadTargetOffset("+x".into())));
    assert_eq!(err("p f-4"), (3, SpecErrorKind::BadTargetOffset("-4".into())));
    assert_eq!(
        err("p f+0x100000000"),
        (3, SpecErrorKind::BadTargetOffset("+0x100000000".into()))
    );
    assert_eq!(err("p ext4:"), (3, SpecErrorKind::BadModuleTarget("ext4:".into())));
    assert_eq!(
        err("p :ext4_sync_file"),
        (3, SpecErrorKind::BadModuleTarget(":ext4_sync_file".into()))
    );
    assert!(target_of("p ext4:ext4_*").is_wildcard());
    assert_eq!(err("p:e ext4:ext4_*"), (5, SpecErrorKind::NamedWildcard));
    assert_eq!(err("p ex!t4:f"), (3, SpecErrorKind::BadModuleTarget("ex!t4:f".into())));
    // The kernel's module names have `_` where the file's name has `-`.
    assert_eq!(
        err("p hvprobe-test:f"),
        (3, SpecErrorKind::BadModuleTarget("hvprobe-test:f".into()))
    );
    assert_eq!(err("r ext4:f+4"), (3, SpecErrorKind::RetprobeNotOnEntry(4)));
    assert_eq!(
        err("p /bin/sh:0x10"),
        (3, SpecErrorKind::UprobeNotSupported("/bin/sh:0x10".into()))
    );
    assert_eq!(err("p f%ret"), (4, SpecErrorKind::BadTargetSuffix("%ret".into())));
    assert_eq!(err("r f+4"), (3, SpecErrorKind::RetprobeNotOnEntry(4)));
    assert_eq!(err("p f+4%return"), (3, SpecErrorKind::RetprobeNotOnEntry(4)));
}

#[test]
fn remove_errors() {
    assert_eq!(err("-:ev extra"), (6, SpecErrorKind::ArgsOnRemove));
    assert_eq!(err("-:grp/"), (7, SpecErrorKind::NoEventName));
    assert_eq!(err("-:"), (3, SpecErrorKind::NoEventName));
    assert_eq!(err("-:9"), (3, SpecErrorKind::BadEventName("9".into())));
}

#[test]
fn argument_list_errors() {
    let many: Vec<String> = (0..=MAX_ARGS).map(|i| format!("a{i}=%ax")).collect();
    let line = format!("p f {}", many.join(" "));
    let last_column = line.rfind(' ').unwrap() + 2;
    assert_eq!(err(&line), (last_column, SpecErrorKind::TooManyArgs));
    assert_eq!(arg_err("=%ax"), (1, SpecErrorKind::NoArgName));
    assert_eq!(
        arg_err(&format!("{}=%ax", "n".repeat(33))),
        (1, SpecErrorKind::ArgNameTooLong)
    );
    assert_eq!(arg_err("1a=%ax"), (1, SpecErrorKind::BadArgName("1a".into())));
    assert_eq!(
        err("p f a=%ax a=%bx"),
        (11, SpecErrorKind::DuplicateArgName("a".into()))
    );
    // A default name can collide too.
    assert_eq!(
        err("p f arg2=%ax %bx"),
        (14, SpecErrorKind::DuplicateArgName("arg2".into()))
    );
    assert_eq!(
        arg_err("common_pid=%ax"),
        (1, SpecErrorKind::ReservedArgName("common_pid".into()))
    );
    assert_eq!(
        arg_err("__probe_ip=%ax"),
        (1, SpecErrorKind::ReservedArgName("__probe_ip".into()))
    );
    assert_eq!(arg_err("x="), (3, SpecErrorKind::NoArgBody));
    let body = format!("+{}(%ax)", "0".repeat(MAX_ARG_BODY_LEN - 5));
    assert_eq!(arg_err(&format!("x={body}")), (3, SpecErrorKind::ArgTooLong));
    let seven: Vec<String> = (0..7).map(|i| format!("a{i}=+0(%ax):x64[64]")).collect();
    let line = format!("p f {}", seven.join(" "));
    let last_column = line.rfind(' ').unwrap() + 2;
    assert_eq!(err(&line), (last_column, SpecErrorKind::EventTooBig(3584)));
}

#[test]
fn register_errors() {
    assert_eq!(
        arg_err("%rxx"),
        (
            1,
            SpecErrorKind::UnknownRegister {
                name: "rxx".into(),
                hint: None
            }
        )
    );
    assert_eq!(
        arg_err("x=%eip"),
        (
            3,
            SpecErrorKind::UnknownRegister {
                name: "eip".into(),
                hint: Some("ip")
            }
        )
    );
    assert_eq!(
        arg_err("%rflags"),
        (
            1,
            SpecErrorKind::UnknownRegister {
                name: "rflags".into(),
                hint: Some("flags")
            }
        )
    );
    // Case matters to the kernel.
    assert_eq!(
        arg_err("%AX"),
        (
            1,
            SpecErrorKind::UnknownRegister {
                name: "AX".into(),
                hint: None
            }
        )
    );
    assert_eq!(
        arg_err("%"),
        (
            1,
            SpecErrorKind::UnknownRegister {
                name: "".into(),
                hint: None
            }
        )
    );
}

#[test]
fn memory_errors() {
    assert_eq!(arg_err("@0xzz"), (1, SpecErrorKind::BadMemoryAddress("0xzz".into())));
    assert_eq!(arg_err("@+10"), (1, SpecErrorKind::FileOffsetOnKprobe));
    assert_eq!(arg_err("@sym+q"), (5, SpecErrorKind::BadDerefOffset("+q".into())));
    assert_eq!(arg_err("@"), (2, SpecErrorKind::BadMemorySymbol("".into())));
    assert_eq!(arg_err("@-8"), (2, SpecErrorKind::BadMemorySymbol("".into())));
}

#[test]
fn variable_errors() {
    assert_eq!(arg_err("$foo"), (1, SpecErrorKind::UnknownVariable("foo".into())));
    assert_eq!(arg_err("$stackx"), (1, SpecErrorKind::UnknownVariable("stackx".into())));
    assert_eq!(arg_err("$stack2049"), (1, SpecErrorKind::BadStackIndex("2049".into())));
    assert_eq!(
        arg_err("$stack99999999999999999999"),
        (1, SpecErrorKind::BadStackIndex("99999999999999999999".into()))
    );
    assert_eq!(arg_err("$arg0"), (1, SpecErrorKind::BadArgNumber("0".into())));
    assert_eq!(arg_err("$arg2049"), (1, SpecErrorKind::BadArgNumber("2049".into())));
    assert_eq!(arg_err("$argx"), (1, SpecErrorKind::UnknownVariable("argx".into())));
    assert_eq!(err("p f+4 $arg1"), (7, SpecErrorKind::ArgNotOnEntry));
    assert_eq!(err("p 0x1000 $arg1"), (10, SpecErrorKind::ArgNotOnEntry));
    assert_eq!(arg_err("$retval"), (1, SpecErrorKind::RetvalOnKprobe));
    assert_eq!(arg_err("$duration"), (1, SpecErrorKind::DurationOnKprobe));
}

#[test]
fn dereference_errors() {
    assert_eq!(arg_err("+8%di"), (1, SpecErrorKind::DerefNeedsParen));
    assert_eq!(arg_err("+x(%di)"), (1, SpecErrorKind::BadDerefOffset("x".into())));
    assert_eq!(arg_err("+u(%di)"), (1, SpecErrorKind::BadDerefOffset("".into())));
    assert_eq!(arg_err("++8(%di)"), (1, SpecErrorKind::BadDerefOffset("+8".into())));
    assert_eq!(arg_err("+8(%di"), (7, SpecErrorKind::DerefNotClosed));
    assert_eq!(arg_err("+8(%di)x"), (8, SpecErrorKind::JunkAfterDeref("x".into())));
    assert_eq!(arg_err("+0($comm)"), (4, SpecErrorKind::CommDeref));
    assert_eq!(
        arg_err("+0(+8(%rxx))"),
        (
            7,
            SpecErrorKind::UnknownRegister {
                name: "rxx".into(),
                hint: None
            }
        )
    );
    assert_eq!(arg_err("+0()"), (4, SpecErrorKind::NoArgBody));
    // @SYM is three kernel ops, each dereference one more: 16 > 15.
    let too_deep = format!("{}@a{}", "+0(".repeat(13), ")".repeat(13));
    // Linux finds it out in the outermost dereference: after its `(`.
    assert_eq!(arg_err(&too_deep), (4, SpecErrorKind::TooManyFetchOps(16)));
}

#[test]
fn immediate_and_unknown_fetcharg_errors() {
    assert_eq!(arg_err("\\\"abc"), (6, SpecErrorKind::ImmStringNotClosed));
    assert_eq!(arg_err("\\\""), (3, SpecErrorKind::ImmStringNotClosed));
    assert_eq!(arg_err("\\x"), (2, SpecErrorKind::BadImmediate("x".into())));
    assert_eq!(arg_err("\\"), (2, SpecErrorKind::BadImmediate("".into())));
    assert_eq!(arg_err("&1"), (1, SpecErrorKind::BadFetchArg("&1".into())));
    assert_eq!(arg_err("n=1ax"), (3, SpecErrorKind::BadFetchArg("1ax".into())));
}

#[test]
fn type_errors() {
    assert_eq!(arg_err("%ax:u128"), (5, SpecErrorKind::UnknownType("u128".into())));
    assert_eq!(arg_err("%ax:"), (5, SpecErrorKind::UnknownType("".into())));
    for bad in ["b0@0/32", "b4@30/32", "b4/32", "b4@/32", "b65@0/64"] {
        assert_eq!(
            arg_err(&format!("+0(%ax):{bad}")),
            (9, SpecErrorKind::BadBitfield(bad.into())),
            "{bad}"
        );
    }
    // Without a good container size after `/`, Linux does not know the type at all.
    for bad in ["b4@0/24", "b4@0", "b"] {
        assert_eq!(
            arg_err(&format!("+0(%ax):{bad}")),
            (9, SpecErrorKind::UnknownType(bad.into())),
            "{bad}"
        );
    }
    assert_eq!(arg_err("+0(%ax):x8[4"), (13, SpecErrorKind::ArrayNotClosed));
    assert_eq!(
        arg_err("+0(%ax):x8[4]x"),
        (14, SpecErrorKind::JunkAfterArray("x".into()))
    );
    assert_eq!(arg_err("+0(%ax):x8[0]"), (12, SpecErrorKind::BadArrayLen("0".into())));
    assert_eq!(arg_err("+0(%ax):x8[65]"), (12, SpecErrorKind::ArrayTooBig("65".into())));
    assert_eq!(arg_err("%ax:x8[2]"), (5, SpecErrorKind::ArrayNotOnMemory));
    assert_eq!(arg_err("+0(%ax):symstr[2]"), (9, SpecErrorKind::ArrayNotOnMemory));
    assert_eq!(arg_err("%ax:string"), (5, SpecErrorKind::StringNotOnMemory("string")));
    assert_eq!(
        arg_err("$stack:ustring"),
        (8, SpecErrorKind::StringNotOnMemory("ustring"))
    );
    assert_eq!(arg_err("$stack:symstr"), (8, SpecErrorKind::SymstrBadFetch));
    assert_eq!(arg_err("+u0(%ax):symstr"), (10, SpecErrorKind::SymstrBadFetch));
    assert_eq!(arg_err("$comm:u32"), (7, SpecErrorKind::CommNotString));
    assert_eq!(arg_err("$comm:string[2]"), (7, SpecErrorKind::CommNotString));
    // The type is read before the fetch-arg, as in the kernel.
    assert_eq!(arg_err("%rxx:u128"), (6, SpecErrorKind::UnknownType("u128".into())));
}

// ---- display and round trips ----

#[test]
fn display_is_the_canonical_form() {
    let cases = [
        ("p do_sys_open %ax", "p:kprobes/p_do_sys_open_0 do_sys_open arg1=%ax"),
        (
            "p ext4:ext4_sync_file",
            "p:kprobes/p_ext4_ext4_sync_file_0 ext4:ext4_sync_file",
        ),
        ("r mod_x:f+0 %ax", "r:kprobes/r_mod_x_f_0 mod_x:f arg1=%ax"),
        ("p:g.e f+0x10 x=+0x10(%di):u32", "p:g/e f+16 x=+16(%di):u32"),
        ("r100:e f $retval:s64", "r100:kprobes/e f arg1=$retval:s64"),
        ("p:e f%return", "r:kprobes/e f"),
        (
            "p 18446744071578845184",
            "p:kprobes/p_0xffffffff81000000 0xffffffff81000000",
        ),
        ("p:e f @0x10 @sym-0x8 @sym+0", "p:e f arg1=@16 arg2=@sym-8 arg3=@sym"),
        (
            "p:e f $COMM:string -u0x8(%si):string",
            "p:kprobes/e f arg1=$comm arg2=-u8(%si):string",
        ),
        ("p:e f \\-1 \\0xffffffff", "p:kprobes/e f arg1=\\-1 arg2=\\4294967295"),
        (
            "p:e f +0(%di):b4@2/32[3] $stack07",
            "p:kprobes/e f arg1=+0(%di):b4@2/32[3] arg2=$stack7",
        ),
        ("-:g/e", "-:g/e"),
        ("-:e", "-:e"),
    ];
    for (input, canonical) in cases {
        let spec = ok(input);
        let canonical = if canonical.starts_with("p:e f") {
            canonical.replacen("p:e f", "p:kprobes/e f", 1)
        } else {
            canonical.to_owned()
        };
        assert_eq!(spec.to_string(), canonical, "{input}");
        round_trip(&spec);
    }
}

#[test]
fn error_display() {
    let e = parse_file("\n\n\np:e f %ax:u128", "a.spec").unwrap_err();
    assert_eq!(e.to_string(), "a.spec:4:11: unknown type `u128`");
    let e = parse_line("p ext4-x:f").unwrap_err();
    assert_eq!(
        e.to_string(),
        "1:3: bad module target `ext4-x:f`: expected MODULE:SYMBOL[+OFFSET] (a module name of letters, digits \
         and `_`, and one of its functions or a pattern of them)"
    );
}

/// Every valid line the tests know, for round trips and mutation.
const VALID_LINES: &[&str] = &[
    "p:mygrp/myevent do_sys_open+16 dfd=%ax filename=%dx flags=%cx mode=+4($stack)",
    "r:myretprobe do_sys_open $retval",
    "r8:g/e f+0 $retval:symstr +0($retval):string",
    "p:e f%return $retval:u8",
    "p do_sys_open $arg1 $arg2:s32 +0($arg2):string",
    "p 0xffffffff81000000 %ip %sp %flags %orig_ax",
    "p:g-1/e f+0x20 a=@jiffies b=@init_task+0x10:symbol c=@0x1000:x32[4]",
    "p:e f +0(+8(+16(%di))):b3@5/16 -u8(%si):ustring $comm $stack $stack12",
    "p:e f \\0x10 \\-5:s64 +0(\\123):x8",
    "p:e f s=\\\"a\"b\" +0(%si):char[2] $arg* count file->f_pos.x->y:s32 $arg2->f_op",
    "r:e f $retval->f_pos",
    "-:g/e",
    "-:e",
];

#[test]
fn valid_lines_round_trip() {
    for line in VALID_LINES {
        round_trip(&ok(line));
    }
}

#[test]
fn longest_fetcharg_survives_the_round_trip() {
    // An octal offset as long as the limit allows: displayed as decimal, shorter.
    let body = format!("+0{}777(%ax):u8", "0".repeat(MAX_ARG_BODY_LEN - 13));
    assert_eq!(body.len(), MAX_ARG_BODY_LEN);
    round_trip(&ok(&format!("p f {body}")));
    round_trip(&ok("p f \\18446744073709551615"));
}

#[test]
fn a_parameter_named_longer_than_an_argument_name_may_be_round_trips() {
    // Linux names an unnamed BTF argument after its parameter, of any length, but refuses
    // an explicit name over MAX_ARG_NAME_LEN: such an argument is shown unnamed.
    let long = format!("p f {} b=%ax", "p".repeat(MAX_ARG_NAME_LEN + 1));
    let spec = ok(&long);
    round_trip(&spec);
    assert_eq!(
        spec.to_string(),
        format!("p:kprobes/p_f_0 f {} b=%ax", "p".repeat(MAX_ARG_NAME_LEN + 1))
    );
}

// ---- properties ----

/// What must hold for any input: no panic, errors inside the line, accepted lines round trip.
fn check_any_line(line: &str) -> Result<(), TestCaseError> {
    match parse_line(line) {
        Ok(Some(spec)) => {
            let text = spec.to_string();
            prop_assert_eq!(parse_line(&text), Ok(Some(spec)), "canonical text {:?}", text);
        }
        Ok(None) => {}
        Err(e) => {
            prop_assert_eq!(e.line, 1);
            prop_assert!(
                e.column >= 1 && e.column <= line.chars().count() + 1,
                "column {} in {:?}",
                e.column,
                line
            );
            prop_assert!(!e.to_string().is_empty());
        }
    }
    Ok(())
}

/// Characters that matter to the grammar, so random lines get past the first checks.
const ALPHABET: &[char] = &[
    'p', 'r', '-', ':', '/', '.', '%', '@', '$', '+', '(', ')', '[', ']', '=', '#', '\\', '"', ' ', '\t', 'a', 'x',
    'u', 's', 'b', 'f', '0', '1', '8', 'é', 'd', 'i', 'k', 'g', 'r', 'e', 't', 'v', 'l', 'c', 'o', 'm', '_',
];

#[derive(Clone, Debug)]
enum Mutation {
    Insert(usize, char),
    Delete(usize),
    Replace(usize, char),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let alphabet_char = proptest::sample::select(ALPHABET);
    prop_oneof![
        (any::<usize>(), alphabet_char.clone()).prop_map(|(i, c)| Mutation::Insert(i, c)),
        any::<usize>().prop_map(Mutation::Delete),
        (any::<usize>(), alphabet_char).prop_map(|(i, c)| Mutation::Replace(i, c)),
    ]
}

fn mutate(line: &str, mutations: &[Mutation]) -> String {
    let mut chars: Vec<char> = line.chars().collect();
    for m in mutations {
        match *m {
            Mutation::Insert(i, c) => chars.insert(i % (chars.len() + 1), c),
            Mutation::Delete(i) if !chars.is_empty() => {
                let at = i % chars.len();
                chars.remove(at);
            }
            Mutation::Replace(i, c) if !chars.is_empty() => {
                let at = i % chars.len();
                chars[at] = c;
            }
            _ => {}
        }
    }
    chars.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_strings_never_panic(line in "\\PC{0,100}") {
        check_any_line(&line)?;
    }

    #[test]
    fn grammar_soup_never_panics(chars in proptest::collection::vec(proptest::sample::select(ALPHABET), 0..80)) {
        let line: String = chars.into_iter().collect();
        check_any_line(&line)?;
    }

    #[test]
    fn mutated_valid_lines_never_panic(
        line in proptest::sample::select(VALID_LINES),
        mutations in proptest::collection::vec(mutation(), 1..5),
    ) {
        check_any_line(&mutate(line, &mutations))?;
    }

    #[test]
    fn files_of_mutated_lines_report_their_line(
        lines in proptest::collection::vec(
            (proptest::sample::select(VALID_LINES), proptest::collection::vec(mutation(), 0..3)), 0..6),
    ) {
        let text: Vec<String> = lines.iter().map(|(l, m)| mutate(l, m)).collect();
        let text = text.join("\n");
        if let Err(e) = parse_file(&text, "p.spec") {
            let line = text.lines().nth(e.line - 1).unwrap_or("");
            prop_assert_eq!(e.file.as_deref(), Some("p.spec"));
            prop_assert_eq!(parse_line(line).map_err(|l| (l.column, l.kind)), Err((e.column, e.kind)));
        }
    }
}

#[test]
fn every_syntax_error_of_a_file_is_reported_in_line_order() {
    let text = "p:a/x vfs_read\np:a/z\n# fine\nq vfs_read\np:b/y do_sys_open x=%nope\n";
    let (specs, errors) = parse_file_all_errors(text, "f.probes");
    let lines: Vec<usize> = errors.iter().map(|e| e.line).collect();
    assert_eq!(lines, [2, 4, 5]);
    assert!(errors.iter().all(|e| e.to_string().starts_with("f.probes:")));
    assert_eq!(specs.iter().map(|(line, _)| *line).collect::<Vec<_>>(), [1]);
}

#[test]
fn a_wildcard_target_gets_generated_event_names_and_round_trips() {
    let spec = ok("p:vfs/ vfs_*");
    match &spec {
        ProbeSpec::Kprobe {
            group, event, target, ..
        } => {
            assert_eq!((group.as_str(), event.as_str()), ("vfs", ""));
            assert!(target.is_wildcard());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ok(&spec.to_string()), spec);
    assert_eq!(ok("r vfs_re?d").to_string(), "r:kprobes/ vfs_re?d");
    assert_eq!(err("p:vfs/named vfs_*").1, SpecErrorKind::NamedWildcard);
    assert_eq!(err("p:vfs/ vfs_*+4").1, SpecErrorKind::NamedWildcard);
    for (pattern, name, matches) in [
        ("vfs_*", "vfs_read", true),
        ("vfs_*", "vfs_", true),
        ("vfs_*", "do_vfs_read", false),
        ("*_read", "vfs_read", true),
        ("v?s_*e", "vfs_write", true),
        ("v?s_*e", "vfs_read", false),
        ("*", "anything", true),
        ("a*b*c", "aXbYc", true),
        ("a*b*c", "aXbY", false),
    ] {
        assert_eq!(wildcard_matches(pattern, name), matches, "{pattern} vs {name}");
    }
}

#[test]
fn an_explicit_list_is_a_multi_probe_over_its_functions() {
    let spec = ok("p:io/ {vfs_read,vfs_write,do_sys_open}");
    match &spec {
        ProbeSpec::Kprobe { event, target, .. } => {
            assert_eq!(event, "");
            assert!(target.is_wildcard());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ok(&spec.to_string()), spec);
    assert_eq!(err("p:io/named {vfs_read,vfs_write}").1, SpecErrorKind::NamedWildcard);
    for bad in ["p {vfs_read,vfs_write", "p vfs_read}", "p {a,{b,c}}", "p a,b", "p {,}"] {
        assert!(
            matches!(err(bad).1, SpecErrorKind::BadTarget(_)),
            "{bad} should be a bad target: {:?}",
            err(bad)
        );
    }
    for (pattern, name, matches) in [
        ("{vfs_read,vfs_write}", "vfs_read", true),
        ("{vfs_read,vfs_write}", "vfs_write", true),
        ("{vfs_read,vfs_write}", "vfs_readv", false),
        ("vfs_{read,write}v", "vfs_writev", true),
        ("{ksys,vfs}_{read,write}", "ksys_write", true),
        ("{ksys,vfs}_{read,write}", "ksys_open", false),
        ("{do_*,vfs_read}", "do_sys_open", true),
        ("{unbalanced", "unbalanced", false),
    ] {
        assert_eq!(wildcard_matches(pattern, name), matches, "{pattern} vs {name}");
    }
    assert_eq!(
        brace_alternatives("{a,b}_{c,d}").unwrap(),
        ["a_c", "a_d", "b_c", "b_d"].map(String::from)
    );
}

#[test]
fn brace_lists_that_stand_for_too_many_names_are_refused_without_building_them() {
    // Ten lists of two: 1024 names, the most there may be.
    let most = "p:g/ f{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}";
    assert!(parse_line(most).is_ok(), "{:?}", parse_line(most));
    let e = parse_line(&format!("{most}{{a,b}}")).unwrap_err();
    assert!(matches!(e.kind, SpecErrorKind::TooManyAlternatives(_)), "{e:?}");
    assert_eq!(e.column, 6, "the column of the symbol: {e:?}");
    assert!(e.to_string().contains("more than 1024 names"), "{e}");
    assert_eq!(brace_alternatives("{a,b}".repeat(11).as_str()), None);
    assert!(!wildcard_matches(&"{a,b}".repeat(11), &"a".repeat(11)));
    // What the spec fuzzer found: lists of ~40 empty alternatives, over 10^20 names (the
    // parser ran out of memory building them).
    let fuzzed = format!("r s{}", "{,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,}".repeat(12));
    let e = parse_line(&fuzzed).unwrap_err();
    assert!(matches!(e.kind, SpecErrorKind::TooManyAlternatives(_)), "{e:?}");
}

/// The spec fuzzer's seeds (`fuzz/corpus/spec_parser`) hold the properties above, line by
/// line, without cargo-fuzz.
#[test]
fn the_fuzzers_seeds_hold_the_properties() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/spec_parser");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        for line in text.lines() {
            check_any_line(line).unwrap();
        }
        seen += 1;
    }
    assert!(seen >= 16, "{seen} seeds in {}", dir.display());
}

/// Linux 6.9+: a return probe on a function entry takes `$argN` (and `$arg*`, BTF names),
/// saved at the call's entry; `$duration` is hvprobe's own, decimal unless typed.
#[test]
fn return_probes_take_entry_arguments_and_a_duration() {
    let all = args("r:g/e f $arg1 first=+0($arg2) lat=$duration hex=$duration:x64");
    let texts: Vec<String> = all.iter().map(|a| a.to_string()).collect();
    assert_eq!(
        texts,
        ["$arg1", "first=+0($arg2)", "lat=$duration", "hex=$duration:x64"]
    );
    assert_eq!((all[2].ty, &all[2].expr), (ArgType::U64, &FetchExpr::Duration));
    assert_eq!(args("r:g/e f $arg*")[0].expr, FetchExpr::AllArgs);
    assert!(matches!(args("r:g/e f count")[0].expr, FetchExpr::Btf(_)));
    // Not on a return probe off a function's entry, which has no arguments.
    assert_eq!(err("r 0x1000 $arg1"), (10, SpecErrorKind::ArgNotOnEntry));
}

#[test]
fn watch_lines_take_perfs_length_and_access_with_its_defaults() {
    use crate::Access;
    let watch = |line: &str| match ok(line) {
        ProbeSpec::Watch {
            group,
            event,
            target,
            access,
            len,
            args,
        } => (group, event, target, access, len, args.len()),
        other => panic!("{line:?} parsed as {other:?}"),
    };
    let jiffies = Target::Symbol {
        name: "jiffies_64".into(),
        offset: 0,
    };
    assert_eq!(
        watch("w:vm/tick jiffies_64/8:w cpu=$comm"),
        ("vm".into(), "tick".into(), jiffies.clone(), Access::Write, 8, 1)
    );
    // perf's defaults: reads and writes of 4 bytes; an execution watch is one byte.
    assert_eq!(
        watch("w jiffies_64"),
        (
            "kprobes".into(),
            "w_jiffies_64_0".into(),
            jiffies,
            Access::ReadWrite,
            4,
            0
        )
    );
    let (_, _, target, access, len, _) = watch("w:x vfs_read+4:x");
    assert_eq!((access, len), (Access::Execute, 1));
    assert_eq!(
        target,
        Target::Symbol {
            name: "vfs_read".into(),
            offset: 4
        }
    );
    assert_eq!(watch("w 0xffffffff82000010/2:rw").3, Access::ReadWrite);
    // The canonical line names everything.
    assert_eq!(
        ok("w jiffies_64/8:w").to_string(),
        "w:kprobes/w_jiffies_64_0 jiffies_64/8:w"
    );
}

#[test]
fn bad_watch_lines_say_what_is_wrong_where() {
    for (line, column, kind) in [
        ("w:e jiffies/3:w", 13, SpecErrorKind::BadWatchLength("3".into())),
        ("w:e jiffies/8:r", 15, SpecErrorKind::ReadOnlyWatch),
        ("w:e jiffies/8:q", 15, SpecErrorKind::BadWatchAccess("q".into())),
        ("w:e vfs_read/8:x", 14, SpecErrorKind::ExecuteWatchLength),
        ("w vfs_*:x", 3, SpecErrorKind::WatchTargetNotSingle),
        ("w vfs_read%return:x", 3, SpecErrorKind::WatchTargetNotSingle),
        ("wx jiffies", 2, SpecErrorKind::JunkAfterProbeType("x".into())),
        ("w:e", 4, SpecErrorKind::MissingTarget),
    ] {
        let e = parse_line(line).expect_err(line);
        assert_eq!((e.column, &e.kind), (column, &kind), "{line:?}: {e}");
        assert_eq!(
            e.kind.linux_error(),
            None,
            "{line:?}: hvprobe's extension, no Linux error"
        );
    }
}

// ---- source targets (perf probe's) ----

fn source(function: Option<&str>, file: Option<&str>, line: Option<u32>) -> Target {
    Target::Source(SourcePoint {
        function: function.map(str::to_owned),
        file: file.map(str::to_owned),
        line,
        module: None,
    })
}

fn in_module(module: &str, target: Target) -> Target {
    let Target::Source(point) = target else {
        panic!("{target:?}")
    };
    Target::Source(SourcePoint {
        module: Some(module.to_owned()),
        ..point
    })
}

/// perf probe's `-m MOD` as a prefix: `MOD:` before a source form (with a `@` or a line);
/// `MOD:SYM` alone stays a module symbol, `FUNC:N` the kernel's.
#[test]
fn module_source_targets() {
    assert_eq!(target_of("p m:f:3"), in_module("m", source(Some("f"), None, Some(3))));
    assert_eq!(
        target_of("p hvprobe_test:hvprobe_test_work@hvprobe_test.c:2 n"),
        in_module(
            "hvprobe_test",
            source(Some("hvprobe_test_work"), Some("hvprobe_test.c"), Some(2))
        )
    );
    assert_eq!(
        target_of("p m:x/m.c:40"),
        in_module("m", source(None, Some("x/m.c"), Some(40)))
    );
    assert_eq!(
        target_of("r m:f@m.c"),
        in_module("m", source(Some("f"), Some("m.c"), None))
    );
    assert_eq!(
        target_of("p m:f"),
        Target::ModuleSymbol {
            module: "m".into(),
            name: "f".into(),
            offset: 0
        }
    );
    assert_eq!(target_of("p vfs_read:23"), source(Some("vfs_read"), None, Some(23)));
    assert_eq!(
        target_of("p vfs_read@fs/read_write.c:4"),
        source(Some("vfs_read"), Some("fs/read_write.c"), Some(4))
    );
    assert_eq!(ok("p:e m:f:3").to_string(), "p:kprobes/e m:f:3");
    assert!(matches!(err("p m:f:x").1, SpecErrorKind::BadModuleTarget(_)));
    assert!(matches!(err("r m:f:3").1, SpecErrorKind::RetprobeOnSourceLine));
}

fn target_of(line: &str) -> Target {
    match ok(line) {
        ProbeSpec::Kprobe { target, .. } | ProbeSpec::Kretprobe { target, .. } => target,
        other => panic!("{other:?}"),
    }
}

#[test]
fn source_targets_take_perf_probes_forms() {
    assert_eq!(target_of("p vfs_read:12"), source(Some("vfs_read"), None, Some(12)));
    assert_eq!(
        target_of("p vfs_read@fs/read_write.c"),
        source(Some("vfs_read"), Some("fs/read_write.c"), None)
    );
    assert_eq!(
        target_of("p vfs_read@read_write.c:3"),
        source(Some("vfs_read"), Some("read_write.c"), Some(3))
    );
    assert_eq!(
        target_of("p fs/read_write.c:470"),
        source(None, Some("fs/read_write.c"), Some(470))
    );
    assert_eq!(
        target_of("r vfs_read@fs/read_write.c"),
        source(Some("vfs_read"), Some("fs/read_write.c"), None)
    );
    assert_eq!(
        target_of("p vfs_read@fs/read_write.c%return"),
        source(Some("vfs_read"), Some("fs/read_write.c"), None)
    );
    // Still what they were: a module target, a uprobe, a symbol.
    assert_eq!(
        target_of("p ext4:ext4_file_write_iter+0x10"),
        Target::ModuleSymbol {
            module: "ext4".into(),
            name: "ext4_file_write_iter".into(),
            offset: 0x10
        }
    );
    assert!(matches!(
        err("p /bin/bash:0x4245c0").1,
        SpecErrorKind::UprobeNotSupported(_)
    ));
    assert_eq!(target_of("p vfs_read"), sym("vfs_read", 0));
}

#[test]
fn source_targets_are_named_as_perf_probe_names_them() {
    let event = |line: &str| match ok(line) {
        ProbeSpec::Kprobe { event, .. } | ProbeSpec::Kretprobe { event, .. } => event,
        other => panic!("{other:?}"),
    };
    assert_eq!(event("p vfs_read:12"), "vfs_read_L12");
    assert_eq!(event("p vfs_read@fs/read_write.c"), "vfs_read");
    assert_eq!(event("r vfs_read@fs/read_write.c"), "vfs_read__return");
    assert_eq!(event("p fs/read_write.c:470"), "read_write_L470");
    // A file's name makes an event name as perf probe makes one: what a name may not hold
    // becomes `_` (the spec fuzzer found `$` in one that did not parse back).
    assert_eq!(event("p fs/x$y-z.c:3"), "x_y_z_L3");
    assert_eq!(event("p 9p/9p.c:3"), "_9p_L3");
    round_trip(&ok("p fs/x$y-z.c:3"));
    // The canonical text parses back to the same spec.
    round_trip(&ok("p:g/e vfs_read@fs/read_write.c:3 count"));
}

#[test]
fn source_targets_read_variables_by_name_anywhere_and_refuse_what_cannot_be() {
    // A name, its fields (also `.` on a struct variable), `$params`, `$vars`, at a line.
    let a = args("p vfs_read:23 ret file->f_pos st.st_size $params $vars");
    assert!(matches!(&a[0].expr, FetchExpr::Btf(BtfRef { base: BtfBase::Param(n), .. }) if n == "ret"));
    assert!(matches!(&a[2].expr, FetchExpr::Btf(BtfRef { fields, .. }) if !fields[0].arrow));
    assert_eq!(a[3].expr, FetchExpr::Params);
    assert_eq!(a[4].expr, FetchExpr::Vars);
    // `$argN` needs a function's entry, as on symbol targets; a return probe a function.
    assert_eq!(arg_err_on("p vfs_read:23 $arg1").1, SpecErrorKind::ArgNotOnEntry);
    assert_eq!(err("r vfs_read:23").1, SpecErrorKind::RetprobeOnSourceLine);
    assert_eq!(err("p vfs_read:23%return").1, SpecErrorKind::RetprobeOnSourceLine);
    // `$params` and `$vars` need DWARF's scope: not on a symbol target.
    assert_eq!(
        err("p vfs_read $vars").1,
        SpecErrorKind::SourceVarsNotAtSource("vars".into())
    );
    // Each variable `$params` and `$vars` expand to keeps its own name and type, so a
    // name or a type on them is refused (perf probe drops it silently; the spec fuzzer's
    // `$vars:char` came back from its canonical text as `$vars`).
    assert_eq!(
        err("p vfs_read:23 $vars:char"),
        (21, SpecErrorKind::SourceVarsTakeNoNameOrType("vars".into()))
    );
    assert_eq!(
        err("p vfs_read:23 x=$params"),
        (15, SpecErrorKind::SourceVarsTakeNoNameOrType("params".into()))
    );
    assert_eq!(
        err("p vfs_read:23 $params:u32[2]"),
        (23, SpecErrorKind::SourceVarsTakeNoNameOrType("params".into()))
    );
    // Nor does a watch go on a line.
    assert_eq!(err("w vfs_read@read_write.c:x").1, SpecErrorKind::WatchTargetNotSingle);
    assert!(matches!(err("p vfs_read@").1, SpecErrorKind::BadTarget(_)));
    // One function, not a pattern (the spec fuzzer's `dnargr*@FILE` named its event `dnargr*`).
    assert!(matches!(err("p vfs_*@fs/read_write.c").1, SpecErrorKind::BadTarget(_)));
}

fn arg_err_on(line: &str) -> (usize, SpecErrorKind) {
    err(line)
}
