//! The exit loop on real KVM, driven by tiny long-mode code blobs (no kernel): guest-owned
//! #BP re-injection, and pause/resume of spinning vCPUs.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_vmm::{Backend, CodeBlob, NoProbes, StopReason, Vm, CODE_BLOB_START};
use vm_memory::{Bytes, GuestAddress};

fn blob_vm(code: &[u8], cpus: u8, breakpoint_handler: Option<u64>) -> Vm {
    Vm::new_code_blob(&CodeBlob {
        code: code.to_vec(),
        cpus,
        breakpoint_handler,
    })
    .unwrap_or_else(|e| panic!("this test needs a usable /dev/kvm: {e}"))
}

/// `int3`, then report BL as the exit status. The guest's own #BP handler sets BL to 0x41
/// when the return address it finds on its stack is the byte after the int3 (what a CPU
/// without a hypervisor pushes), 0x40 otherwise; BL stays 0 if the handler never runs.
const BREAKPOINT_BLOB: &[u8] = &[
    0xcc, // 0x00: int3
    0x66, 0xba, 0xf1, 0x0e, // mov $0xef1,%dx   (guest exit port)
    0x88, 0xd8, // mov %bl,%al
    0xee, // out %al,(%dx)
    0xf4, // hlt
    0, 0, 0, 0, 0, 0, 0, // pad to the handler
    0x48, 0x8b, 0x04, 0x24, // 0x10: mov (%rsp),%rax   (the pushed RIP)
    0x48, 0xc7, 0xc1, 0x01, 0x00, 0x10, 0x00, // mov $0x100001,%rcx
    0x31, 0xdb, // xor %ebx,%ebx
    0x48, 0x39, 0xc8, // cmp %rcx,%rax
    0x0f, 0x94, 0xc3, // sete %bl
    0x80, 0xc3, 0x40, // add $0x40,%bl
    0x48, 0xcf, // iretq
];

#[test]
fn guest_owned_int3_reaches_the_guest_handler_with_the_native_return_address() {
    assert_eq!(CODE_BLOB_START + 1, 0x100001, "the blob hard-codes its load address");
    let vm = blob_vm(BREAKPOINT_BLOB, 1, Some(0x10));
    let backend = vm.backend();
    let outcome = run_with_watchdog(vm, Duration::from_secs(20));
    assert_eq!(
        outcome.reason,
        StopReason::GuestExit(0x41),
        "guest #BP handler saw the wrong return address"
    );
    if backend == Backend::Pvm {
        // On kvm_pvm every CPL0 int3 exits to us; we must have re-injected this one.
        assert_eq!(outcome.breakpoints_reinjected, 1);
    }
}

/// Runs a VM to its end, stopping it if it has not ended after `limit` (a re-injection
/// bug can loop on the int3 forever).
fn run_with_watchdog(vm: Vm, limit: Duration) -> hvprobe_vmm::VmOutcome {
    let control = vm.control();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        let outcome = vm.run(Arc::new(NoProbes));
        let _ = done_tx.send(());
        outcome
    });
    if done_rx.recv_timeout(limit).is_err() {
        control.stop(StopReason::Stopped);
    }
    runner.join().expect("run thread").expect("run")
}

/// Each vCPU increments its own counter at 0x3000 + 8 * index, forever.
const SPIN_BLOB: &[u8] = &[
    0x48, 0xff, 0x04, 0xfd, 0x00, 0x30, 0x00, 0x00, // incq 0x3000(,%rdi,8)
    0xeb, 0xf6, // jmp back
];

fn counters(mem: &vm_memory::GuestMemoryMmap) -> [u64; 2] {
    [
        mem.read_obj(GuestAddress(0x3000)).unwrap(),
        mem.read_obj(GuestAddress(0x3008)).unwrap(),
    ]
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pause_parks_both_spinning_vcpus_and_resume_restarts_them() {
    let vm = blob_vm(SPIN_BLOB, 2, None);
    let mem = vm.memory().clone();
    let control = vm.control();
    let runner = std::thread::spawn(move || vm.run(Arc::new(NoProbes)));

    wait_until("both vCPUs spin", || counters(&mem).iter().all(|c| *c > 0));
    for round in 0..5 {
        let started = Instant::now();
        let paused = control.pause_all();
        let pause_latency = started.elapsed();
        let frozen = counters(&mem);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(counters(&mem), frozen, "round {round}: a paused vCPU ran");
        for cpu in 0..2 {
            let rip = paused.regs(cpu).expect("parked vCPU publishes its registers").rip;
            assert!(
                (CODE_BLOB_START..CODE_BLOB_START + SPIN_BLOB.len() as u64).contains(&rip),
                "vCPU {cpu} parked at {rip:#x}, outside the loop"
            );
        }
        assert!(pause_latency < Duration::from_secs(1), "pause took {pause_latency:?}");
        drop(paused);
        wait_until("both vCPUs run again", || {
            let now = counters(&mem);
            now[0] > frozen[0] && now[1] > frozen[1]
        });
    }
    control.stop(StopReason::Stopped);
    let outcome = runner.join().expect("run thread").expect("run");
    assert_eq!(outcome.reason, StopReason::Stopped);
    // A code blob never enables kvm-clock: KVM_KVMCLOCK_CTRL fails (EINVAL) and the pauses
    // work all the same.
    assert_eq!(control.counters.kvmclock_pauses.load(Ordering::Relaxed), 0);
}

#[test]
fn nested_pauses_keep_vcpus_parked_until_the_last_resume() {
    let vm = blob_vm(SPIN_BLOB, 2, None);
    let mem = vm.memory().clone();
    let control = vm.control();
    let runner = std::thread::spawn(move || vm.run(Arc::new(NoProbes)));
    wait_until("both vCPUs spin", || counters(&mem).iter().all(|c| *c > 0));
    let outer = control.pause_all();
    let inner = control.pause_all();
    let frozen = counters(&mem);
    drop(inner);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(counters(&mem), frozen, "vCPUs ran while the outer pause was held");
    drop(outer);
    wait_until("vCPUs run after the last resume", || counters(&mem)[0] > frozen[0]);
    control.stop(StopReason::Stopped);
    runner.join().expect("run thread").expect("run");
}
