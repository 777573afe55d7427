//! The engine against a fake machine: plain memory for the kernel, a register file for the
//! vCPU. Every hit is driven by hand, as the exit loop would.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::*;
use crate::insn::HexBytes;
use crate::machine::{KernelMemory, Machine, PausedView, Vcpu, VcpuError};
use crate::output::{listing_line, ListKind};
use hvprobe_arch::regs::rflags;
use hvprobe_arch::{Gpa, INT3};
use hvprobe_introspection::memory::MemoryError;

fn libc_einval() -> i32 {
    22
}

const FUNC: u64 = 0xffff_ffff_8100_0000;
const OOL: u64 = 0xffff_ffff_8240_0000;
/// 4 KiB for copies and detours, and the step guard's place after them.
const OOL_SIZE: u64 = 0x1000 + 0x1100;
/// The step guard's IDT, and its stubs (the int3 of vector `v` at `GUARD_STUBS + v`).
const GUARD_IDT: u64 = OOL + 0x1000;
const GUARD_STUBS: u64 = GUARD_IDT + 0x1000;
/// The guest's IDT: every gate a 64-bit interrupt gate to `GUEST_HANDLERS + 0x10 * vector`
/// (the NMI's on IST 2, as Linux has it).
const GUEST_IDT: crate::machine::InterruptTable = crate::machine::InterruptTable {
    base: Gva(0xffff_fe00_0000_0000),
    limit: 0xfff,
};
const GUEST_HANDLERS: u64 = 0xffff_ffff_8180_0000;
const STACK_TOP: u64 = 0xffff_8880_0010_0000;

/// `func`: ftrace NOP; push %rbp; mov %rsp,%rbp; mov 0x10(%rip),%rax; pop %rbp; ret.
const FUNC_CODE: &[u8] = &[
    0x0f, 0x1f, 0x44, 0x00, 0x00, // +0x0 nopl 0x0(%rax,%rax,1)
    0x55, // +0x5 push %rbp
    0x48, 0x89, 0xe5, // +0x6 mov %rsp,%rbp
    0x48, 0x8b, 0x05, 0x10, 0x00, 0x00, 0x00, // +0x9 mov 0x10(%rip),%rax
    0x5d, // +0x10 pop %rbp
    0xc3, // +0x11 ret
];
const PUSH: u64 = FUNC + 5;
/// `other`: a lone `ret` (what `func` tail-calls in the return-probe tests).
const OTHER: u64 = FUNC + 0x40;
/// `do_exit`: ftrace NOP; push %rbp; ret.
const DO_EXIT: u64 = FUNC + 0x80;
const DO_EXIT_CODE: &[u8] = &[0x0f, 0x1f, 0x44, 0x00, 0x00, 0x55, 0xc3];
/// `free_task`: the same code as `do_exit`'s.
const FREE_TASK: u64 = FUNC + 0x90;
/// `traced`: the call the guest's ftrace put in place of the NOP, into a trampoline it
/// allocated (no kernel symbol there); push %rbp; ret.
const TRACED: u64 = FUNC + 0xc0;
const FTRACE_TRAMPOLINE: u64 = 0xffff_ffff_a000_1000;
const TRACED_CODE: [u8; 7] = {
    let rel = (FTRACE_TRAMPOLINE.wrapping_sub(TRACED + 5) as u32).to_le_bytes();
    [0xe8, rel[0], rel[1], rel[2], rel[3], 0x55, 0xc3]
};
/// `looping`: ftrace NOP; push %rbp; pop %rbp; dec %edi; jne +5 (the push); ret.
const LOOPING: u64 = FUNC + 0xa0;
const LOOPING_CODE: &[u8] = &[
    0x0f, 0x1f, 0x44, 0x00, 0x00, // +0x0 nopl
    0x55, // +0x5 push %rbp
    0x5d, // +0x6 pop %rbp
    0xff, 0xcf, // +0x7 dec %edi
    0x75, 0xfa, // +0x9 jne +0x5
    0xc3, // +0xb ret
];
const MOV_RIP: u64 = FUNC + 9;
const POP: u64 = FUNC + 0x10;

#[derive(Default)]
struct FakeMachine {
    pages: Mutex<BTreeMap<u64, Vec<u8>>>,
    pauses: AtomicUsize,
    /// The other vCPUs while paused: (index, RIP).
    parked: Mutex<Vec<(usize, u64)>>,
    /// Pages that are not mapped: reads and writes there fail.
    unmapped: Mutex<Vec<u64>>,
    /// Runs once at the next pause, before the edit: the guest's last act before it stops.
    before_pause: Mutex<Option<GuestAct>>,
    /// The words on the guest's kernel stacks; `None`: they cannot be read.
    stack_words: Mutex<Option<Vec<u64>>>,
    /// Guest-physical memory behind the out-of-line area, for event rings.
    rings: Option<crate::detour::ring::HostRingMemory>,
    /// Pauses fail while set (a vCPU held on the host past the deadline).
    refuse_pauses: AtomicBool,
    /// The debug registers last set, and whether they were set with the vCPUs paused.
    debug_registers: Mutex<Vec<(hvprobe_arch::debugreg::DebugRegisters, bool)>>,
    /// Data watches never fire here (as on kvm_pvm).
    no_data_watches: AtomicBool,
    /// Inside `with_vcpus_paused`.
    paused_now: AtomicBool,
    /// Where each vCPU left the guest once the VM stopped for good: (index, RIP).
    stopped: Mutex<Vec<(usize, u64)>>,
    /// Every write of the guest's text the engine made: (address, length).
    text_writes: Mutex<Vec<(u64, usize)>>,
}

/// Something the guest does to its memory.
type GuestAct = Box<dyn FnOnce(&FakeMachine) + Send>;

impl FakeMachine {
    fn with_code() -> Arc<Self> {
        let m = FakeMachine::default();
        // int3 padding between functions, as the kernel's linker leaves it.
        m.write_virt(Gva(FUNC), &[INT3; 0x100]).unwrap();
        m.write_virt(Gva(FUNC), FUNC_CODE).unwrap();
        m.write_virt(Gva(OTHER), &[0xc3]).unwrap();
        m.write_virt(Gva(DO_EXIT), DO_EXIT_CODE).unwrap();
        m.write_virt(Gva(FREE_TASK), DO_EXIT_CODE).unwrap();
        m.write_virt(Gva(LOOPING), LOOPING_CODE).unwrap();
        m.write_virt(Gva(TRACED), &TRACED_CODE).unwrap();
        m.write_virt(Gva(STACK_TOP - 0x1000), &[0u8; 0x1000]).unwrap();
        m.write_virt(Gva(OOL), &[0u8; OOL_SIZE as usize]).unwrap();
        let mut idt = Vec::new();
        for vector in 0..256u64 {
            let handler = GUEST_HANDLERS + 0x10 * vector;
            idt.extend((handler as u16).to_le_bytes());
            idt.extend(0x10u16.to_le_bytes());
            idt.push(if vector == 2 { 2 } else { 0 });
            idt.push(0x8e);
            idt.extend(((handler >> 16) as u16).to_le_bytes());
            idt.extend(((handler >> 32) as u32).to_le_bytes());
            idt.extend([0u8; 4]);
        }
        m.write_virt(GUEST_IDT.base, &idt).unwrap();
        Arc::new(m)
    }

    /// The engine's writes of text that touched `range`.
    fn text_writes_into(&self, range: std::ops::Range<u64>) -> Vec<(u64, usize)> {
        self.text_writes
            .lock()
            .unwrap()
            .iter()
            .filter(|(at, len)| *at < range.end && at + *len as u64 > range.start)
            .copied()
            .collect()
    }

    fn bytes(&self, at: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.read_virt(Gva(at), &mut b).unwrap();
        b
    }
}

impl GuestVirtRead for FakeMachine {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        let pages = self.pages.lock().unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            let a = gva.0 + i as u64;
            let page = pages.get(&(a & !0xfff)).ok_or(MemoryError::Wraps { gva, len: 0 })?;
            *b = page[(a & 0xfff) as usize];
        }
        Ok(())
    }
}

impl KernelMemory for FakeMachine {
    /// Every text write is noted (the engine's own checks are what the tests look at: this
    /// machine refuses none).
    fn write_text(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError> {
        self.text_writes.lock().unwrap().push((gva.0, bytes.len()));
        self.write_virt(gva, bytes)
    }

    fn write_virt(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError> {
        if self.unmapped.lock().unwrap().contains(&(gva.0 & !0xfff)) {
            return Err(MemoryError::Unmapped(gva));
        }
        let mut pages = self.pages.lock().unwrap();
        for (i, b) in bytes.iter().enumerate() {
            let a = gva.0 + i as u64;
            pages.entry(a & !0xfff).or_insert_with(|| vec![0; 4096])[(a & 0xfff) as usize] = *b;
        }
        Ok(())
    }
}

impl Machine for FakeMachine {
    fn memory_size(&self) -> u64 {
        1 << 30
    }

    fn kernel(&self) -> &dyn KernelMemory {
        self
    }

    fn event_memory(&self) -> Option<&dyn crate::detour::ring::RingMemory> {
        self.rings.as_ref().map(|r| r as &dyn crate::detour::ring::RingMemory)
    }

    fn stopped_rips(&self) -> Vec<(usize, u64)> {
        self.stopped.lock().unwrap().clone()
    }

    fn with_vcpus_paused(&self, edit: &mut dyn FnMut(&dyn PausedView)) -> Result<(), crate::machine::PauseFailed> {
        if self.refuse_pauses.load(Ordering::Relaxed) {
            return Err(crate::machine::PauseFailed("vCPU 1 did not stop".into()));
        }
        self.pauses.fetch_add(1, Ordering::Relaxed);
        let before = self.before_pause.lock().unwrap().take();
        if let Some(before) = before {
            before(self);
        }
        self.paused_now.store(true, Ordering::Relaxed);
        edit(self);
        self.paused_now.store(false, Ordering::Relaxed);
        Ok(())
    }

    fn hardware_breakpoints(&self) -> crate::machine::HardwareBreakpointSupport {
        crate::machine::HardwareBreakpointSupport {
            execute: Ok(()),
            data: if self.no_data_watches.load(Ordering::Relaxed) {
                Err("data breakpoints never fire here")
            } else {
                Ok(())
            },
        }
    }

    fn set_debug_registers(
        &self,
        registers: hvprobe_arch::debugreg::DebugRegisters,
    ) -> Result<(), crate::machine::DebugRegistersError> {
        let paused = self.paused_now.load(Ordering::Relaxed);
        self.debug_registers.lock().unwrap().push((registers, paused));
        Ok(())
    }
}

impl PausedView for FakeMachine {
    fn text(&self) -> &dyn KernelMemory {
        self
    }

    fn parked_rips(&self) -> Vec<(usize, u64)> {
        self.parked.lock().unwrap().clone()
    }

    fn saved_on_stacks(&self, range: std::ops::Range<Gva>) -> Result<Vec<Gva>, crate::machine::StackScanError> {
        match &*self.stack_words.lock().unwrap() {
            Some(words) => Ok(words
                .iter()
                .filter(|w| (range.start.0..range.end.0).contains(w))
                .map(|w| Gva(*w))
                .collect()),
            None => Err(crate::machine::StackScanError::Unsupported),
        }
    }
}

struct FakeVcpu {
    regs: Regs,
    stepping: bool,
    idt: crate::machine::InterruptTable,
    /// Make `set_single_step(true)` fail, as a KVM_SET_GUEST_DEBUG that fails would.
    step_fails: bool,
    /// The guest's `current` (none: the fake knows no task layout).
    task: Option<hvprobe_introspection::task::TaskInfo>,
}

impl FakeVcpu {
    fn at(rip: u64) -> Self {
        FakeVcpu {
            regs: Regs {
                rip,
                rsp: STACK_TOP - 0x100,
                rbp: 0x1234_5678,
                rdi: 7,
                ..Default::default()
            },
            stepping: false,
            idt: GUEST_IDT,
            step_fails: false,
            task: None,
        }
    }
}

impl Vcpu for FakeVcpu {
    fn regs(&mut self) -> Result<Regs, VcpuError> {
        Ok(self.regs)
    }
    fn set_regs(&mut self, regs: &Regs) -> Result<(), VcpuError> {
        self.regs = *regs;
        Ok(())
    }
    fn segment_selectors(&mut self) -> Result<crate::machine::SegmentSelectors, VcpuError> {
        Ok(crate::machine::SegmentSelectors { cs: 0x10, ss: 0 })
    }
    fn set_single_step(&mut self, on: bool) -> Result<(), VcpuError> {
        if on && self.step_fails {
            return Err(VcpuError::new("KVM_SET_GUEST_DEBUG", libc_einval()));
        }
        self.stepping = on;
        Ok(())
    }
    fn interrupt_table(&mut self) -> Result<crate::machine::InterruptTable, VcpuError> {
        Ok(self.idt)
    }
    fn set_interrupt_table(&mut self, table: crate::machine::InterruptTable) -> Result<(), VcpuError> {
        self.idt = table;
        Ok(())
    }
    fn current_task(&mut self) -> Option<hvprobe_introspection::task::TaskInfo> {
        self.task.clone()
    }
    fn user_memory(&mut self) -> Option<Box<dyn GuestVirtRead + '_>> {
        None
    }
}

/// Collects events up to a capacity, refusing the rest (a slow consumer).
struct Events {
    capacity: usize,
    got: Mutex<Vec<HitEvent>>,
}

impl EventSink for Events {
    fn try_send(&self, event: HitEvent) -> bool {
        let mut got = self.got.lock().unwrap();
        if got.len() >= self.capacity {
            return false;
        }
        got.push(event);
        true
    }
}

fn symbols() -> SymbolTable {
    SymbolTable::parse_system_map(&format!(
        "{FUNC:016x} T _stext\n{FUNC:016x} T func\n{OTHER:016x} T other\n{DO_EXIT:016x} T do_exit\n\
         {FREE_TASK:016x} T free_task\n\
         {LOOPING:016x} T looping\n{TRACED:016x} T traced\n{:016x} T _etext\n\
         {GUEST_RETHOOK:016x} T arch_rethook_trampoline\n\
         {GUEST_FGRAPH_RETURN:016x} T return_to_handler\n",
        TRACED + TRACED_CODE.len() as u64
    ))
    .unwrap()
}

/// The guest's own return trampoline (its kretprobes swap it into return slots), outside
/// the text the tests probe.
const GUEST_RETHOOK: u64 = FUNC + 0xd0;
/// The guest's function_graph tracer's return hook.
const GUEST_FGRAPH_RETURN: u64 = FUNC + 0xe0;

fn tracer_with(machine: &Arc<FakeMachine>, patch_sites: PatchSites, sink: Option<Arc<dyn EventSink>>) -> Tracer {
    let view = KernelView {
        symbols: Arc::new(symbols()),
        blacklist: KprobeBlacklist::default(),
        ex_table: ExceptionTable::default(),
        patch_sites,
    };
    let ool = OutOfLineArea {
        start: Gva(OOL),
        size: OOL_SIZE,
        rings: Gva(OOL + OOL_SIZE),
        rings_size: 0,
    };
    Tracer::new(machine.clone(), view, Some(ool), sink)
}

fn tracer(machine: &Arc<FakeMachine>) -> Tracer {
    tracer_with(machine, PatchSites::default(), None)
}

fn at(name: &str, offset: u64) -> ProbePoint {
    ProbePoint::Symbol {
        name: name.into(),
        offset,
    }
}

fn plain(point: ProbePoint, event: &str) -> KprobeRequest {
    KprobeRequest {
        emit_events: false,
        ..KprobeRequest::event(point, "test", event, Vec::new())
    }
}

/// A pause that fails (a vCPU held on the host past the deadline) fails the operation with
/// the machine's reason, and changes nothing: no text, no registry.
#[test]
fn an_operation_whose_pause_fails_changes_nothing_and_says_why() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let id = t.register(plain(at("func", 5), "entry")).unwrap();
    let armed = m.bytes(FUNC, 0x20);
    m.refuse_pauses.store(true, Ordering::Relaxed);
    let refused = |e: ProbeError| matches!(&e, ProbeError::Pause(_)) && e.to_string() == "vCPU 1 did not stop";
    assert!(refused(t.unregister(id).unwrap_err()));
    assert!(refused(t.set_enabled(id, false).unwrap_err()));
    assert!(refused(t.set_armed(false).unwrap_err()));
    assert!(refused(t.set_optimization(false).unwrap_err()));
    assert!(refused(
        t.register_all(vec![plain(at("other", 0), "other")]).unwrap_err().1
    ));
    assert!(refused(t.unregister_all().unwrap_err()));
    assert_eq!(m.bytes(FUNC, 0x20), armed, "the text changed");
    assert_eq!(t.listing().len(), 1);
    assert!(!t.listing()[0].disabled);
    m.refuse_pauses.store(false, Ordering::Relaxed);
    t.unregister(id).unwrap();
    assert_eq!(t.listing().len(), 0);
}

#[test]
fn a_probe_on_the_ftrace_nop_goes_on_the_next_instruction_and_reports_plus_zero() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(plain(at("func", 0), "entry")).unwrap();
    assert_eq!(
        m.bytes(FUNC, 6),
        [0x0f, 0x1f, 0x44, 0x00, 0x00, INT3],
        "the NOP stays untouched"
    );
    let list = t.listing();
    assert_eq!(list[0].address, Gva(FUNC));
    assert_eq!(list[0].location, "func+0x0");
}

#[test]
fn an_emulated_hit_runs_the_handlers_and_the_push_in_one_exit() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (pre_seen, post_seen) = (seen.clone(), seen.clone());
    let mut req = plain(at("func", 0), "entry");
    req.pre = Some(Arc::new(move |ctx: &mut HitContext| {
        pre_seen.lock().unwrap().push(("pre", ctx.regs.rip, ctx.regs.rsp));
        PreAction::Continue
    }));
    req.post = Some(Arc::new(move |ctx: &mut HitContext| {
        post_seen.lock().unwrap().push(("post", ctx.regs.rip, ctx.regs.rsp));
    }));
    t.register(req).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let sp = cpu.regs.rsp;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, PUSH + 1);
    assert_eq!(cpu.regs.rsp, sp - 8);
    assert_eq!(m.read_u64(Gva(sp - 8)).unwrap(), 0x1234_5678, "rbp pushed");
    assert!(!cpu.stepping);
    assert_eq!(
        *seen.lock().unwrap(),
        [("pre", FUNC, sp), ("post", PUSH + 1, sp - 8)],
        "the pre-handler sees the probe's own address (+0), the post-handler the state after"
    );
    assert_eq!(t.listing()[0].hits, 1);
    assert_eq!(t.stats.emulated.load(Ordering::Relaxed), 1);
}

#[test]
fn a_rip_relative_instruction_is_stepped_in_a_fixed_up_copy() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let posts = Arc::new(AtomicU64::new(0));
    let p = posts.clone();
    let mut req = plain(at("func", 9), "mid");
    req.post = Some(Arc::new(move |ctx: &mut HitContext| {
        assert_eq!(ctx.regs.rip, MOV_RIP + 7);
        p.fetch_add(1, Ordering::Relaxed);
    }));
    t.register(req).unwrap();
    let copy = m.bytes(OOL, 7);
    let decoded = insn::analyze(&copy, Gva(OOL)).unwrap();
    assert_eq!(
        decoded.disassembly(),
        format!("mov rax,[0{:X}h]", MOV_RIP + 7 + 0x10),
        "copy {}",
        HexBytes(copy.clone())
    );

    let mut cpu = FakeVcpu::at(MOV_RIP);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, OOL);
    assert!(cpu.stepping);
    assert_eq!(posts.load(Ordering::Relaxed), 0, "post-handlers wait for the step");
    // The CPU executes the copy...
    cpu.regs.rip = OOL + 7;
    assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::Handled));
    assert_eq!(cpu.regs.rip, MOV_RIP + 7);
    assert!(!cpu.stepping);
    assert_eq!(posts.load(Ordering::Relaxed), 1);
    // A step nobody asked for is not ours.
    assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::NotOurs));
}

#[test]
fn bad_addresses_are_refused_with_the_reason() {
    let m = FakeMachine::with_code();
    let sites = PatchSites::from_sites(vec![PatchSite {
        range: Gva(POP)..Gva(POP + 2),
        kind: PatchSiteKind::JumpLabel,
    }]);
    let t = tracer_with(&m, sites, None);
    let err = |p: ProbePoint| t.register(plain(p, "x")).unwrap_err().to_string();
    assert_eq!(
        err(at("func", 7)),
        "func+0x7 is not an instruction boundary in func (instructions start at func+0x6 and func+0x9)"
    );
    assert_eq!(err(at("nope", 0)), "unknown symbol \"nope\"");
    assert!(err(at("func", 0x40)).contains("is outside func"));
    assert!(err(at("func", 0x10)).contains("jump label patch site"));
    assert!(err(ProbePoint::Address(Gva(0x1000))).contains("not in any kernel function"));
    assert!(t.listing().is_empty());
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE, "nothing written");
}

#[test]
fn unregistering_restores_the_text_byte_for_byte() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let a = t.register(plain(at("func", 0), "a")).unwrap();
    let b = t.register(plain(at("func", 9), "b")).unwrap();
    let c = t.register(plain(at("func", 5), "c")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    t.unregister(a).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3], "c still needs the int3 at +5");
    t.unregister(c).unwrap();
    t.unregister(b).unwrap();
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE);
    assert!(matches!(t.unregister(a), Err(ProbeError::NoSuchProbe(_))));
}

#[test]
fn probes_at_one_address_run_in_order_and_a_skip_stops_the_rest() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mk = |name: &'static str, action: PreAction| {
        let order = order.clone();
        let mut req = plain(at("func", 5), name);
        req.pre = Some(Arc::new(move |ctx: &mut HitContext| {
            order.lock().unwrap().push(name);
            if action == PreAction::Skip {
                // Return to the caller with -EPERM, as fault injection does.
                ctx.regs.rax = (-1i64) as u64;
                ctx.regs.rip = 0xffff_ffff_8100_1234;
            }
            action
        }));
        req
    };
    t.register(mk("first", PreAction::Continue)).unwrap();
    t.register(mk("second", PreAction::Skip)).unwrap();
    t.register(mk("third", PreAction::Continue)).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let sp = cpu.regs.rsp;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(*order.lock().unwrap(), ["first", "second"]);
    assert_eq!(cpu.regs.rip, 0xffff_ffff_8100_1234);
    assert_eq!(cpu.regs.rax, u64::MAX);
    assert_eq!(cpu.regs.rsp, sp, "the skipped push did not happen");
}

#[test]
fn disabling_and_the_global_switch_keep_each_probes_state() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let a = t.register(plain(at("func", 5), "a")).unwrap();
    let mut disabled = plain(at("func", 9), "b");
    disabled.disabled = true;
    let b = t.register(disabled).unwrap();
    assert_eq!(m.bytes(MOV_RIP, 1), [0x48], "a disabled probe writes nothing");
    assert!(t.listing()[1].disabled);
    t.set_armed(false).unwrap();
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE);
    assert!(!t.listing()[0].disabled, "the global switch is not a per-probe disable");
    t.set_armed(true).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    assert_eq!(m.bytes(MOV_RIP, 1), [0x48], "b stays disabled");
    t.set_enabled(b, true).unwrap();
    assert_eq!(m.bytes(MOV_RIP, 1), [INT3]);
    t.set_enabled(a, false).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0x55]);
    // A hit racing with the disarm: the original instruction runs again.
    let mut cpu = FakeVcpu::at(PUSH);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, PUSH);
    assert_eq!(t.listing()[0].hits, 0);
}

#[test]
fn a_byte_the_guest_rewrote_is_reported_gone_and_never_written_back() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let a = t.register(plain(at("func", 5), "a")).unwrap();
    m.write_virt(Gva(PUSH), &[0x90]).unwrap();
    t.check_gone();
    assert!(t.listing()[0].gone);
    t.unregister(a).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0x90], "the guest's byte stays");
}

/// A disabled probe's byte rewritten by the guest is found when the probe is enabled (the
/// pause's look for gone sites skips what is not armed): gone, and counted like every other
/// way a site goes.
#[test]
fn a_site_found_gone_when_it_is_armed_is_counted_gone() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let mut disabled = plain(at("func", 9), "b");
    disabled.disabled = true;
    let b = t.register(disabled).unwrap();
    m.write_virt(Gva(MOV_RIP), &[0x90]).unwrap();
    t.set_enabled(b, true).unwrap();
    assert_eq!(m.bytes(MOV_RIP, 1), [0x90], "the guest's byte stays");
    assert!(t.listing()[0].gone);
    assert_eq!(t.stats.gone.load(Ordering::Relaxed), 1);
    t.set_enabled(b, false).unwrap();
    t.set_enabled(b, true).unwrap();
    assert_eq!(t.stats.gone.load(Ordering::Relaxed), 1, "counted once");
}

#[test]
fn a_failing_batch_leaves_nothing_registered() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let err = t
        .register_all(vec![plain(at("func", 5), "a"), plain(at("func", 7), "b")])
        .unwrap_err();
    assert_eq!(err.0, 1);
    assert!(t.listing().is_empty());
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE);
    // One event over two sites must record the same fields (Linux 5.7's multi-probe
    // events): with a field more, the second is refused.
    let with_field = |mut r: KprobeRequest| {
        r.args = crate::spec::parse_line("p f di=%di")
            .unwrap()
            .map_or(Vec::new(), |s| match s {
                crate::spec::ProbeSpec::Kprobe { args, .. } => args,
                _ => Vec::new(),
            });
        r
    };
    assert!(matches!(
        t.register_all(vec![plain(at("func", 5), "a"), with_field(plain(at("func", 9), "a"))]),
        Err((1, ProbeError::DuplicateEvent { .. }))
    ));
}

/// One event may stand for several probes (Linux 5.7's multi-probe events; perf probe's
/// sites of one source line or of an inlined function's instances): each is listed under
/// the event and counts its own hits; removing one leaves the event to the others; a
/// probe of the other kind (a return probe) or with other fields is refused.
#[test]
fn one_event_stands_for_several_probes_of_one_kind_and_fields() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let ids = t
        .register_all(vec![plain(at("func", 0), "multi"), plain(at("func", 5), "multi")])
        .unwrap();
    let listing = t.listing();
    assert_eq!(
        listing.iter().filter(|e| e.event == "test/multi").count(),
        2,
        "{listing:?}"
    );
    assert!(matches!(
        t.register_all(vec![KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 4 },
            ..plain(at("func", 0), "multi")
        }]),
        Err((0, ProbeError::DuplicateEvent { .. }))
    ));
    t.unregister(ids[0]).unwrap();
    assert_eq!(t.listing().iter().filter(|e| e.event == "test/multi").count(), 1);
    // The event goes with its last probe: the name is free for anything again.
    t.unregister(ids[1]).unwrap();
    t.register_all(vec![KprobeRequest {
        kind: ProbeKind::Kretprobe { maxactive: 4 },
        ..plain(at("func", 0), "multi")
    }])
    .unwrap();
}

#[test]
fn the_guests_own_int3_gets_its_breakpoint_after_our_handlers() {
    let m = FakeMachine::with_code();
    m.write_virt(Gva(PUSH), &[INT3]).unwrap();
    let t = tracer(&m);
    let hits = Arc::new(AtomicU64::new(0));
    let h = hits.clone();
    let mut req = plain(at("func", 5), "shared");
    req.pre = Some(Arc::new(move |_: &mut HitContext| {
        h.fetch_add(1, Ordering::Relaxed);
        PreAction::Continue
    }));
    let id = t.register(req).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::HandledThenGuest
    ));
    assert_eq!(cpu.regs.rip, PUSH, "the guest's handler finds RIP on its int3");
    assert_eq!(hits.load(Ordering::Relaxed), 1);
    t.unregister(id).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3], "the guest's int3 is the guest's");
    // Nobody's int3 at all: the guest's.
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(FUNC + 0x40)),
        BreakpointOutcome::NotOurs
    ));
}

#[test]
fn events_beyond_a_full_consumer_count_as_missed() {
    let m = FakeMachine::with_code();
    let events = Arc::new(Events {
        capacity: 2,
        got: Mutex::new(Vec::new()),
    });
    let t = tracer_with(&m, PatchSites::default(), Some(events.clone()));
    let args = crate::spec::parse_line("p:g/e func di=%di")
        .unwrap()
        .map(|s| match s {
            crate::spec::ProbeSpec::Kprobe { args, .. } => args,
            _ => unreachable!(),
        })
        .unwrap();
    t.register(KprobeRequest::event(at("func", 0), "g", "e", args)).unwrap();
    for _ in 0..3 {
        let mut cpu = FakeVcpu::at(PUSH);
        assert!(matches!(
            t.on_breakpoint(1, &mut cpu, Gva(PUSH)),
            BreakpointOutcome::Handled
        ));
    }
    let entry = &t.listing()[0];
    assert_eq!((entry.hits, entry.nmissed), (3, 1));
    let got = events.got.lock().unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].record.cpu, 1);
    assert_eq!(got[0].record.location, "func+0x0/0x40");
    assert_eq!(got[0].record.args[0].1.to_string(), "0x7");
}

#[test]
fn a_tokio_channel_takes_events_and_a_full_one_counts_misses() {
    let m = FakeMachine::with_code();
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let t = tracer_with(&m, PatchSites::default(), Some(Arc::new(tx)));
    t.register(KprobeRequest::event(at("func", 0), "g", "e", Vec::new()))
        .unwrap();
    for _ in 0..2 {
        let mut cpu = FakeVcpu::at(PUSH);
        t.on_breakpoint(0, &mut cpu, Gva(PUSH));
    }
    assert_eq!(rx.try_recv().unwrap().record.event, "e");
    assert!(rx.try_recv().is_err());
    assert_eq!(t.listing()[0].nmissed, 1);
}

fn return_probe(event: &str, maxactive: u32) -> KprobeRequest {
    KprobeRequest {
        kind: ProbeKind::Kretprobe { maxactive },
        ..plain(at("func", 0), event)
    }
}

#[test]
fn a_return_probe_swaps_the_return_address_and_runs_its_handler_at_the_return() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let returned = Arc::new(Mutex::new(Vec::new()));
    let r = returned.clone();
    let mut req = return_probe("ret", 4);
    req.post = Some(Arc::new(move |ctx: &mut HitContext| {
        r.lock().unwrap().push((ctx.regs.rax, ctx.regs.rip));
    }));
    t.register(req).unwrap();
    let trampoline = Gva(OOL);
    assert_eq!(
        m.bytes(OOL, 1),
        [INT3],
        "the trampoline is an int3 in the out-of-line area"
    );

    // The call: the return address on the stack, the int3 past the ftrace NOP.
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = cpu.regs.rsp;
    m.write_virt(Gva(slot), &caller.to_le_bytes()).unwrap();
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(m.read_u64(Gva(slot)).unwrap(), trampoline.0, "return address swapped");
    assert_eq!(t.returns_in_flight(), 1);
    assert!(returned.lock().unwrap().is_empty());

    // ... the function runs and returns into the trampoline.
    cpu.regs = Regs {
        rip: trampoline.0,
        rsp: slot + 8,
        rax: 42,
        ..cpu.regs
    };
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, trampoline),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(*returned.lock().unwrap(), [(42, caller)]);
    assert_eq!(t.returns_in_flight(), 0);
    let entry = &t.listing()[0];
    assert_eq!((entry.kind, entry.hits, entry.nmissed), (ListKind::Kretprobe, 1, 0));
}

#[test]
fn calls_beyond_maxactive_are_missed_and_return_probes_need_a_function_entry() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(return_probe("ret", 2)).unwrap();
    for depth in 0..3u64 {
        let mut cpu = FakeVcpu::at(PUSH);
        cpu.regs.rsp -= 0x10 * depth;
        t.on_breakpoint(0, &mut cpu, Gva(PUSH));
    }
    assert_eq!(t.returns_in_flight(), 2);
    assert_eq!(t.listing()[0].nmissed, 1);
    let err = t
        .register(KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 1 },
            ..plain(at("func", 9), "mid")
        })
        .unwrap_err();
    assert!(matches!(err, ProbeError::ReturnProbeNotAtEntry { .. }), "{err}");
    // A return through the trampoline nobody recorded is our bug: reported, and never a
    // #BP injected in the out-of-line area (the guest would die in its int3 handler).
    let mut cpu = FakeVcpu::at(OOL);
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(OOL));
    assert!(
        matches!(outcome, BreakpointOutcome::Fatal(EngineFault::UnknownReturn { .. })),
        "{outcome:?}"
    );
}

#[test]
fn register_changes_at_a_shared_int3_reach_the_guest_with_its_breakpoint() {
    let m = FakeMachine::with_code();
    m.write_virt(Gva(PUSH), &[INT3]).unwrap();
    let t = tracer(&m);
    let mut req = plain(at("func", 5), "shared");
    req.pre = Some(Arc::new(|ctx: &mut HitContext| {
        ctx.regs.rax = 0xdead;
        PreAction::Continue
    }));
    t.register(req).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::HandledThenGuest
    ));
    assert_eq!((cpu.regs.rax, cpu.regs.rip), (0xdead, PUSH));
}

// ---- Return probes: per-stack chains ----

/// A return probe on `name+0` whose entry handler stores `%rdi` in its per-call data and
/// whose return handler reports (probe event, stored rdi, rax, rip).
type Returned = Arc<Mutex<Vec<(&'static str, u64, u64, u64)>>>;

fn recording_return_probe(name: &str, event: &'static str, maxactive: u32, log: &Returned) -> KprobeRequest {
    let log = log.clone();
    KprobeRequest {
        kind: ProbeKind::Kretprobe { maxactive },
        data_size: 8,
        pre: Some(Arc::new(|ctx: &mut HitContext| {
            ctx.data.copy_from_slice(&ctx.regs.rdi.to_le_bytes());
            PreAction::Continue
        })),
        post: Some(Arc::new(move |ctx: &mut HitContext| {
            let stored = u64::from_le_bytes(ctx.data[..8].try_into().unwrap());
            log.lock().unwrap().push((event, stored, ctx.regs.rax, ctx.regs.rip));
        })),
        ..plain(at(name, 0), event)
    }
}

/// The vCPU enters `func` (its int3 is past the ftrace NOP) with `rsp` holding `caller`.
fn call_func(t: &Tracer, m: &FakeMachine, cpu: &mut FakeVcpu, rsp: u64, caller: u64, rdi: u64) {
    m.write_virt(Gva(rsp), &caller.to_le_bytes()).unwrap();
    cpu.regs.rip = PUSH;
    cpu.regs.rsp = rsp;
    cpu.regs.rdi = rdi;
    assert!(matches!(t.on_breakpoint(0, cpu, Gva(PUSH)), BreakpointOutcome::Handled));
}

/// The function whose frame is at `rsp` returns `rax` through whatever is on its stack slot.
fn return_from(t: &Tracer, m: &FakeMachine, cpu: &mut FakeVcpu, rsp: u64, rax: u64) -> BreakpointOutcome {
    let to = m.read_u64(Gva(rsp)).unwrap();
    assert_eq!(to, OOL, "the return address was swapped for the trampoline");
    cpu.regs.rip = to;
    cpu.regs.rsp = rsp + 8;
    cpu.regs.rax = rax;
    t.on_breakpoint(0, cpu, Gva(to))
}

#[test]
fn a_tail_call_between_two_return_probes_returns_to_the_real_caller_and_fires_both() {
    // `__x64_sys_openat` tail-calls (`jmp`) `do_sys_open`: both return probes share one
    // stack slot. Before per-stack chains, the second entry recorded the trampoline as the
    // caller and the return went back into the trampoline (a guest panic).
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "outer", 4, &log)).unwrap();
    t.register(recording_return_probe("other", "inner", 4, &log)).unwrap();
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = STACK_TOP - 0x100;
    call_func(&t, &m, &mut cpu, slot, caller, 1);
    // func ... jmp other: `other`'s int3 with the same RSP; its `ret` is emulated.
    cpu.regs.rip = OTHER;
    cpu.regs.rsp = slot;
    cpu.regs.rdi = 2;
    cpu.regs.rax = 7;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OTHER)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, OOL, "other's ret went to the trampoline");
    assert_eq!(t.returns_in_flight(), 2);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OOL)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(cpu.regs.rsp, slot + 8);
    assert_eq!(
        *log.lock().unwrap(),
        [("inner", 2, 7, caller), ("outer", 1, 7, caller)],
        "each probe once, latest first, same return value, each with its own data"
    );
    assert_eq!(t.returns_in_flight(), 0);
}

#[test]
fn a_guest_return_probe_between_a_tail_call_and_ours_returns_through_both_trampolines_in_turn() {
    // `__x64_sys_openat` (ours) tail-calls `do_sys_open`, where the guest's own kretprobe
    // swaps our trampoline in the shared slot for its `arch_rethook_trampoline` (keeping
    // ours), then our second return probe swaps the guest's for ours. The return goes: our
    // trampoline (the inner probe) -> the guest's (its handler) -> ours again (the outer
    // probe) -> the caller. Before, the inner entry dropped the outer call and the second
    // return through our trampoline found no call on record: the VM stopped.
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "outer", 4, &log)).unwrap();
    t.register(recording_return_probe("other", "inner", 4, &log)).unwrap();
    // A second one on the tail-called function returns with the first.
    t.register(recording_return_probe("other", "inner2", 4, &log)).unwrap();
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = STACK_TOP - 0x100;
    call_func(&t, &m, &mut cpu, slot, caller, 1);
    assert_eq!(m.read_u64(Gva(slot)).unwrap(), OOL);
    // The guest's kretprobe on `other` (its ftrace call at +0, before our int3).
    m.write_virt(Gva(slot), &GUEST_RETHOOK.to_le_bytes()).unwrap();
    cpu.regs.rip = OTHER;
    cpu.regs.rsp = slot;
    cpu.regs.rdi = 2;
    cpu.regs.rax = 7;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OTHER)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, OOL, "other's ret went to our trampoline");
    assert_eq!(t.returns_in_flight(), 3);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OOL)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, GUEST_RETHOOK, "then the guest's trampoline");
    assert_eq!(
        *log.lock().unwrap(),
        [("inner2", 2, 7, GUEST_RETHOOK), ("inner", 2, 7, GUEST_RETHOOK)]
    );
    assert_eq!(t.returns_in_flight(), 1, "the outer call is still on record");
    // The guest's trampoline puts back what it swapped out (ours) and returns to it.
    m.write_virt(Gva(slot), &OOL.to_le_bytes()).unwrap();
    cpu.regs.rip = OOL;
    cpu.regs.rsp = slot + 8;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OOL)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(
        *log.lock().unwrap(),
        [
            ("inner2", 2, 7, GUEST_RETHOOK),
            ("inner", 2, 7, GUEST_RETHOOK),
            ("outer", 1, 7, caller)
        ]
    );
    assert_eq!(t.returns_in_flight(), 0);
}

#[test]
fn the_guests_function_graph_hook_between_a_tail_call_and_ours_returns_through_both_in_turn() {
    // `proc_reg_read_iter` (ours) tail-calls `seq_read_iter` while the guest's own
    // function_graph tracer traces it: its ftrace call (+0, before our int3) swaps our
    // trampoline in the shared slot for `return_to_handler` (keeping ours in the task's
    // return stack). The return goes: our trampoline (the inner probe) -> the guest's hook
    // -> ours again (the outer probe) -> the caller. Before, the inner entry took the
    // guest's hook for a new call's return address, dropped the outer call, and the second
    // return through our trampoline found no call on record: the VM stopped.
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "outer", 4, &log)).unwrap();
    t.register(recording_return_probe("other", "inner", 4, &log)).unwrap();
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = STACK_TOP - 0x100;
    call_func(&t, &m, &mut cpu, slot, caller, 1);
    assert_eq!(m.read_u64(Gva(slot)).unwrap(), OOL);
    m.write_virt(Gva(slot), &GUEST_FGRAPH_RETURN.to_le_bytes()).unwrap();
    cpu.regs.rip = OTHER;
    cpu.regs.rsp = slot;
    cpu.regs.rdi = 2;
    cpu.regs.rax = 7;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OTHER)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(t.returns_in_flight(), 2, "the outer call is still on record");
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OOL)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, GUEST_FGRAPH_RETURN, "then the guest's hook");
    assert_eq!(t.returns_in_flight(), 1, "the outer call is still on record");
    // The guest's hook returns to what it swapped out: ours.
    m.write_virt(Gva(slot), &OOL.to_le_bytes()).unwrap();
    cpu.regs.rip = OOL;
    cpu.regs.rsp = slot + 8;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(OOL)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    let log = log.lock().unwrap();
    let names: Vec<&str> = log.iter().map(|(n, ..)| *n).collect();
    assert_eq!(names, ["inner", "outer"]);
    assert_eq!(t.returns_in_flight(), 0);
}

#[test]
fn two_return_probes_on_one_function_each_fire_once_per_call() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "a", 4, &log)).unwrap();
    t.register(recording_return_probe("func", "b", 4, &log)).unwrap();
    let caller = 0xffff_ffff_8100_0def_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = STACK_TOP - 0x100;
    call_func(&t, &m, &mut cpu, slot, caller, 9);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, slot, 5),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(*log.lock().unwrap(), [("b", 9, 5, caller), ("a", 9, 5, caller)]);
    let list = t.listing();
    assert_eq!((list[0].hits, list[1].hits), (1, 1));
}

#[test]
fn recursive_calls_return_in_order_with_their_own_private_data() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "r", 8, &log)).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let (outer, inner) = (STACK_TOP - 0x100, STACK_TOP - 0x180);
    call_func(&t, &m, &mut cpu, outer, 0xffff_ffff_8100_1111, 1);
    call_func(&t, &m, &mut cpu, inner, PUSH + 0x20, 2);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, inner, 20),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, PUSH + 0x20);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, outer, 10),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, 0xffff_ffff_8100_1111);
    assert_eq!(
        *log.lock().unwrap(),
        [("r", 2, 20, PUSH + 0x20), ("r", 1, 10, 0xffff_ffff_8100_1111)]
    );
}

#[test]
fn a_returns_record_carries_its_own_calls_entry_time() {
    let m = FakeMachine::with_code();
    let events = Arc::new(Events {
        capacity: 8,
        got: Mutex::new(Vec::new()),
    });
    let t = tracer_with(&m, PatchSites::default(), Some(events.clone()));
    t.register(KprobeRequest {
        kind: ProbeKind::Kretprobe { maxactive: 8 },
        ..KprobeRequest::event(at("func", 0), "g", "ret", Vec::new())
    })
    .unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let (outer, inner) = (STACK_TOP - 0x100, STACK_TOP - 0x180);
    let before_outer = t.timestamp_ns();
    call_func(&t, &m, &mut cpu, outer, 0xffff_ffff_8100_1111, 1);
    // The clock must move between the two entries for their order to show.
    std::thread::sleep(std::time::Duration::from_millis(2));
    let before_inner = t.timestamp_ns();
    call_func(&t, &m, &mut cpu, inner, PUSH + 0x20, 2);
    std::thread::sleep(std::time::Duration::from_millis(2));
    let before_returns = t.timestamp_ns();
    assert!(matches!(
        return_from(&t, &m, &mut cpu, inner, 0),
        BreakpointOutcome::Handled
    ));
    assert!(matches!(
        return_from(&t, &m, &mut cpu, outer, 0),
        BreakpointOutcome::Handled
    ));
    let got = events.got.lock().unwrap();
    let stamps: Vec<(u64, u64)> = got
        .iter()
        .map(|e| {
            (
                e.record.entry_timestamp_ns.expect("a return knows its entry"),
                e.record.timestamp_ns,
            )
        })
        .collect();
    assert_eq!(stamps.len(), 2);
    let ((inner_entry, inner_return), (outer_entry, outer_return)) = (stamps[0], stamps[1]);
    assert!((before_outer..before_inner).contains(&outer_entry), "{stamps:?}");
    assert!((before_inner..before_returns).contains(&inner_entry), "{stamps:?}");
    assert!(
        before_returns <= inner_return && inner_return <= outer_return,
        "{stamps:?}"
    );
}

#[test]
fn a_return_reads_the_arguments_of_its_own_calls_entry_and_the_time_since_it() {
    use crate::fetch::ArgValue;
    use crate::spec::{ArgType, FetchArg, FetchExpr};
    let m = FakeMachine::with_code();
    let events = Arc::new(Events {
        capacity: 8,
        got: Mutex::new(Vec::new()),
    });
    let t = tracer_with(&m, PatchSites::default(), Some(events.clone()));
    let arg = |name: &str, expr: FetchExpr, ty: ArgType| FetchArg {
        name: name.into(),
        expr,
        ty,
        array_len: None,
        typed: false,
    };
    // The string the first argument points to is read at the return, from the entry's
    // pointer (Linux 6.9+'s entry data: the argument saved, the dereference at the return).
    let args = vec![
        arg("a1", FetchExpr::Arg(1), ArgType::U64),
        arg(
            "first",
            FetchExpr::Deref {
                offset: 0,
                user: false,
                base: Box::new(FetchExpr::Arg(1)),
            },
            ArgType::U64,
        ),
        arg("lat", FetchExpr::Duration, ArgType::U64),
        arg("ret", FetchExpr::Retval, ArgType::U64),
    ];
    t.register(KprobeRequest {
        kind: ProbeKind::Kretprobe { maxactive: 8 },
        ..KprobeRequest::event(at("func", 0), "g", "ret", args)
    })
    .unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let (outer, inner) = (STACK_TOP - 0x100, STACK_TOP - 0x180);
    let (outer_arg, inner_arg) = (STACK_TOP - 0x800, STACK_TOP - 0x900);
    m.write_virt(Gva(outer_arg), &111u64.to_le_bytes()).unwrap();
    m.write_virt(Gva(inner_arg), &222u64.to_le_bytes()).unwrap();
    call_func(&t, &m, &mut cpu, outer, 0xffff_ffff_8100_1111, outer_arg);
    std::thread::sleep(std::time::Duration::from_millis(3));
    call_func(&t, &m, &mut cpu, inner, PUSH + 0x20, inner_arg);
    // The callees clobber %rdi, and the inner call rewrote what its argument points to.
    cpu.regs.rdi = 0xdead;
    m.write_virt(Gva(inner_arg), &333u64.to_le_bytes()).unwrap();
    assert!(matches!(
        return_from(&t, &m, &mut cpu, inner, 7),
        BreakpointOutcome::Handled
    ));
    cpu.regs.rdi = 0xbeef;
    assert!(matches!(
        return_from(&t, &m, &mut cpu, outer, 9),
        BreakpointOutcome::Handled
    ));
    let got = events.got.lock().unwrap();
    let value = |e: &HitEvent, name: &str| match e.record.args.iter().find(|(n, _)| n == name) {
        Some((_, ArgValue::Unsigned(v))) => *v,
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(got.len(), 2);
    let (inner_event, outer_event) = (&got[0], &got[1]);
    assert_eq!(value(inner_event, "a1"), inner_arg);
    assert_eq!(value(inner_event, "first"), 333, "dereferenced at the return");
    assert_eq!(value(inner_event, "ret"), 7);
    assert_eq!(value(outer_event, "a1"), outer_arg);
    assert_eq!(value(outer_event, "first"), 111);
    assert_eq!(value(outer_event, "ret"), 9);
    for e in [inner_event, outer_event] {
        let entry = e.record.entry_timestamp_ns.unwrap();
        assert_eq!(
            value(e, "lat"),
            e.record.timestamp_ns - entry,
            "the record's own two times"
        );
    }
    assert!(
        value(outer_event, "lat") >= 3_000_000,
        "the outer call lasted the 3 ms sleep"
    );
    assert!(value(outer_event, "lat") > value(inner_event, "lat"));
}

#[test]
fn an_entry_hit_that_runs_again_follows_the_call_once() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "r", 4, &log)).unwrap();
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = STACK_TOP - 0x100;
    call_func(&t, &m, &mut cpu, slot, caller, 3);
    // The entry's instruction faulted and the guest's handler sent it back to the probe.
    cpu.regs.rip = PUSH;
    cpu.regs.rsp = slot;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(t.returns_in_flight(), 1);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, slot, 0),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[test]
fn calls_that_never_return_are_freed_at_do_exit_and_never_use_up_maxactive() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    let id = t.register(recording_return_probe("func", "r", 2, &log)).unwrap();
    assert_eq!(m.bytes(DO_EXIT + 5, 1), [INT3], "the engine hooks do_exit");
    assert_eq!(t.probe_ids(), [id], "its hook is not the user's");
    assert_eq!(t.listing().len(), 1);
    // Ten tasks, each on its own kernel stack, enter func and exit inside it.
    for task in 0..10u64 {
        let stack_top = STACK_TOP + (task + 1) * 0x4000;
        m.write_virt(Gva(stack_top - 0x1000), &[0u8; 0x1000]).unwrap();
        let mut cpu = FakeVcpu::at(PUSH);
        call_func(&t, &m, &mut cpu, stack_top - 0x100, 0xffff_ffff_8100_0abc, task);
        cpu.regs.rip = DO_EXIT + 5;
        cpu.regs.rsp = stack_top - 0x400;
        assert!(matches!(
            t.on_breakpoint(0, &mut cpu, Gva(DO_EXIT + 5)),
            BreakpointOutcome::Handled
        ));
        assert_eq!(t.returns_in_flight(), 0, "task {task}'s call is freed at do_exit");
    }
    assert_eq!(t.listing()[0].nmissed, 0);
    assert_eq!(t.stats.returns_abandoned.load(Ordering::Relaxed), 10);
    t.unregister(id).unwrap();
    assert_eq!(
        m.bytes(DO_EXIT, DO_EXIT_CODE.len()),
        DO_EXIT_CODE,
        "the hook goes with the last return probe"
    );
}

#[test]
fn abandoned_frames_on_a_reused_stack_and_overwritten_slots_are_reclaimed() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "r", 2, &log)).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    // A deep call that never returns (its stack frame was left and the stack used again,
    // overwriting its slot), then a shallower call on the same stack: the deep one is dead.
    call_func(&t, &m, &mut cpu, STACK_TOP - 0x800, 1, 0);
    m.write_virt(Gva(STACK_TOP - 0x800), &0x1234u64.to_le_bytes()).unwrap();
    call_func(&t, &m, &mut cpu, STACK_TOP - 0x100, 2, 0);
    assert_eq!(t.returns_in_flight(), 1);
    // A call on another stack whose slot the guest then overwrote (its frame is gone).
    let other_stack = STACK_TOP + 0x4000;
    m.write_virt(Gva(other_stack - 0x1000), &[0u8; 0x1000]).unwrap();
    call_func(&t, &m, &mut cpu, other_stack - 0x100, 3, 0);
    m.write_virt(Gva(other_stack - 0x100), &0u64.to_le_bytes()).unwrap();
    // maxactive (2) reached: the overwritten one is reclaimed instead of a miss.
    let third_stack = STACK_TOP + 0x8000;
    m.write_virt(Gva(third_stack - 0x1000), &[0u8; 0x1000]).unwrap();
    call_func(&t, &m, &mut cpu, third_stack - 0x100, 4, 0);
    assert_eq!(t.listing()[0].nmissed, 0);
    assert_eq!(t.returns_in_flight(), 2);
    assert_eq!(t.stats.returns_abandoned.load(Ordering::Relaxed), 2);
}

// ---- The guest's int3s ----

#[test]
fn the_guests_int3_at_a_disabled_or_disarmed_site_is_the_guests() {
    let m = FakeMachine::with_code();
    m.write_virt(Gva(PUSH), &[INT3]).unwrap();
    let t = tracer(&m);
    let id = t.register(plain(at("func", 5), "shared")).unwrap();
    t.set_enabled(id, false).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::NotOurs
    ));
    t.set_enabled(id, true).unwrap();
    t.set_armed(false).unwrap();
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::NotOurs
    ));
    // Our own site, disarmed, where the guest then put an int3 (its own kprobe).
    t.register(plain(at("func", 9), "ours")).unwrap();
    m.write_virt(Gva(MOV_RIP), &[INT3]).unwrap();
    let mut cpu = FakeVcpu::at(MOV_RIP);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
        BreakpointOutcome::NotOurs
    ));
}

#[test]
fn a_gone_site_is_found_at_the_next_pause_and_its_int3_exits_go_to_the_guest() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(plain(at("func", 5), "a")).unwrap();
    // The guest rewrites the byte with an int3 of its own (text_poke_bp's first step).
    m.write_virt(Gva(PUSH), &[0x90]).unwrap();
    t.register(plain(at("func", 9), "b")).unwrap();
    assert!(t.listing()[0].gone, "found at the pause of the next registration");
    assert_eq!(t.stats.gone.load(Ordering::Relaxed), 1);
    m.write_virt(Gva(PUSH), &[INT3]).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::NotOurs
    ));
}

#[test]
fn an_int3_in_the_out_of_line_area_that_is_not_ours_stops_the_vm() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(plain(at("func", 9), "stepped")).unwrap();
    let mut cpu = FakeVcpu::at(OOL + 0x100);
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(OOL + 0x100));
    assert!(
        matches!(
            outcome,
            BreakpointOutcome::Fatal(EngineFault::UnknownOutOfLineBreakpoint { .. })
        ),
        "{outcome:?}"
    );
}

// ---- Error paths and the out-of-line step ----

#[test]
fn a_step_that_cannot_start_stops_the_vm_with_the_vcpu_untouched() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(plain(at("func", 9), "stepped")).unwrap();
    let mut cpu = FakeVcpu::at(MOV_RIP);
    cpu.regs.rflags = 0x202;
    cpu.step_fails = true;
    let before = cpu.regs;
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP));
    assert!(
        matches!(outcome, BreakpointOutcome::Fatal(EngineFault::Vcpu { .. })),
        "{outcome:?}"
    );
    assert_eq!(cpu.regs, before, "never left in the copy with IF cleared and no trap");
    assert!(!cpu.stepping);
}

#[test]
fn a_push_the_host_cannot_emulate_is_stepped_so_the_cpu_raises_the_fault() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let pres = Arc::new(AtomicU64::new(0));
    let p = pres.clone();
    let mut req = plain(at("func", 5), "push");
    req.pre = Some(Arc::new(move |_: &mut HitContext| {
        p.fetch_add(1, Ordering::Relaxed);
        PreAction::Continue
    }));
    t.register(req).unwrap();
    // RSP on a page that is not there: the emulated push cannot write.
    let mut cpu = FakeVcpu::at(PUSH);
    cpu.regs.rsp = 0xffff_c900_0000_0000;
    m.unmapped.lock().unwrap().push(cpu.regs.rsp - 0x1000);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert!(cpu.stepping, "stepped instead");
    let slot = cpu.regs.rip;
    assert!((OOL..OOL + 0x1000).contains(&slot));
    assert_eq!(m.bytes(slot, 1), [0x55], "a copy of the push");
    assert_eq!(t.stats.emulation_fallbacks.load(Ordering::Relaxed), 1);
    assert_eq!(pres.load(Ordering::Relaxed), 1, "the handlers ran once");
}

/// Lays an exception frame (RIP, CS, RFLAGS, RSP, SS; `error_code` first if given) at
/// `at`, as the CPU pushes it.
fn push_frame(m: &FakeMachine, at: u64, error_code: Option<u64>, rip: u64, rflags: u64) -> u64 {
    let mut words = Vec::new();
    words.extend(error_code);
    words.extend([rip, 0x10, rflags, STACK_TOP - 0x100, 0]);
    for (i, w) in words.iter().enumerate() {
        m.write_virt(Gva(at + 8 * i as u64), &w.to_le_bytes()).unwrap();
    }
    at + 8 * u64::from(error_code.is_some())
}

/// Which way the host hears of an exception or NMI delivered during a step.
#[derive(Clone, Copy, Debug)]
enum StepInterruption {
    /// kvm_pvm: the step trap, at the first instruction of the handler (the guard's stub).
    StepTrap,
    /// Hardware KVM: the CPU runs the handler, the stub's int3 exits.
    StubInt3,
}

#[test]
fn an_exception_or_nmi_during_a_step_goes_to_the_guests_handler_returning_to_the_probe() {
    for route in [StepInterruption::StepTrap, StepInterruption::StubInt3] {
        // An NMI (no error code, the guest's gate on IST 2), #GP and #PF (error codes).
        for vector in [2u8, 13, 14] {
            let m = FakeMachine::with_code();
            let t = tracer(&m);
            let posts = Arc::new(AtomicU64::new(0));
            let p = posts.clone();
            let mut req = plain(at("func", 9), "stepped");
            req.post = Some(Arc::new(move |_: &mut HitContext| {
                p.fetch_add(1, Ordering::Relaxed);
            }));
            t.register(req).unwrap();
            let mut cpu = FakeVcpu::at(MOV_RIP);
            cpu.regs.rflags = 0x202;
            assert!(matches!(
                t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
                BreakpointOutcome::Handled
            ));
            assert_eq!(cpu.regs.rflags & rflags::IF, 0, "IF cleared for the step");
            assert_eq!(
                cpu.idt,
                crate::machine::InterruptTable {
                    base: Gva(GUARD_IDT),
                    limit: GUEST_IDT.limit
                },
                "the step runs on the guard's IDT"
            );
            let gate = m.bytes(GUARD_IDT + 16 * u64::from(vector), 16);
            let guest_gate = m.bytes(GUEST_IDT.base.0 + 16 * u64::from(vector), 16);
            assert_eq!(gate[2..6], guest_gate[2..6], "the guest's selector, IST and type");
            let stub = GUARD_STUBS + u64::from(vector);
            let offset = u64::from(u16::from_le_bytes([gate[0], gate[1]]))
                | u64::from(u16::from_le_bytes([gate[6], gate[7]])) << 16
                | u64::from(u32::from_le_bytes(gate[8..12].try_into().unwrap())) << 32;
            assert_eq!(offset, stub);
            assert_eq!(m.bytes(stub, 1), [INT3]);
            // The copy faulted (or an NMI came): the CPU pushed a frame through the guard's
            // gate, where the guest's own would have.
            let frame_at = STACK_TOP - 0x800;
            let error_code = super::step_guard::has_error_code(vector).then_some(2);
            let frame = push_frame(&m, frame_at, error_code, OOL, cpu.regs.rflags | rflags::TF);
            cpu.regs.rip = stub;
            cpu.regs.rsp = frame_at;
            cpu.regs.rflags = 0x2;
            match route {
                StepInterruption::StepTrap => {
                    assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::Handled))
                }
                StepInterruption::StubInt3 => assert!(matches!(
                    t.on_breakpoint(0, &mut cpu, Gva(stub)),
                    BreakpointOutcome::Handled
                )),
            }
            assert!(!cpu.stepping);
            assert_eq!(cpu.idt, GUEST_IDT, "{route:?} {vector}: the guest's IDT back");
            assert_eq!(
                cpu.regs.rip,
                GUEST_HANDLERS + 0x10 * u64::from(vector),
                "the guest's handler runs"
            );
            assert_eq!(cpu.regs.rsp, frame_at, "on the frame the CPU pushed");
            assert_eq!(m.read_u64(Gva(frame)).unwrap(), MOV_RIP, "it returns to the probe");
            let flags = m.read_u64(Gva(frame + 16)).unwrap();
            assert_eq!(flags & rflags::IF, rflags::IF, "with the guest's IF");
            assert_eq!(flags & rflags::TF, 0, "and no TF");
            assert_eq!(posts.load(Ordering::Relaxed), 0, "the instruction did not complete");
            assert_eq!(t.stats.steps_interrupted.load(Ordering::Relaxed), 1);
        }
    }
}

/// A tracer with a probe on the RIP-relative `mov` (stepped), and a vCPU sent into its copy.
fn stepping_the_mov() -> (Arc<FakeMachine>, Tracer, FakeVcpu) {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(plain(at("func", 9), "stepped")).unwrap();
    let mut cpu = FakeVcpu::at(MOV_RIP);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
        BreakpointOutcome::Handled
    ));
    (m, t, cpu)
}

#[test]
fn a_step_that_ends_normally_gives_the_guest_its_idt_back() {
    let (_m, t, mut cpu) = stepping_the_mov();
    assert_eq!(cpu.idt.base, Gva(GUARD_IDT));
    cpu.regs.rip += 7; // past the copy of the 7-byte mov
    assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::Handled));
    assert_eq!(cpu.idt, GUEST_IDT);
    assert_eq!(cpu.regs.rip, MOV_RIP + 7);
}

/// kvm_pvm's emulator loses the step trap after some instructions (`mfence`, `lfence`,
/// `sfence`, `serialize`, `swapgs`, `out`: measured by `vmm/tests/single_step.rs`): the vCPU
/// runs on past the copy. What follows a copy in its slot is int3s, never the bytes an
/// earlier, longer copy left there, so the vCPU stops at once and the step ends there.
#[test]
fn a_step_whose_trap_the_backend_lost_ends_at_the_int3_after_the_copy() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let posts = Arc::new(AtomicU64::new(0));
    let p = posts.clone();
    // The slot first holds the 7-byte mov's copy, then (reused) the 1-byte push's.
    let mov = t.register(plain(at("func", 9), "stepped")).unwrap();
    let slot = {
        let mut cpu = FakeVcpu::at(MOV_RIP);
        assert!(matches!(
            t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
            BreakpointOutcome::Handled
        ));
        let slot = cpu.regs.rip;
        cpu.regs.rip += 7;
        assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::Handled));
        slot
    };
    t.unregister(mov).unwrap();
    let mut req = plain(at("func", 5), "push");
    req.pre = None;
    req.post = Some(Arc::new(move |_: &mut HitContext| {
        p.fetch_add(1, Ordering::Relaxed);
    }));
    t.register(req).unwrap();
    // RSP on a page that is not there: the host cannot emulate the push, it is stepped.
    let mut cpu = FakeVcpu::at(PUSH);
    cpu.regs.rsp = 0xffff_c900_0000_0000;
    cpu.regs.rflags = 0x202;
    m.unmapped.lock().unwrap().push(cpu.regs.rsp - 0x1000);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, slot, "the slot the mov's copy had");
    assert_eq!(m.bytes(slot, 16), {
        let mut b = vec![0x55];
        b.extend([INT3; 15]);
        b
    });
    // The copy ran (the push wrote below RSP) and no trap came: the int3 after it exits.
    cpu.regs.rip = slot + 1;
    cpu.regs.rsp -= 8;
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(slot + 1));
    assert!(matches!(outcome, BreakpointOutcome::Handled), "{outcome:?}");
    assert!(!cpu.stepping, "single-stepping off");
    assert_eq!(cpu.idt, GUEST_IDT, "the guest's IDT back");
    assert_eq!(cpu.regs.rip, PUSH + 1, "on in the function");
    assert_eq!(cpu.regs.rflags & rflags::IF, rflags::IF, "with the guest's IF");
    assert_eq!(posts.load(Ordering::Relaxed), 1, "the post-handler ran once");
    assert_eq!(t.stats.step_traps_lost.load(Ordering::Relaxed), 1);
    // Anywhere else in the slot, an int3 is still none of ours.
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(slot + 3));
    assert!(
        matches!(
            outcome,
            BreakpointOutcome::Fatal(EngineFault::UnknownOutOfLineBreakpoint { .. })
        ),
        "{outcome:?}"
    );
}

/// An exception or NMI delivered at the boundary after the copy (frame RIP = the copy's
/// end, or the target of a branch the copy took), before the step's trap: the instruction
/// completed, so the guest's handler returns past the probe, not to it, and the hit is
/// counted once.
#[test]
fn an_event_delivered_after_the_copy_completed_returns_past_the_probe() {
    for route in [StepInterruption::StepTrap, StepInterruption::StubInt3] {
        for vector in [2u8, 14] {
            let m = FakeMachine::with_code();
            let t = tracer(&m);
            let posts = Arc::new(AtomicU64::new(0));
            let p = posts.clone();
            let mut req = plain(at("func", 9), "stepped");
            req.post = Some(Arc::new(move |ctx: &mut HitContext| {
                assert_eq!(ctx.regs.rip, MOV_RIP + 7, "the post-handler sees the instruction's end");
                p.fetch_add(1, Ordering::Relaxed);
            }));
            t.register(req).unwrap();
            let mut cpu = FakeVcpu::at(MOV_RIP);
            cpu.regs.rflags = 0x202;
            assert!(matches!(
                t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
                BreakpointOutcome::Handled
            ));
            let slot = cpu.regs.rip;
            let frame_at = STACK_TOP - 0x800;
            let error_code = super::step_guard::has_error_code(vector).then_some(0);
            let frame = push_frame(&m, frame_at, error_code, slot + 7, cpu.regs.rflags | rflags::TF);
            cpu.regs.rip = GUARD_STUBS + u64::from(vector);
            cpu.regs.rsp = frame_at;
            cpu.regs.rflags = 0x2;
            match route {
                StepInterruption::StepTrap => {
                    assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::Handled))
                }
                StepInterruption::StubInt3 => {
                    let outcome = t.on_breakpoint(0, &mut cpu, Gva(GUARD_STUBS + u64::from(vector)));
                    assert!(
                        matches!(outcome, BreakpointOutcome::Handled),
                        "{route:?} {vector}: {outcome:?}"
                    )
                }
            }
            assert!(!cpu.stepping);
            assert_eq!(cpu.idt, GUEST_IDT, "{route:?} {vector}: the guest's IDT back");
            assert_eq!(
                cpu.regs.rip,
                GUEST_HANDLERS + 0x10 * u64::from(vector),
                "the guest's handler runs"
            );
            assert_eq!(
                m.read_u64(Gva(frame)).unwrap(),
                MOV_RIP + 7,
                "{route:?} {vector}: it returns past the probe"
            );
            let flags = m.read_u64(Gva(frame + 16)).unwrap();
            assert_eq!(flags & (rflags::IF | rflags::TF), rflags::IF, "the guest's IF, no TF");
            assert_eq!(
                posts.load(Ordering::Relaxed),
                1,
                "the instruction completed: its post-handler ran"
            );
            assert_eq!(t.stats.hits.load(Ordering::Relaxed), 1, "one hit");
            assert_eq!(t.stats.steps_interrupted.load(Ordering::Relaxed), 1);
        }
    }
}

#[test]
fn a_stub_int3_whose_frame_is_not_from_the_copy_stops_the_vm_with_the_guests_idt_back() {
    let (m, t, mut cpu) = stepping_the_mov();
    let frame_at = STACK_TOP - 0x800;
    push_frame(&m, frame_at, Some(0), 0xffff_ffff_8100_4321, 0x2);
    cpu.regs.rip = GUARD_STUBS + 13;
    cpu.regs.rsp = frame_at;
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(GUARD_STUBS + 13));
    assert!(
        matches!(
            outcome,
            BreakpointOutcome::Fatal(EngineFault::StepGuard { vector: 13, .. })
        ),
        "{outcome:?}"
    );
    assert_eq!(cpu.idt, GUEST_IDT);
    // With no step pending, a stub's int3 is no int3 of ours.
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(GUARD_STUBS + 13));
    assert!(
        matches!(
            outcome,
            BreakpointOutcome::Fatal(EngineFault::UnknownOutOfLineBreakpoint { .. })
        ),
        "{outcome:?}"
    );
}

#[test]
fn no_post_handler_runs_after_unregister_returns_even_mid_step() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let posts = Arc::new(AtomicU64::new(0));
    let p = posts.clone();
    let mut req = plain(at("func", 9), "stepped");
    req.post = Some(Arc::new(move |_: &mut HitContext| {
        p.fetch_add(1, Ordering::Relaxed);
    }));
    let id = t.register(req).unwrap();
    let mut cpu = FakeVcpu::at(MOV_RIP);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
        BreakpointOutcome::Handled
    ));
    // Parked between its int3 and its step trap while the probe goes.
    *m.parked.lock().unwrap() = vec![(1, cpu.regs.rip)];
    t.unregister(id).unwrap();
    cpu.regs.rip = OOL + 7;
    assert!(matches!(t.on_single_step(0, &mut cpu), StepOutcome::Handled));
    assert_eq!(cpu.regs.rip, MOV_RIP + 7, "the step still ends in the function");
    assert_eq!(posts.load(Ordering::Relaxed), 0);
}

#[test]
fn out_of_line_slots_are_reused_but_never_while_a_vcpu_steps_in_one() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    // 0x1000 bytes of area: 256 slots; 1000 register/unregister cycles.
    for _ in 0..1000 {
        let id = t.register(plain(at("func", 9), "stepped")).unwrap();
        t.unregister(id).unwrap();
    }
    let id = t.register(plain(at("func", 9), "stepped")).unwrap();
    let mut cpu = FakeVcpu::at(MOV_RIP);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(MOV_RIP)),
        BreakpointOutcome::Handled
    ));
    let busy = cpu.regs.rip;
    t.unregister(id).unwrap();
    t.register(plain(at("func", 9), "again")).unwrap();
    let mut other = FakeVcpu::at(MOV_RIP);
    assert!(matches!(
        t.on_breakpoint(1, &mut other, Gva(MOV_RIP)),
        BreakpointOutcome::Handled
    ));
    assert_ne!(other.regs.rip, busy, "vCPU 0 is still in its slot");
    assert_eq!(m.bytes(busy, 7)[..3], [0x48, 0x8b, 0x05], "vCPU 0's copy is intact");
}

// ---- Placement, listing, fetch-args, batches ----

#[test]
fn a_probe_is_not_moved_off_the_ftrace_nop_onto_a_branch_target() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let err = t.register(plain(at("looping", 0), "entry")).unwrap_err();
    assert!(matches!(err, ProbeError::MovedOntoBranchTarget { .. }), "{err}");
    assert!(err.to_string().contains("looping+0x9"), "{err}");
    assert_eq!(m.bytes(LOOPING, LOOPING_CODE.len()), LOOPING_CODE);
    // Elsewhere in it, and at func's entry (no jump to its +5), probes go in.
    t.register(plain(at("looping", 5), "loop")).unwrap();
    t.register(plain(at("func", 0), "entry")).unwrap();
}

#[test]
fn segment_fetch_args_read_the_vcpus_selectors() {
    let m = FakeMachine::with_code();
    let events = Arc::new(Events {
        capacity: 8,
        got: Mutex::new(Vec::new()),
    });
    let t = tracer_with(&m, PatchSites::default(), Some(events.clone()));
    let args = match crate::spec::parse_line("p:g/e func cs=%cs ss=%ss").unwrap().unwrap() {
        crate::spec::ProbeSpec::Kprobe { args, .. } => args,
        _ => unreachable!(),
    };
    t.register(KprobeRequest::event(at("func", 0), "g", "e", args)).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    t.on_breakpoint(0, &mut cpu, Gva(PUSH));
    let got = events.got.lock().unwrap();
    let shown: Vec<String> = got[0].record.args.iter().map(|(_, v)| v.to_string()).collect();
    assert_eq!(shown, ["0x10", "0x0"]);
}

#[test]
fn a_batch_is_armed_in_one_pause() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let before = m.pauses.load(Ordering::Relaxed);
    t.register_all(vec![
        plain(at("func", 0), "a"),
        plain(at("func", 9), "b"),
        plain(at("func", 0x10), "c"),
    ])
    .unwrap();
    assert_eq!(m.pauses.load(Ordering::Relaxed) - before, 1);
    assert_eq!(t.listing().len(), 3);
}

#[test]
fn a_batch_is_disabled_enabled_and_removed_in_one_pause_each_and_all_or_none() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let original = m.bytes(PUSH, 1)[0];
    let ids = t
        .register_all(vec![plain(at("func", 0), "a"), plain(at("func", 9), "b")])
        .unwrap();
    let before = m.pauses.load(Ordering::Relaxed);
    t.set_enabled_many(&ids, false).unwrap();
    assert_eq!(m.pauses.load(Ordering::Relaxed) - before, 1);
    assert!(t.listing().iter().all(|e| e.disabled));
    assert_ne!(m.bytes(PUSH, 1)[0], INT3, "a disabled probe's int3 is out of the text");
    // One unknown id: nothing changes.
    let unknown = ProbeId(9999);
    assert!(matches!(
        t.set_enabled_many(&[ids[0], unknown], true),
        Err(ProbeError::NoSuchProbe(id)) if id == unknown
    ));
    assert!(t.listing().iter().all(|e| e.disabled));
    t.set_enabled_many(&ids, true).unwrap();
    assert_eq!(m.bytes(PUSH, 1)[0], INT3);
    assert!(matches!(
        t.unregister_many(&[ids[1], unknown]),
        Err(ProbeError::NoSuchProbe(id)) if id == unknown
    ));
    assert_eq!(t.listing().len(), 2, "nothing removed when one id is unknown");
    let before = m.pauses.load(Ordering::Relaxed);
    t.unregister_many(&ids).unwrap();
    assert_eq!(m.pauses.load(Ordering::Relaxed) - before, 1);
    assert!(t.listing().is_empty());
    assert_eq!(m.bytes(PUSH, 1)[0], original);
}

#[test]
fn a_live_call_below_on_another_stack_in_the_same_region_is_kept() {
    // IRQ stacks are only page-aligned: one 16 KiB region can hold the top of one stack
    // and the bottom of another. A live call deeper in the region still has the trampoline
    // in its slot and must survive a call higher up.
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "r", 4, &log)).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let (low, high) = (STACK_TOP - 0x800, STACK_TOP - 0x100);
    call_func(&t, &m, &mut cpu, low, 0xffff_ffff_8100_1111, 1);
    call_func(&t, &m, &mut cpu, high, 0xffff_ffff_8100_2222, 2);
    assert_eq!(t.returns_in_flight(), 2);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, low, 0),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, 0xffff_ffff_8100_1111);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, high, 0),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, 0xffff_ffff_8100_2222);
}

#[test]
fn a_new_call_on_the_slot_of_a_call_that_never_returned_replaces_it() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let log = Returned::default();
    t.register(recording_return_probe("func", "r", 4, &log)).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = STACK_TOP - 0x100;
    // A call followed, then abandoned (no do_exit hook saw its task go) ...
    call_func(&t, &m, &mut cpu, slot, 0xffff_ffff_8100_1111, 1);
    // ... and a new task's call at the same depth: `call` wrote a real return address.
    call_func(&t, &m, &mut cpu, slot, 0xffff_ffff_8100_2222, 2);
    assert_eq!(t.returns_in_flight(), 1);
    assert!(matches!(
        return_from(&t, &m, &mut cpu, slot, 5),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, 0xffff_ffff_8100_2222);
    assert_eq!(
        *log.lock().unwrap(),
        [("r", 2, 5, 0xffff_ffff_8100_2222)],
        "no stale handler or data"
    );
}

#[test]
fn a_skip_that_leaves_rip_on_the_probe_stops_the_vm_instead_of_looping() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let mut req = plain(at("func", 5), "skip");
    req.pre = Some(Arc::new(|_: &mut HitContext| PreAction::Skip));
    t.register(req).unwrap();
    let mut cpu = FakeVcpu::at(PUSH);
    let outcome = t.on_breakpoint(0, &mut cpu, Gva(PUSH));
    assert!(
        matches!(outcome, BreakpointOutcome::Fatal(EngineFault::SkipWithoutRip { .. })),
        "{outcome:?}"
    );
}

#[test]
fn the_entry_call_into_an_ftrace_trampoline_without_a_symbol_is_an_ftrace_site() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.register(plain(at("traced", 0), "entry")).unwrap();
    assert_eq!(
        m.bytes(TRACED, 5),
        TRACED_CODE[..5],
        "the guest's ftrace call is untouched"
    );
    assert_eq!(m.bytes(TRACED + 5, 1), [INT3]);
}

#[test]
fn an_instruction_the_guest_rewrites_while_it_is_checked_is_refused() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    // The guest patches `mov 0x10(%rip),%rax` into a 7-byte NOP between our read and the
    // pause: the copy we would step is no longer the instruction.
    *m.before_pause.lock().unwrap() = Some(Box::new(|m: &FakeMachine| {
        m.write_virt(Gva(MOV_RIP), &[0x0f, 0x1f, 0x80, 0, 0, 0, 0]).unwrap();
    }));
    let err = t.register(plain(at("func", 9), "mid")).unwrap_err();
    assert!(err.to_string().contains("rewrote the instruction"), "{err}");
    assert_eq!(m.bytes(MOV_RIP, 1), [0x0f], "nothing written");
}

#[test]
fn an_int3_that_cannot_be_taken_out_keeps_running_the_original_instruction() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let id = t.register(plain(at("func", 5), "a")).unwrap();
    m.unmapped.lock().unwrap().push(FUNC & !0xfff);
    t.unregister(id).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3], "the write failed");
    let mut cpu = FakeVcpu::at(PUSH);
    let sp = cpu.regs.rsp;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(
        (cpu.regs.rip, cpu.regs.rsp),
        (PUSH + 1, sp - 8),
        "the push ran, nothing looped"
    );
}

#[test]
fn every_refusal_of_a_batch_is_reported_at_once_and_nothing_is_armed() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let requests = vec![
        plain(at("func", 5), "ok"),
        plain(at("nope", 0), "unknown"),
        plain(at("func", 7), "split"),
        // The name of a kprobe event, for a return probe: one event is of one kind.
        KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 4 },
            ..plain(at("func", 0), "ok")
        },
        KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 4 },
            ..plain(at("func", 9), "ret_mid")
        },
    ];
    let problems: Vec<(usize, String)> = t
        .check_all(&requests)
        .into_iter()
        .map(|(i, e)| (i, e.to_string()))
        .collect();
    let indices: Vec<usize> = problems.iter().map(|(i, _)| *i).collect();
    assert_eq!(indices, [1, 2, 3, 4], "{problems:?}");
    assert!(problems[0].1.contains("unknown symbol"));
    assert!(problems[1].1.contains("not an instruction boundary"));
    assert!(problems[2].1.contains("already exists"));
    assert!(problems[3].1.contains("function's entry"));
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE, "nothing written");
    assert!(t.listing().is_empty());
}

// ---- jump optimization -------------------------------------------------------------------

/// Where the first detour goes: the last block of the fake out-of-line area.
const DETOUR: u64 = OOL + 0x1000 - site_jump::DETOUR_BLOCK;

/// A tracer whose machine can search its (empty) kernel stacks, with optimization on.
fn optimizing(m: &Arc<FakeMachine>) -> Tracer {
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    let t = tracer(m);
    t.set_optimization(true).unwrap();
    t
}

/// A probe at `func+0` (on `push %rbp`, past the ftrace NOP) whose pre-handler records the
/// RIP it sees.
fn recording_probe(seen: &Arc<Mutex<Vec<u64>>>) -> KprobeRequest {
    let seen = seen.clone();
    KprobeRequest {
        pre: Some(Arc::new(move |ctx: &mut HitContext| {
            seen.lock().unwrap().push(ctx.regs.rip);
            PreAction::Continue
        })),
        ..plain(at("func", 0), "opt")
    }
}

#[test]
fn an_optimized_probe_jumps_to_a_sync_detour_and_a_hit_takes_one_exit() {
    let m = FakeMachine::with_code();
    let original = m.bytes(FUNC, 0x20);
    let t = optimizing(&m);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let id = t.register(recording_probe(&seen)).unwrap();
    // The jump replaces push/mov/mov(rip) (11 bytes; the first 5 are the jump).
    let jump = crate::detour::jump_bytes(Gva(PUSH), Gva(DETOUR)).unwrap();
    assert_eq!(m.bytes(PUSH, 5), jump);
    // The rest of the region: int3s, so that a decoder walking the function from its
    // start (the guest's own `can_probe` does) stays on instruction boundaries after it.
    assert_eq!(m.bytes(PUSH + 5, 6), [INT3; 6], "the rest of the region is padded");
    assert_eq!(
        m.bytes(POP, 5),
        original[16..21],
        "the text after the region is untouched"
    );
    let text = m.bytes(FUNC, FUNC_CODE.len());
    let boundaries: Vec<u64> = iced_x86::Decoder::with_ip(64, &text, FUNC, iced_x86::DecoderOptions::NONE)
        .into_iter()
        .map(|i| i.ip())
        .collect();
    assert!(boundaries.contains(&POP), "{boundaries:x?}");
    assert_eq!(m.bytes(DETOUR, 1), [INT3]);
    assert!(t.listing()[0].optimized);
    assert_eq!(t.why_not_optimized(id), None);
    // The detour: int3, push, mov, the mov with its displacement re-targeted, jmp back.
    let detour = m.bytes(DETOUR + 1, 1 + 3 + 7 + 5);
    assert_eq!(detour[..4], [0x55, 0x48, 0x89, 0xe5]);
    let new_disp = i32::from_le_bytes(detour[7..11].try_into().unwrap()) as i64;
    assert_eq!((DETOUR + 1 + 11) as i64 + new_disp, (MOV_RIP + 7 + 0x10) as i64);
    assert_eq!(detour[11], 0xe9);
    let back = i32::from_le_bytes(detour[12..16].try_into().unwrap()) as i64;
    assert_eq!((DETOUR + 1 + 16) as i64 + back, POP as i64, "back at the region's end");

    // A hit: the vCPU took the jump and trapped on the detour's int3.
    let mut cpu = FakeVcpu::at(DETOUR);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(DETOUR)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(
        *seen.lock().unwrap(),
        [FUNC],
        "the handler sees RIP at the probe address"
    );
    assert_eq!(cpu.regs.rip, DETOUR + 1, "then the displaced instructions run natively");
    assert!(!cpu.stepping, "no single-step: one exit");
    assert_eq!(t.stats.optimized.load(Ordering::Relaxed), 1);
    assert_eq!(t.listing()[0].hits, 1);

    t.unregister(id).unwrap();
    assert_eq!(m.bytes(FUNC, 0x20), original, "the text is as it was");
}

/// A vCPU stopped in the out-of-line area is in hvprobe's code: the engine names what is
/// there (the lane's SIGTERM test stopped a vCPU in an event detour, which the report of
/// where it stopped called "no kernel symbol").
#[test]
fn an_address_in_a_detour_is_named_with_its_site_and_probes() {
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let id = t.register(recording_probe(&seen)).unwrap();
    let place = t.out_of_line_place(Gva(DETOUR + 3)).expect("in the area");
    assert_eq!(
        place.to_string(),
        "hvprobe's sync detour for func+0x5/0x40 (test/opt)",
        "{place:?}"
    );
    assert_eq!(t.out_of_line_place(Gva(FUNC)), None, "the kernel's text is not ours");
    // The site's instruction copy, for the int3 the site takes while it is not optimized.
    assert_eq!(
        t.out_of_line_place(Gva(OOL + 2)),
        Some(OutOfLinePlace::Copy {
            site: "func+0x5/0x40".into(),
            events: vec!["test/opt".into()]
        })
    );
    assert_eq!(t.out_of_line_place(Gva(OOL + 0x800)), Some(OutOfLinePlace::Unused));
    t.unregister(id).unwrap();
    // No vCPU was in it (none parked there, none on a stack): given back.
    assert_eq!(t.out_of_line_place(Gva(DETOUR)), Some(OutOfLinePlace::Unused));
}

#[test]
fn the_switch_off_puts_the_int3_back_and_on_puts_the_jump_back() {
    let m = FakeMachine::with_code();
    let original = m.bytes(PUSH, 5);
    let t = optimizing(&m);
    let id = t.register(plain(at("func", 0), "opt")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
    t.set_optimization(false).unwrap();
    let mut armed = original.clone();
    armed[0] = INT3;
    assert_eq!(m.bytes(PUSH, 5), armed, "the int3 and the original bytes");
    assert_eq!(t.why_not_optimized(id), Some(WhyNotOptimized::Off));
    assert!(!t.listing()[0].optimized);
    t.set_optimization(true).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
    // Disabled: no jump, no int3; enabled again: the jump.
    t.set_enabled(id, false).unwrap();
    assert_eq!(m.bytes(PUSH, 5), original);
    assert!(matches!(
        t.why_not_optimized(id),
        Some(WhyNotOptimized::Region(r)) if *r == crate::detour::NotOptimizable::Disabled
    ));
    t.set_enabled(id, true).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9], "{:?}", t.why_not_optimized(id));
    t.set_armed(false).unwrap();
    assert_eq!(m.bytes(PUSH, 5), original, "the global switch takes the jump out too");
    t.set_armed(true).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
}

#[test]
fn a_probe_with_a_post_handler_or_stacks_that_cannot_be_read_stays_on_its_int3() {
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    t.set_optimization(true).unwrap();
    let id = t.register(plain(at("func", 0), "opt")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    assert!(matches!(
        t.why_not_optimized(id),
        Some(WhyNotOptimized::StacksUnreadable(_))
    ));
    t.unregister(id).unwrap();
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    let with_post = KprobeRequest {
        post: Some(Arc::new(|_: &mut HitContext| {})),
        ..plain(at("func", 0), "post")
    };
    let id = t.register(with_post).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    assert!(matches!(
        t.why_not_optimized(id),
        Some(WhyNotOptimized::Region(r)) if *r == crate::detour::NotOptimizable::HasPostHandler
    ));
    assert!(
        listing_line(&t.listing()[0]).contains("(not optimized: the probe has a post-handler"),
        "{}",
        listing_line(&t.listing()[0])
    );
}

#[test]
fn a_task_or_vcpu_inside_the_region_delays_the_jump_until_it_has_left() {
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    // A task preempted after `push %rbp` has that address saved on its stack.
    *m.stack_words.lock().unwrap() = Some(vec![PUSH + 1]);
    let id = t.register(plain(at("func", 0), "opt")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    assert_eq!(
        t.why_not_optimized(id),
        Some(WhyNotOptimized::TaskInside { saved: Gva(PUSH + 1) })
    );
    // The task went on; a vCPU is now stopped inside the region.
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    *m.parked.lock().unwrap() = vec![(0, MOV_RIP)];
    t.check_gone();
    t.set_armed(true).unwrap();
    assert_eq!(
        t.why_not_optimized(id),
        Some(WhyNotOptimized::VcpuInside {
            cpu: 0,
            rip: Gva(MOV_RIP)
        })
    );
    // Named by its own index when a vCPU before it is the caller's (not parked).
    *m.parked.lock().unwrap() = vec![(1, MOV_RIP), (2, PUSH)];
    t.set_armed(true).unwrap();
    assert_eq!(
        t.why_not_optimized(id),
        Some(WhyNotOptimized::VcpuInside {
            cpu: 1,
            rip: Gva(MOV_RIP)
        })
    );
    // At the probe address itself it would take the jump: fine.
    *m.parked.lock().unwrap() = vec![(0, PUSH)];
    t.set_armed(true).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
    assert_eq!(t.why_not_optimized(id), None);
}

#[test]
fn a_retired_detour_is_reused_only_when_no_vcpu_or_stack_is_in_it_and_still_works_meanwhile() {
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let id = t.register(recording_probe(&seen)).unwrap();
    // A vCPU took the jump and stopped on the detour's int3; then the probe is disabled.
    *m.parked.lock().unwrap() = vec![(0, DETOUR)];
    t.set_optimization(false).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    // It goes on: the site's handler runs, and so do the displaced instructions.
    let mut cpu = FakeVcpu::at(DETOUR);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(DETOUR)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, DETOUR + 1);
    assert_eq!(seen.lock().unwrap().len(), 1);
    // Interrupted in the copy: its stack holds an address there. The block is not reused.
    *m.parked.lock().unwrap() = Vec::new();
    *m.stack_words.lock().unwrap() = Some(vec![DETOUR + 4]);
    t.set_optimization(true).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
    let second = DETOUR - site_jump::DETOUR_BLOCK;
    assert_eq!(
        m.bytes(PUSH, 5),
        crate::detour::jump_bytes(Gva(PUSH), Gva(second)).unwrap(),
        "a new block while the old one may still be returned into"
    );
    assert_eq!(m.bytes(DETOUR, 1), [INT3], "the retired detour is intact");
    // Once nothing is in it, it is reused.
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    t.set_optimization(false).unwrap();
    t.set_optimization(true).unwrap();
    t.unregister(id).unwrap();
    let id = t.register(plain(at("func", 0), "again")).unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(id));
    let target = |bytes: Vec<u8>| PUSH as i64 + 5 + i32::from_le_bytes(bytes[1..5].try_into().unwrap()) as i64;
    assert!(
        [DETOUR as i64, second as i64].contains(&target(m.bytes(PUSH, 5))),
        "a freed block is reused"
    );
}

#[test]
fn a_jump_the_guest_rewrote_makes_the_probe_gone_and_is_never_written_back() {
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    let id = t.register(plain(at("func", 0), "opt")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
    let guest = [0x0f, 0x0b, 0x90, 0x90, 0x90];
    m.write_virt(Gva(PUSH), &guest).unwrap();
    let entry = &t.listing()[0];
    assert!(entry.gone && !entry.optimized, "{entry:?}");
    t.unregister(id).unwrap();
    assert_eq!(m.bytes(PUSH, 5), guest, "the guest's bytes stay");
}

/// The guest's own kprobe on the address of our jump copies the jump (a relative `jmp` it
/// emulates from its own int3) and writes its int3 over the first byte. From then on it can
/// jump into our detour at any time, for as long as its probe lives, and put the jump back
/// when it goes: the detour is kept, intact and working, and its blocks are never reused.
#[test]
fn a_detour_the_guest_may_have_copied_is_kept_for_good() {
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    let id = t.register(plain(at("func", 0), "opt")).unwrap();
    let jump = m.bytes(PUSH, 5);
    assert_eq!(jump[0], 0xe9);
    let detour = m.bytes(DETOUR, site_jump::DETOUR_BLOCK as usize);
    m.write_virt(Gva(PUSH), &[INT3]).unwrap();
    t.check_gone();
    assert!(t.listing()[0].gone);
    // Nothing is in the detour (no vCPU, no stack): pauses, removal, new probes.
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    t.set_optimization(false).unwrap();
    t.set_optimization(true).unwrap();
    t.unregister(id).unwrap();
    // (`other` given `func`'s code, for a second optimizable function.)
    m.write_virt(Gva(OTHER), FUNC_CODE).unwrap();
    let other = t.register(plain(at("other", 0), "other")).unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(other));
    assert_ne!(
        m.bytes(OTHER + 5, 5),
        crate::detour::jump_bytes(Gva(OTHER + 5), Gva(DETOUR)).unwrap(),
        "the kept detour's block is not reused"
    );
    assert_eq!(m.bytes(DETOUR, detour.len()), detour, "the kept detour is intact");
    assert_eq!(m.bytes(PUSH, 1), [INT3], "the guest's byte stays");
    // The guest's copy of the jump still lands there, and goes on in the relocated region.
    let mut cpu = FakeVcpu::at(DETOUR);
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(DETOUR)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, DETOUR + 1);
}

#[test]
fn a_second_probe_inside_the_region_unoptimizes_it() {
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    let first = t.register(plain(at("func", 0), "first")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [0xe9]);
    // `mov %rsp,%rbp` at func+6 is inside the region push..pop.
    let inside = t.register(plain(at("func", 6), "inside")).unwrap();
    assert_eq!(m.bytes(PUSH, 1), [INT3]);
    // The inner one has a region of its own (mov, mov), clear of the first probe.
    assert_eq!(m.bytes(PUSH + 1, 1), [0xe9]);
    assert_eq!(t.why_not_optimized(inside), None);
    assert!(matches!(
        t.why_not_optimized(first),
        Some(WhyNotOptimized::Region(r)) if matches!(*r, crate::detour::NotOptimizable::ProbeInsideRegion { .. })
    ));
}

// ---- event detours -------------------------------------------------------------------------

const RINGS_GPA: u64 = 0x10_0000;
const BIG_OOL: u64 = 0x10000;

/// A fake machine with guest-physical memory behind a 64 KiB out-of-line area, and a tracer
/// with event rings set up there, sending events to the returned sink.
fn event_tracer() -> (Arc<FakeMachine>, Tracer, Arc<Events>) {
    let mut machine = FakeMachine {
        rings: Some(crate::detour::ring::HostRingMemory::new(Gpa(RINGS_GPA), BIG_OOL)),
        ..FakeMachine::default()
    };
    *machine.stack_words.get_mut().unwrap() = Some(Vec::new());
    let m = Arc::new(machine);
    let code = FakeMachine::with_code();
    for (at, bytes) in code.pages.lock().unwrap().iter() {
        m.write_virt(Gva(*at), bytes).unwrap();
    }
    m.write_virt(Gva(OOL), &vec![0u8; BIG_OOL as usize]).unwrap();
    let events = Arc::new(Events {
        capacity: 100,
        got: Mutex::new(Vec::new()),
    });
    let view = KernelView {
        symbols: Arc::new(symbols()),
        blacklist: KprobeBlacklist::default(),
        ex_table: ExceptionTable::default(),
        patch_sites: PatchSites::default(),
    };
    // Half for code, half for the rings.
    let ool = OutOfLineArea {
        start: Gva(OOL),
        size: BIG_OOL / 2,
        rings: Gva(OOL + BIG_OOL / 2),
        rings_size: BIG_OOL / 2,
    };
    let sink: Arc<dyn EventSink> = events.clone();
    let t = Tracer::new(m.clone(), view, Some(ool), Some(sink));
    let facts = crate::detour::event::GuestKernelFacts {
        cpu_number: 0x1_0000,
        current_task: Some(0x1_0008),
        comm_offset: None,
        pid_offset: None,
        copy_from_kernel_nofault: None,
        strncpy_from_kernel_nofault: None,
        copy_from_user_nofault: None,
        strncpy_from_user_nofault: None,
        thread_size: crate::detour::event::DEFAULT_THREAD_SIZE,
        rethooks: None,
    };
    t.enable_event_detours(1, facts, &|gva: Gva| Gpa(RINGS_GPA + (gva.0 - OOL)))
        .unwrap();
    (m, t, events)
}

/// An event probe at `func`, its detour's entry, and where its full-ring path has counted a
/// miss in the ring and not yet in the probe's entry (read from the detour's own code: the
/// ring's counter, then the locked increment of the probe's entry). The ring is full and
/// the guest has counted one miss in it only.
fn event_probe_stopped_mid_miss(m: &FakeMachine, t: &Tracer) -> (u64, u64) {
    t.set_optimization(true).unwrap();
    let id = t
        .register(KprobeRequest::event(at("func", 0), "g", "ev", Vec::new()))
        .unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(id));
    let code = jump_target(m, PUSH);
    let bytes = m.bytes(code, 4096);
    let insns: Vec<iced_x86::Instruction> =
        iced_x86::Decoder::with_ip(64, &bytes, code, iced_x86::DecoderOptions::NONE)
            .into_iter()
            .take_while(|i| !i.is_invalid())
            .collect();
    let ring_count = insns
        .iter()
        .position(|i| {
            i.mnemonic() == iced_x86::Mnemonic::Inc
                && i.memory_base() == iced_x86::Register::RBX
                && i.memory_displacement64() == crate::detour::ring::MISSED_FULL
        })
        .expect("the full-ring path counts in its ring");
    let probe_count = &insns[ring_count + 1];
    assert!(
        probe_count.mnemonic() == iced_x86::Mnemonic::Inc && probe_count.has_lock_prefix(),
        "{probe_count}"
    );
    let rings = *t.event_rings().unwrap();
    let mem = m.rings.as_ref().unwrap();
    let mut record = vec![0u8; 24];
    record[0..4].copy_from_slice(&id.0.to_le_bytes());
    for _ in 0..rings.geometry().capacity() {
        assert!(mem.guest_record(&rings, 0, miss_slot(t, PUSH), &record).unwrap());
    }
    let counter = Gpa(rings.gpa().0 + rings.geometry().ring_offset(0) + crate::detour::ring::MISSED_FULL);
    crate::detour::ring::RingMemory::store_u64_release(mem, counter, 1).unwrap();
    (code, probe_count.ip())
}

/// The probe's `nmissed` and the rings' missed total.
fn miss_counts(t: &Tracer) -> (u64, u64) {
    (t.listing()[0].nmissed, t.stats.ring_missed.load(Ordering::Relaxed))
}

/// A missed hit is counted twice in the guest: in its ring's counter, then in its probe's
/// miss-table entry. A vCPU the VM stopped for good between the two never makes the
/// second, so the host counts it in the probe's `nmissed` (once) from where the vCPU
/// stopped; a vCPU merely paused there makes it itself when it runs on.
#[test]
fn a_vcpu_stopped_between_the_two_counts_of_a_miss_has_it_counted_in_its_probes_nmissed() {
    let (m, t, _events) = event_tracer();
    let (code, between) = event_probe_stopped_mid_miss(&m, &t);
    // Paused there (a live pause; the pause's parked RIPs are not where a vCPU stopped):
    // nothing is counted for it.
    *m.parked.lock().unwrap() = vec![(0, between)];
    t.set_optimization(true).unwrap();
    assert_eq!(miss_counts(&t), (0, 1));
    // Stopped for good there (and another vCPU at the detour's entry, which has counted
    // nothing): the host counts it, once.
    *m.stopped.lock().unwrap() = vec![(0, between), (1, code)];
    t.drain_events();
    t.drain_events();
    assert_eq!(miss_counts(&t), (1, 1), "the probe's misses and the rings' agree");
}

/// A stop that lands while a pause is held (here one that retires the detour) leaves a
/// vCPU the pause's parked RIPs do not show: the detour it stopped in is not reclaimed
/// (its miss-table entry would go with it), and its cut-short miss is counted.
#[test]
fn a_detour_a_vcpu_stopped_in_is_kept_and_its_cut_short_miss_counted() {
    let (m, t, _events) = event_tracer();
    // The guest's stacks can be read and hold nothing of the detour: a retired detour
    // no vCPU is in is reclaimed in the pause that retires it.
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    let (code, between) = event_probe_stopped_mid_miss(&m, &t);
    *m.before_pause.lock().unwrap() = Some(Box::new(move |m: &FakeMachine| {
        *m.stopped.lock().unwrap() = vec![(0, between)];
    }));
    t.set_optimization(false).unwrap();
    assert!(!t.listing()[0].optimized);
    assert!(
        t.read_registry().detour_codes.contains_key(&Gva(code)),
        "the detour a vCPU stopped in is kept"
    );
    assert_eq!(miss_counts(&t), (1, 1));
}

#[test]
fn an_event_probe_gets_an_event_detour_and_its_ring_records_become_its_hits() {
    let (m, t, events) = event_tracer();
    t.set_optimization(true).unwrap();
    let id = t
        .register(KprobeRequest::event(at("func", 0), "g", "ev", Vec::new()))
        .unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(id));
    assert_ne!(
        m.bytes(jump_target(&m, PUSH), 1),
        [INT3],
        "an event detour does not trap"
    );

    // The guest's detour wrote two records, and one for a probe that never existed.
    let rings = *t.event_rings().unwrap();
    let mem = m.rings.as_ref().unwrap();
    let record = |probe: u32, tsc: u64| {
        let mut r = vec![0u8; 24];
        r[0..4].copy_from_slice(&probe.to_le_bytes());
        r[8..16].copy_from_slice(&tsc.to_le_bytes());
        r
    };
    for (probe, tsc) in [(id.0, 10), (id.0, 20), (9999, 30)] {
        assert!(mem.guest_record(&rings, 0, 0, &record(probe, tsc)).unwrap());
    }
    assert_eq!(t.drain_events(), 2);
    let got = events.got.lock().unwrap().clone();
    assert_eq!(got.len(), 2);
    assert!(got
        .iter()
        .all(|e| e.probe == id && e.record.event == "ev" && e.record.cpu == 0));
    assert_eq!(t.listing()[0].hits, 2);
    assert_eq!(t.stats.optimized_events.load(Ordering::Relaxed), 2);
    assert_eq!(
        t.stats.stale.load(Ordering::Relaxed),
        1,
        "the unknown probe's record is counted"
    );
    // A full ring: the guest counts what it could not write, the host reports it.
    let capacity = rings.geometry().capacity();
    let written = (0..capacity + 3)
        .filter(|i| mem.guest_record(&rings, 0, 0, &record(id.0, u64::from(*i))).unwrap())
        .count() as u32;
    assert_eq!(written, capacity);
    assert_eq!(t.drain_events(), capacity as usize);
    assert_eq!(t.stats.ring_missed.load(Ordering::Relaxed), 3);
    t.unregister(id).unwrap();
}

/// Where slot `n` of the calls-in-flight table's field `field` is, in the fake's rings
/// memory (the table comes first in the writable half).
fn return_slot_gpa(n: u32, field: i32) -> Gpa {
    Gpa(RINGS_GPA + BIG_OOL / 2 + u64::from(n) * u64::from(crate::detour::event::RETURN_SLOT_SIZE) + field as u64)
}

/// Plays an exit-free return probe's entry on the fake: the call whose return address was
/// at the stack slot `frame` (and was `ret`) is kept in slot `n` of the table by `owner`,
/// and the stack slot gets slot `n`'s stub, written at `stub`. The entry's caller is `ret`
/// (what it keeps when `ret` is our trampoline, which it cannot see through). Returns the stub.
fn play_exit_free_entry(m: &FakeMachine, n: u32, owner: u64, frame: u64, ret: u64, stub: u64) -> u64 {
    use crate::detour::event::returns::{SLOT_CALLER, SLOT_FRAME, SLOT_OWNER, SLOT_RET, STUB_OPCODE};
    use crate::detour::ring::RingMemory;
    let mut bytes = vec![STUB_OPCODE];
    bytes.extend_from_slice(&n.to_le_bytes());
    m.write_virt(Gva(stub), &bytes).unwrap();
    let mem = m.rings.as_ref().unwrap();
    for (field, value) in [
        (SLOT_OWNER, owner),
        (SLOT_FRAME, frame),
        (SLOT_RET, ret),
        (SLOT_CALLER, ret),
    ] {
        mem.store_u64_release(return_slot_gpa(n, field), value).unwrap();
    }
    m.write_virt(Gva(frame), &stub.to_le_bytes()).unwrap();
    stub
}

/// An exit-free return probe's code and slots stay while a call of it is in flight (it
/// returns through its stub), however the probe goes; they are reused once every slot is
/// free. A task's calls go at its `do_exit`.
#[test]
fn an_exit_free_return_probes_code_and_slots_outlive_its_calls_in_flight() {
    use crate::detour::event::returns::{SLOT_FRAME, SLOT_OWNER};
    use crate::detour::ring::RingMemory;
    let (m, t, _events) = event_tracer();
    t.set_optimization(true).unwrap();
    let recording = |event: &str| KprobeRequest {
        kind: ProbeKind::Kretprobe { maxactive: 4 },
        ..KprobeRequest::event(at("func", 0), "g", event, Vec::new())
    };
    let id = t.register(recording("ret")).unwrap();
    assert_eq!(t.why_not_optimized(id), None);
    let (code, slots) = {
        let reg = t.read_registry();
        let (at, d) = reg
            .detour_codes
            .iter()
            .find(|(_, d)| !d.returns.is_empty())
            .expect("an exit-free return probe's detour");
        (*at, d.returns[0])
    };
    assert_eq!(slots.count, 4);
    // Its stubs are in its code: `push <slot>`.
    let stub = m.bytes(slots.stubs.0, 5);
    assert_eq!(stub[0], crate::detour::event::returns::STUB_OPCODE);
    assert_eq!(u32::from_le_bytes(stub[1..5].try_into().unwrap()), slots.first);

    // A call in flight in its second slot, on a task stack.
    let mem = m.rings.as_ref().unwrap();
    let frame = 0xffff_c900_0001_3f00u64;
    mem.store_u64_release(return_slot_gpa(slots.first + 1, SLOT_OWNER), 0xffff_8880_0000_1000)
        .unwrap();
    mem.store_u64_release(return_slot_gpa(slots.first + 1, SLOT_FRAME), frame)
        .unwrap();
    use super::registry::Role;
    let hooks = |t: &Tracer| -> Vec<Role> {
        let reg = t.read_registry();
        let mut roles: Vec<Role> = reg
            .probes
            .values()
            .map(|p| p.role)
            .filter(|r| *r != Role::User)
            .collect();
        roles.sort_by_key(|r| format!("{r:?}"));
        roles
    };
    assert_eq!(hooks(&t), [Role::TaskExit, Role::TaskFree]);
    t.unregister(id).unwrap();
    t.set_optimization(true).unwrap();
    {
        let reg = t.read_registry();
        assert!(
            reg.detour_codes.contains_key(&code),
            "the code stays while its call is in flight"
        );
    }
    assert_eq!(
        hooks(&t),
        [Role::TaskExit, Role::TaskFree],
        "the task hooks stay while a call is in flight: free_task frees it"
    );
    // A new probe does not get those slots.
    let other = t.register(recording("other")).unwrap();
    let other_slots = t
        .read_registry()
        .detour_codes
        .values()
        .find_map(|d| d.returns.iter().copied().find(|r| *r != slots));
    let other_slots = other_slots.expect("the new probe's slots");
    assert!(other_slots.first >= slots.first + slots.count || other_slots.first + 4 <= slots.first);
    t.unregister(other).unwrap();

    // The task is freed: its calls are freed, and then the code and the slots go.
    t.exit_free_calls_end(Gva(0xffff_8880_0000_2000));
    assert_ne!(
        mem.load_u64_acquire(return_slot_gpa(slots.first + 1, SLOT_OWNER))
            .unwrap(),
        0,
        "another task's call stays"
    );
    t.exit_free_calls_end(Gva(0xffff_8880_0000_1000));
    assert_eq!(
        mem.load_u64_acquire(return_slot_gpa(slots.first + 1, SLOT_OWNER))
            .unwrap(),
        0
    );
    t.set_optimization(true).unwrap();
    let reg = t.read_registry();
    assert!(
        !reg.detour_codes.contains_key(&code),
        "reclaimed once no call is in flight"
    );
    drop(reg);
    assert!(hooks(&t).is_empty(), "and the hooks go with it");
    let table = t.events.get().unwrap().returns.as_ref().unwrap();
    assert_eq!(table.take(table.slots), Some(0), "every slot was given back");
}

/// A task's exit-free calls in flight are freed when it enters `do_exit` (they are its
/// callers: none returns), not only when RCU frees the task: processes that exit faster
/// than that (the lane's kvm_amd guest: seven `/bin/true` through `do_group_exit`) never
/// use up `maxactive`. Another task's call stays.
#[test]
fn an_exiting_tasks_exit_free_calls_are_freed_at_its_do_exit() {
    use crate::detour::event::returns::SLOT_OWNER;
    use crate::detour::ring::RingMemory;
    use hvprobe_introspection::task::TaskInfo;
    let (m, t, _events) = event_tracer();
    t.set_optimization(true).unwrap();
    let id = t
        .register(KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 2 },
            ..KprobeRequest::event(at("func", 0), "g", "ret", Vec::new())
        })
        .unwrap();
    assert_eq!(t.why_not_optimized(id), None);
    let slots = t
        .read_registry()
        .detour_codes
        .values()
        .find_map(|d| d.returns.first().copied())
        .expect("an exit-free return probe's slots");
    let (exiting, other) = (0xffff_8880_0000_1000u64, 0xffff_8880_0000_2000u64);
    let stack = STACK_TOP + 0x4000;
    m.write_virt(Gva(stack - 0x1000), &[0u8; 0x1000]).unwrap();
    play_exit_free_entry(
        &m,
        slots.first,
        exiting,
        stack - 0x100,
        0xffff_ffff_8100_0abc,
        slots.stubs.0,
    );
    play_exit_free_entry(
        &m,
        slots.first + 1,
        other,
        STACK_TOP - 0x100,
        0xffff_ffff_8100_0abc,
        slots.stubs.0 + crate::detour::event::returns::RETURN_STUB_SIZE,
    );

    let mut cpu = FakeVcpu::at(DO_EXIT + 5);
    cpu.regs.rsp = stack - 0x400;
    cpu.task = Some(TaskInfo {
        address: Gva(exiting),
        comm: "true".into(),
        pid: 42,
        tgid: 42,
    });
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(DO_EXIT + 5)),
        BreakpointOutcome::Handled
    ));
    let mem = m.rings.as_ref().unwrap();
    let owner = |n: u32| mem.load_u64_acquire(return_slot_gpa(n, SLOT_OWNER)).unwrap();
    assert_eq!(owner(slots.first), 0, "the exiting task's call is freed at do_exit");
    assert_eq!(owner(slots.first + 1), other, "another task's call stays");
    assert_eq!(t.stats.returns_abandoned.load(Ordering::Relaxed), 1);
    t.unregister(id).unwrap();
}

/// A kprobe and a return probe on one function entry (bpftrace's `kprobe`/`kretprobe`
/// pair, `funclatency`) share one jump: its code is their two event detours one after the
/// other, the kprobe's first (the site's order), each with its own miss-table entry; a
/// third probe there with a handler makes the site a sync detour again.
#[test]
fn a_kprobe_and_a_return_probe_on_one_entry_share_one_jump_to_two_event_detours() {
    let (m, t, _events) = event_tracer();
    t.set_optimization(true).unwrap();
    let k = t
        .register(KprobeRequest::event(at("func", 0), "g", "entry", Vec::new()))
        .unwrap();
    let r = t
        .register(KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 4 },
            ..KprobeRequest::event(at("func", 0), "g", "ret", Vec::new())
        })
        .unwrap();
    assert_eq!((t.why_not_optimized(k), t.why_not_optimized(r)), (None, None));
    let (code, blocks) = {
        let reg = t.read_registry();
        let (at, d) = reg
            .detour_codes
            .iter()
            .find(|(_, d)| d.live && !d.returns.is_empty())
            .expect("the function's live detour");
        assert_eq!(d.kind, super::site_jump::DetourKind::Event);
        assert_eq!(d.miss_slots.len(), 2);
        assert_eq!(d.returns.len(), 1);
        (*at, d.blocks)
    };
    let layouts = t.events.get().unwrap().layouts.read().unwrap().clone();
    assert!(layouts[&k.0].ret.is_none() && layouts[&r.0].ret.is_some());
    // The kprobe's detour ends with a jump to the return probe's, 16-byte aligned after it.
    let bytes = m.bytes(code.0, (blocks * super::site_jump::DETOUR_BLOCK) as usize);
    let jumps_on: Vec<u64> = iced_x86::Decoder::with_ip(64, &bytes, code.0, iced_x86::DecoderOptions::NONE)
        .into_iter()
        .filter(|i| i.mnemonic() == iced_x86::Mnemonic::Jmp && i.near_branch_target() > code.0)
        .map(|i| i.near_branch_target())
        .filter(|t| *t < code.0 + bytes.len() as u64 && t % 16 == 0)
        .collect();
    assert!(!jumps_on.is_empty(), "no jump from the first detour to the second");

    // A probe with a handler on the same entry: one sync detour for the three.
    let h = t
        .register(KprobeRequest {
            pre: Some(Arc::new(|_: &mut HitContext| PreAction::Continue)),
            ..plain(at("func", 0), "handled")
        })
        .unwrap();
    assert_eq!(t.why_not_optimized(h), None);
    let listed: Vec<_> = t.listing().into_iter().filter(|e| e.event == "g/ret").collect();
    assert_eq!(
        listed[0].return_trapped.as_deref(),
        Some("another probe at its address has handlers or records stacks")
    );
    let reg = t.read_registry();
    let site = reg.sites.get(&Gva(PUSH)).expect("the function's site");
    let detour = site.detour.as_ref().expect("still optimized");
    assert_eq!(detour.kind, super::site_jump::DetourKind::Sync);
    assert!(detour.miss_slots.is_empty() && detour.returns.is_empty());
}

/// A trapped return probe's call whose return address an exit-free return probe's entry
/// then swapped for its stub (the function it tail-called) is still in flight: the stub
/// returns to the trampoline. A reclaim at `maxactive` must not free it (it did: its slot
/// held the stub, not the trampoline, so the call looked abandoned and its return found
/// nothing on record).
#[test]
fn a_trapped_call_behind_an_exit_free_stub_is_not_reclaimed() {
    let (m, t, _events) = event_tracer();
    let mut req = return_probe("trapped", 1);
    req.post = Some(Arc::new(|_: &mut HitContext| {}));
    t.register(req).unwrap();
    let trampoline = *t.trampoline.get().unwrap();
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = cpu.regs.rsp;
    m.write_virt(Gva(slot), &caller.to_le_bytes()).unwrap();
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(PUSH)),
        BreakpointOutcome::Handled
    ));
    assert_eq!(m.read_u64(Gva(slot)).unwrap(), trampoline.0);

    // An exit-free probe's entry follows the same call in slot 5 of the table (its code
    // was given slots 0..8): it keeps the trampoline as the return address and puts slot
    // 5's stub in the stack slot.
    let table = t.events.get().unwrap().returns.as_ref().unwrap();
    assert_eq!(table.take(8), Some(0));
    play_exit_free_entry(&m, 5, 0xffff_8880_0000_1000, slot, trampoline.0, OOL + 0x4000);

    // Another call of the trapped probe, on another stack, at its maxactive (1).
    let mut other = FakeVcpu::at(PUSH);
    other.regs.rsp = slot + 0x10_0000;
    m.write_virt(Gva(other.regs.rsp), &caller.to_le_bytes()).unwrap();
    t.on_breakpoint(1, &mut other, Gva(PUSH));
    assert_eq!(
        t.stats.returns_abandoned.load(Ordering::Relaxed),
        0,
        "the call behind the stub was freed"
    );
    assert_eq!(t.listing()[0].nmissed, 1, "the new call is missed instead");
    // The exit-free function returned: its stub pushed its slot number where the return
    // address was, and its code has not yet put the trampoline back. Still in flight.
    m.write_virt(Gva(slot), &5u64.to_le_bytes()).unwrap();
    let mut third = FakeVcpu::at(PUSH);
    third.regs.rsp = slot + 0x20_0000;
    m.write_virt(Gva(third.regs.rsp), &caller.to_le_bytes()).unwrap();
    t.on_breakpoint(1, &mut third, Gva(PUSH));
    assert_eq!(
        t.stats.returns_abandoned.load(Ordering::Relaxed),
        0,
        "the call was freed while the stub's code returned"
    );

    // The stub's return code returns to the trampoline: the call returns to its caller.
    cpu.regs = Regs {
        rip: trampoline.0,
        rsp: slot + 8,
        ..cpu.regs
    };
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, trampoline),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
}

/// A trapped return probe's call on a stack slot where an exit-free probe's stub stands
/// (trapped `f` tail-calls exit-free `g`, which tail-calls trapped `h`): `h`'s call returns
/// first, to the stub, and `f`'s when the stub's code returns to the trampoline again. It
/// took `h`'s entry for a new call and dropped `f`'s, or returned both at once.
#[test]
fn a_trapped_call_entered_over_an_exit_free_stub_returns_to_the_stub_first() {
    use crate::detour::event::returns::SLOT_OWNER;
    use crate::detour::ring::RingMemory;
    let (m, t, events) = event_tracer();
    let returned = Arc::new(Mutex::new(Vec::new()));
    let r = returned.clone();
    let mut req = return_probe("trapped", 4);
    req.emit_events = true;
    req.post = Some(Arc::new(move |ctx: &mut HitContext| {
        r.lock().unwrap().push(ctx.regs.rip);
    }));
    t.register(req).unwrap();
    let trampoline = *t.trampoline.get().unwrap();
    let caller = 0xffff_ffff_8100_0abc_u64;
    let mut cpu = FakeVcpu::at(PUSH);
    let slot = cpu.regs.rsp;
    m.write_virt(Gva(slot), &caller.to_le_bytes()).unwrap();
    t.on_breakpoint(0, &mut cpu, Gva(PUSH));
    // g's entry: slot 5, returning to the trampoline, its stub in the stack slot.
    let stub = play_exit_free_entry(&m, 5, 0xffff_8880_0000_1000, slot, trampoline.0, OOL + 0x4000);
    let mem = m.rings.as_ref().unwrap();
    // h's entry (the same probe stands in for it) on the same stack slot.
    let mut h = FakeVcpu::at(PUSH);
    h.regs.rsp = slot;
    t.on_breakpoint(0, &mut h, Gva(PUSH));
    assert_eq!(t.returns_in_flight(), 2, "f's call is still followed");
    assert_eq!(m.read_u64(Gva(slot)).unwrap(), trampoline.0);

    // h returns: to the stub, alone.
    cpu.regs = Regs {
        rip: trampoline.0,
        rsp: slot + 8,
        ..cpu.regs
    };
    t.on_breakpoint(0, &mut cpu, trampoline);
    assert_eq!(cpu.regs.rip, stub);
    assert_eq!(t.returns_in_flight(), 1);
    // The stub's code records g's return and returns to the trampoline: f returns.
    mem.store_u64_release(return_slot_gpa(5, SLOT_OWNER), 0).unwrap();
    cpu.regs.rip = trampoline.0;
    t.on_breakpoint(0, &mut cpu, trampoline);
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(t.returns_in_flight(), 0);
    assert_eq!(returned.lock().unwrap().len(), 2);
    // Both name the real caller: h's through the stub (whose entry found our trampoline)
    // and the call f's entry followed, never the trampoline.
    let named: Vec<Option<String>> = events
        .got
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.record.retprobe_caller.clone())
        .collect();
    assert_eq!(named, vec![Some(format!("{caller:#x}")); 2], "{named:?}");
}

/// A record an exit-free return probe's code wrote is a return: its caller, its entry's
/// time and its `$duration`.
#[test]
fn an_exit_free_returns_record_carries_its_caller_and_entry() {
    let (m, t, events) = event_tracer();
    t.set_optimization(true).unwrap();
    let args = vec![crate::spec::FetchArg {
        name: "ret".into(),
        expr: crate::spec::FetchExpr::Retval,
        ty: crate::spec::ArgType::U64,
        array_len: None,
        typed: true,
    }];
    let id = t
        .register(KprobeRequest {
            kind: ProbeKind::Kretprobe { maxactive: 4 },
            ..KprobeRequest::event(at("func", 0), "g", "ret", args)
        })
        .unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(id));
    let layout = t.events.get().unwrap().layouts.read().unwrap()[&id.0].clone();
    let fields = layout.ret.expect("a return's layout");
    let mut r = vec![0u8; layout.size as usize];
    r[0..4].copy_from_slice(&id.0.to_le_bytes());
    r[8..16].copy_from_slice(&500u64.to_le_bytes());
    let caller = FUNC + 0x10;
    r[fields.caller as usize..][..8].copy_from_slice(&caller.to_le_bytes());
    r[fields.entry_tsc as usize..][..8].copy_from_slice(&400u64.to_le_bytes());
    let slot = layout.args[0].slot as usize;
    r[slot..slot + 8].copy_from_slice(&7u64.to_le_bytes());
    let rings = *t.event_rings().unwrap();
    assert!(m.rings.as_ref().unwrap().guest_record(&rings, 0, 0, &r).unwrap());
    assert_eq!(t.drain_events(), 1);
    let got = events.got.lock().unwrap().clone();
    let record = &got[0].record;
    assert_eq!(record.retprobe_caller.as_deref(), Some("func+0x10/0x40"), "{record:?}");
    assert!(record.entry_timestamp_ns.is_some());
    assert_eq!(record.args[0].1.to_string(), "7");
}

#[test]
fn draining_while_the_optimizer_makes_event_detours_never_deadlocks() {
    // The drain takes the registry and the record layouts; the optimization pass holds the
    // registry while it writes a new detour's layout. Taken in two orders, they deadlock.
    let (m, t, _events) = event_tracer();
    let t = Arc::new(t);
    let id = t
        .register(KprobeRequest::event(at("func", 0), "g", "ev", Vec::new()))
        .unwrap();
    let rings = *t.event_rings().unwrap();
    let mut record = vec![0u8; 24];
    record[0..4].copy_from_slice(&id.0.to_le_bytes());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    {
        let t = t.clone();
        std::thread::spawn(move || {
            for i in 0..400 {
                t.set_optimization(i % 2 == 0).unwrap();
            }
            let _ = done_tx.send(());
        });
    }
    {
        let t = t.clone();
        std::thread::spawn(move || loop {
            // The guest keeps hitting the probe: every drain has records to attribute.
            let _ = m.rings.as_ref().unwrap().guest_record(&rings, 0, 0, &record);
            t.drain_events();
            if Arc::strong_count(&t) == 1 {
                return;
            }
        });
    }
    done_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the optimizer and the drain deadlocked");
}

/// Guest-physical memory holding one kvm-clock page at [`KVMCLOCK_GPA`].
struct KvmClockPage(Vec<u8>);

const KVMCLOCK_GPA: u64 = 0x1ea_7000;

impl hvprobe_arch::paging::PhysRead for KvmClockPage {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        let not_memory = hvprobe_arch::paging::PhysAccessError::NotMemory { gpa, len: buf.len() };
        let start = gpa.0.checked_sub(KVMCLOCK_GPA).ok_or(not_memory.clone())? as usize;
        buf.copy_from_slice(self.0.get(start..start + buf.len()).ok_or(not_memory)?);
        Ok(())
    }
}

/// A guest clock at 1 GHz whose `sched_clock()` reads 1000 s + the guest TSC in ns; the
/// guest's TSC is the host's.
fn thousand_seconds_clock() -> Arc<crate::clock::GuestClock> {
    let mut page = vec![0u8; 32];
    page[0..4].copy_from_slice(&2u32.to_le_bytes());
    page[16..24].copy_from_slice(&1_000_000_000_000u64.to_le_bytes());
    page[24..28].copy_from_slice(&0x8000_0000u32.to_le_bytes());
    page[28] = 1;
    let clock = crate::clock::GuestClock::new(Arc::new(KvmClockPage(page)), 0, 1);
    let now = hvprobe_arch::tsc::host_tsc();
    clock.observe(
        0,
        crate::clock::VcpuClockInput {
            kvm_system_time: KVMCLOCK_GPA | 1,
            tsc: Some(hvprobe_arch::tsc::TscSample {
                host_before: now,
                guest: now,
                host_after: now,
            }),
        },
    );
    Arc::new(clock)
}

#[test]
fn records_are_stamped_with_their_own_tsc_on_the_guest_clock_and_with_the_drain_on_the_host_clock() {
    use crate::clock::TraceClock;
    let (m, t, events) = event_tracer();
    assert!(matches!(
        t.set_trace_clock(TraceClock::Local),
        Err(crate::clock::ClockError::NotAttached)
    ));
    assert_eq!(t.trace_clock(), TraceClock::Host);
    t.attach_guest_clock(thousand_seconds_clock()).unwrap();
    assert_eq!(t.trace_clock(), TraceClock::Local, "the guest's clock by default");
    // A trapped hit's stamp: the guest's clock now (1000 s + the TSC's count).
    let before = 1_000_000_000_000 + hvprobe_arch::tsc::host_tsc();
    let trapped = t.timestamp_ns();
    assert!(trapped >= before, "{trapped} < {before}");
    // No __sched_clock_offset: `global` is refused and the choice stays.
    assert!(t.set_trace_clock(TraceClock::Global).is_err());
    assert_eq!(t.trace_clock(), TraceClock::Local);

    t.set_optimization(true).unwrap();
    let id = t
        .register(KprobeRequest::event(at("func", 0), "g", "ev", Vec::new()))
        .unwrap();
    let rings = *t.event_rings().unwrap();
    let mem = m.rings.as_ref().unwrap();
    let record = |tsc: u64| {
        let mut r = vec![0u8; 24];
        r[0..4].copy_from_slice(&id.0.to_le_bytes());
        r[8..16].copy_from_slice(&tsc.to_le_bytes());
        r
    };
    for tsc in [7_000, 9_000] {
        assert!(mem.guest_record(&rings, 0, 0, &record(tsc)).unwrap());
    }
    assert_eq!(t.drain_events(), 2);
    let stamps = |events: &Events| -> Vec<u64> {
        let mut got = events.got.lock().unwrap();
        let stamps = got.iter().map(|e| e.record.timestamp_ns).collect();
        got.clear();
        stamps
    };
    assert_eq!(
        stamps(&events),
        [1_000_000_007_000, 1_000_000_009_000],
        "each record at its own TSC, in order"
    );

    // `host`: the drain's host time since the tracer started (far below 1000 s).
    t.set_trace_clock(TraceClock::Host).unwrap();
    assert!(mem.guest_record(&rings, 0, 0, &record(11_000)).unwrap());
    assert_eq!(t.drain_events(), 1);
    let host = stamps(&events);
    assert!(host[0] < 1_000_000_000_000, "{host:?}");
    assert!(t.timestamp_ns() < 1_000_000_000_000);
    t.unregister(id).unwrap();
}

#[test]
fn a_probe_that_records_stacks_traps_in_a_sync_detour_never_an_event_one() {
    // Its stack is only there while the vCPU is stopped: an event detour (no exit) could
    // not give one.
    let (m, t, _events) = event_tracer();
    t.set_optimization(true).unwrap();
    let id = t
        .register(KprobeRequest {
            stack_trace: true,
            ..KprobeRequest::event(at("func", 0), "g", "ev", Vec::new())
        })
        .unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(id));
    assert_eq!(
        m.bytes(jump_target(&m, PUSH), 1),
        [INT3],
        "a sync detour starts with its trap"
    );
    t.unregister(id).unwrap();
}

/// Where the `jmp rel32` the engine wrote at `site` goes: the site's detour.
fn jump_target(m: &FakeMachine, site: u64) -> u64 {
    let rel = i32::from_le_bytes(m.bytes(site + 1, 4).try_into().unwrap());
    (site + 5).wrapping_add_signed(i64::from(rel))
}

/// The miss-table entry of the event detour at `site`.
fn miss_slot(t: &Tracer, site: u64) -> u32 {
    let reg = t.read_registry();
    let detour = reg.sites[&Gva(site)].detour.as_ref().expect("optimized");
    *detour.miss_slots.first().expect("an event detour has a miss slot")
}

/// Ring misses reach each probe's `nmissed` from its own detour's entry of the miss table:
/// at every drain (a listing drains), through retirement, entry reuse, and a guest that
/// writes over an entry; the per-CPU totals stay in the summary.
#[test]
fn ring_misses_are_folded_into_each_probes_nmissed() {
    use crate::detour::ring::RingMemory;
    let (m, t, events) = event_tracer();
    m.write_virt(Gva(OTHER), FUNC_CODE).unwrap();
    t.set_optimization(true).unwrap();
    let a = t
        .register(KprobeRequest::event(at("func", 0), "g", "a", Vec::new()))
        .unwrap();
    let b = t
        .register(KprobeRequest::event(at("other", 0), "g", "b", Vec::new()))
        .unwrap();
    // (optimized, hits, nmissed) of `g/NAME`, from the listing (which drains first).
    let listed = |name: &str| {
        let entry = t
            .listing()
            .into_iter()
            .find(|e| e.event == format!("g/{name}"))
            .unwrap();
        (entry.optimized, entry.hits, entry.nmissed)
    };
    assert_eq!((listed("a").0, listed("b").0), (true, true));
    let (slot_a, slot_b) = (miss_slot(&t, PUSH), miss_slot(&t, OTHER + 5));
    assert_ne!(slot_a, slot_b);
    let rings = *t.event_rings().unwrap();
    let mem = m.rings.as_ref().unwrap();
    let capacity = rings.geometry().capacity();
    let record = |probe: ProbeId| {
        let mut r = vec![0u8; 24];
        r[0..4].copy_from_slice(&probe.0.to_le_bytes());
        r
    };
    // After a drain, CPU 0's ring takes `capacity` of a's records: then it is full. (The
    // consumer keeps up: only the ring loses hits.)
    let fill = || {
        events.got.lock().unwrap().clear();
        for _ in 0..capacity {
            assert!(mem.guest_record(&rings, 0, slot_a, &record(a)).unwrap());
        }
    };
    let miss = |id: ProbeId, slot: u32| assert!(!mem.guest_record(&rings, 0, slot, &record(id)).unwrap());
    fill();
    for _ in 0..3 {
        miss(a, slot_a);
    }
    for _ in 0..5 {
        miss(b, slot_b);
    }
    assert_eq!(listed("a"), (true, u64::from(capacity), 3));
    assert_eq!(listed("b"), (true, 0, 5));
    assert_eq!(t.stats.ring_missed.load(Ordering::Relaxed), 8, "the per-CPU total");
    assert_eq!((listed("a").2, listed("b").2), (3, 5), "counted once");

    // b's detour is retired while a task is still inside it: its misses there are b's,
    // and so is the last count taken when its entry is given back.
    let b_code = t.read_registry().sites[&Gva(OTHER + 5)].detour.as_ref().unwrap().code;
    *m.stack_words.lock().unwrap() = Some(vec![b_code.0 + 1]);
    t.set_enabled(b, false).unwrap();
    assert!(t
        .read_registry()
        .detour_codes
        .values()
        .any(|d| d.miss_slots.contains(&slot_b)));
    fill();
    miss(b, slot_b);
    assert_eq!(listed("b"), (false, 0, 6));
    fill();
    miss(b, slot_b);
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    t.set_optimization(true).unwrap(); // a pause: the retired detour is reclaimed, its entry freed
    assert!(t
        .read_registry()
        .detour_codes
        .values()
        .all(|d| !d.miss_slots.contains(&slot_b)));
    assert_eq!(listed("b"), (false, 0, 7), "the last count before the entry went");
    // b again: a new detour, whose entry's earlier count is not b's new misses.
    t.set_enabled(b, true).unwrap();
    let slot_b2 = miss_slot(&t, OTHER + 5);
    fill();
    miss(b, slot_b2);
    assert_eq!(listed("b"), (true, 0, 8));

    // A guest that writes over its entry adds nothing, and counts on from there.
    let entry = Gpa(rings.gpa().0 + rings.geometry().probe_missed_offset(slot_a).unwrap());
    mem.store_u64_release(entry, 1).unwrap();
    assert_eq!(listed("a").2, 3, "nothing added");
    mem.store_u64_release(entry, 4).unwrap();
    assert_eq!(listed("a").2, 6);
    assert_eq!(listed("b").2, 8, "b's count is b's alone");
    t.unregister_many(&[a, b]).unwrap();
}

/// Hits an event detour's filter discards in the guest are hits, counted apart: from the
/// detour's entry of the filter table, at every drain, into the probe's hits and
/// `filtered_in_guest` and the engine's totals; a guest that writes over the entry adds
/// nothing.
#[test]
fn hits_an_event_detours_filter_discards_are_hits_counted_apart() {
    use crate::detour::event::filter::{NumberOp, RecordCheck, RecordField, RecordFilter, RecordTest};
    use crate::detour::ring::RingMemory;
    let (m, t, _events) = event_tracer();
    t.set_optimization(true).unwrap();
    let on_cpu_1 = RecordFilter::Test(RecordTest {
        field: RecordField::Cpu,
        check: RecordCheck::Number {
            op: NumberOp::Eq,
            value: 1,
            size: 4,
            signed: true,
        },
    });
    let id = t
        .register(KprobeRequest {
            filter: Some(on_cpu_1),
            ..KprobeRequest::event(at("func", 0), "g", "ev", Vec::new())
        })
        .unwrap();
    let slot = miss_slot(&t, PUSH);
    let rings = *t.event_rings().unwrap();
    let mem = m.rings.as_ref().unwrap();
    let entry = Gpa(rings.gpa().0 + rings.geometry().probe_filtered_offset(slot).unwrap());
    let listed = || {
        let e = t.listing().into_iter().next().unwrap();
        (e.optimized, e.hits, e.filtered_in_guest, e.nmissed)
    };
    assert_eq!(listed(), (true, 0, 0, 0));
    mem.store_u64_release(entry, 5).unwrap();
    let mut record = vec![0u8; 24];
    record[0..4].copy_from_slice(&id.0.to_le_bytes());
    assert!(mem.guest_record(&rings, 0, slot, &record).unwrap());
    assert_eq!(listed(), (true, 6, 5, 0), "5 discarded and 1 recorded hit");
    assert_eq!(listed(), (true, 6, 5, 0), "counted once");
    assert_eq!(t.stats.filtered_in_guest.load(Ordering::Relaxed), 5);
    assert_eq!(t.stats.hits.load(Ordering::Relaxed), 6);
    mem.store_u64_release(entry, 2).unwrap();
    assert_eq!(listed(), (true, 6, 5, 0), "nothing added");
    mem.store_u64_release(entry, 3).unwrap();
    assert_eq!(listed(), (true, 7, 6, 0), "counted on from the value written");
    t.unregister(id).unwrap();
}

/// RSP is the guest's. A guard stub hit with RSP near 2^64 overflowed
/// the frame's address (a panic in a debug build); now the frame is unreadable, which is
/// the guard's error, with the guest's IDT back.
#[test]
fn a_guard_frame_at_the_top_of_the_address_space_is_an_error_not_a_panic() {
    for rsp in [u64::MAX - 7, u64::MAX - 3] {
        let (_m, t, mut cpu) = stepping_the_mov();
        cpu.regs.rip = GUARD_STUBS + 13;
        cpu.regs.rsp = rsp;
        let outcome = t.on_breakpoint(0, &mut cpu, Gva(GUARD_STUBS + 13));
        assert!(
            matches!(
                outcome,
                BreakpointOutcome::Fatal(EngineFault::StepGuard { vector: 13, .. })
            ),
            "{outcome:?}"
        );
        assert_eq!(cpu.idt, GUEST_IDT);
    }
    // The guest's IDT itself at the top: its gate's address wraps rather than panics.
    assert_eq!(
        super::step_guard::gate_address(Gva(u64::MAX - 15), 255),
        Gva((u64::MAX - 15).wrapping_add(255 * 16))
    );
}

/// The event rings are the guest's to write. A record whose CPU
/// number is not its ring's (here CPU 4000 on the one vCPU's ring) would have become a
/// `[4000]` column and a Perfetto track of its own; a loss counter set to 2^64 - 1 would
/// have added that many misses. Both are refused and counted in `ring_rejected`; honest
/// records and counts go on as before.
#[test]
fn forged_ring_records_and_counter_jumps_are_rejected() {
    use crate::detour::ring::RingMemory as _;
    let (m, t, events) = event_tracer();
    t.set_optimization(true).unwrap();
    let id = t
        .register(KprobeRequest::event(at("func", 0), "g", "ev", Vec::new()))
        .unwrap();
    assert!(t.listing()[0].optimized, "{:?}", t.why_not_optimized(id));
    let rings = *t.event_rings().unwrap();
    let mem = m.rings.as_ref().unwrap();
    let record = |cpu: u32, tsc: u64| {
        let mut r = vec![0u8; 24];
        r[0..4].copy_from_slice(&id.0.to_le_bytes());
        r[4..8].copy_from_slice(&cpu.to_le_bytes());
        r[8..16].copy_from_slice(&tsc.to_le_bytes());
        r
    };
    for (cpu, tsc) in [(0, 10), (4000, 20), (0, 30)] {
        assert!(mem.guest_record(&rings, 0, 0, &record(cpu, tsc)).unwrap());
    }
    assert_eq!(t.drain_events(), 2);
    let got = events.got.lock().unwrap().clone();
    assert!(got.iter().all(|e| e.record.cpu == 0), "{got:?}");
    assert_eq!(t.stats.ring_rejected.load(Ordering::Relaxed), 1);
    assert_eq!(t.listing()[0].hits, 2);

    // The guest sets its CPU's full-ring counter to 2^64 - 1, and the probe's miss-table
    // entry too.
    let ring = rings.gpa().0 + rings.geometry().ring_offset(0);
    mem.store_u64_release(Gpa(ring + crate::detour::ring::MISSED_FULL), u64::MAX)
        .unwrap();
    let slot = rings.geometry().probe_missed_offset(0).unwrap();
    mem.store_u64_release(Gpa(rings.gpa().0 + slot), u64::MAX).unwrap();
    t.drain_events();
    assert_eq!(t.stats.ring_missed.load(Ordering::Relaxed), 0);
    assert_eq!(t.listing()[0].nmissed, 0);
    assert_eq!(t.stats.ring_rejected.load(Ordering::Relaxed), 3);
    t.unregister(id).unwrap();
}

#[test]
fn a_plausible_step_is_at_most_one_hit_per_nanosecond_per_vcpu() {
    use super::event_rings::plausible_step;
    use std::time::Duration;
    let ms = Duration::from_millis(1);
    assert_eq!(plausible_step(10, 4, ms, 2), Some(6));
    assert_eq!(plausible_step(3, 4, ms, 2), Some(0), "written over: nothing");
    assert_eq!(
        plausible_step(2_000_000 + (1 << 20), 0, ms, 2),
        Some(2_000_000 + (1 << 20))
    );
    assert_eq!(plausible_step(2_000_001 + (1 << 20), 0, ms, 2), None);
    assert_eq!(plausible_step(u64::MAX, 0, Duration::MAX, u32::MAX), Some(u64::MAX));
}

/// The guest's BTF is read from its memory between `__start_BTF` and `__stop_BTF` when
/// first asked for; a kernel without those symbols has none.
#[test]
fn the_guests_btf_is_read_from_its_memory_once() {
    use hvprobe_introspection::btf::{BTF_MAGIC, BTF_VERSION};
    let machine = FakeMachine::with_code();
    assert!(tracer(&machine).kernel_btf().is_none(), "no __start_BTF: no BTF");
    // An empty BTF: the header, no types, the empty string.
    let mut blob = Vec::new();
    blob.extend(BTF_MAGIC.to_le_bytes());
    blob.extend([BTF_VERSION, 0]);
    for word in [24u32, 0, 0, 0, 1] {
        blob.extend(word.to_le_bytes());
    }
    blob.push(0);
    let at = FUNC + 0x2000;
    machine.write_virt(Gva(at), &blob).unwrap();
    let map = format!(
        "{FUNC:016x} T func\n{at:016x} R __start_BTF\n{:016x} R __stop_BTF\n",
        at + blob.len() as u64
    );
    let view = KernelView {
        symbols: Arc::new(SymbolTable::parse_system_map(&map).unwrap()),
        blacklist: KprobeBlacklist::default(),
        ex_table: ExceptionTable::default(),
        patch_sites: PatchSites::default(),
    };
    let t = Tracer::new(machine.clone(), view, None, None);
    let btf = t.kernel_btf().expect("the BTF is read");
    assert!(btf.is_empty());
    assert!(Arc::ptr_eq(btf, t.kernel_btf().unwrap()), "read once");
}

// ---- watches (debug registers) ----

fn watch(point: ProbePoint, event: &str, access: hvprobe_arch::debugreg::Access, len: u8) -> KprobeRequest {
    KprobeRequest {
        kind: ProbeKind::Watch { access, len },
        ..KprobeRequest::event(point, "w", event, Vec::new())
    }
}

fn loaded(m: &FakeMachine) -> hvprobe_arch::debugreg::DebugRegisters {
    let sets = m.debug_registers.lock().unwrap();
    let (last, paused) = *sets.last().expect("debug registers were set");
    assert!(paused, "the debug registers change only with the vCPUs paused");
    last
}

#[test]
fn watches_take_the_four_debug_registers_and_a_fifth_is_refused_naming_them() {
    use hvprobe_arch::debugreg::Access;
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let data = |n: u64| ProbePoint::Address(Gva(STACK_TOP - 0x200 + 8 * n));
    let ids: Vec<ProbeId> = (0..4)
        .map(|n| t.register(watch(data(n), &format!("d{n}"), Access::Write, 8)).unwrap())
        .collect();
    let regs = loaded(&m);
    assert_eq!(regs.used(), 4);
    assert_eq!(regs.get(2).map(|b| b.address()), Some(Gva(STACK_TOP - 0x200 + 16)));
    match t.register(watch(data(4), "d4", Access::Write, 8)) {
        Err(ProbeError::DebugRegistersFull { in_use }) => {
            assert!(in_use.contains("w/d0") && in_use.contains("w/d3"), "{in_use}")
        }
        other => panic!("a fifth watch: {other:?}"),
    }
    // Disabled: out of the registers, its slot kept; enabled again: back in it.
    t.set_enabled(ids[1], false).unwrap();
    assert!(loaded(&m).get(1).is_none() && loaded(&m).used() == 3);
    assert!(matches!(
        t.register(watch(data(4), "d4", Access::Write, 8)),
        Err(ProbeError::DebugRegistersFull { .. })
    ));
    t.set_enabled(ids[1], true).unwrap();
    assert_eq!(loaded(&m).get(1).map(|b| b.address()), Some(Gva(STACK_TOP - 0x200 + 8)));
    // The global switch empties them and fills them again.
    t.set_armed(false).unwrap();
    assert!(loaded(&m).is_empty());
    t.set_armed(true).unwrap();
    assert_eq!(loaded(&m).used(), 4);
    // Removed: the slot is free for another watch.
    t.unregister(ids[2]).unwrap();
    assert!(loaded(&m).get(2).is_none());
    t.register(watch(data(4), "d4", Access::Write, 8)).unwrap();
    assert_eq!(
        loaded(&m).get(2).map(|b| b.address()),
        Some(Gva(STACK_TOP - 0x200 + 32))
    );
    let listing = t.listing();
    assert_eq!(listing.len(), 4);
    assert!(listing.iter().all(|e| e.kind == crate::output::ListKind::Watch));
    t.unregister_all().unwrap();
    assert!(loaded(&m).is_empty());
    // No text was touched.
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE);
}

#[test]
fn bad_watches_are_refused_with_the_reason() {
    use hvprobe_arch::debugreg::{Access, HardwareBreakpointError};
    let m = FakeMachine::with_code();
    let t = tracer(&m);
    let unaligned = t.register(watch(
        ProbePoint::Address(Gva(STACK_TOP - 0x1fc)),
        "u",
        Access::Write,
        8,
    ));
    assert!(
        matches!(
            unaligned,
            Err(ProbeError::Watch {
                source: HardwareBreakpointError::Unaligned { .. },
                ..
            })
        ),
        "{unaligned:?}"
    );
    // Execution watches go on instruction boundaries of a function.
    assert!(matches!(
        t.register(watch(at("func", 7), "mid", Access::Execute, 1)),
        Err(ProbeError::Unprobeable { .. })
    ));
    assert!(matches!(
        t.register(watch(
            ProbePoint::Address(Gva(STACK_TOP - 0x200)),
            "nx",
            Access::Execute,
            1
        )),
        Err(ProbeError::NotInFunction(_))
    ));
    // An int3 probe and an execution watch do not share an instruction.
    let probe = t
        .register(KprobeRequest::event(at("func", 5), "p", "push", Vec::new()))
        .unwrap();
    assert!(matches!(
        t.register(watch(at("func", 5), "x", Access::Execute, 1)),
        Err(ProbeError::WatchOnProbe { .. })
    ));
    t.unregister(probe).unwrap();
    t.register(watch(at("func", 5), "x", Access::Execute, 1)).unwrap();
    assert!(matches!(
        t.register(KprobeRequest::event(at("func", 5), "p", "push", Vec::new())),
        Err(ProbeError::ProbeOnWatch { .. })
    ));
    // A machine whose data breakpoints never fire refuses data watches, not execution ones.
    m.no_data_watches.store(true, Ordering::Relaxed);
    assert!(matches!(
        t.register(watch(
            ProbePoint::Address(Gva(STACK_TOP - 0x200)),
            "d",
            Access::ReadWrite,
            4
        )),
        Err(ProbeError::WatchUnsupported { .. })
    ));
}

#[test]
fn a_watch_on_the_ftrace_nop_goes_where_an_int3_probe_is_refused_and_touches_no_text() {
    use hvprobe_arch::debugreg::Access;
    let (m, t, events) = event_tracer();
    // `func+0` is its ftrace NOP: an int3 probe moves off it, a watch stays on it.
    let id = t.register(watch(at("func", 0), "entry", Access::Execute, 1)).unwrap();
    assert_eq!(loaded(&m).get(0).map(|b| b.address()), Some(Gva(FUNC)));
    let mut vcpu = FakeVcpu::at(FUNC);
    assert!(t.on_hardware_breakpoint(0, &mut vcpu, Gva(FUNC), 0b1));
    assert_eq!(vcpu.regs.rip, FUNC, "the VMM, not the engine, passes the instruction");
    let got = events.got.lock().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].probe, id);
    assert_eq!(got[0].record.location, "func+0x0/0x40");
    drop(got);
    assert_eq!(m.bytes(FUNC, FUNC_CODE.len()), FUNC_CODE);
    // A slot no watch owns is not taken.
    assert!(!t.on_hardware_breakpoint(0, &mut vcpu, Gva(FUNC), 0b10));
}

#[test]
fn a_data_watch_names_the_instruction_that_accessed_it() {
    use hvprobe_arch::debugreg::Access;
    let (_m, t, events) = event_tracer();
    t.register(watch(
        ProbePoint::Address(Gva(STACK_TOP - 0x108)),
        "slot",
        Access::Write,
        8,
    ))
    .unwrap();
    // `push %rbp` at func+0x5 wrote the slot; the trap leaves RIP after it, at func+0x6.
    let mut vcpu = FakeVcpu::at(FUNC + 6);
    assert!(t.on_hardware_breakpoint(0, &mut vcpu, Gva(FUNC + 6), 0b1));
    // The same after an instruction with a displacement (func+0x9, seven bytes).
    assert!(t.on_hardware_breakpoint(0, &mut vcpu, Gva(FUNC + 0x10), 0b1));
    let got = events.got.lock().unwrap();
    let locations: Vec<&str> = got.iter().map(|e| e.record.location.as_str()).collect();
    assert_eq!(locations, ["func+0x5/0x40", "func+0x9/0x40"]);
}

#[test]
fn an_execution_watch_and_an_optimized_region_never_overlap() {
    use hvprobe_arch::debugreg::Access;
    // A region first: a watch inside it is refused (the guest runs the relocated copy).
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    let seen = Arc::new(Mutex::new(Vec::new()));
    t.register(recording_probe(&seen)).unwrap();
    assert!(t.listing()[0].optimized);
    assert!(matches!(
        t.register(watch(at("func", 6), "inside", Access::Execute, 1)),
        Err(ProbeError::WatchOnProbe { .. })
    ));
    // A watch first: the region that would cover it is not made, and says why.
    let m = FakeMachine::with_code();
    let t = optimizing(&m);
    t.register(watch(at("func", 9), "first", Access::Execute, 1)).unwrap();
    let id = t.register(recording_probe(&seen)).unwrap();
    assert!(t.listing().iter().all(|e| !e.optimized));
    assert!(
        matches!(t.why_not_optimized(id), Some(WhyNotOptimized::WatchInside { watch }) if watch == Gva(MOV_RIP)),
        "{:?}",
        t.why_not_optimized(id)
    );
}

mod modules;
