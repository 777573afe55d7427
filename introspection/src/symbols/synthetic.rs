//! A test fixture (the `test-support` feature): kallsyms tables written into a sparse
//! guest memory as `scripts/kallsyms.c` lays them out (token table and index, names,
//! markers, sequence numbers, relative offsets). For the decoder's unit tests and its fuzz
//! target (`fuzz/fuzz_targets/guest_kallsyms.rs`, which patches the tables as a hostile
//! guest kernel would); nothing else uses it.

use hvprobe_arch::Gva;

use super::KallsymsLayout;
use crate::memory::SparseMemory;

/// The kernel's base (`kallsyms_relative_base`): symbol `i` is at `BASE + 16 * i`.
pub const BASE: u64 = 0xffff_ffff_8100_0000;

fn align8(v: u64) -> u64 {
    (v + 7) & !7
}

/// 256 printable tokens with "0".."9" (and every other printable byte) at their own
/// index; `long` replaces token 1.
pub fn tokens(long: Option<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut t: Vec<Vec<u8>> = (0..256u32)
        .map(|i| {
            if (0x21..0x7f).contains(&i) {
                vec![i as u8]
            } else {
                format!("t{i:02x}").into_bytes()
            }
        })
        .collect();
    if let Some(l) = long {
        t[1] = l;
    }
    t
}

/// Writes a token table and index at `at` (8-aligned); returns the index's address.
pub fn put_token_table(mem: &mut SparseMemory, at: u64, tokens: &[Vec<u8>]) -> u64 {
    let mut table = Vec::new();
    let mut index = Vec::new();
    for t in tokens {
        index.extend_from_slice(&(table.len() as u16).to_le_bytes());
        table.extend_from_slice(t);
        table.push(0);
    }
    mem.write(at, &table);
    let index_at = align8(at + table.len() as u64);
    mem.write(index_at, &index);
    index_at
}

/// A complete kallsyms layout whose names are `names` (token indices per name, the
/// first decoding to the type letter); the token table at `t`, the other tables below
/// it. Returns the layout.
pub fn put_kallsyms(mem: &mut SparseMemory, t: u64, tokens: &[Vec<u8>], names: &[Vec<u8>]) -> KallsymsLayout {
    let n = names.len() as u64;
    let index = put_token_table(mem, t, tokens);
    let seqs = (t - 3 * n) & !7;
    let markers = (seqs - 4 * n.div_ceil(256)) & !7;
    let mut blob = Vec::new();
    let mut marks = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if i % 256 == 0 {
            marks.extend_from_slice(&(blob.len() as u32).to_le_bytes());
        }
        let len = name.len();
        if len < 0x80 {
            blob.push(len as u8);
        } else {
            blob.extend_from_slice(&[(len as u8 & 0x7f) | 0x80, (len >> 7) as u8]);
        }
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
    let offs: Vec<u8> = (0..n as u32).flat_map(|i| (i * 16).to_le_bytes()).collect();
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
        token_table: Gva(t),
        token_index: Gva(index),
        absolute_percpu: false,
    }
}
