//! Exit-free return probes: a return probe's detour keeps each call it follows in the
//! guest, and the call's return writes the record — no VM exit at the entry or at the
//! return.
//!
//! # The calls-in-flight table
//!
//! A table of [`RETURN_SLOT_SIZE`]-byte slots in the writable part of the out-of-line
//! area; each return probe owns `maxactive` consecutive slots (Linux's kretprobe
//! instances), and each slot has a *stub* in the probe's code: `push imm32 <slot>; jmp
//! <return code>`. A slot holds the task that owns it (`current`, 0 when free), the stack
//! slot of the return address (`frame`), the return address the entry found there (`ret`),
//! the caller to report (`caller`), the entry's TSC and the `$argN` words the probe's
//! fetch-args name.
//!
//! # At the entry (the detour the probe's jump goes to)
//!
//! `pushfq; cli`, four registers saved, then a `lock cmpxchg` takes the first free slot of
//! the probe's (owner 0 → `current`): none free is counted in the probe's `nmissed` (its
//! entry of the rings' miss table) and the call runs unfollowed, as Linux's kprobes do past
//! `maxactive`. The slot gets the frame, the return address, the caller, the TSC and the
//! saved arguments, and only then is the return address swapped for the slot's stub. The
//! caller is the return address unless it is
//! - another probe's stub (a function tail-called by a followed one, or a second return
//!   probe on the same function): that slot's caller, when that slot is on the same stack
//!   slot and owned by the same task; the return then runs both, latest first, and the call
//!   returns through the other stub;
//! - the guest's own `arch_rethook_trampoline` (its kretprobe swapped the address first):
//!   the `ret_addr` of the node of `current->rethooks` whose `frame` is this stack slot
//!   (at most [`MAX_RETHOOK_WALK`] nodes; the list is the guest's, walked with plain loads as
//!   its own trampoline walks it).
//!
//! Then the displaced instructions run and jump back.
//!
//! # At the return (the stub, then the probe's return code)
//!
//! The stub's `push` puts the slot number where the return address was. The return code
//! saves the flags (`cli`) and its registers, checks that the slot is one of the probe's,
//! in use, for this stack slot — anything else traps to the host (an `int3`),
//! which stops the VM with the reason: nothing is returned to that was not on record — and
//! writes the real return address back in its place. The record is the event detour's
//! (ring, task stamp, fetch-args; `$retval` is `rax`, `$argN` the entry's words, `%ip` the
//! return address, `%sp` the stack pointer after the return), with the call's caller and
//! entry TSC (the host computes `$duration` from the two stamps). The slot is freed last,
//! on every path (a full ring or a nested hit still returns), then `ret`.
//!
//! A slot whose task went without returning (`do_exit` never returns, nor its final
//! schedule) is freed by the host when the task enters `do_exit` and when the guest frees
//! it (hidden hooks on `do_exit` and `__put_task_struct`: every slot that task owns; Linux's
//! `rethook_flush_task` runs at the second only); the host reads the table (guest memory,
//! one bounded read per slot).

use hvprobe_arch::Gva;
use hvprobe_introspection::stacks::RethookLayout;
use iced_x86::code_asm::*;

use super::{
    assemble, count_path_from, DetourAssembler, DetourCodeError, EventDetourParams, HotPath, Record, ReturnFields, Tail,
};
use crate::jump_bytes;

/// Bytes of one slot of the calls-in-flight table.
pub const RETURN_SLOT_SIZE: u32 = 128;
/// `log2(RETURN_SLOT_SIZE)`.
const SLOT_SHIFT: u32 = 7;
/// Bytes of one slot's stub (`push imm32` is 5 bytes, `jmp rel32` 5, int3 padding).
pub const RETURN_STUB_SIZE: u64 = 16;
/// `log2(RETURN_SLOT_SIZE / RETURN_STUB_SIZE)`: a slot's offset to its stub's.
const SLOT_TO_STUB_SHIFT: u8 = 3;
/// The `push imm32` opcode that starts every stub.
pub const STUB_OPCODE: u8 = 0x68;

/// Offsets in a slot.
pub const SLOT_OWNER: i32 = 0;
pub const SLOT_FRAME: i32 = 8;
pub const SLOT_RET: i32 = 16;
pub const SLOT_CALLER: i32 = 24;
pub const SLOT_TSC: i32 = 32;
pub const SLOT_ARGS: i32 = 40;
/// Most `$argN` words an entry saves (what fits in a slot).
pub const MAX_SAVED_ARGS: usize = ((RETURN_SLOT_SIZE as i32 - SLOT_ARGS) / 8) as usize;
/// Most nodes of `current->rethooks` an entry reads to find the guest's saved return
/// address (a task's kretprobes nest a few calls deep).
pub const MAX_RETHOOK_WALK: i32 = 16;

/// What a return probe's detour needs on top of an event detour's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReturnDetourParams {
    /// The calls-in-flight table, in memory the guest may write.
    pub table: Gva,
    /// Slots the table has.
    pub table_slots: u32,
    /// The probe's slots: `first_slot..first_slot + maxactive`.
    pub first_slot: u32,
    pub maxactive: u32,
    /// The out-of-line area's code (start, size): a return address in it may be a stub.
    pub code_area: (Gva, u64),
    /// The guest's kretprobes' list, to name the caller when the guest swapped first.
    pub rethooks: Option<RethookLayout>,
}

impl ReturnDetourParams {
    /// The address of slot `i` of the table.
    pub fn slot(&self, i: u32) -> Gva {
        Gva(self.table.0.wrapping_add(u64::from(i) * u64::from(RETURN_SLOT_SIZE)))
    }
}

/// The slot a stub at `at` (bytes `stub`, read from the guest) stands for, when it is one:
/// `push imm32` of a slot the table has.
pub fn stub_slot(stub: &[u8], table_slots: u32) -> Option<u32> {
    let [STUB_OPCODE, a, b, c, d, ..] = *stub else {
        return None;
    };
    let slot = u32::from_le_bytes([a, b, c, d]);
    (slot < table_slots).then_some(slot)
}

/// The return code's prologue: the slot the stub pushed, checked (one of the probe's, in
/// use, for this stack slot; else `no_call`), in the frame's slot register; the real
/// return address back in the stack slot. The stack slot names the call: no two calls in
/// flight share one (a tail call's share it through two slots and two stubs); the owner
/// is not compared with `current`, which a function such as `__switch_to` returns under
/// another task than it was entered under.
pub(super) fn take_call(
    code: &mut DetourAssembler<'_>,
    r: &ReturnDetourParams,
    no_call: CodeLabel,
) -> Result<(), DetourCodeError> {
    let (base, rsp0) = (code.frame.base, code.frame.rsp0);
    let slot = code
        .frame
        .slot
        .ok_or_else(|| DetourCodeError::Assemble("a return's code without a slot register".into()))?;
    code.asm().mov(eax, dword_ptr(base + rsp0))?;
    code.asm().sub(eax, r.first_slot as i32)?;
    code.asm().cmp(eax, r.maxactive as i32)?;
    code.asm().jae(no_call)?;
    code.asm().shl(rax, SLOT_SHIFT)?;
    code.asm().mov(slot, r.slot(r.first_slot).0)?;
    code.asm().add(slot, rax)?;
    code.asm().cmp(qword_ptr(slot + SLOT_OWNER), 0)?;
    code.asm().je(no_call)?;
    code.asm().lea(rax, qword_ptr(base + rsp0))?;
    code.asm().cmp(qword_ptr(slot + SLOT_FRAME), rax)?;
    code.asm().jne(no_call)?;
    code.asm().mov(rax, qword_ptr(slot + SLOT_RET))?;
    code.asm().mov(qword_ptr(base + rsp0), rax)?;
    Ok(())
}

/// Copies the call's caller, entry TSC and saved arguments from its slot into the record.
pub(super) fn copy_call(
    code: &mut DetourAssembler<'_>,
    fields: ReturnFields,
    saved: usize,
) -> Result<(), DetourCodeError> {
    let (rec, slot) = (code.frame.rec, code.frame.slot.unwrap_or(rsi));
    let mut moves = vec![(SLOT_CALLER, fields.caller as i32), (SLOT_TSC, fields.entry_tsc as i32)];
    moves.extend((0..saved as i32).map(|k| (SLOT_ARGS + 8 * k, fields.entry_tsc as i32 + 8 + 8 * k)));
    for (from, to) in moves {
        code.asm().mov(rax, qword_ptr(slot + from))?;
        code.asm().mov(qword_ptr(rec + to), rax)?;
    }
    Ok(())
}

/// The entry's code at `p.detour_ip`: see the module docs. `stubs` is where the probe's
/// first stub is; returns the code and where the displaced instructions landed.
fn entry_code(
    p: &EventDetourParams<'_>,
    r: &ReturnDetourParams,
    saved: &[u32],
    stubs: Gva,
    displaced: &[u8],
) -> Result<(Vec<u8>, Gva), DetourCodeError> {
    let mut code = DetourAssembler::new(p, super::Frame::new(false, false), None)?;
    let (base, rsp0) = (code.frame.base, code.frame.rsp0);
    let current = p.kernel.current_task.unwrap_or(0);
    let probe_missed = p
        .rings
        .probe_missed_gva(p.miss_slot)
        .ok_or(DetourCodeError::BadMissSlot {
            slot: p.miss_slot,
            slots: p.rings.geometry().probe_slots(),
        })?;
    let mut take = code.asm().create_label();
    let mut busy = code.asm().create_label();
    let mut resolved = code.asm().create_label();
    let mut chained = code.asm().create_label();
    let mut guest_swapped = code.asm().create_label();
    let mut restore = code.asm().create_label();
    let mut displaced_label = code.asm().create_label();

    code.asm().pushfq()?;
    code.asm().cli()?;
    for reg in code.frame.pushed() {
        code.asm.push(reg)?;
    }
    // A free slot of the probe's: owner 0 → current.
    code.asm().mov(rcx, qword_ptr(current as i64 as u64).gs())?;
    code.asm().mov(rbx, r.slot(r.first_slot).0)?;
    code.asm().mov(edx, r.maxactive)?;
    code.asm().set_label(&mut take)?;
    code.asm().xor(eax, eax)?;
    code.asm().lock().cmpxchg(qword_ptr(rbx + SLOT_OWNER), rcx)?;
    code.asm().jne(busy)?;
    // The call: its stack slot, return address and caller.
    code.asm().lea(rax, qword_ptr(base + rsp0))?;
    code.asm().mov(qword_ptr(rbx + SLOT_FRAME), rax)?;
    code.asm().mov(rdx, qword_ptr(rax))?;
    code.asm().mov(qword_ptr(rbx + SLOT_RET), rdx)?;
    code.asm().mov(qword_ptr(rbx + SLOT_CALLER), rdx)?;
    code.asm().mov(rax, r.code_area.0 .0)?;
    code.asm().mov(rcx, rdx)?;
    code.asm().sub(rcx, rax)?;
    code.asm().mov(rax, r.code_area.1)?;
    code.asm().cmp(rcx, rax)?;
    code.asm().jb(chained)?;
    if let Some(rethooks) = &r.rethooks {
        code.asm().mov(rax, rethooks.trampoline.0)?;
        code.asm().cmp(rdx, rax)?;
        code.asm().je(guest_swapped)?;
    }
    code.asm().set_label(&mut resolved)?;
    code.asm().rdtsc()?;
    code.asm().mov(dword_ptr(rbx + SLOT_TSC), eax)?;
    code.asm().mov(dword_ptr(rbx + (SLOT_TSC + 4)), edx)?;
    for (k, &n) in saved.iter().enumerate() {
        match n {
            1..=6 => code.read_register(rax, super::ARG_REGISTERS[n as usize - 1])?,
            n => code.checked_stack_word(rax, edx, n - 6)?,
        }
        code.asm().mov(qword_ptr(rbx + (SLOT_ARGS + 8 * k as i32)), rax)?;
    }
    // Only now, with the slot complete, the return goes through its stub.
    code.asm().mov(rax, rbx)?;
    code.asm().mov(rdx, r.slot(r.first_slot).0)?;
    code.asm().sub(rax, rdx)?;
    code.asm().shr(rax, SLOT_TO_STUB_SHIFT as u32)?;
    code.asm().mov(rdx, stubs.0)?;
    code.asm().add(rax, rdx)?;
    code.asm().mov(rdx, qword_ptr(rbx + SLOT_FRAME))?;
    code.asm().mov(qword_ptr(rdx), rax)?;
    code.asm().set_label(&mut restore)?;
    for reg in code.frame.pushed().iter().rev() {
        code.asm.pop(*reg)?;
    }
    code.asm().popfq()?;
    code.asm().set_label(&mut displaced_label)?;
    code.asm().db(displaced)?;

    // Cold: the next slot; none free.
    code.asm().set_label(&mut busy)?;
    code.asm().add(rbx, RETURN_SLOT_SIZE as i32)?;
    code.asm().dec(edx)?;
    code.asm().jne(take)?;
    code.inc_counter(probe_missed.0, true)?;
    code.asm().jmp(restore)?;
    // Cold: the return address is in our code: another probe's stub on this stack slot?
    // (rdx = the return address.)
    code.asm().set_label(&mut chained)?;
    code.asm().cmp(byte_ptr(rdx), STUB_OPCODE as i32)?;
    code.asm().jne(resolved)?;
    code.asm().mov(eax, dword_ptr(rdx + 1))?;
    code.asm().cmp(eax, r.table_slots as i32)?;
    code.asm().jae(resolved)?;
    code.asm().shl(rax, SLOT_SHIFT)?;
    code.asm().mov(rcx, r.table.0)?;
    code.asm().add(rax, rcx)?;
    code.asm().mov(rcx, qword_ptr(rax + SLOT_FRAME))?;
    code.asm().cmp(rcx, qword_ptr(rbx + SLOT_FRAME))?;
    code.asm().jne(resolved)?;
    code.asm().mov(rcx, qword_ptr(rax + SLOT_OWNER))?;
    code.asm().cmp(rcx, qword_ptr(rbx + SLOT_OWNER))?;
    code.asm().jne(resolved)?;
    code.asm().mov(rcx, qword_ptr(rax + SLOT_CALLER))?;
    code.asm().mov(qword_ptr(rbx + SLOT_CALLER), rcx)?;
    code.asm().jmp(resolved)?;
    // Cold: the guest's kretprobe swapped first: its node for this stack slot.
    if let Some(rethooks) = &r.rethooks {
        let to = |off: u64| -> Result<i32, DetourCodeError> {
            i32::try_from(off.wrapping_sub(rethooks.node_llist) as i64)
                .map_err(|_| DetourCodeError::Assemble("rethook_node offsets".into()))
        };
        let (frame, ret_addr) = (to(rethooks.node_frame)?, to(rethooks.node_ret_addr)?);
        let list = i32::try_from(rethooks.task_rethooks)
            .map_err(|_| DetourCodeError::Assemble("task_struct.rethooks offset".into()))?;
        let mut walk = code.asm().create_label();
        let mut found = code.asm().create_label();
        code.asm().set_label(&mut guest_swapped)?;
        code.asm().mov(rax, qword_ptr(current as i64 as u64).gs())?;
        code.asm().mov(rax, qword_ptr(rax + list))?;
        code.asm().mov(ecx, MAX_RETHOOK_WALK)?;
        code.asm().set_label(&mut walk)?;
        code.asm().test(rax, rax)?;
        code.asm().je(resolved)?;
        code.asm().mov(rdx, qword_ptr(rax + frame))?;
        code.asm().cmp(rdx, qword_ptr(rbx + SLOT_FRAME))?;
        code.asm().je(found)?;
        code.asm().mov(rax, qword_ptr(rax))?;
        code.asm().dec(ecx)?;
        code.asm().jne(walk)?;
        code.asm().jmp(resolved)?;
        code.asm().set_label(&mut found)?;
        code.asm().mov(rdx, qword_ptr(rax + ret_addr))?;
        code.asm().mov(qword_ptr(rbx + SLOT_CALLER), rdx)?;
        code.asm().jmp(resolved)?;
    }
    for c in std::mem::take(&mut code.cold) {
        if let super::Cold::Zero { mut label, dst, back } = c {
            code.asm().set_label(&mut label)?;
            code.asm().xor(super::low32(dst), super::low32(dst))?;
            code.asm().jmp(back)?;
        }
    }
    let result = code.asm.assemble_options(
        p.detour_ip.0,
        iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )?;
    let displaced_ip = result.label_ip(&displaced_label)?;
    Ok((result.inner.code_buffer, Gva(displaced_ip)))
}

/// The stubs of slots `first..first + count`, at `at`, each jumping to `return_code`.
fn stubs(first: u32, count: u32, at: Gva, return_code: Gva) -> Result<Vec<u8>, DetourCodeError> {
    let mut bytes = Vec::with_capacity(count as usize * RETURN_STUB_SIZE as usize);
    for i in 0..count {
        let ip = at.0 + u64::from(i) * RETURN_STUB_SIZE;
        // `push imm32` is 5 bytes; the jump follows it.
        let jump = jump_bytes(Gva(ip + 5), return_code).ok_or(DetourCodeError::OutOfReach {
            what: "the return code",
            from: Gva(ip),
            target: return_code,
        })?;
        bytes.push(STUB_OPCODE);
        bytes.extend_from_slice(&(first + i).to_le_bytes());
        bytes.extend_from_slice(&jump);
        bytes.resize(
            bytes.len().next_multiple_of(RETURN_STUB_SIZE as usize),
            hvprobe_arch::INT3,
        );
    }
    Ok(bytes)
}

fn align(at: u64) -> u64 {
    at.next_multiple_of(RETURN_STUB_SIZE)
}

/// A return probe's whole code at `p.detour_ip`: the entry, the return code, the stubs
/// (each part 16-byte aligned). Returns it, the hot path of a call (entry and return
/// together), where the first stub is, and the return code's
/// [`super::EventDetour::ring_counted_miss_ips`] (the entry's one miss count, a call with no
/// free slot, counts in no ring).
pub(super) fn return_detour(
    p: &EventDetourParams<'_>,
    r: &ReturnDetourParams,
    record: &Record<'_>,
    saved: &[u32],
) -> Result<(Vec<u8>, HotPath, Gva, Vec<Gva>), DetourCodeError> {
    let end = u64::from(r.first_slot) + u64::from(r.maxactive);
    if r.maxactive == 0 || end > u64::from(r.table_slots) {
        return Err(DetourCodeError::BadReturnSlots {
            first: r.first_slot,
            end,
            slots: r.table_slots,
        });
    }
    let mut displaced = (p.displaced)(p.detour_ip)?;
    let mut stubs_at = Gva(p.detour_ip.0);
    for _ in 0..8 {
        let (entry, displaced_ip) = entry_code(p, r, saved, stubs_at, &displaced)?;
        let return_at = Gva(align(p.detour_ip.0 + entry.len() as u64));
        let returning = assemble(p, return_at, record, Tail::Return(r))?;
        let ret = returning.code;
        let next_stubs = Gva(align(return_at.0 + ret.len() as u64));
        let again = (p.displaced)(displaced_ip)?;
        if next_stubs == stubs_at && again == displaced {
            let mut code = entry;
            code.resize((return_at.0 - p.detour_ip.0) as usize, hvprobe_arch::INT3);
            code.extend_from_slice(&ret);
            code.resize((stubs_at.0 - p.detour_ip.0) as usize, hvprobe_arch::INT3);
            code.extend_from_slice(&stubs(r.first_slot, r.maxactive, stubs_at, return_at)?);
            let at_entry = count_path_from(&code, p.detour_ip, p.detour_ip);
            let at_return = count_path_from(&code, p.detour_ip, stubs_at);
            let hot_path = HotPath {
                instructions: at_entry.instructions + at_return.instructions,
                calls: at_entry.calls + at_return.calls,
            };
            return Ok((code, hot_path, stubs_at, returning.ring_counted_miss_ips));
        }
        stubs_at = next_stubs;
        displaced = again;
    }
    Err(DetourCodeError::Assemble(
        "the return detour's layout did not settle".into(),
    ))
}
