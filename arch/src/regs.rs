//! Bits of the x86-64 flags and control registers that more than one crate reads or sets
//! (Intel SDM vol. 3A, 2.3 and 2.5; AMD APM vol. 2, 3.1).

/// RFLAGS.
pub mod rflags {
    pub const CF: u64 = 1 << 0;
    pub const PF: u64 = 1 << 2;
    pub const AF: u64 = 1 << 4;
    pub const ZF: u64 = 1 << 6;
    pub const SF: u64 = 1 << 7;
    /// The trap flag: a debug trap after the next instruction.
    pub const TF: u64 = 1 << 8;
    /// The interrupt flag.
    pub const IF: u64 = 1 << 9;
    pub const OF: u64 = 1 << 11;
    pub const NT: u64 = 1 << 14;
    pub const RF: u64 = 1 << 16;
    pub const VM: u64 = 1 << 17;
    /// The status flags an arithmetic instruction writes; the others (TF, IF, DF, ...)
    /// survive it.
    pub const STATUS: u64 = CF | PF | AF | ZF | SF | OF;
}

/// The EFER MSR.
pub mod efer {
    /// Long mode enabled (set by software).
    pub const LME: u64 = 1 << 8;
    /// Long mode active (set by the CPU once paging is on).
    pub const LMA: u64 = 1 << 10;
    /// No-execute enabled: page-table entries' bit 63 means NX (reserved otherwise).
    pub const NXE: u64 = 1 << 11;
}

/// CR0.
pub mod cr0 {
    pub const PE: u64 = 1 << 0;
    pub const ET: u64 = 1 << 4;
    pub const PG: u64 = 1 << 31;
}

/// CR4.
pub mod cr4 {
    pub const PAE: u64 = 1 << 5;
}
