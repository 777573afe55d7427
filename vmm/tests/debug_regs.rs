//! Hardware breakpoints the host sets (`VcpuControl::set_debug_registers`) on real KVM,
//! driven by a tiny long-mode code blob: an execution breakpoint fires before its
//! instruction on every pass and the VMM lets the instruction run once; a write watchpoint
//! fires after the write where the backend checks data breakpoints (hardware KVM), and
//! never on kvm_pvm, whose emulator checks only instruction breakpoints.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hvprobe_arch::debugreg::{Access, DebugRegisters, HardwareBreakpoint};
use hvprobe_arch::Gva;
use hvprobe_vmm::{BreakpointDisposition, DebugHandler, StopReason, CODE_BLOB_START};
use kvm_ioctls::VcpuFd;

use common::blob_vm;

/// Three passes of: a write and a read of the quadword at 0x100800, then a `nop` at 0x19.
const BLOB: &[u8] = &[
    0xb9, 0x03, 0x00, 0x00, 0x00, // 0x00: mov $3,%ecx
    0x48, 0xc7, 0x04, 0x25, 0x00, 0x08, 0x10, 0x00, 0x34, 0x12, 0x00, 0x00, // 0x05: movq $0x1234,0x100800
    0x48, 0x8b, 0x04, 0x25, 0x00, 0x08, 0x10, 0x00, // 0x11: mov 0x100800,%rax
    0x90, // 0x19: nop (the execution breakpoint)
    0xff, 0xc9, // 0x1a: dec %ecx
    0x75, 0xe7, // 0x1c: jnz 0x05
    0x66, 0xba, 0xf1, 0x0e, // 0x1e: mov $0xef1,%dx  (guest exit port)
    0xb0, 0x55, // mov $0x55,%al
    0xee, // out %al,(%dx)
    0xf4, // hlt
];
const NOP: u64 = 0x19;
const AFTER_WRITE: u64 = 0x11;
const DATA: u64 = 0x800;
const UNTOUCHED: u64 = 0x808;

/// Every hardware-breakpoint exit: (pc, slots fired, RIP), and the vCPU of each.
#[derive(Default)]
struct Recorder {
    hits: Mutex<Vec<(u64, u8, u64)>>,
    cpus: Mutex<Vec<usize>>,
}

impl DebugHandler for Recorder {
    fn on_breakpoint(&self, _cpu: usize, _vcpu: &mut VcpuFd, _at: Gva) -> BreakpointDisposition {
        BreakpointDisposition::GuestOwned
    }

    fn on_hardware_breakpoint(&self, cpu: usize, vcpu: &mut VcpuFd, pc: Gva, fired: u8) -> bool {
        self.cpus.lock().unwrap().push(cpu);
        let rip = hvprobe_vmm::exit_regs::read(vcpu).expect("registers").rip;
        self.hits.lock().unwrap().push((pc.0, fired, rip));
        true
    }

    fn wants_breakpoints(&self) -> bool {
        false
    }
}

#[test]
fn an_execution_breakpoint_fires_on_every_pass_and_a_write_watch_where_the_backend_checks_data() {
    let vm = blob_vm(BLOB, 1, &[]);
    let backend = vm.backend();
    let bp = |offset: u64, access, len| HardwareBreakpoint::new(Gva(CODE_BLOB_START + offset), access, len).unwrap();
    let mut registers = DebugRegisters::default();
    assert_eq!(registers.insert(bp(NOP, Access::Execute, 1)), Ok(0));
    assert_eq!(registers.insert(bp(DATA, Access::Write, 8)), Ok(1));
    assert_eq!(registers.insert(bp(UNTOUCHED, Access::ReadWrite, 8)), Ok(2));
    let control = vm.control();
    control.set_debug_registers(registers);
    let recorder = Arc::new(Recorder::default());
    let outcome = vm
        .run_for(Arc::clone(&recorder) as Arc<dyn DebugHandler>, Duration::from_secs(20))
        .expect("run");
    assert_eq!(outcome.reason, StopReason::GuestExit(0x55), "{backend}");
    let hits = recorder.hits.lock().unwrap().clone();
    let execute: Vec<_> = hits.iter().filter(|h| h.1 == 0b001).collect();
    let writes: Vec<_> = hits.iter().filter(|h| h.1 == 0b010).collect();
    assert_eq!(
        execute.len() + writes.len(),
        hits.len(),
        "{backend}: only slots 0 and 1 fire, one at a time: {hits:x?}"
    );
    assert_eq!(execute.len(), 3, "{backend}: one execution hit per pass: {hits:x?}");
    for (pc, _, rip) in &execute {
        assert_eq!(
            (*pc, *rip),
            (CODE_BLOB_START + NOP, CODE_BLOB_START + NOP),
            "before the nop"
        );
    }
    if backend.data_breakpoints_fire() {
        assert_eq!(writes.len(), 3, "{backend}: one write hit per pass: {hits:x?}");
        for (pc, _, rip) in &writes {
            let after = CODE_BLOB_START + AFTER_WRITE;
            assert_eq!((*pc, *rip), (after, after), "after the write, not the read");
        }
    } else {
        assert!(
            writes.is_empty(),
            "{backend} was measured not to check data breakpoints: {hits:x?}"
        );
    }
    assert_eq!(
        control
            .counters
            .hardware_breakpoints
            .load(std::sync::atomic::Ordering::Relaxed),
        hits.len() as u64
    );
}

/// Three passes over a `nop` at 0x05 on each vCPU; vCPU 1 then sets a flag and halts,
/// vCPU 0 waits for the flag and ends the run.
const TWO_CPU_BLOB: &[u8] = &[
    0xb9, 0x03, 0x00, 0x00, 0x00, // 0x00: mov $3,%ecx
    0x90, // 0x05: nop (the execution breakpoint)
    0xff, 0xc9, // 0x06: dec %ecx
    0x75, 0xfb, // 0x08: jnz 0x05
    0x85, 0xff, // 0x0a: test %edi,%edi  (the vCPU's index)
    0x75, 0x12, // 0x0c: jnz 0x20
    0x83, 0x3c, 0x25, 0x00, 0x09, 0x10, 0x00, 0x00, // 0x0e: cmpl $0,0x100900
    0x74, 0xf6, // 0x16: je 0x0e
    0x66, 0xba, 0xf1, 0x0e, // 0x18: mov $0xef1,%dx
    0xb0, 0x55, // mov $0x55,%al
    0xee, // out %al,(%dx)
    0xf4, // 0x1f: hlt
    0xc7, 0x04, 0x25, 0x00, 0x09, 0x10, 0x00, 0x01, 0x00, 0x00, 0x00, // 0x20: movl $1,0x100900
    0xf4, // 0x2b: hlt
    0xeb, 0xfd, // jmp 0x2b
];

#[test]
fn the_breakpoints_are_loaded_on_every_vcpu() {
    let vm = blob_vm(TWO_CPU_BLOB, 2, &[]);
    let mut registers = DebugRegisters::default();
    registers
        .insert(HardwareBreakpoint::new(Gva(CODE_BLOB_START + 0x05), Access::Execute, 1).unwrap())
        .unwrap();
    vm.control().set_debug_registers(registers);
    let recorder = Arc::new(Recorder::default());
    let outcome = vm
        .run_for(Arc::clone(&recorder) as Arc<dyn DebugHandler>, Duration::from_secs(20))
        .expect("run");
    assert_eq!(outcome.reason, StopReason::GuestExit(0x55));
    let mut cpus = recorder.cpus.lock().unwrap().clone();
    cpus.sort();
    assert_eq!(cpus, vec![0, 0, 0, 1, 1, 1], "three execution hits on each vCPU");
}

/// A step a handler asked for (`int3` at 0x00, then one step), over a write to a watched
/// quadword: where data breakpoints fire, one exit reports both, and the step must end
/// there (after the write, at 0x0d) — not run on to the next instruction.
const STEP_OVER_A_WRITE_BLOB: &[u8] = &[
    0xcc, // 0x00: int3 (the handler turns single-stepping on)
    0x48, 0xc7, 0x04, 0x25, 0x00, 0x08, 0x10, 0x00, 0x34, 0x12, 0x00, 0x00, // 0x01: movq $0x1234,0x100800
    0x66, 0xba, 0xf1, 0x0e, // 0x0d: mov $0xef1,%dx
    0xb0, 0x55, // mov $0x55,%al
    0xee, // out %al,(%dx)
    0xf4, // hlt
];

/// Steps once from the int3; records where each step and watch hit ended.
#[derive(Default)]
struct Stepper {
    steps: Mutex<Vec<u64>>,
    watch_hits: Mutex<Vec<u64>>,
}

impl DebugHandler for Stepper {
    fn on_breakpoint(&self, _cpu: usize, vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition {
        let mut regs = hvprobe_vmm::exit_regs::read(vcpu).unwrap();
        regs.rip = at.0 + 1;
        hvprobe_vmm::exit_regs::write(vcpu, &regs).unwrap();
        hvprobe_vmm::exit_regs::flush_regs(vcpu).unwrap();
        let backend = hvprobe_vmm::Backend::detect();
        hvprobe_vmm::set_guest_debug(vcpu, backend, true).unwrap();
        BreakpointDisposition::Handled
    }

    fn on_single_step(&self, _cpu: usize, vcpu: &mut VcpuFd) -> bool {
        let rip = hvprobe_vmm::exit_regs::read(vcpu).unwrap().rip;
        self.steps.lock().unwrap().push(rip);
        hvprobe_vmm::set_guest_debug(vcpu, hvprobe_vmm::Backend::detect(), false).unwrap();
        true
    }

    fn on_hardware_breakpoint(&self, _cpu: usize, _vcpu: &mut VcpuFd, pc: Gva, _fired: u8) -> bool {
        self.watch_hits.lock().unwrap().push(pc.0);
        true
    }
}

#[test]
fn a_handlers_step_ends_where_it_should_when_a_data_watch_fires_on_the_same_instruction() {
    let vm = blob_vm(STEP_OVER_A_WRITE_BLOB, 1, &[]);
    let backend = vm.backend();
    let mut registers = DebugRegisters::default();
    registers
        .insert(HardwareBreakpoint::new(Gva(CODE_BLOB_START + DATA), Access::Write, 8).unwrap())
        .unwrap();
    vm.control().set_debug_registers(registers);
    let stepper = Arc::new(Stepper::default());
    let outcome = vm
        .run_for(Arc::clone(&stepper) as Arc<dyn DebugHandler>, Duration::from_secs(20))
        .expect("run");
    assert_eq!(outcome.reason, StopReason::GuestExit(0x55), "{backend}");
    let after_write = CODE_BLOB_START + 0x0d;
    assert_eq!(
        *stepper.steps.lock().unwrap(),
        vec![after_write],
        "{backend}: the step's end"
    );
    let expected_hits = if backend.data_breakpoints_fire() {
        vec![after_write]
    } else {
        vec![]
    };
    assert_eq!(*stepper.watch_hits.lock().unwrap(), expected_hits, "{backend}");
}

/// The guest single-steps itself: TF set with `popf`, a #DB after the next instruction,
/// which the guest's own handler (vector 1, at 0x20) takes: it clears TF in its frame and
/// sets BL to 0x41, which the blob reports. While the host has hardware breakpoints loaded,
/// hardware KVM reports that #DB to the VMM, which must give it back.
const GUEST_SINGLE_STEP_BLOB: &[u8] = &[
    0x31, 0xdb, // 0x00: xor %ebx,%ebx
    0x9c, // 0x02: pushfq
    0x48, 0x81, 0x0c, 0x24, 0x00, 0x01, 0x00, 0x00, // 0x03: orq $0x100,(%rsp)  (TF)
    0x9d, // 0x0b: popfq
    0x90, // 0x0c: nop (the #DB comes after it)
    0x88, 0xd8, // 0x0d: mov %bl,%al
    0x66, 0xba, 0xf1, 0x0e, // 0x0f: mov $0xef1,%dx
    0xee, // 0x13: out %al,(%dx)
    0xf4, // 0x14: hlt
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // pad to 0x20
    0x48, 0x81, 0x64, 0x24, 0x10, 0xff, 0xfe, 0xff, 0xff, // 0x20: andq $~0x100,16(%rsp)  (the frame's RFLAGS)
    0xb3, 0x41, // mov $0x41,%bl
    0x48, 0xcf, // iretq
];

#[test]
fn the_guests_own_single_step_reaches_its_handler_while_hardware_breakpoints_are_loaded() {
    assert_eq!(GUEST_SINGLE_STEP_BLOB[0x20], 0x48, "the blob's layout moved");
    let vm = blob_vm(GUEST_SINGLE_STEP_BLOB, 1, &[(1, 0x20)]);
    let backend = vm.backend();
    let mut registers = DebugRegisters::default();
    // Somewhere the blob never runs: the breakpoints are loaded, none fires.
    registers
        .insert(HardwareBreakpoint::new(Gva(CODE_BLOB_START + 0x1f), Access::Execute, 1).unwrap())
        .unwrap();
    vm.control().set_debug_registers(registers);
    let recorder = Arc::new(Recorder::default());
    let outcome = vm
        .run_for(Arc::clone(&recorder) as Arc<dyn DebugHandler>, Duration::from_secs(20))
        .expect("run");
    assert_eq!(
        outcome.reason,
        StopReason::GuestExit(0x41),
        "{backend}: the guest's #DB handler did not run"
    );
    assert!(recorder.hits.lock().unwrap().is_empty());
}
