//! The x86-64 instruction layer of the probe engine: instruction boundaries of a function,
//! and what to do with the original instruction under a probe's int3 (emulate it on the
//! host, single-step a copy of it out of line, or refuse the probe).
//!
//! Pure: no KVM and no guest memory here. The engine hands in bytes and registers, and a
//! [`StackAccess`] for the few instructions that touch the stack.
//!
//! The classification follows Linux's `arch/x86/kernel/kprobes/core.c`
//! (`can_probe`, `prepare_emulation`, `resume_singlestep`) with two differences that come
//! from running on the host: we emulate more of the common prologue instructions (every
//! emulated instruction saves a single-step exit), and `pushf` is stepped (the engine
//! clears IF for the step, as Linux does, and puts the guest's IF back in the pushed word).

use std::fmt;

use hvprobe_arch::regs::rflags;
use hvprobe_arch::Gva;
use hvprobe_introspection::memory::MemoryError;
use iced_x86::{
    Code, ConditionCode, Decoder, DecoderError, DecoderOptions, FlowControl, Formatter, Instruction, IntelFormatter,
    Mnemonic, OpKind, Register,
};

use hvprobe_arch::pt_regs::Regs;

/// The longest x86 instruction.
pub const MAX_INSN_LEN: usize = 15;

/// Bytes printed as `0f 1f 44 00 00` in error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HexBytes(pub Vec<u8>);

impl fmt::Display for HexBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl HexBytes {
    fn of(bytes: &[u8]) -> Self {
        HexBytes(bytes[..bytes.len().min(MAX_INSN_LEN)].to_vec())
    }
}

/// What went wrong analysing, copying or executing an instruction. Every message starts with
/// the instruction's address and names its bytes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InsnError {
    #[error("{addr}: cannot decode bytes {bytes}")]
    Undecodable { addr: Gva, bytes: HexBytes },
    #[error("{addr}: instruction truncated, only {available} bytes available: {bytes}")]
    Truncated {
        addr: Gva,
        available: usize,
        bytes: HexBytes,
    },
    #[error(
        "{addr}: RIP-relative operand of {bytes} addresses {target:#x}, out of rel32 reach from the copy at {slot}"
    )]
    RipRelativeOutOfReach {
        addr: Gva,
        bytes: HexBytes,
        target: u64,
        slot: Gva,
    },
    #[error("{addr}: instruction {bytes} is not stepped out of line")]
    NotStepped { addr: Gva, bytes: HexBytes },
    #[error("{addr}: instruction {bytes}: stack access at {at} failed: {source}")]
    Stack {
        addr: Gva,
        bytes: HexBytes,
        at: Gva,
        source: MemoryError,
    },
    #[error("{addr}: single-step of the copy of {bytes} at {slot} left RIP at {rip:#x}")]
    UnexpectedStepRip {
        addr: Gva,
        bytes: HexBytes,
        slot: Gva,
        rip: u64,
    },
    #[error(
        "{addr}: single-step of the copy of {bytes} at {slot}: return address on the stack is {found:#x}, not the copy's"
    )]
    UnexpectedReturnAddress {
        addr: Gva,
        bytes: HexBytes,
        slot: Gva,
        found: u64,
    },
}

/// The guest stack as emulation and step fix-ups need it: 8-byte reads and writes at guest
/// virtual addresses. The engine implements it over a page walk; tests over a map.
pub trait StackAccess {
    fn read_u64(&mut self, at: Gva) -> Result<u64, MemoryError>;
    fn write_u64(&mut self, at: Gva, value: u64) -> Result<(), MemoryError>;
}

fn decoder_at(bytes: &[u8], addr: Gva) -> Decoder<'_> {
    Decoder::with_ip(64, bytes, addr.0, DecoderOptions::NONE)
}

/// Why `decoder` could not decode the instruction at `addr` (`bytes` from there on): cut short
/// by the end of the bytes, or undecodable.
pub fn decode_error(decoder: &Decoder<'_>, bytes: &[u8], addr: Gva) -> InsnError {
    // iced also reports "no more bytes" for an invalid opcode at the very end of the input
    // (a lone `ce`), so a cut-short instruction is one that decodes once bytes are added.
    let cut_short = decoder.last_error() == DecoderError::NoMoreBytes && {
        let mut padded = bytes[..bytes.len().min(MAX_INSN_LEN)].to_vec();
        padded.resize(MAX_INSN_LEN, 0);
        !decoder_at(&padded, addr).decode().is_invalid()
    };
    if cut_short {
        InsnError::Truncated {
            addr,
            available: bytes.len(),
            bytes: HexBytes::of(bytes),
        }
    } else {
        InsnError::Undecodable {
            addr,
            bytes: HexBytes::of(bytes),
        }
    }
}

/// The address of every instruction of a function, decoding `code` (the bytes from the
/// symbol's start, as long as the symbol's size) linearly from `start`. A probe address not
/// in this list would split an instruction, which in-kernel kprobes cannot check but we can.
pub fn instruction_starts(code: &[u8], start: Gva) -> Result<Vec<Gva>, InsnError> {
    instruction_starts_through(code, start, Gva(u64::MAX))
}

/// Like [`instruction_starts`], but stops after the instruction that covers `last`: what
/// follows (padding, data the compiler put after the code) need not decode.
pub fn instruction_starts_through(code: &[u8], start: Gva, last: Gva) -> Result<Vec<Gva>, InsnError> {
    let mut decoder = decoder_at(code, start);
    let mut starts = Vec::new();
    let mut instruction = Instruction::default();
    while decoder.can_decode() && decoder.ip() <= last.0 {
        let offset = decoder.position();
        decoder.decode_out(&mut instruction);
        if instruction.is_invalid() {
            let addr = Gva(start.0.wrapping_add(offset as u64));
            return Err(decode_error(&decoder, &code[offset..], addr));
        }
        starts.push(Gva(instruction.ip()));
    }
    // The next instruction starts where the last decoded one ends: a boundary, even if
    // it is not decoded.
    if decoder.can_decode() {
        starts.push(Gva(decoder.ip()));
    }
    Ok(starts)
}

/// A direct near branch (`jmp`, `jcc`, `call`, `loop*`, `jrcxz`) of a function whose
/// target lies inside the function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InternalBranch {
    pub from: Gva,
    pub target: Gva,
}

/// Every direct near branch of the function `code` (from `start`) that lands inside it,
/// decoding the whole function; an undecodable byte is an error (then nothing can be said
/// about what jumps where).
pub fn internal_branches(code: &[u8], start: Gva) -> Result<Vec<InternalBranch>, InsnError> {
    let end = start.0.wrapping_add(code.len() as u64);
    let mut decoder = decoder_at(code, start);
    let mut branches = Vec::new();
    let mut instruction = Instruction::default();
    while decoder.can_decode() {
        let offset = decoder.position();
        decoder.decode_out(&mut instruction);
        if instruction.is_invalid() {
            let addr = Gva(start.0.wrapping_add(offset as u64));
            return Err(decode_error(&decoder, &code[offset..], addr));
        }
        let direct = matches!(
            instruction.op0_kind(),
            OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
        );
        if direct && instruction.op_count() == 1 {
            let target = instruction.near_branch_target();
            if (start.0..end).contains(&target) {
                branches.push(InternalBranch {
                    from: Gva(instruction.ip()),
                    target: Gva(target),
                });
            }
        }
    }
    Ok(branches)
}

/// Whether `addr` is the start of an instruction of the function whose bytes are `code`,
/// starting at `start`.
pub fn is_boundary(code: &[u8], start: Gva, addr: Gva) -> Result<bool, InsnError> {
    Ok(instruction_starts(code, start)?.binary_search(&addr).is_ok())
}

/// The original instruction at a probe address and how a hit executes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbedInsn {
    pub addr: Gva,
    pub len: usize,
    /// The instruction's own bytes (`len` of them).
    pub bytes: Vec<u8>,
    pub execution: Execution,
}

impl ProbedInsn {
    /// The address right after the instruction, where execution resumes.
    pub fn next_addr(&self) -> Gva {
        Gva(self.addr.0.wrapping_add(self.len as u64))
    }

    /// Intel-syntax text of the instruction, for listings and logs.
    pub fn disassembly(&self) -> String {
        let instruction = decoder_at(&self.bytes, self.addr).decode();
        let mut text = String::new();
        IntelFormatter::new().format(&instruction, &mut text);
        text
    }

    fn hex(&self) -> HexBytes {
        HexBytes(self.bytes.clone())
    }
}

/// How a probe hit executes the original instruction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Execution {
    /// The host performs the instruction on the registers: one exit per hit.
    Emulate(Emulation),
    /// The vCPU single-steps a copy in the out-of-line area, then the host fixes up.
    Step(OutOfLine),
    /// The address must not be probed; the reason says why.
    Refuse(&'static str),
}

/// A general-purpose register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gpr {
    Rax,
    Rcx,
    Rdx,
    Rbx,
    Rsp,
    Rbp,
    Rsi,
    Rdi,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
}

impl Gpr {
    /// The 64-bit register that contains iced's `register` (eax → rax), if it is a GPR.
    fn containing(register: Register) -> Option<Gpr> {
        if !register.is_gpr() {
            return None;
        }
        Some(match register.full_register() {
            Register::RAX => Gpr::Rax,
            Register::RCX => Gpr::Rcx,
            Register::RDX => Gpr::Rdx,
            Register::RBX => Gpr::Rbx,
            Register::RSP => Gpr::Rsp,
            Register::RBP => Gpr::Rbp,
            Register::RSI => Gpr::Rsi,
            Register::RDI => Gpr::Rdi,
            Register::R8 => Gpr::R8,
            Register::R9 => Gpr::R9,
            Register::R10 => Gpr::R10,
            Register::R11 => Gpr::R11,
            Register::R12 => Gpr::R12,
            Register::R13 => Gpr::R13,
            Register::R14 => Gpr::R14,
            Register::R15 => Gpr::R15,
            _ => return None,
        })
    }

    fn slot(self, regs: &mut Regs) -> &mut u64 {
        match self {
            Gpr::Rax => &mut regs.rax,
            Gpr::Rcx => &mut regs.rcx,
            Gpr::Rdx => &mut regs.rdx,
            Gpr::Rbx => &mut regs.rbx,
            Gpr::Rsp => &mut regs.rsp,
            Gpr::Rbp => &mut regs.rbp,
            Gpr::Rsi => &mut regs.rsi,
            Gpr::Rdi => &mut regs.rdi,
            Gpr::R8 => &mut regs.r8,
            Gpr::R9 => &mut regs.r9,
            Gpr::R10 => &mut regs.r10,
            Gpr::R11 => &mut regs.r11,
            Gpr::R12 => &mut regs.r12,
            Gpr::R13 => &mut regs.r13,
            Gpr::R14 => &mut regs.r14,
            Gpr::R15 => &mut regs.r15,
        }
    }

    pub fn get(self, regs: &Regs) -> u64 {
        match self {
            Gpr::Rax => regs.rax,
            Gpr::Rcx => regs.rcx,
            Gpr::Rdx => regs.rdx,
            Gpr::Rbx => regs.rbx,
            Gpr::Rsp => regs.rsp,
            Gpr::Rbp => regs.rbp,
            Gpr::Rsi => regs.rsi,
            Gpr::Rdi => regs.rdi,
            Gpr::R8 => regs.r8,
            Gpr::R9 => regs.r9,
            Gpr::R10 => regs.r10,
            Gpr::R11 => regs.r11,
            Gpr::R12 => regs.r12,
            Gpr::R13 => regs.r13,
            Gpr::R14 => regs.r14,
            Gpr::R15 => regs.r15,
        }
    }

    pub fn set(self, regs: &mut Regs, value: u64) {
        *self.slot(regs) = value;
    }
}

/// The condition of a `jcc`, as the low nibble of its opcode encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    Overflow,
    NotOverflow,
    Below,
    AboveOrEqual,
    Equal,
    NotEqual,
    BelowOrEqual,
    Above,
    Sign,
    NotSign,
    Parity,
    NotParity,
    Less,
    GreaterOrEqual,
    LessOrEqual,
    Greater,
}

impl Condition {
    fn from_iced(code: ConditionCode) -> Option<Condition> {
        Some(match code {
            ConditionCode::o => Condition::Overflow,
            ConditionCode::no => Condition::NotOverflow,
            ConditionCode::b => Condition::Below,
            ConditionCode::ae => Condition::AboveOrEqual,
            ConditionCode::e => Condition::Equal,
            ConditionCode::ne => Condition::NotEqual,
            ConditionCode::be => Condition::BelowOrEqual,
            ConditionCode::a => Condition::Above,
            ConditionCode::s => Condition::Sign,
            ConditionCode::ns => Condition::NotSign,
            ConditionCode::p => Condition::Parity,
            ConditionCode::np => Condition::NotParity,
            ConditionCode::l => Condition::Less,
            ConditionCode::ge => Condition::GreaterOrEqual,
            ConditionCode::le => Condition::LessOrEqual,
            ConditionCode::g => Condition::Greater,
            _ => return None,
        })
    }

    /// Whether the condition holds for these RFLAGS.
    pub fn holds(self, rflags: u64) -> bool {
        let cf = rflags & rflags::CF != 0;
        let pf = rflags & rflags::PF != 0;
        let zf = rflags & rflags::ZF != 0;
        let sf = rflags & rflags::SF != 0;
        let of = rflags & rflags::OF != 0;
        match self {
            Condition::Overflow => of,
            Condition::NotOverflow => !of,
            Condition::Below => cf,
            Condition::AboveOrEqual => !cf,
            Condition::Equal => zf,
            Condition::NotEqual => !zf,
            Condition::BelowOrEqual => cf || zf,
            Condition::Above => !cf && !zf,
            Condition::Sign => sf,
            Condition::NotSign => !sf,
            Condition::Parity => pf,
            Condition::NotParity => !pf,
            Condition::Less => sf != of,
            Condition::GreaterOrEqual => sf == of,
            Condition::LessOrEqual => zf || sf != of,
            Condition::Greater => !zf && sf == of,
        }
    }
}

/// `add` or `sub` of an immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArithOp {
    Add,
    Sub,
}

/// The branch-on-RCX instructions (rel8 only, with RCX as the counter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountedBranch {
    /// `loop`: RCX -= 1, branch if RCX != 0.
    Loop,
    /// `loope`: RCX -= 1, branch if RCX != 0 and ZF.
    LoopIfEqual,
    /// `loopne`: RCX -= 1, branch if RCX != 0 and !ZF.
    LoopIfNotEqual,
    /// `jrcxz`: branch if RCX == 0, RCX unchanged.
    JumpIfRcxZero,
}

/// An instruction the host performs itself. Branch targets are absolute: they were
/// resolved from the instruction's own address when it was analysed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emulation {
    /// Every NOP form, `endbr64` (no IBT state to track: we arrive by RIP, not a branch),
    /// and `xchg` of a 16- or 64-bit register with itself.
    Nop,
    /// `push r64`. `push rsp` pushes the value RSP had before the push.
    Push { src: Gpr },
    /// `pop r64`. `pop rsp` leaves RSP = the popped value.
    Pop { dst: Gpr },
    /// `mov r64,r64`, or `mov r32,r32` with `zero_extend` (a 32-bit write clears bits 63:32),
    /// which is also what `xchg r32,r32` of a register with itself does.
    Move { dst: Gpr, src: Gpr, zero_extend: bool },
    /// `mov r32, imm32` (zero-extended, as a 32-bit write is), `mov r64, imm32`
    /// (sign-extended) and `movabs r64, imm64`: `value` is what the register gets. Flags
    /// are not touched. (The 8- and 16-bit forms keep the register's other bits: stepped.)
    LoadImmediate { dst: Gpr, value: u64 },
    /// `add`/`sub r64, imm` (the immediate already sign-extended), flags as the CPU sets them.
    ArithImm { op: ArithOp, dst: Gpr, imm: u64 },
    /// `lea r64, [base + index*scale + disp]`; RIP-relative forms have no base and the
    /// absolute address in `disp`.
    LoadAddress {
        dst: Gpr,
        base: Option<Gpr>,
        index: Option<(Gpr, u32)>,
        disp: u64,
    },
    /// `xor r32,r32` / `xor r64,r64` of a register with itself.
    Zero { dst: Gpr },
    /// `call rel32`.
    Call { target: Gva },
    /// `jmp rel8/rel32`.
    Jump { target: Gva },
    /// `jcc rel8/rel32`.
    JumpIf { condition: Condition, target: Gva },
    /// `loop*`/`jrcxz rel8`.
    Counted { kind: CountedBranch, target: Gva },
    /// `ret` and `ret imm16` (which releases `release` more bytes of arguments). A `bnd`
    /// prefix changes nothing: the kernel does not use MPX.
    Return { release: u16 },
    /// `cli`: emulated, because a stepped instruction runs with IF cleared by the engine
    /// and IF is put back after the step.
    DisableInterrupts,
}

impl Emulation {
    /// How to run this instruction as a single-stepped copy instead, for when the host
    /// cannot complete it (its stack access failed: a page not present, a guard page):
    /// stepping lets the CPU raise the real fault. `None` for instructions that touch no
    /// memory, which the host always completes.
    pub fn fallback_step(&self, insn: &ProbedInsn) -> Option<OutOfLine> {
        let kind = match self {
            Emulation::Push { .. } | Emulation::Pop { .. } => StepKind::Plain,
            // RIP after the step is the popped return address.
            Emulation::Return { .. } => StepKind::IndirectJump,
            // The copy's rel32 is re-targeted at the slot; the pushed return address is
            // then the copy's, fixed up as for `call r/m64`.
            Emulation::Call { .. } if insn.bytes.len() == 5 && insn.bytes[0] == CALL_REL32 => StepKind::IndirectCall,
            _ => return None,
        };
        Some(OutOfLine {
            kind,
            rip_relative: false,
        })
    }

    /// Perform the instruction `insn` (whose analysis gave `self`): registers, RIP (the
    /// next instruction or the branch target) and the stack. On an error nothing in `regs`
    /// has changed, though a failed `call` may have written nothing or the return address.
    pub fn execute(&self, insn: &ProbedInsn, regs: &mut Regs, stack: &mut dyn StackAccess) -> Result<(), InsnError> {
        let mut new = *regs;
        let next = insn.next_addr().0;
        new.rip = next;
        let stack_error = |at: u64, source: MemoryError| InsnError::Stack {
            addr: insn.addr,
            bytes: insn.hex(),
            at: Gva(at),
            source,
        };
        match *self {
            Emulation::Nop => {}
            Emulation::Push { src } => {
                let value = src.get(regs);
                let at = regs.rsp.wrapping_sub(8);
                stack.write_u64(Gva(at), value).map_err(|m| stack_error(at, m))?;
                new.rsp = at;
            }
            Emulation::Pop { dst } => {
                let at = regs.rsp;
                let value = stack.read_u64(Gva(at)).map_err(|m| stack_error(at, m))?;
                // RSP is incremented before the destination is written, so `pop rsp` ends
                // with RSP = the popped value.
                new.rsp = at.wrapping_add(8);
                dst.set(&mut new, value);
            }
            Emulation::Move { dst, src, zero_extend } => {
                let value = src.get(regs);
                dst.set(&mut new, if zero_extend { value & 0xffff_ffff } else { value });
            }
            Emulation::LoadImmediate { dst, value } => dst.set(&mut new, value),
            Emulation::ArithImm { op, dst, imm } => {
                let (result, flags) = arith_flags(op, dst.get(regs), imm);
                dst.set(&mut new, result);
                new.rflags = (regs.rflags & !rflags::STATUS) | flags;
            }
            Emulation::LoadAddress { dst, base, index, disp } => {
                let base = base.map_or(0, |b| b.get(regs));
                let index = index.map_or(0, |(i, scale)| i.get(regs).wrapping_mul(u64::from(scale)));
                dst.set(&mut new, base.wrapping_add(index).wrapping_add(disp));
            }
            Emulation::Zero { dst } => {
                dst.set(&mut new, 0);
                // CF = OF = SF = 0, ZF = PF = 1; AF is undefined and we clear it.
                new.rflags = (regs.rflags & !rflags::STATUS) | rflags::ZF | rflags::PF;
            }
            Emulation::Call { target } => {
                let at = regs.rsp.wrapping_sub(8);
                stack.write_u64(Gva(at), next).map_err(|m| stack_error(at, m))?;
                new.rsp = at;
                new.rip = target.0;
            }
            Emulation::Jump { target } => new.rip = target.0,
            Emulation::JumpIf { condition, target } => {
                if condition.holds(regs.rflags) {
                    new.rip = target.0;
                }
            }
            Emulation::Counted { kind, target } => {
                let zf = regs.rflags & rflags::ZF != 0;
                let taken = if kind == CountedBranch::JumpIfRcxZero {
                    regs.rcx == 0
                } else {
                    new.rcx = regs.rcx.wrapping_sub(1);
                    new.rcx != 0
                        && match kind {
                            CountedBranch::LoopIfEqual => zf,
                            CountedBranch::LoopIfNotEqual => !zf,
                            _ => true,
                        }
                };
                if taken {
                    new.rip = target.0;
                }
            }
            Emulation::Return { release } => {
                let at = regs.rsp;
                new.rip = stack.read_u64(Gva(at)).map_err(|m| stack_error(at, m))?;
                new.rsp = at.wrapping_add(8).wrapping_add(u64::from(release));
            }
            Emulation::DisableInterrupts => new.rflags &= !rflags::IF,
        }
        *regs = new;
        Ok(())
    }
}

/// `a op b` in 64 bits and the status flags it sets (CF, PF, AF, ZF, SF, OF).
fn arith_flags(op: ArithOp, a: u64, b: u64) -> (u64, u64) {
    let (result, carry, overflow) = match op {
        ArithOp::Add => {
            let (result, carry) = a.overflowing_add(b);
            // Signed overflow: both operands have the same sign and the result the other.
            (result, carry, ((a ^ result) & (b ^ result)) >> 63 != 0)
        }
        ArithOp::Sub => {
            let (result, borrow) = a.overflowing_sub(b);
            // Signed overflow: operands of different signs and the result's sign is b's.
            (result, borrow, ((a ^ b) & (a ^ result)) >> 63 != 0)
        }
    };
    let mut flags = 0;
    if carry {
        flags |= rflags::CF;
    }
    // PF: even number of set bits in the low byte only.
    if (result as u8).count_ones() & 1 == 0 {
        flags |= rflags::PF;
    }
    // AF: carry or borrow out of bit 3, visible as bit 4 of a ^ b ^ result.
    if (a ^ b ^ result) & 0x10 != 0 {
        flags |= rflags::AF;
    }
    if result == 0 {
        flags |= rflags::ZF;
    }
    if result >> 63 != 0 {
        flags |= rflags::SF;
    }
    if overflow {
        flags |= rflags::OF;
    }
    (result, flags)
}

/// `call rel32`.
const CALL_REL32: u8 = 0xe8;

/// What the host must do after one single-step of an out-of-line copy, as Linux's
/// `resume_singlestep` decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// Falls through: RIP = slot + len becomes addr + len.
    Plain,
    /// `pushf`: as Plain, and the pushed flags lose the TF our single-step set.
    PushFlags,
    /// `call r/m64`: RIP is the (absolute) target; the pushed return address slot + len
    /// becomes addr + len.
    IndirectCall,
    /// `jmp r/m64`: RIP is the absolute target, left alone.
    IndirectJump,
}

/// An instruction that runs as a single-stepped copy at a slot of the out-of-line area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfLine {
    pub kind: StepKind,
    /// Has a RIP-relative memory operand, whose displacement the copy re-targets.
    pub rip_relative: bool,
}

impl OutOfLine {
    /// The bytes to place at `slot` so that one step there does what `insn` does at its own
    /// address: the same bytes, with a RIP-relative displacement re-targeted so that it
    /// addresses the same absolute location from the slot.
    pub fn copy_for(&self, insn: &ProbedInsn, slot: Gva) -> Result<Vec<u8>, InsnError> {
        let mut copy = insn.bytes.clone();
        if insn.bytes.len() == 5 && insn.bytes[0] == CALL_REL32 {
            // A `call rel32` stepped as the fallback of its emulation: same target.
            let rel = i32::from_le_bytes([insn.bytes[1], insn.bytes[2], insn.bytes[3], insn.bytes[4]]);
            let target = insn.next_addr().0.wrapping_add_signed(i64::from(rel));
            let from_slot = target.wrapping_sub(slot.0.wrapping_add(5)) as i64;
            let rel = i32::try_from(from_slot).map_err(|_| InsnError::RipRelativeOutOfReach {
                addr: insn.addr,
                bytes: insn.hex(),
                target,
                slot,
            })?;
            copy[1..5].copy_from_slice(&rel.to_le_bytes());
            return Ok(copy);
        }
        if !self.rip_relative {
            return Ok(copy);
        }
        let mut decoder = decoder_at(&insn.bytes, insn.addr);
        let instruction = decoder.decode();
        let offsets = decoder.get_constant_offsets(&instruction);
        // In 64-bit mode a RIP-relative displacement is always 4 bytes.
        if !offsets.has_displacement() || offsets.displacement_size() != 4 {
            return Err(InsnError::Undecodable {
                addr: insn.addr,
                bytes: insn.hex(),
            });
        }
        let target = instruction.ip_rel_memory_address();
        let next_in_slot = slot.0.wrapping_add(insn.len as u64);
        let displacement = target.wrapping_sub(next_in_slot) as i64;
        let displacement = i32::try_from(displacement).map_err(|_| InsnError::RipRelativeOutOfReach {
            addr: insn.addr,
            bytes: insn.hex(),
            target,
            slot,
        })?;
        let at = offsets.displacement_offset();
        copy[at..at + 4].copy_from_slice(&displacement.to_le_bytes());
        Ok(copy)
    }

    /// Fix the registers and stack after one single-step of the copy of `insn` at `slot`.
    pub fn fixup_after_step(
        &self,
        insn: &ProbedInsn,
        slot: Gva,
        regs: &mut Regs,
        stack: &mut dyn StackAccess,
    ) -> Result<(), InsnError> {
        let after_copy = slot.0.wrapping_add(insn.len as u64);
        let unexpected_rip = |rip| InsnError::UnexpectedStepRip {
            addr: insn.addr,
            bytes: insn.hex(),
            slot,
            rip,
        };
        let stack_error = |at: u64, source: MemoryError| InsnError::Stack {
            addr: insn.addr,
            bytes: insn.hex(),
            at: Gva(at),
            source,
        };
        match self.kind {
            StepKind::Plain | StepKind::PushFlags => {
                if regs.rip != after_copy {
                    return Err(unexpected_rip(regs.rip));
                }
                if self.kind == StepKind::PushFlags {
                    // The guest kernel never runs with TF set itself; the TF in the pushed
                    // word is the one KVM set for our step, and a later popf would make the
                    // guest trap on every instruction.
                    let at = regs.rsp;
                    let flags = stack.read_u64(Gva(at)).map_err(|m| stack_error(at, m))?;
                    stack
                        .write_u64(Gva(at), flags & !rflags::TF)
                        .map_err(|m| stack_error(at, m))?;
                }
                regs.rip = insn.next_addr().0;
            }
            StepKind::IndirectCall => {
                let at = regs.rsp;
                let pushed = stack.read_u64(Gva(at)).map_err(|m| stack_error(at, m))?;
                if pushed != after_copy {
                    return Err(InsnError::UnexpectedReturnAddress {
                        addr: insn.addr,
                        bytes: insn.hex(),
                        slot,
                        found: pushed,
                    });
                }
                stack
                    .write_u64(Gva(at), insn.next_addr().0)
                    .map_err(|m| stack_error(at, m))?;
            }
            StepKind::IndirectJump => {}
        }
        Ok(())
    }
}

/// Decode the instruction at `addr` (`bytes` are the original bytes there, up to 15) and
/// decide how a probe hit executes it.
pub fn analyze(bytes: &[u8], addr: Gva) -> Result<ProbedInsn, InsnError> {
    let bytes = &bytes[..bytes.len().min(MAX_INSN_LEN)];
    let mut decoder = decoder_at(bytes, addr);
    let instruction = decoder.decode();
    if instruction.is_invalid() {
        // Undefined opcodes (including `into` and `pop ss`, invalid in 64-bit mode) land
        // here: with no instruction there is no length either, so this is an error rather
        // than a refusal.
        return Err(decode_error(&decoder, bytes, addr));
    }
    let len = instruction.len();
    let execution = match refusal(&instruction) {
        Some(reason) => Execution::Refuse(reason),
        None if instruction.flow_control() != FlowControl::Next && has_operand_size_prefix(bytes) => {
            // iced decodes as Intel does (66 ignored on near branches in 64-bit mode); AMD
            // CPUs make them 16-bit and truncate RIP. Compilers never emit them.
            Execution::Refuse("operand-size prefix on a branch: Intel and AMD disagree on its meaning")
        }
        None => match emulation(&instruction) {
            Some(emulation) => Execution::Emulate(emulation),
            None if has_relative_branch(&instruction) => {
                // A relative branch run elsewhere would branch relative to the elsewhere.
                Execution::Refuse(
                    "relative branch that is not emulated (16-bit or ECX forms, rep-prefixed loops, xbegin)",
                )
            }
            None => Execution::Step(OutOfLine {
                kind: step_kind(&instruction),
                rip_relative: instruction.is_ip_rel_memory_operand(),
            }),
        },
    };
    Ok(ProbedInsn {
        addr,
        len,
        bytes: bytes[..len].to_vec(),
        execution,
    })
}

/// Whether the legacy prefixes before the opcode include 0x66.
fn has_operand_size_prefix(bytes: &[u8]) -> bool {
    has_legacy_prefix(bytes, 0x66)
}

/// Whether the legacy prefixes before the opcode include `prefix`. A REX byte that a legacy
/// prefix follows is ignored by the CPU (`48 66 eb 00` is a 66-prefixed jmp), so the scan
/// goes on past REX bytes too.
pub fn has_legacy_prefix(bytes: &[u8], prefix: u8) -> bool {
    bytes
        .iter()
        .take_while(|b| {
            matches!(
                b,
                0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3 | 0x40..=0x4f
            )
        })
        .any(|&b| b == prefix)
}

fn has_relative_branch(instruction: &Instruction) -> bool {
    (0..instruction.op_count()).any(|i| {
        matches!(
            instruction.op_kind(i),
            OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
        )
    })
}

/// Whether `bytes` start with a `rep`-prefixed string instruction (which traps after each
/// iteration with RIP still on it).
pub fn is_rep_string(bytes: &[u8]) -> bool {
    let mut decoder = decoder_at(bytes, Gva(0));
    let instruction = decoder.decode();
    !instruction.is_invalid()
        && instruction.is_string_instruction()
        && (instruction.has_rep_prefix() || instruction.has_repne_prefix())
}

/// Why an instruction must not be probed, if it must not.
fn refusal(instruction: &Instruction) -> Option<&'static str> {
    if instruction.is_jmp_far()
        || instruction.is_call_far()
        || instruction.is_jmp_far_indirect()
        || instruction.is_call_far_indirect()
        || instruction.mnemonic() == Mnemonic::Retf
    {
        return Some("far transfer: loads CS, which neither emulation nor a copy handles");
    }
    if instruction.mnemonic() == Mnemonic::Mov
        && instruction.op0_kind() == OpKind::Register
        && instruction.op0_register() == Register::SS
    {
        return Some("mov to SS blocks debug exceptions for the next instruction: the step would run past the copy");
    }
    // A step runs one iteration of a `rep` string instruction: stepping it through would
    // take one exit per iteration with the vCPU's interrupts off, as many as the guest's
    // RCX says (a 1 MiB `rep movsb` is a million exits, seconds of a guest that takes no
    // interrupt). Bounded by refusing it.
    if instruction.is_string_instruction() && (instruction.has_rep_prefix() || instruction.has_repne_prefix()) {
        return Some(
            "rep-prefixed string instruction: a single-step runs one iteration, so its probe would take an exit \
             per iteration, as many as the guest's RCX says, with the vCPU's interrupts off; probe the \
             instruction before or after it",
        );
    }
    Some(match instruction.mnemonic() {
        Mnemonic::Int3 | Mnemonic::Int | Mnemonic::Int1 | Mnemonic::Into => {
            "raises an exception on purpose: the guest's handler expects the original address"
        }
        Mnemonic::Iret | Mnemonic::Iretd | Mnemonic::Iretq => "returns through an interrupt frame",
        Mnemonic::Syscall
        | Mnemonic::Sysret
        | Mnemonic::Sysretq
        | Mnemonic::Sysenter
        | Mnemonic::Sysexit
        | Mnemonic::Sysexitq => "changes privilege level",
        Mnemonic::Hlt | Mnemonic::Mwait | Mnemonic::Mwaitx | Mnemonic::Umwait | Mnemonic::Tpause => {
            "waits for an interrupt, which BLOCKIRQ withholds while we step"
        }
        Mnemonic::Ud0 | Mnemonic::Ud1 | Mnemonic::Ud2 => {
            "raises #UD on purpose (BUG/WARN sites): the guest's handler matches the trapping address"
        }
        // popf can set TF, which collides with the TF KVM owns while stepping, and sets IF,
        // whose change we would have to reproduce exactly; Linux emulates it, we refuse it.
        Mnemonic::Popf | Mnemonic::Popfd | Mnemonic::Popfq => {
            "pop of RFLAGS can change TF and IF under the single-step"
        }
        // sti opens an interrupt shadow for the next instruction; stepping it leaves the
        // shadow pending on the copy's successor (VMX also rejects a VM entry with STI
        // blocking and TF set without a pending BS), and emulating it would lose the shadow.
        Mnemonic::Sti => "sti's interrupt shadow cannot be carried across a step or emulated",
        // While a copy runs, the IDTR holds the step guard's IDT (engine::step_guard).
        Mnemonic::Sidt | Mnemonic::Lidt => "reads or loads the IDTR, which an out-of-line step points elsewhere",
        _ => return None,
    })
}

/// The emulation of an instruction the host performs itself, if it is one of those.
fn emulation(instruction: &Instruction) -> Option<Emulation> {
    let gpr = |operand: u32| {
        if instruction.op_kind(operand) == OpKind::Register {
            Gpr::containing(instruction.op_register(operand))
        } else {
            None
        }
    };
    let target = || Gva(instruction.near_branch_target());
    Some(match instruction.code() {
        _ if instruction.mnemonic() == Mnemonic::Nop || instruction.mnemonic() == Mnemonic::Endbr64 => Emulation::Nop,
        Code::Xchg_rm16_r16 | Code::Xchg_rm64_r64 | Code::Xchg_r16_AX | Code::Xchg_r64_RAX
            if gpr(0).is_some() && instruction.op0_register() == instruction.op1_register() =>
        {
            Emulation::Nop
        }
        Code::Xchg_rm32_r32 | Code::Xchg_r32_EAX
            if gpr(0).is_some() && instruction.op0_register() == instruction.op1_register() =>
        {
            let reg = gpr(0)?;
            Emulation::Move {
                dst: reg,
                src: reg,
                zero_extend: true,
            }
        }
        Code::Push_r64 => Emulation::Push { src: gpr(0)? },
        Code::Pop_r64 => Emulation::Pop { dst: gpr(0)? },
        Code::Mov_rm64_r64 | Code::Mov_r64_rm64 => Emulation::Move {
            dst: gpr(0)?,
            src: gpr(1)?,
            zero_extend: false,
        },
        Code::Mov_rm32_r32 | Code::Mov_r32_rm32 => Emulation::Move {
            dst: gpr(0)?,
            src: gpr(1)?,
            zero_extend: true,
        },
        // iced gives the immediate as the register receives it: imm32 zero-extended for
        // the 32-bit forms, sign-extended for `mov r/m64, imm32`.
        Code::Mov_r32_imm32 | Code::Mov_rm32_imm32 => Emulation::LoadImmediate {
            dst: gpr(0)?,
            value: instruction.immediate(1) & 0xffff_ffff,
        },
        Code::Mov_r64_imm64 | Code::Mov_rm64_imm32 => Emulation::LoadImmediate {
            dst: gpr(0)?,
            value: instruction.immediate(1),
        },
        Code::Add_rm64_imm8 | Code::Add_rm64_imm32 | Code::Add_RAX_imm32 => Emulation::ArithImm {
            op: ArithOp::Add,
            dst: gpr(0)?,
            imm: instruction.immediate(1),
        },
        Code::Sub_rm64_imm8 | Code::Sub_rm64_imm32 | Code::Sub_RAX_imm32 => Emulation::ArithImm {
            op: ArithOp::Sub,
            dst: gpr(0)?,
            imm: instruction.immediate(1),
        },
        Code::Lea_r64_m => {
            let dst = gpr(0)?;
            let base = instruction.memory_base();
            let index = instruction.memory_index();
            if base == Register::RIP {
                // memory_displacement64() is already the absolute address for RIP-relative.
                Emulation::LoadAddress {
                    dst,
                    base: None,
                    index: None,
                    disp: instruction.memory_displacement64(),
                }
            } else {
                // Only 64-bit address size: a 67-prefixed lea truncates, leave it to a step.
                let base = match base {
                    Register::None => None,
                    b if b.is_gpr64() => Some(Gpr::containing(b)?),
                    _ => return None,
                };
                let index = match index {
                    Register::None => None,
                    i if i.is_gpr64() => Some((Gpr::containing(i)?, instruction.memory_index_scale())),
                    _ => return None,
                };
                Emulation::LoadAddress {
                    dst,
                    base,
                    index,
                    disp: instruction.memory_displacement64(),
                }
            }
        }
        Code::Xor_rm32_r32 | Code::Xor_r32_rm32 | Code::Xor_rm64_r64 | Code::Xor_r64_rm64
            if gpr(1).is_some() && instruction.op0_register() == instruction.op1_register() =>
        {
            Emulation::Zero { dst: gpr(0)? }
        }
        Code::Call_rel32_64 => Emulation::Call { target: target() },
        Code::Jmp_rel8_64 | Code::Jmp_rel32_64 => Emulation::Jump { target: target() },
        _ if instruction.is_jcc_short_or_near() && instruction.op0_kind() == OpKind::NearBranch64 => {
            Emulation::JumpIf {
                condition: Condition::from_iced(instruction.condition_code())?,
                target: target(),
            }
        }
        // A REP/REPNE prefix changes which ZF the CPU tests (on AMD `f3 loopne` runs as
        // loope, `f2 loope` as loopne): compilers never emit it, and no one emulation fits.
        Code::Loop_rel8_64_RCX | Code::Loope_rel8_64_RCX | Code::Loopne_rel8_64_RCX | Code::Jrcxz_rel8_64
            if instruction.has_rep_prefix() || instruction.has_repne_prefix() =>
        {
            return None
        }
        Code::Loop_rel8_64_RCX => Emulation::Counted {
            kind: CountedBranch::Loop,
            target: target(),
        },
        Code::Loope_rel8_64_RCX => Emulation::Counted {
            kind: CountedBranch::LoopIfEqual,
            target: target(),
        },
        Code::Loopne_rel8_64_RCX => Emulation::Counted {
            kind: CountedBranch::LoopIfNotEqual,
            target: target(),
        },
        Code::Jrcxz_rel8_64 => Emulation::Counted {
            kind: CountedBranch::JumpIfRcxZero,
            target: target(),
        },
        Code::Retnq => Emulation::Return { release: 0 },
        Code::Cli => Emulation::DisableInterrupts,
        Code::Retnq_imm16 => Emulation::Return {
            release: instruction.immediate16(),
        },
        _ => return None,
    })
}

/// The fix-up a stepped instruction needs (Linux's `resume_singlestep` cases).
fn step_kind(instruction: &Instruction) -> StepKind {
    match instruction.flow_control() {
        // `call r/m` (including `notrack call`): the CPU pushed the copy's return address.
        FlowControl::IndirectCall => return StepKind::IndirectCall,
        // `jmp r/m` (including `notrack jmp`), and the `ret` forms we do not emulate
        // (16-bit `66 c3`): RIP is absolute already.
        FlowControl::IndirectBranch | FlowControl::Return => return StepKind::IndirectJump,
        _ => {}
    }
    if matches!(
        instruction.mnemonic(),
        Mnemonic::Pushf | Mnemonic::Pushfd | Mnemonic::Pushfq
    ) {
        return StepKind::PushFlags;
    }
    StepKind::Plain
}

#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
#[cfg(test)]
mod tests;
