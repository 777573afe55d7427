//! A synthetic guest with loaded modules, laid out as Linux 6.1 lays them out: BTF that
//! describes `struct module` (and `mod_kallsyms`, `module_layout`, `mod_arch_specific`),
//! and memory with the `modules` list and each module's kallsyms, ORC tables and kprobe
//! blacklist. For the reader's tests and its fuzz target (which patches it as a hostile
//! guest would); nothing else uses it.

use crate::btf::builder::Builder;
use crate::memory::SparseMemory;

/// Where the synthetic guest keeps the kernel's `modules` list head.
pub const MODULES_HEAD: u64 = 0xffff_ffff_8200_0000;
/// Module `i`'s core layout starts at `MODULE_BASE + i * MODULE_STRIDE`.
pub const MODULE_BASE: u64 = 0xffff_ffff_c000_0000;
pub const MODULE_STRIDE: u64 = 0x10_0000;
/// Offsets in a module's core layout.
pub const TEXT_SIZE: u64 = 0x1000;
pub const CORE_SIZE: u64 = 0x4000;
pub const STRUCT_MODULE: u64 = 0x2000;
const KALLSYMS: u64 = 0x2100;
const SYMTAB: u64 = 0x2200;
const STRTAB: u64 = 0x2300;
const TYPETAB: u64 = 0x2400;
const ORC_IPS: u64 = 0x2500;
const ORC_ENTRIES: u64 = 0x2600;
const BLACKLIST: u64 = 0x2700;
const JUMP_TABLE: u64 = 0x2800;
/// A jump label's 5-byte site in each module's `mod_fn_b` (its jump table's one entry).
pub const JUMP_LABEL: u64 = 0x48;
/// Each module's functions: (name, type letter, offset in the core text, size).
pub const FUNCTIONS: &[(&str, u8, u64, u64)] = &[("mod_fn_a", b't', 0x10, 0x20), ("mod_fn_b", b'T', 0x40, 0x30)];
/// `mod_fn_a` is on each module's kprobe blacklist.
pub const BLACKLISTED: &str = "mod_fn_a";

/// Byte offsets of `struct module`'s members in the synthetic BTF.
const M_STATE: u32 = 0;
const M_LIST: u32 = 8;
const M_NAME: u32 = 24;
const M_CORE: u32 = 80;
const M_INIT: u32 = 104;
const M_ARCH: u32 = 128;
const M_KALLSYMS: u32 = 152;
const M_KPROBES_TEXT_START: u32 = 160;
const M_KPROBES_TEXT_SIZE: u32 = 168;
const M_BLACKLIST: u32 = 176;
const M_NUM_BLACKLIST: u32 = 184;
const M_NOINSTR_START: u32 = 192;
const M_NOINSTR_SIZE: u32 = 200;
const M_JUMP_ENTRIES: u32 = 208;
const M_NUM_JUMP_ENTRIES: u32 = 216;
const M_SIZE: u32 = 224;

/// A struct with (name, type, byte offset) members.
fn strukt(b: &mut Builder, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
    let members: Vec<(&str, u32, u32, u32)> = members.iter().map(|&(n, t, off)| (n, t, off * 8, 0)).collect();
    b.aggregate(4, name, size, false, &members)
}

/// BTF describing Linux 6.1's `struct module` as far as the reader looks.
pub fn btf() -> Vec<u8> {
    let mut b = Builder::new();
    let int = b.raw("int", 1, false, 0, 4, &[(1 << 24) | 32]);
    let uint = b.raw("unsigned int", 1, false, 0, 4, &[32]);
    let ch = b.raw("char", 1, false, 0, 1, &[8]);
    let ptr = b.raw("", 2, false, 0, 0, &[]);
    let name = b.raw("", 3, false, 0, 0, &[ch, int, 56]);
    let state = b.raw("module_state", 6, false, 0, 4, &[]);
    let list = strukt(&mut b, "list_head", 16, &[("next", ptr, 0), ("prev", ptr, 8)]);
    let layout = strukt(
        &mut b,
        "module_layout",
        24,
        &[
            ("base", ptr, 0),
            ("size", uint, 8),
            ("text_size", uint, 12),
            ("ro_size", uint, 16),
        ],
    );
    strukt(
        &mut b,
        "mod_kallsyms",
        32,
        &[
            ("symtab", ptr, 0),
            ("num_symtab", uint, 8),
            ("strtab", ptr, 16),
            ("typetab", ptr, 24),
        ],
    );
    let arch = strukt(
        &mut b,
        "mod_arch_specific",
        24,
        &[
            ("num_orcs", uint, 0),
            ("orc_unwind_ip", ptr, 8),
            ("orc_unwind", ptr, 16),
        ],
    );
    strukt(
        &mut b,
        "module",
        M_SIZE,
        &[
            ("state", state, M_STATE),
            ("list", list, M_LIST),
            ("name", name, M_NAME),
            ("core_layout", layout, M_CORE),
            ("init_layout", layout, M_INIT),
            ("arch", arch, M_ARCH),
            ("kallsyms", ptr, M_KALLSYMS),
            ("kprobes_text_start", ptr, M_KPROBES_TEXT_START),
            ("kprobes_text_size", uint, M_KPROBES_TEXT_SIZE),
            ("kprobe_blacklist", ptr, M_BLACKLIST),
            ("num_kprobe_blacklist", uint, M_NUM_BLACKLIST),
            ("noinstr_text_start", ptr, M_NOINSTR_START),
            ("noinstr_text_size", uint, M_NOINSTR_SIZE),
            ("jump_entries", ptr, M_JUMP_ENTRIES),
            ("num_jump_entries", uint, M_NUM_JUMP_ENTRIES),
        ],
    );
    b.blob()
}

/// Memory with `names.len()` live modules in the `modules` list (the first name at the
/// head), each with [`FUNCTIONS`], two ORC entries and [`BLACKLISTED`] on its blacklist.
pub fn memory(names: &[&str]) -> SparseMemory {
    let mut mem = SparseMemory::new();
    lay_out(names, &mut |at, bytes| mem.write(at, bytes));
    mem
}

/// The bytes of [`memory`], handed to `write` (for a fake machine's own memory).
pub fn lay_out(names: &[&str], write: &mut dyn FnMut(u64, &[u8])) {
    let mut mem = Writer(write);
    let struct_at = |i: usize| MODULE_BASE + i as u64 * MODULE_STRIDE + STRUCT_MODULE;
    let node = |i: usize| struct_at(i) + u64::from(M_LIST);
    for (i, name) in names.iter().enumerate() {
        let base = MODULE_BASE + i as u64 * MODULE_STRIDE;
        let m = struct_at(i);
        mem.put_u32(m + u64::from(M_STATE), 0);
        let next = if i + 1 < names.len() { node(i + 1) } else { MODULES_HEAD };
        let prev = if i == 0 { MODULES_HEAD } else { node(i - 1) };
        mem.put_u64(node(i), next);
        mem.put_u64(node(i) + 8, prev);
        let mut raw = name.as_bytes().to_vec();
        raw.resize(56, 0);
        mem.write(m + u64::from(M_NAME), &raw);
        mem.put_u64(m + u64::from(M_CORE), base);
        mem.put_u32(m + u64::from(M_CORE) + 8, CORE_SIZE as u32);
        mem.put_u32(m + u64::from(M_CORE) + 12, TEXT_SIZE as u32);
        mem.put_u64(m + u64::from(M_INIT), 0);
        mem.put_u32(m + u64::from(M_INIT) + 8, 0);
        mem.put_u32(m + u64::from(M_INIT) + 12, 0);
        // ORC: one entry at the text's start, a terminator at its end.
        mem.put_u32(m + u64::from(M_ARCH), 2);
        mem.put_u64(m + u64::from(M_ARCH) + 8, base + ORC_IPS);
        mem.put_u64(m + u64::from(M_ARCH) + 16, base + ORC_ENTRIES);
        let ips = base + ORC_IPS;
        mem.put_u32(ips, (base as i64 - ips as i64) as i32 as u32);
        mem.put_u32(ips + 4, ((base + TEXT_SIZE) as i64 - (ips + 4) as i64) as i32 as u32);
        // sp = sp + 8, bp undefined, type CALL; then an undefined (end) entry.
        mem.write(base + ORC_ENTRIES, &[8, 0, 0, 0, 0x05, 0x00, 0, 0, 0, 0, 0, 0]);
        // kallsyms: the null symbol, then the functions.
        let ks = base + KALLSYMS;
        mem.put_u64(m + u64::from(M_KALLSYMS), ks);
        mem.put_u64(ks, base + SYMTAB);
        mem.put_u32(ks + 8, FUNCTIONS.len() as u32 + 1);
        mem.put_u64(ks + 16, base + STRTAB);
        mem.put_u64(ks + 24, base + TYPETAB);
        let mut strtab = vec![0u8];
        let mut types = vec![b'?'];
        for (j, (fname, kind, off, size)) in FUNCTIONS.iter().enumerate() {
            let sym = base + SYMTAB + 24 * (j as u64 + 1);
            mem.put_u32(sym, strtab.len() as u32);
            mem.put_u64(sym + 8, base + off);
            mem.put_u64(sym + 16, *size);
            strtab.extend_from_slice(fname.as_bytes());
            strtab.push(0);
            types.push(*kind);
        }
        mem.write(base + STRTAB, &strtab);
        mem.write(base + TYPETAB, &types);
        let blacklisted = FUNCTIONS.iter().find(|f| f.0 == BLACKLISTED).map_or(0, |f| f.2);
        mem.put_u64(m + u64::from(M_BLACKLIST), base + BLACKLIST);
        mem.put_u32(m + u64::from(M_NUM_BLACKLIST), 1);
        mem.put_u64(base + BLACKLIST, base + blacklisted + 4);
        // One jump label (`struct jump_entry`: code, target, key, relative).
        let entry = base + JUMP_TABLE;
        mem.put_u64(m + u64::from(M_JUMP_ENTRIES), entry);
        mem.put_u32(m + u64::from(M_NUM_JUMP_ENTRIES), 1);
        mem.put_u32(entry, ((base + JUMP_LABEL) as i64 - entry as i64) as i32 as u32);
        mem.put_u32(
            entry + 4,
            ((base + JUMP_LABEL + 5) as i64 - (entry + 4) as i64) as i32 as u32,
        );
        mem.put_u64(entry + 8, 0);
        // The text itself (so that a page walk finds it): NOPs.
        mem.write(base, &[0x90; TEXT_SIZE as usize]);
    }
    let first = if names.is_empty() { MODULES_HEAD } else { node(0) };
    let last = if names.is_empty() {
        MODULES_HEAD
    } else {
        node(names.len() - 1)
    };
    mem.put_u64(MODULES_HEAD, first);
    mem.put_u64(MODULES_HEAD + 8, last);
}

struct Writer<'a>(&'a mut dyn FnMut(u64, &[u8]));

impl Writer<'_> {
    fn write(&mut self, at: u64, bytes: &[u8]) {
        (self.0)(at, bytes)
    }

    fn put_u64(&mut self, at: u64, v: u64) {
        self.write(at, &v.to_le_bytes())
    }

    fn put_u32(&mut self, at: u64, v: u32) {
        self.write(at, &v.to_le_bytes())
    }
}
