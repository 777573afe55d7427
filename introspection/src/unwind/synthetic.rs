//! A test fixture (the `test-support` feature): a made-up kernel for the ORC walk — text
//! with five functions, their ORC entries laid out as the kernel's tables are, a task
//! stack and an IRQ stack, and three call frames on the task stack. For the walk's unit
//! tests and its fuzz target (`fuzz/fuzz_targets/guest_unwind.rs`, which patches the
//! tables and stacks as a hostile guest kernel would); nothing else uses it.

use hvprobe_arch::Gva;

use super::{reg, StackBounds, StartRegs};

pub const TEXT: u64 = 0xffff_ffff_8100_0000;
/// Where the kernel's `.orc_unwind_ip` (self-relative addresses) starts.
pub const IP_TABLE: u64 = TEXT + 0x10_0000;
pub const TASK_STACK: u64 = 0xffff_c900_0000_0000;
pub const IRQ_STACK: u64 = 0xffff_c900_0010_0000;
pub const STACK_SIZE: u64 = 0x4000;

// The functions: leaf (probed, at +0 the return address is at sp), mid (pushed rbp: the
// caller's sp is 16 above), top (a kernel thread's first function: `end`), an interrupt
// entry that saved full pt_regs, a switch to the IRQ stack, and code whose ORC entry is
// undefined.
pub const LEAF: u64 = TEXT + 0x100;
pub const MID: u64 = TEXT + 0x200;
pub const TOP: u64 = TEXT + 0x300;
pub const IRQ_ENTRY: u64 = TEXT + 0x400;
pub const SWITCHER: u64 = TEXT + 0x500;
pub const UNDEFINED_AFTER: u64 = TEXT + 0x600;

/// An ORC entry of Linux 6.1: sp_offset, bp_offset (s16 each), then type/regs/end bits.
pub fn entry(sp_reg: u8, sp_offset: i16, bp_reg: u8, bp_offset: i16, kind: u16, end: bool) -> [u8; 6] {
    let bits = u16::from(sp_reg) | (u16::from(bp_reg) << 4) | (kind << 8) | (u16::from(end) << 10);
    let mut b = [0u8; 6];
    b[0..2].copy_from_slice(&sp_offset.to_le_bytes());
    b[2..4].copy_from_slice(&bp_offset.to_le_bytes());
    b[4..6].copy_from_slice(&bits.to_le_bytes());
    b
}

/// The ORC rows of the kernel's functions, [`LEAF`] to [`UNDEFINED_AFTER`].
pub fn kernel_rows() -> Vec<(u64, [u8; 6])> {
    vec![
        (LEAF, entry(reg::SP, 8, reg::UNDEFINED, 0, 0, false)),
        (MID, entry(reg::SP, 16, reg::PREV_SP, -16, 0, false)),
        (TOP, entry(reg::UNDEFINED, 0, reg::UNDEFINED, 0, 0, true)),
        (IRQ_ENTRY, entry(reg::SP, 0, reg::UNDEFINED, 0, 1, false)),
        // Switched to the IRQ stack: the interrupted stack pointer is the word at sp.
        (SWITCHER, entry(reg::SP_INDIRECT, 8, reg::UNDEFINED, 0, 0, false)),
        (UNDEFINED_AFTER, entry(reg::UNDEFINED, 0, reg::UNDEFINED, 0, 0, false)),
    ]
}

/// The bytes of `.orc_unwind_ip` (at [`IP_TABLE`], each address relative to its own
/// slot) and `.orc_unwind` for (address, entry) rows.
pub fn tables(rows: &[(u64, [u8; 6])]) -> (Vec<u8>, Vec<u8>) {
    let mut ips = Vec::new();
    let mut orcs = Vec::new();
    for (i, (ip, e)) in rows.iter().enumerate() {
        let rel = (*ip as i64) - (IP_TABLE + 4 * i as u64) as i64;
        ips.extend_from_slice(&(rel as i32).to_le_bytes());
        orcs.extend_from_slice(e);
    }
    (ips, orcs)
}

/// The task stack and the IRQ stack.
pub fn stacks() -> Vec<StackBounds> {
    vec![
        StackBounds {
            name: "task".into(),
            range: Gva(TASK_STACK)..Gva(TASK_STACK + STACK_SIZE),
        },
        StackBounds {
            name: "irq".into(),
            range: Gva(IRQ_STACK)..Gva(IRQ_STACK + STACK_SIZE),
        },
    ]
}

/// leaf (hit at +0) <- mid+0x10 <- top+0x20, with mid's saved rbp below its return
/// address: the words handed to `put` (address, value), and the registers at the hit.
pub fn three_frames(put: &mut dyn FnMut(u64, u64)) -> StartRegs {
    let sp = TASK_STACK + STACK_SIZE - 0x100;
    put(sp, MID + 0x10); // leaf's return address
    put(sp + 8, 0x1234); // mid's saved rbp
    put(sp + 16, TOP + 0x20); // mid's return address
    StartRegs {
        ip: LEAF,
        sp,
        bp: 0x5555,
        ..StartRegs::default()
    }
}
