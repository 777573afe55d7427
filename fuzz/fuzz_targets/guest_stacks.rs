//! Fuzzes the walk of every kernel stack (`hvprobe_introspection::stacks`): the task list,
//! thread lists, run queues, per-CPU areas, IRQ, exception and entry stacks, all guest
//! memory; then the scan of those stacks for saved addresses, and the narrowing to a
//! paused vCPU's registers.
//!
//! A valid guest is built (`stacks::synthetic`, the unit tests' guest: 2 CPUs, `init_task`
//! and CPU 1's idle task, three processes, one with a second thread, per-CPU areas and
//! stacks) with a layout as the BTF gives it, bounded as the host bounds it (2 vCPUs,
//! 256 MiB of memory). Input: `[claimed nr_cpu_ids: u16] [cpl: u8] [rsp
//! offset: u16]`, then patches (see `guest_common.rs`; regions: init_task, the per-CPU
//! offsets and nr_cpu_ids, the task and signal areas, each CPU's per-CPU area, stacks).
//! Checked: no panic, and what is listed stays within the bounds: CPUs at most the VM's,
//! stack bytes at most its memory, hits at most `MAX_STACK_HITS`.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::Gva;
use hvprobe_introspection::stacks::synthetic::{
    estacks, irq_stack, layout, per_cpu_area, World, CODE, INIT_TASK, IRQ_SIZE, NR_CPU_IDS, PER_CPU_OFFSET, THREAD_SIZE,
};
use hvprobe_introspection::stacks::{KernelStacks, MAX_STACK_HITS};
use libfuzzer_sys::fuzz_target;

const VCPUS: u32 = 2;
const MEMORY: u64 = 256 << 20;

/// The guest (`stacks::synthetic`): three processes, the first with a second thread and
/// running on CPU 1, and the saved address [`CODE`] on every task stack and each CPU's NMI
/// stack. Returns it with the processes.
fn build() -> (World, Vec<u64>) {
    let mut w = World::new(VCPUS);
    let procs: Vec<u64> = (1..=3).map(|pid| w.process(pid, "task")).collect();
    let extra_thread = w.thread(procs[0], 10);
    w.link();
    w.run_on(1, procs[0]);
    for t in [INIT_TASK, procs[0], procs[1], procs[2], extra_thread] {
        let stack = w.stack_of(t);
        w.mem.put_u64(stack + THREAD_SIZE - 0x80, CODE);
    }
    for cpu in 0..VCPUS {
        w.mem.put_u64(estacks(cpu) + 0x1000 + 0x100, CODE);
    }
    (w, procs)
}

fuzz_target!(|data: &[u8]| {
    let (mut w, procs) = build();
    let first_stack = w.stack_of(procs[0]);
    let bases = [
        INIT_TASK,
        PER_CPU_OFFSET,
        procs[0],
        procs[2],
        w.signal_of(procs[0]),
        per_cpu_area(0),
        per_cpu_area(1),
        first_stack,
        estacks(0),
        irq_stack(1) + IRQ_SIZE - 0x100,
    ];
    let mut input = Input::new(data);
    let claimed = input.u16();
    if claimed != 0 {
        w.mem.put_u32(NR_CPU_IDS, u32::from(claimed));
    }
    let cpl = input.u8() & 3;
    let rsp = first_stack + u64::from(input.u16());
    input.patch(&mut w.mem, &bases);
    let mem = w.mem;
    let layout = layout().bounded_by_vm(VCPUS, MEMORY);
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
