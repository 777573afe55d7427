//! Fuzzes the kernel facts probes are checked against, all read from guest memory at
//! bounds the guest's own symbols give in kallsyms mode: the exception table, the kprobe
//! blacklist (the `_kprobe_blacklist` array and the live `kprobe_blacklist` list), and the
//! patch-site tables (`__jump_table`, `.static_call_sites`).
//!
//! Valid tables are built; the input gives `[ex_table entries: u16] [blacklist array
//! entries: u16] [jump table entries: u16] [static call sites: u16] [address flips: u8]`
//! (the `__stop_*` symbols move accordingly, and a flip puts a table at the top of the
//! address space), then patches (see `guest_common.rs`; regions: each table, the live
//! list's entries, kernel text). Checked: no panic, everything within libFuzzer's
//! `-timeout` and `-rss_limit_mb`, and lookups agree with the lists.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::Gva;
use hvprobe_introspection::facts::{ExceptionTable, KprobeBlacklist, TextBounds};
use hvprobe_introspection::memory::SparseMemory;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::engine::PatchSites;
use libfuzzer_sys::fuzz_target;

const TEXT: u64 = 0xffff_ffff_8100_0000;
const ETEXT: u64 = TEXT + 0x10_0000;
const EX_TABLE: u64 = 0xffff_ffff_8220_0000;
const BLACKLIST: u64 = 0xffff_ffff_8230_0000;
const LIST_HEAD: u64 = 0xffff_ffff_8240_0000;
const ENTRIES: u64 = 0xffff_8880_0300_0000;
const JUMP_TABLE: u64 = 0xffff_ffff_8250_0000;
const STATIC_CALLS: u64 = 0xffff_ffff_8260_0000;
const TOP: u64 = 0xffff_ffff_ffff_f000;

fn function(i: u64) -> u64 {
    TEXT + 0x100 * i
}

fn rel32(at: u64, to: u64) -> u32 {
    to.wrapping_sub(at) as i32 as u32
}

fn build(mem: &mut SparseMemory) {
    mem.write(TEXT, &vec![0x90; 0x1000]);
    for i in 0..4u64 {
        // Exception table: insn, fixup (relative), data.
        let e = EX_TABLE + 12 * i;
        mem.put_u32(e, rel32(e, function(i) + 5));
        mem.put_u32(e + 4, rel32(e + 4, function(i) + 0x40));
        mem.put_u32(e + 8, 3);
        // The blacklist array: absolute addresses.
        mem.put_u64(BLACKLIST + 8 * i, function(i));
        // The live list: list_head, start, end.
        let n = ENTRIES + 32 * i;
        mem.put_u64(n, if i == 3 { LIST_HEAD } else { n + 32 });
        mem.put_u64(n + 8, if i == 0 { LIST_HEAD } else { n - 32 });
        mem.put_u64(n + 16, function(i));
        mem.put_u64(n + 24, function(i) + 0x80);
        // Jump labels: code, target, key (relative); 5-byte nops at the sites.
        let j = JUMP_TABLE + 16 * i;
        mem.put_u32(j, rel32(j, function(i) + 0x10));
        mem.put_u32(j + 4, rel32(j + 4, function(i) + 0x20));
        mem.write(function(i) + 0x10, &[0x0f, 0x1f, 0x44, 0x00, 0x00]);
        // Static calls: addr, key.
        let s = STATIC_CALLS + 8 * i;
        mem.put_u32(s, rel32(s, function(i) + 0x30));
    }
    mem.put_u64(LIST_HEAD, ENTRIES);
}

fn symbols(lens: [u64; 4], flips: u8) -> SymbolTable {
    let at = |base: u64, bit: u8| if flips & (1 << bit) != 0 { TOP } else { base };
    let (ex, bl, jt, sc) = (
        at(EX_TABLE, 0),
        at(BLACKLIST, 1),
        at(JUMP_TABLE, 2),
        at(STATIC_CALLS, 3),
    );
    let mut syms = vec![
        (TEXT, 'T', "_stext".to_string()),
        (ETEXT, 'T', "_etext".to_string()),
        (ex, 'D', "__start___ex_table".to_string()),
        (ex.wrapping_add(12 * lens[0]), 'D', "__stop___ex_table".to_string()),
        (bl, 'D', "__start_kprobe_blacklist".to_string()),
        (bl.wrapping_add(8 * lens[1]), 'D', "__stop_kprobe_blacklist".to_string()),
        (LIST_HEAD, 'D', "kprobe_blacklist".to_string()),
        (jt, 'D', "__start___jump_table".to_string()),
        (jt.wrapping_add(16 * lens[2]), 'D', "__stop___jump_table".to_string()),
        (sc, 'D', "__start_static_call_sites".to_string()),
        (
            sc.wrapping_add(8 * lens[3]),
            'D',
            "__stop_static_call_sites".to_string(),
        ),
    ];
    for i in 0..6u64 {
        syms.push((function(i), 't', format!("f{i}")));
        syms.push((function(i) + 0x60, 't', format!("f{i}.cold")));
    }
    let map: String = syms.iter().map(|(a, k, n)| format!("{a:016x} {k} {n}\n")).collect();
    SymbolTable::parse_system_map(&map).expect("a valid System.map")
}

fuzz_target!(|data: &[u8]| {
    let mut mem = SparseMemory::new();
    build(&mut mem);
    let mut input = Input::new(data);
    // 0 keeps the built table's length; otherwise the guest's own (up to 64 Ki entries).
    let mut lens = [4u64; 4];
    for l in &mut lens {
        let v = input.u16();
        if v != 0 {
            *l = u64::from(v);
        }
    }
    let flips = input.u8();
    input.patch(
        &mut mem,
        &[
            EX_TABLE,
            BLACKLIST,
            LIST_HEAD,
            ENTRIES,
            JUMP_TABLE,
            STATIC_CALLS,
            TEXT,
            TOP,
        ],
    );
    let syms = symbols(lens, flips);
    let _ = TextBounds::read(&syms);
    if let Ok(ex) = ExceptionTable::read(&mem, &syms) {
        for e in ex.entries() {
            assert!(ex.lookup(e.insn).is_some());
        }
        let _ = ex.in_range(Gva(TEXT)..Gva(ETEXT));
    }
    for list in [
        KprobeBlacklist::read(&mem, &syms),
        KprobeBlacklist::read_live(&mem, &syms),
    ] {
        let Ok(list) = list else { continue };
        for (range, _) in list.symbols() {
            if range.start < range.end {
                assert!(list.is_blacklisted(range.start).is_some(), "{range:?}");
            }
        }
        for i in 0..6 {
            let _ = list.is_blacklisted(Gva(function(i) + 0x61));
        }
    }
    if let Ok(sites) = PatchSites::read(&mem, &syms) {
        for i in 0..6 {
            let _ = sites.containing(Gva(function(i) + 0x12));
        }
    }
});
