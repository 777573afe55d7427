//! The stack walk against a made-up guest (`synthetic`): a sparse memory with tasks,
//! lists and per-CPU areas at addresses of our choosing, and a layout written by hand.

use super::synthetic::*;
use super::*;
use crate::memory::SparseMemory;

fn pid_of(owner: &StackOwner) -> Option<i32> {
    match owner {
        StackOwner::Task { pid, .. } => Some(*pid),
        _ => None,
    }
}

#[test]
fn every_stack_is_found_and_a_planted_word_only_where_it_is_live() {
    let mut w = World::new(2);
    let init = w.process(1, "init");
    let _kthreadd = w.process(2, "kthreadd");
    let p10 = w.process(10, "app");
    let t11 = w.thread(p10, 11);
    let t12 = w.thread(p10, 12);
    w.link();
    w.run_on(1, t11);

    let mut expected = Vec::new();
    let mut plant = |mem: &mut SparseMemory, at: u64, hit: bool| {
        mem.put_u64(at, CODE);
        if hit {
            expected.push(Gva(at));
        }
    };
    // Above a sleeping task's saved stack pointer: live; below it: dead.
    let s12 = w.stack_of(t12);
    plant(&mut w.mem, s12 + THREAD_SIZE - 0x80, true);
    let s10 = w.stack_of(p10);
    plant(&mut w.mem, s10 + THREAD_SIZE - 0x200, false);
    // Anywhere on a running task's stack.
    let s11 = w.stack_of(t11);
    plant(&mut w.mem, s11 + 0x40, true);
    // The top word of init's stack; the bottom word of CPU 1's idle stack (sleeping: dead).
    let init_top = w.stack_of(init) + THREAD_SIZE - 8;
    plant(&mut w.mem, init_top, true);
    let idle1 = w.mem.read_u64(Gva(per_cpu_area(1) + RQ_IDLE)).unwrap();
    let idle1_bottom = w.stack_of(idle1);
    plant(&mut w.mem, idle1_bottom, false);
    // CPU 0's IRQ stack is not in use, CPU 1's is.
    plant(&mut w.mem, irq_stack(0) + 0x100, false);
    w.mem.write(per_cpu_area(1) + IRQ_INUSE, &[1]);
    plant(&mut w.mem, irq_stack(1) + 0x100, true);
    // Exception and entry stacks are scanned whole.
    plant(&mut w.mem, estacks(0) + 0x1000, true);
    plant(&mut w.mem, estacks(1) + 0x4000 + 0x1ff8, true);
    plant(&mut w.mem, per_cpu_area(1) + ENTRY + 0x800, true);
    // Just outside the range, on a stack scanned whole.
    w.mem.put_u64(s11 + 0x48, RANGE.end.0);
    w.mem.put_u64(s11 + 0x50, RANGE.start.0 - 1);
    w.mem.put_u64(s11 + 0x58, RANGE.start.0);
    expected.push(Gva(s11 + 0x58));

    let stacks = w.read().unwrap();
    let counts = stacks.task_counts();
    assert_eq!(
        counts,
        TaskCounts {
            listed: 5,
            idle: 2,
            unlisted: 0,
            on_cpu: 2, // swapper/0 (CPU 0's current) and thread 11
            without_stack: 0
        }
    );
    let mut pids: Vec<i32> = stacks.stacks().iter().filter_map(|s| pid_of(&s.owner)).collect();
    pids.sort();
    assert_eq!(pids, [0, 0, 1, 2, 10, 11, 12]);
    let kinds = |f: fn(&StackOwner) -> bool| stacks.stacks().iter().filter(|s| f(&s.owner)).count();
    assert_eq!(kinds(|o| matches!(o, StackOwner::Irq { .. })), 2);
    assert_eq!(kinds(|o| matches!(o, StackOwner::Exception { .. })), 6);
    assert_eq!(kinds(|o| matches!(o, StackOwner::Entry { .. })), 2);
    assert_eq!(stacks.task_stack(Gva(t11)).unwrap().extent, Extent::Whole);
    assert_eq!(stacks.task_stack(Gva(INIT_TASK)).unwrap().extent, Extent::Whole);
    let t12_stack = stacks.task_stack(Gva(t12)).unwrap();
    assert_eq!(t12_stack.extent, Extent::FromSavedSp);
    assert_eq!(t12_stack.scan, Gva(s12 + THREAD_SIZE - 0x100)..Gva(s12 + THREAD_SIZE));
    let irq0 = stacks
        .stacks()
        .iter()
        .find(|s| s.owner == StackOwner::Irq { cpu: 0 })
        .unwrap();
    assert_eq!(
        (irq0.extent, irq0.scan_len(), irq0.bounds.clone()),
        (Extent::Unused, 0, Gva(irq_stack(0))..Gva(irq_stack(0) + IRQ_SIZE))
    );
    assert_eq!(stacks.cpus().len(), 2);
    assert_eq!(stacks.cpus()[1].current, Gva(t11));

    let hits = stacks.saved_addresses_in(&w.mem, RANGE).unwrap();
    let mut found: Vec<Gva> = hits.iter().map(|h| h.at).collect();
    found.sort();
    expected.sort();
    assert_eq!(found, expected, "{hits:#?}");
    for h in &hits {
        assert!(RANGE.contains(&h.value));
        assert_eq!(stacks.stacks()[h.stack].owner, h.owner);
    }
    let on_12 = hits.iter().find(|h| h.at.0 == s12 + THREAD_SIZE - 0x80).unwrap();
    assert_eq!(
        on_12.to_string(),
        format!(
            "{} saved at {} on task 12 (process 10) `worker` (task_struct {})",
            Gva(CODE),
            on_12.at,
            Gva(t12)
        )
    );

    // A range that misses everything, and several ranges at once.
    assert!(stacks
        .saved_addresses_in(&w.mem, Gva(CODE + 0x100)..Gva(CODE + 0x200))
        .unwrap()
        .is_empty());
    assert!(stacks
        .saved_addresses_in(&w.mem, Gva(CODE)..Gva(CODE))
        .unwrap()
        .is_empty());
    let two = stacks
        .saved_addresses_in_any(&w.mem, &[Gva(0x10)..Gva(0x20), Gva(CODE)..Gva(CODE + 1)])
        .unwrap();
    assert_eq!(
        two.len(),
        expected.len() - 1,
        "the word at the range's start is not CODE"
    );
}

#[test]
fn exiting_and_queued_tasks_off_the_lists_are_found() {
    let mut w = World::new(2);
    w.process(1, "init");
    let exiting = w.unlisted(30);
    let preempted = w.unlisted(31);
    w.link();
    w.run_on(1, exiting);
    // CPU 0's CFS run queue holds the preempted one.
    let head = per_cpu_area(0) + RQ_CFS;
    w.ring(head, &[preempted + GROUP_NODE]);
    w.mem.put_u64(w.stack_of(preempted) + THREAD_SIZE - 0x10, CODE);
    w.mem.put_u64(w.stack_of(exiting) + 0x10, CODE);

    let stacks = w.read().unwrap();
    let c = stacks.task_counts();
    assert_eq!((c.listed, c.idle, c.unlisted, c.on_cpu), (1, 2, 2, 2));
    assert_eq!(stacks.task_stack(Gva(exiting)).unwrap().extent, Extent::Whole);
    assert_eq!(stacks.task_stack(Gva(preempted)).unwrap().extent, Extent::FromSavedSp);
    let hits = stacks.saved_addresses_in(&w.mem, RANGE).unwrap();
    let mut pids: Vec<i32> = hits.iter().filter_map(|h| pid_of(&h.owner)).collect();
    pids.sort();
    assert_eq!(pids, [30, 31]);
}

#[test]
fn dead_tasks_and_bad_saved_stack_pointers() {
    let mut w = World::new(1);
    let zombie = w.process(5, "zombie");
    let odd = w.process(6, "odd");
    w.link();
    w.mem.put_u64(zombie + STACK, 0);
    w.mem.put_u64(odd + THREAD_SP, 0x1234); // not on its stack
    let deep = w.stack_of(odd) + 0x18;
    w.mem.put_u64(deep, CODE);

    let stacks = w.read().unwrap();
    assert_eq!(stacks.task_counts().without_stack, 1);
    assert!(stacks.task_stack(Gva(zombie)).is_none());
    assert_eq!(stacks.task_stack(Gva(odd)).unwrap().extent, Extent::WholeSavedSpOutside);
    let hits = stacks.saved_addresses_in(&w.mem, RANGE).unwrap();
    assert_eq!(hits.iter().map(|h| h.at).collect::<Vec<_>>(), [Gva(deep)]);

    // Without on_cpu in the layout every task is scanned whole.
    let mut l = layout();
    l.task_on_cpu = None;
    let stacks = KernelStacks::read(&w.mem, &l).unwrap();
    assert!(stacks
        .stacks()
        .iter()
        .filter(|s| matches!(s.owner, StackOwner::Task { .. }))
        .all(|s| s.extent == Extent::Whole));
    // Without hardirq_stack_inuse the IRQ stack is scanned whole.
    l.irq.inuse = None;
    let stacks = KernelStacks::read(&w.mem, &l).unwrap();
    let irq = stacks
        .stacks()
        .iter()
        .find(|s| matches!(s.owner, StackOwner::Irq { .. }))
        .unwrap();
    assert_eq!((irq.extent, irq.scan_len()), (Extent::Whole, IRQ_SIZE));
}

#[test]
fn cyclic_lists_are_errors() {
    // Processes 1 -> 2 -> 3 -> 2: never back at init_task.
    let mut w = World::new(1);
    let a = w.process(1, "a");
    let b = w.process(2, "b");
    let c = w.process(3, "c");
    w.link();
    w.mem.put_u64(c + TASKS, b + TASKS);
    let err = w.read().unwrap_err();
    assert!(
        matches!(err, StacksError::ListCycle { list: "task_struct.tasks", node } if node == Gva(b + TASKS)),
        "{err}"
    );

    // A thread list looping on its second thread.
    let mut w = World::new(1);
    let p = w.process(1, "p");
    let t = w.thread(p, 2);
    w.link();
    w.mem.put_u64(t + THREAD_NODE, t + THREAD_NODE);
    let err = w.read().unwrap_err();
    assert!(
        matches!(
            err,
            StacksError::ListCycle {
                list: "thread_head",
                ..
            }
        ),
        "{err}"
    );

    // A node pointing at itself as the first element.
    let mut w = World::new(1);
    w.link();
    w.mem.put_u64(INIT_TASK + TASKS, a + TASKS);
    w.mem.map(a, TASK_SIZE);
    w.mem.put_u64(a + TASKS, a + TASKS);
    assert!(matches!(w.read().unwrap_err(), StacksError::ListCycle { .. }));
}

#[test]
fn lists_are_bounded() {
    let mut w = World::new(1);
    for pid in 1..=20 {
        w.process(pid, "many");
    }
    w.link();
    let mut l = layout();
    l.max_list_steps = 30; // 20 processes + 21 thread list nodes needed
    let err = KernelStacks::read(&w.mem, &l).unwrap_err();
    assert!(matches!(err, StacksError::TooManyNodes { max: 30 }), "{err}");
    l.max_list_steps = 41;
    assert_eq!(KernelStacks::read(&w.mem, &l).unwrap().task_counts().listed, 20);
}

#[test]
fn corrupt_pointers_are_errors() {
    let fresh = || {
        let mut w = World::new(1);
        let p = w.process(1, "p");
        w.link();
        (w, p)
    };
    // A user-space pointer in a list.
    let (mut w, p) = fresh();
    w.mem.put_u64(p + TASKS, 0x7fff_0000_1000);
    assert!(matches!(
        w.read().unwrap_err(),
        StacksError::BadPointer {
            what: "task_struct.tasks",
            value: 0x7fff_0000_1000,
            ..
        }
    ));
    // A list pointing into unmapped memory.
    let (mut w, p) = fresh();
    w.mem.put_u64(p + TASKS, 0xffff_8880_7000_0050);
    assert!(matches!(w.read().unwrap_err(), StacksError::Memory { .. }));
    // A NULL next.
    let (mut w, p) = fresh();
    w.mem.put_u64(p + TASKS, 0);
    assert!(matches!(
        w.read().unwrap_err(),
        StacksError::BadPointer { value: 0, .. }
    ));
    // A stack not aligned to THREAD_SIZE.
    let (mut w, p) = fresh();
    let s = w.stack_of(p);
    w.mem.put_u64(p + STACK, s + 0x1000);
    assert!(matches!(w.read().unwrap_err(), StacksError::MisalignedStack { .. }));
    // An unmapped stack (task stacks are never skipped).
    let (mut w, p) = fresh();
    w.mem.put_u64(p + STACK, 0xffff_c900_7000_0000);
    let stacks = w.read().unwrap();
    assert!(matches!(
        stacks.saved_addresses_in(&w.mem, RANGE).unwrap_err(),
        StacksError::Memory { .. }
    ));
    // A hand-made layout with impossible sizes.
    let (w, _) = fresh();
    for bad in [0, 0x3000, 1 << 30] {
        let mut l = layout();
        l.thread_size = bad;
        assert!(matches!(KernelStacks::read(&w.mem, &l), Err(StacksError::Layout(_))));
    }
    let mut l = layout();
    l.irq.size = 1 << 40;
    assert!(matches!(KernelStacks::read(&w.mem, &l), Err(StacksError::Layout(_))));
    // Absurd CPU counts and per-CPU bases.
    let (mut w, _) = fresh();
    w.mem.put_u32(NR_CPU_IDS, 1 << 20);
    assert!(matches!(w.read().unwrap_err(), StacksError::TooManyCpus(_)));
    let (mut w, _) = fresh();
    w.mem.put_u64(PER_CPU_OFFSET, 0x1000);
    assert!(matches!(
        w.read().unwrap_err(),
        StacksError::BadPointer {
            what: "__per_cpu_offset",
            ..
        }
    ));
}

#[test]
fn impossible_cpus_are_skipped_and_missing_per_cpu_stacks_tolerated() {
    let mut w = World::new(3);
    w.link();
    // CPU 1 is not possible; CPU 2 has no IRQ or exception stacks yet.
    let mask = 0xffff_ffff_8210_2000;
    w.mem.put_u64(mask, 0b101);
    w.mem.put_u64(per_cpu_area(2) + IRQ_PTR, 0);
    w.mem.put_u64(per_cpu_area(2) + ESTACKS_PTR, 0);
    let mut l = layout();
    l.possible_mask = Some(Gva(mask));
    let stacks = KernelStacks::read(&w.mem, &l).unwrap();
    assert_eq!(stacks.cpus().iter().map(|c| c.cpu).collect::<Vec<_>>(), [0, 2]);
    let per_cpu: Vec<String> = stacks
        .stacks()
        .iter()
        .filter(|s| !matches!(s.owner, StackOwner::Task { .. }))
        .map(|s| s.owner.to_string())
        .collect();
    assert_eq!(
        per_cpu,
        [
            "CPU 0's IRQ stack",
            "CPU 0's NMI exception stack",
            "CPU 0's DB exception stack",
            "CPU 0's VC exception stack",
            "CPU 0's entry stack",
            "CPU 2's entry stack"
        ]
    );
    assert_eq!(stacks.task_counts().idle, 2, "swapper/0 and CPU 2's idle task");
    // The unmapped VC stack reads as nothing rather than failing the scan.
    assert!(stacks.saved_addresses_in(&w.mem, RANGE).unwrap().is_empty());
}

#[test]
fn a_paused_vcpus_registers_narrow_its_current_tasks_scan() {
    let fresh = || {
        let mut w = World::new(2);
        let p = w.process(1, "init");
        w.link();
        w.run_on(1, p);
        let s = w.stack_of(p);
        (w, p, s)
    };
    let base1 = per_cpu_area(1);

    // Kernel mode on the task's stack: below rsp is dead.
    let (mut w, p, s) = fresh();
    let rsp = s + 0x3000;
    w.mem.put_u64(rsp - 8, CODE);
    w.mem.put_u64(rsp, CODE);
    let mut stacks = w.read().unwrap();
    assert_eq!(stacks.task_stack(Gva(p)).unwrap().extent, Extent::Whole);
    assert_eq!(stacks.saved_addresses_in(&w.mem, RANGE).unwrap().len(), 2);
    stacks.narrow_to_vcpu(&w.mem, base1, 0, rsp).unwrap();
    let t = stacks.task_stack(Gva(p)).unwrap();
    assert_eq!(
        (t.extent, t.scan.clone()),
        (Extent::FromVcpuSp, Gva(rsp)..Gva(s + THREAD_SIZE))
    );
    let hits = stacks.saved_addresses_in(&w.mem, RANGE).unwrap();
    assert_eq!(hits.iter().map(|h| h.at).collect::<Vec<_>>(), [Gva(rsp)]);
    // CPU 1 is in no exception handler; CPU 0's exception stacks are untouched.
    for s in stacks.stacks() {
        if let StackOwner::Exception { cpu, .. } = s.owner {
            let expected = if cpu == 1 {
                (Extent::Unused, 0)
            } else {
                (Extent::Whole, 0x2000)
            };
            assert_eq!((s.extent, s.scan_len()), expected, "{}", s.owner);
        }
    }
    // It never widens: a lower rsp later changes nothing.
    stacks.narrow_to_vcpu(&w.mem, base1, 0, s + 0x100).unwrap();
    assert_eq!(stacks.task_stack(Gva(p)).unwrap().scan.start, Gva(rsp));

    // User mode: nothing on the kernel stack.
    let (w, p, _) = fresh();
    let mut stacks = w.read().unwrap();
    stacks.narrow_to_vcpu(&w.mem, base1, 3, 0x7ffc_0000_0000).unwrap();
    let t = stacks.task_stack(Gva(p)).unwrap();
    assert_eq!((t.extent, t.scan_len()), (Extent::UserMode, 0));
    assert!(stacks
        .stacks()
        .iter()
        .filter(|s| matches!(s.owner, StackOwner::Exception { cpu: 1, .. }))
        .all(|s| s.extent == Extent::Unused));

    // On the IRQ stack: it from rsp, the task from the stack pointer saved at its top.
    let (mut w, p, s) = fresh();
    w.mem.write(base1 + IRQ_INUSE, &[1]);
    let top = irq_stack(1) + IRQ_SIZE;
    w.mem.put_u64(top - 8, s + 0x3800);
    let mut stacks = w.read().unwrap();
    stacks.narrow_to_vcpu(&w.mem, base1, 0, top - 0x200).unwrap();
    let t = stacks.task_stack(Gva(p)).unwrap();
    assert_eq!((t.extent, t.scan.start), (Extent::FromVcpuSp, Gva(s + 0x3800)));
    let irq = stacks
        .stacks()
        .iter()
        .find(|s| s.owner == StackOwner::Irq { cpu: 1 })
        .unwrap();
    assert_eq!(
        (irq.extent, irq.scan.clone()),
        (Extent::FromVcpuSp, Gva(top - 0x200)..Gva(top))
    );
    assert!(stacks
        .stacks()
        .iter()
        .filter(|s| matches!(s.owner, StackOwner::Exception { cpu: 1, .. }))
        .all(|s| s.extent == Extent::Unused));

    // On an IRQ stack its CPU marks unused (a contradiction): scanned from rsp all the same.
    let (w, _, _) = fresh();
    let mut stacks = w.read().unwrap();
    stacks.narrow_to_vcpu(&w.mem, base1, 0, top - 0x100).unwrap();
    let irq = stacks
        .stacks()
        .iter()
        .find(|s| s.owner == StackOwner::Irq { cpu: 1 })
        .unwrap();
    assert_eq!(
        (irq.extent, irq.scan.clone()),
        (Extent::FromVcpuSp, Gva(top - 0x100)..Gva(top))
    );

    // Elsewhere (an exception stack, or another task's stack mid-switch): no change.
    let (w, p, _) = fresh();
    let mut stacks = w.read().unwrap();
    let before = stacks.stacks().to_vec();
    stacks.narrow_to_vcpu(&w.mem, base1, 0, estacks(1) + 0x2000).unwrap();
    stacks.narrow_to_vcpu(&w.mem, base1, 0, STACKS_AT + 0x10).unwrap();
    assert_eq!(stacks.stacks(), &before[..]);
    assert_eq!(stacks.task_stack(Gva(p)).unwrap().extent, Extent::Whole);
    // A per-CPU base of no CPU is an error, not a guess.
    assert!(matches!(
        stacks.narrow_to_vcpu(&w.mem, 0xffff_8880_dead_0000, 0, 0),
        Err(StacksError::Layout(_))
    ));
}

/// A guest claiming many CPUs (`nr_cpu_ids`, up to 8192; 500 here,
/// as many as this made-up guest has room for) whose per-CPU offsets all alias one area
/// makes one CPU's IRQ, exception and entry stacks listed (and scanned at every pause) once
/// per claimed CPU. The VM's vCPU count bounds the CPUs instead.
#[test]
fn the_vms_vcpu_count_bounds_the_guests_nr_cpu_ids() {
    let mut w = World::new(2);
    w.link();
    const CLAIMED: u32 = 500;
    w.mem.put_u32(NR_CPU_IDS, CLAIMED);
    for cpu in 2..CLAIMED {
        w.mem.put_u64(PER_CPU_OFFSET + u64::from(cpu) * 8, per_cpu_area(1));
    }
    // What the guest's own count gives: every alias listed.
    let unbounded = KernelStacks::read(&w.mem, &layout()).unwrap();
    assert_eq!(unbounded.cpus().len(), CLAIMED as usize);
    let stacks = KernelStacks::read(&w.mem, &layout().bounded_by_vm(2, 1 << 30)).unwrap();
    assert_eq!(stacks.cpus().iter().map(|c| c.cpu).collect::<Vec<_>>(), [0, 1]);
    assert!(stacks.stacks().len() < 16, "{} stacks", stacks.stacks().len());
}

/// The stacks listed may not add up to more than the guest's memory: distinct stacks fit
/// in it, so only aliased or made-up ones could exceed it, and each may be scanned whole.
#[test]
fn the_stacks_listed_are_bounded_by_the_guests_memory() {
    let mut w = World::new(2);
    for pid in 1..=10 {
        w.process(pid, "many");
    }
    w.link();
    let total = KernelStacks::read(&w.mem, &layout()).unwrap().total_bytes();
    assert!(KernelStacks::read(&w.mem, &layout().bounded_by_vm(2, total)).is_ok());
    let err = KernelStacks::read(&w.mem, &layout().bounded_by_vm(2, total - 1)).unwrap_err();
    match err {
        StacksError::OverBudget { structure, limit, .. } => {
            assert!(structure.contains("kernel stacks"), "{structure}");
            assert_eq!(limit, total - 1);
        }
        other => panic!("expected the stack bytes budget, got {other}"),
    }
}

/// More IST stacks per CPU than any `cea_exception_stacks` has is refused.
#[test]
fn exception_stacks_per_cpu_are_limited() {
    let w = World::new(1);
    let mut l = layout();
    l.exception.stacks = (0..=MAX_EXCEPTION_STACKS as u64)
        .map(|i| ExceptionStackSlot {
            name: format!("S{i}"),
            offset: i * 0x2000,
            size: 0x1000,
        })
        .collect();
    let err = KernelStacks::read(&w.mem, &l).unwrap_err();
    assert!(
        matches!(err, StacksError::OverBudget { limit, .. } if limit == MAX_EXCEPTION_STACKS as u64),
        "{err}"
    );
}

/// A 1 MiB exception stack filled with a word in the range: 128 Ki hits, each of which the
/// scan would collect with its owner's name. Over the limit, the scan is an error (nothing
/// proven, the jump is not written) rather than an unbounded list.
#[test]
fn saved_words_found_in_one_scan_are_limited() {
    let mut w = World::new(1);
    w.link();
    let mut l = layout();
    l.exception.stacks[1].size = 1 << 20;
    let db = estacks(0) + l.exception.stacks[1].offset;
    let words: Vec<u8> = std::iter::repeat_n(CODE.to_le_bytes(), (1 << 20) / 8)
        .flatten()
        .collect();
    w.mem.write(db, &words);
    let stacks = KernelStacks::read(&w.mem, &l).unwrap();
    let err = stacks.saved_addresses_in(&w.mem, RANGE).unwrap_err();
    assert!(
        matches!(err, StacksError::OverBudget { limit, .. } if limit == MAX_STACK_HITS as u64),
        "{err}"
    );
}
