//! Fuzzes the guest's ORC tables and the stack walk over them
//! (`hvprobe_introspection::unwind`): both are the guest's memory.
//!
//! A valid kernel is built: ORC tables for five functions (a leaf, a caller with a frame
//! pointer, a kernel thread's first function, an interrupt entry with full `pt_regs`, a
//! switch to the IRQ stack), a task stack holding three frames and an IRQ stack. The input
//! gives `[text span selector: u8] [start registers: 8 x u64] [rethook count: u8]` and then
//! patches (see `guest_common.rs`; regions: the ip table, the ORC entries, the task stack
//! at its frames, the IRQ stack's top); patched tables are read back and parsed as the
//! guest has them. Checked: no panic; at most `MAX_FRAMES + 1` frames; lookups only inside
//! the text.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::Gva;
use hvprobe_introspection::memory::{GuestVirtRead, SparseMemory};
use hvprobe_introspection::stacks::SwappedReturn;
use hvprobe_introspection::unwind::{unwind, GuestRethooks, OrcTable, StackBounds, StartRegs, MAX_FRAMES};
use libfuzzer_sys::fuzz_target;

const TEXT: u64 = 0xffff_ffff_8100_0000;
const IP_TABLE: u64 = TEXT + 0x10_0000;
const ORC_TABLE: u64 = TEXT + 0x11_0000;
const TASK_STACK: u64 = 0xffff_c900_0001_0000;
const IRQ_STACK: u64 = 0xffff_c900_0010_0000;
const STACK_SIZE: u64 = 0x4000;
const LEAF: u64 = TEXT + 0x100;
const MID: u64 = TEXT + 0x200;
const TOP: u64 = TEXT + 0x300;
const IRQ_ENTRY: u64 = TEXT + 0x400;
const SWITCHER: u64 = TEXT + 0x500;

/// An ORC entry of Linux 6.1: sp_offset, bp_offset (s16 each), then type/regs/end bits.
fn entry(sp_reg: u8, sp_offset: i16, bp_reg: u8, bp_offset: i16, kind: u16, end: bool) -> [u8; 6] {
    let bits = u16::from(sp_reg) | (u16::from(bp_reg) << 4) | (kind << 8) | (u16::from(end) << 10);
    let mut b = [0u8; 6];
    b[0..2].copy_from_slice(&sp_offset.to_le_bytes());
    b[2..4].copy_from_slice(&bp_offset.to_le_bytes());
    b[4..6].copy_from_slice(&bits.to_le_bytes());
    b
}

fn build(mem: &mut SparseMemory) -> usize {
    // ORC_REG_*: 0 undefined, 1 prev_sp, 5 sp, 9 sp_indirect.
    let rows = [
        (LEAF, entry(5, 8, 0, 0, 0, false)),
        (MID, entry(5, 16, 1, -16, 0, false)),
        (TOP, entry(0, 0, 0, 0, 0, true)),
        (IRQ_ENTRY, entry(5, 0, 0, 0, 1, false)),
        (SWITCHER, entry(9, 8, 0, 0, 0, false)),
    ];
    for (i, (ip, e)) in rows.iter().enumerate() {
        let at = IP_TABLE + 4 * i as u64;
        mem.put_u32(at, (*ip as i64 - at as i64) as i32 as u32);
        mem.write(ORC_TABLE + 6 * i as u64, e);
    }
    let sp = TASK_STACK + STACK_SIZE - 0x100;
    mem.put_u64(sp, MID + 0x10);
    mem.put_u64(sp + 8, 0x1234);
    mem.put_u64(sp + 16, TOP + 0x20);
    mem.write(TASK_STACK + STACK_SIZE - 0x1000, &[0; 0x1000]);
    mem.write(IRQ_STACK + STACK_SIZE - 0x1000, &[0; 0x1000]);
    mem.put_u64(IRQ_STACK + STACK_SIZE - 8, sp);
    rows.len()
}

fuzz_target!(|data: &[u8]| {
    let mut mem = SparseMemory::new();
    let rows = build(&mut mem);
    let mut input = Input::new(data);
    let span = match input.u8() % 4 {
        0 => 0x1_0000,
        1 => 0x100_0000,
        2 => 0,        // empty text
        _ => u64::MAX, // refused: larger than the kernel image mapping
    };
    let text = Gva(TEXT)..Gva(TEXT.saturating_add(span));
    let init_text = Some(Gva(TEXT - 0x10_0000)..Gva(TEXT - 0x8_0000));
    let mut regs = [0u64; 8];
    for r in &mut regs {
        *r = input.u64();
    }
    let sp = TASK_STACK + STACK_SIZE - 0x100;
    let start = StartRegs {
        ip: LEAF ^ regs[0],
        sp: sp ^ regs[1],
        bp: regs[2],
        cs: regs[3] & 0xffff,
        r10: regs[4],
        r13: regs[5],
        di: regs[6],
        dx: regs[7],
    };
    let rethooks = usize::from(input.u8() % 4);
    input.patch(
        &mut mem,
        &[
            IP_TABLE,
            ORC_TABLE,
            sp - 0x40,
            TASK_STACK + STACK_SIZE - 0x200,
            IRQ_STACK + STACK_SIZE - 0x100,
        ],
    );
    let mut ips = vec![0u8; 4 * rows];
    let mut orcs = vec![0u8; 6 * rows];
    if mem.read_virt(Gva(IP_TABLE), &mut ips).is_err() || mem.read_virt(Gva(ORC_TABLE), &mut orcs).is_err() {
        return;
    }
    let Ok(orc) = OrcTable::from_tables(Gva(IP_TABLE), &ips, &orcs, text.clone(), init_text.clone()) else {
        return;
    };
    for probe in [0, LEAF, MID + 3, TEXT - 0x10_0000 + 8, start.ip] {
        let _ = orc.find(Gva(probe));
    }
    let stacks = [
        StackBounds {
            name: "task".into(),
            range: Gva(TASK_STACK)..Gva(TASK_STACK + STACK_SIZE),
        },
        StackBounds {
            name: "irq".into(),
            range: Gva(IRQ_STACK)..Gva(IRQ_STACK + STACK_SIZE),
        },
    ];
    let guest_rethooks = GuestRethooks {
        trampoline: Gva(MID + 0x10),
        returns: (0..rethooks as u64)
            .map(|i| SwappedReturn {
                frame: Gva(sp + 8 * i),
                ret_addr: Gva(TOP + i),
            })
            .collect(),
    };
    let recover = |ip: Gva, _slot: Gva| ip;
    let walked = unwind(&orc, &mem, start, &stacks, Some(&guest_rethooks), &recover);
    assert!(walked.frames.len() <= MAX_FRAMES + 1, "{} frames", walked.frames.len());
});
