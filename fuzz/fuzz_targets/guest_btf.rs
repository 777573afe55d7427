//! Fuzzes BTF as read from guest memory (`hvprobe_introspection::btf`) and the layouts
//! taken from it (`TaskLayout`, `StacksLayout`).
//!
//! Input: `[mode] ...`. An even mode: the rest is a BTF blob. An odd mode: a valid blob is
//! built (a small `task_struct` with members inside nested anonymous structs and unions,
//! bitfields, typedefs, arrays, `cea_exception_stacks`, `rq`...) and the rest patches it:
//! `[offset: u16 LE] [len: u8] [bytes]`, past its end appending. Checked: no panic, and the
//! member searches, sizes and layouts stay within libFuzzer's `-timeout` and
//! `-rss_limit_mb` (a 3^depth member search was found here once).
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_introspection::btf::builder::Builder;
use hvprobe_introspection::btf::{Btf, Kind};
use hvprobe_introspection::stacks::StacksLayout;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::task::TaskLayout;
use libfuzzer_sys::fuzz_target;

/// Structs and unions with (name, type, bit offset) members.
fn agg(b: &mut Builder, kind: u32, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
    let members: Vec<(&str, u32, u32, u32)> = members.iter().map(|&(n, t, off)| (n, t, off, 0)).collect();
    b.aggregate(kind, name, size, false, &members)
}

fn baseline() -> Vec<u8> {
    let mut b = Builder::new();
    let int = b.raw("int", 1, false, 0, 4, &[(1 << 24) | 32]);
    let long = b.raw("long", 1, false, 0, 8, &[(1 << 24) | 64]);
    let ch = b.raw("char", 1, false, 0, 1, &[8]);
    let pid_t = b.raw("pid_t", 8, false, 0, int, &[]);
    let cpid = b.raw("", 10, false, 0, pid_t, &[]);
    let comm = b.raw("", 3, false, 0, 0, &[ch, int, 16]);
    let ptr = b.raw("", 2, false, 0, 0, &[]);
    let list = agg(&mut b, 4, "list_head", 16, &[("next", ptr, 0), ("prev", ptr, 64)]);
    let thread = agg(&mut b, 4, "thread_struct", 16, &[("sp", long, 0), ("fsbase", long, 64)]);
    let anon_inner = agg(&mut b, 5, "", 8, &[("pid", cpid, 0), ("tgid", pid_t, 32)]);
    let anon = agg(&mut b, 4, "", 16, &[("", anon_inner, 0), ("on_cpu", int, 64)]);
    let sched = agg(&mut b, 4, "sched_entity", 16, &[("group_node", list, 0)]);
    agg(
        &mut b,
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
    agg(&mut b, 4, "signal_struct", 16, &[("thread_head", list, 0)]);
    agg(&mut b, 4, "rq", 64, &[("idle", ptr, 0), ("cfs_tasks", list, 64)]);
    agg(&mut b, 4, "irq_stack", 16384, &[("stack", comm, 0)]);
    let st = b.raw("", 3, false, 0, 0, &[ch, int, 4096]);
    agg(
        &mut b,
        4,
        "cea_exception_stacks",
        32768,
        &[
            ("DF_stack", st, 8 * 4096),
            ("NMI_stack", st, 3 * 8 * 4096),
            ("DB_stack", st, 5 * 8 * 4096),
        ],
    );
    agg(&mut b, 4, "cpumask", 8, &[("bits", long, 0)]);
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
