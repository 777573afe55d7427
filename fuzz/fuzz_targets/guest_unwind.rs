//! Fuzzes the guest's ORC tables and the stack walk over them
//! (`hvprobe_introspection::unwind`): both are the guest's memory.
//!
//! A valid kernel is built (`unwind::synthetic`, the unit tests' kernel): ORC tables for
//! six functions (a leaf, a caller with a frame pointer, a kernel thread's first function,
//! an interrupt entry with full `pt_regs`, a switch to the IRQ stack, code with an
//! undefined entry), a task stack holding three frames and an IRQ stack. The input
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
use hvprobe_introspection::unwind::synthetic::{
    kernel_rows, stacks, tables, three_frames, IP_TABLE, IRQ_STACK, LEAF, MID, STACK_SIZE, TASK_STACK, TEXT, TOP,
};
use hvprobe_introspection::unwind::{unwind, GuestRethooks, OrcTable, StartRegs, MAX_FRAMES};
use libfuzzer_sys::fuzz_target;

/// Where the guest keeps `.orc_unwind` (`.orc_unwind_ip` is at `IP_TABLE`).
const ORC_TABLE: u64 = TEXT + 0x11_0000;

/// The kernel (`unwind::synthetic`): its ORC tables and stacks in memory, three frames on
/// the task stack whose top the IRQ stack's top points to. Returns the number of ORC rows
/// and the stack pointer at the hit.
fn build(mem: &mut SparseMemory) -> (usize, u64) {
    let rows = kernel_rows();
    let (ips, orcs) = tables(&rows);
    mem.write(IP_TABLE, &ips);
    mem.write(ORC_TABLE, &orcs);
    mem.write(TASK_STACK + STACK_SIZE - 0x1000, &[0; 0x1000]);
    mem.write(IRQ_STACK + STACK_SIZE - 0x1000, &[0; 0x1000]);
    let sp = three_frames(&mut |at, v| mem.put_u64(at, v)).sp;
    mem.put_u64(IRQ_STACK + STACK_SIZE - 8, sp);
    (rows.len(), sp)
}

fuzz_target!(|data: &[u8]| {
    let mut mem = SparseMemory::new();
    let (rows, sp) = build(&mut mem);
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
    let stacks = stacks();
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
