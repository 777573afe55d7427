//! Fuzzes the kallsyms search and decoder (`hvprobe_introspection::symbols::KallsymsLayout`)
//! over guest memory a hostile kernel controls.
//!
//! A valid set of tables (300 symbols, a token table with multi-byte tokens, markers,
//! sequence numbers, offsets) is laid out as `scripts/kallsyms.c` does, then the input
//! patches it (see `guest_common.rs`; regions: each table's start). Checked: the search
//! and a decode at the known layout never panic, stay within their budgets (libFuzzer's
//! `-timeout` and `-rss_limit_mb` catch the rest), and what decodes is consistent: as
//! many symbols as `kallsyms_num_syms`, sorted, each name 1..512 bytes.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::Gva;
use hvprobe_introspection::memory::SparseMemory;
use hvprobe_introspection::symbols::{KallsymsLayout, Symbol};
use libfuzzer_sys::fuzz_target;

const BASE: u64 = 0xffff_ffff_8100_0000;
const TABLES: u64 = BASE + (1 << 20);

fn align8(v: u64) -> u64 {
    (v + 7) & !7
}

fn tokens() -> Vec<Vec<u8>> {
    (0..256u32)
        .map(|i| match i {
            0x21..=0x7e => vec![i as u8],
            0x01 => b"_do_".to_vec(),
            0x02 => b"sys".to_vec(),
            0x03 => b"Tx".to_vec(),
            _ => format!("t{i:02x}").into_bytes(),
        })
        .collect()
}

/// The tables at `TABLES` (the token table), the rest below it; returns the layout.
fn build(mem: &mut SparseMemory) -> KallsymsLayout {
    let toks = tokens();
    let names: Vec<Vec<u8>> = (0..300u32)
        .map(|i| {
            let kind = if i % 7 == 0 { b'D' } else { b't' };
            let mut n = vec![kind, 0x01, 0x02];
            n.extend(format!("{i}").bytes());
            if i % 5 == 0 {
                n.push(0x03);
            }
            n
        })
        .collect();
    let mut table = Vec::new();
    let mut index = Vec::new();
    for t in &toks {
        index.extend_from_slice(&(table.len() as u16).to_le_bytes());
        table.extend_from_slice(t);
        table.push(0);
    }
    mem.write(TABLES, &table);
    let index_at = align8(TABLES + table.len() as u64);
    mem.write(index_at, &index);
    let n = names.len() as u64;
    let seqs = (TABLES - 3 * n) & !7;
    let markers = (seqs - 4 * n.div_ceil(256)) & !7;
    let mut blob = Vec::new();
    let mut marks = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if i % 256 == 0 {
            marks.extend_from_slice(&(blob.len() as u32).to_le_bytes());
        }
        blob.push(name.len() as u8);
        blob.extend_from_slice(name);
    }
    let names_at = markers - align8(blob.len() as u64);
    let a = names_at - 8;
    mem.write(names_at, &blob);
    mem.write(markers, &marks);
    let seq_bytes: Vec<u8> = (0..n as u32)
        .flat_map(|i| [(i >> 16) as u8, (i >> 8) as u8, i as u8])
        .collect();
    mem.write(seqs, &seq_bytes);
    mem.put_u32(a, n as u32);
    mem.put_u32(a + 4, 0);
    mem.put_u64(a - 8, BASE);
    let offsets = (a - 8 - 4 * n) & !7;
    let offs: Vec<u8> = (0..n as u32).flat_map(|i| (i * 32).to_le_bytes()).collect();
    mem.write(offsets, &offs);
    KallsymsLayout {
        offsets: Gva(offsets),
        relative_base_addr: Gva(a - 8),
        relative_base: BASE,
        num_syms_addr: Gva(a),
        num_syms: n as u32,
        names: Gva(names_at),
        markers: Gva(markers),
        seqs_of_names: Some(Gva(seqs)),
        token_table: Gva(TABLES),
        token_index: Gva(index_at),
        absolute_percpu: false,
    }
}

fn check(layout: &KallsymsLayout, symbols: &[Symbol]) {
    assert_eq!(symbols.len(), layout.num_syms as usize);
    assert!(symbols.windows(2).all(|w| w[0].addr <= w[1].addr), "sorted");
    assert!(symbols.iter().all(|s| !s.name.is_empty() && s.name.len() < 512));
}

fuzz_target!(|data: &[u8]| {
    let mut mem = SparseMemory::new();
    let layout = build(&mut mem);
    let mut input = Input::new(data);
    // How far below the token table the search starts and how far above it it ends (up
    // to 64 KiB each: the built tables take ~8 KiB below it; near enough for a fast
    // fuzzer, the crate's budget tests cover 64 MiB spans).
    let below = u64::from(input.u16() & 0x3ff) << 6;
    let above = u64::from(input.u8()) << 8;
    let bases = [
        layout.token_table.0,
        layout.token_index.0,
        layout.names.0,
        layout.markers.0,
        layout.seqs_of_names.map_or(0, |g| g.0),
        layout.offsets.0,
        layout.num_syms_addr.0 - 8,
        TABLES - (1 << 16),
    ];
    input.patch(&mut mem, &bases);
    let search = Gva(TABLES - below.min(TABLES - BASE))..Gva(TABLES + 0x1000 + above);
    if let Ok((found, symbols)) = KallsymsLayout::locate_and_decode(&mem, search) {
        check(&found, &symbols);
    }
    if let Ok(symbols) = layout.decode(&mem) {
        check(&layout, &symbols);
    }
});
