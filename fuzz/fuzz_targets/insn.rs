//! Fuzzes the x86-64 instruction layer (`hvprobe_probes::insn`), and checks its emulations
//! against the host CPU.
//!
//! Input layout (missing bytes read as zero):
//! `[L] [L bytes of code] [addr: u64] [slot: u64] [flags: u8] [stack offset: u8]
//!  [16 GPRs: u64 each, rax rcx rdx rbx rsp rbp rsi rdi r8..r15] [32 bytes of stack]`
//!
//! Never panics, for any input:
//! - `instruction_starts` / `instruction_starts_through` (boundaries 1..=15 bytes apart,
//!   each one an instruction `analyze` decodes with exactly that length);
//!   `internal_branches` (decoding exactly when those do, each branch from a start into the
//!   code);
//! - `analyze` (and `disassembly`, error display); for `Step`, `copy_for` at the slot (a
//!   copy of the same length that decodes to the same instruction addressing the same
//!   absolute location) and `fixup_after_step`; for `Emulate`, `execute` on the registers,
//!   and the same checks for its `fallback_step`.
//!
//! Native comparison: the instruction is analysed again at its address in an executable
//! page of this process. If it is an emulation whose effect is registers, flags and our own
//! scratch stack only (`Nop`, `Move`, `ArithImm`, `LoadAddress`, `Zero`, `Push`, `Pop`,
//! `Jump`, `JumpIf`, `Counted`, `Call`, `Return`), it is run on the host CPU between a
//! trampoline that loads all 16 GPRs and the status flags and one that stores them, and
//! the result must equal `Emulation::execute`'s (registers, RFLAGS (AF aside after `xor`,
//! where it is undefined), RIP and the stack). Relative branches get their displacement
//! re-pointed at a "taken" block of the trampoline, and `ret` pops that block's address,
//! so a branch decides between two known places. Every other instruction (`cli`, anything
//! stepped or refused) never runs natively.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use guest_common::Input;
use hvprobe_arch::regs::rflags::{AF, CF, OF, PF, SF, ZF};
use hvprobe_arch::Gva;
use hvprobe_insn::test_support::ALL_GPRS;
use hvprobe_introspection::memory::MemoryError;
use hvprobe_probes::insn::{
    analyze, instruction_starts, instruction_starts_through, internal_branches, Emulation, Execution, InsnError,
    OutOfLine, ProbedInsn, StackAccess, MAX_INSN_LEN,
};
use hvprobe_probes::regs::Regs;
use iced_x86::{Decoder, DecoderOptions};
use libfuzzer_sys::fuzz_target;

/// The error type of `StackAccess`.
type StackError = MemoryError;

fn unmapped(at: Gva) -> StackError {
    MemoryError::Unmapped(at)
}

const RSP: usize = 4;

/// The status flags, in the order the input's flags byte gives them (bits 0..6).
const STATUS: [u64; 6] = [CF, PF, AF, ZF, SF, OF];
/// IF and the always-one bit 1, as user mode runs.
const BASE_FLAGS: u64 = 0x202;

/// A stack of 8-byte cells at any address: what was written, else a value made from the
/// address. Never fails, so `execute` always gets to the end.
#[derive(Default)]
struct AnyStack(HashMap<u64, u64>);

impl StackAccess for AnyStack {
    fn read_u64(&mut self, at: Gva) -> Result<u64, StackError> {
        Ok(self
            .0
            .get(&at.0)
            .copied()
            .unwrap_or(at.0.rotate_left(17) ^ 0x5a5a_5a5a_5a5a_5a5a))
    }

    fn write_u64(&mut self, at: Gva, value: u64) -> Result<(), StackError> {
        self.0.insert(at.0, value);
        Ok(())
    }
}

/// Bytes at `[base, base + len)`, unaligned access allowed; anything else fails.
struct ByteStack {
    base: u64,
    bytes: Vec<u8>,
}

impl ByteStack {
    fn range(&self, at: Gva) -> Result<std::ops::Range<usize>, StackError> {
        let offset = at.0.wrapping_sub(self.base);
        if offset.checked_add(8).is_some_and(|end| end <= self.bytes.len() as u64) {
            Ok(offset as usize..offset as usize + 8)
        } else {
            Err(unmapped(at))
        }
    }
}

impl StackAccess for ByteStack {
    fn read_u64(&mut self, at: Gva) -> Result<u64, StackError> {
        let r = self.range(at)?;
        Ok(u64::from_le_bytes(self.bytes[r].try_into().unwrap()))
    }

    fn write_u64(&mut self, at: Gva, value: u64) -> Result<(), StackError> {
        let r = self.range(at)?;
        self.bytes[r].copy_from_slice(&value.to_le_bytes());
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let code_len = usize::from(input.u8());
    let code = input.bytes(code_len);
    let addr = Gva(input.u64());
    let slot = Gva(input.u64());
    let flags_byte = input.u8();
    let stack_offset = input.u8();
    let mut gprs = [0u64; 16];
    for g in &mut gprs {
        *g = input.u64();
    }
    let mut stack_init = [0u8; 32];
    let s = input.bytes(32);
    stack_init[..s.len()].copy_from_slice(s);

    let rflags = STATUS
        .iter()
        .enumerate()
        .filter(|(bit, _)| flags_byte & (1 << bit) != 0)
        .fold(BASE_FLAGS, |f, (_, flag)| f | flag);
    let mut regs = Regs {
        rip: addr.0,
        rflags,
        cs: 0x10,
        ss: 0x18,
        ..Regs::default()
    };
    for (gpr, value) in ALL_GPRS.iter().zip(gprs) {
        gpr.set(&mut regs, value);
    }

    check_boundaries(code, addr, slot);
    let Some(insn) = check_analysis(code, addr) else {
        return;
    };
    match &insn.execution {
        Execution::Step(ool) => {
            check_copy(&insn, ool, slot);
            let mut after = regs;
            after.rip = slot.0.wrapping_add(gprs[0] & 0x1f);
            let _ = ool.fixup_after_step(&insn, slot, &mut after, &mut AnyStack::default());
        }
        Execution::Emulate(emulation) => {
            let mut after = regs;
            after.rip = addr.0;
            emulation
                .execute(&insn, &mut after, &mut AnyStack::default())
                .expect("execute on a stack that never fails");
            if let Some(ool) = emulation.fallback_step(&insn) {
                check_copy(&insn, &ool, slot);
                let mut after = regs;
                after.rip = slot.0.wrapping_add(insn.len as u64);
                let _ = ool.fixup_after_step(&insn, slot, &mut after, &mut AnyStack::default());
            }
            compare_with_cpu(&insn.bytes, emulation, regs, stack_offset, &stack_init);
        }
        Execution::Refuse(reason) => assert!(!reason.is_empty()),
    }
});

/// `instruction_starts`: from `addr`, 1 to 15 bytes apart, each an instruction `analyze`
/// decodes with that length; `instruction_starts_through` a prefix of it.
fn check_boundaries(code: &[u8], addr: Gva, slot: Gva) {
    let all = instruction_starts(code, addr);
    // Where `_through` stops: somewhere in the code, from the slot's low bits.
    let last = Gva(addr.0.wrapping_add(slot.0 % (code.len() as u64 + 2)));
    let through = instruction_starts_through(code, addr, last);
    let branches = internal_branches(code, addr);
    match (&all, &branches) {
        (Ok(starts), Ok(branches)) => {
            for b in branches {
                assert!(starts.contains(&b.from), "{b:x?} not from an instruction start");
                assert!(
                    b.target.0.wrapping_sub(addr.0) < code.len() as u64,
                    "{b:x?} outside the code"
                );
            }
        }
        (Err(e), Err(e2)) => assert_eq!(e, e2),
        _ => panic!("instruction_starts {all:?} and internal_branches {branches:?} disagree"),
    }
    match &all {
        Ok(starts) => {
            let offsets: Vec<u64> = starts.iter().map(|s| s.0.wrapping_sub(addr.0)).collect();
            if !code.is_empty() {
                assert_eq!(offsets.first(), Some(&0), "{starts:x?}");
            }
            for pair in offsets.windows(2) {
                assert!((1..=MAX_INSN_LEN as u64).contains(&(pair[1] - pair[0])), "{offsets:?}");
            }
            assert!(
                offsets.last().is_none_or(|&o| o < code.len() as u64),
                "{offsets:?} of {}",
                code.len()
            );
            for (i, &offset) in offsets.iter().enumerate() {
                let insn = analyze(&code[offset as usize..], starts[i]).expect("a listed start decodes");
                let end = offsets.get(i + 1).copied().unwrap_or(code.len() as u64);
                assert_eq!(offset + insn.len as u64, end, "length at offset {offset}");
            }
            let through = through.as_ref().expect("_through fails where the whole code decodes");
            assert!(
                starts.starts_with(through),
                "{through:x?} is not a prefix of {starts:x?}"
            );
        }
        Err(e) => {
            check_error(e, addr, code.len());
            // `_through` decodes a prefix of the same instructions: if it fails, it fails
            // on the same one.
            if let Err(e2) = &through {
                assert_eq!(e2, e);
            }
        }
    }
    if let Err(e) = &through {
        check_error(e, addr, code.len());
    }
}

/// A decode error is at an address within the code and names at most 15 of its bytes.
fn check_error(e: &InsnError, start: Gva, code_len: usize) {
    let text = e.to_string();
    match e {
        InsnError::Undecodable { addr, bytes } | InsnError::Truncated { addr, bytes, .. } => {
            let offset = addr.0.wrapping_sub(start.0);
            assert!(offset < code_len.max(1) as u64, "{text}: offset {offset} of {code_len}");
            assert!(bytes.0.len() <= MAX_INSN_LEN, "{text}");
            if let InsnError::Truncated { available, .. } = e {
                assert!(*available < MAX_INSN_LEN, "{text}");
            }
        }
        other => panic!("unexpected decode error {other:?}"),
    }
    assert!(!text.is_empty());
}

fn check_analysis(code: &[u8], addr: Gva) -> Option<ProbedInsn> {
    match analyze(code, addr) {
        Ok(insn) => {
            assert!((1..=MAX_INSN_LEN).contains(&insn.len), "{insn:?}");
            assert_eq!(insn.bytes, code[..insn.len], "{insn:?}");
            assert_eq!(insn.addr, addr);
            assert_eq!(insn.next_addr(), Gva(addr.0.wrapping_add(insn.len as u64)));
            assert!(!insn.disassembly().is_empty());
            // The analysis is of the instruction alone: trailing bytes change nothing.
            assert_eq!(analyze(&insn.bytes, addr).as_ref(), Ok(&insn));
            Some(insn)
        }
        Err(e) => {
            check_error(&e, addr, code.len());
            None
        }
    }
}

/// The copy at `slot` is the same instruction, addressing the same absolute location (a
/// RIP-relative operand's, or a `call rel32`'s target when that is stepped as the fallback
/// of its emulation).
fn check_copy(insn: &ProbedInsn, ool: &OutOfLine, slot: Gva) {
    let decode = |bytes: &[u8], at: Gva| Decoder::with_ip(64, bytes, at.0, DecoderOptions::NONE).decode();
    let original = decode(&insn.bytes, insn.addr);
    assert_eq!(ool.rip_relative, original.is_ip_rel_memory_operand(), "{insn:?}");
    let call_rel32 = insn.bytes.len() == 5 && insn.bytes[0] == 0xe8;
    let retargeted = ool.rip_relative || call_rel32;
    let absolute = |i: &iced_x86::Instruction| {
        if call_rel32 {
            i.near_branch_target()
        } else if ool.rip_relative {
            i.ip_rel_memory_address()
        } else {
            0
        }
    };
    match ool.copy_for(insn, slot) {
        Ok(copy) => {
            assert_eq!(copy.len(), insn.len, "{insn:?}");
            if !retargeted {
                assert_eq!(copy, insn.bytes);
            }
            let copied = decode(&copy, slot);
            assert_eq!(copied.code(), original.code(), "{insn:?} copy {copy:x?}");
            assert_eq!(copied.len(), insn.len, "{insn:?} copy {copy:x?}");
            assert_eq!(
                absolute(&copied),
                absolute(&original),
                "{insn:?} copy {copy:x?} at {slot}"
            );
        }
        Err(InsnError::RipRelativeOutOfReach { target, .. }) => {
            assert!(retargeted, "{insn:?}");
            assert_eq!(target, absolute(&original), "{insn:?}");
            let from = slot.0.wrapping_add(insn.len as u64);
            assert!(
                i32::try_from(target.wrapping_sub(from) as i64).is_err(),
                "{insn:?} at {slot} is in reach"
            );
        }
        Err(e) => panic!("copy_for {insn:?} at {slot}: {e}"),
    }
}

// ---- running an instruction on the host CPU ----

/// The code page, then the data page (registers in and out, the scratch stack).
const CODE_SIZE: usize = 4096;
const DATA: usize = CODE_SIZE;
const D_IN: usize = DATA; // 16 GPRs
const D_FLAGS_IN: usize = DATA + 0x80;
const D_OUT: usize = DATA + 0x100; // 16 GPRs
const D_FLAGS_OUT: usize = DATA + 0x180;
const D_SAVED_RSP: usize = DATA + 0x188;
const D_TAKEN: usize = DATA + 0x190;
/// The scratch stack for push/pop/call/ret: RSP is put near its middle.
const D_STACK: usize = DATA + 0x400;
const STACK_LEN: usize = 0x200;

struct Native {
    page: *mut u8,
}

thread_local! {
    static NATIVE: RefCell<Option<Native>> = const { RefCell::new(None) };
}

static COMPARED: AtomicU64 = AtomicU64::new(0);
static COMPARED_BRANCHES: AtomicU64 = AtomicU64::new(0);
static COMPARED_STACK: AtomicU64 = AtomicU64::new(0);

extern "C" fn print_counts() {
    eprintln!(
        "insn fuzz: {} emulations compared with the CPU ({} branches, {} with stack)",
        COMPARED.load(Ordering::Relaxed),
        COMPARED_BRANCHES.load(Ordering::Relaxed),
        COMPARED_STACK.load(Ordering::Relaxed)
    );
}

impl Native {
    fn new() -> Native {
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                CODE_SIZE * 2,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED, "mmap of an executable page failed");
        // SAFETY: a plain C function with no arguments.
        unsafe { libc::atexit(print_counts) };
        Native { page: page.cast() }
    }

    fn addr(&self, offset: usize) -> u64 {
        self.page as u64 + offset as u64
    }
}

/// x86-64 machine code, with RIP-relative references into the data page.
struct Asm {
    base: u64,
    code: Vec<u8>,
}

impl Asm {
    fn here(&self) -> u64 {
        self.base + self.code.len() as u64
    }

    /// A rel32 from the end of an instruction whose remaining length is `rest` bytes.
    fn rel32(&mut self, target: u64, rest: usize) {
        let end = self.here() + 4 + rest as u64;
        let rel = i32::try_from(target.wrapping_sub(end) as i64).expect("in rel32 reach");
        self.code.extend_from_slice(&rel.to_le_bytes());
    }

    fn rex_w_r(&mut self, reg: usize) {
        self.code.push(0x48 | ((reg >> 3) as u8) << 2);
    }

    /// `mov reg, [rip + target]`
    fn load(&mut self, reg: usize, target: u64) {
        self.rex_w_r(reg);
        self.code.extend_from_slice(&[0x8b, 0x05 | ((reg & 7) as u8) << 3]);
        self.rel32(target, 0);
    }

    /// `mov [rip + target], reg`
    fn store(&mut self, reg: usize, target: u64) {
        self.rex_w_r(reg);
        self.code.extend_from_slice(&[0x89, 0x05 | ((reg & 7) as u8) << 3]);
        self.rel32(target, 0);
    }

    fn push(&mut self, reg: usize) {
        if reg >= 8 {
            self.code.push(0x41);
        }
        self.code.push(0x50 + (reg & 7) as u8);
    }

    fn pop(&mut self, reg: usize) {
        if reg >= 8 {
            self.code.push(0x41);
        }
        self.code.push(0x58 + (reg & 7) as u8);
    }

    /// `mov byte [rip + target], value`: 7 bytes, flags untouched.
    fn set_byte(&mut self, target: u64, value: u8) {
        self.code.extend_from_slice(&[0xc6, 0x05]);
        self.rel32(target, 1);
        self.code.push(value);
    }

    /// `jmp rel32`: 5 bytes.
    fn jmp(&mut self, target: u64) {
        self.code.push(0xe9);
        self.rel32(target, 0);
    }
}

const CALLEE_SAVED: [usize; 6] = [3, 5, 12, 13, 14, 15];
/// `mov byte [rip+x], 0` and `jmp rel32`: the not-taken block.
const FALLTHROUGH_LEN: usize = 12;

/// The prologue's length, which is where the instruction goes.
fn prologue(asm: &mut Asm, native: &Native) {
    for r in CALLEE_SAVED {
        asm.push(r);
    }
    asm.store(RSP, native.addr(D_SAVED_RSP));
    // push qword [rip + flags_in]; popfq
    asm.code.extend_from_slice(&[0xff, 0x35]);
    asm.rel32(native.addr(D_FLAGS_IN), 0);
    asm.code.push(0x9d);
    // RSP last: from here on nothing uses the stack until the epilogue restores it.
    for r in (0..16).filter(|&r| r != RSP).chain([RSP]) {
        asm.load(r, native.addr(D_IN + 8 * r));
    }
}

fn epilogue(asm: &mut Asm, native: &Native) {
    for r in 0..16 {
        asm.store(r, native.addr(D_OUT + 8 * r));
    }
    asm.load(RSP, native.addr(D_SAVED_RSP));
    asm.code.push(0x9c); // pushfq
    asm.pop(0);
    asm.store(0, native.addr(D_FLAGS_OUT));
    for r in CALLEE_SAVED.iter().rev() {
        asm.pop(*r);
    }
    asm.code.push(0xc3);
}

/// What running the instruction natively or by emulation left.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    gprs: [u64; 16],
    rflags: u64,
    rip: u64,
    stack: Vec<u8>,
}

/// Whether the emulation's effect stays in registers, flags and the stack we give it (so
/// the instruction can run in this process), and whether it touches the stack.
fn native_kind(emulation: &Emulation) -> Option<bool> {
    match emulation {
        Emulation::Nop
        | Emulation::Move { .. }
        | Emulation::LoadImmediate { .. }
        | Emulation::ArithImm { .. }
        | Emulation::LoadAddress { .. }
        | Emulation::Zero { .. }
        | Emulation::Jump { .. }
        | Emulation::JumpIf { .. }
        | Emulation::Counted { .. } => Some(false),
        Emulation::Push { .. } | Emulation::Pop { .. } | Emulation::Call { .. } | Emulation::Return { .. } => {
            Some(true)
        }
        // cli is privileged: #GP in user mode.
        Emulation::DisableInterrupts => None,
    }
}

fn is_relative_branch(emulation: &Emulation) -> bool {
    matches!(
        emulation,
        Emulation::Jump { .. } | Emulation::JumpIf { .. } | Emulation::Counted { .. } | Emulation::Call { .. }
    )
}

/// Runs `bytes` (an instruction that analysed as `emulation` somewhere else) at its place
/// in the code page and by emulation, from `regs`, and compares.
fn compare_with_cpu(bytes: &[u8], emulation: &Emulation, mut regs: Regs, stack_offset: u8, stack_init: &[u8; 32]) {
    let Some(uses_stack) = native_kind(emulation) else {
        return;
    };
    NATIVE.with(|cell| {
        let mut cell = cell.borrow_mut();
        let native = cell.get_or_insert_with(Native::new);

        let mut asm = Asm {
            base: native.addr(0),
            code: Vec::with_capacity(512),
        };
        prologue(&mut asm, native);
        let at = asm.here();
        let taken = at + (bytes.len() + FALLTHROUGH_LEN) as u64;
        let mut bytes = bytes.to_vec();
        if is_relative_branch(emulation) {
            // Re-point the displacement (the last 1 or 4 bytes) at the taken block.
            let mut decoder = Decoder::with_ip(64, &bytes, at, DecoderOptions::NONE);
            let instruction = decoder.decode();
            let offsets = decoder.get_constant_offsets(&instruction);
            assert!(offsets.has_immediate(), "{bytes:x?}: branch without a displacement");
            let (o, size) = (offsets.immediate_offset(), offsets.immediate_size());
            let rel = FALLTHROUGH_LEN as u64;
            bytes[o..o + size].copy_from_slice(&rel.to_le_bytes()[..size]);
        }
        // The emulation of these very bytes at this very address.
        let insn = analyze(&bytes, Gva(at)).expect("re-analysis at the native address");
        let Execution::Emulate(local) = insn.execution else {
            panic!(
                "{bytes:x?} analyses as {:?} at {at:#x}, as {emulation:?} elsewhere",
                insn.execution
            );
        };
        assert_eq!(
            std::mem::discriminant(&local),
            std::mem::discriminant(emulation),
            "{bytes:x?}"
        );
        if is_relative_branch(&local) {
            let target = match local {
                Emulation::Jump { target }
                | Emulation::JumpIf { target, .. }
                | Emulation::Counted { target, .. }
                | Emulation::Call { target } => target,
                _ => unreachable!(),
            };
            assert_eq!(target.0, taken, "{bytes:x?}: patched branch target");
        }
        asm.code.extend_from_slice(&bytes);
        // Not taken.
        asm.set_byte(native.addr(D_TAKEN), 0);
        let epilogue_at = asm.here() + 5 + 7;
        asm.jmp(epilogue_at);
        assert_eq!(asm.here(), taken);
        asm.set_byte(native.addr(D_TAKEN), 1);
        assert_eq!(asm.here(), epilogue_at);
        epilogue(&mut asm, native);
        assert!(asm.code.len() <= CODE_SIZE);

        // The stack: RSP near the middle of the scratch area, the input's bytes around it.
        let stack_base = native.addr(D_STACK);
        let mut stack = vec![0u8; STACK_LEN];
        if uses_stack {
            let rsp_offset = STACK_LEN / 2 - 128 + usize::from(stack_offset);
            regs.rsp = stack_base + rsp_offset as u64;
            stack[rsp_offset - 16..rsp_offset + 16].copy_from_slice(stack_init);
            if let Emulation::Return { .. } = local {
                stack[rsp_offset..rsp_offset + 8].copy_from_slice(&taken.to_le_bytes());
            }
        }
        regs.rip = at;

        // Emulate.
        let mut emulated_regs = regs;
        let mut emulated_stack = ByteStack {
            base: stack_base,
            bytes: stack.clone(),
        };
        local
            .execute(&insn, &mut emulated_regs, &mut emulated_stack)
            .expect("emulation within the scratch stack");
        let mut emulated = Outcome {
            gprs: ALL_GPRS.map(|g| g.get(&emulated_regs)),
            rflags: emulated_regs.rflags,
            rip: emulated_regs.rip,
            stack: emulated_stack.bytes,
        };

        // Run.
        let page = native.page;
        // SAFETY: the code page holds the trampoline just assembled (checked to fit), the
        // data page the registers it loads; the instruction analysed as one of the
        // emulations above, whose effect is registers, flags, RIP within the trampoline and
        // the scratch stack. The trampoline saves and restores the callee-saved registers
        // and RSP, and leaves DF clear (only status flags are loaded).
        let native_outcome = unsafe {
            std::ptr::copy_nonoverlapping(asm.code.as_ptr(), page, asm.code.len());
            let gprs_in = ALL_GPRS.map(|g| g.get(&regs));
            std::ptr::copy_nonoverlapping(gprs_in.as_ptr().cast::<u8>(), page.add(D_IN), 128);
            page.add(D_FLAGS_IN).cast::<u64>().write(regs.rflags);
            std::ptr::copy_nonoverlapping(stack.as_ptr(), page.add(D_STACK), STACK_LEN);
            page.add(D_TAKEN).write(0xff);

            // While RSP holds a random value, a signal would be delivered onto it: hold
            // the asynchronous ones back (faults still arrive, on the sanitizer's stack).
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            for sig in [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE, libc::SIGTRAP] {
                libc::sigdelset(&mut all, sig);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
            let entry: extern "sysv64" fn() = std::mem::transmute(page);
            entry();
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());

            let mut gprs = [0u64; 16];
            std::ptr::copy_nonoverlapping(page.add(D_OUT), gprs.as_mut_ptr().cast::<u8>(), 128);
            let mut stack_out = vec![0u8; STACK_LEN];
            std::ptr::copy_nonoverlapping(page.add(D_STACK), stack_out.as_mut_ptr(), STACK_LEN);
            let rip = match page.add(D_TAKEN).read() {
                0 => at + bytes.len() as u64,
                1 => taken,
                other => panic!("{bytes:x?}: trampoline left taken = {other}"),
            };
            Outcome {
                gprs,
                rflags: page.add(D_FLAGS_OUT).cast::<u64>().read(),
                rip,
                stack: stack_out,
            }
        };
        let mut native_outcome = native_outcome;
        if let Emulation::Zero { .. } = local {
            // AF is undefined after xor.
            emulated.rflags &= !AF;
            native_outcome.rflags &= !AF;
        }
        COMPARED.fetch_add(1, Ordering::Relaxed);
        if is_relative_branch(&local) || matches!(local, Emulation::Return { .. }) {
            COMPARED_BRANCHES.fetch_add(1, Ordering::Relaxed);
        }
        if uses_stack {
            COMPARED_STACK.fetch_add(1, Ordering::Relaxed);
        }
        if emulated != native_outcome {
            panic!(
                "{} ({bytes:x?}) as {local:?} from {regs:x?}: emulation and CPU differ:\n{}",
                insn.disassembly(),
                differences(&emulated, &native_outcome)
            );
        }
    });
}

/// The fields in which the emulated and native outcomes differ, in hex.
fn differences(emulated: &Outcome, native: &Outcome) -> String {
    let mut lines = Vec::new();
    for (i, gpr) in ALL_GPRS.iter().enumerate() {
        if emulated.gprs[i] != native.gprs[i] {
            lines.push(format!(
                "  {gpr:?}: emulated {:#x}, cpu {:#x}",
                emulated.gprs[i], native.gprs[i]
            ));
        }
    }
    if emulated.rflags != native.rflags {
        lines.push(format!(
            "  rflags: emulated {:#x}, cpu {:#x}",
            emulated.rflags, native.rflags
        ));
    }
    if emulated.rip != native.rip {
        lines.push(format!("  rip: emulated {:#x}, cpu {:#x}", emulated.rip, native.rip));
    }
    for (i, (e, n)) in emulated.stack.iter().zip(&native.stack).enumerate() {
        if e != n {
            lines.push(format!("  stack byte {i:#x}: emulated {e:#04x}, cpu {n:#04x}"));
        }
    }
    lines.join("\n")
}
