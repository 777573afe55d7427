//! The displaced instructions made to run in the detour, and the jumps in and out.
//!
//! Each displaced instruction keeps its meaning at its new address: one without anything
//! relative in it is copied byte for byte; one with a RIP-relative operand gets its
//! displacement re-targeted (the fix-up the out-of-line copies of classic probes use); a
//! relative `jmp`/`jcc` is re-encoded by iced's block encoder (a short jcc becomes a near one).
//! Each instruction is encoded on its own, so that a branch back to the region's first byte
//! still goes to the original address (and so through the probe again), not to its copy.
//! Every re-encoded instruction is decoded again and checked to reach the same absolute
//! targets before it is used.

use hvprobe_arch::Gva;
use iced_x86::{BlockEncoder, BlockEncoderOptions, Decoder, DecoderOptions, Instruction, InstructionBlock};

use super::{disassemble, near_branch_target, DetourRegion, DisplacedInsn, NotOptimizable, JMP_REL32, JMP_REL32_LEN};
use hvprobe_insn::{Execution, InsnError, OutOfLine, ProbedInsn, StepKind, MAX_INSN_LEN};

/// `e9 rel32` at `from`, jumping to `to`; `None` when `to` is out of rel32 reach.
pub fn jump_bytes(from: Gva, to: Gva) -> Option<[u8; JMP_REL32_LEN]> {
    let next = from.0.wrapping_add(JMP_REL32_LEN as u64);
    let rel = i32::try_from(to.0.wrapping_sub(next) as i64).ok()?.to_le_bytes();
    Some([JMP_REL32, rel[0], rel[1], rel[2], rel[3]])
}

/// The displaced instructions of `region` re-encoded to run from `new_ip`, followed by a
/// `jmp rel32` to `return_to` (normally [`DetourRegion::end`]). Refused when a RIP-relative
/// operand, a branch target or `return_to` is out of rel32 reach of the new code.
pub fn relocate(region: &DetourRegion, new_ip: Gva, return_to: Gva) -> Result<Vec<u8>, NotOptimizable> {
    let mut out = Vec::new();
    for insn in region.instructions() {
        let rip = Gva(new_ip.0.wrapping_add(out.len() as u64));
        let piece = relocate_one(insn, rip)?;
        verify(insn, &piece, rip)?;
        out.extend_from_slice(&piece);
    }
    let from = Gva(new_ip.0.wrapping_add(out.len() as u64));
    let back = jump_bytes(from, return_to).ok_or(NotOptimizable::ReturnOutOfReach { from, to: return_to })?;
    out.extend_from_slice(&back);
    Ok(out)
}

/// Whether an instruction starting at `rip` (and so ending at most 15 bytes later) reaches
/// `target` with a rel32.
fn reaches(rip: Gva, target: Gva) -> bool {
    let fits = |from: u64| i32::try_from(target.0.wrapping_sub(from) as i64).is_ok();
    fits(rip.0) && fits(rip.0.wrapping_add(MAX_INSN_LEN as u64))
}

fn relocate_one(insn: &DisplacedInsn, rip: Gva) -> Result<Vec<u8>, NotOptimizable> {
    let decoded = &insn.decoded;
    if let Some(target) = near_branch_target(decoded) {
        if !reaches(rip, target) {
            return Err(NotOptimizable::BranchOutOfReach {
                at: insn.addr,
                target,
                new_ip: rip,
            });
        }
        // The block encoder sends a branch to an instruction of its own block to that
        // instruction's new copy. Alone in its block, only a branch to itself (`jmp $` at the
        // probe) could be one: its IP is cleared so that it too keeps its original target.
        let mut alone = *decoded;
        alone.set_ip(0);
        let block = InstructionBlock::new(std::slice::from_ref(&alone), rip.0);
        let encoded =
            BlockEncoder::encode(64, block, BlockEncoderOptions::NONE).map_err(|e| NotOptimizable::Reencode {
                at: insn.addr,
                new_ip: rip,
                message: e.to_string(),
            })?;
        return Ok(encoded.code_buffer);
    }
    if decoded.is_ip_rel_memory_operand() {
        let target = Gva(decoded.ip_rel_memory_address());
        let out_of_reach = NotOptimizable::RipRelativeOutOfReach {
            at: insn.addr,
            target,
            new_ip: rip,
        };
        if !reaches(rip, target) {
            return Err(out_of_reach);
        }
        let copy = OutOfLine {
            kind: StepKind::Plain,
            rip_relative: true,
        };
        let probed = ProbedInsn {
            addr: insn.addr,
            len: insn.bytes.len(),
            bytes: insn.bytes.clone(),
            execution: Execution::Step(copy),
        };
        return copy.copy_for(&probed, rip).map_err(|e| match e {
            InsnError::RipRelativeOutOfReach { .. } => out_of_reach,
            other => NotOptimizable::Reencode {
                at: insn.addr,
                new_ip: rip,
                message: other.to_string(),
            },
        });
    }
    Ok(insn.bytes.clone())
}

/// Checks that `piece`, at `rip`, is one instruction doing what `insn` does at its address:
/// the same mnemonic, the same absolute branch or memory target, and otherwise the same bytes.
pub(super) fn verify(insn: &DisplacedInsn, piece: &[u8], rip: Gva) -> Result<(), NotOptimizable> {
    let mut decoder = Decoder::with_ip(64, piece, rip.0, DecoderOptions::NONE);
    let relocated: Instruction = decoder.decode();
    let original = &insn.decoded;
    let same = !relocated.is_invalid()
        && relocated.len() == piece.len()
        && relocated.mnemonic() == original.mnemonic()
        && near_branch_target(&relocated) == near_branch_target(original)
        && relocated.is_ip_rel_memory_operand() == original.is_ip_rel_memory_operand()
        && (!original.is_ip_rel_memory_operand()
            || relocated.ip_rel_memory_address() == original.ip_rel_memory_address())
        && (near_branch_target(original).is_some() || original.is_ip_rel_memory_operand() || piece == insn.bytes);
    if same {
        Ok(())
    } else {
        Err(NotOptimizable::RelocationMismatch {
            at: insn.addr,
            new_ip: rip,
            relocated: disassemble(&relocated),
        })
    }
}
