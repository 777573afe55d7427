//! Which instructions may run displaced, in the detour, with a jump back after them.
//!
//! The rule is Linux's `can_boost()` (arch/x86/kernel/kprobes/core.c), which decides the
//! same question for its optprobes' copied instructions, with one extension: relative `jmp`
//! and `jcc` are allowed, because [`relocate`](super::relocate) re-encodes them for the
//! detour with iced (Linux copies bytes and cannot). Linux's opcode tables are followed as
//! they are, including their conservative parts (the opcode-extension groups, most SSE
//! opcodes): a refused instruction still gets a classic int3 probe. Where iced names an
//! instruction more precisely than Linux's byte tables, a few refusals are added: `sti` and
//! `mov ss` (their interrupt shadow would cover the jump back instead of the next
//! instruction), far and privilege-changing transfers, and VEX/EVEX/XOP encodings (Linux's
//! tables treat those by accident of their opcode byte; kernel code uses them only inside
//! FPU sections).

use std::fmt;

use iced_x86::{Code, EncodingKind, FlowControl, Instruction, Mnemonic, OpCodeTableKind, OpKind, Register};

use hvprobe_insn::has_legacy_prefix;

/// Why an instruction cannot run displaced in a detour.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Undisplaceable {
    /// Any near call, direct or indirect.
    Call,
    /// int3, `int n`, int1, into, ud0/ud1/ud2.
    Trap,
    /// `jmp r/m` (refused for the whole function anyway).
    IndirectJump,
    /// Far jumps, calls and returns, `iret`, `syscall`/`sysret`, `sysenter`/`sysexit`, and
    /// the other privilege-changing transfers.
    FarOrPrivileged,
    /// `loop`, `loope`, `loopne`, `jrcxz`: rel8 only (Linux refuses them too).
    CountedBranch,
    /// `xbegin`, `xabort`, `xend`.
    Transactional,
    /// An operand-size prefix on a branch.
    BranchOperandSize,
    /// An address-size prefix (0x67).
    AddressSizePrefix,
    /// A CS segment prefix (0x2e) on a one-byte opcode.
    CsPrefix,
    /// `endbr64`/`endbr32`.
    Endbr,
    /// `sti`, `mov ss`.
    InterruptShadow,
    /// A VEX, EVEX, XOP or 3DNow! encoding.
    VectorEncoding,
    /// An opcode Linux's `can_boost()` refuses (its bytes, e.g. `0f a2`).
    NotBoostable { opcode: String },
}

impl fmt::Display for Undisplaceable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Undisplaceable::Call => f.write_str(
                "a call: the callee would return into the detour, which would then have to outlive every task \
                 sleeping below it",
            ),
            Undisplaceable::Trap => f.write_str(
                "it raises an exception on purpose, and the guest's handler looks up the address, which would be \
                 the detour's",
            ),
            Undisplaceable::IndirectJump => f.write_str("an indirect jump"),
            Undisplaceable::FarOrPrivileged => f.write_str("a far or privilege-changing transfer"),
            Undisplaceable::CountedBranch => {
                f.write_str("loop/jrcxz have an 8-bit displacement only, which cannot reach back from the detour")
            }
            Undisplaceable::Transactional => {
                f.write_str("transactional memory: an abort resumes at an address relative to the instruction")
            }
            Undisplaceable::BranchOperandSize => {
                f.write_str("an operand-size prefix on a branch: Intel and AMD disagree on what it means")
            }
            Undisplaceable::AddressSizePrefix => f.write_str("an address-size prefix, which Linux's can_boost refuses"),
            Undisplaceable::CsPrefix => {
                f.write_str("a CS prefix on a one-byte opcode, which Linux's can_boost refuses")
            }
            Undisplaceable::Endbr => f.write_str(
                "indirect branches must land on an endbr64 under IBT, and they would land on the jump instead",
            ),
            Undisplaceable::InterruptShadow => f.write_str(
                "its interrupt shadow would cover the jump back instead of the instruction after it (sti; hlt)",
            ),
            Undisplaceable::VectorEncoding => f.write_str("a VEX/EVEX/XOP-encoded instruction"),
            Undisplaceable::NotBoostable { opcode } => {
                write!(f, "opcode {opcode} is not one Linux's can_boost lets run out of line")
            }
        }
    }
}

/// Whether `instruction` (whose bytes are `bytes`) can run displaced, with a jump back after it.
pub(super) fn check(instruction: &Instruction, bytes: &[u8]) -> Result<(), Undisplaceable> {
    match instruction.mnemonic() {
        Mnemonic::Endbr64 | Mnemonic::Endbr32 => return Err(Undisplaceable::Endbr),
        Mnemonic::Sti => return Err(Undisplaceable::InterruptShadow),
        Mnemonic::Mov if instruction.op0_kind() == OpKind::Register && instruction.op0_register() == Register::SS => {
            return Err(Undisplaceable::InterruptShadow)
        }
        _ => {}
    }
    if instruction.is_jmp_far()
        || instruction.is_jmp_far_indirect()
        || instruction.is_call_far()
        || instruction.is_call_far_indirect()
    {
        return Err(Undisplaceable::FarOrPrivileged);
    }
    match instruction.flow_control() {
        FlowControl::Call | FlowControl::IndirectCall => {
            return Err(if instruction.is_call_near() || instruction.is_call_near_indirect() {
                Undisplaceable::Call
            } else {
                // syscall, sysenter, vmcall, vmlaunch, ...
                Undisplaceable::FarOrPrivileged
            });
        }
        FlowControl::Interrupt | FlowControl::Exception => return Err(Undisplaceable::Trap),
        FlowControl::IndirectBranch => return Err(Undisplaceable::IndirectJump),
        FlowControl::XbeginXabortXend => return Err(Undisplaceable::Transactional),
        FlowControl::Return => match instruction.code() {
            Code::Retnq | Code::Retnq_imm16 => {}
            Code::Retnw | Code::Retnw_imm16 => return Err(Undisplaceable::BranchOperandSize),
            // retf, iret, sysret, sysexit, ...
            _ => return Err(Undisplaceable::FarOrPrivileged),
        },
        FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch => {
            if matches!(
                instruction.mnemonic(),
                Mnemonic::Loop
                    | Mnemonic::Loope
                    | Mnemonic::Loopne
                    | Mnemonic::Jrcxz
                    | Mnemonic::Jecxz
                    | Mnemonic::Jcxz
            ) {
                return Err(Undisplaceable::CountedBranch);
            }
            if has_legacy_prefix(bytes, 0x66) {
                return Err(Undisplaceable::BranchOperandSize);
            }
            if has_legacy_prefix(bytes, 0x67) {
                return Err(Undisplaceable::AddressSizePrefix);
            }
            // A relative jmp/jcc: re-encoded for the detour.
            return Ok(());
        }
        FlowControl::Next => {}
    }
    if has_legacy_prefix(bytes, 0x67) {
        return Err(Undisplaceable::AddressSizePrefix);
    }
    let op_code = instruction.op_code();
    if op_code.encoding() != EncodingKind::Legacy {
        return Err(Undisplaceable::VectorEncoding);
    }
    // The first opcode byte after the escape bytes (iced appends a ModRM-selected byte to
    // some opcodes, `0f 01 f8` is 0x01f8: Linux's tables look at the 0x01).
    let len = op_code.op_code_len().max(1);
    let first = (op_code.op_code() >> (8 * (len - 1))) & 0xff;
    let refused = |opcode: String| Err(Undisplaceable::NotBoostable { opcode });
    match op_code.table() {
        OpCodeTableKind::Normal => {
            if has_legacy_prefix(bytes, 0x2e) {
                return Err(Undisplaceable::CsPrefix);
            }
            if one_byte_refused(first) {
                return refused(format!("{first:02x}"));
            }
        }
        OpCodeTableKind::T0F => {
            if two_byte_refused(first) {
                return refused(format!("0f {first:02x}"));
            }
        }
        // Linux boosts one- and two-byte opcodes only.
        OpCodeTableKind::T0F38 => return refused(format!("0f 38 {first:02x}")),
        OpCodeTableKind::T0F3A => return refused(format!("0f 3a {first:02x}")),
        _ => return Err(Undisplaceable::VectorEncoding),
    }
    Ok(())
}

/// The one-byte opcodes `can_boost()` refuses: bound, jcc, far call, group 2 (shifts),
/// int3/int/into, salc, x87, loop/jrcxz, call/jmp, hlt and int1, group 3 (test/not/neg/mul/
/// div), group 4 (inc/dec r/m8), group 5 except `jmp r/m` (which is refused anyway). The
/// branches among them are decided before this table is looked at.
fn one_byte_refused(opcode: u32) -> bool {
    matches!(
        opcode,
        0x62 | 0x70..=0x7f
            | 0x9a
            | 0xc0..=0xc1
            | 0xcc..=0xce
            | 0xd0..=0xd3
            | 0xd6
            | 0xd8..=0xdf
            | 0xe0..=0xe3
            | 0xe8..=0xe9
            | 0xeb
            | 0xf0..=0xf4
            | 0xf6..=0xf7
            | 0xfe..=0xff
    )
}

/// The `0f xx` opcodes `can_boost()` refuses (the zero bits of its `twobyte_is_boostable`):
/// system groups 6/7 (`lgdt`, `swapgs`, `clac`, `mwait`, ...), syscall/sysret, ud2,
/// prefetches, SSE moves and conversions, `endbr64`'s `0f 1e`, wrmsr/rdmsr/rdpmc/sysenter,
/// most SSE arithmetic, VMX `vmread`/`vmwrite`, near jcc, cpuid, rsm, group 15 (fences,
/// `clflush`, `xsave`), popcnt and group 8, group 9 (`cmpxchg16b`, `rdrand`), ud0/ud1.
fn two_byte_refused(opcode: u32) -> bool {
    matches!(
        opcode,
        0x00 | 0x01
            | 0x04
            | 0x05
            | 0x07
            | 0x0a..=0x1e
            | 0x24..=0x30
            | 0x32..=0x3f
            | 0x50..=0x5f
            | 0x6c..=0x6d
            | 0x70..=0x73
            | 0x78..=0x7d
            | 0x80..=0x8f
            | 0xa2
            | 0xa6..=0xa7
            | 0xaa
            | 0xae
            | 0xb8..=0xba
            | 0xc2..=0xc7
            | 0xd0
            | 0xd4
            | 0xd6..=0xd7
            | 0xda
            | 0xde
            | 0xe0
            | 0xe3..=0xe4
            | 0xe6..=0xe7
            | 0xea
            | 0xee
            | 0xf0
            | 0xf4
            | 0xf6..=0xf7
            | 0xfb
            | 0xff
    )
}
