//! A debug handler that panics in a vCPU thread stops the VM with that panic as the reason:
//! the other vCPUs stop, and nothing touches the dead thread's `kvm_run` or signals it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use hvprobe_arch::Gva;
use hvprobe_vmm::{BreakpointDisposition, DebugHandler, GuestEvent, StopReason, Vm, VmOutcome};
use kvm_ioctls::VcpuFd;

use common::blob_vm;

/// vCPU 0 hits an int3; every other vCPU spins (a vCPU the panic must stop).
const INT3_ON_VCPU0_BLOB: &[u8] = &[
    0x48, 0x85, 0xff, // test %rdi,%rdi
    0x75, 0x01, // jnz spin
    0xcc, // int3
    0xeb, 0xfe, // spin: jmp spin
];

/// Signals guest event 1 ("/init reached") on the event port, then spins.
const GUEST_EVENT_BLOB: &[u8] = &[
    0x66, 0xba, 0xf0, 0x0e, // mov $0xef0,%dx   (guest event port)
    0xb0, 0x01, // mov $1,%al
    0xee, // out %al,(%dx)
    0xeb, 0xfe, // spin: jmp spin
];

struct PanickingHandler;

impl DebugHandler for PanickingHandler {
    fn on_breakpoint(&self, cpu: usize, _vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition {
        panic!("handler bug at {:#x} on vCPU {cpu}", at.0);
    }

    fn on_guest_event(&self, cpu: usize, event: GuestEvent) {
        panic!("handler bug at {event:?} on vCPU {cpu}");
    }
}

/// Runs the VM in a thread; a run that has not ended after `limit` is stopped from
/// outside (the second value says so), and one that does not end even then (its vCPU
/// threads hang) fails the test.
fn run_with_limit(vm: Vm, limit: Duration) -> (VmOutcome, bool) {
    let control = vm.control();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(vm.run(Arc::new(PanickingHandler)));
    });
    let (outcome, stopped_from_outside) = match done_rx.recv_timeout(limit) {
        Ok(outcome) => (outcome, false),
        Err(_) => {
            control.stop(StopReason::Stopped);
            let outcome = done_rx
                .recv_timeout(Duration::from_secs(5))
                .unwrap_or_else(|_| panic!("the VM did not stop within {limit:?}, nor after a stop"));
            (outcome, true)
        }
    };
    (outcome.expect("run"), stopped_from_outside)
}

/// Far beyond what the run takes (a few ms natively; 6.6 s once in the nested-SVM lane's
/// L1 on a loaded host, which a 5 s bound on the run's time failed): the run must end by the
/// handler's panic, not by the stop after it.
const LIMIT: Duration = Duration::from_secs(120);

fn panicking_handler_stops_the_vm(blob: &[u8], cpus: u8, expected: &str) {
    let vm = blob_vm(blob, cpus, &[]);
    let (outcome, stopped_from_outside) = run_with_limit(vm, LIMIT);
    match &outcome.reason {
        StopReason::HandlerPanicked { cpu: 0, message } if message == expected => {}
        other => panic!("{cpus} vCPUs: the run ended with {other:?}, not the handler's panic"),
    }
    assert!(
        outcome.reason.to_string().contains(expected),
        "the reason does not show the panic: {}",
        outcome.reason
    );
    assert!(
        !stopped_from_outside,
        "{cpus} vCPUs: the panic was the reason, but the VM ran on until stopped from outside after {LIMIT:?}"
    );
}

#[test]
fn a_panicking_breakpoint_handler_stops_a_one_vcpu_vm_with_its_message() {
    panicking_handler_stops_the_vm(INT3_ON_VCPU0_BLOB, 1, "handler bug at 0x100005 on vCPU 0");
}

#[test]
fn a_panicking_breakpoint_handler_stops_the_other_vcpu_too() {
    panicking_handler_stops_the_vm(INT3_ON_VCPU0_BLOB, 2, "handler bug at 0x100005 on vCPU 0");
}

#[test]
fn a_panicking_guest_event_handler_stops_the_vm_with_its_message() {
    panicking_handler_stops_the_vm(GUEST_EVENT_BLOB, 1, "handler bug at InitReached on vCPU 0");
}
