//! The ORC walk against made-up text, ORC tables and stacks (`synthetic`).

use std::collections::HashMap;

use super::synthetic::*;
use super::*;
use crate::stacks::SwappedReturn;

#[derive(Default)]
struct FakeGuest {
    words: HashMap<u64, u64>,
}

impl FakeGuest {
    fn put(&mut self, at: u64, v: u64) {
        self.words.insert(at, v);
    }
}

impl GuestVirtRead for FakeGuest {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        // Word-granular: the walk only reads aligned words; anything else is unmapped here.
        if buf.len() != 8 {
            return Err(MemoryError::Unmapped(gva));
        }
        let v = self.words.get(&gva.0).ok_or(MemoryError::Unmapped(gva))?;
        buf.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }
}

/// An ORC table from (address, entry) rows, laid out as the kernel's sections are.
fn table(rows: &[(u64, [u8; 6])]) -> OrcTable {
    let (ips, orcs) = tables(rows);
    OrcTable::from_tables(Gva(IP_TABLE), &ips, &orcs, Gva(TEXT)..Gva(TEXT + 0x10000), None).unwrap()
}

fn kernel_orc() -> OrcTable {
    table(&kernel_rows())
}

fn no_recovery(ip: Gva, _slot: Gva) -> Gva {
    ip
}

/// [`synthetic::three_frames`] in `g`.
fn three_frames(g: &mut FakeGuest) -> StartRegs {
    super::synthetic::three_frames(&mut |at, v| g.put(at, v))
}

#[test]
fn orc_entries_decode_the_6_1_bitfields() {
    let e = OrcEntry::parse(entry(reg::BP_INDIRECT, -8, reg::PREV_SP, -16, 2, true));
    assert_eq!(
        e,
        OrcEntry {
            sp_offset: -8,
            bp_offset: -16,
            sp_reg: reg::BP_INDIRECT,
            bp_reg: reg::PREV_SP,
            kind: OrcType::RegsPartial,
            end: true,
        }
    );
}

#[test]
fn lookup_takes_the_rightmost_entry_at_or_below_and_nothing_outside_text() {
    let t = table(&[
        (LEAF, entry(reg::SP, 8, 0, 0, 0, false)),
        // A section terminator and a real entry at one address: the later one wins.
        (MID, entry(reg::UNDEFINED, 0, 0, 0, 0, false)),
        (MID, entry(reg::SP, 16, 0, 0, 0, false)),
    ]);
    assert_eq!(t.find(Gva(LEAF + 5)).unwrap().sp_offset, 8);
    assert_eq!(t.find(Gva(MID + 0x50)).unwrap().sp_offset, 16);
    assert_eq!(t.find(Gva(TEXT)), None, "below the first entry");
    assert_eq!(t.find(Gva(TEXT + 0x20000)), None, "outside the text");
    assert_eq!(t.find(Gva(0)), Some(OrcEntry::NULL));
}

#[test]
fn unsorted_or_mismatched_tables_are_refused() {
    let e = entry(reg::SP, 8, 0, 0, 0, false);
    let ip_table = Gva(TEXT);
    let ips: Vec<u8> = [0x200i32, 0x100 - 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    let orcs: Vec<u8> = [e, e].concat();
    let r = OrcTable::from_tables(ip_table, &ips, &orcs, Gva(TEXT)..Gva(TEXT + 0x1000), None);
    assert!(matches!(r, Err(OrcError::Inconsistent(m)) if m.contains("not sorted")));
    let r = OrcTable::from_tables(ip_table, &ips, &e, Gva(TEXT)..Gva(TEXT + 0x1000), None);
    assert!(matches!(r, Err(OrcError::Inconsistent(_))));
}

#[test]
fn call_frames_unwind_to_the_end_entry() {
    let mut g = FakeGuest::default();
    let start = three_frames(&mut g);
    let u = unwind(&kernel_orc(), &g, start, &stacks(), None, &no_recovery);
    assert_eq!(u.frames, vec![Gva(LEAF), Gva(MID + 0x10), Gva(TOP + 0x20)]);
    assert_eq!(u.end, UnwindEnd::Bottom);
    assert!(!u.guessed);
}

#[test]
fn a_return_probe_trampoline_is_replaced_by_the_real_return_address() {
    let mut g = FakeGuest::default();
    let start = three_frames(&mut g);
    let trampoline = TEXT + 0x8000; // in text, no ORC entry of its own needed
    g.put(start.sp, trampoline);
    let slot = start.sp;
    let recover = move |ip: Gva, at: Gva| {
        if ip.0 == trampoline && at.0 == slot {
            Gva(MID + 0x10)
        } else {
            ip
        }
    };
    let u = unwind(&kernel_orc(), &g, start, &stacks(), None, &recover);
    assert_eq!(u.frames, vec![Gva(LEAF), Gva(MID + 0x10), Gva(TOP + 0x20)]);
}

#[test]
fn an_interrupt_frame_on_the_irq_stack_leads_back_to_the_task_stack() {
    let mut g = FakeGuest::default();
    // Task stack: `mid` was interrupted at mid+0x30 with sp = task_sp.
    let task_sp = TASK_STACK + STACK_SIZE - 0x200;
    g.put(task_sp, 0x1234); // mid's saved rbp (mid had pushed it)
    g.put(task_sp + 8, TOP + 0x20); // mid's return address
    let regs = task_sp - 0x400; // pt_regs pushed by the entry, on the task stack
    g.put(regs + pt_regs::IP, MID + 0x30);
    g.put(regs + pt_regs::SP, task_sp);
    g.put(regs + pt_regs::CS, 0x10);
    g.put(regs + pt_regs::BP, 0x7777);
    // The entry then called the handler, which switched to the IRQ stack: its return
    // address into the entry is on the task stack, and the stack pointer it switched from
    // is the first word on the IRQ stack.
    g.put(regs - 8, IRQ_ENTRY + 0x10);
    let leaf_sp = IRQ_STACK + STACK_SIZE - 0x10;
    g.put(leaf_sp, SWITCHER + 0x8); // leaf's return into switcher
    g.put(leaf_sp + 8, regs - 8); // switcher: the task's stack pointer
    let start = StartRegs {
        ip: LEAF,
        sp: leaf_sp,
        ..StartRegs::default()
    };
    let orc = table(&[
        (LEAF, entry(reg::SP, 8, reg::UNDEFINED, 0, 0, false)),
        (MID, entry(reg::SP, 16, reg::PREV_SP, -16, 0, false)),
        (TOP, entry(reg::UNDEFINED, 0, reg::UNDEFINED, 0, 0, true)),
        (IRQ_ENTRY, entry(reg::SP, 0, reg::UNDEFINED, 0, 1, false)),
        // switcher: the previous stack pointer is the word at sp, plus 8 (past the
        // return address pushed before the switch).
        (SWITCHER, entry(reg::SP_INDIRECT, 8, reg::UNDEFINED, 0, 0, false)),
    ]);
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert_eq!(
        u.frames,
        vec![
            Gva(LEAF),
            Gva(SWITCHER + 0x8),
            Gva(IRQ_ENTRY + 0x10),
            Gva(MID + 0x30),
            Gva(TOP + 0x20)
        ],
        "{:?}",
        u.end
    );
    assert_eq!(u.end, UnwindEnd::Bottom);
}

#[test]
fn user_mode_registers_end_the_stack() {
    let mut g = FakeGuest::default();
    let sp = TASK_STACK + STACK_SIZE - pt_regs::SIZE - 8;
    g.put(sp, IRQ_ENTRY + 4); // leaf's return into the syscall entry, just below its pt_regs
    let regs = sp + 8;
    g.put(regs + pt_regs::IP, 0x40_1000);
    g.put(regs + pt_regs::SP, 0x7fff_0000);
    g.put(regs + pt_regs::CS, 0x33);
    let orc = table(&[
        (LEAF, entry(reg::SP, 8, reg::UNDEFINED, 0, 0, false)),
        (IRQ_ENTRY, entry(reg::SP, 0, reg::UNDEFINED, 0, 1, false)),
    ]);
    let start = StartRegs {
        ip: LEAF,
        sp,
        ..StartRegs::default()
    };
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert_eq!(u.frames, vec![Gva(LEAF), Gva(IRQ_ENTRY + 4)]);
    assert_eq!(u.end, UnwindEnd::Bottom);
}

#[test]
fn hostile_stacks_end_the_walk_without_reading_elsewhere() {
    // A return address read from outside every known stack.
    let mut g = FakeGuest::default();
    let start = StartRegs {
        ip: LEAF,
        sp: 0xffff_8880_0000_0000,
        ..StartRegs::default()
    };
    g.put(start.sp, MID);
    let u = unwind(&kernel_orc(), &g, start, &stacks(), None, &no_recovery);
    assert_eq!(u.frames, vec![Gva(LEAF)]);
    assert!(matches!(u.end, UnwindEnd::Error(m) if m.contains("no known stack")));

    // A frame that points back at itself: the stack pointer must grow.
    let mut g = FakeGuest::default();
    let sp = TASK_STACK + 0x1000;
    let orc = table(&[(LEAF, entry(reg::BP, 0, reg::UNDEFINED, 0, 0, false))]);
    g.put(sp - 8, LEAF + 1);
    let start = StartRegs {
        ip: LEAF,
        sp,
        bp: sp,
        ..StartRegs::default()
    };
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert!(
        matches!(&u.end, UnwindEnd::Error(m) if m.contains("does not grow")),
        "{u:?}"
    );

    // An undefined rule without `end`, an unknown type.
    let mut g = FakeGuest::default();
    let start = three_frames(&mut g);
    let u = unwind(
        &kernel_orc(),
        &g,
        StartRegs {
            ip: UNDEFINED_AFTER,
            ..start
        },
        &stacks(),
        None,
        &no_recovery,
    );
    assert!(matches!(u.end, UnwindEnd::Error(_)));
    let orc = table(&[(LEAF, entry(reg::SP, 8, reg::UNDEFINED, 0, 3, false))]);
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert!(matches!(u.end, UnwindEnd::Error(m) if m.contains("type")));
}

#[test]
fn a_stack_is_entered_once_and_the_walk_is_bounded() {
    // Frames that each grow the stack by 8 forever (every return address is `leaf`):
    // bounded by the stack, then by MAX_FRAMES on a large one.
    let mut g = FakeGuest::default();
    let big = StackBounds {
        name: "big".into(),
        range: Gva(TASK_STACK)..Gva(TASK_STACK + 0x10_0000),
    };
    for i in 0..0x2_0000u64 {
        g.put(TASK_STACK + 8 * i, LEAF + 1);
    }
    let start = StartRegs {
        ip: LEAF,
        sp: TASK_STACK,
        ..StartRegs::default()
    };
    let u = unwind(&kernel_orc(), &g, start, std::slice::from_ref(&big), None, &no_recovery);
    assert_eq!(u.frames.len(), MAX_FRAMES);
    assert_eq!(u.end, UnwindEnd::TooDeep);

    // The IRQ stack's saved pointer leads back to the IRQ stack after the task stack:
    // refused (the guest's "unwinder looped").
    let mut g = FakeGuest::default();
    let irq_sp = IRQ_STACK + 0x100;
    g.put(irq_sp, SWITCHER + 1);
    g.put(irq_sp + 8, TASK_STACK + 0x100); // switcher's saved (task) stack pointer
    g.put(TASK_STACK + 0x100, SWITCHER + 1); // ... whose return goes to switcher again
    g.put(TASK_STACK + 0x108, IRQ_STACK + 0x200);
    let orc = table(&[
        (LEAF, entry(reg::SP, 8, reg::UNDEFINED, 0, 0, false)),
        (SWITCHER, entry(reg::SP_INDIRECT, 0, reg::UNDEFINED, 0, 0, false)),
    ]);
    let start = StartRegs {
        ip: LEAF,
        sp: irq_sp,
        ..StartRegs::default()
    };
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert!(u.frames.len() <= 4, "{u:?}");
    assert!(matches!(u.end, UnwindEnd::Error(_)), "{u:?}");
}

#[test]
fn code_without_orc_data_is_walked_by_frame_pointer_and_marked_guessed() {
    let mut g = FakeGuest::default();
    let start = three_frames(&mut g);
    // leaf's address has no entry (below the first one): rbp chain instead.
    let orc = table(&[
        (MID, entry(reg::SP, 16, reg::PREV_SP, -16, 0, false)),
        (TOP, entry(reg::UNDEFINED, 0, reg::UNDEFINED, 0, 0, true)),
    ]);
    let bp = start.sp + 0x40;
    g.put(bp, 0x9999); // saved rbp
    g.put(bp + 8, MID + 0x10);
    g.put(bp + 16, 0x1234);
    g.put(bp + 24, TOP + 0x20);
    let start = StartRegs {
        ip: TEXT + 0x10,
        bp,
        ..start
    };
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert!(u.guessed);
    assert_eq!(u.frames, vec![Gva(TEXT + 0x10), Gva(MID + 0x10), Gva(TOP + 0x20)]);

    // A return address outside the text ends the walk there (not printed).
    g.put(bp + 8, 0xdead_beef);
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert_eq!(u.frames, vec![Gva(TEXT + 0x10)]);
    assert_eq!(u.end, UnwindEnd::NotText(Gva(0xdead_beef)));
}

#[test]
fn an_iret_frame_gives_the_interrupted_address_and_stack() {
    // An exception entry before its registers are saved: only the hardware's frame (ip,
    // cs, flags, sp, ss) is on the stack, where the ORC rule's stack pointer points.
    let mut g = FakeGuest::default();
    let task_sp = TASK_STACK + STACK_SIZE - 0x200;
    g.put(task_sp, 0x1234); // mid's saved rbp
    g.put(task_sp + 8, TOP + 0x20); // mid's return address
    let frame = task_sp - 0x100;
    g.put(frame, MID + 0x30); // ip
    g.put(frame + 8, 0x10); // cs
    g.put(frame + 16, 0x2); // flags
    g.put(frame + 24, task_sp); // sp
    g.put(frame + 32, 0x18); // ss
    let orc = table(&[
        (MID, entry(reg::SP, 16, reg::PREV_SP, -16, 0, false)),
        (TOP, entry(reg::UNDEFINED, 0, reg::UNDEFINED, 0, 0, true)),
        (IRQ_ENTRY, entry(reg::SP, 0, reg::UNDEFINED, 0, 2, false)),
    ]);
    let start = StartRegs {
        ip: IRQ_ENTRY,
        sp: frame,
        ..StartRegs::default()
    };
    let u = unwind(&orc, &g, start, &stacks(), None, &no_recovery);
    assert_eq!(
        u.frames,
        vec![Gva(IRQ_ENTRY), Gva(MID + 0x30), Gva(TOP + 0x20)],
        "{:?}",
        u.end
    );
    assert_eq!(u.end, UnwindEnd::Bottom);
}

#[test]
fn the_block_index_finds_what_a_search_of_the_whole_table_finds() {
    // Entries at pseudo-random addresses over the text (duplicates and gaps of many blocks
    // included); every address of the text looks up the same entry both ways.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut ips: Vec<u64> = (0..3000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            TEXT + 0x40 + x % 0xff00
        })
        .collect();
    ips.extend([TEXT + 0x100, TEXT + 0x100, TEXT + 0x200]);
    ips.sort_unstable();
    let rows: Vec<(u64, [u8; 6])> = ips
        .iter()
        .enumerate()
        .map(|(i, &ip)| (ip, entry(reg::SP, i as i16, 0, 0, 0, false)))
        .collect();
    let t = table(&rows);
    for ip in (TEXT..TEXT + 0x10000).step_by(3) {
        let naive = ips.partition_point(|&a| a <= ip).checked_sub(1).map(|i| i as i16);
        assert_eq!(t.find(Gva(ip)).map(|e| e.sp_offset), naive, "at {ip:#x}");
    }
}

#[test]
fn the_guests_own_kretprobe_trampoline_is_looked_up_in_the_tasks_rethook_list() {
    let mut g = FakeGuest::default();
    let start = three_frames(&mut g);
    let guest_trampoline = Gva(TEXT + 0x9000);
    // mid's return address (at sp + 16) was swapped by the guest's kretprobe.
    let slot = start.sp + 16;
    g.put(slot, guest_trampoline.0);
    let rethooks = GuestRethooks {
        trampoline: guest_trampoline,
        returns: vec![
            // A later call on another frame, one whose saved address is the trampoline
            // itself (skipped, as the guest skips it), then ours.
            SwappedReturn {
                frame: Gva(start.sp - 0x100),
                ret_addr: Gva(MID + 0x99),
            },
            SwappedReturn {
                frame: Gva(slot),
                ret_addr: guest_trampoline,
            },
            SwappedReturn {
                frame: Gva(slot),
                ret_addr: Gva(TOP + 0x20),
            },
        ],
    };
    let u = unwind(&kernel_orc(), &g, start, &stacks(), Some(&rethooks), &no_recovery);
    assert_eq!(
        u.frames,
        vec![Gva(LEAF), Gva(MID + 0x10), Gva(TOP + 0x20)],
        "{:?}",
        u.end
    );

    // Not on the list: address 0, the walk ends there (as the guest's does).
    let rethooks = GuestRethooks {
        trampoline: guest_trampoline,
        returns: vec![],
    };
    let u = unwind(&kernel_orc(), &g, start, &stacks(), Some(&rethooks), &no_recovery);
    assert_eq!(u.frames, vec![Gva(LEAF), Gva(MID + 0x10)]);
    assert_eq!(u.end, UnwindEnd::NotText(Gva(0)));
}

/// `_stext`/`_etext` come from guest symbols (kallsyms mode); a pair
/// 2^64 apart sized the lookup blocks at 2^56 entries (a capacity overflow, or an abort on
/// allocation). Text larger than the kernel image mapping is refused instead. Allocations
/// on this thread are capped at 64 MiB, so the old code aborts the test.
#[test]
fn text_bounds_larger_than_the_kernel_image_are_refused() {
    let (ip, orc) = (Vec::new(), Vec::new());
    let r = crate::alloc_cap::with_cap(64 << 20, || {
        OrcTable::from_tables(Gva(0), &ip, &orc, Gva(0x1000)..Gva(u64::MAX), None)
    });
    match r {
        Err(OrcError::TextTooLarge { len, limit }) => {
            assert_eq!((len, limit), (u64::MAX - 0x1000, MAX_KERNEL_TEXT));
        }
        other => panic!("expected the text size limit, got {other:?}"),
    }
}

/// Finding 8 (unwind): an init text below the core text made the lookup subtract the
/// core text's start from an address below it (a panic in a debug build).
#[test]
fn lookup_of_init_text_below_the_core_text_does_not_overflow() {
    let text = Gva(0xffff_ffff_8100_0000)..Gva(0xffff_ffff_8200_0000);
    let init = Gva(0xffff_ffff_8000_0000)..Gva(0xffff_ffff_8010_0000);
    let ips = ((0xffff_ffff_8000_0100u64 as i64).wrapping_sub(0x1000i64) as i32).to_le_bytes();
    let t = OrcTable::from_tables(
        Gva(0x1000),
        &ips,
        &entry(reg::SP, 8, reg::UNDEFINED, 0, 0, false),
        text,
        Some(init),
    )
    .unwrap();
    assert!(t.find(Gva(0xffff_ffff_8000_0200)).is_some());
}
