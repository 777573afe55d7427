//! A test fixture (the `test-support` feature): what the instruction layer's unit tests
//! and its fuzz target (`fuzz/fuzz_targets/insn.rs`) share; nothing else uses it.

use crate::Gpr;

/// The 16 GPRs in their hardware numbering (`rax` 0 … `r15` 15), the order of an
/// instruction's register fields.
pub const ALL_GPRS: [Gpr; 16] = [
    Gpr::Rax,
    Gpr::Rcx,
    Gpr::Rdx,
    Gpr::Rbx,
    Gpr::Rsp,
    Gpr::Rbp,
    Gpr::Rsi,
    Gpr::Rdi,
    Gpr::R8,
    Gpr::R9,
    Gpr::R10,
    Gpr::R11,
    Gpr::R12,
    Gpr::R13,
    Gpr::R14,
    Gpr::R15,
];
