//! A test fixture (the `test-support` feature): a made-up guest for the stack walk. A
//! [`World`] is a sparse memory with tasks, their lists, run queues and per-CPU areas at
//! addresses of our choosing, read with a [`layout`] written by hand. For the walk's unit
//! tests and its fuzz target (`fuzz/fuzz_targets/guest_stacks.rs`, which patches the guest
//! as a hostile kernel would); nothing else uses it.

use std::ops::Range;

use hvprobe_arch::Gva;

use super::{
    CpuCount, ExceptionStackSlot, ExceptionStacksLayout, IrqStackLayout, KernelStacks, StacksError, StacksLayout,
    ThreadLinks, DEFAULT_MAX_STACK_BYTES, MAX_CPUS,
};
use crate::memory::{GuestVirtRead, SparseMemory};
use crate::task::TaskLayout;

// task_struct
pub const PID: u64 = 0x10;
pub const TGID: u64 = 0x14;
pub const COMM: u64 = 0x20;
pub const STACK: u64 = 0x40;
pub const TASKS: u64 = 0x50;
pub const THREAD_NODE: u64 = 0x60;
pub const SIGNAL: u64 = 0x70;
pub const THREAD_SP: u64 = 0x80;
pub const ON_CPU: u64 = 0x88;
pub const GROUP_NODE: u64 = 0x90;
pub const TASK_SIZE: u64 = 0x100;
// signal_struct
pub const THREAD_HEAD: u64 = 0x10;
pub const THREAD_SIZE: u64 = 0x4000;

// per-CPU variables
pub const CURRENT: u64 = 0x100;
pub const RQ_IDLE: u64 = 0x200;
pub const RQ_CFS: u64 = 0x300;
pub const IRQ_PTR: u64 = 0x400;
pub const IRQ_INUSE: u64 = 0x408;
pub const ESTACKS_PTR: u64 = 0x500;
pub const ENTRY: u64 = 0x1000;
pub const IRQ_SIZE: u64 = 0x4000;

pub const INIT_TASK: u64 = 0xffff_ffff_8200_0000;
pub const INIT_SIGNAL: u64 = 0xffff_ffff_8200_1000;
pub const PER_CPU_OFFSET: u64 = 0xffff_ffff_8210_0000;
pub const NR_CPU_IDS: u64 = 0xffff_ffff_8210_1000;
pub const TASKS_AT: u64 = 0xffff_8880_1000_0000;
pub const SIGNALS_AT: u64 = 0xffff_8880_2000_0000;
pub const STACKS_AT: u64 = 0xffff_c900_1000_0000;

/// CPU `cpu`'s per-CPU area.
pub fn per_cpu_area(cpu: u32) -> u64 {
    0xffff_8880_0100_0000 + u64::from(cpu) * 0x10_0000
}

/// CPU `cpu`'s IRQ stack (its lowest address).
pub fn irq_stack(cpu: u32) -> u64 {
    0xffff_c900_0000_0000 + u64::from(cpu) * 0x1_0000
}

/// CPU `cpu`'s exception stacks (`cea_exception_stacks`).
pub fn estacks(cpu: u32) -> u64 {
    0xffff_fe00_0000_0000 + u64::from(cpu) * 0x2_0000
}

/// The value planted on stacks, and the range a scan looks for.
pub const CODE: u64 = 0xffff_ffff_8100_1230;
pub const RANGE: Range<Gva> = Gva(0xffff_ffff_8100_1200)..Gva(0xffff_ffff_8100_1240);

/// The layout of a [`World`]'s kernel: NMI and DB exception stacks, and a VC slot that
/// is never mapped (as on a kernel without SEV).
pub fn layout() -> StacksLayout {
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
pub struct World {
    pub mem: SparseMemory,
    /// Processes in list order (leaders), init_task not included.
    processes: Vec<u64>,
    /// Threads of each signal_struct, leader first.
    threads: Vec<(u64, Vec<u64>)>,
    next: u64,
}

impl World {
    /// `ncpus` CPUs (`nr_cpu_ids`), each with its per-CPU area, an idle task (init_task
    /// on CPU 0), an empty CFS run queue, an IRQ stack not in use and mapped NMI and DB
    /// stacks; init_task is every CPU's current task.
    pub fn new(ncpus: u32) -> World {
        let mut w = World {
            mem: SparseMemory::new(),
            processes: Vec::new(),
            threads: vec![(INIT_SIGNAL, vec![INIT_TASK])],
            next: 0,
        };
        w.mem.put_u32(NR_CPU_IDS, ncpus);
        let init_stack = 0xffff_ffff_81c0_0000;
        w.write_task(INIT_TASK, 0, 0, "swapper/0", Some(init_stack), INIT_SIGNAL);
        for cpu in 0..ncpus {
            let base = per_cpu_area(cpu);
            w.mem.put_u64(PER_CPU_OFFSET + u64::from(cpu) * 8, base);
            w.mem.map(base, 0x2000);
            w.mem.put_u64(base + CURRENT, INIT_TASK);
            let idle = match cpu {
                0 => INIT_TASK,
                _ => {
                    let t = w.alloc_task();
                    let stack = w.alloc_stack(t);
                    w.write_task(t, 0, 0, &format!("swapper/{cpu}"), Some(stack), INIT_SIGNAL);
                    t
                }
            };
            w.mem.put_u64(base + RQ_IDLE, idle);
            let cfs = base + RQ_CFS;
            w.mem.put_u64(cfs, cfs); // empty run queue
            w.mem.map(irq_stack(cpu), IRQ_SIZE);
            w.mem.put_u64(base + IRQ_PTR, irq_stack(cpu) + IRQ_SIZE - 8);
            w.mem.put_u64(base + ESTACKS_PTR, estacks(cpu));
            w.mem.map(estacks(cpu) + 0x1000, 0x2000);
            w.mem.map(estacks(cpu) + 0x4000, 0x2000);
        }
        w
    }

    pub fn alloc_task(&mut self) -> u64 {
        self.next += 1;
        TASKS_AT + self.next * 0x1000
    }

    pub fn alloc_stack(&mut self, task: u64) -> u64 {
        let stack = STACKS_AT + (task - TASKS_AT) / 0x1000 * THREAD_SIZE;
        self.mem.map(stack, THREAD_SIZE);
        stack
    }

    /// A sleeping task: on no CPU, saved stack pointer 0x100 below the top.
    pub fn write_task(&mut self, t: u64, pid: i32, tgid: i32, comm: &str, stack: Option<u64>, signal: u64) {
        self.mem.map(t, TASK_SIZE);
        self.mem.put_u32(t + PID, pid as u32);
        self.mem.put_u32(t + TGID, tgid as u32);
        let mut c = [0u8; 16];
        c[..comm.len()].copy_from_slice(comm.as_bytes());
        self.mem.write(t + COMM, &c);
        self.mem.put_u64(t + STACK, stack.unwrap_or(0));
        self.mem.put_u64(t + SIGNAL, signal);
        if let Some(s) = stack {
            self.mem.map(s, THREAD_SIZE);
            self.mem.put_u64(t + THREAD_SP, s + THREAD_SIZE - 0x100);
        }
        // Links of their own, as INIT_LIST_HEAD leaves them, until link() runs.
        self.mem.put_u64(t + TASKS, t + TASKS);
        self.mem.put_u64(t + THREAD_NODE, t + THREAD_NODE);
    }

    /// A new process with one thread; returns its task.
    pub fn process(&mut self, pid: i32, comm: &str) -> u64 {
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
    pub fn thread(&mut self, leader: u64, pid: i32) -> u64 {
        let t = self.alloc_task();
        let stack = self.alloc_stack(t);
        let (signal, _) = *self.threads.iter().find(|(_, ts)| ts[0] == leader).unwrap();
        let (tgid, comm) = (self.read_u32(leader + TGID) as i32, "worker");
        self.write_task(t, pid, tgid, comm, Some(stack), signal);
        self.threads.iter_mut().find(|(s, _)| *s == signal).unwrap().1.push(t);
        t
    }

    /// A task on no list at all (an exiting thread), with a stack.
    pub fn unlisted(&mut self, pid: i32) -> u64 {
        let t = self.alloc_task();
        let stack = self.alloc_stack(t);
        self.write_task(t, pid, pid, "exiting", Some(stack), INIT_SIGNAL);
        t
    }

    pub fn read_u32(&self, at: u64) -> u32 {
        self.mem.read_u32(Gva(at)).unwrap()
    }

    pub fn stack_of(&self, t: u64) -> u64 {
        self.mem.read_u64(Gva(t + STACK)).unwrap()
    }

    /// The signal_struct of task `t`.
    pub fn signal_of(&self, t: u64) -> u64 {
        self.mem.read_u64(Gva(t + SIGNAL)).unwrap()
    }

    /// Writes `next` pointers of a ring through `nodes` (addresses of list_heads) from `head`.
    pub fn ring(&mut self, head: u64, nodes: &[u64]) {
        let mut prev = head;
        for &n in nodes {
            self.mem.put_u64(prev, n);
            prev = n;
        }
        self.mem.put_u64(prev, head);
    }

    /// Writes the task list (init_task, then the processes) and each thread list.
    pub fn link(&mut self) {
        let procs: Vec<u64> = self.processes.iter().map(|p| p + TASKS).collect();
        self.ring(INIT_TASK + TASKS, &procs);
        for (signal, threads) in self.threads.clone() {
            let nodes: Vec<u64> = threads.iter().map(|t| t + THREAD_NODE).collect();
            self.mem.map(signal, 0x100);
            self.ring(signal + THREAD_HEAD, &nodes);
        }
    }

    /// Makes `t` the task running on `cpu`.
    pub fn run_on(&mut self, cpu: u32, t: u64) {
        self.mem.put_u64(per_cpu_area(cpu) + CURRENT, t);
        self.mem.put_u32(t + ON_CPU, 1);
    }

    /// The stacks as the walk reads them with [`layout`].
    pub fn read(&self) -> Result<KernelStacks, StacksError> {
        KernelStacks::read(&self.mem, &layout())
    }
}
