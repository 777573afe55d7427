//! Every kernel stack of the bundled guest, from a restored snapshot (memory only: the
//! vCPU never runs, so the guest is as paused as it gets), and the scan for saved addresses.
//!
//! Needs `/dev/kvm` and the bundled guest's 1- and 2-vCPU snapshots
//! (`$HVPROBE_CACHE` or `~/.cache/hvprobe`, `snapshots/<guest key>-<N>cpu-v<format>`), which
//! the root package's snapshot tests create; without either the test fails and says so.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::stacks::{Extent, KernelStack, KernelStacks, StackOwner, StacksLayout};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::task::select_per_cpu_base;
use hvprobe_live::{kernel_memory, live_memory, load_symbols, narrow_to_vcpus, SymbolsFrom};
use hvprobe_vmm::{snapshot_cache_name, Backend, ConsoleOutput, Vm};

/// The bundled guest's `cpus`-vCPU snapshot directory, or a panic that says how to get one.
fn snapshot_dir(cpus: u8) -> PathBuf {
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        panic!("this test restores a guest snapshot and needs /dev/kvm, which cannot be opened: {e}");
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guest/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed with {}", script.display(), out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let guest = PathBuf::from(stdout.lines().last().unwrap_or("").trim());
    let key = guest
        .file_name()
        .unwrap_or_else(|| panic!("{} printed no guest directory", script.display()))
        .to_string_lossy()
        .into_owned();
    let cache = match std::env::var_os("HVPROBE_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/hvprobe"),
    };
    let dir = cache
        .join("snapshots")
        .join(snapshot_cache_name(&key, cpus, Backend::detect()));
    assert!(
        dir.join("state").exists(),
        "no snapshot of the bundled guest at {}: create it with `cargo run -- snapshot create --out {} --cpus {cpus}` \
         (the root package's snapshot tests create it too)",
        dir.display(),
        dir.display()
    );
    dir
}

fn function(symbols: &SymbolTable, name: &str) -> std::ops::Range<Gva> {
    let s = symbols.lookup(name).unwrap_or_else(|| panic!("no symbol {name}"));
    let size = symbols.size_of(s).unwrap_or_else(|| panic!("no size for {name}"));
    s.addr..Gva(s.addr.0 + size)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[test]
fn every_kernel_stack_of_the_bundled_guest_and_a_scan_of_them() {
    check_snapshot(1);
}

#[test]
fn every_kernel_stack_of_the_bundled_guest_with_two_vcpus() {
    check_snapshot(2);
}

fn check_snapshot(cpus: u8) {
    let dir = snapshot_dir(cpus);
    let vm = Vm::restore(&dir, Some(cpus), ConsoleOutput::Discard, &[])
        .unwrap_or_else(|e| panic!("restoring {}: {e}", dir.display()));
    let states: Vec<_> = (0..usize::from(cpus))
        .map(|i| vm.vcpu_state(i).unwrap_or_else(|e| panic!("vCPU {i} state: {e}")))
        .collect();
    let state = &states[0];
    let symbols = load_symbols(&SymbolsFrom::Kallsyms, &live_memory(vm.memory(), state), state.lstar)
        .expect("kallsyms of the restored guest")
        .table;
    let mem = kernel_memory(vm.memory(), state, &symbols).expect("the kernel's page tables");

    let started = Instant::now();
    let layout = StacksLayout::from_guest(&mem, &symbols).expect("stacks layout from the guest's BTF");
    let layout_time = started.elapsed();

    // Several rounds, for the timing; the guest does not run, so each is the same.
    let schedule = function(&symbols, "__schedule");
    let getppid = function(&symbols, "__x64_sys_getppid");
    let mut read_times = Vec::new();
    let mut scan_times = Vec::new();
    let mut result = None;
    for _ in 0..5 {
        let t = Instant::now();
        let mut stacks = KernelStacks::read(&mem, &layout).expect("kernel stacks");
        let unnarrowed = stacks.scan_bytes();
        narrow_to_vcpus(&mut stacks, &mem, &states).expect("narrowing to the vCPUs");
        read_times.push(t.elapsed());
        let t = Instant::now();
        let hits = stacks.saved_addresses_in(&mem, schedule.clone()).expect("scan");
        scan_times.push(t.elapsed());
        result = Some((stacks, hits, unnarrowed));
    }
    let (stacks, hits, unnarrowed) = result.unwrap();
    read_times.sort();
    scan_times.sort();

    // What a scan would read without the saved-stack-pointer and IRQ-in-use rules.
    let t = Instant::now();
    let mut buf = Vec::new();
    for s in stacks.stacks() {
        buf.resize((s.bounds.end.0 - s.bounds.start.0) as usize, 0);
        let _ = mem.read_virt(s.bounds.start, &mut buf);
    }
    let whole_read = t.elapsed();

    let counts = stacks.task_counts();
    let task_stacks: Vec<_> = stacks
        .stacks()
        .iter()
        .filter(|s| matches!(s.owner, StackOwner::Task { .. }))
        .collect();
    let by_extent = |e: Extent| stacks.stacks().iter().filter(|s| s.extent == e).count();
    eprintln!(
        "stacks: {} ({} tasks: {counts:?}), {} CPUs; {} of {} bytes scanned ({} before narrowing to the vCPU); \
         layout from BTF {:.1} ms; read (median of 5) {:.2} ms, scan {:.2} ms; reading every stack whole {:.2} ms; \
         extents: whole {}, from saved sp {}, sp outside {}, unused {}, from vCPU sp {}, user mode {}",
        stacks.stacks().len(),
        task_stacks.len(),
        stacks.cpus().len(),
        stacks.scan_bytes(),
        stacks.total_bytes(),
        unnarrowed,
        ms(layout_time),
        ms(read_times[2]),
        ms(scan_times[2]),
        ms(whole_read),
        by_extent(Extent::Whole),
        by_extent(Extent::FromSavedSp),
        by_extent(Extent::WholeSavedSpOutside),
        by_extent(Extent::Unused),
        by_extent(Extent::FromVcpuSp),
        by_extent(Extent::UserMode),
    );
    for (i, st) in states.iter().enumerate() {
        eprintln!(
            "vCPU {i} at {:#x} ({}), rsp {:#x}, cs {:#x}",
            st.regs.rip,
            symbols
                .describe(Gva(st.regs.rip))
                .map(|d| d.to_string())
                .unwrap_or_default(),
            st.regs.rsp,
            st.sregs.cs.selector
        );
    }
    for s in stacks.stacks() {
        eprintln!("  {:?} {} {:?} {} bytes", s.extent, s.owner, s.bounds, s.scan_len());
    }

    // Each vCPU's current task is scanned from its stack pointer (kernel mode, when that is
    // on the task's stack) or not at all (user mode); then the CPU is in no exception handler.
    // A snapshot can also catch a kernel-mode vCPU on another stack: half-way through a
    // context switch (on the next task's stack while `current_task` still names the previous
    // one), in an IST exception handler or on the entry stack. Then narrowing changes
    // nothing of that CPU's stacks, which the stacks as read without narrowing show; a
    // stack pointer on no stack the reader found fails.
    let stacks_as_read = KernelStacks::read(&mem, &layout).expect("kernel stacks");
    for st in &states {
        let cpl = (st.sregs.cs.selector & 3) as u8;
        let base = select_per_cpu_base(cpl, st.sregs.gs.base, st.kernel_gs_base).expect("per-CPU base");
        let cpu = stacks
            .cpus()
            .iter()
            .find(|c| c.per_cpu_base == base)
            .expect("the vCPU's CPU");
        let running = stacks.task_stack(cpu.current).expect("the current task's stack");
        let sp = Gva(st.regs.rsp);
        let on_task_stack = running.bounds.contains(&sp);
        let irq = stacks
            .stacks()
            .iter()
            .find(|s| s.owner == StackOwner::Irq { cpu: cpu.cpu })
            .expect("IRQ stack");
        let on_irq_stack = irq.bounds.contains(&sp);
        let other = stacks.stacks().iter().find(|s| s.bounds.contains(&sp));
        if let (0, false, false, Some(other)) = (cpl, on_task_stack, on_irq_stack, other) {
            eprintln!("vCPU of CPU {} on another stack: {}", cpu.cpu, other.owner);
            let of_this_cpu = |s: &&KernelStack| match &s.owner {
                StackOwner::Task { task, .. } => *task == cpu.current || s.owner == other.owner,
                StackOwner::Irq { cpu: c } | StackOwner::Exception { cpu: c, .. } | StackOwner::Entry { cpu: c } => {
                    *c == cpu.cpu
                }
            };
            let narrowed: Vec<_> = stacks.stacks().iter().filter(of_this_cpu).collect();
            let read: Vec<_> = stacks_as_read.stacks().iter().filter(of_this_cpu).collect();
            assert_eq!(
                narrowed, read,
                "narrowing changed the stacks of a CPU on {}",
                other.owner
            );
            continue;
        }
        match cpl {
            0 if on_task_stack => {
                assert_eq!(running.extent, Extent::FromVcpuSp, "{running:?}");
                assert_eq!(running.scan.start, Gva(st.regs.rsp & !7), "{running:?}");
            }
            0 => {
                // In an interrupt, on the CPU's IRQ stack: it is scanned from rsp, and the
                // interrupted task from the stack pointer saved at the IRQ stack's top.
                assert!(on_irq_stack, "vCPU on neither stack: {st:?}");
                assert_eq!(
                    (irq.extent, irq.scan.start),
                    (Extent::FromVcpuSp, Gva(st.regs.rsp & !7))
                );
                let saved = mem.read_u64(Gva(irq.bounds.end.0 - 8)).expect("saved stack pointer");
                assert_eq!((running.extent, running.scan.start), (Extent::FromVcpuSp, Gva(saved)));
            }
            _ => assert_eq!(running.extent, Extent::UserMode, "{running:?}"),
        }
        for s in stacks.stacks() {
            if matches!(s.owner, StackOwner::Exception { cpu: c, .. } if c == cpu.cpu) {
                assert_eq!((s.extent, s.scan_len()), (Extent::Unused, 0), "{}", s.owner);
            }
        }
    }

    // The task count is the kernel's own: nr_threads counts the tasks on the lists (the
    // idle tasks excluded).
    let nr_threads = mem
        .read_u32(symbols.lookup("nr_threads").expect("nr_threads").addr)
        .expect("nr_threads") as usize;
    assert_eq!(
        counts.listed, nr_threads,
        "tasks on the lists vs the kernel's nr_threads"
    );
    assert!(counts.listed > 10, "only {} tasks", counts.listed);
    assert_eq!(
        counts.idle,
        usize::from(cpus),
        "one idle task per vCPU (CPU 0's is init_task)"
    );
    assert_eq!(
        task_stacks.len(),
        counts.listed + counts.idle + counts.unlisted - counts.without_stack
    );
    let unique: HashSet<_> = task_stacks
        .iter()
        .map(|s| match s.owner {
            StackOwner::Task { task, .. } => task,
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(unique.len(), task_stacks.len(), "a task listed twice");
    assert!(task_stacks
        .iter()
        .any(|s| matches!(&s.owner, StackOwner::Task { pid: 1, .. })));
    assert!(task_stacks
        .iter()
        .any(|s| matches!(&s.owner, StackOwner::Task { pid: 0, .. })));

    // Every CPU's IRQ and exception stacks.
    assert_eq!(stacks.cpus().len(), usize::from(cpus));
    let per_cpu: Vec<String> = stacks
        .stacks()
        .iter()
        .filter(|s| !matches!(s.owner, StackOwner::Task { .. }))
        .map(|s| s.owner.to_string())
        .collect();
    for cpu in 0..cpus {
        for what in [
            "IRQ stack",
            "DF exception stack",
            "NMI exception stack",
            "DB exception stack",
        ] {
            let name = format!("CPU {cpu}'s {what}");
            assert!(per_cpu.contains(&name), "{name} missing from {per_cpu:?}");
        }
        for what in ["MCE exception stack", "entry stack"] {
            let name = format!("CPU {cpu}'s {what}");
            assert!(per_cpu.contains(&name), "{name} missing from {per_cpu:?}");
        }
    }
    // The IRQ and the four IST stacks in use on every x86-64 kernel are mapped.
    for s in stacks.stacks() {
        let mapped = matches!(&s.owner, StackOwner::Irq { .. })
            || matches!(&s.owner, StackOwner::Exception { name, .. } if !name.starts_with("VC"));
        if mapped {
            let mut b = vec![0u8; (s.bounds.end.0 - s.bounds.start.0) as usize];
            mem.read_virt(s.bounds.start, &mut b)
                .unwrap_or_else(|e| panic!("{} at {:?} does not read: {e}", s.owner, s.bounds));
        }
    }

    // Every task that is switched out went through __schedule (context_switch, inlined
    // there, calls __switch_to_asm): its return address is on its stack, above its saved
    // stack pointer. A task that never ran would resume at ret_from_fork instead.
    let ret_from_fork = symbols.lookup("ret_from_fork").expect("ret_from_fork").addr;
    let with_hits: HashSet<usize> = hits.iter().map(|h| h.stack).collect();
    for (i, s) in stacks.stacks().iter().enumerate() {
        if s.extent != Extent::FromSavedSp {
            continue;
        }
        // inactive_task_frame: six saved registers, then the return address.
        let ret = mem.read_u64(Gva(s.scan.start.0 + 48)).expect("saved frame");
        assert!(
            with_hits.contains(&i) || ret == ret_from_fork.0,
            "{} is switched out but has no return address into __schedule; resumes at {ret:#x}",
            s.owner
        );
        assert!(
            schedule.contains(&Gva(ret)) || ret == ret_from_fork.0,
            "{}: its switch frame returns to {ret:#x} ({:?})",
            s.owner,
            symbols.describe(Gva(ret)).map(|d| d.to_string())
        );
    }
    assert!(
        hits.len() >= counts.listed / 2,
        "only {} hits in __schedule",
        hits.len()
    );
    for h in hits.iter().take(5) {
        eprintln!("  hit: {h}");
    }

    // Nothing is inside getppid while nothing calls it.
    let none = stacks.saved_addresses_in(&mem, getppid.clone()).expect("scan");
    assert!(
        none.is_empty(),
        "saved addresses in __x64_sys_getppid {getppid:?}: {none:#?}"
    );
}
