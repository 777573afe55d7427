//! Event detours on code blobs under KVM: a loop calls a small function whose first
//! instructions are replaced by `jmp rel32` into an event detour in the out-of-line area
//! (mapped at [`CODE_BLOB_OOL_VA`], within rel32 reach of the blob). The blob has a fake
//! per-CPU area behind %gs (`cpu_number`, `current_task`), a fake task with a `comm`, and
//! stand-ins for `copy_from_kernel_nofault` / `strncpy_from_kernel_nofault` that fail
//! with -EFAULT on one marked page, check the stack alignment of every call and clobber
//! every caller-saved register.
//!
//! Checked: every hit recorded in order with the values the host's fetch would give, the
//! register file and flags after the displaced instructions equal to a run without the
//! detour, no VM exit from the probe, the guest instructions a hit costs (KVM's
//! `insn_emulation`, exact on kvm_pvm where all CPL0 code is emulated), the rings drained
//! while the guest runs, and two vCPUs each in their own ring.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_analysis::fields::EventFields;
use hvprobe_analysis::filter::FilterExpr;
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{GuestPhys, CODE_BLOB_OOL_VA};
use hvprobe_probes::detour::event::filter::{FilterInGuest, RecordFilter};
use hvprobe_probes::detour::event::{event_detour, EventDetour, EventDetourParams, GuestKernelFacts, TaskStamp};
use hvprobe_probes::detour::relocate;
use hvprobe_probes::detour::ring::{EventBatch, EventRings, RingGeometry, RingReader};
use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::HitRecord;
use hvprobe_probes::spec::{parse_line, FetchArg, ProbeSpec};
use hvprobe_vmm::layout::{OOL_AREA_SIZE, OOL_AREA_START, OOL_CODE_SIZE};
use hvprobe_vmm::{StopReason, Vm, VmOutcome, CODE_BLOB_START};
use iced_x86::code_asm::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const B: u64 = CODE_BLOB_START;
/// The probed function.
const FUNC: u64 = B + 0x800;
const COPY: u64 = B + 0x900;
const STRNCPY: u64 = B + 0xa00;
/// A second probed function, called twice per iteration when [`CALL2`] is set.
const FUNC2: u64 = B + 0xb00;
/// struct S { u64 a; u64 b; char *name; }
const S: u64 = B + 0x1000;
const S_A: u64 = 0x1122_3344_5566_7788;
const S_B: u64 = 0x0bad_f00d_0000_0001;
const S2: u64 = B + 0x1100;
const S2_B: u64 = 0xcafe_babe_1234_5678;
const NAME: u64 = B + 0x1200;
const NAME_TEXT: &[u8] = b"hello-from-the-blob";
/// `blob_data`, read by the displaced RIP-relative load and by `@blob_data`.
const DATA: u64 = B + 0x1300;
const DATA_VALUE: u64 = 0x0123_4567_89ab_cdef;
/// Per-CPU areas (GS base), 0x100 apart: cpu_number at +0x10, current_task at +0x18.
const PERCPU: u64 = B + 0x2000;
const CPU_NUMBER: i32 = 0x10;
const CURRENT_TASK: i32 = 0x18;
/// Fake tasks, 0x100 apart; comm at +0x40, pid at +0x20 (100 + the CPU).
const TASKS: u64 = B + 0x2400;
const COMM: u32 = 0x40;
const PID: u32 = 0x20;
/// Per-iteration register dumps: 0x90 bytes each (16 GPRs, rsp slot reused, flags).
const DUMPS: u64 = B + 0x4000;
const DUMP_SIZE: u64 = 0x90;
const DUMPS_PER_CPU: u64 = 0x8000;
/// Counters: +0 misaligned calls into the stubs, +8 vCPU 1 done.
const COUNTERS: u64 = B + 0x2_0000;
/// Non-zero: the copy stub calls the probed function (a nested hit).
const NEST: u64 = COUNTERS + 0x18;
/// Non-zero: each iteration calls `func2` twice after `func`.
const CALL2: u64 = COUNTERS + 0x20;
/// The page the stubs refuse (-EFAULT).
const BAD: u64 = B + 0xf_f000;
const EFAULT: i64 = -14;
/// Where the detour and the rings go in the out-of-line area.
const DETOUR_OFFSET: u64 = 0x1000;
/// The rings live in the area's second half, the one the guest may write (the code half's
/// memory slot is read-only to it).
const RINGS_OFFSET: u64 = OOL_CODE_SIZE;
const ITERATIONS: u64 = 64;

fn asm(ip: u64, f: impl FnOnce(&mut CodeAssembler) -> Result<(), IcedError>) -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    f(&mut a).unwrap();
    a.assemble(ip).unwrap()
}

/// The blob: entry loop, the probed function, the two stubs and their data.
fn blob(cpus: u8, iterations: u64) -> Vec<u8> {
    let entry = asm(B, |a| {
        // GS base = this CPU's per-CPU area.
        a.mov(eax, edi)?;
        a.shl(eax, 8)?;
        a.add(eax, PERCPU as i32)?;
        a.xor(edx, edx)?;
        a.mov(ecx, 0xc000_0101u32)?;
        a.wrmsr()?;
        // r15 = this CPU's dumps, r14 = the iteration.
        a.mov(r15, rdi)?;
        a.imul_3(r15, r15, DUMPS_PER_CPU as i32)?;
        a.add(r15, DUMPS as i32)?;
        a.xor(r14d, r14d)?;
        a.sti()?;
        let mut top = a.create_label();
        let mut not_std = a.create_label();
        a.set_label(&mut top)?;
        // The argument registers, from i.
        a.mov(rdi, r14)?;
        a.mov(rsi, S)?;
        a.lea(rdx, ptr(r14 + r14 * 2))?;
        a.mov(rcx, S2)?;
        a.mov(rax, BAD)?;
        a.test(r14b, 1)?;
        a.cmovne(rcx, rax)?;
        a.lea(r8, ptr(r14 + 0x0888_0000i64))?;
        a.mov(r9, 0x9999u64)?;
        a.lea(rax, ptr(r14 + 0x0aaa_0000i64))?;
        a.lea(rbx, ptr(r14 + 0x0bbb_0000i64))?;
        a.mov(rbp, 0x5555u64)?;
        a.mov(r10, 0x1010u64)?;
        a.mov(r11, 0x1111u64)?;
        a.mov(r12, 0x1212u64)?;
        a.lea(r13, ptr(r14 + 0x1313))?;
        // $stack2 = i * 7, $stack1 = 0x5151 (after the return address).
        a.imul_3(rdx, r14, 7)?;
        a.push(rdx)?;
        a.push(0x5151)?;
        a.lea(rdx, ptr(r14 + r14 * 2))?;
        // Flags from i: CF for i < 5, ZF at 5; DF set on every fourth iteration.
        a.push(rax)?;
        a.mov(rax, r14)?;
        a.and(eax, 3)?;
        a.cmp(eax, 1)?;
        a.pop(rax)?;
        a.jne(not_std)?;
        a.std()?;
        a.set_label(&mut not_std)?;
        a.cmp(r14, 5)?;
        a.call(FUNC)?;
        a.cld()?;
        a.add(rsp, 16)?;
        let mut no_func2 = a.create_label();
        a.cmp(qword_ptr(CALL2), 0)?;
        a.je(no_func2)?;
        a.call(FUNC2)?;
        a.call(FUNC2)?;
        a.set_label(&mut no_func2)?;
        a.add(r15, DUMP_SIZE as i32)?;
        a.inc(r14)?;
        a.cmp(r14, iterations as i32)?;
        a.jb(top)?;
        // Done: vCPU 0 waits for the others and exits; the others park.
        let mut park = a.create_label();
        let mut wait = a.create_label();
        a.mov(edi, dword_ptr(CPU_NUMBER as u64).gs())?;
        a.test(edi, edi)?;
        a.jnz(park)?;
        a.set_label(&mut wait)?;
        a.pause()?;
        a.cmp(qword_ptr(COUNTERS + 8), i32::from(cpus) - 1)?;
        a.jb(wait)?;
        a.mov(dx, 0xef1u32)?;
        a.xor(eax, eax)?;
        a.out(dx, al)?;
        a.hlt()?;
        a.set_label(&mut park)?;
        a.lock().inc(qword_ptr(COUNTERS + 8))?;
        a.cli()?;
        let mut forever = a.create_label();
        a.set_label(&mut forever)?;
        a.hlt()?;
        a.jmp(forever)?;
        Ok(())
    });
    let func = asm(FUNC, |a| {
        // The region a jump displaces: lea (4 bytes) and a RIP-relative load (7 bytes).
        a.lea(r11, ptr(rdi + rsi))?;
        let load = iced_x86::Instruction::with2(
            iced_x86::Code::Mov_r64_rm64,
            iced_x86::Register::RAX,
            iced_x86::MemoryOperand::with_base_displ(iced_x86::Register::RIP, DATA as i64),
        )?;
        a.add_instruction(load)?;
        // Dump every register and the flags as they are after the displaced instructions.
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
        a.ret()?;
        Ok(())
    });
    // The same region as func's, and nothing else.
    let func2 = asm(FUNC2, |a| {
        a.lea(r11, ptr(rdi + rsi))?;
        let load = iced_x86::Instruction::with2(
            iced_x86::Code::Mov_r64_rm64,
            iced_x86::Register::RAX,
            iced_x86::MemoryOperand::with_base_displ(iced_x86::Register::RIP, DATA as i64),
        )?;
        a.add_instruction(load)?;
        a.ret()
    });
    // Shared prologue of the stubs: count a call whose stack is not 16-byte aligned at
    // the call (rsp % 16 != 8 at entry), and refuse the bad page.
    let check = |a: &mut CodeAssembler, fault: CodeLabel| -> Result<(), IcedError> {
        let mut aligned = a.create_label();
        a.test(spl, 0xf)?;
        a.jnz(aligned)?; // 8: aligned; 0: not (the push of the return address made it 8)
        a.inc(qword_ptr(COUNTERS))?;
        a.set_label(&mut aligned)?;
        a.mov(rax, rsi)?;
        a.shr(rax, 12)?;
        a.cmp(rax, (BAD >> 12) as i32)?;
        a.je(fault)?;
        Ok(())
    };
    let clobber = |a: &mut CodeAssembler| -> Result<(), IcedError> {
        for r in [rcx, rdx, rsi, rdi, r8, r9, r10, r11] {
            a.mov(r, 0xdead_dead_dead_deadu64)?;
        }
        // Arithmetic flags changed too.
        a.cmp(rcx, 0)
    };
    let copy = asm(COPY, |a| {
        let mut fault = a.create_label();
        let mut no_nest = a.create_label();
        // When asked to, hit the probe again from inside the nofault routine, as a probe
        // on something the guest's page-fault handler runs would.
        a.cmp(qword_ptr(NEST), 0)?;
        a.je(no_nest)?;
        a.push(rdi)?;
        a.push(rsi)?;
        a.push(rdx)?;
        a.sub(rsp, 8)?;
        a.call(FUNC)?;
        a.add(rsp, 8)?;
        a.pop(rdx)?;
        a.pop(rsi)?;
        a.pop(rdi)?;
        a.set_label(&mut no_nest)?;
        check(a, fault)?;
        a.mov(rcx, rdx)?;
        a.rep().movsb()?;
        clobber(a)?;
        a.xor(eax, eax)?;
        a.ret()?;
        a.set_label(&mut fault)?;
        clobber(a)?;
        a.mov(rax, EFAULT as u64)?;
        a.ret()?;
        Ok(())
    });
    let strncpy = asm(STRNCPY, |a| {
        let mut fault = a.create_label();
        let mut next = a.create_label();
        let mut cut = a.create_label();
        let mut done = a.create_label();
        check(a, fault)?;
        a.xor(eax, eax)?;
        a.set_label(&mut next)?;
        a.cmp(rax, rdx)?;
        a.jae(cut)?;
        a.mov(cl, byte_ptr(rsi + rax))?;
        a.mov(byte_ptr(rdi + rax), cl)?;
        a.inc(rax)?;
        a.test(cl, cl)?;
        a.jnz(next)?;
        a.jmp(done)?;
        a.set_label(&mut cut)?;
        a.mov(byte_ptr(rdi + rdx - 1), 0)?;
        a.mov(rax, rdx)?;
        a.set_label(&mut done)?;
        clobber(a)?;
        a.ret()?;
        a.set_label(&mut fault)?;
        clobber(a)?;
        a.mov(rax, EFAULT as u64)?;
        a.ret()?;
        Ok(())
    });
    let mut code = vec![0xccu8; 0x3000];
    let mut put =
        |at: u64, bytes: &[u8]| code[(at - B) as usize..(at - B) as usize + bytes.len()].copy_from_slice(bytes);
    assert!(entry.len() < 0x800 && func.len() < 0x100 && copy.len() < 0x100 && strncpy.len() < 0x100);
    put(B, &entry);
    put(FUNC, &func);
    put(FUNC2, &func2);
    put(COPY, &copy);
    put(STRNCPY, &strncpy);
    put(S, &S_A.to_le_bytes());
    put(S + 8, &S_B.to_le_bytes());
    put(S + 16, &NAME.to_le_bytes());
    put(S2 + 8, &S2_B.to_le_bytes());
    let mut name = NAME_TEXT.to_vec();
    name.push(0);
    put(NAME, &name);
    put(DATA, &DATA_VALUE.to_le_bytes());
    for cpu in 0..u64::from(cpus) {
        let area = PERCPU + cpu * 0x100;
        let task = TASKS + cpu * 0x100;
        put(area + CPU_NUMBER as u64, &(cpu as u32).to_le_bytes());
        put(area + CURRENT_TASK as u64, &task.to_le_bytes());
        let mut comm = [0u8; 16];
        let text = format!("blob-cpu{cpu}");
        comm[..text.len()].copy_from_slice(text.as_bytes());
        put(task + u64::from(COMM), &comm);
        put(task + u64::from(PID), &(100 + cpu as u32).to_le_bytes());
    }
    code
}

fn symbols() -> SymbolTable {
    SymbolTable::parse_system_map(&format!(
        "{B:016x} T blob\n{FUNC:016x} T func\n{COPY:016x} T copy_from_kernel_nofault\n\
         {STRNCPY:016x} T strncpy_from_kernel_nofault\n{FUNC2:016x} T func2\n{DATA:016x} D blob_data\n\
         {:016x} T blob_end\n",
        B + 0x3000
    ))
    .unwrap()
}

fn facts() -> GuestKernelFacts {
    GuestKernelFacts {
        cpu_number: CPU_NUMBER,
        current_task: Some(CURRENT_TASK),
        comm_offset: Some(COMM),
        pid_offset: Some(PID),
        copy_from_kernel_nofault: Some(Gva(COPY)),
        strncpy_from_kernel_nofault: Some(Gva(STRNCPY)),
        copy_from_user_nofault: None,
        strncpy_from_user_nofault: None,
        thread_size: 16 << 10,
        rethooks: None,
    }
}

fn args(spec: &str) -> Vec<FetchArg> {
    match parse_line(&format!("p:blob/func func {spec}")).unwrap() {
        Some(ProbeSpec::Kprobe { args, .. }) => args,
        other => panic!("{other:?}"),
    }
}

/// A code-blob VM with the out-of-line area mapped at [`CODE_BLOB_OOL_VA`].
fn vm(cpus: u8, iterations: u64) -> Vm {
    common::blob_vm(blob(cpus, iterations), cpus)
}

struct Armed {
    detour: EventDetour,
    rings: EventRings,
}

/// Generates the detour for `spec`, writes it and the rings into the out-of-line area and
/// patches `jmp rel32` over the function's first instructions.
fn arm(vm: &Vm, spec: &str, cpus: u32, capacity: u32, record_task: bool) -> Armed {
    let rings = new_rings(vm, cpus, capacity);
    let detour = arm_probe(vm, &rings, FUNC, 7, 0, DETOUR_OFFSET, spec, record_task, None);
    Armed { detour, rings }
}

/// Rings for `cpus` CPUs in the out-of-line area, initialised.
fn new_rings(vm: &Vm, cpus: u32, capacity: u32) -> EventRings {
    let geometry = RingGeometry::new(cpus, capacity, 512).unwrap();
    let rings = EventRings::new(
        geometry,
        Gva(CODE_BLOB_OOL_VA + RINGS_OFFSET),
        Gpa(OOL_AREA_START.0 + RINGS_OFFSET),
        OOL_AREA_SIZE - RINGS_OFFSET,
    )
    .unwrap();
    rings.init(&GuestPhys(vm.memory().clone())).unwrap();
    rings
}

/// Generates the event detour of probe `probe_id` (slot `miss_slot` of the miss and
/// filter tables) on the function at `func` for `spec` (and `filter`), writes it at `detour_offset` of the out-of-line area and
/// patches `jmp rel32` over the function's first instructions (lea + RIP-relative mov).
#[allow(clippy::too_many_arguments)]
fn arm_probe(
    vm: &Vm,
    rings: &EventRings,
    func: u64,
    probe_id: u32,
    miss_slot: u32,
    detour_offset: u64,
    spec: &str,
    record_task: bool,
    filter: Option<&RecordFilter>,
) -> EventDetour {
    let mem = vm.memory();
    let region = common::blob_region(&blob(rings.geometry().cpus() as u8, 1), func);
    let (args, symbols, kernel) = (args(spec), symbols(), facts());
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
        record_task,
        filter,
        displaced: &displaced,
        returns: None,
    })
    .unwrap();
    assert!(detour.code.len() < 0x1000 && detour_offset + 0x1000 <= RINGS_OFFSET);
    mem.write_slice(&detour.code, GuestAddress(OOL_AREA_START.0 + detour_offset))
        .unwrap();
    let jump = hvprobe_probes::detour::jump_bytes(Gva(func), detour_ip).unwrap();
    mem.write_slice(&jump, GuestAddress(func)).unwrap();
    detour
}

/// Every iteration's register dump of vCPU `cpu`.
fn dumps(mem: &GuestMemoryMmap, cpu: u64, iterations: u64) -> Vec<[u64; 17]> {
    (0..iterations)
        .map(|i| {
            let mut d = [0u64; 17];
            for (k, v) in d.iter_mut().enumerate() {
                *v = mem
                    .read_obj(GuestAddress(DUMPS + cpu * DUMPS_PER_CPU + i * DUMP_SIZE + 8 * k as u64))
                    .unwrap();
            }
            d
        })
        .collect()
}

fn run(vm: Vm) -> (VmOutcome, GuestMemoryMmap) {
    let mem = vm.memory().clone();
    let outcome = vm.run(Arc::new(hvprobe_vmm::NoProbes)).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{outcome:?}");
    let misaligned: u64 = mem.read_obj(GuestAddress(COUNTERS)).unwrap();
    assert_eq!(misaligned, 0, "calls into the nofault routines with a misaligned stack");
    (outcome, mem)
}

/// KVM's own exit counter (in-kernel exits included) also counts the host's timer ticks
/// and preemptions while the vCPU runs, so it grows with run time: on kvm_pvm about one
/// per 2 ms in both runs, and a probed run is longer (its instructions are emulated). A
/// probe that exited would add at least one per hit.
fn assert_kvm_exits_not_per_hit(plain: &VmOutcome, probed: &VmOutcome, hits: u64) {
    let extra = probed.kvm_exits.saturating_sub(plain.kvm_exits);
    assert!(
        extra < hits / 2,
        "{extra} more KVM exits for {hits} hits (plain {plain:?}, probed {probed:?})"
    );
}

/// A drained record: ring, the CPU it names, tsc, the values, the task stamp.
type Decoded = (u32, u32, u64, Vec<(String, ArgValue)>, Option<TaskStamp>);

fn drain_all(armed: &Armed, mem: &GuestMemoryMmap) -> Vec<Decoded> {
    let mut reader = RingReader::new(armed.rings);
    let mut batch = EventBatch::new();
    reader.drain(&GuestPhys(mem.clone()), &mut batch).unwrap();
    let symbols = symbols();
    batch
        .iter()
        .map(|e| {
            assert_eq!(e.probe, 7);
            let layout = &armed.detour.layout;
            (
                e.ring,
                e.cpu,
                e.tsc,
                layout.decode(e.record, &symbols),
                layout.task(e.record),
            )
        })
        .collect()
}

const FULL_SPEC: &str = "i=%di:u64 s=%si st1=$stack1 st2=$stack2:u32 a=+0(%si):u32 nm=+0(+16(%si)):string \
                         bad=+8(%cx):x64 comm=$comm ax=%ax bx=%bx r11=%r11 fl=%flags ip=%ip sp=$stack \
                         arr=+0(%si):x16[4] imm=\\0x1234 sym=@blob_data far=$stack700 r13=%r13 \
                         dx=%dx:s32 nested=+8(+16(%si)):x64 cs=%cs:u16 oa=%orig_ax";

/// What the host's fetch gives for FULL_SPEC at iteration `i` of vCPU `cpu`, with `dump`
/// the registers there (after the displaced instructions: r11 and rax changed) and `sp`
/// the probe's rsp.
fn expected(i: u64, cpu: u64, dump: &[u64; 17], code_selector: u16) -> Vec<String> {
    let stack_pointer = dump[4];
    let flags = dump[16];
    vec![
        format!("{i}"),
        format!("{S:#x}"),
        format!("{:#x}", 0x5151),
        format!("{}", i * 7),
        format!("{}", S_A as u32),
        format!("\"{}\"", std::str::from_utf8(NAME_TEXT).unwrap()),
        if i % 2 == 1 {
            "(fault)".into()
        } else {
            format!("{S2_B:#x}")
        },
        format!("\"blob-cpu{cpu}\""),
        format!("{:#x}", 0x0aaa_0000 + i),
        format!("{:#x}", 0x0bbb_0000 + i),
        format!("{:#x}", 0x1111),
        format!("{flags:#x}"),
        format!("{FUNC:#x}"),
        format!("{stack_pointer:#x}"),
        "{0x7788,0x5566,0x3344,0x1122}".into(),
        "0x1234".into(),
        format!("{DATA_VALUE:#x}"),
        // Outside the 16 KiB stack block: 0, as regs_get_kernel_stack_nth gives.
        "0x0".into(),
        format!("{:#x}", 0x1313 + i),
        format!("{}", (i * 3) as i32),
        // +8 of the name string: its bytes 8..16.
        format!("{:#x}", u64::from_le_bytes(NAME_TEXT[8..16].try_into().unwrap())),
        code_selector.to_string(),
        "0xffffffffffffffff".into(),
    ]
}

#[test]
fn every_hit_is_recorded_in_guest_with_the_hosts_values_and_no_exit() {
    // Without the detour: the reference registers and exit / instruction counts.
    let (plain, plain_mem) = run(vm(1, ITERATIONS));
    let reference = dumps(&plain_mem, 0, ITERATIONS);
    // With it.
    let vm = vm(1, ITERATIONS);
    let code_selector = vm.vcpu_state(0).unwrap().sregs.cs.selector;
    let armed = arm(&vm, FULL_SPEC, 1, 128, true);
    let (probed, mem) = run(vm);
    let after = dumps(&mem, 0, ITERATIONS);
    for (i, (a, b)) in reference.iter().zip(&after).enumerate() {
        assert_eq!(a, b, "iteration {i}: registers or flags after the detour differ");
    }
    assert!(
        reference.iter().any(|d| d[16] & 0x400 != 0),
        "DF was set at some probe hits"
    );
    assert!(reference.iter().all(|d| d[16] & 0x200 != 0), "IF was set at every hit");

    let events = drain_all(&armed, &mem);
    assert_eq!(events.len() as u64, ITERATIONS);
    let mut last_tsc = 0;
    for (i, (ring, cpu, tsc, values, task)) in events.iter().enumerate() {
        assert_eq!((*ring, *cpu), (0, 0));
        assert_eq!(
            task.as_ref(),
            Some(&TaskStamp {
                pid: 100,
                comm: b"blob-cpu0".to_vec()
            })
        );
        assert!(*tsc >= last_tsc, "timestamps in order");
        last_tsc = *tsc;
        let mut dump = reference[i];
        // The probe's rsp: the dump's rsp is the same (lea/mov do not move it).
        dump[4] = reference[i][4];
        let got: Vec<String> = values.iter().map(|(_, v)| v.to_string()).collect();
        assert_eq!(got, expected(i as u64, 0, &dump, code_selector), "iteration {i}");
    }
    let missed = armed.rings.missed(&GuestPhys(mem.clone())).unwrap();
    assert_eq!(missed.total(), 0, "{missed:?}");

    eprintln!(
        "without the detour: {} exits ({} counted by KVM), {} instructions emulated; with it: {} exits \
         ({} counted by KVM), {} emulated; {} hits; common path (static) {:?}",
        plain.exits,
        plain.kvm_exits,
        plain.instructions_emulated,
        probed.exits,
        probed.kvm_exits,
        probed.instructions_emulated,
        ITERATIONS,
        armed.detour.hot_path
    );
    assert_eq!(probed.exits, plain.exits, "the probe caused VM exits");
    // KVM's own count is reported, not checked, here: with eight calls into the stubs a
    // hit costs ~450 emulated instructions (~1 ms on kvm_pvm), as long as the host's
    // ticks are apart. The four-argument test checks it.
}

/// The common case of the target: four register/stack arguments, no call. On kvm_pvm the
/// emulator runs (and counts) every CPL0 instruction, so the extra instructions per hit
/// are exact: the jump in, plus the detour's common path, minus the two displaced
/// instructions that no longer run in place.
#[test]
fn four_register_and_stack_args_cost_the_counted_instructions_and_no_exit() {
    let spec = "%di %si $stack1 $stack2";
    let (plain, _) = run(vm(1, ITERATIONS));
    for record_task in [false, true] {
        let vm = vm(1, ITERATIONS);
        let armed = arm(&vm, spec, 1, 128, record_task);
        let (probed, mem) = run(vm);
        let events = drain_all(&armed, &mem);
        assert_eq!(events.len() as u64, ITERATIONS);
        for (i, (_, _, _, values, task)) in events.iter().enumerate() {
            let got: Vec<String> = values.iter().map(|(_, v)| v.to_string()).collect();
            assert_eq!(
                got,
                [
                    format!("{i:#x}"),
                    format!("{S:#x}"),
                    "0x5151".into(),
                    format!("{:#x}", i * 7)
                ]
            );
            assert_eq!(task.is_some(), record_task);
        }
        assert_eq!(probed.exits, plain.exits, "the probe caused VM exits");
        assert_kvm_exits_not_per_hit(&plain, &probed, ITERATIONS);
        let hot = armed.detour.hot_path.instructions as u64;
        let extra = probed.instructions_emulated.saturating_sub(plain.instructions_emulated);
        eprintln!(
            "task stamp {record_task}: exits {} vs {} (KVM: {} vs {}); emulated {} vs {}: {} extra per hit \
             ({} expected: jmp + {} - 2 displaced)",
            probed.exits,
            plain.exits,
            probed.kvm_exits,
            plain.kvm_exits,
            probed.instructions_emulated,
            plain.instructions_emulated,
            extra as f64 / ITERATIONS as f64,
            hot - 1,
            hot
        );
        if plain.instructions_emulated > 0 {
            assert_eq!(extra, ITERATIONS * (hot - 1), "guest instructions per hit");
        }
    }
}

/// A small ring drained by the host while the guest runs: nothing is read twice or out of
/// order, and whatever did not fit is counted missed.
#[test]
fn the_host_drains_while_the_guest_runs() {
    let iterations = 400;
    let vm = vm(1, iterations);
    let armed = arm(&vm, "%di", 1, 8, false);
    let mem = vm.memory().clone();
    let runner = std::thread::spawn(move || vm.run(Arc::new(hvprobe_vmm::NoProbes)));
    let phys = GuestPhys(mem.clone());
    let mut reader = RingReader::new(armed.rings);
    let mut batch = EventBatch::new();
    let mut got = Vec::new();
    let (mut drains, start) = (0u64, Instant::now());
    loop {
        let finished = runner.is_finished();
        reader.drain(&phys, &mut batch).unwrap();
        drains += 1;
        got.extend(
            batch
                .iter()
                .map(|e| u64::from_le_bytes(e.record[24..32].try_into().unwrap())),
        );
        if finished {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the blob did not finish");
        std::thread::sleep(Duration::from_micros(200));
    }
    let outcome = runner.join().unwrap().unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0));
    let missed = armed.rings.missed(&phys).unwrap().total();
    eprintln!(
        "{} records in {drains} drains while the guest ran, {missed} missed, {:?}",
        got.len(),
        start.elapsed()
    );
    assert!(got.windows(2).all(|w| w[0] < w[1]), "in order, each once: {got:?}");
    assert_eq!(got.len() as u64 + missed, iterations, "recorded + missed = hits");
    assert!(!got.is_empty());
}

#[test]
fn two_vcpus_record_into_their_own_rings() {
    let iterations = 32;
    let (_, plain_mem) = run(vm(2, iterations));
    let vm = vm(2, iterations);
    let code_selector = vm.vcpu_state(0).unwrap().sregs.cs.selector;
    let armed = arm(&vm, FULL_SPEC, 2, 64, true);
    let (_, mem) = run(vm);
    let events = drain_all(&armed, &mem);
    assert_eq!(events.len() as u64, 2 * iterations);
    for cpu in 0..2u64 {
        let reference = dumps(&plain_mem, cpu, iterations);
        assert_eq!(
            dumps(&mem, cpu, iterations),
            reference,
            "vCPU {cpu}: registers after the detour"
        );
        let mine: Vec<_> = events.iter().filter(|e| u64::from(e.0) == cpu).collect();
        assert_eq!(mine.len() as u64, iterations, "vCPU {cpu}");
        for (i, (ring, cpu_field, _, values, task)) in mine.iter().enumerate() {
            assert_eq!(u64::from(*cpu_field), cpu, "attributed to its CPU");
            let stamp = task.as_ref().unwrap();
            assert_eq!(
                (stamp.pid as u64, stamp.comm.clone()),
                (100 + cpu, format!("blob-cpu{cpu}").into_bytes())
            );
            assert_eq!(u64::from(*ring), cpu);
            let got: Vec<String> = values.iter().map(|(_, v)| v.to_string()).collect();
            assert_eq!(
                got,
                expected(i as u64, cpu, &reference[i], code_selector),
                "vCPU {cpu} iteration {i}"
            );
        }
    }
}

/// A hit while this CPU is writing a record (here from inside the fault-safe copy, as an
/// NMI or a probe on the page-fault path would make) is counted `missed_nested`; the
/// record being written is not disturbed.
#[test]
fn a_nested_hit_is_counted_and_the_outer_record_is_intact() {
    let vm = vm(1, ITERATIONS);
    let armed = arm(&vm, "i=%di:u64 a=+0(%si):u32", 1, 128, false);
    vm.memory().write_obj(1u64, GuestAddress(NEST)).unwrap();
    let (outcome, mem) = run(vm);
    let events = drain_all(&armed, &mem);
    let got: Vec<Vec<String>> = events
        .iter()
        .map(|e| e.3.iter().map(|(_, v)| v.to_string()).collect())
        .collect();
    let want: Vec<Vec<String>> = (0..ITERATIONS)
        .map(|i| vec![i.to_string(), (S_A as u32).to_string()])
        .collect();
    assert_eq!(got, want);
    let missed = armed.rings.missed(&GuestPhys(mem.clone())).unwrap();
    assert_eq!(missed.per_cpu[0].nested, ITERATIONS, "{missed:?}");
    assert_eq!(missed.per_cpu[0].full, 0);
    assert_eq!(
        armed.rings.probe_missed(&GuestPhys(mem.clone()), 0).unwrap(),
        ITERATIONS,
        "each nested hit in its probe's entry"
    );
    assert_eq!(outcome.reason, StopReason::GuestExit(0));
}

/// A ring the host does not drain fills up: the first `capacity` hits are there, every
/// later one is counted `missed_full` and in the probe's entry of the miss table, and the
/// guest runs on exactly as without the probe. Reports what a miss costs the guest.
#[test]
fn a_full_ring_counts_missed_in_the_guest() {
    let (plain, plain_mem) = run(vm(1, ITERATIONS));
    let vm = vm(1, ITERATIONS);
    let armed = arm(&vm, "%di", 1, 8, false);
    let (probed, mem) = run(vm);
    assert_eq!(dumps(&mem, 0, ITERATIONS), dumps(&plain_mem, 0, ITERATIONS));
    let events = drain_all(&armed, &mem);
    let got: Vec<String> = events.iter().map(|e| e.3[0].1.to_string()).collect();
    assert_eq!(got, (0..8).map(|i| format!("{i:#x}")).collect::<Vec<_>>());
    let missed = armed.rings.missed(&GuestPhys(mem.clone())).unwrap();
    assert_eq!(missed.per_cpu[0].full, ITERATIONS - 8);
    assert_eq!(missed.total(), ITERATIONS - 8);
    assert_eq!(
        armed.rings.probe_missed(&GuestPhys(mem.clone()), 0).unwrap(),
        ITERATIONS - 8
    );
    // Extra instructions: 8 recorded hits (the jump in, the common path, minus the two
    // displaced instructions), then the misses.
    let hot = armed.detour.hot_path.instructions as u64;
    let extra = probed.instructions_emulated.saturating_sub(plain.instructions_emulated);
    if plain.instructions_emulated > 0 {
        let per_miss = (extra - 8 * (hot - 1)) as f64 / (ITERATIONS - 8) as f64;
        eprintln!(
            "emulated {} vs {}: a recorded hit {} extra, a miss (full ring) {per_miss} extra",
            probed.instructions_emulated,
            plain.instructions_emulated,
            hot - 1
        );
        assert_eq!(
            (extra - 8 * (hot - 1)) % (ITERATIONS - 8),
            0,
            "every miss costs the same"
        );
    }
}

/// Two probes on one CPU, one ring that is never drained: the ring takes the first hits of
/// both in order, and every later hit is counted in its own probe's entry of the miss
/// table — for each probe, its hits = its records + its entry — and the ring's
/// `missed_full` is their sum.
#[test]
fn a_full_ring_counts_each_probes_misses_in_its_own_entry() {
    let (capacity, (a_id, a_slot), (b_id, b_slot)) = (8u32, (7u32, 2u32), (8u32, 5u32));
    let vm = vm(1, ITERATIONS);
    vm.memory().write_obj(1u64, GuestAddress(CALL2)).unwrap();
    let rings = new_rings(&vm, 1, capacity);
    let a = arm_probe(&vm, &rings, FUNC, a_id, a_slot, DETOUR_OFFSET, "%di", false, None);
    let b = arm_probe(
        &vm,
        &rings,
        FUNC2,
        b_id,
        b_slot,
        DETOUR_OFFSET + 0x1000,
        "%di",
        false,
        None,
    );
    let (_, mem) = run(vm);
    let phys = GuestPhys(mem.clone());
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    reader.drain(&phys, &mut batch).unwrap();
    let symbols = symbols();
    let got: Vec<(u32, String)> = batch
        .iter()
        .map(|e| {
            let layout = if e.probe == a_id { &a.layout } else { &b.layout };
            (e.probe, layout.decode(e.record, &symbols)[0].1.to_string())
        })
        .collect();
    // Per iteration i: func (a) with %di = i, then func2 (b) twice, %di still i.
    let want: Vec<(u32, String)> = (0..u64::from(capacity))
        .map(|k| {
            let i = k / 3;
            (if k % 3 == 0 { a_id } else { b_id }, format!("{i:#x}"))
        })
        .collect();
    assert_eq!(got, want, "the first hits of both, in order");
    let recorded = |id: u32| got.iter().filter(|(p, _)| *p == id).count() as u64;
    let (a_hits, b_hits) = (ITERATIONS, 2 * ITERATIONS);
    let a_missed = rings.probe_missed(&phys, a_slot).unwrap();
    let b_missed = rings.probe_missed(&phys, b_slot).unwrap();
    eprintln!(
        "a: {a_hits} hits, {} recorded, {a_missed} missed; b: {b_hits} hits, {} recorded, {b_missed} missed",
        recorded(a_id),
        recorded(b_id)
    );
    assert_eq!(recorded(a_id) + a_missed, a_hits, "a: hits = recorded + nmissed");
    assert_eq!(recorded(b_id) + b_missed, b_hits, "b: hits = recorded + nmissed");
    assert_eq!((recorded(a_id), recorded(b_id)), (3, 5));
    let others: u64 = (0..rings.geometry().probe_slots())
        .filter(|s| ![a_slot, b_slot].contains(s))
        .map(|s| rings.probe_missed(&phys, s).unwrap())
        .sum();
    assert_eq!(others, 0, "no other entry counted");
    let missed = rings.missed(&phys).unwrap();
    assert_eq!(missed.per_cpu[0].full, a_missed + b_missed, "the ring's total");
    assert_eq!(missed.total(), a_missed + b_missed);
}

/// A CPU whose number has no ring (the rings were made for fewer CPUs) counts `bad_cpu`
/// and writes nowhere.
#[test]
fn a_cpu_without_a_ring_counts_bad_cpu() {
    let iterations = 16;
    let vm = vm(2, iterations);
    let armed = arm(&vm, "%di", 1, 64, false);
    let (_, mem) = run(vm);
    let events = drain_all(&armed, &mem);
    assert_eq!(events.len() as u64, iterations, "vCPU 0's hits");
    assert!(events.iter().all(|e| e.0 == 0 && e.1 == 0));
    let missed = armed.rings.missed(&GuestPhys(mem.clone())).unwrap();
    assert_eq!(missed.bad_cpu, iterations, "vCPU 1's hits");
    assert_eq!(
        armed.rings.probe_missed(&GuestPhys(mem.clone()), 0).unwrap(),
        iterations,
        "and the probe's"
    );
}

/// The drain through real guest memory (vm-memory's mmap, as the engine reads it; no KVM
/// needed): 4 rings × 2048 records of a four-argument probe with the task stamp, refilled
/// between drains; every record drained and decoded into its four values and its task.
/// (Throughput is measured by `hvprobe bench drain`, not here.)
#[test]
fn full_rings_in_guest_memory_drain_and_decode_whole() {
    let (cpus, capacity) = (4u32, 2048u32);
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(OOL_AREA_START.0), OOL_AREA_SIZE as usize)]).unwrap();
    let phys = GuestPhys(mem.clone());
    let geometry = RingGeometry::new(cpus, capacity, 128).unwrap();
    let rings = EventRings::new(
        geometry,
        Gva(CODE_BLOB_OOL_VA + RINGS_OFFSET),
        Gpa(OOL_AREA_START.0 + RINGS_OFFSET),
        OOL_AREA_SIZE - RINGS_OFFSET,
    )
    .unwrap();
    rings.init(&phys).unwrap();
    let (args, symbols, kernel) = (args("%di %si $stack1 $stack2"), symbols(), facts());
    let detour = event_detour(&EventDetourParams {
        probe_id: 7,
        miss_slot: 0,
        probe_address: Gva(FUNC),
        detour_ip: Gva(CODE_BLOB_OOL_VA + DETOUR_OFFSET),
        args: &args,
        rings: &rings,
        kernel: &kernel,
        symbols: &symbols,
        string_size: 32,
        record_task: true,
        filter: None,
        displaced: &|_| Ok(vec![0xc3]),
        returns: None,
    })
    .unwrap();
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    let rounds = 3;
    let mut drained = 0u64;
    let mut record = vec![0u8; 128];
    record[..4].copy_from_slice(&7u32.to_le_bytes());
    record[32..36].copy_from_slice(b"bash");
    for round in 0..rounds {
        for cpu in 0..cpus {
            for i in 0..u64::from(capacity) {
                let index = round * u64::from(capacity) + i;
                record[8..16].copy_from_slice(&index.to_le_bytes());
                let at = OOL_AREA_START.0 + RINGS_OFFSET + geometry.record_offset(cpu, index);
                mem.write_slice(&record, GuestAddress(at)).unwrap();
            }
            let head = OOL_AREA_START.0 + RINGS_OFFSET + geometry.ring_offset(cpu);
            mem.store(
                (round + 1) * u64::from(capacity),
                GuestAddress(head),
                std::sync::atomic::Ordering::Release,
            )
            .unwrap();
        }
        let summary = reader.drain(&phys, &mut batch).unwrap();
        assert_eq!(summary.records, (cpus * capacity) as usize);
        drained += summary.records as u64;
        let mut values = 0;
        for e in batch.iter() {
            values += detour.layout.decode(e.record, &symbols).len();
            assert!(detour.layout.task(e.record).is_some());
        }
        assert_eq!(values, 4 * summary.records);
    }
    assert_eq!(drained, rounds * u64::from(cpus * capacity));
}

/// The host's view of a drained record: what its filter is given.
fn hit_of(decoded: &Decoded) -> HitRecord {
    let (_, cpu, _, values, task) = decoded;
    let task = task.as_ref().expect("records carry the task stamp");
    HitRecord {
        comm: String::from_utf8_lossy(&task.comm).into_owned(),
        pid: task.pid,
        cpu: *cpu as usize,
        timestamp_ns: 0,
        group: "blob".into(),
        event: "func".into(),
        location: "func+0x0/0x100".into(),
        retprobe_caller: None,
        args: values.clone(),
        entry_timestamp_ns: None,
        stack: None,
    }
}

/// The iteration a record of FULL_SPEC is from (its `i`).
fn iteration(decoded: &Decoded) -> u64 {
    match &decoded.3[0] {
        (name, ArgValue::Unsigned(i)) if name == "i" => *i,
        other => panic!("the first arg is i: {other:?}"),
    }
}

/// Filters of FULL_SPEC's fields, and how much of each the detour runs: numbers of every
/// width and signedness, 64-bit constants, `&`, a fetch-arg that faults on odd iterations
/// (every test on it false, also under `!`), strings whole and by prefix, `$comm`, the task
/// stamp's pid, the CPU, and globs the guest leaves to the host.
const GUEST_FILTERS: &[(&str, Option<FilterInGuest>)] = &[
    ("i < 1000", Some(FilterInGuest::Exact)),
    ("nm == \"hello-from-the-blob\"", Some(FilterInGuest::Exact)),
    ("i > 10 && i <= 40", Some(FilterInGuest::Exact)),
    ("dx < 30 || i == 63", Some(FilterInGuest::Exact)),
    (
        "dx >= -1 && i < 0x8000000000000000 && i >= 60",
        Some(FilterInGuest::Exact),
    ),
    ("bad == 0xcafebabe12345678", Some(FilterInGuest::Exact)),
    ("!(bad == 0xcafebabe12345678) && i < 20", Some(FilterInGuest::Exact)),
    ("i & 4", Some(FilterInGuest::Exact)),
    ("i == 5 || (i > 50 && !(i & 1))", Some(FilterInGuest::Exact)),
    (
        "st1 == 0x5151 && st2 >= 100 && a == 0x55667788",
        Some(FilterInGuest::Exact),
    ),
    ("comm == \"blob-cpu0\" && i < 3", Some(FilterInGuest::Exact)),
    ("comm != \"blob-cpu0\"", Some(FilterInGuest::Exact)),
    ("nm ~ \"hello*\" && i >= 30", Some(FilterInGuest::Exact)),
    ("nm != \"hello-from-the-blob\"", Some(FilterInGuest::Exact)),
    ("nm == \"hello-from-the-blob\" && i < 4", Some(FilterInGuest::Exact)),
    ("common_pid == 100 && cpu == 0 && i < 5", Some(FilterInGuest::Exact)),
    ("common_pid != 100 || cpu > 0", Some(FilterInGuest::Exact)),
    ("nm ~ \"*blob\" && i < 2", Some(FilterInGuest::Partial)),
    ("nm ~ \"*blob\" || i < 2", None),
];

/// The filters above, each run by the detour, against the host's own filter on every hit
/// of an unfiltered run: the records the detour keeps are exactly the hits the host's filter
/// keeps (a superset the host then filters, for a filter the guest runs in part), and the
/// others are counted in the detour's filter-table entry.
#[test]
fn a_filter_in_the_detour_keeps_exactly_the_hits_the_hosts_filter_keeps() {
    let vm0 = vm(1, ITERATIONS);
    let armed = arm(&vm0, FULL_SPEC, 1, 128, true);
    let (unfiltered, mem) = run(vm0);
    let every_hit: Vec<HitRecord> = drain_all(&armed, &mem).iter().map(hit_of).collect();
    assert_eq!(every_hit.len() as u64, ITERATIONS);
    let spec_args = args(FULL_SPEC);
    let fields = EventFields::new(&spec_args);
    for &(text, in_guest) in GUEST_FILTERS {
        let filter = FilterExpr::parse(text).and_then(|f| f.bind(&fields)).unwrap();
        let host_keeps: Vec<u64> = (0..ITERATIONS)
            .filter(|&i| filter.matches(&every_hit[i as usize]))
            .collect();
        let record_filter = filter.record_filter(&spec_args);

        let vm = vm(1, ITERATIONS);
        let rings = new_rings(&vm, 1, 128);
        let detour = arm_probe(
            &vm,
            &rings,
            FUNC,
            7,
            0,
            DETOUR_OFFSET,
            FULL_SPEC,
            true,
            Some(&record_filter),
        );
        assert_eq!(detour.filter, in_guest, "{text}");
        let (filtered_run, mem) = run(vm);
        let armed = Armed { detour, rings };
        let records = drain_all(&armed, &mem);
        let guest_keeps: Vec<u64> = records.iter().map(iteration).collect();
        let after_host: Vec<u64> = records
            .iter()
            .filter(|r| filter.matches(&hit_of(r)))
            .map(iteration)
            .collect();
        assert_eq!(after_host, host_keeps, "{text}: the host's filter after the guest's");
        if in_guest == Some(FilterInGuest::Exact) {
            assert_eq!(guest_keeps, host_keeps, "{text}: the records the detour kept");
        }
        let ring_memory = GuestPhys(mem.clone());
        let filtered = armed.rings.probe_filtered(&ring_memory, 0).unwrap();
        assert_eq!(
            filtered + records.len() as u64,
            ITERATIONS,
            "{text}: every hit recorded or counted as filtered"
        );
        assert_eq!(armed.rings.missed(&ring_memory).unwrap().total(), 0, "{text}");
        // Guest instructions (exact on kvm_pvm) against the unfiltered detour's: what the
        // filter adds, less the fetches a discarded hit skips.
        let per_hit = |o: &VmOutcome| o.instructions_emulated as f64 / ITERATIONS as f64;
        eprintln!(
            "{text}: host keeps {} of {ITERATIONS}, the detour recorded {} ({:?}); guest instructions per hit {:+.1}",
            host_keeps.len(),
            records.len(),
            armed.detour.filter,
            per_hit(&filtered_run) - per_hit(&unfiltered)
        );
    }
}
