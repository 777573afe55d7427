//! Module probes on the fake machine: pending before the module loads, armed at the
//! `do_init_module` hook, `[GONE]` with the text restored at the `module_memfree` hook,
//! armed again at the next load; the hooks gone with the last module probe.

use super::*;
use hvprobe_introspection::modules::synthetic::{self, MODULES_HEAD, MODULE_BASE, STRUCT_MODULE};
use hvprobe_introspection::modules::ModuleBudget;

/// The loader's functions (ftrace NOP; push %rbp; mov %rsp,%rbp; pop %rbp; ret: room
/// for a jump after the NOP), in the padding after `traced`.
const DO_INIT_MODULE: u64 = FUNC + 0xe0;
const MODULE_MEMFREE: u64 = FUNC + 0xf0;
const LOADER_CODE: &[u8] = &[0x0f, 0x1f, 0x44, 0x00, 0x00, 0x55, 0x48, 0x89, 0xe5, 0x5d, 0xc3];
/// Where the kernel's BTF is.
const BTF: u64 = 0xffff_ffff_8300_0000;

fn machine() -> (Arc<FakeMachine>, u64) {
    let m = FakeMachine::with_code();
    m.write_virt(Gva(DO_INIT_MODULE), LOADER_CODE).unwrap();
    m.write_virt(Gva(MODULE_MEMFREE), LOADER_CODE).unwrap();
    let btf = synthetic::btf();
    m.write_virt(Gva(BTF), &btf).unwrap();
    // No module loaded yet: the list is empty.
    synthetic::lay_out(&[], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    (m, btf.len() as u64)
}

fn module_tracer(m: &Arc<FakeMachine>, btf_len: u64) -> Tracer {
    module_tracer_with(m, btf_len, OOL, "")
}

/// A tracer whose out-of-line area is at `ool` (zeroed here), with `more_symbols` (System.map
/// lines) in its kernel's symbols: what a guest that lies in kallsyms mode may say.
fn module_tracer_with(m: &Arc<FakeMachine>, btf_len: u64, ool: u64, more_symbols: &str) -> Tracer {
    let map = format!(
        "{FUNC:016x} T _stext\n{FUNC:016x} T func\n{DO_INIT_MODULE:016x} T do_init_module\n\
         {MODULE_MEMFREE:016x} W module_memfree\n{:016x} T _etext\n{MODULES_HEAD:016x} D modules\n\
         {BTF:016x} R __start_BTF\n{:016x} R __stop_BTF\n{more_symbols}",
        MODULE_MEMFREE + 0x10,
        BTF + btf_len
    );
    let view = KernelView {
        symbols: Arc::new(SymbolTable::parse_system_map(&map).unwrap()),
        blacklist: KprobeBlacklist::default(),
        ex_table: ExceptionTable::default(),
        patch_sites: PatchSites::default(),
    };
    m.write_virt(Gva(ool), &[0u8; OOL_SIZE as usize]).unwrap();
    let ool = OutOfLineArea {
        start: Gva(ool),
        size: OOL_SIZE,
        rings: Gva(ool + OOL_SIZE),
        rings_size: 0,
    };
    Tracer::new(m.clone(), view, Some(ool), None)
}

fn module_point(name: &str) -> ProbePoint {
    ProbePoint::Module {
        module: "alpha".into(),
        name: name.into(),
        offset: 0,
    }
}

/// The guest's loader reaches `do_init_module(mod)` (or `module_memfree(region)`): the
/// hook's hit on vCPU 0, with the argument in %rdi.
fn loader_hit(t: &Tracer, function: u64, arg: u64) {
    let site = function + 5;
    let mut cpu = FakeVcpu::at(site);
    cpu.regs.rdi = arg;
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(site)),
        BreakpointOutcome::Handled
    ));
}

fn load(m: &FakeMachine, t: &Tracer) {
    synthetic::lay_out(&["alpha"], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    loader_hit(t, DO_INIT_MODULE, MODULE_BASE + STRUCT_MODULE);
}

fn unload(m: &FakeMachine, t: &Tracer) {
    loader_hit(t, MODULE_MEMFREE, MODULE_BASE);
    synthetic::lay_out(&[], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
}

#[test]
fn a_module_probe_waits_for_its_module_arms_at_its_load_and_goes_at_its_free() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    let loader_text = (m.bytes(DO_INIT_MODULE, 11), m.bytes(MODULE_MEMFREE, 11));
    let id = t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    let listed = &t.listing()[0];
    assert!(listed.pending && listed.address == Gva(0), "{listed:?}");
    assert_eq!(
        listing_line(listed),
        "0000000000000000  k  mod_fn_b+0x0  alpha [PENDING] hits=0 nmissed=0 event=test/work"
    );
    // The hooks are in the loader, after its ftrace NOPs.
    assert_eq!(m.bytes(DO_INIT_MODULE + 5, 1), [INT3]);
    assert_eq!(m.bytes(MODULE_MEMFREE + 5, 1), [INT3]);
    // Not in the listing: they are the engine's.
    assert_eq!(t.listing().len(), 1);

    let fn_b = MODULE_BASE + 0x40;
    for round in 1..=2u64 {
        load(&m, &t);
        assert_eq!(m.bytes(fn_b, 1), [INT3], "armed at load {round}");
        let listed = &t.listing()[0];
        assert!(!listed.pending && !listed.gone, "{listed:?}");
        assert_eq!(listed.address, Gva(fn_b));
        assert_eq!(listed.module.as_deref(), Some("alpha"));
        let mut cpu = FakeVcpu::at(fn_b);
        assert!(matches!(
            t.on_breakpoint(0, &mut cpu, Gva(fn_b)),
            BreakpointOutcome::Handled
        ));
        assert_eq!(t.listing()[0].hits, round);

        unload(&m, &t);
        assert_eq!(m.bytes(fn_b, 1), [0x90], "the original byte back before the free");
        assert!(t.listing()[0].gone, "{:?}", t.listing()[0]);
        // A hit there now is not ours (the memory is the guest's again).
        let mut cpu = FakeVcpu::at(fn_b);
        assert!(matches!(
            t.on_breakpoint(0, &mut cpu, Gva(fn_b)),
            BreakpointOutcome::NotOurs
        ));
    }

    // Freeing memory that is no module's changes nothing.
    load(&m, &t);
    loader_hit(&t, MODULE_MEMFREE, 0xffff_c900_0000_0000);
    assert_eq!(m.bytes(fn_b, 1), [INT3]);

    // The last module probe goes: its int3 and the loader's hooks go with it.
    t.unregister(id).unwrap();
    assert_eq!(m.bytes(fn_b, 1), [0x90]);
    assert_eq!((m.bytes(DO_INIT_MODULE, 11), m.bytes(MODULE_MEMFREE, 11)), loader_text);
    assert!(t.modules.hook_at(Gva(DO_INIT_MODULE + 5)).is_none());
}

/// Every probe removed at once (the end of a run): the hooks are no hooks any more.
#[test]
fn the_hooks_are_forgotten_when_every_probe_goes() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    assert!(t.modules.hook_at(Gva(DO_INIT_MODULE + 5)).is_some());
    t.unregister_all().unwrap();
    assert!(t.modules.hook_at(Gva(DO_INIT_MODULE + 5)).is_none());
    assert!(t.modules.hook_at(Gva(MODULE_MEMFREE + 5)).is_none());
}

#[test]
fn a_loaded_modules_blacklisted_or_unknown_function_is_refused_and_a_pending_one_stays_pending() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    // Pending: accepted (the module may bring it), then left pending when it does not.
    let blacklisted = t.register(plain(module_point(synthetic::BLACKLISTED), "nope")).unwrap();
    let unknown = t.register(plain(module_point("no_such"), "none")).unwrap();
    load(&m, &t);
    let listing = t.listing();
    assert!(listing.iter().all(|l| l.pending), "{listing:?}");
    assert_eq!(m.bytes(MODULE_BASE + 0x10, 1), [0x90]);
    t.unregister_many(&[blacklisted, unknown]).unwrap();
    // Loaded: refused at once, with the reason.
    let e = t
        .register(plain(module_point(synthetic::BLACKLISTED), "nope"))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "alpha:mod_fn_a+0x0 is blacklisted: on the module's kprobe blacklist (NOKPROBE_SYMBOL)"
    );
    let e = t.register(plain(module_point("no_such"), "none")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "alpha:no_such+0x0: module alpha has no text symbol \"no_such\""
    );
    // The module's own jump label (its jump table, as the kernel's are refused).
    let label = ProbePoint::Module {
        module: "alpha".into(),
        name: "mod_fn_b".into(),
        offset: synthetic::JUMP_LABEL - 0x40 + 2,
    };
    let e = t.register(plain(label, "label")).unwrap_err();
    assert!(
        matches!(
            e,
            ProbeError::PatchSite {
                kind: PatchSiteKind::JumpLabel,
                ..
            }
        ),
        "{e}"
    );
    // A return probe off a function's entry is refused while the module is away too
    // (unloaded while no module probe, nor hook, was in).
    synthetic::lay_out(&[], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    let mut r = plain(
        ProbePoint::Module {
            module: "alpha".into(),
            name: "mod_fn_b".into(),
            offset: 4,
        },
        "ret",
    );
    r.kind = ProbeKind::Kretprobe { maxactive: 4 };
    assert!(matches!(
        t.register(r).unwrap_err(),
        ProbeError::ReturnProbeNotAtEntry { .. }
    ));
}

/// The hooks must exit to the host at every load and free: with optimization on they
/// stay int3s (a detour's exit is at its code, not at the hook's address), and a load
/// still arms the module's probes.
#[test]
fn the_loader_hooks_are_never_optimized_away() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    // (The machine can search its kernel stacks: nothing else stops an optimization.)
    *m.stack_words.lock().unwrap() = Some(Vec::new());
    t.set_optimization(true).unwrap();
    assert_eq!(m.bytes(DO_INIT_MODULE + 5, 1), [INT3], "do_init_module's hook");
    assert_eq!(m.bytes(MODULE_MEMFREE + 5, 1), [INT3], "module_memfree's hook");
    load(&m, &t);
    assert_eq!(m.bytes(MODULE_BASE + 0x40, 1), [INT3]);
}

/// A return probe registered while its module is away follows calls once the module
/// loads (its trampoline is made at registration, as for any return probe).
#[test]
fn a_pending_return_probe_follows_calls_once_its_module_loads() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    let mut req = plain(module_point("mod_fn_b"), "ret");
    req.kind = ProbeKind::Kretprobe { maxactive: 4 };
    t.register(req).unwrap();
    load(&m, &t);
    let fn_b = MODULE_BASE + 0x40;
    let caller = FUNC + 0x20;
    let mut cpu = FakeVcpu::at(fn_b);
    let slot = cpu.regs.rsp;
    m.write_virt(Gva(slot), &caller.to_le_bytes()).unwrap();
    assert!(matches!(
        t.on_breakpoint(0, &mut cpu, Gva(fn_b)),
        BreakpointOutcome::Handled
    ));
    // (`return_from` checks the return address was swapped for the trampoline.)
    assert!(matches!(
        return_from(&t, &m, &mut cpu, slot, 0),
        BreakpointOutcome::Handled
    ));
    assert_eq!(cpu.regs.rip, caller);
    assert_eq!(t.listing()[0].hits, 1);
}

/// The global switch off: the loader hooks stay in (a module that unloads meanwhile must
/// still take our int3s with it), and switching back on arms nothing in freed memory.
#[test]
fn the_loader_hooks_stay_armed_while_the_global_switch_is_off() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    load(&m, &t);
    let fn_b = MODULE_BASE + 0x40;
    assert_eq!(m.bytes(fn_b, 1), [INT3]);
    t.set_armed(false).unwrap();
    assert_eq!(m.bytes(fn_b, 1), [0x90]);
    assert_eq!(m.bytes(MODULE_MEMFREE + 5, 1), [INT3], "the free hook stays");
    unload(&m, &t);
    // Other code where the module was: its first byte as the probed one was.
    m.write_virt(Gva(fn_b), &[0x90, 0x0f, 0x0b]).unwrap();
    t.set_armed(true).unwrap();
    assert_eq!(
        m.bytes(fn_b, 3),
        [0x90, 0x0f, 0x0b],
        "nothing written into freed memory"
    );
    assert!(t.listing()[0].gone, "{:?}", t.listing()[0]);
}

/// An address in a module's code is refused: only `MOD:SYM+OFF` follows the module's
/// unload (a raw address would stay in the freed memory).
#[test]
fn an_address_in_a_modules_code_is_refused_with_the_way_to_probe_it() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    let id = t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    load(&m, &t);
    t.unregister(id).unwrap();
    let e = t
        .register(plain(ProbePoint::Address(Gva(MODULE_BASE + 0x40)), "addr"))
        .unwrap_err();
    assert!(e.to_string().contains("give it as alpha:mod_fn_b+0x0"), "{e}");
    assert_eq!(m.bytes(MODULE_BASE + 0x40, 1), [0x90]);
}

/// The module list read again between the module leaving it and its memory being freed
/// (another module probe added then): the free still takes our int3 out — what a site
/// is in was noted when it was armed.
#[test]
fn a_free_takes_the_int3s_out_even_when_the_list_was_read_again_before_it() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    load(&m, &t);
    let fn_b = MODULE_BASE + 0x40;
    // free_module: the module leaves the list, ...
    synthetic::lay_out(&[], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    // ... a probe of another module is added (its registration reads the list), ...
    let other = ProbePoint::Module {
        module: "other".into(),
        name: "x".into(),
        offset: 0,
    };
    t.register(plain(other, "other")).unwrap();
    // ... and the memory is freed.
    loader_hit(&t, MODULE_MEMFREE, MODULE_BASE);
    assert_eq!(m.bytes(fn_b, 1), [0x90]);
    assert!(t.listing()[0].gone, "{:?}", t.listing()[0]);
}

/// The module loads while a probe of it is being registered — after the list was read,
/// before the pause (and so before the load hook was in): the probe is armed all the
/// same, not left pending on a loaded module.
#[test]
fn a_module_that_loads_while_its_probe_is_registered_gets_the_probe() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    *m.before_pause.lock().unwrap() = Some(Box::new(|m: &FakeMachine| {
        synthetic::lay_out(&["alpha"], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    }));
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    let listed = &t.listing()[0];
    assert!(!listed.pending, "{listed:?}");
    assert_eq!(m.bytes(MODULE_BASE + 0x40, 1), [INT3]);
}

/// A module symbol's address is the guest's. One at
/// 0xffff_ffff_ffff_fff0 with an ELF size of 0x100 let `alpha:mod_fn_b+0x20` pass the
/// offset check, and the address sum overflowed (a panic in a debug build, a wrapped
/// address in a release one).
#[test]
fn a_module_symbol_at_the_top_of_the_address_space_is_an_error_not_a_panic() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    synthetic::lay_out(&["alpha"], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    // mod_fn_b is the second symbol after the null one.
    let sym = MODULE_BASE + 0x2200 + 2 * 24;
    m.write_virt(Gva(sym + 8), &0xffff_ffff_ffff_fff0u64.to_le_bytes())
        .unwrap();
    m.write_virt(Gva(sym + 16), &0x100u64.to_le_bytes()).unwrap();
    let point = ProbePoint::Module {
        module: "alpha".into(),
        name: "mod_fn_b".into(),
        offset: 0x20,
    };
    let e = t.register(plain(point, "top")).unwrap_err();
    assert!(matches!(e, ProbeError::AddressWraps { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "alpha:mod_fn_b+0x20: mod_fn_b at 0xfffffffffffffff0 plus 0x20 runs past the end of the address space"
    );
}

/// Every `do_init_module` hit of a module with a new name and
/// address added it to the engine's list, which nothing capped: a guest that kept
/// "loading" forged modules grew the host without bound (and every stack frame's lookup
/// scanned them all). The list keeps at most the budget's modules, the oldest going first,
/// and a real module loaded after such a flood still gets its probes.
#[test]
fn forged_loads_do_not_grow_the_module_list_past_its_budget() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    synthetic::lay_out(&["alpha"], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    let id = t
        .register(plain(
            ProbePoint::Module {
                module: "beta".into(),
                name: "mod_fn_b".into(),
                offset: 0,
            },
            "work",
        ))
        .unwrap();
    let template = m.bytes(MODULE_BASE + STRUCT_MODULE, 224);
    let limit = ModuleBudget::for_memory(m.memory_size()).max_modules;
    // Each forged module: alpha's struct module with a name and memory of its own.
    let forged = |i: u64, name: &str, core: u64| {
        let at = MODULE_BASE + 0x80_0000 + i * 0x100;
        let mut bytes = template.clone();
        let mut raw = name.as_bytes().to_vec();
        raw.resize(56, 0);
        bytes[24..80].copy_from_slice(&raw);
        bytes[80..88].copy_from_slice(&core.to_le_bytes());
        m.write_virt(Gva(at), &bytes).unwrap();
        loader_hit(&t, DO_INIT_MODULE, at);
    };
    let flood = limit as u64 + 100;
    for i in 0..flood {
        forged(i, &format!("forged{i}"), MODULE_BASE + 0x100_0000 + i * 0x4000);
    }
    let kept = t.loaded_modules().modules().count();
    assert!(kept <= limit, "{kept} modules kept");
    // The newest are the ones kept.
    let newest = MODULE_BASE + 0x100_0000 + (flood - 1) * 0x4000;
    assert_eq!(
        t.module_containing(Gva(newest + 0x10)).map(|m| m.name.clone()),
        Some(format!("forged{}", flood - 1))
    );
    // beta, in alpha's memory (the symbols they share are there).
    forged(flood, "beta", MODULE_BASE);
    assert_eq!(m.bytes(MODULE_BASE + 0x40, 1), [INT3]);
    assert!(!t.listing()[0].pending, "{:?}", t.listing()[0]);
    t.unregister(id).unwrap();
}

/// The engine's list keeps the modules' decoded bytes within the budget too (the oldest
/// go first), and a module whose memory overlaps one it holds replaces it: the module
/// holding an address is then one lookup.
#[test]
fn the_module_list_keeps_its_decoded_bytes_within_budget_and_one_module_per_address() {
    use super::super::modules::LoadedList;
    use hvprobe_introspection::btf::Btf;
    use hvprobe_introspection::modules::{read_module, ModuleLayout};
    let mem = synthetic::memory(&["alpha"]);
    let layout = ModuleLayout::from_btf(&Btf::parse(&synthetic::btf()).unwrap()).unwrap();
    let budget = ModuleBudget::for_memory(1 << 30);
    let alpha = read_module(&mem, &layout, Gva(MODULE_BASE + STRUCT_MODULE), &budget).unwrap();
    let module = |name: &str, core: u64, decoded: u64| {
        let mut m = alpha.clone();
        m.name = name.into();
        m.address = Gva(core + STRUCT_MODULE);
        m.core = Gva(core)..Gva(core + 0x4000);
        m.decoded_bytes = decoded;
        Arc::new(m)
    };
    let small = ModuleBudget {
        max_total_decoded: 1000,
        ..budget
    };
    let mut list = LoadedList::default();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        list.insert(module(name, MODULE_BASE + i as u64 * 0x10_0000, 400), &small);
    }
    let names = |list: &LoadedList| list.modules().map(|m| m.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&list), ["b", "c"], "a went to make room for c");
    // d claims part of c's memory: c goes, and an address there is d's.
    list.insert(module("d", MODULE_BASE + 2 * 0x10_0000 + 0x2000, 100), &small);
    assert_eq!(names(&list), ["b", "d"]);
    let at = |a: u64| list.containing(Gva(a)).map(|m| m.name.clone());
    assert_eq!(at(MODULE_BASE + 2 * 0x10_0000 + 0x1000), None);
    assert_eq!(at(MODULE_BASE + 2 * 0x10_0000 + 0x2000).as_deref(), Some("d"));
    assert_eq!(at(MODULE_BASE + 0x10_0000 + 0x3fff).as_deref(), Some("b"));
    assert_eq!(at(MODULE_BASE + 0x10_0000 + 0x4000), None);
    // One over the whole budget on its own is not kept.
    list.insert(module("e", MODULE_BASE + 5 * 0x10_0000, 1001), &small);
    assert_eq!(names(&list), ["b", "d"]);
}

/// Where a KASLR kernel's image mapping may put the out-of-line area: below 0xffffffffc0000000
/// and above 0xffffffffa0000000, inside what the engine counts as the module area.
const OOL_AMONG_MODULES: u64 = 0xffff_ffff_bfc0_0000;

/// That the bytes at `at` are still `before` (naming the first that changed).
fn assert_unchanged(m: &FakeMachine, at: u64, before: &[u8]) {
    let now = m.bytes(at, before.len());
    if let Some(i) = (0..before.len()).find(|&i| now[i] != before[i]) {
        panic!(
            "{:#x} changed from {:#04x} to {:#04x}",
            at + i as u64,
            before[i],
            now[i]
        );
    }
}

/// alpha's struct module claims its core layout at `core`, and its mod_fn_b at `fn_b`
/// (with an ELF size of 0x30).
fn forge_alpha(m: &FakeMachine, core: u64, fn_b: u64) {
    synthetic::lay_out(&["alpha"], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    m.write_virt(Gva(MODULE_BASE + STRUCT_MODULE + 80), &core.to_le_bytes())
        .unwrap();
    let sym = MODULE_BASE + 0x2200 + 2 * 24;
    m.write_virt(Gva(sym + 8), &fn_b.to_le_bytes()).unwrap();
}

/// A forged `do_init_module` for a module a pending probe waits on,
/// with the probed function in the out-of-line area (where a KASLR kernel's image mapping
/// may put it, inside the module area), had the load hook write its int3 into hvprobe's
/// own code — and `disarm` would write a stale "original" byte there later. A module's
/// text must be in the module area, outside the kernel's text and the out-of-line area,
/// or its probes stay pending.
#[test]
fn a_forged_module_in_the_out_of_line_area_gets_no_probe_writes() {
    let (m, btf_len) = machine();
    let t = module_tracer_with(&m, btf_len, OOL_AMONG_MODULES, "");
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    let area = m.bytes(OOL_AMONG_MODULES, OOL_SIZE as usize);
    forge_alpha(&m, OOL_AMONG_MODULES, OOL_AMONG_MODULES + 0x800);
    loader_hit(&t, DO_INIT_MODULE, MODULE_BASE + STRUCT_MODULE);
    assert_unchanged(&m, OOL_AMONG_MODULES, &area);
    assert!(t.listing()[0].pending, "{:?}", t.listing()[0]);
    assert!(m
        .text_writes_into(OOL_AMONG_MODULES..OOL_AMONG_MODULES + OOL_SIZE)
        .is_empty());
}

/// The load hook arms without a pause (a module's own text runs
/// nowhere yet). A forged module whose text is the kernel's live text got its int3s there
/// unpaused, racing every vCPU that runs it. Refused: the probe stays pending.
#[test]
fn a_forged_module_over_the_kernels_text_gets_no_unpaused_writes() {
    let (m, btf_len) = machine();
    let t = module_tracer(&m, btf_len);
    t.register(plain(module_point("mod_fn_b"), "work")).unwrap();
    let text = m.bytes(FUNC, 0x20);
    let pauses = m.pauses.load(Ordering::Relaxed);
    forge_alpha(&m, FUNC, FUNC);
    loader_hit(&t, DO_INIT_MODULE, MODULE_BASE + STRUCT_MODULE);
    assert_unchanged(&m, FUNC, &text);
    assert_eq!(m.pauses.load(Ordering::Relaxed), pauses);
    assert!(t.listing()[0].pending, "{:?}", t.listing()[0]);
}

/// In kallsyms mode the kernel's symbols are the guest's too. A
/// "function" in the out-of-line area, or outside the kernel's text and the module area,
/// is refused with the reason, and nothing is written.
#[test]
fn a_core_symbol_in_the_out_of_line_area_or_outside_text_is_refused() {
    let (m, btf_len) = machine();
    let in_area = OOL_AMONG_MODULES + 0x800;
    let outside = BTF + 0x10_0000;
    m.write_virt(Gva(outside), &[0x55, 0xc3]).unwrap();
    let t = module_tracer_with(
        &m,
        btf_len,
        OOL_AMONG_MODULES,
        &format!(
            "{in_area:016x} T forged_in_area\n{:016x} T next_in_area\n\
             {outside:016x} T forged_outside\n{:016x} T next_outside\n",
            in_area + 0x30,
            outside + 0x30
        ),
    );
    let area = m.bytes(OOL_AMONG_MODULES, OOL_SIZE as usize);
    let e = t.register(plain(at("forged_in_area", 0), "a")).unwrap_err();
    assert!(e.to_string().contains("out-of-line area"), "{e}");
    let e = t.register(plain(at("forged_outside", 0), "b")).unwrap_err();
    assert!(e.to_string().contains("neither in the kernel's text"), "{e}");
    assert_unchanged(&m, OOL_AMONG_MODULES, &area);
    assert_eq!(m.bytes(outside, 2), [0x55, 0xc3]);
    assert!(t.listing().is_empty());
}

/// A kernel probe (a core symbol the guest's kallsyms puts in module
/// memory) that shared a module probe's site was left with no site when the module's
/// memory was freed — listed neither armed nor `[GONE]`, silently dead. It is `[GONE]`
/// now. And in the other order (the kernel probe's site first, the module loading under
/// it), the free takes the int3 out too instead of leaving it in freed memory.
#[test]
fn a_kernel_probe_sharing_a_freed_module_site_is_reported_gone() {
    let (m, btf_len) = machine();
    let fn_b = MODULE_BASE + 0x40;
    let t = module_tracer_with(
        &m,
        btf_len,
        OOL,
        &format!("{fn_b:016x} T core_in_module\n{:016x} T core_after\n", fn_b + 0x30),
    );
    t.register(plain(module_point("mod_fn_b"), "module")).unwrap();
    load(&m, &t);
    t.register(plain(at("core_in_module", 0), "kernel")).unwrap();
    assert_eq!(m.bytes(fn_b, 1), [INT3]);
    unload(&m, &t);
    assert_eq!(m.bytes(fn_b, 1), [0x90]);
    let listing = t.listing();
    assert!(listing.iter().all(|l| l.gone), "{listing:?}");

    // The kernel probe first, then the module loads under it.
    let (m, btf_len) = machine();
    let t = module_tracer_with(
        &m,
        btf_len,
        OOL,
        &format!("{fn_b:016x} T core_in_module\n{:016x} T core_after\n", fn_b + 0x30),
    );
    m.write_virt(Gva(MODULE_BASE), &[0x90; 0x100]).unwrap();
    t.register(plain(module_point("mod_fn_b"), "module")).unwrap();
    t.register(plain(at("core_in_module", 0), "kernel")).unwrap();
    assert_eq!(m.bytes(fn_b, 1), [INT3]);
    synthetic::lay_out(&["alpha"], &mut |at, bytes| m.write_virt(Gva(at), bytes).unwrap());
    // (The loader's copy of the module's text left the byte under the int3 as it was.)
    m.write_virt(Gva(fn_b), &[INT3]).unwrap();
    loader_hit(&t, DO_INIT_MODULE, MODULE_BASE + STRUCT_MODULE);
    assert!(!t.listing()[0].pending, "{:?}", t.listing()[0]);
    loader_hit(&t, MODULE_MEMFREE, MODULE_BASE);
    assert_eq!(m.bytes(fn_b, 1), [0x90], "our int3 left in freed memory");
    let listing = t.listing();
    assert!(listing.iter().all(|l| l.gone), "{listing:?}");
}
