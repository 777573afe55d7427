//! Kallsyms found and decoded in guest memory without System.map.
//!
//! `scripts/kallsyms.c` (Linux 6.1, `CONFIG_KALLSYMS_BASE_RELATIVE`) emits into `.rodata`,
//! in this order, each label 8-aligned:
//!
//! ```text
//! kallsyms_offsets        s32[num_syms]
//! kallsyms_relative_base  u64 (a relocated pointer: run-time address)
//! kallsyms_num_syms       u32
//! kallsyms_names          per symbol: ULEB128 length (1-2 bytes), then token bytes
//! kallsyms_markers        u32[(num_syms + 255) / 256]: names offset of every 256th symbol
//! kallsyms_seqs_of_names  u8[3 * num_syms] (big-endian indices; from 6.1.y / 6.2 on)
//! kallsyms_token_table    256 NUL-terminated tokens
//! kallsyms_token_index    u16[256]: offset of each token in the table
//! ```
//!
//! The token table is the one part with recognisable content: every byte that occurs in a
//! symbol name is a token of itself at its own index, so tokens 0x30..0x39 are "0".."9",
//! consecutive. From it the tables before it are found by working backwards over the
//! known sizes and alignments, then everything is checked by decoding.

use std::ops::Range;

use hvprobe_arch::Gva;

use super::{Symbol, SymbolError, KERNEL_HALF};
use crate::memory::GuestVirtRead;

/// Where the kallsyms tables are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KallsymsLayout {
    pub offsets: Gva,
    pub relative_base_addr: Gva,
    /// The value of `kallsyms_relative_base` (the lowest relative symbol's address).
    pub relative_base: u64,
    pub num_syms_addr: Gva,
    pub num_syms: u32,
    pub names: Gva,
    pub markers: Gva,
    /// `None` for kernels without `kallsyms_seqs_of_names`.
    pub seqs_of_names: Option<Gva>,
    pub token_table: Gva,
    pub token_index: Gva,
    /// `CONFIG_KALLSYMS_ABSOLUTE_PERCPU` (seen from the offsets: per-CPU symbols are then
    /// non-negative absolute values and all others negative).
    pub absolute_percpu: bool,
}

/// Tokens "0\0" .. "9\0" as they sit at indices 0x30..0x39 of the token table.
const DIGIT_TOKENS: &[u8; 20] = b"0\x001\x002\x003\x004\x005\x006\x007\x008\x009\x00";
/// Scanning reads this much at once: few calls into a live guest's page walker.
const SCAN_CHUNK: u64 = 4 << 20;
/// How far below the token table the tables before it may start.
const MAX_TABLES_SPAN: u64 = 64 << 20;
/// `KSYM_NAME_LEN`: names are shorter.
const KSYM_NAME_LEN: usize = 512;
/// Far more symbols than any kernel has: a distro kernel has ~200k, this is 20 times that.
/// A larger count is not `kallsyms_num_syms`,
/// and refusing it keeps a bad layout from allocating gigabytes.
const MAX_SYMS: u64 = 1 << 22;
/// The decoded names of one table, in bytes: a distro kernel's ~200k names take ~6 MiB,
/// so 128 MiB is 20 times that (and more than MAX_SYMS average-length names). Without it a
/// guest could have 4 M names of 512 bytes (2 GiB) decoded.
const MAX_NAME_BYTES: u64 = 128 << 20;
/// What the whole search may read from the guest and decode, beyond one pass over the
/// search range: a real kernel needs one backward scan (< MAX_TABLES_SPAN) and one decode
/// (a few MiB) from its one token table; four spans leave room for a few false candidates.
/// Without a budget every planted "0\01\0…9\0" started a 64 MiB scan and a decode.
const EXTRA_WORK: u64 = 4 * MAX_TABLES_SPAN;
/// The largest single token: the compressor builds tokens by merging pairs of common
/// substrings, and a token longer than a name cannot occur in one.
const MAX_TOKEN_LEN: usize = KSYM_NAME_LEN;
const PAGE: u64 = 0x1000;

fn align8(v: u64) -> u64 {
    // Saturates: a guest-derived address near 2^64 gives a misaligned end, which no
    // check accepts, instead of an overflow.
    v.saturating_add(7) & !7
}

/// Bytes of guest memory the search may still read and decode: charged before each read
/// or decode, so that an over-budget search stops before doing the work.
struct Budget {
    left: u64,
    limit: u64,
}

impl Budget {
    fn new(limit: u64) -> Budget {
        Budget { left: limit, limit }
    }

    fn charge(&mut self, bytes: u64) -> Result<(), SymbolError> {
        self.left = self.left.checked_sub(bytes).ok_or(SymbolError::KallsymsOverBudget {
            structure: "the search (bytes of guest memory read and names decoded)",
            limit: self.limit,
            unit: "bytes",
        })?;
        Ok(())
    }
}

fn over_budget(e: &SymbolError) -> bool {
    matches!(e, SymbolError::KallsymsOverBudget { .. })
}

fn invalid(at: Gva, reason: impl Into<String>) -> SymbolError {
    SymbolError::KallsymsInvalid {
        at,
        reason: reason.into(),
    }
}

fn read<M: GuestVirtRead + ?Sized>(mem: &M, what: &'static str, at: Gva, len: u64) -> Result<Vec<u8>, SymbolError> {
    let len = usize::try_from(len).map_err(|_| invalid(at, format!("{what} length {len:#x} is too large")))?;
    let mut buf = vec![0u8; len];
    mem.read_virt(at, &mut buf)
        .map_err(|source| SymbolError::Memory { what, source })?;
    Ok(buf)
}

/// Reads `[start, start+len)`; pages that do not read (holes between segments, unmapped
/// pages) come back as zeros, which match nothing the search looks for.
fn read_lenient<M: GuestVirtRead + ?Sized>(mem: &M, start: u64, len: u64) -> Vec<u8> {
    let len = len.min(u64::MAX - start);
    let mut buf = vec![0u8; len as usize];
    if mem.read_virt(Gva(start), &mut buf).is_ok() {
        return buf;
    }
    buf.fill(0);
    let mut at = start;
    while at < start + len {
        let next = ((at / PAGE) + 1) * PAGE;
        let end = next.min(start + len);
        let piece = &mut buf[(at - start) as usize..(end - start) as usize];
        if mem.read_virt(Gva(at), piece).is_err() {
            piece.fill(0);
        }
        at = end;
    }
    buf
}

fn find_all(hay: &[u8], needle: &[u8], mut f: impl FnMut(usize) -> bool) {
    let Some((&first, rest)) = needle.split_first() else {
        return;
    };
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        if hay[i] == first && &hay[i + 1..i + needle.len()] == rest && f(i) {
            return;
        }
        i += 1;
    }
}

struct TokenTable {
    start: Gva,
    index_addr: Gva,
    tokens: Vec<Vec<u8>>,
}

/// Checks that the "0" token at `zero` is part of a real token table and reads it.
fn token_table_at<M: GuestVirtRead + ?Sized>(
    mem: &M,
    zero: Gva,
    budget: &mut Budget,
) -> Result<TokenTable, SymbolError> {
    // Tokens are short (the compressor merges pairs); 16 KiB holds the rest of any table.
    budget.charge((16 << 10) + 512)?;
    let tail = read_lenient(mem, zero.0, 16 << 10);
    let mut nuls = 0;
    let mut end = None;
    for (i, &b) in tail.iter().enumerate() {
        if b == 0 {
            nuls += 1;
            if nuls == 256 - 0x30 {
                end = Some(zero.0 + i as u64 + 1);
                break;
            }
        }
    }
    let end = end.ok_or_else(|| invalid(zero, "no end of the token table"))?;
    let index_addr = Gva(align8(end));
    let raw = read(mem, "kallsyms_token_index", index_addr, 512)?;
    let index: Vec<u64> = raw
        .chunks_exact(2)
        .map(|c| u64::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let start = zero
        .0
        .checked_sub(index[0x30])
        .ok_or_else(|| invalid(zero, "token index points before the table"))?;
    if index[0] != 0 || start % 8 != 0 {
        return Err(invalid(Gva(start), "token index does not start an aligned table"));
    }
    budget.charge(end - start)?;
    let table = read(mem, "kallsyms_token_table", Gva(start), end - start)?;
    let mut tokens = Vec::with_capacity(256);
    for i in 0..256 {
        let from = index[i] as usize;
        let to = index.get(i + 1).map_or(table.len(), |&n| n as usize);
        let token = table
            .get(from..to)
            .and_then(|t| t.strip_suffix(&[0]))
            .filter(|t| !t.is_empty() && t.len() <= MAX_TOKEN_LEN && t.iter().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| {
                invalid(
                    Gva(start),
                    format!("token {i:#x} is not a printable NUL-terminated string"),
                )
            })?;
        tokens.push(token.to_vec());
    }
    if tokens[0x30..0x3a]
        .iter()
        .enumerate()
        .any(|(d, t)| t != &[b'0' + d as u8])
    {
        return Err(invalid(Gva(start), "digit tokens are not at their own indices"));
    }
    Ok(TokenTable {
        start: Gva(start),
        index_addr,
        tokens,
    })
}

impl KallsymsLayout {
    /// Finds the kallsyms tables inside `search`.
    pub fn locate<M: GuestVirtRead + ?Sized>(mem: &M, search: Range<Gva>) -> Result<Self, SymbolError> {
        locate_and_decode(mem, search).map(|(layout, _)| layout)
    }

    /// Finds the kallsyms tables inside `search` and returns their symbols too (the search
    /// checks a candidate by decoding it).
    pub fn locate_and_decode<M: GuestVirtRead + ?Sized>(
        mem: &M,
        search: Range<Gva>,
    ) -> Result<(Self, Vec<Symbol>), SymbolError> {
        locate_and_decode(mem, search)
    }

    /// Decodes every symbol, checking the tables against each other on the way.
    pub fn decode<M: GuestVirtRead + ?Sized>(&self, mem: &M) -> Result<Vec<Symbol>, SymbolError> {
        // One decode of known tables: the allowance the search has beyond its scan.
        let mut budget = Budget::new(EXTRA_WORK);
        let tokens = read_tokens(mem, self.token_table, self.token_index)?;
        decode_with(mem, self, &tokens, &mut budget).map(|(symbols, _)| symbols)
    }
}

/// Reads a token table at a known place (no search).
fn read_tokens<M: GuestVirtRead + ?Sized>(mem: &M, table: Gva, index: Gva) -> Result<Vec<Vec<u8>>, SymbolError> {
    let raw = read(mem, "kallsyms_token_index", index, 512)?;
    let len = index
        .0
        .checked_sub(table.0)
        .ok_or_else(|| invalid(table, "token index before token table"))?;
    let bytes = read(mem, "kallsyms_token_table", table, len)?;
    raw.chunks_exact(2)
        .enumerate()
        .map(|(i, c)| {
            let from = usize::from(u16::from_le_bytes([c[0], c[1]]));
            bytes
                .get(from..)
                .and_then(|t| t.split(|&b| b == 0).next())
                // Printable, as the search checks them: names are printed on the user's
                // terminal, and each is at most KSYM_NAME_LEN bytes once decoded (found by
                // the guest_kallsyms fuzz target: a non-UTF-8 token tripled a name's length
                // and could carry control bytes).
                .filter(|t| {
                    !t.is_empty()
                        && t.len() <= MAX_TOKEN_LEN
                        && from + t.len() < bytes.len()
                        && t.iter().all(|b| b.is_ascii_graphic())
                })
                .map(<[u8]>::to_vec)
                .ok_or_else(|| invalid(table, format!("token {i:#x} is not a printable NUL-terminated string")))
        })
        .collect()
}

fn locate_and_decode<M: GuestVirtRead + ?Sized>(
    mem: &M,
    search: Range<Gva>,
) -> Result<(KallsymsLayout, Vec<Symbol>), SymbolError> {
    let not_found = |reason: String| SymbolError::KallsymsNotFound {
        start: search.start,
        end: search.end,
        reason,
    };
    if search.end <= search.start {
        return Err(not_found("empty search range".into()));
    }
    let mut last_error = None;
    let mut found = None;
    let mut stop = None;
    let overlap = DIGIT_TOKENS.len() as u64 - 1;
    let mut budget = Budget::new((search.end.0 - search.start.0).saturating_add(EXTRA_WORK));
    let mut at = search.start.0;
    while at < search.end.0 && found.is_none() && stop.is_none() {
        let len = SCAN_CHUNK.min(search.end.0 - at);
        budget.charge(len)?;
        let chunk = read_lenient(mem, at, len);
        find_all(&chunk, DIGIT_TOKENS, |i| {
            let zero = Gva(at + i as u64);
            match token_table_at(mem, zero, &mut budget).and_then(|tt| tables_before(mem, &search, &tt, &mut budget)) {
                Ok(r) => {
                    found = Some(r);
                    true
                }
                Err(e) if over_budget(&e) => {
                    stop = Some(e);
                    true
                }
                Err(e) => {
                    tracing::debug!("kallsyms candidate at {zero} rejected: {e}");
                    last_error = Some(e);
                    false
                }
            }
        });
        if at + len >= search.end.0 {
            break;
        }
        at += len - overlap;
    }
    if let Some(e) = stop {
        return Err(e);
    }
    found.ok_or_else(|| {
        not_found(match last_error {
            None => "no token table (tokens \"0\"..\"9\" in a row)".into(),
            Some(e) => format!("no candidate token table checked out; the last one: {e}"),
        })
    })
}

/// Given a token table, finds `kallsyms_num_syms` below it and checks the whole layout by
/// decoding it.
fn tables_before<M: GuestVirtRead + ?Sized>(
    mem: &M,
    search: &Range<Gva>,
    tt: &TokenTable,
    budget: &mut Budget,
) -> Result<(KallsymsLayout, Vec<Symbol>), SymbolError> {
    let t = tt.start.0;
    let floor = search.start.0.max(t.saturating_sub(MAX_TABLES_SPAN));
    let mut last_error = invalid(tt.start, "no kallsyms_num_syms below the token table");
    let mut hi = t;
    // Walk down in chunks; each candidate `a` is an 8-aligned kallsyms_num_syms with
    // kallsyms_relative_base just below it.
    while hi > floor + 16 {
        let lo = hi.saturating_sub(1 << 20).max(floor);
        budget.charge(hi - lo)?;
        let buf = read_lenient(mem, lo, hi - lo);
        let word = |addr: u64| -> u64 {
            let o = (addr - lo) as usize;
            u64::from_le_bytes(buf[o..o + 8].try_into().expect("8 bytes"))
        };
        let mut a = (hi - 8) & !7;
        while a >= lo + 8 {
            // The count in the low half, its padding (zero) in the high half. Checked
            // first and cheaply: this loop runs for every 8 bytes of up to 64 MiB.
            let count_and_pad = word(a);
            let n = count_and_pad & 0xffff_ffff;
            // Each symbol costs at least two bytes of names, four of offsets, three of
            // sequence numbers.
            if n != 0 && n <= MAX_SYMS && count_and_pad >> 32 == 0 && n * 2 < t - a && word(a - 8) >= KERNEL_HALF {
                let base = word(a - 8);
                for with_seqs in [true, false] {
                    match layout_from(a, n, base, t, tt, with_seqs) {
                        Some(layout) => match decode_with(mem, &layout, &tt.tokens, budget) {
                            Ok((symbols, absolute_percpu)) => {
                                return Ok((
                                    KallsymsLayout {
                                        absolute_percpu,
                                        ..layout
                                    },
                                    symbols,
                                ));
                            }
                            Err(e) if over_budget(&e) => return Err(e),
                            Err(e) => last_error = e,
                        },
                        None => continue,
                    }
                }
            }
            a -= 8;
        }
        hi = lo + 8;
        if lo == floor {
            break;
        }
    }
    Err(last_error)
}

/// The layout implied by `kallsyms_num_syms` = `n` at `a` and the token table at `t`.
fn layout_from(a: u64, n: u64, base: u64, t: u64, tt: &TokenTable, with_seqs: bool) -> Option<KallsymsLayout> {
    let seqs = if with_seqs { t.checked_sub(3 * n)? & !7 } else { t };
    let markers = seqs.checked_sub(4 * n.div_ceil(256))? & !7;
    let names = a + 8;
    if markers < names + 2 * n {
        return None;
    }
    let relative_base_addr = a - 8;
    let offsets = relative_base_addr.checked_sub(4 * n)? & !7;
    Some(KallsymsLayout {
        offsets: Gva(offsets),
        relative_base_addr: Gva(relative_base_addr),
        relative_base: base,
        num_syms_addr: Gva(a),
        num_syms: u32::try_from(n).ok()?,
        names: Gva(names),
        markers: Gva(markers),
        seqs_of_names: with_seqs.then_some(Gva(seqs)),
        token_table: tt.start,
        token_index: tt.index_addr,
        absolute_percpu: false,
    })
}

fn decode_with<M: GuestVirtRead + ?Sized>(
    mem: &M,
    layout: &KallsymsLayout,
    tokens: &[Vec<u8>],
    budget: &mut Budget,
) -> Result<(Vec<Symbol>, bool), SymbolError> {
    if u64::from(layout.num_syms) > MAX_SYMS {
        return Err(invalid(
            layout.num_syms_addr,
            format!("{} symbols is not plausible", layout.num_syms),
        ));
    }
    let n = layout.num_syms as usize;
    let names_len = layout
        .markers
        .0
        .checked_sub(layout.names.0)
        .ok_or_else(|| invalid(layout.names, "markers before names"))?;
    if names_len > n as u64 * (KSYM_NAME_LEN as u64 + 2) + 8 {
        return Err(invalid(
            layout.names,
            format!("{names_len:#x} bytes of names for {n} symbols"),
        ));
    }
    // Cheap checks first: wrong candidates fail here before the names are read.
    let n_markers = n.div_ceil(256);
    budget.charge(4 * n_markers as u64)?;
    let markers_raw = read(mem, "kallsyms_markers", layout.markers, 4 * n_markers as u64)?;
    let markers: Vec<u32> = markers_raw
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if markers.first() != Some(&0) || markers.windows(2).any(|w| w[0] >= w[1]) {
        return Err(invalid(
            layout.markers,
            "kallsyms_markers is not an increasing table from 0",
        ));
    }
    budget.charge(names_len)?;
    let names = read(mem, "kallsyms_names", layout.names, names_len)?;

    let mut pos = 0usize;
    let mut name_bytes = 0u64;
    // Grown as names decode rather than sized from the guest's count up front.
    let mut decoded: Vec<(char, String)> = Vec::new();
    let mut buf = Vec::with_capacity(KSYM_NAME_LEN);
    for i in 0..n {
        if i % 256 == 0 && markers[i / 256] as usize != pos {
            return Err(invalid(
                layout.markers,
                format!(
                    "marker {} is {:#x}, symbol {i} starts at {pos:#x}",
                    i / 256,
                    markers[i / 256]
                ),
            ));
        }
        let bad = |what: &str| invalid(Gva(layout.names.0 + pos as u64), format!("symbol {i}: {what}"));
        let first = *names.get(pos).ok_or_else(|| bad("names end early"))?;
        let (len, header) = if first & 0x80 != 0 {
            let second = *names.get(pos + 1).ok_or_else(|| bad("names end early"))?;
            ((usize::from(first) & 0x7f) | (usize::from(second) << 7), 2)
        } else {
            (usize::from(first), 1)
        };
        let body = names
            .get(pos + header..pos + header + len)
            .ok_or_else(|| bad("names end early"))?;
        if len == 0 {
            return Err(bad("zero length"));
        }
        // Every token is at least a byte, so a longer body cannot make a name that fits;
        // and the length is checked token by token, before joining (a body of 32767
        // references to a 60 KB token would otherwise join ~2 GB first).
        if len > KSYM_NAME_LEN {
            return Err(bad("name length out of range"));
        }
        buf.clear();
        for &b in body {
            let token = &tokens[usize::from(b)];
            if buf.len() + token.len() > KSYM_NAME_LEN {
                return Err(bad("name length out of range"));
            }
            buf.extend_from_slice(token);
        }
        if buf.len() < 2 {
            return Err(bad("name length out of range"));
        }
        name_bytes += buf.len() as u64;
        if name_bytes > MAX_NAME_BYTES {
            return Err(SymbolError::KallsymsOverBudget {
                structure: "kallsyms_names (decoded)",
                limit: MAX_NAME_BYTES,
                unit: "bytes",
            });
        }
        budget.charge(buf.len() as u64)?;
        let kind = char::from(buf[0]);
        // nm's '?' (type unknown) occurs for linker-script symbols.
        if !kind.is_ascii_alphabetic() && kind != '?' {
            return Err(bad("type is not a letter or '?'"));
        }
        // Tokens are printable ASCII (checked when reading them), so this is valid UTF-8.
        let name = String::from_utf8_lossy(&buf[1..]).into_owned();
        decoded.push((kind, name));
        pos += header + len;
    }
    if align8(layout.names.0 + pos as u64) != layout.markers.0 {
        return Err(invalid(
            layout.names,
            format!(
                "names end at {:#x}, markers are at {}",
                layout.names.0 + pos as u64,
                layout.markers
            ),
        ));
    }

    if let Some(seqs_at) = layout.seqs_of_names {
        budget.charge(3 * n as u64)?;
        let raw = read(mem, "kallsyms_seqs_of_names", seqs_at, 3 * n as u64)?;
        let mut seen = vec![false; n];
        for c in raw.chunks_exact(3) {
            let s = (usize::from(c[0]) << 16) | (usize::from(c[1]) << 8) | usize::from(c[2]);
            match seen.get_mut(s) {
                Some(slot) if !*slot => *slot = true,
                _ => return Err(invalid(seqs_at, "kallsyms_seqs_of_names is not a permutation")),
            }
        }
    }

    budget.charge(4 * n as u64)?;
    let raw = read(mem, "kallsyms_offsets", layout.offsets, 4 * n as u64)?;
    let offsets: Vec<i32> = raw
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let absolute_percpu = offsets.iter().any(|&o| o < 0);
    let base = layout.relative_base;
    let mut symbols = Vec::with_capacity(n);
    let mut prev = 0u64;
    for ((kind, name), off) in decoded.into_iter().zip(offsets) {
        let addr = if !absolute_percpu {
            base.wrapping_add(u64::from(off as u32))
        } else if off >= 0 {
            off as u64
        } else {
            // relative_base - 1 - off, with off negative.
            base.wrapping_sub(1).wrapping_add(off.unsigned_abs().into())
        };
        if addr < prev {
            return Err(invalid(
                layout.offsets,
                format!("addresses not sorted at {name} ({addr:#x} < {prev:#x})"),
            ));
        }
        prev = addr;
        symbols.push(Symbol {
            name,
            addr: Gva(addr),
            kind,
            size: None,
        });
    }
    Ok((symbols, absolute_percpu))
}

#[cfg(test)]
mod tests {
    //! Kallsyms tables built by hand in a sparse guest memory, as a hostile guest kernel
    //! could lay them out.

    use super::*;
    use crate::memory::SparseMemory;
    use crate::symbols::synthetic::{put_kallsyms, put_token_table, tokens, BASE};

    fn name(s: &str) -> Vec<u8> {
        s.bytes().collect()
    }

    #[test]
    fn synthetic_tables_are_found_and_decoded() {
        let mut mem = SparseMemory::new();
        let t = BASE + (1 << 20);
        let layout = put_kallsyms(
            &mut mem,
            t,
            &tokens(None),
            &[name("T_text"), name("tfoo"), name("Dbar")],
        );
        let (found, symbols) = KallsymsLayout::locate_and_decode(&mem, Gva(BASE)..Gva(BASE + (2 << 20))).unwrap();
        assert_eq!(found, layout);
        let got: Vec<(char, &str, u64)> = symbols.iter().map(|s| (s.kind, s.name.as_str(), s.addr.0)).collect();
        assert_eq!(
            got,
            [('T', "_text", BASE), ('t', "foo", BASE + 16), ('D', "bar", BASE + 32)]
        );
    }

    /// One name of 32767 references to a 60 KB token: the old decoder joined ~2 GB before
    /// checking the 512-byte limit. Every allocation of the decode is capped at 16 MiB.
    #[test]
    fn a_names_tokens_are_not_joined_past_the_name_limit() {
        let mut mem = SparseMemory::new();
        let toks = tokens(Some(vec![b'A'; 60_000]));
        // The long name first, then enough short ones that the names' total length is
        // plausible for the count.
        let mut names = vec![vec![1u8; 0x7fff]];
        names.extend((0..80).map(|_| name("tx")));
        let layout = put_kallsyms(&mut mem, BASE + (4 << 20), &toks, &names);
        let r = crate::alloc_cap::with_cap(16 << 20, || {
            decode_with(&mem, &layout, &toks, &mut Budget::new(EXTRA_WORK))
        });
        match r {
            Err(SymbolError::KallsymsInvalid { reason, .. }) => assert!(reason.contains("name length"), "{reason}"),
            other => panic!("expected a name length error, got {other:?}"),
        }
    }

    /// 300k names of 500 bytes each (150 MB decoded from 600 KB of names) is over the
    /// decoded-names limit: a clear error, not 150 MB (or, at 4 M names, 2 GB) of strings.
    #[test]
    fn decoded_names_are_limited() {
        let mut mem = SparseMemory::new();
        let mut long = vec![b't'];
        long.extend(std::iter::repeat_n(b'a', 499));
        let toks = tokens(Some(long));
        let names: Vec<Vec<u8>> = (0..300_000).map(|_| vec![1u8]).collect();
        let layout = put_kallsyms(&mut mem, BASE + (8 << 20), &toks, &names);
        let r = decode_with(&mem, &layout, &toks, &mut Budget::new(u64::MAX));
        match r {
            Err(SymbolError::KallsymsOverBudget { structure, limit, .. }) => {
                assert_eq!((structure, limit), ("kallsyms_names (decoded)", MAX_NAME_BYTES));
            }
            other => panic!(
                "expected the decoded-names limit, got {:?}",
                other.map(|(s, _)| s.len())
            ),
        }
    }

    /// 2000 copies of a valid token table (no tables below them) 64 MiB above the start of
    /// the search: each started a 64 MiB backward scan (128 GB of scanning in all, about
    /// ten minutes of this debug build). The search must give up with the budget error
    /// (~330 MiB of scanning, under two seconds here when the machine is idle; the
    /// deadline leaves room for a loaded one).
    #[test]
    fn planted_token_tables_exhaust_a_budget_not_the_host() {
        let mut mem = SparseMemory::new();
        let toks = tokens(None);
        let first = BASE + MAX_TABLES_SPAN;
        for i in 0..2000 {
            put_token_table(&mut mem, first + i * 0x1000, &toks);
        }
        let search = Gva(BASE)..Gva(first + (10 << 20));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(KallsymsLayout::locate(&mem, search));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the kallsyms search ran for more than 60 s");
        assert!(
            matches!(r, Err(SymbolError::KallsymsOverBudget { .. })),
            "expected the search budget error, got {r:?}"
        );
    }

    /// Found by the guest_kallsyms fuzz target: decoding at a known layout (as after a
    /// restore) took the guest's tokens without the search's printable check, so a token of
    /// control or non-UTF-8 bytes made names with escape sequences, three times as long
    /// once decoded.
    #[test]
    fn tokens_of_known_tables_must_be_printable() {
        let mut mem = SparseMemory::new();
        let layout = put_kallsyms(
            &mut mem,
            BASE + (1 << 20),
            &tokens(None),
            &[name("T_text"), name("tfoo")],
        );
        assert_eq!(layout.decode(&mem).unwrap().len(), 2);
        let mut bad = tokens(None);
        bad[1] = b"\x1b[2J\xff".to_vec();
        let layout = put_kallsyms(&mut mem, BASE + (1 << 20), &bad, &[name("T_text"), name("tfoo")]);
        let r = layout.decode(&mem);
        assert!(
            matches!(&r, Err(SymbolError::KallsymsInvalid { reason, .. }) if reason.contains("printable")),
            "{r:?}"
        );
    }
}
