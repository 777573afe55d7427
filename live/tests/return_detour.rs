//! Exit-free return probes on code blobs under KVM: a loop calls a function whose first
//! instructions are replaced by `jmp rel32` into a return probe's detour in the out-of-line
//! area; the function returns through the probe's stub and return code, which record the
//! return with no VM exit. The blob has a fake per-CPU area behind %gs (`cpu_number`,
//! `current_task`) and a fake task.
//!
//! Checked: one record per call with the return value, the argument the entry saved (the
//! function clobbers its register) and the real caller; every register and the flags after
//! the return equal to a run without the probe; no VM exit; the guest instructions a call
//! costs (KVM's `insn_emulation`, exact on kvm_pvm) equal to the counted hot path;
//! recursion past `maxactive` (the deeper calls run unfollowed and are counted missed, every
//! call returns where it should); a tail call between two probed functions (both returns,
//! latest first, each naming the real caller); and a return whose slot is not the call's
//! traps instead of returning anywhere.

mod common;

use std::sync::Arc;

use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{GuestPhys, CODE_BLOB_OOL_VA};
use hvprobe_probes::detour::event::{
    event_detour, EventDetour, EventDetourParams, GuestKernelFacts, ReturnDetourParams, RETURN_SLOT_SIZE,
};
use hvprobe_probes::detour::relocate;
use hvprobe_probes::detour::ring::{EventBatch, EventRings, RingGeometry, RingReader};
use hvprobe_probes::spec::{parse_line, FetchArg, ProbeSpec};
use hvprobe_vmm::layout::{OOL_AREA_START, OOL_CODE_SIZE};
use hvprobe_vmm::{StopReason, Vm, VmOutcome, CODE_BLOB_START};
use iced_x86::code_asm::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const B: u64 = CODE_BLOB_START;
/// The probed function, and the one it tail-calls when [`TAIL`] is set.
const FUNC: u64 = B + 0x800;
const FUNC2: u64 = B + 0x900;
/// `blob_data`, read by the displaced RIP-relative load.
const DATA: u64 = B + 0x1300;
/// Per-CPU area (GS base): cpu_number at +0x10, current_task at +0x18.
const PERCPU: u64 = B + 0x2000;
const CPU_NUMBER: i32 = 0x10;
const CURRENT_TASK: i32 = 0x18;
const TASK: u64 = B + 0x2400;
/// Per-iteration register dumps after the call returned: 16 GPRs and the flags.
const DUMPS: u64 = B + 0x4000;
const DUMP_SIZE: u64 = 0x90;
/// Counters and switches: +0 wrong return values, +8 recursion depth (0: none), +0x10 tail
/// call (non-zero: func ends with `jmp func2`).
const COUNTERS: u64 = B + 0x2_0000;
const BAD_RETURNS: u64 = COUNTERS;
const RECURSE: u64 = COUNTERS + 8;
const TAIL: u64 = COUNTERS + 0x10;
const DETOUR_OFFSET: u64 = 0x1000;
const DETOUR2_OFFSET: u64 = 0x3000;
const RINGS_OFFSET: u64 = OOL_CODE_SIZE;
/// The calls-in-flight table, in the writable half after the rings.
const TABLE_OFFSET: u64 = OOL_CODE_SIZE + (1 << 20);
const TABLE_SLOTS: u32 = 64;
const ITERATIONS: u64 = 48;

/// Assembles at `ip`; also returns the address of the label `mark` sets, if any.
fn asm(ip: u64, f: impl FnOnce(&mut CodeAssembler, &mut CodeLabel) -> Result<(), IcedError>) -> (Vec<u8>, u64) {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut mark = a.create_label();
    f(&mut a, &mut mark).unwrap();
    let r = a
        .assemble_options(ip, iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)
        .unwrap();
    let at = r.label_ip(&mark).unwrap_or(0);
    (r.inner.code_buffer, at)
}

/// The region a jump displaces: `lea r11, [rdi+rsi]` and a RIP-relative load (11 bytes).
fn region_instructions(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.lea(r11, ptr(rdi + rsi))?;
    let load = iced_x86::Instruction::with2(
        iced_x86::Code::Mov_r64_rm64,
        iced_x86::Register::RAX,
        iced_x86::MemoryOperand::with_base_displ(iced_x86::Register::RIP, DATA as i64),
    )?;
    a.add_instruction(load)
}

struct Blob {
    code: Vec<u8>,
    /// Where the loop's `call func` returns to.
    loop_caller: u64,
    /// Where func's recursive `call func` returns to.
    inner_caller: u64,
}

/// The blob: a loop calling `func(i, S)` (checking it returns `3i + 1`, dumping the
/// registers after each call), `func` (recursing `RECURSE` deep, or tail-calling
/// `func2`), `func2`.
fn blob() -> Blob {
    let (entry, loop_caller) = asm(B, |a, after_call| {
        a.mov(eax, PERCPU as u32)?;
        a.xor(edx, edx)?;
        a.mov(ecx, 0xc000_0101u32)?;
        a.wrmsr()?;
        a.mov(r15, DUMPS)?;
        a.xor(r14d, r14d)?;
        a.sti()?;
        let mut top = a.create_label();
        let mut good = a.create_label();
        a.set_label(&mut top)?;
        a.mov(rdi, r14)?;
        a.mov(rsi, 0x5151u64)?;
        a.lea(rbx, ptr(r14 + 0x0bbb_0000i64))?;
        a.mov(rbp, 0x5555u64)?;
        a.mov(r12, 0x1212u64)?;
        a.lea(r13, ptr(r14 + 0x1313))?;
        a.mov(r8, 0x8888u64)?;
        a.mov(r9, 0x9999u64)?;
        a.mov(r10, 0x1010u64)?;
        a.mov(rdx, 0xd0d0u64)?;
        a.mov(rcx, 0xc0c0u64)?;
        a.cmp(r14, 5)?;
        a.call(FUNC)?;
        a.set_label(after_call)?;
        a.lea(rdx, ptr(r14 + r14 * 2 + 1))?;
        a.cmp(rax, rdx)?;
        a.je(good)?;
        a.inc(qword_ptr(BAD_RETURNS))?;
        a.set_label(&mut good)?;
        for (k, r) in [
            rax, rcx, rdx, rbx, rsp, rbp, rsi, rdi, r8, r9, r10, r11, r12, r13, r14, r15,
        ]
        .into_iter()
        .enumerate()
        {
            a.mov(qword_ptr(r15 + 8 * k as i32), r)?;
        }
        a.pushfq()?;
        a.pop(qword_ptr(r15 + 0x80))?;
        a.add(r15, DUMP_SIZE as i32)?;
        a.inc(r14)?;
        a.cmp(r14, ITERATIONS as i32)?;
        a.jb(top)?;
        a.mov(dx, 0xef1u32)?;
        a.xor(eax, eax)?;
        a.out(dx, al)?;
        a.hlt()
    });
    let (func, inner_caller) = asm(FUNC, |a, after_call| {
        region_instructions(a)?;
        let mut flat = a.create_label();
        let mut tail = a.create_label();
        // Recursion: func(n) calls func(n - 1) while n > 0 and n <= RECURSE.
        a.cmp(qword_ptr(RECURSE), 0)?;
        a.je(flat)?;
        a.test(rdi, rdi)?;
        a.je(flat)?;
        a.cmp(rdi, qword_ptr(RECURSE))?;
        a.ja(flat)?;
        a.push(rdi)?;
        a.dec(rdi)?;
        a.call(FUNC)?;
        a.set_label(after_call)?;
        a.pop(rdi)?;
        a.set_label(&mut flat)?;
        a.cmp(qword_ptr(TAIL), 0)?;
        a.jne(tail)?;
        a.lea(rax, ptr(rdi + rdi * 2 + 1))?;
        // The argument register is clobbered: `$arg1` at the return is the entry's.
        a.mov(rdi, 0xdead_dead_dead_deadu64)?;
        a.ret()?;
        a.set_label(&mut tail)?;
        a.jmp(FUNC2)
    });
    let (func2, _) = asm(FUNC2, |a, _| {
        region_instructions(a)?;
        a.lea(rax, ptr(rdi + rdi * 2 + 1))?;
        a.mov(rdi, 0xdead_dead_dead_deadu64)?;
        a.ret()
    });
    let mut code = vec![0xccu8; 0x3000];
    let mut put =
        |at: u64, bytes: &[u8]| code[(at - B) as usize..(at - B) as usize + bytes.len()].copy_from_slice(bytes);
    assert!(entry.len() < 0x800 && func.len() < 0x100 && func2.len() < 0x100);
    put(B, &entry);
    put(FUNC, &func);
    put(FUNC2, &func2);
    put(DATA, &0x0123_4567_89ab_cdefu64.to_le_bytes());
    put(PERCPU + CPU_NUMBER as u64, &0u32.to_le_bytes());
    put(PERCPU + CURRENT_TASK as u64, &TASK.to_le_bytes());
    Blob {
        code,
        loop_caller,
        inner_caller,
    }
}

fn symbols() -> SymbolTable {
    SymbolTable::parse_system_map(&format!(
        "{B:016x} T blob\n{FUNC:016x} T func\n{FUNC2:016x} T func2\n{DATA:016x} D blob_data\n{:016x} T blob_end\n",
        B + 0x3000
    ))
    .unwrap()
}

fn facts() -> GuestKernelFacts {
    GuestKernelFacts {
        cpu_number: CPU_NUMBER,
        current_task: Some(CURRENT_TASK),
        comm_offset: None,
        pid_offset: None,
        copy_from_kernel_nofault: None,
        strncpy_from_kernel_nofault: None,
        copy_from_user_nofault: None,
        strncpy_from_user_nofault: None,
        thread_size: 16 << 10,
        rethooks: None,
    }
}

fn return_args(spec: &str) -> Vec<FetchArg> {
    match parse_line(&format!("r:blob/func func {spec}")).unwrap() {
        Some(ProbeSpec::Kretprobe { args, .. }) => args,
        other => panic!("{other:?}"),
    }
}

fn vm(recurse: u64, tail: bool) -> Vm {
    let vm = common::blob_vm(blob().code, 1);
    vm.memory().write_obj(recurse, GuestAddress(RECURSE)).unwrap();
    vm.memory().write_obj(u64::from(tail), GuestAddress(TAIL)).unwrap();
    vm
}

fn new_rings(vm: &Vm) -> EventRings {
    let geometry = RingGeometry::new(1, 256, 256).unwrap().with_probe_slots(4).unwrap();
    let rings = EventRings::new(
        geometry,
        Gva(CODE_BLOB_OOL_VA + RINGS_OFFSET),
        Gpa(OOL_AREA_START.0 + RINGS_OFFSET),
        TABLE_OFFSET - RINGS_OFFSET,
    )
    .unwrap();
    rings.init(&GuestPhys(vm.memory().clone())).unwrap();
    rings
}

/// Generates the return detour of probe `probe_id` (miss slot `miss_slot`, table slots
/// `first_slot..+maxactive`) on `func` for `spec`, writes it at `detour_offset` and
/// patches the jump over the function's first instructions.
#[allow(clippy::too_many_arguments)]
fn arm_return(
    vm: &Vm,
    rings: &EventRings,
    func: u64,
    probe_id: u32,
    miss_slot: u32,
    first_slot: u32,
    maxactive: u32,
    detour_offset: u64,
    spec: &str,
) -> EventDetour {
    let region = common::blob_region(&blob().code, func);
    let (args, symbols, kernel) = (return_args(spec), symbols(), facts());
    let displaced = |ip: Gva| relocate(&region, ip, region.end());
    let detour_ip = Gva(CODE_BLOB_OOL_VA + detour_offset);
    let detour = event_detour(&EventDetourParams {
        probe_id,
        miss_slot,
        probe_address: Gva(func),
        detour_ip,
        args: &args,
        rings,
        kernel: &kernel,
        symbols: &symbols,
        string_size: 32,
        record_task: false,
        filter: None,
        displaced: &displaced,
        returns: Some(ReturnDetourParams {
            table: Gva(CODE_BLOB_OOL_VA + TABLE_OFFSET),
            table_slots: TABLE_SLOTS,
            first_slot,
            maxactive,
            code_area: (Gva(CODE_BLOB_OOL_VA), OOL_CODE_SIZE),
            rethooks: None,
        }),
    })
    .unwrap();
    assert!(detour.code.len() < 0x2000);
    vm.memory()
        .write_slice(&detour.code, GuestAddress(OOL_AREA_START.0 + detour_offset))
        .unwrap();
    let jump = hvprobe_probes::detour::jump_bytes(Gva(func), detour_ip).unwrap();
    vm.memory().write_slice(&jump, GuestAddress(func)).unwrap();
    detour
}

fn run(vm: Vm) -> (VmOutcome, GuestMemoryMmap) {
    let mem = vm.memory().clone();
    let outcome = vm.run(Arc::new(hvprobe_vmm::NoProbes)).unwrap();
    (outcome, mem)
}

/// [`run`], to the loop's end, every call having returned what it should.
fn run_to_its_end(vm: Vm) -> (VmOutcome, GuestMemoryMmap) {
    let (outcome, mem) = run(vm);
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{outcome:?}");
    assert_eq!(
        mem.read_obj::<u64>(GuestAddress(BAD_RETURNS)).unwrap(),
        0,
        "wrong return values"
    );
    (outcome, mem)
}

fn dumps(mem: &GuestMemoryMmap) -> Vec<[u64; 17]> {
    (0..ITERATIONS)
        .map(|i| {
            let mut d = [0u64; 17];
            for (k, v) in d.iter_mut().enumerate() {
                *v = mem
                    .read_obj(GuestAddress(DUMPS + i * DUMP_SIZE + 8 * k as u64))
                    .unwrap();
            }
            d
        })
        .collect()
}

/// A drained return: probe, values printed, caller, entry TSC, the record's TSC.
struct Return {
    probe: u32,
    values: Vec<String>,
    caller: u64,
    entry_tsc: u64,
    tsc: u64,
}

fn drain(rings: &EventRings, mem: &GuestMemoryMmap, layouts: &[&EventDetour]) -> Vec<Return> {
    let mut reader = RingReader::new(*rings);
    let mut batch = EventBatch::new();
    reader.drain(&GuestPhys(mem.clone()), &mut batch).unwrap();
    let symbols = symbols();
    batch
        .iter()
        .map(|e| {
            let layout = &layouts
                .iter()
                .find(|d| d.layout.probe_id == e.probe)
                .expect("a record of a probe armed")
                .layout;
            let (caller, entry_tsc) = layout.call(e.record).expect("a return's record has its call");
            Return {
                probe: e.probe,
                values: layout
                    .decode_with(e.record, &symbols, Some(7))
                    .iter()
                    .map(|(_, v)| v.to_string())
                    .collect(),
                caller: caller.0,
                entry_tsc,
                tsc: e.tsc,
            }
        })
        .collect()
}

fn table_owners(mem: &GuestMemoryMmap) -> Vec<u64> {
    (0..TABLE_SLOTS)
        .map(|s| {
            mem.read_obj(GuestAddress(
                OOL_AREA_START.0 + TABLE_OFFSET + u64::from(s) * u64::from(RETURN_SLOT_SIZE),
            ))
            .unwrap()
        })
        .collect()
}

const SPEC: &str = "ret=$retval:s64 a1=$arg1:u64 si=%si ip=%ip lat=$duration";

#[test]
fn every_return_is_recorded_in_guest_with_its_value_entry_argument_and_caller_and_no_exit() {
    let (plain, plain_mem) = run(vm(0, false));
    assert_eq!(plain.reason, StopReason::GuestExit(0), "{plain:?}");
    let reference = dumps(&plain_mem);
    let vm = vm(0, false);
    let rings = new_rings(&vm);
    let detour = arm_return(&vm, &rings, FUNC, 7, 0, 3, 4, DETOUR_OFFSET, SPEC);
    let (probed, mem) = run_to_its_end(vm);
    let after = dumps(&mem);
    for (i, (a, b)) in reference.iter().zip(&after).enumerate() {
        assert_eq!(a, b, "iteration {i}: registers or flags after the return differ");
    }
    let caller = blob().loop_caller;
    let returns = drain(&rings, &mem, &[&detour]);
    assert_eq!(returns.len() as u64, ITERATIONS, "one record per call");
    for (i, r) in returns.iter().enumerate() {
        assert_eq!(
            r.values,
            [
                format!("{}", 3 * i + 1),
                format!("{i}"),
                "0x5151".into(),
                format!("{caller:#x}"),
                "7".into()
            ],
            "call {i}"
        );
        assert_eq!((r.probe, r.caller), (7, caller));
        assert!(
            r.entry_tsc <= r.tsc && r.entry_tsc > 0,
            "call {i}: entry TSC {} and return's {}",
            r.entry_tsc,
            r.tsc
        );
    }
    assert!(
        table_owners(&mem).iter().all(|&o| o == 0),
        "every slot is free after the returns"
    );
    assert_eq!(rings.probe_missed(&GuestPhys(mem.clone()), 0).unwrap(), 0);
    assert_eq!(probed.exits, plain.exits, "the return probe caused VM exits");
    let hot = detour.hot_path.instructions as u64;
    let extra = probed.instructions_emulated.saturating_sub(plain.instructions_emulated);
    eprintln!(
        "exits {} vs {}; emulated {} vs {}: {} extra per call ({} counted: jmp + entry + stub + return code, - 2 \
         displaced); hot path {:?}",
        probed.exits,
        plain.exits,
        probed.instructions_emulated,
        plain.instructions_emulated,
        extra as f64 / ITERATIONS as f64,
        hot - 1,
        detour.hot_path
    );
    if plain.instructions_emulated > 0 {
        assert_eq!(extra, ITERATIONS * (hot - 1), "guest instructions per call");
    }
    assert!(hot <= 120, "a call costs {hot} detour instructions");
}

#[test]
fn recursion_past_maxactive_runs_unfollowed_counted_missed_and_returns_right() {
    // func(i) recurses i deep for i <= 5: up to 6 nested calls, 2 followed.
    let recurse = 5;
    let vm = vm(recurse, false);
    let rings = new_rings(&vm);
    let detour = arm_return(
        &vm,
        &rings,
        FUNC,
        7,
        1,
        10,
        2,
        DETOUR_OFFSET,
        "ret=$retval:s64 a1=$arg1:u64",
    );
    let (_, mem) = run_to_its_end(vm);
    let calls_per_iteration = |i: u64| if i <= recurse { i + 1 } else { 1 };
    let calls: u64 = (0..ITERATIONS).map(calls_per_iteration).sum();
    let followed: u64 = (0..ITERATIONS).map(|i| calls_per_iteration(i).min(2)).sum();
    let returns = drain(&rings, &mem, &[&detour]);
    assert_eq!(returns.len() as u64, followed);
    let missed = rings.probe_missed(&GuestPhys(mem.clone()), 1).unwrap();
    assert_eq!(missed, calls - followed, "calls past maxactive are counted missed");
    let b = blob();
    // The followed calls are the outer two: func(i) from the loop and func(i - 1) from it.
    for r in &returns {
        let n: u64 = r.values[1].parse().unwrap();
        assert_eq!(r.values[0], format!("{}", 3 * n + 1));
        assert!(
            r.caller == b.loop_caller || r.caller == b.inner_caller,
            "caller {:#x}",
            r.caller
        );
    }
    assert!(
        table_owners(&mem).iter().all(|&o| o == 0),
        "every slot is free after the returns"
    );
}

#[test]
fn a_tail_call_between_two_probed_functions_records_both_latest_first_with_the_real_caller() {
    let vm = vm(0, true);
    let rings = new_rings(&vm);
    let outer = arm_return(
        &vm,
        &rings,
        FUNC,
        7,
        0,
        0,
        4,
        DETOUR_OFFSET,
        "ret=$retval:s64 a1=$arg1:u64",
    );
    let inner = arm_return(
        &vm,
        &rings,
        FUNC2,
        8,
        1,
        4,
        4,
        DETOUR2_OFFSET,
        "ret=$retval:s64 a1=$arg1:u64",
    );
    let (_, mem) = run_to_its_end(vm);
    let returns = drain(&rings, &mem, &[&outer, &inner]);
    assert_eq!(returns.len() as u64, 2 * ITERATIONS);
    let caller = blob().loop_caller;
    for (i, pair) in returns.chunks(2).enumerate() {
        let expected = [format!("{}", 3 * i + 1), format!("{i}")];
        assert_eq!((pair[0].probe, pair[1].probe), (8, 7), "call {i}: func2's return first");
        for r in pair {
            assert_eq!(r.values[..2], expected, "call {i}");
            assert_eq!(r.caller, caller, "call {i}: the real caller, not a stub");
        }
    }
    assert!(table_owners(&mem).iter().all(|&o| o == 0));
}

#[test]
fn a_return_whose_slot_is_not_the_calls_traps_instead_of_returning_anywhere() {
    let vm = vm(0, false);
    let rings = new_rings(&vm);
    let detour = arm_return(&vm, &rings, FUNC, 7, 0, 3, 4, DETOUR_OFFSET, "ret=$retval");
    // A hostile or broken guest frees every slot while calls are in flight: from the
    // first call on, the slot the stub names is not owned by the returning task.
    let owner_gpa = |s: u32| GuestAddress(OOL_AREA_START.0 + TABLE_OFFSET + u64::from(s) * u64::from(RETURN_SLOT_SIZE));
    // Owned by another task from the start: the entry finds no free slot, and calls run
    // unfollowed (counted missed)...
    for s in 3..7 {
        vm.memory().write_obj(TASK + 0x100, owner_gpa(s)).unwrap();
    }
    let mem = vm.memory().clone();
    let (unfollowed, _) = run(vm);
    assert_eq!(unfollowed.reason, StopReason::GuestExit(0), "{unfollowed:?}");
    assert_eq!(rings.probe_missed(&GuestPhys(mem.clone()), 0).unwrap(), ITERATIONS);
    assert_eq!(drain(&rings, &mem, &[&detour]).len(), 0);
    // ...and a stub entered for a slot whose call is not on record traps to the host.
    let vm = self::vm(0, false);
    let rings = new_rings(&vm);
    let detour = arm_return(&vm, &rings, FUNC, 7, 0, 3, 4, DETOUR_OFFSET, "ret=$retval");
    let stubs = detour.stubs.expect("a return detour has stubs");
    // The loop's first call returns into the stub of slot 4 (no call on record there).
    let (entry, _) = asm(B, |a, _| {
        a.mov(rax, stubs.0 + 16)?;
        a.push(rax)?;
        a.ret()
    });
    vm.memory().write_slice(&entry, GuestAddress(B)).unwrap();
    let (trapped, _) = run(vm);
    assert_ne!(trapped.reason, StopReason::GuestExit(0), "{trapped:?}");
    eprintln!("a return with no call on record: {:?}", trapped.reason);
}
