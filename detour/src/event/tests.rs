//! Event detour code generation: the shape of the code (decoded with iced), the common
//! path's length, the record layout and its decoding, and what is refused. Running the
//! code is the KVM tests' job (`live/tests/event_detour.rs`).

use hvprobe_introspection::facts::ExceptionTable;
use iced_x86::{Code, Formatter, IntelFormatter, OpKind};

use super::*;
use crate::ring::RingGeometry;
use crate::sites::PatchSites;
use crate::{plan_region, relocate, DetourFacts, FunctionText, IndirectThunks};
use hvprobe_spec::{parse_line, ProbeSpec};

const FUNC: u64 = 0xffff_ffff_8100_0000;
pub(super) const DETOUR: u64 = 0xffff_ffff_8260_1000;
const RINGS: u64 = 0xffff_ffff_8261_0000;
const COPY: u64 = 0xffff_ffff_8120_0000;
pub(super) const STRNCPY: u64 = 0xffff_ffff_8120_0100;
const DATA_SYM: u64 = 0xffff_ffff_8180_0000;

/// `push rbp; mov rbp, rsp; push r12; push rbx; mov rbx, rdi; ... ret`
const FUNCTION: &[u8] = &[
    0x55, // push rbp
    0x48, 0x89, 0xe5, // mov rbp, rsp
    0x41, 0x54, // push r12
    0x53, // push rbx
    0x48, 0x89, 0xfb, // mov rbx, rdi
    0x5b, 0x41, 0x5c, 0x5d, 0xc3, // pop rbx; pop r12; pop rbp; ret
];

pub(super) fn facts() -> GuestKernelFacts {
    GuestKernelFacts {
        cpu_number: 0x1_f9a8,
        current_task: Some(0x1_f9b0),
        comm_offset: Some(0x5f8),
        pid_offset: Some(0x4e0),
        copy_from_kernel_nofault: Some(Gva(COPY)),
        strncpy_from_kernel_nofault: Some(Gva(STRNCPY)),
        copy_from_user_nofault: None,
        strncpy_from_user_nofault: None,
        thread_size: DEFAULT_THREAD_SIZE,
        rethooks: None,
    }
}

fn symbols() -> SymbolTable {
    SymbolTable::parse_system_map(&format!(
        "{FUNC:016x} T func\n{:016x} T func_end\n{DATA_SYM:016x} D some_data\n",
        FUNC + FUNCTION.len() as u64
    ))
    .unwrap()
}

/// The fetch-args of `spec` as the engine gets them: resolved, on a kernel without BTF
/// (an unnamed `$argN` is then its register or stack slot).
fn args(spec: &str) -> Vec<FetchArg> {
    match parse_line(&format!("p:g/e func {spec}")).unwrap() {
        Some(ProbeSpec::Kprobe { args, .. }) => hvprobe_spec::check::resolve_btf_args("func", &args, None).unwrap(),
        other => panic!("{other:?}"),
    }
}

pub(super) fn rings(record_size: u32) -> EventRings {
    let g = RingGeometry::new(2, 64, record_size).unwrap();
    EventRings::new(g, Gva(RINGS), Gpa(0xd001_0000), g.total_size()).unwrap()
}

use hvprobe_arch::Gpa;

fn region() -> crate::DetourRegion {
    let ex = ExceptionTable::default();
    let sites = PatchSites::default();
    let thunks = IndirectThunks::default();
    let function = FunctionText {
        body: crate::Code {
            start: Gva(FUNC),
            bytes: FUNCTION,
        },
        ftrace_site: None,
        split_parts: &[],
    };
    let facts = DetourFacts {
        ex_table: &ex,
        patch_sites: &sites,
        thunks: &thunks,
    };
    plan_region(Gva(FUNC), &function, &facts, &[]).unwrap()
}

/// The detour of `spec` on `func`, with probe id 42 and slot 3 of rings of `record_size`
/// bytes per record.
pub(super) fn generate_params(
    spec: &str,
    record_size: u32,
    kernel: &GuestKernelFacts,
    record_task: bool,
    filter: Option<&RecordFilter>,
) -> Result<EventDetour, DetourCodeError> {
    generate_from(&args(spec), record_size, kernel, record_task, filter, None)
}

/// The detour of probe 42 (slot 3 of rings of `record_size` bytes per record) on `func`
/// for `args`; a return probe's with `returns`.
fn generate_from(
    args: &[FetchArg],
    record_size: u32,
    kernel: &GuestKernelFacts,
    record_task: bool,
    filter: Option<&RecordFilter>,
    returns: Option<ReturnDetourParams>,
) -> Result<EventDetour, DetourCodeError> {
    let region = region();
    let displaced = |ip: Gva| relocate(&region, ip, region.end());
    let (rings, symbols) = (rings(record_size), symbols());
    event_detour(&EventDetourParams {
        probe_id: 42,
        miss_slot: 3,
        probe_address: Gva(FUNC),
        detour_ip: Gva(DETOUR),
        args,
        rings: &rings,
        kernel,
        symbols: &symbols,
        string_size: 32,
        record_task,
        filter,
        displaced: &displaced,
        returns,
    })
}

fn generate_with(spec: &str, record_size: u32, kernel: &GuestKernelFacts) -> Result<EventDetour, DetourCodeError> {
    generate_params(spec, record_size, kernel, false, None)
}

fn generate(spec: &str) -> Result<EventDetour, DetourCodeError> {
    generate_with(spec, 256, &facts())
}

fn generate_stamped(spec: &str, kernel: &GuestKernelFacts) -> Result<EventDetour, DetourCodeError> {
    generate_params(spec, 256, kernel, true, None)
}

fn decode(code: &[u8]) -> Vec<Instruction> {
    Decoder::with_ip(64, code, DETOUR, DecoderOptions::NONE)
        .into_iter()
        .collect()
}

fn listing(code: &[u8]) -> String {
    let mut f = IntelFormatter::new();
    let mut out = String::new();
    for i in decode(code) {
        let mut s = String::new();
        f.format(&i, &mut s);
        out.push_str(&format!("{:016x}  {s}\n", i.ip()));
    }
    out
}

#[test]
fn the_common_path_with_four_register_and_stack_args_is_short() {
    for spec in [
        "%di %si %dx %r8",
        "%ax %bx %cx %dx",
        "$stack0 $stack1 $stack2 $stack3",
        "$arg1 $arg2 $stack1 $stack2",
        "a=%di:u32 b=$stack1:s64 c=%ax:x16 d=$arg8",
    ] {
        let d = generate(spec).unwrap();
        eprintln!(
            "{spec:40} {} instructions on the common path, {} bytes",
            d.hot_path.instructions,
            d.code.len()
        );
        assert_eq!(d.hot_path.calls, 0, "{spec}");
        assert!(
            d.hot_path.instructions <= 60,
            "{spec}: {:?}\n{}",
            d.hot_path,
            listing(&d.code)
        );
        assert!(!d.layout.faults_written, "nothing here can fault");
    }
    // The exact count of the common case, also measured under KVM.
    let d = generate("%di %si $stack1 $stack2").unwrap();
    assert_eq!(d.hot_path.instructions, 48, "\n{}", listing(&d.code));
}

#[test]
fn the_code_saves_flags_first_reads_the_cpu_through_gs_and_ends_with_the_displaced_instructions() {
    let d = generate("%di $stack1").unwrap();
    let insns = decode(&d.code);
    let text = listing(&d.code);
    assert_eq!(insns[0].code(), Code::Pushfq, "{text}");
    assert_eq!(insns[1].code(), Code::Cli, "{text}");
    let gs_read = insns
        .iter()
        .find(|i| i.segment_prefix() == iced_x86::Register::GS)
        .unwrap_or_else(|| panic!("no %gs read\n{text}"));
    assert_eq!(gs_read.memory_displacement64() as i64, 0x1_f9a8, "{text}");
    assert!(!gs_read.is_ip_rel_memory_operand(), "{text}");
    assert!(insns.iter().any(|i| i.mnemonic() == Mnemonic::Rdtsc), "{text}");
    // popfq, then the displaced push rbp / mov rbp,rsp / push r12 and the jump back.
    let popf = insns.iter().position(|i| i.code() == Code::Popfq).unwrap();
    let displaced: Vec<Mnemonic> = insns[popf + 1..popf + 5].iter().map(|i| i.mnemonic()).collect();
    assert_eq!(
        displaced,
        [Mnemonic::Push, Mnemonic::Mov, Mnemonic::Push, Mnemonic::Jmp],
        "{text}"
    );
    assert_eq!(
        insns[popf + 4].near_branch_target(),
        FUNC + 6,
        "back after the region\n{text}"
    );
    // Every push has its pop, in reverse, before popfq.
    let pushes: Vec<_> = insns[2..6].iter().map(|i| i.op0_register()).collect();
    let pops: Vec<_> = insns[popf - 4..popf].iter().rev().map(|i| i.op0_register()).collect();
    assert_eq!(pushes, pops, "{text}");
    // Cold paths only after the jump back; nothing jumps outside the detour but the jump
    // back.
    let end = DETOUR + d.code.len() as u64;
    for i in &insns {
        if i.op0_kind() == OpKind::NearBranch64 && i.ip() != insns[popf + 4].ip() {
            assert!((DETOUR..end).contains(&i.near_branch_target()), "{i}\n{text}");
        }
    }
}

#[test]
fn a_detour_with_calls_saves_the_caller_saved_registers_and_aligns_the_stack() {
    let d = generate("+8(%di):u32 +0(+16(%si)):string $comm @some_data+8:x8").unwrap();
    let insns = decode(&d.code);
    let text = listing(&d.code);
    let pushed: Vec<_> = insns[2..14].iter().map(|i| i.op0_register()).collect();
    use iced_x86::Register::*;
    assert_eq!(
        pushed,
        [RAX, RCX, RDX, RSI, RDI, R8, R9, R10, R11, RBX, R12, RBP],
        "{text}"
    );
    assert_eq!(insns[14].code(), Code::Mov_rm64_r64, "{text}");
    assert_eq!(insns[15].mnemonic(), Mnemonic::And, "and rsp, -16\n{text}");
    assert_eq!(insns[16].mnemonic(), Mnemonic::Cld, "{text}");
    let calls: Vec<u64> = insns
        .iter()
        .filter(|i| i.mnemonic() == Mnemonic::Call)
        .map(|i| i.near_branch_target())
        .collect();
    // +8(%di); the inner +16(%si) then the string; @some_data.
    assert_eq!(calls, [COPY, COPY, STRNCPY, COPY], "{text}");
    assert_eq!(d.hot_path.calls, 4);
    assert!(d.layout.faults_written);
    eprintln!("{} instructions besides the 4 calls\n{text}", d.hot_path.instructions);
    // The layout: four slots, then the string's area and comm's.
    let kinds: Vec<ArgKind> = d.layout.args.iter().map(|a| a.kind).collect();
    assert_eq!(
        kinds,
        [
            ArgKind::Value,
            ArgKind::String { area: 56, len: 32 },
            ArgKind::String { area: 88, len: 16 },
            ArgKind::Value
        ]
    );
    let bits: Vec<Option<u32>> = d.layout.args.iter().map(|a| a.fault_bit).collect();
    assert_eq!(bits, [Some(0), Some(1), Option::None, Some(3)]);
    assert_eq!(d.layout.size, 104);
}

#[test]
fn rings_and_calls_are_reached_from_wherever_the_detour_is() {
    // Rings at an address no sign-extended imm32 is: reached RIP-relative.
    let region = region();
    let displaced = |ip: Gva| relocate(&region, ip, region.end());
    let g = RingGeometry::new(1, 4, 64).unwrap();
    let far_rings = EventRings::new(g, Gva(0x7fff_0000_1000), Gpa(0xd000_0000), g.total_size()).unwrap();
    let (args, symbols, kernel) = (args("%di +0(%si)"), symbols(), facts());
    let params = EventDetourParams {
        probe_id: 1,
        miss_slot: 3,
        probe_address: Gva(FUNC),
        detour_ip: Gva(0x7fff_0000_0000),
        args: &args,
        rings: &far_rings,
        kernel: &kernel,
        symbols: &symbols,
        string_size: 32,
        record_task: false,
        filter: None,
        displaced: &displaced,
        returns: None,
    };
    // The jump back to the probe's function is out of reach from there.
    assert!(matches!(
        event_detour(&params),
        Err(DetourCodeError::Displaced(NotOptimizable::ReturnOutOfReach { .. }))
    ));
    // And so is copy_from_kernel_nofault.
    let nothing_back = |_: Gva| Ok(vec![0xc3]);
    let params = EventDetourParams {
        displaced: &nothing_back,
        ..params
    };
    assert!(matches!(
        event_detour(&params),
        Err(DetourCodeError::OutOfReach {
            what: "copy_from_kernel_nofault",
            ..
        })
    ));
    let args = self::args("%di");
    let params = EventDetourParams { args: &args, ..params };
    let d = event_detour(&params).unwrap();
    let insns: Vec<Instruction> = Decoder::with_ip(64, &d.code, 0x7fff_0000_0000, DecoderOptions::NONE)
        .into_iter()
        .collect();
    assert!(
        insns
            .iter()
            .any(|i| i.is_ip_rel_memory_operand() && i.ip_rel_memory_address() == 0x7fff_0000_1040),
        "the first ring through a RIP-relative lea"
    );
    let far_detour = EventDetourParams {
        detour_ip: Gva(0x7ffe_0000_0000),
        ..params
    };
    assert_eq!(
        event_detour(&far_detour),
        Err(DetourCodeError::RingsOutOfReach(Gva(0x7fff_0000_1000)))
    );
}

/// Every way a hit is not recorded (a CPU with no ring, a nested hit, a full ring) counts
/// the probe's own miss-table entry with one locked increment, after its ring's counter;
/// the common path has none of it (its length is the test above's).
#[test]
fn each_miss_path_counts_the_probes_entry_with_a_locked_increment() {
    for spec in ["%di %si $stack1 $stack2", "+8(%di):u32 $comm"] {
        let d = generate(spec).unwrap();
        let insns = decode(&d.code);
        let text = listing(&d.code);
        let entry = rings(256).probe_missed_gva(3).unwrap().0;
        let counts: Vec<(usize, &Instruction)> = insns
            .iter()
            .enumerate()
            .filter(|(_, i)| i.mnemonic() == Mnemonic::Inc && i.op0_kind() == OpKind::Memory)
            .collect();
        let probe_incs: Vec<usize> = counts
            .iter()
            .filter(|(_, i)| i.memory_displacement64() == entry && i.memory_base() == iced_x86::Register::None)
            .map(|(at, i)| {
                assert!(i.has_lock_prefix(), "{i}\n{text}");
                *at
            })
            .collect();
        assert_eq!(probe_incs.len(), 3, "{spec}\n{text}");
        // Each right after the counter of its path: bad_cpu (global), missed_nested,
        // missed_full.
        let before: Vec<u64> = probe_incs
            .iter()
            .map(|at| insns[at - 1].memory_displacement64())
            .collect();
        let bad_cpu = RINGS + crate::ring::GLOBAL_BAD_CPU;
        assert_eq!(before, [bad_cpu, MISSED_NESTED, MISSED_FULL], "{spec}\n{text}");
        // The rings' own counters stay plain increments.
        assert!(probe_incs.iter().all(|at| !insns[at - 1].has_lock_prefix()), "{text}");
        // All of them after the jump back: off the common path.
        let popf = insns.iter().position(|i| i.code() == Code::Popfq).unwrap();
        assert!(probe_incs.iter().all(|at| *at > popf), "{text}");
        // Where a vCPU has counted in the ring and not yet in the entry: the host's list
        // of them is these three increments.
        let between: Vec<Gva> = probe_incs.iter().map(|at| Gva(insns[*at].ip())).collect();
        assert_eq!(d.ring_counted_miss_ips, between, "{spec}\n{text}");
    }
    // An entry the table does not have is refused.
    let region = region();
    let displaced = |ip: Gva| relocate(&region, ip, region.end());
    let (args, rings, symbols, kernel) = (args("%di"), rings(256), symbols(), facts());
    let slots = rings.geometry().probe_slots();
    let params = EventDetourParams {
        probe_id: 1,
        miss_slot: slots,
        probe_address: Gva(FUNC),
        detour_ip: Gva(DETOUR),
        args: &args,
        rings: &rings,
        kernel: &kernel,
        symbols: &symbols,
        string_size: 32,
        record_task: false,
        filter: None,
        displaced: &displaced,
        returns: None,
    };
    assert_eq!(
        event_detour(&params),
        Err(DetourCodeError::BadMissSlot { slot: slots, slots })
    );
}

#[test]
fn what_cannot_be_compiled_is_refused_with_the_reason() {
    let no_copy = GuestKernelFacts {
        copy_from_kernel_nofault: None,
        ..facts()
    };
    assert_eq!(
        generate_with("x=+0(%di)", 256, &no_copy),
        Err(DetourCodeError::MissingFact {
            arg: "x".into(),
            fact: "copy_from_kernel_nofault"
        })
    );
    // Register-only probes do not need it.
    assert!(generate_with("%di", 256, &no_copy).is_ok());
    let no_task = GuestKernelFacts {
        current_task: None,
        ..facts()
    };
    assert!(matches!(
        generate_with("$comm", 256, &no_task),
        Err(DetourCodeError::MissingFact { .. })
    ));
    assert!(matches!(
        generate("u=+0(%di):ustring"),
        Err(DetourCodeError::MissingFact {
            fact: "strncpy_from_user_nofault",
            ..
        })
    ));
    assert!(matches!(
        generate("s=+0(%di):string[2]"),
        Err(DetourCodeError::Unsupported { .. })
    ));
    assert!(matches!(
        generate_with("+0(%di):string +0(%si):string +0(%dx):string", 96, &facts()),
        Err(DetourCodeError::RecordTooLarge { .. })
    ));
    let many = (0..65).map(|i| format!("a{i}=%di")).collect::<Vec<_>>().join(" ");
    assert!(matches!(
        generate_with(&many, 4096, &facts()),
        Err(DetourCodeError::TooManyArgs { count: 65 })
    ));
    let err = generate("x=+0(%di)").map(|_| ());
    assert!(err.is_ok());
    let msg = DetourCodeError::MissingFact {
        arg: "x".into(),
        fact: "copy_from_kernel_nofault",
    }
    .to_string();
    assert!(msg.contains("copy_from_kernel_nofault") && msg.contains('x'), "{msg}");
}

#[test]
fn records_decode_to_what_the_hosts_fetch_prints() {
    let d =
        generate("a=%di:u8 b=+0(%si):s32 c=+0(%dx):string d=$comm e=@nowhere f=+0(%cx):u16[3] g=%ip:symbol").unwrap();
    let l = &d.layout;
    let mut record = vec![0u8; l.size as usize];
    let put = |r: &mut Vec<u8>, at: u32, bytes: &[u8]| r[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    put(&mut record, l.args[0].slot, &0x1234u64.to_le_bytes());
    put(&mut record, l.args[1].slot, &0xdead_0000_ffff_fffeu64.to_le_bytes());
    let ArgKind::String { area, .. } = l.args[2].kind else {
        panic!()
    };
    put(&mut record, area, b"hello\0junk");
    let ArgKind::String { area, len } = l.args[3].kind else {
        panic!()
    };
    assert_eq!(len, COMM_SIZE);
    put(&mut record, area, b"sixteen-chars-xx"); // no NUL: bounded by the area
    let ArgKind::Array { area, elem, count } = l.args[5].kind else {
        panic!()
    };
    assert_eq!((elem, count), (2, 3));
    put(&mut record, area, &[1, 0, 2, 0, 3, 0]);
    put(&mut record, l.args[6].slot, &FUNC.to_le_bytes());
    let symbols = symbols();
    let values: Vec<String> = l
        .decode(&record, &symbols)
        .into_iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect();
    assert_eq!(
        values,
        [
            "a=52",
            "b=-2",
            "c=\"hello\"",
            "d=\"sixteen-chars-xx\"",
            "e=(fault)",
            "f={1,2,3}",
            "g=func+0x0/0xf"
        ]
    );
    // Fault bits: b and f.
    let faults = (1u64 << l.args[1].fault_bit.unwrap()) | (1u64 << l.args[5].fault_bit.unwrap());
    put(&mut record, RECORD_FAULTS as u32, &faults.to_le_bytes());
    let values: Vec<String> = l
        .decode(&record, &symbols)
        .into_iter()
        .map(|(_, v)| v.to_string())
        .collect();
    assert_eq!(values[1], "(fault)");
    assert_eq!(values[5], "{(fault),(fault),(fault)}");
    // A record cut short (hostile) decodes to faults, never a panic.
    let values: Vec<String> = l
        .decode(&record[..30], &symbols)
        .into_iter()
        .map(|(_, v)| v.to_string())
        .collect();
    assert!(values.iter().all(|v| v.contains("(fault)")), "{values:?}");
}

#[test]
fn facts_come_from_the_symbols() {
    let old = SymbolTable::parse_system_map(
        "000000000001f9a8 D cpu_number\n000000000001f9b0 D current_task\n\
         ffffffff81234000 T copy_from_kernel_nofault\nffffffff81234100 T strncpy_from_kernel_nofault\n",
    )
    .unwrap();
    let f = GuestKernelFacts::from_symbols(&old, None).unwrap();
    assert_eq!((f.cpu_number, f.current_task), (0x1_f9a8, Some(0x1_f9b0)));
    assert_eq!(f.copy_from_kernel_nofault, Some(Gva(0xffff_ffff_8123_4000)));
    assert_eq!(f.copy_from_user_nofault, None);
    let hot = SymbolTable::parse_system_map("0000000000020c40 D pcpu_hot\n").unwrap();
    let f = GuestKernelFacts::from_symbols(&hot, None).unwrap();
    assert_eq!((f.cpu_number, f.current_task), (0x2_0c4c, Some(0x2_0c40)));
    let none = SymbolTable::parse_system_map("ffffffff81000000 T _text\n").unwrap();
    assert_eq!(
        GuestKernelFacts::from_symbols(&none, None),
        Err(FactsError::NoCpuNumber)
    );
}

#[test]
fn the_task_stamp_costs_seven_instructions_and_decodes() {
    let plain = generate("%di %si $stack1 $stack2").unwrap();
    let stamped = generate_stamped("%di %si $stack1 $stack2", &facts()).unwrap();
    assert_eq!(stamped.hot_path.instructions, plain.hot_path.instructions + 7);
    assert!(stamped.hot_path.instructions <= 60);
    let layout = &stamped.layout;
    assert_eq!(layout.task, Some(RECORD_HEADER_SIZE));
    assert_eq!(layout.args[0].slot, RECORD_HEADER_SIZE + TASK_STAMP_SIZE);
    let mut record = vec![0u8; layout.size as usize];
    record[24..28].copy_from_slice(&1234i32.to_le_bytes());
    record[32..38].copy_from_slice(b"bash\0x");
    assert_eq!(
        layout.task(&record),
        Some(TaskStamp {
            pid: 1234,
            comm: b"bash".to_vec()
        })
    );
    assert_eq!(layout.task(&record[..40]), None, "cut short");
    assert_eq!(plain.layout.task(&record), None);
    let no_pid = GuestKernelFacts {
        pid_offset: None,
        ..facts()
    };
    assert!(matches!(
        generate_stamped("%di", &no_pid),
        Err(DetourCodeError::MissingFact { .. })
    ));
}

/// An exit-free return probe's detour for `spec` (a `r:` line's fetch-args), probe 42's
/// slots 8..18 of a 64-slot table, with or without the task stamp.
fn generate_return(spec: &str, record_task: bool) -> Result<EventDetour, DetourCodeError> {
    let args = match hvprobe_spec::parse_line(&format!("r:g/e func {spec}")).unwrap() {
        Some(hvprobe_spec::ProbeSpec::Kretprobe { args, .. }) => args,
        other => panic!("{other:?}"),
    };
    let returns = ReturnDetourParams {
        table: Gva(RINGS + 0x10_0000),
        table_slots: 64,
        first_slot: 8,
        maxactive: 10,
        code_area: (Gva(DETOUR & !0xf_ffff), 2 << 20),
        rethooks: None,
    };
    generate_from(&args, 256, &facts(), record_task, None, Some(returns))
}

/// The target: a call through an exit-free return probe with `$retval` and
/// `$duration` — entry and return together, the task stamp included — is at most 120
/// guest instructions; its stubs follow its code, one per slot, each `push <slot>` and a
/// jump to the return code.
#[test]
fn an_exit_free_return_with_retval_and_duration_costs_at_most_120_instructions() {
    let d = generate_return("ret=$retval lat=$duration", true).unwrap();
    eprintln!("entry and return together: {:?}", d.hot_path);
    assert!(d.hot_path.instructions <= 120, "{:?}", d.hot_path);
    assert_eq!(d.hot_path.calls, 0);
    let stubs = d.stubs.expect("stubs");
    let first = (stubs.0 - DETOUR) as usize;
    assert_eq!(
        d.code.len() - first,
        10 * RETURN_STUB_SIZE as usize,
        "one stub per slot"
    );
    for (i, stub) in d.code[first..].chunks(RETURN_STUB_SIZE as usize).enumerate() {
        assert_eq!(super::returns::stub_slot(stub, 64), Some(8 + i as u32));
        assert_eq!(stub[5], 0xe9, "jmp rel32 to the return code");
    }
    // The return code's record misses count in a ring first, as an entry's do: three
    // locked increments of the probe's entry, each right after its ring's (or the global)
    // counter. The entry's own miss (no free slot) counts in no ring, and is not one.
    let entry = rings(256).probe_missed_gva(3).unwrap().0;
    let insns: Vec<Instruction> = iced_x86::Decoder::with_ip(64, &d.code, DETOUR, iced_x86::DecoderOptions::NONE)
        .into_iter()
        .collect();
    let entry_incs: Vec<usize> = (0..insns.len())
        .filter(|&k| insns[k].mnemonic() == Mnemonic::Inc && insns[k].memory_displacement64() == entry)
        .collect();
    assert_eq!(entry_incs.len(), 4, "the entry's and the return code's three");
    let bad_cpu = RINGS + crate::ring::GLOBAL_BAD_CPU;
    let after_ring: Vec<Gva> = entry_incs
        .iter()
        .filter(|&&k| {
            let before = &insns[k - 1];
            before.mnemonic() == Mnemonic::Inc
                && [bad_cpu, MISSED_NESTED, MISSED_FULL].contains(&before.memory_displacement64())
        })
        .map(|&k| Gva(insns[k].ip()))
        .collect();
    assert_eq!(after_ring.len(), 3);
    assert_eq!(d.ring_counted_miss_ips, after_ring);
    let layout = d.layout;
    assert!(layout.ret.is_some());
    assert_eq!(layout.args[1].kind, ArgKind::Duration);
}

/// What an exit-free return probe cannot record is refused with the reason (the probe
/// keeps the trapped path): a stack word at the return, too many saved arguments, slots
/// the table does not have, no `current_task`.
#[test]
fn what_an_exit_free_return_cannot_do_is_refused_with_the_reason() {
    let err = generate_return("s=$stack1", false).unwrap_err();
    assert!(err.to_string().contains("a stack word at a return"), "{err}");
    let many: Vec<String> = (1..=12).map(|n| format!("a{n}=$arg{n}")).collect();
    assert!(matches!(
        generate_return(&many.join(" "), false),
        Err(DetourCodeError::TooManySaved { count: 12 })
    ));
}
