//! A guest kernel stack, unwound on the host with the guest's own ORC data.
//!
//! Linux (x86-64, `CONFIG_UNWINDER_ORC`, what distributions ship) describes, for every
//! address of its text, how to find the caller's stack pointer, frame pointer and return
//! address: `.orc_unwind_ip` (sorted 32-bit self-relative addresses) and `.orc_unwind` (one
//! 6-byte `struct orc_entry` per address), between `__start_orc_unwind_ip`,
//! `__stop_orc_unwind_ip`, `__start_orc_unwind` and `__stop_orc_unwind`. [`OrcTable`] reads
//! both tables out of guest memory once (found through the guest's symbols, so kallsyms
//! read from memory is enough, and the table is KASLR-independent since its addresses are
//! self-relative), and [`unwind`] walks a stack the way the guest's `unwind_next_frame`
//! (`arch/x86/kernel/unwind_orc.c`, Linux 6.1) and `arch_stack_walk` do: the same ORC
//! entry for an address (the rightmost one at or below it; `ip - 1` for a return address),
//! the same register rules (`sp_reg`/`bp_reg`, full `pt_regs` and IRET frames of interrupts
//! and exceptions, `R10`/`R13`/`DI`/`DX` from the last full register set), the same stops
//! (an `end` entry, user-mode registers, an address that is not kernel text) and the same
//! fallback for code without ORC data (a frame-pointer guess).
//!
//! Nothing here trusts guest memory. Every stack read must lie inside one of the stacks the
//! caller lists (the hitting CPU's task, IRQ, exception and entry stacks, as the guest's
//! `get_stack_info` allows them), each stack may be entered once, the stack pointer must
//! grow within a stack, and at most [`MAX_FRAMES`] frames are produced: a corrupt or
//! hostile stack ends the walk ([`UnwindEnd`] says why), it never reads unbounded memory.

use std::ops::Range;

use hvprobe_arch::Gva;

use crate::memory::{GuestVirtRead, MemoryError};
use crate::stacks::SwappedReturn;
use crate::symbols::SymbolTable;

/// The most frames one walk yields: ftrace's per-event stack (`FTRACE_KSTACK_ENTRIES`, a
/// quarter page of addresses).
pub const MAX_FRAMES: usize = 128;
/// The largest ORC table accepted (entries): far above any kernel's (a distribution kernel
/// has ~300,000), so a corrupt symbol pair cannot make the host read gigabytes.
const MAX_ORC_ENTRIES: u64 = 8 << 20;
const ORC_ENTRY_SIZE: u64 = 6;
/// The largest `_stext.._etext` accepted: x86-64's kernel image mapping
/// (`KERNEL_IMAGE_SIZE`) is 1 GiB, and all of the text is inside it. The lookup blocks are
/// sized from this span (4 Mi blocks at most), and the symbols that give it are the guest's
/// own in kallsyms mode.
pub const MAX_KERNEL_TEXT: u64 = 1 << 30;

/// `struct pt_regs` offsets (x86-64), in bytes.
mod pt_regs {
    pub const R13: u64 = 16;
    pub const BP: u64 = 32;
    pub const R10: u64 = 56;
    pub const DX: u64 = 96;
    pub const DI: u64 = 112;
    pub const IP: u64 = 128;
    pub const CS: u64 = 136;
    pub const SP: u64 = 152;
    pub const SIZE: u64 = 168;
}
/// `IRET_FRAME_OFFSET`: where the hardware's frame (ip, cs, flags, sp, ss) starts in
/// `pt_regs`, and its size.
const IRET_FRAME_OFFSET: u64 = pt_regs::IP;
const IRET_FRAME_SIZE: u64 = pt_regs::SIZE - IRET_FRAME_OFFSET;

/// `ORC_REG_SP`: an [`OrcEntry::sp_reg`] that says the previous frame's stack pointer (the
/// canonical frame address) is RSP plus `sp_offset`.
pub const ORC_REG_SP: u8 = reg::SP;

/// `ORC_REG_*`.
mod reg {
    pub const UNDEFINED: u8 = 0;
    pub const PREV_SP: u8 = 1;
    pub const DX: u8 = 2;
    pub const DI: u8 = 3;
    pub const BP: u8 = 4;
    pub const SP: u8 = 5;
    pub const R10: u8 = 6;
    pub const R13: u8 = 7;
    pub const BP_INDIRECT: u8 = 8;
    pub const SP_INDIRECT: u8 = 9;
}

/// `UNWIND_HINT_TYPE_*` (Linux 6.1's three).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrcType {
    /// A function's frame: the return address is just below the caller's stack pointer.
    Call,
    /// A full `pt_regs` (an interrupt or exception entry saved every register).
    Regs,
    /// Only the hardware's IRET frame.
    RegsPartial,
    /// A type 6.1 does not define (3): corrupt data.
    Unknown,
}

/// One `struct orc_entry` (Linux 6.1's layout: `s16 sp_offset; s16 bp_offset;` then the
/// bitfields `sp_reg:4, bp_reg:4, type:2, end:1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrcEntry {
    pub sp_offset: i16,
    pub bp_offset: i16,
    pub sp_reg: u8,
    pub bp_reg: u8,
    pub kind: OrcType,
    pub end: bool,
}

impl OrcEntry {
    pub fn parse(b: [u8; 6]) -> OrcEntry {
        let bits = u16::from_le_bytes([b[4], b[5]]);
        OrcEntry {
            sp_offset: i16::from_le_bytes([b[0], b[1]]),
            bp_offset: i16::from_le_bytes([b[2], b[3]]),
            sp_reg: (bits & 0xf) as u8,
            bp_reg: ((bits >> 4) & 0xf) as u8,
            kind: match (bits >> 8) & 3 {
                0 => OrcType::Call,
                1 => OrcType::Regs,
                2 => OrcType::RegsPartial,
                _ => OrcType::Unknown,
            },
            end: bits & (1 << 10) != 0,
        }
    }

    /// `null_orc_entry`: what a call through a NULL pointer left (ip 0).
    const NULL: OrcEntry = OrcEntry {
        sp_offset: 8,
        bp_offset: 0,
        sp_reg: reg::SP,
        bp_reg: reg::UNDEFINED,
        kind: OrcType::Call,
        end: false,
    };

    /// `orc_fp_entry`: the guess for code without ORC data (it uses a frame pointer).
    const FRAME_POINTER: OrcEntry = OrcEntry {
        sp_offset: 16,
        bp_offset: -16,
        sp_reg: reg::BP,
        bp_reg: reg::PREV_SP,
        kind: OrcType::Call,
        end: false,
    };
}

/// Why the ORC table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum OrcError {
    #[error("the kernel's symbols have no {0} (is it built with CONFIG_UNWINDER_ORC?)")]
    MissingSymbol(&'static str),
    #[error("the ORC tables are inconsistent: {0}")]
    Inconsistent(String),
    #[error("_stext.._etext is {len:#x} bytes, more than the {limit:#x}-byte kernel image mapping")]
    TextTooLarge { len: u64, limit: u64 },
    #[error("reading the {what} at {at}: {source}")]
    Memory {
        what: &'static str,
        at: Gva,
        #[source]
        source: MemoryError,
    },
}

/// The guest kernel's ORC data, copied to the host, with the text it covers.
#[derive(Clone, Debug)]
pub struct OrcTable {
    /// Absolute addresses, non-decreasing.
    ips: Vec<u64>,
    entries: Vec<OrcEntry>,
    /// `_stext.._etext` (the range the guest's fast lookup covers).
    text: Range<Gva>,
    /// `_sinittext.._einittext`, when the symbols have it.
    init_text: Option<Range<Gva>>,
    /// For each [`LOOKUP_BLOCK`] bytes of `text`, the index of the last entry at or below
    /// the block's start (as the guest's `orc_lookup`): a lookup searches only the
    /// entries of its block, a few cache lines instead of the whole table.
    blocks: Vec<u32>,
}

/// The guest's `LOOKUP_BLOCK_SIZE`.
const LOOKUP_BLOCK: u64 = 256;

fn symbol(symbols: &SymbolTable, name: &'static str) -> Result<Gva, OrcError> {
    symbols
        .lookup(name)
        .map(|s| s.addr)
        .ok_or(OrcError::MissingSymbol(name))
}

impl OrcTable {
    /// Reads the tables from the running guest (its own page tables in `mem`).
    pub fn read(mem: &(impl GuestVirtRead + ?Sized), symbols: &SymbolTable) -> Result<OrcTable, OrcError> {
        let ip_start = symbol(symbols, "__start_orc_unwind_ip")?;
        let ip_stop = symbol(symbols, "__stop_orc_unwind_ip")?;
        let orc_start = symbol(symbols, "__start_orc_unwind")?;
        let orc_stop = symbol(symbols, "__stop_orc_unwind")?;
        let text = symbol(symbols, "_stext")?..symbol(symbols, "_etext")?;
        let init_text = match (symbols.lookup("_sinittext"), symbols.lookup("_einittext")) {
            (Some(s), Some(e)) => Some(s.addr..e.addr),
            _ => None,
        };
        let ip_len = ip_stop.0.checked_sub(ip_start.0).filter(|l| l % 4 == 0);
        let orc_len = orc_stop.0.checked_sub(orc_start.0).filter(|l| l % ORC_ENTRY_SIZE == 0);
        let (Some(ip_len), Some(orc_len)) = (ip_len, orc_len) else {
            return Err(OrcError::Inconsistent(format!(
                "ip table {ip_start}..{ip_stop}, entries {orc_start}..{orc_stop}"
            )));
        };
        let count = ip_len / 4;
        if count != orc_len / ORC_ENTRY_SIZE || count > MAX_ORC_ENTRIES {
            return Err(OrcError::Inconsistent(format!(
                "{count} addresses and {} entries (at most {MAX_ORC_ENTRIES})",
                orc_len / ORC_ENTRY_SIZE
            )));
        }
        let mut ip_bytes = vec![0u8; ip_len as usize];
        mem.read_virt(ip_start, &mut ip_bytes)
            .map_err(|source| OrcError::Memory {
                what: "ORC address table",
                at: ip_start,
                source,
            })?;
        let mut orc_bytes = vec![0u8; orc_len as usize];
        mem.read_virt(orc_start, &mut orc_bytes)
            .map_err(|source| OrcError::Memory {
                what: "ORC entry table",
                at: orc_start,
                source,
            })?;
        OrcTable::from_tables(ip_start, &ip_bytes, &orc_bytes, text, init_text)
    }

    /// The host memory [`OrcTable::from_tables`] allocates for `entries` entries over a
    /// text of `text_len` bytes (its addresses, its entries, a lookup block per
    /// `LOOKUP_BLOCK` bytes of text): what a caller with a budget charges before it reads
    /// the tables, since a guest that claims a large text with a small table makes the
    /// blocks far outweigh the bytes read.
    pub fn host_bytes(entries: u64, text_len: u64) -> u64 {
        let per_entry = (std::mem::size_of::<u64>() + std::mem::size_of::<OrcEntry>()) as u64;
        let blocks = text_len.div_ceil(LOOKUP_BLOCK).saturating_add(1);
        entries
            .saturating_mul(per_entry)
            .saturating_add(blocks.saturating_mul(std::mem::size_of::<u32>() as u64))
    }

    /// The table from the bytes of `.orc_unwind_ip` (which starts at `ip_table`) and
    /// `.orc_unwind`.
    pub fn from_tables(
        ip_table: Gva,
        ip_bytes: &[u8],
        orc_bytes: &[u8],
        text: Range<Gva>,
        init_text: Option<Range<Gva>>,
    ) -> Result<OrcTable, OrcError> {
        if !ip_bytes.len().is_multiple_of(4) || !(orc_bytes.len() as u64).is_multiple_of(ORC_ENTRY_SIZE) {
            return Err(OrcError::Inconsistent("table sizes are not whole entries".into()));
        }
        let text_len = text.end.0.saturating_sub(text.start.0);
        if text_len > MAX_KERNEL_TEXT {
            return Err(OrcError::TextTooLarge {
                len: text_len,
                limit: MAX_KERNEL_TEXT,
            });
        }
        let ips: Vec<u64> = ip_bytes
            .chunks_exact(4)
            .enumerate()
            .map(|(i, b)| {
                let rel = i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                (ip_table.0.wrapping_add(4 * i as u64)).wrapping_add_signed(rel)
            })
            .collect();
        let entries: Vec<OrcEntry> = orc_bytes
            .chunks_exact(6)
            .map(|b| OrcEntry::parse([b[0], b[1], b[2], b[3], b[4], b[5]]))
            .collect();
        if ips.len() != entries.len() {
            return Err(OrcError::Inconsistent(format!(
                "{} addresses and {} entries",
                ips.len(),
                entries.len()
            )));
        }
        // The build sorts them (scripts/sorttable); a guest that broke that order would only
        // make lookups wrong, but say so rather than unwind with it.
        if let Some(i) = ips.windows(2).position(|w| w[0] > w[1]) {
            return Err(OrcError::Inconsistent(format!(
                "addresses not sorted at entry {i} ({:#x} > {:#x})",
                ips[i],
                ips[i + 1]
            )));
        }
        let blocks = lookup_blocks(&ips, &text);
        Ok(OrcTable {
            ips,
            entries,
            text,
            init_text,
            blocks,
        })
    }

    pub fn len(&self) -> usize {
        self.ips.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
    }

    /// Whether the guest counts `ip` as its text for unwinding (`__kernel_text_address` for
    /// the core kernel: the text and init text; modules, BPF and ftrace trampolines are
    /// not known here).
    pub fn is_text(&self, ip: Gva) -> bool {
        self.text.contains(&ip) || self.init_text.as_ref().is_some_and(|r| r.contains(&ip))
    }

    /// `orc_find`: the entry for `ip`, or `None` where the guest has none (then it guesses
    /// a frame pointer).
    pub fn find(&self, ip: Gva) -> Option<OrcEntry> {
        if ip.0 == 0 {
            return Some(OrcEntry::NULL);
        }
        if !self.is_text(ip) {
            return None;
        }
        // The rightmost entry at or below ip (duplicates: section terminators come first),
        // searched for between the entries that cover the start of ip's block and of the
        // next one.
        // Init text may lie below the core text: its addresses have no block.
        let block = ip.0.checked_sub(self.text.start.0).map(|o| (o / LOOKUP_BLOCK) as usize);
        let (lo, hi) = match block {
            Some(b) if self.text.contains(&ip) && b + 1 < self.blocks.len() => {
                (self.blocks[b] as usize, self.blocks[b + 1] as usize + 1)
            }
            _ => (0, self.ips.len()),
        };
        let hi = hi.min(self.ips.len());
        let i = lo + self.ips[lo..hi].partition_point(|&a| a <= ip.0);
        Some(self.entries[i.checked_sub(1)?])
    }
}

/// Where a walk finds its ORC entries: the kernel's table, and each loaded module's.
pub trait OrcLookup {
    /// Whether the guest counts `ip` as its text (`__kernel_text_address`).
    fn is_text(&self, ip: Gva) -> bool;
    /// `orc_find`: the entry for `ip`.
    fn find(&self, ip: Gva) -> Option<OrcEntry>;
}

impl OrcLookup for OrcTable {
    fn is_text(&self, ip: Gva) -> bool {
        OrcTable::is_text(self, ip)
    }

    fn find(&self, ip: Gva) -> Option<OrcEntry> {
        OrcTable::find(self, ip)
    }
}

/// The kernel's ORC table and its modules' (each covering its module's text), as the
/// guest's `orc_find` looks in them.
pub struct KernelAndModules<'a> {
    pub kernel: &'a OrcTable,
    pub modules: Vec<&'a OrcTable>,
}

impl OrcLookup for KernelAndModules<'_> {
    fn is_text(&self, ip: Gva) -> bool {
        self.kernel.is_text(ip) || self.modules.iter().any(|m| m.is_text(ip))
    }

    fn find(&self, ip: Gva) -> Option<OrcEntry> {
        if ip.0 == 0 || self.kernel.is_text(ip) {
            return self.kernel.find(ip);
        }
        self.modules.iter().find(|m| m.is_text(ip))?.find(ip)
    }
}

/// `blocks[b]`: the index of the last entry at or below `text.start + b * LOOKUP_BLOCK`
/// (0 when none is), for every block of `text` and one past its end.
fn lookup_blocks(ips: &[u64], text: &Range<Gva>) -> Vec<u32> {
    let len = text.end.0.saturating_sub(text.start.0);
    let count = len.div_ceil(LOOKUP_BLOCK) + 1;
    let mut blocks = Vec::with_capacity(count as usize);
    let mut i = 0usize;
    for b in 0..count {
        let start = text.start.0.saturating_add(b * LOOKUP_BLOCK);
        while i < ips.len() && ips[i] <= start {
            i += 1;
        }
        blocks.push(u32::try_from(i.saturating_sub(1)).unwrap_or(u32::MAX));
    }
    blocks
}

/// A stack the walk may read, with a name for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackBounds {
    pub name: String,
    pub range: Range<Gva>,
}

/// The registers the walk starts from (a probe hit's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StartRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    pub cs: u64,
    pub r10: u64,
    pub r13: u64,
    pub di: u64,
    pub dx: u64,
}

/// The return addresses the guest's own kretprobes swapped out on the walked task's stack
/// (its `rethooks` list, latest first), which the walk puts back where it reads the
/// guest's trampoline, as the guest's `unwind_recover_kretprobe` does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestRethooks {
    /// `arch_rethook_trampoline`.
    pub trampoline: Gva,
    pub returns: Vec<SwappedReturn>,
}

/// What a walk of the stack of the task on one CPU may read ([`StackBounds`]), and the
/// return addresses the guest's kretprobes swapped out on it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuStackView {
    pub stacks: Vec<StackBounds>,
    pub rethooks: Option<GuestRethooks>,
}

/// Why a walk ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnwindEnd {
    /// The guest's end of its stack: an ORC `end` entry (a kernel thread's first frame, or
    /// the entry code's) or user-mode registers.
    Bottom,
    /// A frame's address is not kernel text (as the guest's `unwind_get_return_address`
    /// stops there).
    NotText(Gva),
    /// [`MAX_FRAMES`] frames.
    TooDeep,
    /// What the guest calls an unwinder error: a read outside the known stacks (or of a
    /// stack entered before), a stack pointer that does not grow, an undefined ORC register
    /// or type. The frames so far are the guest's too.
    Error(String),
}

/// A walked stack: the addresses, innermost first (the start `ip`, then return
/// addresses), and why it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unwound {
    pub frames: Vec<Gva>,
    pub end: UnwindEnd,
    /// The ORC data ran out somewhere and a frame pointer was guessed (the guest marks
    /// such a walk unreliable, and prints it all the same).
    pub guessed: bool,
}

/// Where the current register set lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegsAt {
    Start,
    /// A `pt_regs` on a stack (for a partial one: where it would start).
    Stack(u64),
}

struct Walk<'a, M: ?Sized> {
    orc: &'a dyn OrcLookup,
    mem: &'a M,
    start: StartRegs,
    stacks: &'a [StackBounds],
    /// Index of the current stack, and which ones were entered.
    current: Option<usize>,
    visited: Vec<bool>,
    ip: u64,
    sp: u64,
    bp: u64,
    signal: bool,
    regs: Option<RegsAt>,
    full_regs: bool,
    prev_regs: Option<RegsAt>,
    guessed: bool,
    rethooks: Option<&'a GuestRethooks>,
    /// Where `rethook_find_ret_addr` left off in the list (the guest's `kr_cur`).
    rethook_cursor: Option<usize>,
}

enum Step {
    Next,
    End(UnwindEnd),
}

impl<M: GuestVirtRead + ?Sized> Walk<'_, M> {
    fn on_current(&self, addr: u64, len: u64) -> bool {
        self.current.is_some_and(|i| on_stack(&self.stacks[i].range, addr, len))
    }

    /// `stack_access_ok`: on the current stack, or on a stack not entered yet (which
    /// becomes the current one).
    fn access_ok(&mut self, addr: u64, len: u64) -> bool {
        if self.on_current(addr, len) {
            return true;
        }
        match self.stacks.iter().position(|s| on_stack(&s.range, addr, len)) {
            Some(i) if !self.visited[i] => {
                self.visited[i] = true;
                self.current = Some(i);
                true
            }
            _ => false,
        }
    }

    fn read(&mut self, addr: u64) -> Option<u64> {
        if !self.access_ok(addr, 8) {
            return None;
        }
        self.mem.read_u64(Gva(addr)).ok()
    }

    fn reg_at(&self, at: RegsAt, off: u64) -> Option<u64> {
        match at {
            RegsAt::Start => Some(match off {
                pt_regs::R13 => self.start.r13,
                pt_regs::BP => self.start.bp,
                pt_regs::R10 => self.start.r10,
                pt_regs::DX => self.start.dx,
                pt_regs::DI => self.start.di,
                pt_regs::CS => self.start.cs,
                _ => return None,
            }),
            // Checked to be on a stack when the regs were taken.
            RegsAt::Stack(a) => self.mem.read_u64(Gva(a.checked_add(off)?)).ok(),
        }
    }

    /// `get_reg`.
    fn get_reg(&self, off: u64) -> Option<u64> {
        let regs = self.regs?;
        if self.full_regs {
            return self.reg_at(regs, off);
        }
        self.reg_at(self.prev_regs?, off)
    }

    fn user_mode_regs(&self) -> bool {
        self.regs
            .and_then(|r| self.reg_at(r, pt_regs::CS))
            .is_some_and(|cs| cs & 3 != 0)
    }

    /// The return address read at `slot`: the caller's `recover` first (the host's own
    /// trampoline), then the guest's kretprobes' (`rethook_find_ret_addr`: from where the
    /// last search ended, the next node that is not the trampoline itself, until one whose
    /// frame is `slot`; none found is address 0, which ends the walk as in the guest).
    fn recover(&mut self, ip: Gva, slot: Gva, recover: &dyn Fn(Gva, Gva) -> Gva) -> u64 {
        let ip = recover(ip, slot);
        let Some(rethooks) = self.rethooks.filter(|r| r.trampoline == ip) else {
            return ip.0;
        };
        loop {
            let from = self.rethook_cursor.map_or(0, |i| i + 1);
            let Some(i) = rethooks.returns[from.min(rethooks.returns.len())..]
                .iter()
                .position(|n| n.ret_addr != rethooks.trampoline)
                .map(|k| from + k)
            else {
                return 0;
            };
            self.rethook_cursor = Some(i);
            if rethooks.returns[i].frame == slot {
                return rethooks.returns[i].ret_addr.0;
            }
        }
    }

    /// `unwind_next_frame`.
    fn next_frame(&mut self, recover: &dyn Fn(Gva, Gva) -> Gva) -> Step {
        let prev_sp = self.sp;
        let prev_stack = self.current;
        if self.user_mode_regs() {
            return Step::End(UnwindEnd::Bottom);
        }
        let at = if self.signal { self.ip } else { self.ip.wrapping_sub(1) };
        let orc = match self.orc.find(Gva(at)) {
            Some(o) => o,
            None => {
                self.guessed = true;
                OrcEntry::FRAME_POINTER
            }
        };
        let err = |what: String| Step::End(UnwindEnd::Error(what));
        if orc.sp_reg == reg::UNDEFINED {
            return match orc.end {
                true => Step::End(UnwindEnd::Bottom),
                false => err(format!("no stack pointer rule at {:#x}", self.ip)),
            };
        }
        let off = i64::from(orc.sp_offset);
        let mut indirect = false;
        let mut sp = match orc.sp_reg {
            reg::SP => self.sp.wrapping_add_signed(off),
            reg::BP => self.bp.wrapping_add_signed(off),
            reg::SP_INDIRECT => {
                indirect = true;
                self.sp
            }
            reg::BP_INDIRECT => {
                indirect = true;
                self.bp.wrapping_add_signed(off)
            }
            r @ (reg::R10 | reg::R13 | reg::DI | reg::DX) => {
                let o = match r {
                    reg::R10 => pt_regs::R10,
                    reg::R13 => pt_regs::R13,
                    reg::DI => pt_regs::DI,
                    _ => pt_regs::DX,
                };
                match self.get_reg(o) {
                    Some(v) => v,
                    None => return err(format!("register {r} of the ORC rule at {:#x} is not known", self.ip)),
                }
            }
            r => return err(format!("unknown stack pointer register {r} at {:#x}", self.ip)),
        };
        if indirect {
            sp = match self.read(sp) {
                Some(v) => v,
                None => return err(format!("indirect stack pointer at {sp:#x} is not on a stack")),
            };
            if orc.sp_reg == reg::SP_INDIRECT {
                sp = sp.wrapping_add_signed(off);
            }
        }
        match orc.kind {
            OrcType::Call => {
                let ip_p = sp.wrapping_sub(8);
                let Some(ip) = self.read(ip_p) else {
                    return err(format!("return address at {ip_p:#x} is not on a stack"));
                };
                self.ip = self.recover(Gva(ip), Gva(ip_p), recover);
                self.sp = sp;
                self.regs = None;
                self.prev_regs = None;
                self.signal = false;
            }
            OrcType::Regs => {
                // The rule's stack pointer is where the `pt_regs` starts.
                let base = sp;
                if !self.access_ok(base, pt_regs::SIZE) {
                    return err(format!("registers at {base:#x} are not on a stack"));
                }
                let (Some(ip), Some(new_sp)) = (
                    self.reg_at(RegsAt::Stack(base), pt_regs::IP),
                    self.reg_at(RegsAt::Stack(base), pt_regs::SP),
                ) else {
                    return err(format!("registers at {base:#x} cannot be read"));
                };
                self.sp = new_sp;
                self.ip = self.recover(Gva(ip), Gva(new_sp.wrapping_sub(8)), recover);
                self.regs = Some(RegsAt::Stack(base));
                self.prev_regs = None;
                self.full_regs = true;
                self.signal = true;
            }
            OrcType::RegsPartial => {
                // The rule's stack pointer is where the hardware's IRET frame starts.
                let frame = sp;
                if !self.access_ok(frame, IRET_FRAME_SIZE) {
                    return err(format!("IRET frame at {frame:#x} is not on a stack"));
                }
                let base = frame.wrapping_sub(IRET_FRAME_OFFSET);
                let (Some(ip), Some(new_sp)) = (
                    self.reg_at(RegsAt::Stack(base), pt_regs::IP),
                    self.reg_at(RegsAt::Stack(base), pt_regs::SP),
                ) else {
                    return err(format!("IRET frame at {frame:#x} cannot be read"));
                };
                self.sp = new_sp;
                self.ip = self.recover(Gva(ip), Gva(new_sp.wrapping_sub(8)), recover);
                if self.full_regs {
                    self.prev_regs = self.regs;
                }
                self.regs = Some(RegsAt::Stack(base));
                self.full_regs = false;
                self.signal = true;
            }
            OrcType::Unknown => return err(format!("unknown ORC entry type at {at:#x}")),
        }
        let boff = i64::from(orc.bp_offset);
        match orc.bp_reg {
            reg::UNDEFINED => {
                if let Some(v) = self.get_reg(pt_regs::BP) {
                    self.bp = v;
                }
            }
            reg::PREV_SP => match self.read(sp.wrapping_add_signed(boff)) {
                Some(v) => self.bp = v,
                None => return err("saved frame pointer is not on a stack".into()),
            },
            reg::BP => match self.read(self.bp.wrapping_add_signed(boff)) {
                Some(v) => self.bp = v,
                None => return err("saved frame pointer is not on a stack".into()),
            },
            r => return err(format!("unknown frame pointer register {r} at {at:#x}")),
        }
        if self.current == prev_stack && self.on_current(self.sp, 8) && self.sp <= prev_sp {
            return err(format!("the stack pointer does not grow at {:#x}", self.ip));
        }
        Step::Next
    }
}

fn on_stack(range: &Range<Gva>, addr: u64, len: u64) -> bool {
    addr >= range.start.0 && addr.checked_add(len).is_some_and(|end| end <= range.end.0)
}

/// Walks the stack of a task stopped with `start` (kernel mode) as the guest's
/// `arch_stack_walk` does from a `pt_regs`: the start address, then one return address per
/// frame. `stacks` are the stacks the walk may read (at most once each); `recover` maps a
/// return address read from a stack slot (address, slot) to the real one, where the host's
/// return probe trampoline stands in for it; `rethooks` does the same for the guest's own.
pub fn unwind(
    orc: &dyn OrcLookup,
    mem: &(impl GuestVirtRead + ?Sized),
    start: StartRegs,
    stacks: &[StackBounds],
    rethooks: Option<&GuestRethooks>,
    recover: &dyn Fn(Gva, Gva) -> Gva,
) -> Unwound {
    let mut frames = vec![Gva(start.ip)];
    if start.cs & 3 != 0 {
        return Unwound {
            frames,
            end: UnwindEnd::Bottom,
            guessed: false,
        };
    }
    let mut walk = Walk {
        orc,
        mem,
        start,
        stacks,
        current: None,
        visited: vec![false; stacks.len()],
        ip: start.ip,
        sp: start.sp,
        bp: start.bp,
        signal: true,
        regs: Some(RegsAt::Start),
        full_regs: true,
        prev_regs: None,
        guessed: false,
        rethooks,
        rethook_cursor: None,
    };
    if !walk.access_ok(start.sp, 8) {
        // As the guest does, try the page above (a stack overflowed into its guard page).
        let next_page = (start.sp | 0xfff).wrapping_add(1);
        if !walk.access_ok(next_page, 8) {
            return Unwound {
                frames,
                end: UnwindEnd::Error(format!("the stack pointer {:#x} is on no known stack", start.sp)),
                guessed: false,
            };
        }
    }
    // The registers' own frame is the start address, already taken.
    let end = loop {
        if let Step::End(end) = walk.next_frame(recover) {
            break end;
        }
        let ip = Gva(walk.ip);
        if walk.user_mode_regs() {
            // A system call's or interrupt's entry from user mode: the kernel stack ends.
            break UnwindEnd::Bottom;
        }
        if !orc.is_text(ip) {
            break UnwindEnd::NotText(ip);
        }
        if frames.len() == MAX_FRAMES {
            break UnwindEnd::TooDeep;
        }
        frames.push(ip);
    };
    Unwound {
        frames,
        end,
        guessed: walk.guessed,
    }
}

#[cfg(any(test, feature = "test-support"))]
pub mod synthetic;
#[cfg(test)]
mod tests;
