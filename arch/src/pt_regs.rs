//! The x86-64 `struct pt_regs`: the registers a probe hit sees, in the guest kernel's
//! terms, and the names Linux's probe events give them.

/// The registers `%REG` may name on x86-64: exactly the `struct pt_regs` fields the
/// kernel's `regs_query_register_offset` knows, spelled as it spells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Register {
    R15,
    R14,
    R13,
    R12,
    Bp,
    Bx,
    R11,
    R10,
    R9,
    R8,
    Ax,
    Cx,
    Dx,
    Si,
    Di,
    OrigAx,
    Ip,
    Cs,
    Flags,
    Sp,
    Ss,
}

impl std::fmt::Display for Register {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Register {
    /// Every register, in `struct pt_regs` order.
    pub const ALL: [Register; 21] = [
        Register::R15,
        Register::R14,
        Register::R13,
        Register::R12,
        Register::Bp,
        Register::Bx,
        Register::R11,
        Register::R10,
        Register::R9,
        Register::R8,
        Register::Ax,
        Register::Cx,
        Register::Dx,
        Register::Si,
        Register::Di,
        Register::OrigAx,
        Register::Ip,
        Register::Cs,
        Register::Flags,
        Register::Sp,
        Register::Ss,
    ];

    /// The name after `%`.
    pub const fn name(self) -> &'static str {
        match self {
            Register::R15 => "r15",
            Register::R14 => "r14",
            Register::R13 => "r13",
            Register::R12 => "r12",
            Register::Bp => "bp",
            Register::Bx => "bx",
            Register::R11 => "r11",
            Register::R10 => "r10",
            Register::R9 => "r9",
            Register::R8 => "r8",
            Register::Ax => "ax",
            Register::Cx => "cx",
            Register::Dx => "dx",
            Register::Si => "si",
            Register::Di => "di",
            Register::OrigAx => "orig_ax",
            Register::Ip => "ip",
            Register::Cs => "cs",
            Register::Flags => "flags",
            Register::Sp => "sp",
            Register::Ss => "ss",
        }
    }

    /// The byte offset of this register in the x86-64 `struct pt_regs`.
    pub const fn pt_regs_offset(self) -> usize {
        8 * self as usize
    }

    /// The register named `name` (without `%`), as the kernel matches it (case-sensitive).
    pub fn from_name(name: &str) -> Option<Register> {
        Register::ALL.into_iter().find(|r| r.name() == name)
    }
}

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
