//! Fuzzes the kallsyms search and decoder (`hvprobe_introspection::symbols::KallsymsLayout`)
//! over guest memory a hostile kernel controls.
//!
//! A valid set of tables (300 symbols, a token table with multi-byte tokens, markers,
//! sequence numbers, offsets) is laid out as `scripts/kallsyms.c` does
//! (`symbols::synthetic`, as the decoder's unit tests lay theirs out), then the input
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
use hvprobe_introspection::symbols::synthetic::{put_kallsyms, tokens, BASE};
use hvprobe_introspection::symbols::{KallsymsLayout, Symbol};
use libfuzzer_sys::fuzz_target;

const TABLES: u64 = BASE + (1 << 20);

/// The tables (`symbols::synthetic`) at `TABLES` (the token table), the rest below it;
/// returns the layout.
fn build(mem: &mut SparseMemory) -> KallsymsLayout {
    let mut toks = tokens(Some(b"_do_".to_vec()));
    toks[2] = b"sys".to_vec();
    toks[3] = b"Tx".to_vec();
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
    put_kallsyms(mem, TABLES, &toks, &names)
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
