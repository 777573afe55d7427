//! Where the host's single-step (`KVM_GUESTDBG_SINGLESTEP`) ends after one instruction of
//! each kind the probe engine may step out of line, on a tiny long-mode code blob: right
//! after it on hardware KVM; on kvm_pvm one instruction late after the few instructions
//! its emulator completes without reporting the trap
//! (`Backend::loses_step_trap_after_some_instructions`). The probe engine follows every
//! out-of-line copy with int3s because of this; if the backend changes, this test says so.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hvprobe_arch::Gva;
use hvprobe_vmm::{Backend, BreakpointDisposition, DebugHandler, StopReason, CODE_BLOB_START};
use kvm_ioctls::VcpuFd;

use common::blob_vm;

/// Turns single-stepping on at the blob's int3 and records where each step ended.
#[derive(Default)]
struct Stepper {
    steps: Mutex<Vec<u64>>,
}

impl DebugHandler for Stepper {
    fn on_breakpoint(&self, _cpu: usize, vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition {
        let mut regs = hvprobe_vmm::exit_regs::read(vcpu).unwrap();
        regs.rip = at.0 + 1;
        hvprobe_vmm::exit_regs::write(vcpu, &regs).unwrap();
        hvprobe_vmm::exit_regs::flush_regs(vcpu).unwrap();
        hvprobe_vmm::set_guest_debug(vcpu, Backend::detect(), true).unwrap();
        BreakpointDisposition::Handled
    }

    fn on_single_step(&self, _cpu: usize, vcpu: &mut VcpuFd) -> bool {
        let rip = hvprobe_vmm::exit_regs::read(vcpu).unwrap().rip;
        self.steps.lock().unwrap().push(rip.wrapping_sub(CODE_BLOB_START));
        hvprobe_vmm::set_guest_debug(vcpu, Backend::detect(), false).unwrap();
        true
    }
}

/// `[0x100800]` with ModRM's reg field 0 (`%rax`, or `/0`): ModRM, SIB and disp32 of the
/// blob's data quadword.
const DATA: [u8; 6] = [0x04, 0x25, 0x00, 0x08, 0x10, 0x00];

fn with_data(opcode: &[u8], imm: &[u8]) -> Vec<u8> {
    let mut bytes = opcode.to_vec();
    bytes.extend(DATA);
    bytes.extend(imm);
    bytes
}

#[test]
fn a_single_step_ends_after_its_instruction_or_where_the_backend_is_known_to_run_on() {
    // (instruction, bytes, whether kvm_pvm misses the trap after it)
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("nop", vec![0x90], false),
        ("mfence", vec![0x0f, 0xae, 0xf0], true),
        ("lfence", vec![0x0f, 0xae, 0xe8], true),
        ("sfence", vec![0x0f, 0xae, 0xf8], true),
        // Only where the CPU has it (QEMU's TCG CPUs in the lane do not: #UD).
        ("serialize", vec![0x0f, 0x01, 0xe8], true),
        ("swapgs", vec![0x0f, 0x01, 0xf8], true),
        ("out %al,$0x80", vec![0xe6, 0x80], true),
        ("in $0x80,%al", vec![0xe4, 0x80], false),
        ("pause", vec![0xf3, 0x90], false),
        ("rdtsc", vec![0x0f, 0x31], false),
        ("cpuid", vec![0x0f, 0xa2], false),
        ("rdmsr", vec![0x0f, 0x32], false),
        ("mov %cr3,%rax", vec![0x0f, 0x20, 0xd8], false),
        ("mov %rax,%rbx", vec![0x48, 0x89, 0xc3], false),
        ("mov %rax,(data)", with_data(&[0x48, 0x89], &[]), false),
        ("lock addq $1,(data)", with_data(&[0xf0, 0x48, 0x83], &[0x01]), false),
        ("xchg %rax,(data)", with_data(&[0x48, 0x87], &[]), false),
        (
            "clflush (data)",
            vec![0x0f, 0xae, 0x3c, 0x25, 0x00, 0x08, 0x10, 0x00],
            false,
        ),
        (
            "invlpg (data)",
            vec![0x0f, 0x01, 0x3c, 0x25, 0x00, 0x08, 0x10, 0x00],
            false,
        ),
        ("wbinvd", vec![0x0f, 0x09], false),
        ("pushf", vec![0x9c], false),
        ("stosb", vec![0xaa], false),
        ("call *%rdx", vec![0xff, 0xd2], false),
        ("jmp *%rdx", vec![0xff, 0xe2], false),
        ("ret", vec![0xc3], false),
    ];
    let backend = Backend::detect();
    let has_serialize = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.split_whitespace().any(|flag| flag == "serialize"))
        .unwrap_or(false);
    let mut wrong = Vec::new();
    for (name, insn, runs_on) in cases {
        if name == "serialize" && !has_serialize {
            continue;
        }
        // RSI/RDI at the data, ECX = 0x10 (rdmsr of the TSC), RDX = a branch's
        // target (the exit sequence after the nops), pushed for `ret`; then int3, the
        // instruction, four nops and the exit.
        let setup_len = 7 + 7 + 5 + 7 + 1;
        let int3 = setup_len as u64;
        let after = int3 + 1 + insn.len() as u64;
        let target = CODE_BLOB_START + after + 4;
        let mut code = vec![0x48, 0xc7, 0xc6, 0x00, 0x08, 0x10, 0x00]; // mov $0x100800,%rsi
        code.extend([0x48, 0xc7, 0xc7, 0x00, 0x08, 0x10, 0x00]); // mov $0x100800,%rdi
        code.extend([0xb9, 0x10, 0x00, 0x00, 0x00]); // mov $0x10,%ecx (IA32_TIME_STAMP_COUNTER)
        code.extend([0x48, 0xc7, 0xc2]); // mov $target,%rdx
        code.extend((target as u32).to_le_bytes());
        code.push(0x52); // push %rdx
        assert_eq!(code.len(), setup_len);
        code.push(0xcc);
        code.extend(&insn);
        code.extend([0x90; 4]);
        code.extend([0x66, 0xba, 0xf1, 0x0e, 0xb0, 0x55, 0xee, 0xf4]); // exit 0x55
        let vm = blob_vm(&code, 1, &[]);
        let stepper = Arc::new(Stepper::default());
        let outcome = vm
            .run_for(Arc::clone(&stepper) as Arc<dyn DebugHandler>, Duration::from_secs(20))
            .expect("run");
        if outcome.reason != StopReason::GuestExit(0x55) {
            wrong.push(format!("{name}: the blob ended with {:?}", outcome.reason));
            continue;
        }
        let branches = matches!(insn[0], 0xff | 0xc3);
        let expected = match (branches, runs_on && backend.loses_step_trap_after_some_instructions()) {
            (true, _) => after + 4,
            (false, false) => after,
            (false, true) => after + 1, // one nop more
        };
        let steps = stepper.steps.lock().unwrap().clone();
        if steps != [expected] {
            wrong.push(format!("{name}: the step ended at +{steps:x?}, expected +{expected:x}"));
        }
    }
    assert!(wrong.is_empty(), "{backend}:\n{}", wrong.join("\n"));
}
