//! The exit loop on real KVM, driven by tiny long-mode code blobs (no kernel): guest-owned
//! #BP re-injection, and pause/resume of spinning vCPUs.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_arch::Gva;
use hvprobe_vmm::{BreakpointDisposition, DebugHandler, NoProbes, StopReason, CODE_BLOB_START};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use common::blob_vm;

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
    let vm = blob_vm(BREAKPOINT_BLOB, 1, &[(BP_VECTOR, 0x10)]);
    let backend = vm.backend();
    let handler = GuestOwnsEveryInt3 {
        raise_on_breakpoint: None,
    };
    let outcome = vm.run_for(Arc::new(handler), Duration::from_secs(20)).expect("run");
    assert_eq!(
        outcome.reason,
        StopReason::GuestExit(0x41),
        "guest #BP handler saw the wrong return address ({backend})"
    );
    // The int3 exited to us (on hardware KVM because we asked for int3 exits) and we gave
    // it back.
    assert_eq!(outcome.breakpoints_reinjected, 1);
}

const BP_VECTOR: u8 = 3;
const PENDING_VECTOR: u8 = 0x30;

/// An int3 given back to the guest while an interrupt is pending, as when the guest's
/// timer fires while its vCPU is out to us on the int3. The blob enables its local APIC
/// (x2APIC), runs with interrupts on, hits an int3, waits for one interrupt on vector 0x30
/// and reports `0x10 * interrupts + BL`, BL as in BREAKPOINT_BLOB (0x41: the #BP handler
/// ran and saw the return address after the int3). The test's handler makes vector 0x30
/// pending in the APIC during the int3's exit. Under nested SVM without nrips, KVM's
/// delivery of the #BP lost it to the interrupt (0x10): when we injected it, and when we
/// queued it as pending but its delivery exited on the first touch of the IDT's page (KVM
/// re-queues it itself). The VMM now delivers a kernel #BP itself.
const BREAKPOINT_WITH_PENDING_IRQ_BLOB: &[u8] = &[
    0xfa, // 0x00: cli
    0xb9, 0x1b, 0x00, 0x00, 0x00, // mov $0x1b,%ecx  (IA32_APIC_BASE)
    0x0f, 0x32, // rdmsr
    0x0d, 0x00, 0x0c, 0x00, 0x00, // or $0xc00,%eax  (enabled, x2APIC mode)
    0x0f, 0x30, // wrmsr
    0xb9, 0x0f, 0x08, 0x00, 0x00, // mov $0x80f,%ecx  (x2APIC SVR)
    0xb8, 0xff, 0x01, 0x00, 0x00, // mov $0x1ff,%eax  (software-enabled)
    0x31, 0xd2, // xor %edx,%edx
    0x0f, 0x30, // wrmsr
    0x31, 0xdb, // xor %ebx,%ebx
    0x31, 0xf6, // xor %esi,%esi  (interrupts taken)
    0xfb, // sti
    0x90, // nop  (out of the STI shadow)
    0xcc, // 0x23: int3
    0x85, 0xf6, // 0x24: test %esi,%esi
    0x74, 0xfc, // je 0x24
    0x89, 0xf0, // mov %esi,%eax
    0xc1, 0xe0, 0x04, // shl $0x4,%eax
    0x00, 0xd8, // add %bl,%al
    0x66, 0xba, 0xf1, 0x0e, // mov $0xef1,%dx  (guest exit port)
    0xee, // out %al,(%dx)
    0xf4, // hlt
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // pad
    0x48, 0x8b, 0x04, 0x24, // 0x40: mov (%rsp),%rax  (#BP handler: the pushed RIP)
    0x48, 0xc7, 0xc1, 0x24, 0x00, 0x10, 0x00, // mov $0x100024,%rcx
    0x31, 0xdb, // xor %ebx,%ebx
    0x48, 0x39, 0xc8, // cmp %rcx,%rax
    0x0f, 0x94, 0xc3, // sete %bl
    0x80, 0xc3, 0x40, // add $0x40,%bl
    0x48, 0xcf, // iretq
    0, 0, 0, 0, 0, 0, 0, 0, // pad
    0xff, 0xc6, // 0x60: inc %esi  (interrupt handler)
    0xb9, 0x0b, 0x08, 0x00, 0x00, // mov $0x80b,%ecx  (x2APIC EOI)
    0x31, 0xc0, // xor %eax,%eax
    0x31, 0xd2, // xor %edx,%edx
    0x0f, 0x30, // wrmsr
    0x48, 0xcf, // iretq
];

#[test]
fn guest_owned_int3_with_an_interrupt_pending_reaches_the_guest_before_the_interrupt() {
    assert_eq!(BREAKPOINT_WITH_PENDING_IRQ_BLOB[0x23], 0xcc, "the blob's layout moved");
    assert_eq!(BREAKPOINT_WITH_PENDING_IRQ_BLOB[0x40], 0x48, "the blob's layout moved");
    assert_eq!(BREAKPOINT_WITH_PENDING_IRQ_BLOB[0x60], 0xff, "the blob's layout moved");
    for run in 0..20 {
        let vm = blob_vm(
            BREAKPOINT_WITH_PENDING_IRQ_BLOB,
            1,
            &[(BP_VECTOR, 0x40), (PENDING_VECTOR, 0x60)],
        );
        let handler = GuestOwnsEveryInt3 {
            raise_on_breakpoint: Some(PENDING_VECTOR),
        };
        let outcome = vm.run_for(Arc::new(handler), Duration::from_secs(20)).expect("run");
        assert_eq!(
            outcome.reason,
            StopReason::GuestExit(0x51),
            "run {run}: want the #BP handler with the native return address (0x41) and one \
             interrupt (+0x10); 0x10 means the #BP was lost to the interrupt"
        );
        assert_eq!(outcome.breakpoints_reinjected, 1, "run {run}");
    }
}

/// Asks for every int3 (as a probe engine does) and gives each back to the guest; first
/// makes `raise_on_breakpoint` pending in the vCPU's local APIC, if set.
struct GuestOwnsEveryInt3 {
    raise_on_breakpoint: Option<u8>,
}

impl DebugHandler for GuestOwnsEveryInt3 {
    fn on_breakpoint(&self, _cpu: usize, vcpu: &mut VcpuFd, _at: Gva) -> BreakpointDisposition {
        if let Some(vector) = self.raise_on_breakpoint {
            // The APIC's IRR: 8 registers of 32 bits, 16 bytes apart, from offset 0x200.
            let mut lapic = vcpu.get_lapic().expect("KVM_GET_LAPIC");
            let offset = 0x200 + usize::from(vector / 32) * 0x10;
            let mut irr = u32::from_le_bytes(std::array::from_fn(|i| lapic.regs[offset + i] as u8));
            irr |= 1 << (vector % 32);
            for (i, b) in irr.to_le_bytes().into_iter().enumerate() {
                lapic.regs[offset + i] = b as _;
            }
            vcpu.set_lapic(&lapic).expect("KVM_SET_LAPIC");
        }
        BreakpointDisposition::GuestOwned
    }
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
    let vm = blob_vm(SPIN_BLOB, 2, &[]);
    let mem = vm.memory().clone();
    let control = vm.control();
    let runner = std::thread::spawn(move || vm.run(Arc::new(NoProbes)));

    wait_until("both vCPUs spin", || counters(&mem).iter().all(|c| *c > 0));
    for round in 0..5 {
        let started = Instant::now();
        let paused = control.pause_all().unwrap();
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
    let vm = blob_vm(SPIN_BLOB, 2, &[]);
    let mem = vm.memory().clone();
    let control = vm.control();
    let runner = std::thread::spawn(move || vm.run(Arc::new(NoProbes)));
    wait_until("both vCPUs spin", || counters(&mem).iter().all(|c| *c > 0));
    let outer = control.pause_all().unwrap();
    let inner = control.pause_all().unwrap();
    let frozen = counters(&mem);
    drop(inner);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(counters(&mem), frozen, "vCPUs ran while the outer pause was held");
    drop(outer);
    wait_until("vCPUs run after the last resume", || counters(&mem)[0] > frozen[0]);
    control.stop(StopReason::Stopped);
    runner.join().expect("run thread").expect("run");
}
