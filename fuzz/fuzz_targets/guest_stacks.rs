//! Fuzzes the walk of every kernel stack (`hvprobe_introspection::stacks`): the task list,
//! thread lists, run queues, per-CPU areas, IRQ, exception and entry stacks, all guest
//! memory; then the scan of those stacks for saved addresses, and the narrowing to a
//! paused vCPU's registers.
//!
//! A valid guest is built (2 CPUs, `init_task`, three processes, one with a second thread,
//! per-CPU areas and stacks) with a layout as the BTF gives it, bounded as the host bounds
//! it (2 vCPUs, 256 MiB of memory). Input: `[claimed nr_cpu_ids: u16] [cpl: u8] [rsp
//! offset: u16]`, then patches (see `guest_common.rs`; regions: init_task, the per-CPU
//! offsets and nr_cpu_ids, the task and signal areas, each CPU's per-CPU area, stacks).
//! Checked: no panic, and what is listed stays within the bounds: CPUs at most the VM's,
//! stack bytes at most its memory, hits at most `MAX_STACK_HITS`.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::Gva;
use hvprobe_introspection::memory::SparseMemory;
use hvprobe_introspection::stacks::{
    CpuCount, ExceptionStackSlot, ExceptionStacksLayout, IrqStackLayout, KernelStacks, StacksLayout, ThreadLinks,
    MAX_STACK_HITS,
};
use hvprobe_introspection::task::TaskLayout;
use libfuzzer_sys::fuzz_target;

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
const THREAD_HEAD: u64 = 0x10;
const THREAD_SIZE: u64 = 0x4000;
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
const CODE: u64 = 0xffff_ffff_8100_1230;
const VCPUS: u32 = 2;
const MEMORY: u64 = 256 << 20;

fn per_cpu_area(cpu: u64) -> u64 {
    0xffff_8880_0100_0000 + cpu * 0x10_0000
}
fn irq_stack(cpu: u64) -> u64 {
    0xffff_c900_0000_0000 + cpu * 0x1_0000
}
fn estacks(cpu: u64) -> u64 {
    0xffff_fe00_0000_0000 + cpu * 0x2_0000
}

fn layout() -> StacksLayout {
    StacksLayout {
        task: TaskLayout {
            comm_offset: COMM,
            comm_len: 16,
            pid_offset: PID,
            tgid_offset: TGID,
            task_struct_size: 0x100,
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
            ],
        },
        entry_stack: Some((ENTRY, 0x1000)),
        max_list_steps: 10_000,
        max_cpus: 8192,
        max_stack_bytes: u64::MAX,
        rethooks: None,
    }
    .bounded_by_vm(VCPUS, MEMORY)
}

fn task(mem: &mut SparseMemory, t: u64, pid: u32, signal: u64, stack: u64) {
    mem.write(t, &[0; 0x100]);
    mem.put_u32(t + PID, pid);
    mem.put_u32(t + TGID, pid);
    mem.write(t + COMM, b"task\0");
    mem.put_u64(t + STACK, stack);
    mem.put_u64(t + SIGNAL, signal);
    mem.write(stack, &[0; THREAD_SIZE as usize]);
    mem.put_u64(t + THREAD_SP, stack + THREAD_SIZE - 0x100);
    mem.put_u64(stack + THREAD_SIZE - 0x80, CODE);
    mem.put_u64(t + GROUP_NODE, t + GROUP_NODE);
}

/// Writes a ring of `next` pointers from `head` through `nodes`.
fn ring(mem: &mut SparseMemory, head: u64, nodes: &[u64]) {
    let mut prev = head;
    for &n in nodes {
        mem.put_u64(prev, n);
        prev = n;
    }
    mem.put_u64(prev, head);
}

fn build(mem: &mut SparseMemory) {
    mem.put_u32(NR_CPU_IDS, VCPUS);
    task(mem, INIT_TASK, 0, INIT_SIGNAL, 0xffff_ffff_81c0_0000);
    let procs: Vec<u64> = (1..=3).map(|i| TASKS_AT + i * 0x1000).collect();
    let extra_thread = TASKS_AT + 4 * 0x1000;
    for (i, &p) in procs.iter().enumerate() {
        let signal = SIGNALS_AT + i as u64 * 0x100;
        task(mem, p, i as u32 + 1, signal, STACKS_AT + i as u64 * THREAD_SIZE);
    }
    task(mem, extra_thread, 10, SIGNALS_AT, STACKS_AT + 3 * THREAD_SIZE);
    ring(
        mem,
        INIT_TASK + TASKS,
        &procs.iter().map(|p| p + TASKS).collect::<Vec<_>>(),
    );
    ring(mem, INIT_SIGNAL + THREAD_HEAD, &[INIT_TASK + THREAD_NODE]);
    for (i, &p) in procs.iter().enumerate() {
        let mut nodes = vec![p + THREAD_NODE];
        if i == 0 {
            nodes.push(extra_thread + THREAD_NODE);
        }
        ring(mem, SIGNALS_AT + i as u64 * 0x100 + THREAD_HEAD, &nodes);
    }
    for cpu in 0..u64::from(VCPUS) {
        let base = per_cpu_area(cpu);
        mem.put_u64(PER_CPU_OFFSET + cpu * 8, base);
        mem.write(base, &[0; 0x2000]);
        mem.put_u64(base + CURRENT, if cpu == 0 { INIT_TASK } else { procs[0] });
        mem.put_u64(base + RQ_IDLE, INIT_TASK);
        mem.put_u64(base + RQ_CFS, base + RQ_CFS);
        mem.write(irq_stack(cpu), &[0; IRQ_SIZE as usize]);
        mem.put_u64(base + IRQ_PTR, irq_stack(cpu) + IRQ_SIZE - 8);
        mem.put_u64(base + ESTACKS_PTR, estacks(cpu));
        mem.write(estacks(cpu) + 0x1000, &[0; 0x2000]);
        mem.put_u64(estacks(cpu) + 0x1000 + 0x100, CODE);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut mem = SparseMemory::new();
    build(&mut mem);
    let mut input = Input::new(data);
    let claimed = input.u16();
    if claimed != 0 {
        mem.put_u32(NR_CPU_IDS, u32::from(claimed));
    }
    let cpl = input.u8() & 3;
    let rsp = STACKS_AT + u64::from(input.u16());
    input.patch(
        &mut mem,
        &[
            INIT_TASK,
            PER_CPU_OFFSET,
            TASKS_AT + 0x1000,
            TASKS_AT + 0x3000,
            SIGNALS_AT,
            per_cpu_area(0),
            per_cpu_area(1),
            STACKS_AT,
            estacks(0),
            irq_stack(1) + IRQ_SIZE - 0x100,
        ],
    );
    let layout = layout();
    let Ok(mut stacks) = KernelStacks::read(&mem, &layout) else {
        return;
    };
    assert!(stacks.cpus().len() <= VCPUS as usize);
    assert!(stacks.total_bytes() <= MEMORY);
    if let Some(cpu) = stacks.cpus().first().cloned() {
        let _ = stacks.narrow_to_vcpu(&mem, cpu.per_cpu_base, cpl, rsp);
    }
    if let Ok(hits) = stacks.saved_addresses_in(&mem, Gva(CODE - 0x30)..Gva(CODE + 0x10)) {
        assert!(hits.len() <= MAX_STACK_HITS);
    }
});
