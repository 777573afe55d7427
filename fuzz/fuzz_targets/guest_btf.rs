//! Fuzzes BTF as read from guest memory (`hvprobe_introspection::btf`) and the layouts
//! taken from it (`TaskLayout`, `StacksLayout`).
//!
//! Input: `[mode] ...`. An even mode: the rest is a BTF blob. An odd mode: a valid blob is
//! built (a small `task_struct` with members inside nested anonymous structs and unions,
//! bitfields, typedefs, arrays, `cea_exception_stacks`, `rq`...) and the rest patches it:
//! `[offset: u16 LE] [len: u8] [bytes]`, past its end appending. Checked: no panic, and the
//! member searches, sizes and layouts stay within libFuzzer's `-timeout` and
//! `-rss_limit_mb` (issue 24 found a 3^depth member search here).
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_introspection::btf::{Btf, Kind};
use hvprobe_introspection::stacks::StacksLayout;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::task::TaskLayout;
use libfuzzer_sys::fuzz_target;

struct Builder {
    types: Vec<u8>,
    strings: Vec<u8>,
    next: u32,
}

impl Builder {
    fn str(&mut self, s: &str) -> u32 {
        if s.is_empty() {
            return 0;
        }
        let off = self.strings.len() as u32;
        self.strings.extend_from_slice(s.as_bytes());
        self.strings.push(0);
        off
    }

    fn raw(&mut self, name: &str, kind: u32, kflag: bool, vlen: u32, size_or_type: u32, tail: &[u32]) -> u32 {
        let name_off = self.str(name);
        let info = (kind << 24) | vlen | if kflag { 1 << 31 } else { 0 };
        for w in [name_off, info, size_or_type].iter().chain(tail) {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
        self.next += 1;
        self.next - 1
    }

    fn agg(&mut self, kind: u32, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
        let mut tail = Vec::new();
        for &(n, t, off) in members {
            tail.extend([self.str(n), t, off]);
        }
        self.raw(name, kind, false, members.len() as u32, size, &tail)
    }

    fn blob(&self) -> Vec<u8> {
        let mut b = vec![0x9f, 0xeb, 1, 0];
        for w in [
            24u32,
            0,
            self.types.len() as u32,
            self.types.len() as u32,
            self.strings.len() as u32,
        ] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&self.types);
        b.extend_from_slice(&self.strings);
        b
    }
}

fn baseline() -> Vec<u8> {
    let mut b = Builder {
        types: Vec::new(),
        strings: vec![0],
        next: 1,
    };
    let int = b.raw("int", 1, false, 0, 4, &[(1 << 24) | 32]);
    let long = b.raw("long", 1, false, 0, 8, &[(1 << 24) | 64]);
    let ch = b.raw("char", 1, false, 0, 1, &[8]);
    let pid_t = b.raw("pid_t", 8, false, 0, int, &[]);
    let cpid = b.raw("", 10, false, 0, pid_t, &[]);
    let comm = b.raw("", 3, false, 0, 0, &[ch, int, 16]);
    let ptr = b.raw("", 2, false, 0, 0, &[]);
    let list = b.agg(4, "list_head", 16, &[("next", ptr, 0), ("prev", ptr, 64)]);
    let thread = b.agg(4, "thread_struct", 16, &[("sp", long, 0), ("fsbase", long, 64)]);
    let anon_inner = b.agg(5, "", 8, &[("pid", cpid, 0), ("tgid", pid_t, 32)]);
    let anon = b.agg(4, "", 16, &[("", anon_inner, 0), ("on_cpu", int, 64)]);
    let sched = b.agg(4, "sched_entity", 16, &[("group_node", list, 0)]);
    b.agg(
        4,
        "task_struct",
        256,
        &[
            ("stack", ptr, 0),
            ("", anon, 64),
            ("tasks", list, 192),
            ("se", sched, 320),
            ("thread_node", list, 448),
            ("signal", ptr, 576),
            ("comm", comm, 640),
            ("thread", thread, 768),
        ],
    );
    b.agg(4, "signal_struct", 16, &[("thread_head", list, 0)]);
    b.agg(4, "rq", 64, &[("idle", ptr, 0), ("cfs_tasks", list, 64)]);
    b.agg(4, "irq_stack", 16384, &[("stack", comm, 0)]);
    let st = b.raw("", 3, false, 0, 0, &[ch, int, 4096]);
    b.agg(
        4,
        "cea_exception_stacks",
        32768,
        &[
            ("DF_stack", st, 8 * 4096),
            ("NMI_stack", st, 3 * 8 * 4096),
            ("DB_stack", st, 5 * 8 * 4096),
        ],
    );
    b.agg(4, "cpumask", 8, &[("bits", long, 0)]);
    b.blob()
}

fn symbols() -> SymbolTable {
    let names = [
        "__start_init_task",
        "__end_init_task",
        "init_task",
        "__per_cpu_offset",
        "nr_cpu_ids",
        "current_task",
        "runqueues",
        "hardirq_stack_ptr",
        "hardirq_stack_inuse",
        "cea_exception_stacks",
        "entry_stack_storage",
        "__cpu_possible_mask",
    ];
    let map: String = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let addr = match *n {
                "__end_init_task" => 0xffff_ffff_8200_4000u64,
                "__start_init_task" => 0xffff_ffff_8200_0000,
                _ => 0xffff_ffff_8300_0000 + 0x1000 * i as u64,
            };
            format!("{addr:016x} D {n}\n")
        })
        .collect();
    SymbolTable::parse_system_map(&map).expect("a valid System.map")
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let blob = if input.u8() & 1 == 0 {
        input.bytes(usize::MAX).to_vec()
    } else {
        let mut blob = baseline();
        while !input.is_empty() {
            let at = usize::from(input.u16());
            let len = usize::from(input.u8());
            let bytes = input.bytes(len);
            let end = at.saturating_add(bytes.len());
            if end > blob.len() {
                blob.resize(end, 0);
            }
            blob[at..end].copy_from_slice(bytes);
        }
        blob
    };
    let Ok(btf) = Btf::parse(&blob) else { return };
    for (id, t) in btf.types() {
        let _ = btf.type_size(id);
        let _ = btf.type_name(id);
        if matches!(t.kind, Kind::Struct | Kind::Union) {
            for m in ["comm", "pid", "thread.sp", "se.group_node", "nope"] {
                let _ = btf.member_path(id, "?", m);
            }
        }
    }
    let _ = TaskLayout::from_btf(&btf);
    let _ = StacksLayout::from_btf(&btf, &symbols());
});
