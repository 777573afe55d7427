use std::collections::HashMap;

use hvprobe_arch::regs::rflags::{AF, CF, OF, PF, SF, TF, ZF};

use super::*;
use crate::test_support::ALL_GPRS;

const FUNC: Gva = Gva(0xffff_ffff_8123_4560);
const SLOT: Gva = Gva(0xffff_ffff_8200_1000);

/// IF and the always-one bit 1: what the kernel usually runs with.
const BASE_FLAGS: u64 = 0x202;

/// A sparse guest stack of 8-byte cells; addresses in `broken` fail.
#[derive(Default)]
struct FakeStack {
    cells: HashMap<u64, u64>,
    broken: Option<u64>,
}

impl StackAccess for FakeStack {
    fn read_u64(&mut self, at: Gva) -> Result<u64, MemoryError> {
        if self.broken == Some(at.0) {
            return Err(MemoryError::Unmapped(at));
        }
        self.cells.get(&at.0).copied().ok_or(MemoryError::Unmapped(at))
    }

    fn write_u64(&mut self, at: Gva, value: u64) -> Result<(), MemoryError> {
        if self.broken == Some(at.0) {
            return Err(MemoryError::Unmapped(at));
        }
        self.cells.insert(at.0, value);
        Ok(())
    }
}

/// Registers with a distinct, recognisable value in every GPR.
fn sample_regs() -> Regs {
    Regs {
        rax: 0x1111_1111_0000_00a0,
        rcx: 0x1111_1111_0000_00c0,
        rdx: 0x1111_1111_0000_00d0,
        rbx: 0x1111_1111_0000_00b0,
        rsp: 0xffff_c900_0001_3f58,
        rbp: 0xffff_c900_0001_3f90,
        rsi: 0x1111_1111_0000_0051,
        rdi: 0x1111_1111_0000_00d1,
        r8: 0x8888_8888_0000_0008,
        r9: 0x9999_9999_0000_0009,
        r10: 0x1010_1010_0000_0010,
        r11: 0x1111_1111_0000_0011,
        r12: 0x1212_1212_0000_0012,
        r13: 0x1313_1313_0000_0013,
        r14: 0x1414_1414_0000_0014,
        r15: 0x1515_1515_0000_0015,
        rip: FUNC.0,
        cs: 0x10,
        rflags: BASE_FLAGS,
        ss: 0x18,
    }
}

fn emulation_of(bytes: &[u8]) -> (ProbedInsn, Emulation) {
    let insn = analyze(bytes, FUNC).unwrap();
    match insn.execution {
        Execution::Emulate(emulation) => (insn, emulation),
        ref other => panic!(
            "{} ({}) is {other:?}, not emulated",
            HexBytes::of(bytes),
            insn.disassembly()
        ),
    }
}

fn out_of_line(bytes: &[u8]) -> (ProbedInsn, OutOfLine) {
    let insn = analyze(bytes, FUNC).unwrap();
    match insn.execution {
        Execution::Step(step) => (insn, step),
        ref other => panic!(
            "{} ({}) is {other:?}, not stepped",
            HexBytes::of(bytes),
            insn.disassembly()
        ),
    }
}

/// Execute `bytes` at FUNC on `regs` and a fresh stack; returns the stack.
fn run(bytes: &[u8], regs: &mut Regs) -> FakeStack {
    let mut stack = FakeStack::default();
    run_on(bytes, regs, &mut stack);
    stack
}

fn run_on(bytes: &[u8], regs: &mut Regs, stack: &mut FakeStack) {
    let (insn, emulation) = emulation_of(bytes);
    regs.rip = FUNC.0;
    emulation.execute(&insn, regs, stack).unwrap();
}

fn next(len: u64) -> u64 {
    FUNC.0 + len
}

#[test]
fn every_nop_form_only_advances_rip() {
    let nops: &[&[u8]] = &[
        &[0x90],
        &[0x66, 0x90],
        &[0x48, 0x90], // xchg rax,rax
        &[0x0f, 0x1f, 0x00],
        &[0x0f, 0x1f, 0x40, 0x00],
        &[0x0f, 0x1f, 0x44, 0x00, 0x00], // the ftrace/fentry pad
        &[0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00],
        &[0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00],
        &[0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00],
        &[0x66, 0x2e, 0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00],
        &[0x66, 0x87, 0xc0],       // xchg ax,ax
        &[0x48, 0x87, 0xdb],       // xchg rbx,rbx
        &[0xf3, 0x0f, 0x1e, 0xfa], // endbr64
    ];
    for bytes in nops {
        let (insn, emulation) = emulation_of(bytes);
        assert_eq!(emulation, Emulation::Nop, "{}", HexBytes::of(bytes));
        assert_eq!(insn.len, bytes.len());
        let mut regs = sample_regs();
        run(bytes, &mut regs);
        let mut expected = sample_regs();
        expected.rip = next(bytes.len() as u64);
        assert_eq!(regs, expected, "{}", HexBytes::of(bytes));
    }
}

#[test]
fn moves_of_an_immediate_into_a_whole_register_are_emulated() {
    let cases: &[(&[u8], u64)] = &[
        // mov $0x1,%ecx (the -O2 kernel's `__task_pid_nr_ns` starts so): zero-extended
        (&[0xb9, 0x01, 0x00, 0x00, 0x00], 0x1),
        // mov $0xffffffff,%ecx: a 32-bit write clears bits 63:32
        (&[0xb9, 0xff, 0xff, 0xff, 0xff], 0xffff_ffff),
        // c7 c1 imm32, the other encoding of mov r32, imm32
        (&[0xc7, 0xc1, 0x78, 0x56, 0x34, 0x12], 0x1234_5678),
        // mov $-2,%rcx (48 c7 c1): sign-extended to 64 bits
        (&[0x48, 0xc7, 0xc1, 0xfe, 0xff, 0xff, 0xff], 0xffff_ffff_ffff_fffe),
        // movabs $0x1122334455667788,%rcx
        (
            &[0x48, 0xb9, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11],
            0x1122_3344_5566_7788,
        ),
    ];
    for &(bytes, value) in cases {
        let (_, emulation) = emulation_of(bytes);
        assert_eq!(
            emulation,
            Emulation::LoadImmediate { dst: Gpr::Rcx, value },
            "{}",
            HexBytes::of(bytes)
        );
        let mut regs = sample_regs();
        run(bytes, &mut regs);
        let mut expected = sample_regs();
        expected.rcx = value;
        expected.rip = next(bytes.len() as u64);
        assert_eq!(
            regs,
            expected,
            "{}: only RCX and RIP change, flags too stay",
            HexBytes::of(bytes)
        );
    }
    // r8-r15 through REX.B: mov $0x7,%r9d
    let mut regs = sample_regs();
    run(&[0x41, 0xb9, 0x07, 0x00, 0x00, 0x00], &mut regs);
    assert_eq!(regs.r9, 7);
    // The 8- and 16-bit forms keep the register's other bits: stepped, not emulated.
    out_of_line(&[0xb1, 0x01]); // mov $0x1,%cl
    out_of_line(&[0x66, 0xb9, 0x01, 0x00]); // mov $0x1,%cx
                                            // A store of an immediate to memory is stepped.
    out_of_line(&[0xc7, 0x01, 0x01, 0x00, 0x00, 0x00]); // movl $0x1,(%rcx)
}

#[test]
fn xchg_forms_that_are_not_nops() {
    // 41 90 is xchg r8,rax: a real exchange, stepped.
    out_of_line(&[0x41, 0x90]);
    // 87 c0 is xchg eax,eax: a 32-bit write, so it clears the upper half of rax.
    let mut regs = sample_regs();
    run(&[0x87, 0xc0], &mut regs);
    assert_eq!(regs.rax, 0x0000_00a0);
    assert_eq!(regs.rip, next(2));
}

#[test]
fn push_every_register() {
    for (number, reg) in ALL_GPRS.iter().enumerate() {
        let bytes: Vec<u8> = if number < 8 {
            vec![0x50 + number as u8]
        } else {
            vec![0x41, 0x50 + (number - 8) as u8]
        };
        let mut regs = sample_regs();
        let before = regs;
        let stack = run(&bytes, &mut regs);
        assert_eq!(emulation_of(&bytes).1, Emulation::Push { src: *reg });
        // push rsp stores the value from before the decrement.
        assert_eq!(stack.cells[&(before.rsp - 8)], reg.get(&before), "{reg:?}");
        let mut expected = before;
        expected.rsp -= 8;
        expected.rip = next(bytes.len() as u64);
        assert_eq!(regs, expected, "{reg:?}");
    }
}

#[test]
fn pop_every_register() {
    const POPPED: u64 = 0xdead_beef_cafe_f00d;
    for (number, reg) in ALL_GPRS.iter().enumerate() {
        let bytes: Vec<u8> = if number < 8 {
            vec![0x58 + number as u8]
        } else {
            vec![0x41, 0x58 + (number - 8) as u8]
        };
        let mut regs = sample_regs();
        let before = regs;
        let mut stack = FakeStack::default();
        stack.cells.insert(before.rsp, POPPED);
        run_on(&bytes, &mut regs, &mut stack);
        let mut expected = before;
        expected.rsp += 8;
        // pop rsp: the popped value wins over the increment.
        reg.set(&mut expected, POPPED);
        expected.rip = next(bytes.len() as u64);
        assert_eq!(regs, expected, "{reg:?}");
    }
}

#[test]
fn mov_between_registers() {
    let regs0 = sample_regs();
    // (bytes, destination, expected value)
    let cases: &[(&[u8], Gpr, u64)] = &[
        (&[0x48, 0x89, 0xe5], Gpr::Rbp, regs0.rsp),   // mov rbp,rsp (89 form)
        (&[0x48, 0x8b, 0xec], Gpr::Rbp, regs0.rsp),   // mov rbp,rsp (8b form)
        (&[0x48, 0x89, 0xec], Gpr::Rsp, regs0.rbp),   // mov rsp,rbp
        (&[0x4c, 0x89, 0xc7], Gpr::Rdi, regs0.r8),    // mov rdi,r8
        (&[0x49, 0x89, 0xfc], Gpr::R12, regs0.rdi),   // mov r12,rdi
        (&[0x89, 0xc7], Gpr::Rdi, 0x0000_00a0),       // mov edi,eax zero-extends
        (&[0x44, 0x89, 0xc0], Gpr::Rax, 0x0000_0008), // mov eax,r8d
        (&[0x45, 0x89, 0xf7], Gpr::R15, 0x0000_0014), // mov r15d,r14d
        (&[0x89, 0xc0], Gpr::Rax, 0x0000_00a0),       // mov eax,eax clears the upper half
    ];
    for (bytes, dst, value) in cases {
        let mut regs = regs0;
        run(bytes, &mut regs);
        let mut expected = regs0;
        dst.set(&mut expected, *value);
        expected.rip = next(bytes.len() as u64);
        assert_eq!(regs, expected, "{}", HexBytes::of(bytes));
    }
}

/// Hand-computed add/sub vectors: (bytes, register before, result, status flags).
/// The reasoning for each flag is in the comment.
#[allow(clippy::type_complexity)]
const ARITH_VECTORS: &[(&[u8], u64, u64, u64)] = &[
    // sub rsp,8: 0x1000-8, borrow out of bit 3 (AF); low byte f8 has 5 ones (PF=0).
    (&[0x48, 0x83, 0xec, 0x08], 0x1000, 0xff8, AF),
    // sub rsp,0x10 on a kernel stack: negative result (SF), no nibble borrow, 0x48 even (PF).
    (
        &[0x48, 0x83, 0xec, 0x10],
        0xffff_c900_0001_3f58,
        0xffff_c900_0001_3f48,
        SF | PF,
    ),
    // sub rsp,1 from 0: borrow (CF), nibble borrow (AF), -1 (SF), ff even (PF), no OF.
    (&[0x48, 0x83, 0xec, 0x01], 0, u64::MAX, CF | AF | SF | PF),
    // sub rsp,1 from i64::MIN: signed overflow to i64::MAX (OF), AF, ff even (PF).
    (
        &[0x48, 0x83, 0xec, 0x01],
        0x8000_0000_0000_0000,
        0x7fff_ffff_ffff_ffff,
        OF | AF | PF,
    ),
    // sub rsp,8 from 8: zero (ZF, PF).
    (&[0x48, 0x83, 0xec, 0x08], 8, 0, ZF | PF),
    // sub rsp,0x7f from 0x80: 1, nibble borrow (AF), one bit set (PF=0).
    (&[0x48, 0x83, 0xec, 0x7f], 0x80, 1, AF),
    // sub rsp,0x1000 (imm32) from 0x10: borrow (CF), negative (SF), 0x10 odd (PF=0).
    (
        &[0x48, 0x81, 0xec, 0x00, 0x10, 0x00, 0x00],
        0x10,
        0xffff_ffff_ffff_f010,
        CF | SF,
    ),
    // sub rax,0x10 via the short rax form 48 2d.
    (&[0x48, 0x2d, 0x10, 0x00, 0x00, 0x00], 0x20, 0x10, 0),
    // add rsp,8: 0xff8+8, nibble carry (AF), low byte 00 even (PF).
    (&[0x48, 0x83, 0xc4, 0x08], 0xff8, 0x1000, AF | PF),
    // add rsp,1 to -1: carry (CF), zero (ZF), AF, PF; -1 + 1 does not overflow.
    (&[0x48, 0x83, 0xc4, 0x01], u64::MAX, 0, CF | ZF | AF | PF),
    // add rsp,1 to i64::MAX: signed overflow (OF), negative (SF), AF, 00 even (PF).
    (
        &[0x48, 0x83, 0xc4, 0x01],
        0x7fff_ffff_ffff_ffff,
        0x8000_0000_0000_0000,
        OF | SF | AF | PF,
    ),
    // add rsp,-8 (imm8 sign-extended): 0x1000 + 0xffff_ffff_ffff_fff8 carries (CF); f8 odd.
    (&[0x48, 0x83, 0xc4, 0xf8], 0x1000, 0xff8, CF),
    // add rsp,-0x80000000 (imm32) to i64::MIN: neg+neg=pos (OF), carry (CF), 00 even (PF).
    (
        &[0x48, 0x81, 0xc4, 0x00, 0x00, 0x00, 0x80],
        0x8000_0000_0000_0000,
        0x7fff_ffff_8000_0000,
        CF | OF | PF,
    ),
    // add rsp,0x100 (imm32): no flags but PF (low byte 58 → 0x58 has 3 ones: odd, PF=0).
    (
        &[0x48, 0x81, 0xc4, 0x00, 0x01, 0x00, 0x00],
        0xffff_c900_0001_3e58,
        0xffff_c900_0001_3f58,
        SF,
    ),
];

#[test]
fn add_sub_immediate_results_and_flags() {
    for (bytes, before, result, flags) in ARITH_VECTORS {
        let (_, emulation) = emulation_of(bytes);
        let reg = match emulation {
            Emulation::ArithImm { dst, .. } => dst,
            other => panic!("{other:?}"),
        };
        // Start with every status flag set (and DF) to see that all are rewritten and the
        // others kept.
        for initial_flags in [BASE_FLAGS, BASE_FLAGS | CF | PF | AF | ZF | SF | OF | (1 << 10)] {
            let mut regs = sample_regs();
            regs.rflags = initial_flags;
            reg.set(&mut regs, *before);
            let before_regs = regs;
            run(bytes, &mut regs);
            let mut expected = before_regs;
            reg.set(&mut expected, *result);
            expected.rflags = (initial_flags & !(CF | PF | AF | ZF | SF | OF)) | flags;
            expected.rip = next(bytes.len() as u64);
            assert_eq!(
                regs,
                expected,
                "{} on {before:#x}: flags {:#x}, expected {:#x}",
                HexBytes::of(bytes),
                regs.rflags,
                expected.rflags
            );
        }
    }
}

/// The same vectors, and a grid of edge values, checked against this very CPU.
#[cfg(target_arch = "x86_64")]
#[test]
fn add_sub_flags_match_the_host_cpu() {
    fn cpu(op: ArithOp, a: u64, b: u64) -> (u64, u64) {
        let mut result = a;
        let flags: u64;
        // SAFETY: register-only arithmetic; pushfq/pop balance the stack (no `nostack`).
        unsafe {
            match op {
                ArithOp::Add => {
                    core::arch::asm!("add {r}, {b}", "pushfq", "pop {f}", r = inout(reg) result, b = in(reg) b, f = out(reg) flags)
                }
                ArithOp::Sub => {
                    core::arch::asm!("sub {r}, {b}", "pushfq", "pop {f}", r = inout(reg) result, b = in(reg) b, f = out(reg) flags)
                }
            }
        }
        (result, flags & (CF | PF | AF | ZF | SF | OF))
    }
    let edges = [
        0u64,
        1,
        7,
        8,
        0xf,
        0x10,
        0x7f,
        0x80,
        0xff,
        0x1000,
        0x7fff_ffff,
        0x8000_0000,
        0xffff_ffff,
        0x7fff_ffff_ffff_ffff,
        0x8000_0000_0000_0000,
        0xffff_c900_0001_3f58,
        u64::MAX - 7,
        u64::MAX,
    ];
    let imms = [
        0u64,
        1,
        8,
        0x10,
        0x7f,
        0xffff_ffff_ffff_ff80,
        0x7fff_ffff,
        0xffff_ffff_8000_0000,
        u64::MAX,
    ];
    for op in [ArithOp::Add, ArithOp::Sub] {
        for a in edges {
            for b in imms {
                // Encode `op rsp, imm32` and emulate it.
                let opcode_ext = if op == ArithOp::Add { 0xc4 } else { 0xec };
                let imm = (b as i64 as i32).to_le_bytes();
                let bytes = [0x48, 0x81, opcode_ext, imm[0], imm[1], imm[2], imm[3]];
                let mut regs = sample_regs();
                regs.rsp = a;
                run(&bytes, &mut regs);
                let (result, flags) = cpu(op, a, b);
                assert_eq!(
                    (regs.rsp, regs.rflags & !BASE_FLAGS),
                    (result, flags),
                    "{op:?} {a:#x}, {b:#x}"
                );
            }
        }
    }
    for (bytes, before, result, flags) in ARITH_VECTORS {
        let (_, emulation) = emulation_of(bytes);
        let Emulation::ArithImm { op, imm, .. } = emulation else {
            panic!()
        };
        assert_eq!(
            cpu(op, *before, imm),
            (*result, *flags),
            "hand vector {} disagrees with the CPU",
            HexBytes::of(bytes)
        );
    }
}

#[test]
fn lea_forms() {
    let regs0 = sample_regs();
    // lea rax,[rip+0x1234]: relative to the next instruction.
    let cases: &[(&[u8], Gpr, u64)] = &[
        (
            &[0x48, 0x8d, 0x05, 0x34, 0x12, 0x00, 0x00],
            Gpr::Rax,
            FUNC.0 + 7 + 0x1234,
        ),
        // lea rdi,[rip-0x10]
        (&[0x48, 0x8d, 0x3d, 0xf0, 0xff, 0xff, 0xff], Gpr::Rdi, FUNC.0 + 7 - 0x10),
        // lea rax,[rbp-0x10]
        (&[0x48, 0x8d, 0x45, 0xf0], Gpr::Rax, regs0.rbp - 0x10),
        // lea rsi,[rsp+0x8]
        (&[0x48, 0x8d, 0x74, 0x24, 0x08], Gpr::Rsi, regs0.rsp + 8),
        // lea rax,[rdi+r8*8+8]
        (
            &[0x4a, 0x8d, 0x44, 0xc7, 0x08],
            Gpr::Rax,
            regs0.rdi.wrapping_add(regs0.r8.wrapping_mul(8)) + 8,
        ),
        // lea r12,[r13+0x100000]
        (
            &[0x4d, 0x8d, 0xa5, 0x00, 0x00, 0x10, 0x00],
            Gpr::R12,
            regs0.r13 + 0x10_0000,
        ),
    ];
    for (bytes, dst, value) in cases {
        let mut regs = regs0;
        run(bytes, &mut regs);
        let mut expected = regs0;
        dst.set(&mut expected, *value);
        expected.rip = next(bytes.len() as u64);
        assert_eq!(regs, expected, "{}", HexBytes::of(bytes));
    }
    // lea with a 32-bit address (67 prefix) or a 32-bit destination is stepped.
    out_of_line(&[0x67, 0x48, 0x8d, 0x00]);
    out_of_line(&[0x8d, 0x45, 0xf0]);
}

#[test]
fn xor_of_a_register_with_itself_zeroes_it() {
    let cases: &[(&[u8], Gpr)] = &[
        (&[0x31, 0xc0], Gpr::Rax),       // xor eax,eax
        (&[0x33, 0xc9], Gpr::Rcx),       // xor ecx,ecx (33 form)
        (&[0x45, 0x31, 0xff], Gpr::R15), // xor r15d,r15d
        (&[0x48, 0x31, 0xd2], Gpr::Rdx), // xor rdx,rdx
    ];
    for (bytes, dst) in cases {
        let mut regs = sample_regs();
        regs.rflags = BASE_FLAGS | CF | OF | SF | AF;
        let before = regs;
        run(bytes, &mut regs);
        let mut expected = before;
        dst.set(&mut expected, 0);
        expected.rflags = BASE_FLAGS | ZF | PF;
        expected.rip = next(bytes.len() as u64);
        assert_eq!(regs, expected, "{}", HexBytes::of(bytes));
    }
    // xor of two different registers is stepped.
    out_of_line(&[0x31, 0xc8]);
}

#[test]
fn call_rel32_pushes_the_return_address() {
    for (disp, target) in [(0x100i32, FUNC.0 + 5 + 0x100), (-0x1000, FUNC.0 + 5 - 0x1000)] {
        let d = disp.to_le_bytes();
        let bytes = [0xe8, d[0], d[1], d[2], d[3]];
        let mut regs = sample_regs();
        let before = regs;
        let stack = run(&bytes, &mut regs);
        assert_eq!(regs.rip, target);
        assert_eq!(regs.rsp, before.rsp - 8);
        assert_eq!(stack.cells[&(before.rsp - 8)], FUNC.0 + 5);
    }
}

#[test]
fn jmp_rel8_and_rel32() {
    let cases: &[(&[u8], u64)] = &[
        (&[0xeb, 0xfe], FUNC.0), // jmp . (to itself)
        (&[0xeb, 0x10], FUNC.0 + 2 + 0x10),
        (&[0xe9, 0x00, 0x01, 0x00, 0x00], FUNC.0 + 5 + 0x100),
        (&[0xe9, 0xfb, 0xff, 0xff, 0xff], FUNC.0),           // jmp rel32 -5
        (&[0xf2, 0xe9, 0x00, 0x00, 0x00, 0x00], FUNC.0 + 6), // bnd jmp
    ];
    for (bytes, target) in cases {
        let mut regs = sample_regs();
        let before = regs;
        run(bytes, &mut regs);
        let mut expected = before;
        expected.rip = *target;
        assert_eq!(regs, expected, "{}", HexBytes::of(bytes));
    }
}

#[test]
fn jcc_all_sixteen_conditions() {
    // (condition nibble, RFLAGS status bits, taken?) — from the SDM's Jcc table.
    let table: &[(u8, u64, bool)] = &[
        (0x0, OF, true),
        (0x0, 0, false),
        (0x1, 0, true),
        (0x1, OF, false),
        (0x2, CF, true),
        (0x2, ZF, false),
        (0x3, ZF, true),
        (0x3, CF, false),
        (0x4, ZF, true),
        (0x4, CF | SF, false),
        (0x5, CF, true),
        (0x5, ZF, false),
        (0x6, CF, true),
        (0x6, ZF, true),
        (0x6, SF | OF | PF, false),
        (0x7, 0, true),
        (0x7, CF, false),
        (0x7, ZF, false),
        (0x8, SF, true),
        (0x8, OF, false),
        (0x9, ZF, true),
        (0x9, SF, false),
        (0xa, PF, true),
        (0xa, CF, false),
        (0xb, 0, true),
        (0xb, PF, false),
        (0xc, SF, true),
        (0xc, OF, true),
        (0xc, SF | OF, false),
        (0xc, 0, false),
        (0xd, SF | OF, true),
        (0xd, 0, true),
        (0xd, SF, false),
        (0xd, OF, false),
        (0xe, ZF, true),
        (0xe, OF, true),
        (0xe, ZF | SF | OF, true),
        (0xe, SF | OF, false),
        (0xe, 0, false),
        (0xf, 0, true),
        (0xf, SF | OF, true),
        (0xf, ZF, false),
        (0xf, SF, false),
    ];
    for &(condition, flags, taken) in table {
        let short = [0x70 | condition, 0x20];
        let near = [0x0f, 0x80 | condition, 0x00, 0x02, 0x00, 0x00];
        for (bytes, target) in [(&short[..], FUNC.0 + 2 + 0x20), (&near[..], FUNC.0 + 6 + 0x200)] {
            let mut regs = sample_regs();
            regs.rflags = BASE_FLAGS | flags;
            let before = regs;
            run(bytes, &mut regs);
            let mut expected = before;
            expected.rip = if taken { target } else { FUNC.0 + bytes.len() as u64 };
            assert_eq!(regs, expected, "{} with flags {flags:#x}", HexBytes::of(bytes));
        }
    }
    // A cs segment prefix as a branch hint changes nothing.
    let mut regs = sample_regs();
    regs.rflags = BASE_FLAGS | ZF;
    run(&[0x2e, 0x74, 0x10], &mut regs);
    assert_eq!(regs.rip, FUNC.0 + 3 + 0x10);
}

#[test]
fn ret_pops_rip() {
    for (bytes, release) in [
        (&[0xc3][..], 0),
        (&[0xf2, 0xc3][..], 0),
        (&[0xc2, 0x10, 0x00][..], 0x10),
    ] {
        let mut regs = sample_regs();
        let before = regs;
        let mut stack = FakeStack::default();
        stack.cells.insert(before.rsp, 0xffff_ffff_8100_4321);
        run_on(bytes, &mut regs, &mut stack);
        let mut expected = before;
        expected.rip = 0xffff_ffff_8100_4321;
        expected.rsp = before.rsp + 8 + release;
        assert_eq!(regs, expected, "{}", HexBytes::of(bytes));
    }
}

#[test]
fn loop_and_jrcxz() {
    // (bytes, rcx before, zf, rcx after, taken)
    let cases: &[(&[u8], u64, bool, u64, bool)] = &[
        (&[0xe2, 0x10], 2, false, 1, true),
        (&[0xe2, 0x10], 1, false, 0, false),
        (&[0xe2, 0x10], 0, false, u64::MAX, true),
        (&[0xe1, 0x10], 2, true, 1, true), // loope
        (&[0xe1, 0x10], 2, false, 1, false),
        (&[0xe0, 0x10], 2, false, 1, true), // loopne
        (&[0xe0, 0x10], 2, true, 1, false),
        (&[0xe3, 0x10], 0, false, 0, true), // jrcxz
        (&[0xe3, 0x10], 5, false, 5, false),
    ];
    for &(bytes, rcx, zf, rcx_after, taken) in cases {
        let mut regs = sample_regs();
        regs.rcx = rcx;
        regs.rflags = BASE_FLAGS | if zf { ZF } else { 0 };
        run(bytes, &mut regs);
        assert_eq!(regs.rcx, rcx_after, "{}", HexBytes::of(bytes));
        assert_eq!(
            regs.rip,
            if taken { FUNC.0 + 2 + 0x10 } else { FUNC.0 + 2 },
            "{}",
            HexBytes::of(bytes)
        );
    }
}

#[test]
fn a_failing_stack_access_is_an_error_and_changes_no_register() {
    for bytes in [&[0x55][..], &[0x5d], &[0xe8, 0, 0, 0, 0], &[0xc3]] {
        let mut regs = sample_regs();
        let before = regs;
        let mut stack = FakeStack {
            broken: Some(before.rsp - 8),
            ..FakeStack::default()
        };
        if bytes[0] == 0x5d || bytes[0] == 0xc3 {
            stack.broken = Some(before.rsp);
        }
        let (insn, emulation) = emulation_of(bytes);
        let error = emulation.execute(&insn, &mut regs, &mut stack).unwrap_err();
        assert!(matches!(error, InsnError::Stack { .. }), "{error}");
        assert!(
            error.to_string().starts_with("0xffffffff81234560: instruction "),
            "{error}"
        );
        assert_eq!(regs, before);
    }
}

#[test]
fn rip_relative_copy_addresses_the_same_location() {
    let insns: &[&[u8]] = &[
        &[0x48, 0x8b, 0x05, 0x00, 0x01, 0x00, 0x00], // mov rax,[rip+0x100]
        &[0x48, 0xc7, 0x05, 0xf0, 0xff, 0xff, 0xff, 0x01, 0, 0, 0], // mov qword [rip-0x10],1 (imm after disp)
        &[0x80, 0x3d, 0x44, 0x33, 0x22, 0x01, 0x00], // cmp byte [rip+0x1223344],0
        &[0xff, 0x15, 0x10, 0x00, 0x00, 0x00],       // call [rip+0x10]
    ];
    for bytes in insns {
        let (insn, step) = out_of_line(bytes);
        assert!(step.rip_relative, "{}", HexBytes::of(bytes));
        let original = Decoder::with_ip(64, bytes, FUNC.0, DecoderOptions::NONE).decode();
        let copy = step.copy_for(&insn, SLOT).unwrap();
        assert_eq!(copy.len(), bytes.len());
        let relocated = Decoder::with_ip(64, &copy, SLOT.0, DecoderOptions::NONE).decode();
        assert_eq!(relocated.code(), original.code());
        assert_eq!(
            relocated.ip_rel_memory_address(),
            original.ip_rel_memory_address(),
            "{}",
            HexBytes::of(bytes)
        );
        // Only the displacement changed: an immediate after it (`mov [rip],imm`) is intact.
        let last = original.op_count() - 1;
        if original.op_kind(last) != OpKind::Memory {
            assert_eq!(relocated.immediate(last), original.immediate(last));
        }
    }
}

#[test]
fn rip_relative_copy_out_of_reach_is_an_error() {
    let bytes = [0x48, 0x8b, 0x05, 0x00, 0x01, 0x00, 0x00];
    let (insn, step) = out_of_line(&bytes);
    let far_slot = Gva(FUNC.0 - 0x1_0000_0000);
    let error = step.copy_for(&insn, far_slot).unwrap_err();
    assert!(matches!(error, InsnError::RipRelativeOutOfReach { .. }));
    assert_eq!(
        error.to_string(),
        "0xffffffff81234560: RIP-relative operand of 48 8b 05 00 01 00 00 addresses 0xffffffff81234667, \
         out of rel32 reach from the copy at 0xfffffffe81234560"
    );
    // Just inside the reach works.
    let near_slot = Gva(0xffff_ffff_8123_4667 - 7 - 0x7fff_ffff);
    step.copy_for(&insn, near_slot).unwrap();
}

#[test]
fn non_rip_relative_copies_are_byte_identical() {
    let insns: &[&[u8]] = &[&[0x48, 0x8b, 0x47, 0x08], &[0xff, 0xd0], &[0xa4], &[0x0f, 0x0d, 0x08]];
    for bytes in insns {
        let (insn, step) = out_of_line(bytes);
        assert!(!step.rip_relative);
        assert_eq!(step.copy_for(&insn, SLOT).unwrap(), bytes.to_vec());
    }
}

#[test]
fn step_kinds() {
    let cases: &[(&[u8], StepKind)] = &[
        (&[0x48, 0x8b, 0x47, 0x08], StepKind::Plain),        // mov rax,[rdi+8]
        (&[0x85, 0xc0], StepKind::Plain),                    // test eax,eax
        (&[0x9c], StepKind::PushFlags),                      // pushfq
        (&[0xff, 0xd0], StepKind::IndirectCall),             // call rax
        (&[0x41, 0xff, 0xd3], StepKind::IndirectCall),       // call r11
        (&[0xff, 0x15, 0, 0, 0, 0], StepKind::IndirectCall), // call [rip]
        (&[0x3e, 0xff, 0xd0], StepKind::IndirectCall),       // notrack call rax
        (&[0xff, 0xe0], StepKind::IndirectJump),             // jmp rax
        (&[0x3e, 0xff, 0x24, 0xc5, 0, 0, 0, 0], StepKind::IndirectJump), // notrack jmp [rax*8]
        (&[0xa4], StepKind::Plain),                          // movsb without rep
        (&[0xf2, 0x0f, 0x10, 0xc1], StepKind::Plain),        // movsd xmm0,xmm1: f2 is not a rep here
    ];
    for (bytes, kind) in cases {
        assert_eq!(out_of_line(bytes).1.kind, *kind, "{}", HexBytes::of(bytes));
    }
}

#[test]
fn fixup_of_a_plain_step_moves_rip_back() {
    let (insn, step) = out_of_line(&[0x48, 0x8b, 0x47, 0x08]);
    let mut regs = sample_regs();
    regs.rip = SLOT.0 + 4;
    let mut stack = FakeStack::default();
    step.fixup_after_step(&insn, SLOT, &mut regs, &mut stack).unwrap();
    assert_eq!(regs.rip, FUNC.0 + 4);
    // Anywhere else (an exception was delivered instead) is an error.
    regs.rip = 0xffff_ffff_8100_0000;
    let error = step.fixup_after_step(&insn, SLOT, &mut regs, &mut stack).unwrap_err();
    assert!(matches!(
        error,
        InsnError::UnexpectedStepRip {
            rip: 0xffff_ffff_8100_0000,
            ..
        }
    ));
}

#[test]
fn fixup_of_an_indirect_call_rewrites_the_return_address() {
    let (insn, step) = out_of_line(&[0xff, 0xd0]);
    let target = 0xffff_ffff_8150_0000;
    let mut regs = sample_regs();
    regs.rip = target;
    regs.rsp -= 8;
    let mut stack = FakeStack::default();
    stack.cells.insert(regs.rsp, SLOT.0 + 2);
    step.fixup_after_step(&insn, SLOT, &mut regs, &mut stack).unwrap();
    assert_eq!(regs.rip, target);
    assert_eq!(stack.cells[&regs.rsp], FUNC.0 + 2);
    // A return address that is not the copy's is an error, not silently rewritten.
    stack.cells.insert(regs.rsp, 0x1234);
    assert!(matches!(
        step.fixup_after_step(&insn, SLOT, &mut regs, &mut stack),
        Err(InsnError::UnexpectedReturnAddress { found: 0x1234, .. })
    ));
}

#[test]
fn fixup_of_an_indirect_jump_keeps_rip() {
    let (insn, step) = out_of_line(&[0xff, 0xe0]);
    let mut regs = sample_regs();
    regs.rip = 0xffff_ffff_8150_0000;
    let before = regs;
    let mut stack = FakeStack::default();
    step.fixup_after_step(&insn, SLOT, &mut regs, &mut stack).unwrap();
    assert_eq!(regs, before);
}

#[test]
fn fixup_of_pushf_clears_the_trap_flag_it_pushed() {
    let (insn, step) = out_of_line(&[0x9c]);
    let mut regs = sample_regs();
    regs.rip = SLOT.0 + 1;
    regs.rsp -= 8;
    let mut stack = FakeStack::default();
    stack.cells.insert(regs.rsp, 0x246 | TF);
    step.fixup_after_step(&insn, SLOT, &mut regs, &mut stack).unwrap();
    assert_eq!(stack.cells[&regs.rsp], 0x246);
    assert_eq!(regs.rip, FUNC.0 + 1);
}

#[test]
fn rep_string_instructions_are_refused_not_stepped_once_per_iteration() {
    for bytes in [
        &[0xf3, 0xa4][..],         // rep movsb
        &[0xf3, 0x48, 0xab],       // rep stosq
        &[0xf3, 0xa6],             // repe cmpsb
        &[0xf2, 0xae],             // repne scasb
        &[0x65, 0xf3, 0x48, 0xa5], // gs rep movsq
    ] {
        match analyze(bytes, FUNC).unwrap().execution {
            Execution::Refuse(reason) => assert!(reason.contains("per iteration"), "{reason}"),
            other => panic!("{}: {other:?}", HexBytes::of(bytes)),
        }
    }
}

#[test]
fn refused_instructions() {
    let refused: &[&[u8]] = &[
        &[0xcc],                   // int3
        &[0xcd, 0x80],             // int 0x80
        &[0xf1],                   // int1
        &[0xcf],                   // iretd
        &[0x48, 0xcf],             // iretq
        &[0x0f, 0x05],             // syscall
        &[0x48, 0x0f, 0x07],       // sysretq
        &[0x0f, 0x34],             // sysenter
        &[0x48, 0x0f, 0x35],       // sysexitq
        &[0xf4],                   // hlt
        &[0x0f, 0x01, 0xc9],       // mwait
        &[0xff, 0x2c, 0x24],       // jmp far [rsp]
        &[0xff, 0x1c, 0x24],       // call far [rsp]
        &[0xcb],                   // retf
        &[0x48, 0xcb],             // retfq
        &[0xca, 0x08, 0x00],       // retf 8
        &[0x8e, 0xd0],             // mov ss,ax
        &[0x8e, 0x14, 0x24],       // mov ss,[rsp]
        &[0x9d],                   // popfq
        &[0xfb],                   // sti
        &[0x0f, 0x0b],             // ud2
        &[0x0f, 0xb9, 0xc0],       // ud1
        &[0xc7, 0xf8, 0, 0, 0, 0], // xbegin: a relative branch we do not emulate
        &[0x67, 0xe3, 0x10],       // jecxz
        &[0x67, 0xe2, 0x10],       // loop with ecx
        &[0x66, 0xc3],             // 16-bit ret on AMD
        &[0x66, 0xe8, 0, 0, 0, 0], // call rel16 on AMD
        &[0x66, 0xff, 0xd0],       // call ax on AMD
        // A REX before a legacy prefix is ignored, the 66 still counts (found by fuzzing:
        // the jmp was emulated, and AMD truncates RIP to 16 bits).
        &[0x40, 0x66, 0x2e, 0xeb, 0xfa], // jmp rel8 on AMD
        &[0x48, 0x66, 0xe8, 0, 0, 0, 0], // call rel16 on AMD
        &[0x66, 0x41, 0x66, 0x74, 0x10], // jz rel8 on AMD
        &[0x48, 0x66, 0x41, 0xc3],       // 16-bit ret on AMD
        // REP/REPNE on loop*/jrcxz: AMD tests ZF the prefix's way (found by fuzzing).
        &[0xf3, 0xe0, 0x10],       // rep loopne: loope on AMD
        &[0xf2, 0xe1, 0x10],       // repne loope: loopne on AMD
        &[0xf3, 0x2e, 0xe0, 0x10], // rep cs loopne
        &[0xf2, 0xe2, 0x10],       // repne loop
        &[0xf3, 0xe3, 0x10],       // rep jrcxz
        // The IDTR holds the step guard's IDT while a copy runs.
        &[0x0f, 0x01, 0x0c, 0x24], // sidt (%rsp)
        &[0x0f, 0x01, 0x1f],       // lidt (%rdi)
    ];
    for bytes in refused {
        let insn = analyze(bytes, FUNC).unwrap();
        assert!(
            matches!(insn.execution, Execution::Refuse(_)),
            "{} ({}) is {:?}",
            HexBytes::of(bytes),
            insn.disassembly(),
            insn.execution
        );
        assert_eq!(insn.len, bytes.len());
    }
}

#[test]
fn invalid_encodings_are_errors() {
    // into, pop ss and push es do not exist in 64-bit mode.
    for bytes in [&[0xce][..], &[0x17], &[0x06, 0x90]] {
        assert!(
            matches!(analyze(bytes, FUNC), Err(InsnError::Undecodable { .. })),
            "{}: {:?}",
            HexBytes::of(bytes),
            analyze(bytes, FUNC)
        );
    }
    let error = analyze(&[0x06, 0x90], Gva(0xffff_ffff_8123_4567)).unwrap_err();
    assert_eq!(error.to_string(), "0xffffffff81234567: cannot decode bytes 06 90");
}

#[test]
fn analyze_takes_only_the_instruction_bytes() {
    let mut bytes = vec![0x48, 0x89, 0xe5];
    bytes.extend([0xcc; 20]);
    let insn = analyze(&bytes, FUNC).unwrap();
    assert_eq!(insn.len, 3);
    assert_eq!(insn.bytes, vec![0x48, 0x89, 0xe5]);
    assert_eq!(insn.next_addr(), Gva(FUNC.0 + 3));
    assert_eq!(insn.disassembly(), "mov rbp,rsp");
    // The end of a function cutting an instruction short.
    let error = analyze(&[0xe8, 0x00, 0x00], FUNC).unwrap_err();
    assert_eq!(
        error.to_string(),
        "0xffffffff81234560: instruction truncated, only 3 bytes available: e8 00 00"
    );
}

/// A prologue and epilogue like the kernel's, padded with int3 like the linker does.
const FUNCTION: &[u8] = &[
    0xf3, 0x0f, 0x1e, 0xfa, // 0: endbr64
    0x0f, 0x1f, 0x44, 0x00, 0x00, // 4: nopl 0x0(%rax,%rax,1) — the fentry pad
    0x55, // 9: push rbp
    0x48, 0x89, 0xe5, // 10: mov rbp,rsp
    0x41, 0x54, // 13: push r12
    0x53, // 15: push rbx
    0x48, 0x83, 0xec, 0x10, // 16: sub rsp,0x10
    0x48, 0x8b, 0x05, 0x10, 0x20, 0x30, 0x00, // 20: mov rax,[rip+0x302010]
    0x85, 0xc0, // 27: test eax,eax
    0x74, 0x05, // 29: je +5
    0xe8, 0x00, 0x00, 0x00, 0x00, // 31: call
    0x5b, // 36: pop rbx
    0x41, 0x5c, // 37: pop r12
    0x5d, // 39: pop rbp
    0xc3, // 40: ret
    0xcc, 0xcc, // 41, 42: padding
];

#[test]
fn instruction_starts_of_a_prologue() {
    let starts = instruction_starts(FUNCTION, FUNC).unwrap();
    let offsets: Vec<u64> = starts.iter().map(|a| a.0 - FUNC.0).collect();
    assert_eq!(
        offsets,
        vec![0, 4, 9, 10, 13, 15, 16, 20, 27, 29, 31, 36, 37, 39, 40, 41, 42]
    );
    assert!(is_boundary(FUNCTION, FUNC, Gva(FUNC.0 + 9)).unwrap());
    assert!(!is_boundary(FUNCTION, FUNC, Gva(FUNC.0 + 5)).unwrap());
    assert!(!is_boundary(FUNCTION, FUNC, Gva(FUNC.0 + 100)).unwrap());
    assert_eq!(instruction_starts(&[], FUNC).unwrap(), vec![]);
    // Every instruction of it classifies; the common prologue ones are all emulated.
    for start in &offsets[..7] {
        let insn = analyze(&FUNCTION[*start as usize..], Gva(FUNC.0 + start)).unwrap();
        assert!(
            matches!(insn.execution, Execution::Emulate(_)),
            "offset {start}: {}",
            insn.disassembly()
        );
    }
}

#[test]
fn instruction_starts_of_garbage() {
    let error = instruction_starts(&[0x55, 0x48, 0x89, 0xe5, 0x06, 0x07, 0xc3], FUNC).unwrap_err();
    assert_eq!(
        error,
        InsnError::Undecodable {
            addr: Gva(FUNC.0 + 4),
            bytes: HexBytes(vec![0x06, 0x07, 0xc3])
        }
    );
    assert_eq!(error.to_string(), "0xffffffff81234564: cannot decode bytes 06 07 c3");
    // A symbol size that cuts the last instruction.
    let error = instruction_starts(&[0x55, 0xe8, 0x00, 0x00], FUNC).unwrap_err();
    assert!(matches!(error, InsnError::Truncated { addr: Gva(a), available: 3, .. } if a == FUNC.0 + 1));
}

#[test]
fn cli_is_emulated_because_a_step_runs_with_if_cleared() {
    let insn = analyze(&[0xfa], FUNC).unwrap();
    let Execution::Emulate(emulation) = &insn.execution else {
        panic!("cli is {:?}", insn.execution)
    };
    let mut regs = Regs {
        rip: FUNC.0,
        rflags: 0x246,
        ..Default::default()
    };
    emulation.execute(&insn, &mut regs, &mut FakeStack::default()).unwrap();
    assert_eq!(regs.rflags, 0x46);
    assert_eq!(regs.rip, FUNC.0 + 1);
}

#[test]
fn rep_string_instructions_are_recognised_where_a_data_watch_traps_on_them() {
    assert!(is_rep_string(&[0xf3, 0xa4])); // rep movsb
    assert!(is_rep_string(&[0xf3, 0x48, 0xab])); // rep stosq
    assert!(is_rep_string(&[0xf2, 0xae])); // repne scasb
    assert!(!is_rep_string(&[0xa4])); // movsb
    assert!(!is_rep_string(&[0x48, 0x89, 0x07])); // mov %rax,(%rdi)
    assert!(!is_rep_string(&[0xf3])); // a prefix alone
}
