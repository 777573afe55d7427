//! The registers of a vCPU at a probe hit, in the guest kernel's `struct pt_regs` terms.

use crate::spec::Register;

/// General-purpose registers, RIP, RFLAGS and the segment selectors a handler sees and may
/// change. The engine loads them from the vCPU at a hit and writes back what changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub rbp: u64,
    pub rbx: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rax: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

/// `orig_ax` outside a system call, as the kernel's int3 entry leaves it.
pub const NO_ORIG_AX: u64 = u64::MAX;

impl Regs {
    /// The value `%REG` names.
    pub fn get(&self, reg: Register) -> u64 {
        match reg {
            Register::R15 => self.r15,
            Register::R14 => self.r14,
            Register::R13 => self.r13,
            Register::R12 => self.r12,
            Register::Bp => self.rbp,
            Register::Bx => self.rbx,
            Register::R11 => self.r11,
            Register::R10 => self.r10,
            Register::R9 => self.r9,
            Register::R8 => self.r8,
            Register::Ax => self.rax,
            Register::Cx => self.rcx,
            Register::Dx => self.rdx,
            Register::Si => self.rsi,
            Register::Di => self.rdi,
            Register::OrigAx => NO_ORIG_AX,
            Register::Ip => self.rip,
            Register::Cs => self.cs,
            Register::Flags => self.rflags,
            Register::Sp => self.rsp,
            Register::Ss => self.ss,
        }
    }

    /// The Nth integer argument (from 1) of the x86-64 calling convention: rdi, rsi, rdx,
    /// rcx, r8, r9, then the stack above the return address (at a function's entry).
    pub fn arg_register(&self, n: u32) -> Option<u64> {
        Some(match n {
            1 => self.rdi,
            2 => self.rsi,
            3 => self.rdx,
            4 => self.rcx,
            5 => self.r8,
            6 => self.r9,
            _ => return None,
        })
    }
}
