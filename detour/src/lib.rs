//! Jump-optimized probes, the part with no KVM in it: where a 5-byte `jmp rel32` may take the
//! place of the instructions at a probe address ([`plan_region`]), and those instructions
//! re-encoded to run in a detour buffer in the out-of-line area ([`relocate`],
//! [`jump_bytes`]). The engine does not use this yet.
//!
//! For probes that only record ([`event`]): the detour's own code, generated for the
//! probe's fetch-args, writes each hit into a per-CPU ring ([`ring`]) inside the guest
//! with no VM exit, then runs the relocated instructions; the host drains the rings
//! without pausing the guest.
//!
//! **Invariant: a region is planned for a jump only when replacing it with `jmp rel32`
//! cannot change what the guest executes anywhere else.** Execution that enters the region
//! at its first byte takes the jump, runs the displaced instructions in the detour and comes
//! back at the region's end, which is what it did before. So nothing may enter the region
//! anywhere else, and the displaced instructions must do in the detour what they did in
//! place. Every check below serves one of the two; a refusal is a [`NotOptimizable`] whose
//! text names the addresses, for the per-probe "why not optimized" of the listing.
//!
//! What [`plan_region`] checks (Linux's kprobes' safety checks, as Linux's
//! `arch/x86/kernel/kprobes/opt.c` makes them, plus what the host can see and Linux does not
//! look at):
//! - the region is whole instructions from the probe address covering at least 5 bytes, and
//!   it ends inside the function;
//! - nothing in the function may branch into the region other than to its first byte: no
//!   direct `jmp`/`jcc`/`call`/`loop` whose target is inside it (Linux looks at the four bytes
//!   after the first; the whole interior also covers a target in the middle of a longer last
//!   instruction, whose bytes no longer run there), no indirect jump anywhere in
//!   the function (its target is unknown: a jump table, a computed goto), and no direct jump to
//!   an indirect-branch thunk (`__x86_indirect_thunk_*` and friends: a retpoline kernel's
//!   spelling of `jmp *%reg`). A kernel built with retpolines or IBT has no jump tables, so
//!   Linux skips the indirect-jump check there; we cannot see the guest's config and always
//!   make it;
//! - no instruction of the function has an exception-table entry: its fixup may resume
//!   anywhere in the function (old kernels jump back from `.fixup`). Linux refuses the whole
//!   function then, and so do we (for every entry inside the function's bytes, not only at the
//!   instruction starts Linux decodes: an entry elsewhere means our decoding is not the
//!   compiler's). Beyond Linux, an entry anywhere in the kernel whose *fixup* address lies
//!   inside the region refuses it too;
//! - no instruction of the function uses an address inside the region as a value (a
//!   RIP-relative `lea`, an absolute displacement or an immediate): code that takes a label's
//!   address (`push $1f; ...; iretq`, as `sync_core()` did) jumps there without a branch the
//!   scan could see;
//! - the text decodes: Linux refused a function with another subsystem's breakpoint in it
//!   (today only kgdb's), since the bytes under it are unknown. A compiler puts int3 only where execution never
//!   falls through (after `ret`/`jmp` for straight-line speculation, or as padding), so an int3
//!   right after an instruction that falls through is someone else's breakpoint (the guest's
//!   own kprobe, its debugger) and refuses the function;
//! - every displaced instruction can run in the detour ([`Undisplaceable`]): no `call` (Linux's
//!   limitation too: the callee would return into the detour, which would then have to
//!   outlive every task sleeping below it), no trap raised on purpose (int3, `int`, `ud2`: the
//!   guest's handler looks the address up), and nothing Linux's `can_boost()` refuses, except
//!   relative `jmp`/`jcc`, which iced re-encodes for the detour. A region also ends at a `jmp`
//!   or `ret`: an instruction after one is reached only by jumps, and only some are visible;
//! - the region is clear of the guest's patch sites (the ftrace site, jump labels, static
//!   calls): the guest checks those bytes before it rewrites them;
//! - no other probe lies strictly inside the region (Linux's kprobes' pre-optimization condition;
//!   temporary, like the probe-state conditions of [`check_probe`]).
//!
//! Decisions:
//! - **Indirect calls** are allowed, as in Linux (its check is for `ff /4` and `ff /5`, jumps
//!   only, and jumps to the thunks, not calls to them): a call lands on another function's
//!   entry, and its return lands after the call, which is inside the region only when the
//!   call itself is, and calls are refused there.
//! - **`__x86_return_thunk`** is not an indirect-branch thunk: `jmp __x86_return_thunk` is a
//!   `ret`, which returns after a call, and no call is displaced.
//! - **The ftrace NOP at +0**: placement moves a probe aimed at it to the next instruction,
//!   and the region is planned at that moved address; a region overlapping the ftrace site is
//!   refused, which happens only for a probe not moved or a region starting before the NOP
//!   (at an `endbr64` at +0, itself refused: indirect calls must land on it under IBT).
//! - **Compiler-split parts** (`NAME.cold`) jump back into their function,
//!   so [`FunctionText::split_parts`] are scanned like the function itself. Jumps from
//!   elsewhere (other functions, BPF programs) remain invisible, to Linux as to us.
//!
//! What the caller still owns: the function's text must be the compiler's (our own int3s
//! and jumps replaced by the original bytes); a probe at an address inside an optimized
//! region blocks that region, which must be unoptimized first (Linux's kprobes' "blocked by another
//! kprobe"); the jump is written with every vCPU paused and no vCPU or task interrupted
//! inside the region (DESIGN.md); the bytes after the 5-byte jump stay as they are (nothing
//! can reach them); the detour's entry must be within rel32 reach of the probe
//! ([`jump_bytes`] says when it is not).

#![forbid(unsafe_code)]

use std::fmt;
use std::ops::Range;

use hvprobe_arch::Gva;
use hvprobe_introspection::facts::ExceptionTable;
use hvprobe_introspection::symbols::SymbolTable;
use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Formatter, Instruction, IntelFormatter, Mnemonic, OpKind, Register,
};

use crate::sites::{PatchSiteKind, PatchSites};
use hvprobe_insn::{self, InsnError};

mod displace;
pub mod event;
mod relocate;
pub mod ring;
pub mod sites;
#[cfg(test)]
mod tests;

pub use displace::Undisplaceable;
pub use relocate::{jump_bytes, relocate};

/// The length of `jmp rel32`: the least a region covers.
pub const JMP_REL32_LEN: usize = 5;
/// The opcode of `jmp rel32`.
pub const JMP_REL32: u8 = 0xe9;
/// The most bytes a region covers: whole instructions until [`JMP_REL32_LEN`] are
/// covered, so the last starts within the jump's first four bytes and is at most
/// [`MAX_INSN_LEN`](hvprobe_insn::MAX_INSN_LEN) long. A region that covers an address
/// starts less than this before it.
pub const MAX_REGION_LEN: u64 = (JMP_REL32_LEN - 1 + hvprobe_insn::MAX_INSN_LEN) as u64;
const INT3: u8 = 0xcc;

/// Code at an address: a function's bytes, or a part of it.
#[derive(Clone, Copy, Debug)]
pub struct Code<'a> {
    pub start: Gva,
    pub bytes: &'a [u8],
}

impl Code<'_> {
    pub fn end(&self) -> Gva {
        Gva(self.start.0.wrapping_add(self.bytes.len() as u64))
    }

    pub fn range(&self) -> Range<Gva> {
        self.start..self.end()
    }
}

/// The function a probe is in, as [`plan_region`] needs it.
#[derive(Clone, Copy, Debug)]
pub struct FunctionText<'a> {
    /// The function's bytes (its symbol's size) as the compiler left them: the engine's own
    /// int3s and jumps replaced by the original bytes.
    pub body: Code<'a>,
    /// Where its ftrace site is (the 5-byte NOP at the entry, or the call the guest put
    /// there), as the engine's placement finds it.
    pub ftrace_site: Option<Gva>,
    /// The parts the compiler split off the function (`NAME.cold`): they jump back into it,
    /// so they are scanned like it.
    pub split_parts: &'a [Code<'a>],
}

/// Where the guest's indirect-branch thunks are (`__x86_indirect_thunk_*`,
/// `__x86_indirect_call_thunk_*`, `__x86_indirect_jump_thunk_*`, the ITS thunks): a `jmp`
/// there is an indirect jump. `__x86_return_thunk` is not one of them (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndirectThunks {
    /// Sorted, non-overlapping.
    ranges: Vec<Range<Gva>>,
}

impl IndirectThunks {
    pub fn from_ranges(mut ranges: Vec<Range<Gva>>) -> Self {
        ranges.retain(|r| r.start < r.end);
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<Gva>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        IndirectThunks { ranges: merged }
    }

    /// The thunks a symbol table names: every text symbol `__x86_indirect_*thunk*` (its size,
    /// or up to the next symbol), and `__indirect_thunk_start..__indirect_thunk_end` where
    /// the kernel has those markers.
    pub fn from_symbols(symbols: &SymbolTable) -> Self {
        let mut ranges = Vec::new();
        if let (Some(start), Some(end)) = (
            symbols.lookup("__indirect_thunk_start"),
            symbols.lookup("__indirect_thunk_end"),
        ) {
            ranges.push(start.addr..end.addr);
        }
        for s in symbols.symbols() {
            if s.is_text() && is_indirect_thunk_name(&s.name) {
                let size = symbols.size_of(s).unwrap_or(1).max(1);
                ranges.push(s.addr..Gva(s.addr.0.saturating_add(size)));
            }
        }
        Self::from_ranges(ranges)
    }

    pub fn ranges(&self) -> &[Range<Gva>] {
        &self.ranges
    }

    /// The start of the thunk range that contains `at`.
    pub fn containing(&self, at: Gva) -> Option<Gva> {
        let i = self.ranges.partition_point(|r| r.start <= at);
        let r = self.ranges.get(i.checked_sub(1)?)?;
        r.contains(&at).then_some(r.start)
    }
}

fn is_indirect_thunk_name(name: &str) -> bool {
    name.starts_with("__x86_indirect_") && name.contains("thunk")
}

/// The guest facts [`plan_region`] checks a region against.
#[derive(Clone, Copy, Debug)]
pub struct DetourFacts<'a> {
    pub ex_table: &'a ExceptionTable,
    pub patch_sites: &'a PatchSites,
    pub thunks: &'a IndirectThunks,
}

/// One instruction a jump displaces, as decoded at its original address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DisplacedInsn {
    pub addr: Gva,
    pub bytes: Vec<u8>,
    decoded: Instruction,
}

impl DisplacedInsn {
    pub fn next_addr(&self) -> Gva {
        Gva(self.addr.0.wrapping_add(self.bytes.len() as u64))
    }

    /// Intel-syntax text of the instruction.
    pub fn disassembly(&self) -> String {
        disassemble(&self.decoded)
    }
}

/// Where a `jmp rel32` goes: whole instructions from the probe address, at least
/// [`JMP_REL32_LEN`] bytes of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetourRegion {
    start: Gva,
    instructions: Vec<DisplacedInsn>,
}

impl DetourRegion {
    /// The probe address, where the jump goes.
    pub fn start(&self) -> Gva {
        self.start
    }

    /// The address after the last displaced instruction, where the detour jumps back to.
    pub fn end(&self) -> Gva {
        self.instructions.last().map_or(self.start, DisplacedInsn::next_addr)
    }

    /// How many bytes the displaced instructions take (at least [`JMP_REL32_LEN`]).
    pub fn size(&self) -> usize {
        self.instructions.iter().map(|i| i.bytes.len()).sum()
    }

    pub fn instructions(&self) -> &[DisplacedInsn] {
        &self.instructions
    }

    /// The original bytes of the region, as the unoptimization writes them back.
    pub fn original_bytes(&self) -> Vec<u8> {
        self.instructions.iter().flat_map(|i| i.bytes.iter().copied()).collect()
    }

    /// Whether `at` lies inside the region but is not its first byte: where nothing may
    /// branch to.
    pub fn is_interior(&self, at: Gva) -> bool {
        self.start < at && at < self.end()
    }
}

/// Why a probe is not jump-optimized. Each message names the addresses involved; the
/// listing shows it per probe.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotOptimizable {
    #[error("{at} is outside the function {}..{}", function.start, function.end)]
    NotInFunction { at: Gva, function: Range<Gva> },
    #[error("{at} is inside the instruction at {insn}, not at an instruction start")]
    NotInstructionBoundary { at: Gva, insn: Gva },
    #[error(
        "a {JMP_REL32_LEN}-byte jump at {start} needs the bytes up to {needed_end}, past the function's end at \
         {function_end}"
    )]
    CrossesFunctionEnd {
        start: Gva,
        needed_end: Gva,
        function_end: Gva,
    },
    #[error("the function does not decode: {0}")]
    Undecodable(InsnError),
    #[error(
        "int3 at {at} follows an instruction that falls through: a breakpoint of someone else's (the guest's own \
         kprobe or debugger), and the bytes under it are unknown"
    )]
    ForeignBreakpoint { at: Gva },
    #[error("indirect jump `{insn}` at {at}: a jump table or computed target could land inside the region")]
    IndirectJump { at: Gva, insn: String },
    #[error(
        "jump at {at} to the indirect-branch thunk at {thunk}: an indirect jump, whose target could land inside \
         the region"
    )]
    JumpToThunk { at: Gva, thunk: Gva },
    #[error(
        "the instruction at {insn} has an exception-table entry: its fixup may resume anywhere in the function, \
         so (as in Linux) no probe in it is optimized"
    )]
    ExceptionTableEntry { insn: Gva },
    #[error("the exception fixup of the instruction at {insn} resumes at {fixup}, inside the region {start}..{end}")]
    FixupIntoRegion {
        insn: Gva,
        fixup: Gva,
        start: Gva,
        end: Gva,
    },
    #[error(
        "the branch at {from} targets {target}, inside the region {start}..{end} (only its first byte may be a \
         branch target)"
    )]
    BranchIntoRegion {
        from: Gva,
        target: Gva,
        start: Gva,
        end: Gva,
    },
    #[error(
        "the instruction at {at} uses {target}, inside the region {start}..{end}, as an address: code may jump \
         there"
    )]
    AddressTaken { at: Gva, target: Gva, start: Gva, end: Gva },
    #[error("`{insn}` at {at} cannot run displaced: {why}")]
    NotDisplaceable { at: Gva, insn: String, why: Undisplaceable },
    #[error(
        "the region would continue past the jmp/ret at {transfer}: the instruction at {next} is reached only by \
         jumps, not all of which can be seen"
    )]
    PastUnconditionalTransfer { transfer: Gva, next: Gva },
    #[error("the region {start}..{end} overlaps the function's ftrace site at {site}, which the guest rewrites")]
    OverlapsFtraceSite { start: Gva, end: Gva, site: Gva },
    #[error("the region {start}..{end} overlaps the guest's {kind} at {site}, which the guest rewrites")]
    OverlapsPatchSite {
        start: Gva,
        end: Gva,
        site: Gva,
        kind: PatchSiteKind,
    },
    #[error("another probe at {probe} lies inside the region {start}..{end}")]
    ProbeInsideRegion { probe: Gva, start: Gva, end: Gva },
    #[error("the probe has a post-handler, which runs after a single-step that a jump does not make")]
    HasPostHandler,
    #[error("the probe is disabled")]
    Disabled,
    #[error(
        "the RIP-relative operand of the instruction at {at} addresses {target}, out of rel32 reach from {new_ip}"
    )]
    RipRelativeOutOfReach { at: Gva, target: Gva, new_ip: Gva },
    #[error("the branch at {at} targets {target}, out of rel32 reach from {new_ip}")]
    BranchOutOfReach { at: Gva, target: Gva, new_ip: Gva },
    #[error("the jump back from {from} to {to} is out of rel32 reach")]
    ReturnOutOfReach { from: Gva, to: Gva },
    #[error("re-encoding the instruction at {at} to run at {new_ip} failed: {message}")]
    Reencode { at: Gva, new_ip: Gva, message: String },
    #[error(
        "the instruction at {at} re-encoded at {new_ip} does not do what the original does (a relocation bug): \
         {relocated}"
    )]
    RelocationMismatch { at: Gva, new_ip: Gva, relocated: String },
}

impl NotOptimizable {
    /// Whether the reason may go away while the text stays as it is (Linux's kprobes'
    /// pre-optimization conditions): the probe may be optimized later.
    pub fn is_temporary(&self) -> bool {
        matches!(
            self,
            NotOptimizable::HasPostHandler | NotOptimizable::Disabled | NotOptimizable::ProbeInsideRegion { .. }
        )
    }
}

/// The state of a probe that Linux's kprobes' pre-optimization conditions look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeConditions {
    pub has_post_handler: bool,
    pub enabled: bool,
}

/// Linux's kprobes' pre-optimization conditions that depend on the probe rather than the text: no
/// post-handler (it runs after a single-step, and a jumped-over instruction is not stepped)
/// and enabled. Both are temporary ([`NotOptimizable::is_temporary`]). The third condition,
/// no other probe inside the region, is [`plan_region`]'s.
pub fn check_probe(probe: ProbeConditions) -> Result<(), NotOptimizable> {
    if probe.has_post_handler {
        return Err(NotOptimizable::HasPostHandler);
    }
    if !probe.enabled {
        return Err(NotOptimizable::Disabled);
    }
    Ok(())
}

/// Plans a jump at `at` (the probe's site, after placement moved it off an ftrace NOP) in
/// `function`: the displaced instructions, or why no jump may go there. `other_probes` are
/// the addresses of the other probes in the function (at `at` itself they share the site).
/// See the module docs for every check.
pub fn plan_region(
    at: Gva,
    function: &FunctionText<'_>,
    facts: &DetourFacts<'_>,
    other_probes: &[Gva],
) -> Result<DetourRegion, NotOptimizable> {
    let body = function.body;
    if !body.range().contains(&at) {
        return Err(NotOptimizable::NotInFunction {
            at,
            function: body.range(),
        });
    }
    let decoded = decode_all(body)?;
    let parts = function
        .split_parts
        .iter()
        .map(|part| decode_all(*part).map(|insns| (*part, insns)))
        .collect::<Result<Vec<_>, _>>()?;

    let region = displaced_region(at, body, &decoded)?;
    let (start, end) = (region.start(), region.end());
    check_patch_sites(&region, function.ftrace_site, facts.patch_sites)?;

    // Whole-function checks: nothing but the first byte of the region may be entered.
    for code in std::iter::once(body).chain(function.split_parts.iter().copied()) {
        if let Some(entry) = facts.ex_table.in_range(code.range()).first() {
            return Err(NotOptimizable::ExceptionTableEntry { insn: entry.insn });
        }
    }
    if let Some(entry) = facts.ex_table.entries().iter().find(|e| region.is_interior(e.fixup)) {
        return Err(NotOptimizable::FixupIntoRegion {
            insn: entry.insn,
            fixup: entry.fixup,
            start,
            end,
        });
    }
    scan_for_entries(body, &decoded, &region, facts.thunks)?;
    for (part, insns) in &parts {
        scan_for_entries(*part, insns, &region, facts.thunks)?;
    }

    if let Some(&probe) = other_probes.iter().find(|p| region.is_interior(**p)) {
        return Err(NotOptimizable::ProbeInsideRegion { probe, start, end });
    }
    Ok(region)
}

/// Every instruction of `code`, decoded linearly from its start.
fn decode_all(code: Code<'_>) -> Result<Vec<Instruction>, NotOptimizable> {
    let mut decoder = Decoder::with_ip(64, code.bytes, code.start.0, DecoderOptions::NONE);
    let mut out = Vec::new();
    let mut instruction = Instruction::default();
    while decoder.can_decode() {
        let offset = decoder.position();
        decoder.decode_out(&mut instruction);
        if instruction.is_invalid() {
            let addr = Gva(code.start.0.wrapping_add(offset as u64));
            return Err(NotOptimizable::Undecodable(hvprobe_insn::decode_error(
                &decoder,
                &code.bytes[offset..],
                addr,
            )));
        }
        out.push(instruction);
    }
    Ok(out)
}

/// The instructions from `at` that a jump displaces, each checked to run in a detour.
fn displaced_region(at: Gva, body: Code<'_>, decoded: &[Instruction]) -> Result<DetourRegion, NotOptimizable> {
    let first = match decoded.binary_search_by_key(&at.0, Instruction::ip) {
        Ok(i) => i,
        // `at` is inside the body, whose first instruction starts at its start.
        Err(i) => {
            return Err(NotOptimizable::NotInstructionBoundary {
                at,
                insn: Gva(decoded[i - 1].ip()),
            })
        }
    };
    let mut instructions: Vec<DisplacedInsn> = Vec::new();
    let mut covered = 0usize;
    for instruction in &decoded[first..] {
        if covered >= JMP_REL32_LEN {
            break;
        }
        if let Some(previous) = instructions.last() {
            if matches!(
                previous.decoded.flow_control(),
                FlowControl::UnconditionalBranch | FlowControl::Return
            ) {
                return Err(NotOptimizable::PastUnconditionalTransfer {
                    transfer: previous.addr,
                    next: Gva(instruction.ip()),
                });
            }
        }
        let offset = (instruction.ip() - body.start.0) as usize;
        let bytes = &body.bytes[offset..offset + instruction.len()];
        displace::check(instruction, bytes).map_err(|why| NotOptimizable::NotDisplaceable {
            at: Gva(instruction.ip()),
            insn: disassemble(instruction),
            why,
        })?;
        instructions.push(DisplacedInsn {
            addr: Gva(instruction.ip()),
            bytes: bytes.to_vec(),
            decoded: *instruction,
        });
        covered += bytes.len();
    }
    if covered < JMP_REL32_LEN {
        return Err(NotOptimizable::CrossesFunctionEnd {
            start: at,
            needed_end: Gva(at.0.wrapping_add(JMP_REL32_LEN as u64)),
            function_end: body.end(),
        });
    }
    debug_assert!(covered as u64 <= MAX_REGION_LEN);
    Ok(DetourRegion {
        start: at,
        instructions,
    })
}

/// The region must be clear of every byte the guest rewrites itself.
fn check_patch_sites(
    region: &DetourRegion,
    ftrace_site: Option<Gva>,
    patch_sites: &PatchSites,
) -> Result<(), NotOptimizable> {
    let (start, end) = (region.start(), region.end());
    if let Some(site) = ftrace_site {
        // The ftrace site is the 5 bytes of its NOP (or call).
        if site < end && start.0 < site.0.wrapping_add(JMP_REL32_LEN as u64) {
            return Err(NotOptimizable::OverlapsFtraceSite { start, end, site });
        }
    }
    for a in start.0..end.0 {
        if let Some(site) = patch_sites.containing(Gva(a)) {
            return Err(NotOptimizable::OverlapsPatchSite {
                start,
                end,
                site: site.range.start,
                kind: site.kind,
            });
        }
    }
    Ok(())
}

/// Looks through one piece of the function for every way into the region's interior: a
/// direct branch there, an indirect jump (directly or through a thunk), an address of it
/// taken as a value, and a foreign int3 that makes the decoding (and so all of this) unsure.
fn scan_for_entries(
    code: Code<'_>,
    decoded: &[Instruction],
    region: &DetourRegion,
    thunks: &IndirectThunks,
) -> Result<(), NotOptimizable> {
    let (start, end) = (region.start(), region.end());
    // A piece is entered at its start (by calls, or by jumps into a split part), so an int3
    // there is a breakpoint too.
    let mut previous_falls_through = true;
    for instruction in decoded {
        let at = Gva(instruction.ip());
        let flow = instruction.flow_control();
        if instruction.mnemonic() == Mnemonic::Int3 {
            let offset = (instruction.ip() - code.start.0) as usize;
            let padding_to_the_end = code.bytes[offset..].iter().all(|&b| b == INT3);
            if previous_falls_through && !padding_to_the_end {
                return Err(NotOptimizable::ForeignBreakpoint { at });
            }
        }
        previous_falls_through = !matches!(
            flow,
            FlowControl::UnconditionalBranch
                | FlowControl::IndirectBranch
                | FlowControl::Return
                | FlowControl::Interrupt
                | FlowControl::Exception
        );

        if flow == FlowControl::IndirectBranch {
            return Err(NotOptimizable::IndirectJump {
                at,
                insn: disassemble(instruction),
            });
        }
        if let Some(target) = near_branch_target(instruction) {
            if matches!(flow, FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch) {
                if let Some(thunk) = thunks.containing(target) {
                    return Err(NotOptimizable::JumpToThunk { at, thunk });
                }
            }
            if region.is_interior(target) {
                return Err(NotOptimizable::BranchIntoRegion {
                    from: at,
                    target,
                    start,
                    end,
                });
            }
        }
        if let Some(target) = addresses_used(instruction).find(|a| region.is_interior(*a)) {
            return Err(NotOptimizable::AddressTaken { at, target, start, end });
        }
    }
    Ok(())
}

/// The target of a direct near branch (`jmp`, `jcc`, `call`, `loop*`, `jrcxz`, `xbegin`).
fn near_branch_target(instruction: &Instruction) -> Option<Gva> {
    (0..instruction.op_count())
        .any(|i| {
            matches!(
                instruction.op_kind(i),
                OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
            )
        })
        .then(|| Gva(instruction.near_branch_target()))
}

/// The addresses an instruction computes or names as values: a RIP-relative operand's
/// target, an absolute displacement, and its immediates (sign-extended as the CPU does).
fn addresses_used(instruction: &Instruction) -> impl Iterator<Item = Gva> + '_ {
    (0..instruction.op_count()).filter_map(move |i| match instruction.op_kind(i) {
        OpKind::Memory if instruction.is_ip_rel_memory_operand() => Some(Gva(instruction.ip_rel_memory_address())),
        OpKind::Memory
            if instruction.memory_base() == Register::None && instruction.memory_index() == Register::None =>
        {
            Some(Gva(instruction.memory_displacement64()))
        }
        OpKind::Immediate8
        | OpKind::Immediate8_2nd
        | OpKind::Immediate16
        | OpKind::Immediate32
        | OpKind::Immediate64
        | OpKind::Immediate8to16
        | OpKind::Immediate8to32
        | OpKind::Immediate8to64
        | OpKind::Immediate32to64 => Some(Gva(instruction.immediate(i))),
        _ => None,
    })
}

fn disassemble(instruction: &Instruction) -> String {
    let mut text = String::new();
    IntelFormatter::new().format(instruction, &mut text);
    text
}

impl fmt::Display for DetourRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{} (", self.start(), self.end())?;
        for (i, insn) in self.instructions.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            f.write_str(&insn.disassembly())?;
        }
        f.write_str(")")
    }
}
