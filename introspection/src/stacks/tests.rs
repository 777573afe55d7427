//! The stack walk against a made-up guest: a sparse memory with tasks, lists and per-CPU
//! areas at addresses of our choosing, and a layout written by hand.

use std::collections::HashMap;

use super::*;

/// Sparse guest-virtual memory: 4 KiB pages exist only once mapped or written.
#[derive(Default)]
struct FakeGuest {
    pages: HashMap<u64, Box<[u8; 4096]>>,
}

impl FakeGuest {
    fn map(&mut self, start: u64, len: u64) {
        let mut page = start & !0xfff;
        while page < start + len {
            self.pages.entry(page).or_insert_with(|| Box::new([0; 4096]));
            page += 0x1000;
        }
    }

    fn write(&mut self, at: u64, bytes: &[u8]) {
        self.map(at, bytes.len() as u64);
        for (i, b) in bytes.iter().enumerate() {
            let a = at + i as u64;
            self.pages.get_mut(&(a & !0xfff)).unwrap()[(a & 0xfff) as usize] = *b;
        }
    }

    fn put(&mut self, at: u64, v: u64) {
        self.write(at, &v.to_le_bytes());
    }

    fn put_u32(&mut self, at: u64, v: u32) {
        self.write(at, &v.to_le_bytes());
    }
}

impl GuestVirtRead for FakeGuest {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        let mut done = 0usize;
        while done < buf.len() {
            let a = gva
                .0
                .checked_add(done as u64)
                .ok_or(MemoryError::Wraps { gva, len: buf.len() })?;
            let page = self.pages.get(&(a & !0xfff)).ok_or(MemoryError::Unmapped(Gva(a)))?;
            let off = (a & 0xfff) as usize;
            let n = (0x1000 - off).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&page[off..off + n]);
            done += n;
        }
        Ok(())
    }
}

// task_struct
const PID: u64 = 0x10;
const TGID: u64 = 0x14;
const COMM: u64 = 0x20;
const STACK: u64 = 0x40;
const TASKS: u64 = 0x50;
const THREAD_NODE: u64 = 0x60;
const SIGNAL: u64 = 0x70;
const THREAD_SP: u64 = 0x80;
const ON_CPU: u64 = 0x88;
const GROUP_NODE: u64 = 0x90;
const TASK_SIZE: u64 = 0x100;
// signal_struct
const THREAD_HEAD: u64 = 0x10;
const THREAD_SIZE: u64 = 0x4000;

// per-CPU variables
const CURRENT: u64 = 0x100;
const RQ_IDLE: u64 = 0x200;
const RQ_CFS: u64 = 0x300;
const IRQ_PTR: u64 = 0x400;
const IRQ_INUSE: u64 = 0x408;
const ESTACKS_PTR: u64 = 0x500;
const ENTRY: u64 = 0x1000;
const IRQ_SIZE: u64 = 0x4000;

const INIT_TASK: u64 = 0xffff_ffff_8200_0000;
const INIT_SIGNAL: u64 = 0xffff_ffff_8200_1000;
const PER_CPU_OFFSET: u64 = 0xffff_ffff_8210_0000;
const NR_CPU_IDS: u64 = 0xffff_ffff_8210_1000;
const TASKS_AT: u64 = 0xffff_8880_1000_0000;
const SIGNALS_AT: u64 = 0xffff_8880_2000_0000;
const STACKS_AT: u64 = 0xffff_c900_1000_0000;

fn per_cpu_area(cpu: u32) -> u64 {
    0xffff_8880_0100_0000 + u64::from(cpu) * 0x10_0000
}
fn irq_stack(cpu: u32) -> u64 {
    0xffff_c900_0000_0000 + u64::from(cpu) * 0x1_0000
}
fn estacks(cpu: u32) -> u64 {
    0xffff_fe00_0000_0000 + u64::from(cpu) * 0x2_0000
}

/// The value planted on stacks, and the range a scan looks for.
const CODE: u64 = 0xffff_ffff_8100_1230;
const RANGE: Range<Gva> = Gva(0xffff_ffff_8100_1200)..Gva(0xffff_ffff_8100_1240);

fn layout() -> StacksLayout {
    StacksLayout {
        task: TaskLayout {
            comm_offset: COMM,
            comm_len: 16,
            pid_offset: PID,
            tgid_offset: TGID,
            task_struct_size: TASK_SIZE,
        },
        task_stack: STACK,
        task_tasks: TASKS,
        threads: ThreadLinks::SignalThreadHead {
            signal: SIGNAL,
            thread_head: THREAD_HEAD,
            thread_node: THREAD_NODE,
        },
        task_thread_sp: THREAD_SP,
        task_on_cpu: Some(ON_CPU),
        task_se_group_node: Some(GROUP_NODE),
        thread_size: THREAD_SIZE,
        init_task: Gva(INIT_TASK),
        per_cpu_offset: Gva(PER_CPU_OFFSET),
        cpu_count: CpuCount::Variable(Gva(NR_CPU_IDS)),
        possible_mask: None,
        current_task: CURRENT,
        rq_idle: RQ_IDLE,
        rq_cfs_tasks: Some(RQ_CFS),
        irq: IrqStackLayout {
            ptr: IRQ_PTR,
            inuse: Some(IRQ_INUSE),
            size: IRQ_SIZE,
        },
        exception: ExceptionStacksLayout {
            ptr: ESTACKS_PTR,
            stacks: vec![
                ExceptionStackSlot {
                    name: "NMI".into(),
                    offset: 0x1000,
                    size: 0x2000,
                },
                ExceptionStackSlot {
                    name: "DB".into(),
                    offset: 0x4000,
                    size: 0x2000,
                },
                // Never mapped, as the VC stacks of a kernel without SEV.
                ExceptionStackSlot {
                    name: "VC".into(),
                    offset: 0x7000,
                    size: 0x2000,
                },
            ],
        },
        entry_stack: Some((ENTRY, 0x1000)),
        max_list_steps: 1000,
        max_cpus: MAX_CPUS,
        max_stack_bytes: DEFAULT_MAX_STACK_BYTES,
        rethooks: None,
    }
}

/// A made-up guest: tasks are created, then [`World::link`] writes the lists.
struct World {
    mem: FakeGuest,
    /// Processes in list order (leaders), init_task not included.
    processes: Vec<u64>,
    /// Threads of each signal_struct, leader first.
    threads: Vec<(u64, Vec<u64>)>,
    next: u64,
}

impl World {
    fn new(ncpus: u32) -> World {
        let mut w = World {
            mem: FakeGuest::default(),
            processes: Vec::new(),
            threads: vec![(INIT_SIGNAL, vec![INIT_TASK])],
            next: 0,
        };
        w.mem.put_u32(NR_CPU_IDS, ncpus);
        let init_stack = 0xffff_ffff_81c0_0000;
        w.write_task(INIT_TASK, 0, 0, "swapper/0", Some(init_stack), INIT_SIGNAL);
        for cpu in 0..ncpus {
            let base = per_cpu_area(cpu);
            w.mem.put(PER_CPU_OFFSET + u64::from(cpu) * 8, base);
            w.mem.map(base, 0x2000);
            w.mem.put(base + CURRENT, INIT_TASK);
            let idle = match cpu {
                0 => INIT_TASK,
                _ => {
                    let t = w.alloc_task();
                    let stack = w.alloc_stack(t);
                    w.write_task(t, 0, 0, &format!("swapper/{cpu}"), Some(stack), INIT_SIGNAL);
                    t
                }
            };
            w.mem.put(base + RQ_IDLE, idle);
            let cfs = base + RQ_CFS;
            w.mem.put(cfs, cfs); // empty run queue
            w.mem.map(irq_stack(cpu), IRQ_SIZE);
            w.mem.put(base + IRQ_PTR, irq_stack(cpu) + IRQ_SIZE - 8);
            w.mem.put(base + ESTACKS_PTR, estacks(cpu));
            w.mem.map(estacks(cpu) + 0x1000, 0x2000);
            w.mem.map(estacks(cpu) + 0x4000, 0x2000);
        }
        w
    }

    fn alloc_task(&mut self) -> u64 {
        self.next += 1;
        TASKS_AT + self.next * 0x1000
    }

    fn alloc_stack(&mut self, task: u64) -> u64 {
        let stack = STACKS_AT + (task - TASKS_AT) / 0x1000 * THREAD_SIZE;
        self.mem.map(stack, THREAD_SIZE);
        stack
    }

    /// A sleeping task: on no CPU, saved stack pointer 0x100 below the top.
    fn write_task(&mut self, t: u64, pid: i32, tgid: i32, comm: &str, stack: Option<u64>, signal: u64) {
        self.mem.map(t, TASK_SIZE);
        self.mem.put_u32(t + PID, pid as u32);
        self.mem.put_u32(t + TGID, tgid as u32);
        let mut c = [0u8; 16];
        c[..comm.len()].copy_from_slice(comm.as_bytes());
        self.mem.write(t + COMM, &c);
        self.mem.put(t + STACK, stack.unwrap_or(0));
        self.mem.put(t + SIGNAL, signal);
        if let Some(s) = stack {
            self.mem.map(s, THREAD_SIZE);
            self.mem.put(t + THREAD_SP, s + THREAD_SIZE - 0x100);
        }
        // Links of their own, as INIT_LIST_HEAD leaves them, until link() runs.
        self.mem.put(t + TASKS, t + TASKS);
        self.mem.put(t + THREAD_NODE, t + THREAD_NODE);
    }

    /// A new process with one thread; returns its task.
    fn process(&mut self, pid: i32, comm: &str) -> u64 {
        let t = self.alloc_task();
        let stack = self.alloc_stack(t);
        let signal = SIGNALS_AT + self.next * 0x100;
        self.mem.map(signal, 0x100);
        self.write_task(t, pid, pid, comm, Some(stack), signal);
        self.processes.push(t);
        self.threads.push((signal, vec![t]));
        t
    }

    /// Another thread of `leader`'s process.
    fn thread(&mut self, leader: u64, pid: i32) -> u64 {
        let t = self.alloc_task();
        let stack = self.alloc_stack(t);
        let (signal, _) = *self.threads.iter().find(|(_, ts)| ts[0] == leader).unwrap();
        let (tgid, comm) = (self.read_u32(leader + TGID) as i32, "worker");
        self.write_task(t, pid, tgid, comm, Some(stack), signal);
        self.threads.iter_mut().find(|(s, _)| *s == signal).unwrap().1.push(t);
        t
    }

    /// A task on no list at all (an exiting thread), with a stack.
    fn unlisted(&mut self, pid: i32) -> u64 {
        let t = self.alloc_task();
        let stack = self.alloc_stack(t);
        self.write_task(t, pid, pid, "exiting", Some(stack), INIT_SIGNAL);
        t
    }

    fn read_u32(&self, at: u64) -> u32 {
        self.mem.read_u32(Gva(at)).unwrap()
    }

    fn stack_of(&self, t: u64) -> u64 {
        self.mem.read_u64(Gva(t + STACK)).unwrap()
    }

    /// Writes `next` pointers of a ring through `nodes` (addresses of list_heads) from `head`.
    fn ring(&mut self, head: u64, nodes: &[u64]) {
        let mut prev = head;
        for &n in nodes {
            self.mem.put(prev, n);
            prev = n;
        }
        self.mem.put(prev, head);
    }

    fn link(&mut self) {
        let procs: Vec<u64> = self.processes.iter().map(|p| p + TASKS).collect();
        self.ring(INIT_TASK + TASKS, &procs);
        for (signal, threads) in self.threads.clone() {
            let nodes: Vec<u64> = threads.iter().map(|t| t + THREAD_NODE).collect();
            self.mem.map(signal, 0x100);
            self.ring(signal + THREAD_HEAD, &nodes);
        }
    }

    fn run_on(&mut self, cpu: u32, t: u64) {
        self.mem.put(per_cpu_area(cpu) + CURRENT, t);
        self.mem.put_u32(t + ON_CPU, 1);
    }

    fn read(&self) -> Result<KernelStacks, StacksError> {
        KernelStacks::read(&self.mem, &layout())
    }
}

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
    let mut plant = |mem: &mut FakeGuest, at: u64, hit: bool| {
        mem.put(at, CODE);
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
    w.mem.put(s11 + 0x48, RANGE.end.0);
    w.mem.put(s11 + 0x50, RANGE.start.0 - 1);
    w.mem.put(s11 + 0x58, RANGE.start.0);
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
    w.mem.put(w.stack_of(preempted) + THREAD_SIZE - 0x10, CODE);
    w.mem.put(w.stack_of(exiting) + 0x10, CODE);

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
    w.mem.put(zombie + STACK, 0);
    w.mem.put(odd + THREAD_SP, 0x1234); // not on its stack
    let deep = w.stack_of(odd) + 0x18;
    w.mem.put(deep, CODE);

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
    w.mem.put(c + TASKS, b + TASKS);
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
    w.mem.put(t + THREAD_NODE, t + THREAD_NODE);
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
    w.mem.put(INIT_TASK + TASKS, a + TASKS);
    w.mem.map(a, TASK_SIZE);
    w.mem.put(a + TASKS, a + TASKS);
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
    w.mem.put(p + TASKS, 0x7fff_0000_1000);
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
    w.mem.put(p + TASKS, 0xffff_8880_7000_0050);
    assert!(matches!(w.read().unwrap_err(), StacksError::Memory { .. }));
    // A NULL next.
    let (mut w, p) = fresh();
    w.mem.put(p + TASKS, 0);
    assert!(matches!(
        w.read().unwrap_err(),
        StacksError::BadPointer { value: 0, .. }
    ));
    // A stack not aligned to THREAD_SIZE.
    let (mut w, p) = fresh();
    let s = w.stack_of(p);
    w.mem.put(p + STACK, s + 0x1000);
    assert!(matches!(w.read().unwrap_err(), StacksError::MisalignedStack { .. }));
    // An unmapped stack (task stacks are never skipped).
    let (mut w, p) = fresh();
    w.mem.put(p + STACK, 0xffff_c900_7000_0000);
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
    w.mem.put(PER_CPU_OFFSET, 0x1000);
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
    w.mem.put(mask, 0b101);
    w.mem.put(per_cpu_area(2) + IRQ_PTR, 0);
    w.mem.put(per_cpu_area(2) + ESTACKS_PTR, 0);
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
    w.mem.put(rsp - 8, CODE);
    w.mem.put(rsp, CODE);
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
    w.mem.put(top - 8, s + 0x3800);
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
        w.mem.put(PER_CPU_OFFSET + u64::from(cpu) * 8, per_cpu_area(1));
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
