//! The library API on real KVM: handlers that change the guest's execution path, probes
//! removed while two vCPUs hit them, and the two ways of executing a probed instruction
//! checked exactly on a code blob.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe::guest::workload_message;
use hvprobe_arch::Gva;
use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::{build_tracer, code_blob_tracer, live_memory, load_symbols, ProbeHandler, SymbolsFrom};
use hvprobe_probes::engine::{HitContext, KprobeRequest, PreAction, ProbePoint, Tracer};
use hvprobe_vmm::{CodeBlob, ConsoleOutput, StopReason, Vm, VmOutcome, CODE_BLOB_START};
use vm_memory::{Bytes, GuestAddress};

/// A restored snapshot of the bundled guest with a tracer attached (nothing registered).
fn restored(cpus: u8) -> (Vm, Arc<Tracer>, Arc<ProbeHandler>, SymbolTable) {
    let dir = common::snapshot(cpus);
    let vm = Vm::restore(&dir, Some(cpus), ConsoleOutput::Discard, &[]).expect("restore");
    let state = vm.vcpu_state(0).unwrap();
    let symbols = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), &state), state.lstar)
        .expect("kallsyms")
        .table;
    let tracer = build_tracer(vm.control(), vm.memory(), &state, &symbols, None).expect("tracer");
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), None);
    (vm, tracer, handler, symbols)
}

/// Longest a test's guest may run: a guest that hangs is stopped then, and its test fails
/// on the stop reason with the console's tail (in the lane a hung L2 held the whole suite
/// until the lane's own timeout, with nothing to show for it).
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn point(name: &str) -> ProbePoint {
    ProbePoint::Symbol {
        name: name.into(),
        offset: 0,
    }
}

fn request(name: &str, event: &str) -> KprobeRequest {
    KprobeRequest {
        emit_events: false,
        ..KprobeRequest::event(point(name), "api", event, Vec::new())
    }
}

fn text(vm_mem: &vm_memory::GuestMemoryMmap, state: &hvprobe_vmm::VcpuState, at: Gva, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    live_memory(vm_mem, state).read_virt(at, &mut b).unwrap();
    b
}

#[test]
fn a_pre_handler_makes_getppid_return_a_chosen_value() {
    pre_handler_redirects_getppid(false);
}

/// The same through a sync detour: the handler's RIP is obeyed there too.
#[test]
fn a_pre_handler_of_a_jump_optimized_probe_makes_getppid_return_a_chosen_value() {
    pre_handler_redirects_getppid(true);
}

fn pre_handler_redirects_getppid(optimize: bool) {
    let (mut vm, tracer, handler, _) = restored(1);
    tracer.set_optimization(optimize).unwrap();
    let mut req = request("__x64_sys_getppid", "inject");
    // Fault injection as a kprobe does it: set the return value, return to the caller,
    // skip the function.
    req.pre = Some(Arc::new(|ctx: &mut HitContext| {
        let Ok(ret) = ctx.kernel.read_u64(Gva(ctx.regs.rsp)) else {
            return PreAction::Continue;
        };
        ctx.regs.rax = 4242;
        ctx.regs.rip = ret;
        ctx.regs.rsp += 8;
        PreAction::Skip
    }));
    let id = tracer.register(req).unwrap();
    if optimize {
        assert_eq!(tracer.why_not_optimized(id), None);
    }
    vm.send_console_input(workload_message("echo PPID=$PPID; hvprobe-loop 3"));
    let console = vm.console_log();
    let outcome = vm.run_for(handler, RUN_LIMIT).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{}", console.tail(20));
    assert!(
        console.contents().contains("PPID=4242"),
        "the shell's getppid() was not redirected\n{}",
        console.tail(20)
    );
    assert!(console.contents().contains("hvprobe-loop: 3 getppid calls"));
    assert!(tracer.stats.skipped.load(Ordering::Relaxed) >= 4);
    assert_eq!(tracer.stats.optimized.load(Ordering::Relaxed) > 0, optimize);
}

/// Jump-optimized probes with a pre-handler (sync detours) on the bundled guest: one int3
/// exit per hit and no single-step, for the instruction stepped out of line today
/// (getppid's `mov %gs:...,%rax`) as for one emulated today (`push %rbp` of
/// `__task_pid_nr_ns`).
#[test]
fn a_sync_detour_takes_one_exit_per_hit_even_for_an_instruction_stepped_today() {
    let (mut vm, tracer, handler, _) = restored(1);
    tracer.set_optimization(true).unwrap();
    let hits = Arc::new(AtomicU64::new(0));
    for f in ["__x64_sys_getppid", "__task_pid_nr_ns"] {
        let mut req = request(f, f);
        let h = hits.clone();
        req.pre = Some(Arc::new(move |_: &mut HitContext| {
            h.fetch_add(1, Ordering::Relaxed);
            PreAction::Continue
        }));
        let id = tracer.register(req).unwrap();
        assert_eq!(tracer.why_not_optimized(id), None, "{f}");
    }
    vm.send_console_input(workload_message("hvprobe-loop 50"));
    let console = vm.console_log();
    let outcome = vm.run_for(handler, RUN_LIMIT).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{}", console.tail(20));
    let hits = hits.load(Ordering::Relaxed);
    assert!(hits >= 100, "{hits} hits");
    assert_eq!(tracer.stats.optimized.load(Ordering::Relaxed), hits);
    assert_eq!(
        outcome.breakpoints - outcome.breakpoints_reinjected,
        hits,
        "one int3 exit per hit"
    );
    assert_eq!(outcome.single_steps, 0, "nothing stepped");
}

#[test]
fn probes_removed_while_two_vcpus_hit_them_leave_a_working_guest_and_intact_text() {
    let (mut vm, tracer, handler, symbols) = restored(2);
    let state = vm.vcpu_state(0).unwrap();
    let mem = vm.memory().clone();
    let functions = ["__x64_sys_getppid", "__task_pid_nr_ns"];
    let before: Vec<Vec<u8>> = functions
        .iter()
        .map(|f| text(&mem, &state, symbols.lookup(f).unwrap().addr, 0x30))
        .collect();
    let hits = Arc::new(AtomicU64::new(0));
    for f in functions {
        let mut req = request(f, f);
        let h = hits.clone();
        req.pre = Some(Arc::new(move |_: &mut HitContext| {
            h.fetch_add(1, Ordering::Relaxed);
            PreAction::Continue
        }));
        tracer.register(req).unwrap();
    }
    vm.send_console_input(workload_message(
        "hvprobe-loop 300 & hvprobe-loop 300 & wait; echo LOOPS-DONE",
    ));
    let console = vm.console_log();
    let control = vm.control();
    let runner = std::thread::spawn(move || vm.run_for(handler, RUN_LIMIT));
    let deadline = Instant::now() + Duration::from_secs(120);
    while hits.load(Ordering::Relaxed) < 100 {
        assert!(
            Instant::now() < deadline,
            "the probes were not hit\n{}",
            console.tail(20)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for id in tracer.probe_ids() {
        tracer.unregister(id).unwrap();
    }
    let at_removal = hits.load(Ordering::Relaxed);
    let outcome: VmOutcome = runner.join().unwrap().unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{}", console.tail(20));
    let log = console.contents();
    assert_eq!(
        log.matches("hvprobe-loop: 300 getppid calls").count(),
        2,
        "{}",
        console.tail(20)
    );
    assert!(log.contains("LOOPS-DONE"));
    assert_eq!(
        hits.load(Ordering::Relaxed),
        at_removal,
        "a handler ran after its probe was removed"
    );
    assert!(at_removal < 4 * 300, "the probes were removed before the loops ended");
    for (f, b) in functions.iter().zip(before) {
        assert_eq!(
            text(&mem, &state, symbols.lookup(f).unwrap().addr, 0x30),
            b,
            "{f} not restored"
        );
    }
    drop(control);
}

/// Loads a value through a RIP-relative operand (stepped out of line), pushes and moves
/// (emulated), stores what it got at 0x3000.., and exits with status 0.
const BLOB: &[u8] = &[
    0x48, 0x8b, 0x05, 0xf9, 0x0f, 0x00, 0x00, // 0x00: mov 0xff9(%rip),%rax   (= [0x101000])
    0x55, // 0x07: push %rbp
    0x48, 0x89, 0xe3, // 0x08: mov %rsp,%rbx
    0x48, 0x89, 0x04, 0x25, 0x00, 0x30, 0x00, 0x00, // 0x0b: mov %rax,0x3000
    0x48, 0x89, 0x1c, 0x25, 0x08, 0x30, 0x00, 0x00, // 0x13: mov %rbx,0x3008
    0x66, 0xba, 0xf1, 0x0e, // 0x1b: mov $0xef1,%dx
    0x30, 0xc0, // 0x1f: xor %al,%al
    0xee, // 0x21: out %al,(%dx)
    0xf4, // 0x22: hlt
];
const BLOB_DATA: u64 = 0x1122_3344_5566_7788;

/// A one-vCPU code-blob VM running `code` (padded with int3s to 0x1000 bytes) with
/// [`BLOB_DATA`] right after it.
fn blob_vm(mut code: Vec<u8>) -> Vm {
    common::require_kvm();
    code.resize(0x1000, 0xcc);
    code.extend_from_slice(&BLOB_DATA.to_le_bytes());
    Vm::new_code_blob(&CodeBlob {
        code,
        cpus: 1,
        handlers: Vec::new(),
    })
    .unwrap_or_else(|e| panic!("this test needs a usable /dev/kvm: {e}"))
}

#[test]
fn on_a_code_blob_emulated_probes_take_one_exit_and_stepped_ones_two() {
    let vm = blob_vm(BLOB.to_vec());
    let state = vm.vcpu_state(0).unwrap();
    let mem = vm.memory().clone();
    let tracer = code_blob_tracer(&vm, 0x1000).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for offset in [0x0, 0x7, 0x8] {
        let s = seen.clone();
        let mut req = KprobeRequest {
            emit_events: false,
            ..KprobeRequest::event(
                ProbePoint::Symbol {
                    name: "blob".into(),
                    offset,
                },
                "blob",
                &format!("at{offset:x}"),
                Vec::new(),
            )
        };
        req.post = Some(Arc::new(move |ctx: &mut HitContext| {
            s.lock().unwrap().push((offset, ctx.regs.rip, ctx.regs.rax));
        }));
        tracer.register(req).unwrap();
    }
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), None);
    let outcome = vm.run_for(handler, RUN_LIMIT).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0));
    let got: u64 = mem.read_obj(GuestAddress(0x3000)).unwrap();
    assert_eq!(got, BLOB_DATA, "the stepped copy read the wrong address");
    let rsp: u64 = mem.read_obj(GuestAddress(0x3008)).unwrap();
    let pushed: u64 = mem.read_obj(GuestAddress(rsp)).unwrap();
    assert_eq!(pushed, state.regs.rbp, "the emulated push");
    assert_eq!(rsp, state.regs.rsp - 8);
    let start = CODE_BLOB_START;
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (0x0, start + 7, BLOB_DATA),
            (0x7, start + 8, BLOB_DATA),
            (0x8, start + 0xb, BLOB_DATA)
        ],
        "post-handlers see the state after each instruction"
    );
    assert_eq!(outcome.breakpoints, 3, "one int3 exit per hit");
    assert_eq!(outcome.single_steps, 1, "only the RIP-relative load is stepped");
    assert_eq!(tracer.stats.emulated.load(Ordering::Relaxed), 2);
    assert_eq!(tracer.stats.stepped.load(Ordering::Relaxed), 1);
}

/// Collects hit events.
#[derive(Default)]
struct Collect(std::sync::Mutex<Vec<hvprobe_probes::engine::HitEvent>>);

impl hvprobe_probes::engine::EventSink for Collect {
    fn try_send(&self, event: hvprobe_probes::engine::HitEvent) -> bool {
        self.0.lock().unwrap().push(event);
        true
    }
}

#[test]
fn a_probe_on_the_guests_own_int3_runs_and_the_guests_kprobe_still_counts_every_hit() {
    let dir = common::snapshot(1);
    let mut vm = Vm::restore(&dir, Some(1), ConsoleOutput::Discard, &[]).expect("restore");
    let state = vm.vcpu_state(0).unwrap();
    let symbols = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), &state), state.lstar)
        .expect("kallsyms")
        .table;
    let tasks = hvprobe_live::TaskContext::read(&live_memory(vm.memory(), &state), &symbols).ok();
    let events = Arc::new(Collect::default());
    let sink: Arc<dyn hvprobe_probes::engine::EventSink> = events.clone();
    let tracer = build_tracer(vm.control(), vm.memory(), &state, &symbols, Some(sink)).expect("tracer");
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), tasks);

    // +5 is past the ftrace NOP: the guest's kprobe there is an int3 of its own (kept an
    // int3: with jump optimization on, the guest would soon turn it into a jmp, and our
    // probe would be gone).
    let site = Gva(symbols.lookup("__x64_sys_getppid").unwrap().addr.0 + 5);
    let original = text(vm.memory(), &state, site, 1)[0];
    assert_ne!(original, 0xcc);
    vm.send_console_input(workload_message(
        "echo 0 > /proc/sys/debug/kprobes-optimization; \
         T=/sys/kernel/tracing; echo 'p:gk __x64_sys_getppid+5' > $T/kprobe_events; \
         echo 1 > $T/events/kprobes/gk/enable; echo GUEST-ARMED; read -t 20 go < /dev/console; \
         hvprobe-loop 20; echo 0 > $T/events/kprobes/gk/enable; \
         while read l; do echo \"PROFILE $l\"; done < $T/kprobe_profile",
    ));
    let console = vm.console_log();
    let mem = vm.memory().clone();
    let input = vm.console_input();
    let runner = std::thread::spawn(move || vm.run_for(handler, RUN_LIMIT));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !console.contents().contains("GUEST-ARMED") {
        assert!(
            Instant::now() < deadline,
            "the guest never armed its probe\n{}",
            console.tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(text(&mem, &state, site, 1)[0], 0xcc, "the guest's int3");
    tracer
        .register(KprobeRequest::event(
            ProbePoint::Address(site),
            "api",
            "shared",
            Vec::new(),
        ))
        .unwrap();
    input.send(b"go\n".to_vec()).unwrap();
    let outcome = runner.join().unwrap().unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{}", console.tail(20));
    let log = console.contents();
    let profile = log
        .lines()
        .find_map(|l| l.strip_prefix("PROFILE "))
        .unwrap_or_else(|| panic!("no profile\n{}", console.tail(20)));
    let guest_hits: u64 = profile.split_whitespace().nth(1).unwrap().parse().unwrap();
    let ours = events
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.record.comm == "hvprobe-loop")
        .count();
    assert_eq!(guest_hits, 20, "the guest's kprobe missed hits\n{}", console.tail(20));
    let all: Vec<(String, i32)> = events
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|e| (e.record.comm.clone(), e.record.pid))
        .collect();
    assert_eq!(
        ours,
        20,
        "our probe on the shared int3: {all:?} {:?} {}",
        tracer.stats,
        console.tail(30)
    );
    assert!(tracer.stats.shared_with_guest.load(Ordering::Relaxed) >= 20);
    assert_eq!(
        outcome.breakpoints_reinjected, outcome.breakpoints,
        "every shared hit went back to the guest"
    );
    tracer.unregister_all().unwrap();
    assert_eq!(
        text(&mem, &state, site, 1)[0],
        original,
        "the guest removed its int3; we wrote nothing"
    );
}

/// Probes on instructions after which kvm_pvm's emulator loses the single-step trap, with
/// RAX at an address that is not mapped: were the bytes after a copy anything but int3s
/// (a fresh area's zeros are `add %al,(%rax)`), the vCPU would run them and fault there.
const FENCES_BLOB: &[u8] = &[
    0x48, 0xb8, 0, 0, 0, 0, 0, 0x40, 0, 0, // 0x00: movabs $0x400000000000,%rax
    0x0f, 0xae, 0xf0, // 0x0a: mfence
    0x0f, 0xae, 0xe8, // 0x0d: lfence
    0x0f, 0xae, 0xf8, // 0x10: sfence
    0xe6, 0x80, // 0x13: out %al,$0x80
    0x66, 0xba, 0xf1, 0x0e, // 0x15: mov $0xef1,%dx
    0x30, 0xc0, // 0x19: xor %al,%al
    0xee, // 0x1b: out %al,(%dx)
    0xf4, // 0x1c: hlt
];

#[test]
fn a_step_whose_trap_the_backend_loses_ends_at_the_instruction_after_the_probe() {
    let vm = blob_vm(FENCES_BLOB.to_vec());
    let tracer = code_blob_tracer(&vm, 0x20).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for offset in [0x0a, 0x0d, 0x10, 0x13] {
        let s = seen.clone();
        let mut req = request("blob", &format!("at{offset:x}"));
        req.point = ProbePoint::Symbol {
            name: "blob".into(),
            offset,
        };
        req.post = Some(Arc::new(move |ctx: &mut HitContext| {
            s.lock().unwrap().push((offset, ctx.regs.rip - CODE_BLOB_START));
        }));
        tracer.register(req).unwrap();
    }
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), None);
    let outcome = vm.run_for(handler, RUN_LIMIT).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{outcome:?}");
    assert_eq!(
        *seen.lock().unwrap(),
        [(0x0a, 0x0d), (0x0d, 0x10), (0x10, 0x13), (0x13, 0x15)],
        "each probe once, its step ending at the next instruction"
    );
    let stats = &tracer.stats;
    assert_eq!(stats.stepped.load(Ordering::Relaxed), 4);
    let lost = if hvprobe_vmm::Backend::detect().loses_step_trap_after_some_instructions() {
        4
    } else {
        0
    };
    assert_eq!(stats.step_traps_lost.load(Ordering::Relaxed), lost);
}

/// Loads through RBX, which first holds a non-canonical address (#GP); the guest's #GP
/// handler points RBX at the data and returns. The load is stepped out of line, so the
/// #GP is raised in the copy.
const FAULTING_BLOB: &[u8] = &[
    0xfb, // 0x00: sti (interrupts on, as in a kernel; nothing raises one here)
    0x48, 0xbb, 0, 0, 0, 0, 0, 0, 0, 0x80, // 0x01: movabs $0x8000000000000000,%rbx
    0x48, 0x8b, 0x03, // 0x0b: mov (%rbx),%rax   <- the probe
    0x48, 0x89, 0x04, 0x25, 0x00, 0x30, 0x00, 0x00, // 0x0e: mov %rax,0x3000
    0x9c, // 0x16: pushf
    0x8f, 0x04, 0x25, 0x08, 0x30, 0x00, 0x00, // 0x17: pop 0x3008
    0x66, 0xba, 0xf1, 0x0e, // 0x1e: mov $0xef1,%dx
    0x30, 0xc0, // 0x22: xor %al,%al
    0xee, // 0x24: out %al,(%dx)
    0xf4, // 0x25: hlt
];
/// The #GP handler, at 0x40: RBX = the data at blob+0x1000; records the frame's RIP and
/// RFLAGS at 0x3010 and 0x3018; drops the error code; iretq.
const GP_HANDLER: &[u8] = &[
    0x48, 0xbb, 0x00, 0x10, 0x10, 0, 0, 0, 0, 0, // movabs $0x101000,%rbx
    0x48, 0x8b, 0x44, 0x24, 0x08, // mov 0x8(%rsp),%rax       (frame RIP)
    0x48, 0x89, 0x04, 0x25, 0x10, 0x30, 0x00, 0x00, // mov %rax,0x3010
    0x48, 0x8b, 0x44, 0x24, 0x18, // mov 0x18(%rsp),%rax      (frame RFLAGS)
    0x48, 0x89, 0x04, 0x25, 0x18, 0x30, 0x00, 0x00, // mov %rax,0x3018
    0x48, 0x83, 0xc4, 0x08, // add $8,%rsp                    (the error code)
    0x48, 0xcf, // iretq
];

#[test]
fn a_fault_in_a_stepped_copy_returns_to_the_probe_with_the_guests_flags() {
    let mut code = FAULTING_BLOB.to_vec();
    code.resize(0x40, 0xcc);
    code.extend_from_slice(GP_HANDLER);
    let vm = blob_vm(code);
    let state = vm.vcpu_state(0).unwrap();
    let mem = vm.memory().clone();
    // A 64-bit interrupt gate for #GP (13), DPL 0, code selector 8.
    let handler_at = CODE_BLOB_START + 0x40;
    let mut gate = [0u8; 16];
    gate[0..2].copy_from_slice(&(handler_at as u16).to_le_bytes());
    gate[2..4].copy_from_slice(&8u16.to_le_bytes());
    gate[5] = 0x8e;
    gate[6..8].copy_from_slice(&((handler_at >> 16) as u16).to_le_bytes());
    gate[8..12].copy_from_slice(&((handler_at >> 32) as u32).to_le_bytes());
    mem.write_slice(&gate, GuestAddress(state.sregs.idt.base + 13 * 16))
        .unwrap();
    let tracer = code_blob_tracer(&vm, 0x40).unwrap();
    let (pres, posts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (p, q) = (pres.clone(), posts.clone());
    let mut req = request("blob", "load");
    req.point = ProbePoint::Symbol {
        name: "blob".into(),
        offset: 0xb,
    };
    req.pre = Some(Arc::new(move |_: &mut HitContext| {
        p.fetch_add(1, Ordering::Relaxed);
        PreAction::Continue
    }));
    req.post = Some(Arc::new(move |_: &mut HitContext| {
        q.fetch_add(1, Ordering::Relaxed);
    }));
    tracer.register(req).unwrap();
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), None);
    let outcome = vm.run_for(handler, RUN_LIMIT).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{outcome:?}");
    let loaded: u64 = mem.read_obj(GuestAddress(0x3000)).unwrap();
    assert_eq!(
        loaded, BLOB_DATA,
        "the load ran again after the fault, with the handler's RBX"
    );
    let frame_rip: u64 = mem.read_obj(GuestAddress(0x3010)).unwrap();
    assert_eq!(
        frame_rip,
        CODE_BLOB_START + 0xb,
        "the handler returns to the probe, not into the copy"
    );
    let frame_flags: u64 = mem.read_obj(GuestAddress(0x3018)).unwrap();
    assert_eq!(
        frame_flags & 0x200,
        0x200,
        "the guest's own IF in the frame, not the step's IF=0"
    );
    assert_eq!(frame_flags & 0x100, 0, "no TF in the frame");
    let flags_after: u64 = mem.read_obj(GuestAddress(0x3008)).unwrap();
    assert_eq!(flags_after & 0x200, 0x200, "IF as before the probe");
    assert_eq!(
        pres.load(Ordering::Relaxed),
        2,
        "the probe hit again when the handler returned"
    );
    assert_eq!(posts.load(Ordering::Relaxed), 1, "the instruction completed once");
    assert_eq!(tracer.stats.steps_interrupted.load(Ordering::Relaxed), 1);
}

/// The out-of-line area's code half is in a read-only memory slot.
/// A code blob (its page tables identity-map the area, as `/dev/mem` reaches it in a
/// guest) writes into the code half and into the rings half, reading each back: the code
/// write is refused, counted and the guest goes on; the rings take the write.
#[test]
fn guest_writes_into_the_out_of_line_code_are_refused_and_counted() {
    use hvprobe_vmm::layout::{OOL_AREA_START, OOL_CODE_SIZE};
    const CODE: &[u8] = &[
        0xb8, 0xcc, 0xcc, 0xcc, 0xcc, // mov $0xcccccccc,%eax
        0xbb, 0x00, 0x00, 0x00, 0xd0, // mov $0xd0000000,%ebx (the area's code)
        0x89, 0x03, // mov %eax,(%rbx)
        0x48, 0x8b, 0x0b, // mov (%rbx),%rcx
        0x48, 0x89, 0x0c, 0x25, 0x00, 0x30, 0x00, 0x00, // mov %rcx,0x3000
        0x89, 0x83, 0x00, 0x00, 0x20, 0x00, // mov %eax,0x200000(%rbx) (the rings)
        0x48, 0x8b, 0x8b, 0x00, 0x00, 0x20, 0x00, // mov 0x200000(%rbx),%rcx
        0x48, 0x89, 0x0c, 0x25, 0x08, 0x30, 0x00, 0x00, // mov %rcx,0x3008
        0x66, 0xba, 0xf1, 0x0e, // mov $0xef1,%dx
        0x30, 0xc0, // xor %al,%al
        0xee, // out %al,(%dx)
        0xf4, // hlt
    ];
    assert_eq!(OOL_AREA_START.0, 0xd000_0000);
    assert_eq!(OOL_CODE_SIZE, 0x20_0000);
    let vm = blob_vm(CODE.to_vec());
    let mem = vm.memory().clone();
    const OURS: u64 = 0x1122_3344_5566_7788;
    mem.write_obj(OURS, GuestAddress(OOL_AREA_START.0)).unwrap();
    mem.write_obj(0u64, GuestAddress(OOL_AREA_START.0 + OOL_CODE_SIZE))
        .unwrap();
    let outcome = vm.run_for(Arc::new(hvprobe_vmm::NoProbes), RUN_LIMIT).unwrap();
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{outcome:?}");
    let ours: u64 = mem.read_obj(GuestAddress(OOL_AREA_START.0)).unwrap();
    assert_eq!(ours, OURS, "our code is unchanged");
    let seen: u64 = mem.read_obj(GuestAddress(0x3000)).unwrap();
    assert_eq!(seen, OURS, "the guest reads our code back, not its write");
    assert_eq!(outcome.ool_writes_refused, 1);
    let ring: u64 = mem.read_obj(GuestAddress(0x3008)).unwrap();
    assert_eq!(ring, 0xcccc_cccc, "the rings stay guest-writable");
}
