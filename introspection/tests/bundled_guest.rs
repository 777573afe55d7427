//! Introspection against the bundled guest's kernel files (vmlinux, System.map): the BTF
//! layout of `task_struct`, `init_task` read from the vmlinux as from guest memory, the ELF
//! image reader, the kernel facts (text bounds, exception table, kprobe blacklist), and the
//! symbol sources (System.map, ELF symbols, kallsyms decoded offline and through page walks).
//!
//! These need the bundled guest: `guest/build.sh` prints its directory, building it first
//! (minutes) when its cache entry is missing. A missing guest, or a missing `pahole` (which
//! the guest's build needs as well), fails the test with the reason; nothing is skipped.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use goblin::elf::Elf;
use hvprobe_arch::Gva;
use hvprobe_introspection::btf::Btf;
use hvprobe_introspection::facts::{BlacklistReason, KernelFacts, KprobeBlacklist};
use hvprobe_introspection::memory::{ElfImage, GuestVirtRead, MemoryError, PagedGuestMemory};
use hvprobe_introspection::stacks::{Extent, KernelStacks, StackOwner, StacksLayout, ThreadLinks};
use hvprobe_introspection::symbols::{KallsymsLayout, Symbol, SymbolError, SymbolSource, SymbolTable};
use hvprobe_introspection::task::{current_task, task_info, TaskError, TaskInfo, TaskLayout};

/// The bundled guest's artefact directory (`guest/build.sh`, last stdout line).
fn bundled_guest_dir() -> PathBuf {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guest/build.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        if !out.status.success() {
            return Err(format!("{} failed with {}", script.display(), out.status));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
        if dir.is_empty() {
            return Err(format!("{} printed no artefact directory", script.display()));
        }
        Ok(PathBuf::from(dir))
    })
    .clone()
    .unwrap_or_else(|e| panic!("these tests read the bundled guest's kernel, which is unavailable: {e}"))
}

/// The bundled guest's vmlinux bytes.
fn vmlinux_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let path = bundled_guest_dir().join("vmlinux");
        std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    })
}

/// The contents of the named ELF section of the bundled vmlinux.
fn vmlinux_section(name: &str) -> &'static [u8] {
    let bytes = vmlinux_bytes();
    let elf = Elf::parse(bytes).expect("bundled vmlinux is not ELF");
    let sh = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(name))
        .unwrap_or_else(|| panic!("bundled vmlinux has no {name} section (built without CONFIG_DEBUG_INFO_BTF?)"));
    &bytes[sh.sh_offset as usize..(sh.sh_offset + sh.sh_size) as usize]
}

/// Address of `name` in the bundled guest's System.map.
fn system_map_symbol(name: &str) -> u64 {
    let path = bundled_guest_dir().join("System.map");
    let map = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    map.lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (addr, _ty, sym) = (f.next()?, f.next()?, f.next()?);
            (sym == name).then(|| u64::from_str_radix(addr, 16).ok()).flatten()
        })
        .unwrap_or_else(|| panic!("{name} not in {}", path.display()))
}

// --- BTF ---

/// Top-level members of `task_struct` with byte offset and size as pahole prints them
/// from the same vmlinux: an independent reading of the same BTF.
/// `pahole` is a build dependency of the guest (`CONFIG_DEBUG_INFO_BTF`), so it is here.
fn pahole_task_struct(vmlinux: &std::path::Path) -> Vec<(String, u64, u64)> {
    let out = Command::new("pahole")
        .args(["-F", "btf", "-C", "task_struct"])
        .arg(vmlinux)
        .output()
        .unwrap_or_else(|e| panic!("cannot run pahole (install dwarves, as guest/install-deps.sh does): {e}"));
    assert!(
        out.status.success(),
        "pahole failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = Vec::new();
    for line in text.lines() {
        // "\tpid_t                      pid;                  /*  1234     4 */"
        let Some(rest) = line.strip_prefix('\t') else { continue };
        if rest.starts_with(['\t', ' ', '/', '}']) {
            continue; // nested member, comment or end of a nested block
        }
        let (Some(semi), Some(c)) = (rest.find(';'), rest.find("/*")) else {
            continue;
        };
        let decl = rest[..semi].trim();
        let comment = rest[c + 2..].trim_end_matches("*/").trim();
        if decl.contains(':') || decl.contains('(') || comment.contains(':') {
            continue; // bitfields and function pointers
        }
        let name = decl.rsplit([' ', '*']).next().unwrap_or("");
        let name = name.split('[').next().unwrap_or("").to_string();
        let nums: Vec<u64> = comment.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        if let [off, size] = nums[..] {
            fields.push((name, off, size));
        }
    }
    fields
}

#[test]
fn bundled_guest_btf_task_struct_layout() {
    let btf = Btf::parse(vmlinux_section(".BTF")).expect("bundled guest .BTF");
    assert!(btf.len() > 1000, "only {} types", btf.len());
    let task = btf.find_struct("task_struct").unwrap();
    let size = btf.type_size(task).unwrap();
    let comm = btf.member_offset("task_struct", "comm").unwrap();
    let pid = btf.member_offset("task_struct", "pid").unwrap();
    let tgid = btf.member_offset("task_struct", "tgid").unwrap();
    eprintln!(
        "bundled guest: {} BTF types, task_struct {size} B, comm {comm:?}, pid {pid:?}, tgid {tgid:?}",
        btf.len()
    );
    assert_eq!(comm.size, 16, "TASK_COMM_LEN");
    assert_eq!((pid.size, tgid.size), (4, 4), "pid_t is int");
    // include/linux/sched.h: `pid_t pid; pid_t tgid;` are adjacent, and comm comes
    // much later (after the credentials); all inside the struct.
    assert_eq!(tgid.offset, pid.offset + 4);
    assert!(comm.offset > pid.offset);
    assert!(comm.offset + comm.size <= size && pid.offset < size);
    // x86 thread_info (flags, syscall_work, status, cpu: 24 bytes) comes first, then
    // the scheduler state word.
    assert_eq!(btf.member_offset("task_struct", "thread_info").unwrap().offset, 0);
    assert_eq!(btf.member_offset("task_struct", "__state").unwrap().offset, 24);
    assert_eq!(btf.type_name(btf.resolve(pid.type_id).unwrap()).unwrap(), "int");

    let vmlinux = bundled_guest_dir().join("vmlinux");
    let fields = pahole_task_struct(&vmlinux);
    assert!(fields.len() > 50, "pahole gave only {} members", fields.len());
    for (name, off, sz) in &fields {
        let m = btf.member_offset("task_struct", name).unwrap();
        assert_eq!((m.offset, m.size), (*off, *sz), "task_struct.{name}: ours vs pahole");
    }
    assert!(fields.iter().any(|(n, _, _)| n == "comm"));
}

// --- task_struct ---

fn bundled_layout() -> TaskLayout {
    let btf = Btf::parse(vmlinux_section(".BTF")).expect("bundled guest .BTF");
    TaskLayout::from_btf(&btf).expect("task layout")
}

#[test]
fn bundled_guest_layout_is_plausible() {
    let l = bundled_layout();
    eprintln!("bundled guest task layout: {l:?}");
    assert_eq!(l.comm_len, 16);
    assert_eq!(l.tgid_offset, l.pid_offset + 4);
    assert!(l.comm_offset > l.pid_offset);
    assert!(l.comm_offset + l.comm_len <= l.task_struct_size);
}

/// init_task is a static task_struct in .data (INIT_TASK_COMM "swapper", pid 0), and the
/// boot CPU's initial per-CPU copy (at __per_cpu_load) has current_task = &init_task:
/// the same reads as on a live guest, against the vmlinux file.
#[test]
fn init_task_from_vmlinux_file() {
    let reader = ElfImage::from_bytes(vmlinux_bytes().to_vec()).expect("bundled vmlinux");
    let layout = bundled_layout();
    let init_task = Gva(system_map_symbol("init_task"));
    let info = task_info(&reader, &layout, init_task).unwrap();
    assert_eq!(
        info,
        TaskInfo {
            address: init_task,
            comm: "swapper".into(),
            pid: 0,
            tgid: 0
        }
    );

    let per_cpu_load = system_map_symbol("__per_cpu_load");
    let current_task_offset = system_map_symbol("current_task");
    assert!(current_task_offset < 0x10_0000, "current_task is a per-CPU offset");
    assert_eq!(
        current_task(&reader, per_cpu_load, current_task_offset).unwrap(),
        init_task
    );

    // The loaded copy of .BTF gives the same layout as the section in the file.
    let bounds = (
        Gva(system_map_symbol("__start_BTF")),
        Gva(system_map_symbol("__stop_BTF")),
    );
    assert_eq!(TaskLayout::from_guest(&reader, Some(bounds)).unwrap(), layout);
    assert_eq!(
        TaskLayout::from_guest(&reader, None).unwrap_err(),
        TaskError::CommUnavailable
    );
}

// --- ELF image ---

#[test]
fn elf_image_reads_text_rodata_and_zero_bss() {
    let dir = bundled_guest_dir();
    let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux parses");
    // `_text` is where the first PT_LOAD starts; its bytes come from the file.
    let ranges = img.mapped_ranges();
    assert!(
        ranges.iter().any(|r| r.start == Gva(0xffff_ffff_8100_0000)),
        "{ranges:x?}"
    );
    let mut head = [0u8; 16];
    img.read_virt(Gva(0xffff_ffff_8100_0000), &mut head)
        .expect("text is mapped");
    assert_ne!(head, [0u8; 16]);
    // Every range reads to its last byte; the byte after it does not (ranges are
    // separated by gaps in this kernel).
    for r in &ranges {
        let mut b = [0u8; 1];
        img.read_virt(Gva(r.end.0 - 1), &mut b).expect("last byte");
        assert!(img.read_virt(r.end, &mut b).is_err() || ranges.iter().any(|o| o.start == r.end));
    }
    // Nothing is mapped in the low half: the per-CPU template was moved to its load address.
    assert!(ranges.iter().all(|r| r.start.0 >= 1 << 63), "{ranges:x?}");
    // The last segment ends in .bss/.brk, which has no file bytes and reads as zeros.
    let last = ranges.last().expect("segments");
    let mut tail = vec![0xffu8; 0x1000];
    img.read_virt(Gva(last.end.0 - 0x1000), &mut tail).expect("bss");
    assert!(tail.iter().all(|&b| b == 0));
}

// --- kernel stacks ---

/// The stacks layout from the bundled guest's BTF and ELF symbols: task_struct offsets as
/// pahole reads them, the x86-64 stack sizes, and a walk of the vmlinux file's own data,
/// where before boot the only task is init_task on init_stack and no CPU is possible yet.
#[test]
fn stacks_layout_and_the_boot_tasks_stack_from_the_vmlinux_file() {
    let (img, syms, _) = guest();
    let btf = Btf::parse(vmlinux_section(".BTF")).expect("bundled guest .BTF");
    let layout = StacksLayout::from_btf(&btf, syms).expect("stacks layout");
    eprintln!("bundled guest stacks layout: {layout:#?}");

    let fields = pahole_task_struct(&bundled_guest_dir().join("vmlinux"));
    let pahole = |name: &str| {
        fields
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("pahole shows no task_struct.{name}"))
            .1
    };
    assert_eq!(layout.task_stack, pahole("stack"));
    assert_eq!(layout.task_tasks, pahole("tasks"));
    assert_eq!(layout.task_on_cpu, Some(pahole("on_cpu")));
    assert_eq!(
        layout.threads,
        ThreadLinks::SignalThreadHead {
            signal: pahole("signal"),
            thread_head: btf.member_offset("signal_struct", "thread_head").unwrap().offset,
            thread_node: pahole("thread_node"),
        }
    );
    assert!(layout.task_thread_sp < layout.task.task_struct_size);
    assert_eq!(layout.thread_size, 16 << 10, "THREAD_SIZE without KASAN");
    assert_eq!(layout.irq.size, 16 << 10, "IRQ_STACK_SIZE without KASAN");
    assert!(layout.irq.inuse.is_some(), "6.1 has hardirq_stack_inuse");
    let names: Vec<&str> = layout.exception.stacks.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["DF", "NMI", "DB", "MCE", "VC", "VC2"]);
    assert!(layout
        .exception
        .stacks
        .iter()
        .all(|s| s.size == 8192 && s.offset % 4096 == 0));
    assert_eq!(layout.entry_stack.map(|(_, size)| size), Some(4096));
    assert!(layout.rq_cfs_tasks.is_some() && layout.task_se_group_node.is_some());

    let stacks = KernelStacks::read(img, &layout).expect("stacks of the vmlinux file");
    assert!(stacks.cpus().is_empty(), "no CPU is possible before boot");
    let [only] = stacks.stacks() else {
        panic!("expected init_task's stack alone: {:#?}", stacks.stacks())
    };
    let init_stack = Gva(system_map_symbol("init_stack"));
    assert_eq!(only.bounds, init_stack..Gva(system_map_symbol("__end_init_task")));
    assert!(matches!(&only.owner, StackOwner::Task { pid: 0, comm, .. } if comm == "swapper"));
    assert_ne!(only.extent, Extent::Unused);
}

// --- kernel facts ---

fn guest() -> &'static (ElfImage, SymbolTable, KernelFacts) {
    static G: OnceLock<(ElfImage, SymbolTable, KernelFacts)> = OnceLock::new();
    G.get_or_init(|| {
        let dir = bundled_guest_dir();
        let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
        let syms = SymbolTable::parse_elf(img.file_bytes()).expect("ELF symbols");
        let facts = KernelFacts::read(&img, &syms).expect("facts");
        (img, syms, facts)
    })
}

#[test]
fn text_bounds_come_from_the_linker_symbols() {
    let (_, syms, facts) = guest();
    assert_eq!(facts.text.text.start, syms.lookup("_stext").expect("_stext").addr);
    assert!(facts.text.text.end.0 - facts.text.text.start.0 > 1 << 20);
    let init = facts.text.init_text.as_ref().expect("init text");
    assert!(init.start >= facts.text.text.end);
    let vfs_read = syms.lookup("vfs_read").expect("vfs_read").addr;
    assert!(facts.text.contains(vfs_read));
    assert!(!facts.text.contains(syms.lookup("_sdata").expect("_sdata").addr));
}

#[test]
fn exception_table_entries_point_into_text() {
    let (_, syms, facts) = guest();
    let ex = &facts.ex_table;
    let fixups_in_text = ex.entries().iter().filter(|e| facts.text.contains(e.fixup)).count();
    println!(
        "exception table: {} entries, {fixups_in_text} fixups inside kernel text",
        ex.len()
    );
    assert!(ex.len() > 100, "only {} entries", ex.len());
    for e in ex.entries() {
        assert!(facts.text.contains(e.insn), "{e:x?} outside text");
        assert!(e.fixup_type() <= 20, "{e:x?}: unknown EX_TYPE");
    }
    assert_eq!(fixups_in_text, ex.len());
    // Lookups find each entry and nothing in between.
    let first = ex.entries()[0];
    assert_eq!(ex.lookup(first.insn), Some(&first));
    assert_eq!(ex.lookup(Gva(first.insn.0 - 1)), None);
    assert_eq!(
        ex.in_range(facts.text.text.clone()).len()
            + ex.in_range(Gva(0)..facts.text.text.start).len()
            + ex.in_range(facts.text.text.end..Gva(u64::MAX)).len(),
        ex.len()
    );
    // The user-copy helpers are the classic exception-table users.
    let copy = syms
        .lookup("copy_user_generic_unrolled")
        .or_else(|| syms.lookup("rep_movs_alternative"))
        .expect("the kernel has a user-copy helper (copy_user_generic_unrolled or rep_movs_alternative)");
    let size = syms.size_of(copy).expect("sized");
    assert!(
        !ex.in_range(copy.addr..Gva(copy.addr.0 + size)).is_empty(),
        "{} has no extable entries",
        copy.name
    );
}

#[test]
fn the_guest_blacklist_matches_nokprobe_symbol() {
    let (_, syms, facts) = guest();
    let bl = &facts.blacklist;
    println!(
        "kprobe blacklist: {} NOKPROBE_SYMBOL functions, sections {:x?}",
        bl.symbols().len(),
        bl.sections()
    );
    for name in ["do_int3", "kprobe_int3_handler", "exc_int3", "dump_kprobe"] {
        let s = syms.lookup(name).unwrap_or_else(|| panic!("{name} exists"));
        let reason = bl
            .is_blacklisted(s.addr)
            .unwrap_or_else(|| panic!("{name} not blacklisted"));
        let inside = Gva(s.addr.0 + 1);
        assert!(bl.is_blacklisted(inside).is_some(), "{name}+1");
        println!("{name}: {reason}");
    }
    for name in ["vfs_read", "do_sys_open", "schedule_timeout"] {
        let s = syms.lookup(name).unwrap_or_else(|| panic!("{name} exists"));
        assert_eq!(bl.is_blacklisted(s.addr), None, "{name}");
    }
    // Entry code is blacklisted by section.
    let entry = syms.lookup("entry_SYSCALL_64").expect("entry_SYSCALL_64");
    assert!(matches!(
        bl.is_blacklisted(entry.addr),
        Some(BlacklistReason::Section {
            section: ".entry.text",
            ..
        })
    ));
    // noinstr functions too.
    let noinstr = syms.lookup("__noinstr_text_start").expect("noinstr").addr;
    assert!(matches!(
        bl.is_blacklisted(noinstr),
        Some(BlacklistReason::Section {
            section: ".noinstr.text",
            ..
        })
    ));
    assert!(bl.symbols().len() > 20);
}

#[test]
fn facts_from_kallsyms_equal_facts_from_the_elf() {
    let (img, _, facts) = guest();
    let text = facts.text.text.start;
    let ks = SymbolTable::from_kallsyms(img, text..Gva(text.0 + (48 << 20))).expect("kallsyms");
    assert_eq!(ks.source(), SymbolSource::Kallsyms);
    let from_ks = KernelFacts::read(img, &ks).expect("facts from kallsyms");
    assert_eq!(from_ks.text, facts.text);
    assert_eq!(from_ks.ex_table, facts.ex_table);
    // Kallsyms has no sizes, so ranges may differ, but the same functions are listed.
    let names = |b: &KprobeBlacklist| {
        let mut v: Vec<String> = b.symbols().iter().map(|(_, n)| n.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&from_ks.blacklist), names(&facts.blacklist));
}

// --- symbols and kallsyms ---

/// A memory image with some bytes replaced.
struct Patched<'a> {
    inner: &'a ElfImage,
    at: Gva,
    bytes: Vec<u8>,
}

impl GuestVirtRead for Patched<'_> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.inner.read_virt(gva, buf)?;
        for (i, b) in self.bytes.iter().enumerate() {
            if let Some(o) = (self.at.0 + i as u64)
                .checked_sub(gva.0)
                .filter(|&o| o < buf.len() as u64)
            {
                buf[o as usize] = *b;
            }
        }
        Ok(())
    }
}

fn guest_tables() -> (SymbolTable, SymbolTable) {
    let dir = bundled_guest_dir();
    let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map parses");
    let elf = SymbolTable::from_elf_file(dir.join("vmlinux")).expect("vmlinux symbols parse");
    (map, elf)
}

#[test]
fn system_map_and_elf_agree_on_functions() {
    let (map, elf) = guest_tables();
    assert_eq!(map.source(), SymbolSource::SystemMap);
    let mut checked = 0;
    for s in map.symbols().iter().filter(|s| s.is_text()) {
        assert!(
            elf.lookup_all(&s.name)
                .any(|e| e.addr == s.addr && e.kind.eq_ignore_ascii_case(&s.kind)),
            "{} {} {} from System.map is not in the ELF symbols",
            s.addr,
            s.kind,
            s.name
        );
        checked += 1;
    }
    assert!(checked > 10_000, "only {checked} text symbols");
    let vfs_read = elf.resolve("vfs_read").expect("vfs_read");
    assert_eq!(vfs_read.addr, map.resolve("vfs_read").expect("vfs_read").addr);
    let size = vfs_read.symbol.size.expect("functions have st_size");
    let mid = vfs_read.addr.checked_add(size / 2).expect("no overflow");
    // Printed as the kernel's `%pS` prints it (the size is the distance to the next
    // symbol, so both sources agree); the ELF size still bounds the code.
    let described = elf.describe(mid).expect("inside vfs_read");
    assert_eq!(described.size, size);
    assert_eq!(
        described.to_string(),
        map.describe(mid).expect("inside vfs_read").to_string()
    );
    assert!(
        described.to_string().starts_with(&format!("vfs_read+{:#x}/", size / 2)),
        "{described}"
    );
    println!(
        "checked {checked} text symbols; System.map has {}, ELF {}",
        map.len(),
        elf.len()
    );
}

#[test]
fn kallsyms_decoded_offline_matches_system_map() {
    let dir = bundled_guest_dir();
    let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
    let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map");
    let text = map.resolve("_text").expect("_text").addr;
    let search = text..Gva(text.0 + 48 * 1024 * 1024);

    let started = Instant::now();
    let layout = KallsymsLayout::locate(&img, search.clone()).expect("kallsyms located");
    let located = started.elapsed();
    let ks = SymbolTable::from_kallsyms_layout(&img, &layout).expect("kallsyms decodes");
    let total = started.elapsed();
    println!(
        "kallsyms: located (with a validating decode) in {located:?}, decoded again in {:?}: {} symbols \
         (System.map {}) {layout:x?}",
        total - located,
        ks.len(),
        map.len()
    );
    assert_eq!(ks.source(), SymbolSource::Kallsyms);

    // The tables are where the linker put them.
    for (name, at) in [
        ("kallsyms_token_table", layout.token_table),
        ("kallsyms_token_index", layout.token_index),
        ("kallsyms_names", layout.names),
        ("kallsyms_markers", layout.markers),
        ("kallsyms_num_syms", layout.num_syms_addr),
        ("kallsyms_relative_base", layout.relative_base_addr),
        ("kallsyms_offsets", layout.offsets),
    ] {
        assert_eq!(map.resolve(name).expect(name).addr, at, "{name}");
    }
    assert_eq!(
        layout.seqs_of_names,
        map.lookup("kallsyms_seqs_of_names").map(|s| s.addr)
    );

    // Every kallsyms symbol is in System.map at the same address, with the same type
    // (per-CPU symbols are typed 'A' by kallsyms and 'D'/'d' by System.map).
    let mut percpu = 0;
    for s in ks.symbols() {
        let m = map.lookup_all(&s.name).find(|m| m.addr == s.addr).unwrap_or_else(|| {
            panic!("kallsyms {} {} {} not in System.map", s.addr, s.kind, s.name);
        });
        if s.kind == 'A' && m.kind != 'A' {
            percpu += 1;
            // Below the kernel half of the address space (0xffff_8000_0000_0000).
            assert!(s.addr.0 < 0xffff_8000_0000_0000, "{s:?}");
        } else {
            assert_eq!(s.kind, m.kind, "{s:?} vs {m:?}");
        }
    }
    let ks_names: HashSet<&str> = ks.symbols().iter().map(|s| s.name.as_str()).collect();
    let missing: Vec<&Symbol> = map
        .symbols()
        .iter()
        .filter(|s| !ks_names.contains(s.name.as_str()))
        .collect();
    println!(
        "kallsyms {} symbols ({percpu} per-CPU typed 'A'); System.map {}; {} System.map names not in kallsyms: {:?}",
        ks.len(),
        map.len(),
        missing.len(),
        missing
            .iter()
            .map(|s| format!("{} {}", s.kind, s.name))
            .collect::<Vec<_>>()
    );
    assert!(ks.len() > 10_000 && ks.len() < map.len());
    assert!(percpu > 0);
    // What kallsyms leaves out is its own tables (they are added after its symbol
    // list is made) and absolute symbols; every function is there.
    let unexpected: Vec<_> = missing
        .iter()
        .filter(|s| s.is_text() && !s.name.starts_with("kallsyms_"))
        .map(|s| format!("{} {} {}", s.addr, s.kind, s.name))
        .collect();
    assert!(
        unexpected.is_empty(),
        "text symbols missing from kallsyms: {unexpected:?}"
    );
}

/// Guest RAM as one byte vector.
struct Ram(Vec<u8>);

impl hvprobe_arch::paging::PhysRead for Ram {
    fn read_phys(&self, gpa: hvprobe_arch::Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        let src = usize::try_from(gpa.0)
            .ok()
            .and_then(|start| self.0.get(start..start.checked_add(buf.len())?))
            .ok_or(hvprobe_arch::paging::PhysAccessError::NotMemory { gpa, len: buf.len() })?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn kallsyms_decodes_through_guest_page_tables() {
    use goblin::elf::program_header::PT_LOAD;
    use hvprobe_arch::paging::PagingMode;

    // Load vmlinux the way a boot loader does (segments at their physical addresses)
    // and map the kernel image the way head_64.S does, with 2 MiB pages, except the
    // first 2 MiB through a 4 KiB page table; then find kallsyms through the walk.
    let dir = bundled_guest_dir();
    let bytes = std::fs::read(dir.join("vmlinux")).expect("vmlinux");
    let elf = goblin::elf::Elf::parse(&bytes).expect("ELF");
    let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map");
    let image_end = elf
        .program_headers
        .iter()
        .filter(|p| p.p_type == PT_LOAD)
        .map(|p| p.p_paddr + p.p_memsz)
        .max()
        .expect("segments");
    let ram_len = (image_end + (4 << 20)) & !0x1f_ffff;
    let mut ram = vec![0u8; ram_len as usize];
    for p in elf.program_headers.iter().filter(|p| p.p_type == PT_LOAD) {
        let (dst, src) = (p.p_paddr as usize, p.p_offset as usize);
        ram[dst..dst + p.p_filesz as usize].copy_from_slice(&bytes[src..src + p.p_filesz as usize]);
    }
    let text = map.resolve("_text").expect("_text").addr;
    let phys_base = 0x100_0000u64;
    let (pml4, pdpt, pd, pt) = (0x10_0000u64, 0x10_1000u64, 0x10_2000u64, 0x10_3000u64);
    let mut put = |at: u64, v: u64| ram[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes());
    put(pml4 + ((text.0 >> 39) & 0x1ff) * 8, pdpt | 0x3);
    put(pdpt + ((text.0 >> 30) & 0x1ff) * 8, pd | 0x3);
    let pd_first = (text.0 >> 21) & 0x1ff;
    put(pd + pd_first * 8, pt | 0x3);
    for i in 0..512 {
        put(pt + i * 8, (phys_base + i * 0x1000) | 0x1); // read-only 4 KiB pages
    }
    let big_pages = (image_end - phys_base).div_ceil(0x20_0000);
    for i in 1..big_pages {
        put(pd + (pd_first + i) * 8, (phys_base + i * 0x20_0000) | 0x83);
    }
    let mem = PagedGuestMemory::new(Ram(ram), pml4, PagingMode::Level4);
    let t = mem.translate(text).expect("text mapped");
    assert_eq!(
        (t.gpa.0, t.page_size),
        (phys_base, hvprobe_arch::paging::PageSize::Size4K)
    );

    let started = Instant::now();
    let ks = SymbolTable::from_kallsyms(&mem, text..Gva(text.0 + (48 << 20))).expect("kallsyms via page walk");
    println!(
        "kallsyms through 4-level page walks: {} symbols in {:?}",
        ks.len(),
        started.elapsed()
    );
    let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
    let offline = SymbolTable::from_kallsyms(&img, text..Gva(text.0 + (48 << 20))).expect("kallsyms offline");
    assert_eq!(ks.symbols(), offline.symbols());
}

#[test]
fn kallsyms_search_fails_cleanly_where_there_is_none() {
    let dir = bundled_guest_dir();
    let img = ElfImage::open(dir.join("vmlinux")).expect("vmlinux");
    let map = SymbolTable::from_system_map_file(dir.join("System.map")).expect("System.map");
    let text = map.resolve("_stext").expect("_stext").addr;
    // Kernel text alone holds no token table.
    let etext = map.resolve("_etext").expect("_etext").addr;
    match SymbolTable::from_kallsyms(&img, text..etext) {
        Err(SymbolError::KallsymsNotFound { start, end, .. }) => assert_eq!((start, end), (text, etext)),
        other => panic!("expected KallsymsNotFound, got {:?}", other.map(|t| t.len())),
    }
    // An unmapped range.
    assert!(matches!(
        SymbolTable::from_kallsyms(&img, Gva(0x1000)..Gva(0x10_0000)),
        Err(SymbolError::KallsymsNotFound { .. })
    ));
    // A corrupted marker table is caught by validation, not decoded into garbage.
    let layout = KallsymsLayout::locate(&img, text..Gva(text.0 + 48 * 1024 * 1024)).expect("located");
    // The second marker claims symbol 256 starts at byte 1 of the names.
    let bad = Patched {
        inner: &img,
        at: Gva(layout.markers.0 + 4),
        bytes: 1u32.to_le_bytes().to_vec(),
    };
    assert!(matches!(layout.decode(&bad), Err(SymbolError::KallsymsInvalid { .. })));
}
