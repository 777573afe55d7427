//! Fuzzes the module list reader (`hvprobe_introspection::modules`) over guest memory a
//! hostile kernel controls.
//!
//! A valid guest with three modules (each with kallsyms, ORC tables and a kprobe
//! blacklist, laid out as Linux 6.1 lays them out; `modules::synthetic`) is patched by the
//! input (see `guest_common.rs`; regions: the list head, each module's core layout and its
//! `struct module`). Checked: the reader never panics, stays within its budget
//! (libFuzzer's `-timeout` and `-rss_limit_mb` catch the rest), and what it returns is
//! consistent: at most the budget's modules, each name escaped (printable ASCII only),
//! each symbol inside the address space with a name of 1..=4 × 512 bytes, and what each
//! module's names take on the host charged to its decoded bytes, which stay within the
//! budget's (per module, and for the list). The decoded budget is small here (32 KiB a
//! module, 64 KiB the list) so that inputs reach it: a few dozen symbols naming one long
//! unprintable string (the seeds `seed-decoded-*`, from `make_seeds.py`).
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::Gva;
use hvprobe_introspection::btf::Btf;
use hvprobe_introspection::modules::synthetic::{self, MODULES_HEAD, MODULE_BASE, MODULE_STRIDE, STRUCT_MODULE};
use hvprobe_introspection::modules::{read_module, read_modules, ModuleBudget, ModuleLayout};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let layout = ModuleLayout::from_btf(&Btf::parse(&synthetic::btf()).expect("synthetic BTF")).expect("layout");
    let mut mem = synthetic::memory(&["alpha", "beta", "gamma"]);
    let mut input = Input::new(data);
    let budget = ModuleBudget {
        max_modules: 64,
        max_symbols: 4096,
        max_strtab: 1 << 20,
        max_orc_entries: 1 << 16,
        max_blacklist: 4096,
        max_total_bytes: 16 << 20,
        max_decoded: 32 << 10,
        max_total_decoded: 64 << 10,
    };
    let mut bases = vec![MODULES_HEAD];
    for i in 0..3 {
        let base = MODULE_BASE + i * MODULE_STRIDE;
        bases.extend([base, base + STRUCT_MODULE]);
    }
    input.patch(&mut mem, &bases);
    if let Ok(modules) = read_modules(&mem, &layout, Gva(MODULES_HEAD), &budget) {
        assert!(modules.len() <= budget.max_modules);
        let mut decoded = 0u64;
        for m in &modules {
            assert!(m.name.bytes().all(|b| (0x21..0x7f).contains(&b)), "{:?}", m.name);
            assert!(m.core.start <= m.core.end);
            let mut names = m.name.len() as u64;
            for s in m.symbols.symbols() {
                assert!(!s.name.is_empty() && s.name.len() <= 4 * 512);
                names += 2 * s.name.len() as u64;
            }
            assert!(names <= m.decoded_bytes, "{names} bytes of names, {} charged", m.decoded_bytes);
            assert!(m.decoded_bytes <= budget.max_decoded);
            decoded += m.decoded_bytes;
        }
        assert!(decoded <= budget.max_total_decoded);
    }
    for i in 0..3 {
        let _ = read_module(&mem, &layout, Gva(MODULE_BASE + i * MODULE_STRIDE + STRUCT_MODULE), &budget);
    }
});
