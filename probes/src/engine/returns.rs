//! Return probes. Invariant: every followed call returns to its own caller, and each
//! return probe's handler runs once per call with that call's private data.
//!
//! Calls in flight are kept in chains, one per kernel stack — the host's equivalent of
//! Linux's per-task `kretprobe_instance` list: a task runs on its own kernel stack (and
//! interrupts on the per-CPU stacks), so one chain per stack orders the calls of one task,
//! last in first out. A stack is named by its 16 KiB-aligned region (`THREAD_SIZE` on
//! x86-64; a larger stack only splits into several chains, each still in order).
//!
//! - The trampoline is never recorded as a return address. When a call's return address
//!   already is the trampoline (a function tail-called by a followed function, or a second
//!   return probe on the same function), the new instance takes the real address from the
//!   instance already on that stack slot, and the return runs both handlers, latest first
//!   (what Linux's trampoline handler does when it walks past instances whose saved
//!   address is the trampoline).
//! - A call whose slot no longer holds the trampoline (nor the guest's own rethook
//!   trampoline, when its kretprobe swapped ours in turn) can no longer return through it:
//!   its frame was left (the task exited, the stack was reused). A new call on a slot
//!   overwrites it for sure (`call` wrote the return address there); instances below a new
//!   call on the same stack region are checked, and so are a probe's instances when it
//!   reaches `maxactive`. Those, and every call of a task that enters `do_exit`, are freed
//!   and counted, so calls that never return do not use up `maxactive`. A region may hold
//!   parts of two stacks (IRQ stacks are only page-aligned): the slot check keeps another
//!   stack's live calls, whose slots still hold the trampoline.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use hvprobe_arch::Gva;

use super::registry::Probe;
use super::stamps::Stamp;
use super::{BreakpointOutcome, EngineFault, HitContext, PreAction, ProbeId, Tracer};
use crate::machine::Vcpu;
use crate::regs::Regs;

/// The alignment and size of an x86-64 kernel stack (`THREAD_SIZE`, without KASAN).
const STACK_REGION: u64 = 16 << 10;
/// Most exit-free stubs followed from one stack slot to where its return goes (each is a
/// return probe on a function tail-called by the previous one's, or on the same one).
const MAX_STUBS_ON_A_SLOT: usize = 16;

/// A call a return probe follows.
struct Instance {
    probe: ProbeId,
    /// The stack slot that held the return address (RSP at the function's entry).
    slot: u64,
    /// Where the call returns to: never the trampoline.
    return_address: u64,
    /// The slot held the guest's own return trampoline at entry, or an exit-free return
    /// probe's stub that returns to ours: the guest's kretprobe or that probe swapped out
    /// what was there before (ours, for the calls already on this slot), so this call and
    /// the later ones on the slot return first, through that return, and the earlier ones
    /// when it returns to ours again.
    after_guest_swap: bool,
    /// The probe's private data for this call.
    data: Vec<u8>,
    /// When the call entered the function ([`Tracer::stamp`] at the entry's hit), for the
    /// return's record (a consumer draws the call as a slice from entry to return) and its
    /// `$duration`.
    entered: Stamp,
    /// The `$argN` the probe's fetch-args name, at the entry: what they read at the return
    /// (Linux 6.9+'s entry data).
    entry_args: Vec<(u32, Option<u64>)>,
}

#[derive(Default)]
pub(super) struct ReturnChains {
    /// Per stack region, in the order the calls were entered.
    chains: HashMap<u64, Vec<Instance>>,
    in_flight: HashMap<ProbeId, usize>,
}

fn region(slot: u64) -> u64 {
    slot & !(STACK_REGION - 1)
}

impl ReturnChains {
    pub fn len(&self) -> usize {
        self.in_flight.values().sum()
    }

    fn forget(&mut self, removed: &[Instance]) {
        for i in removed {
            if let Some(n) = self.in_flight.get_mut(&i.probe) {
                *n -= 1;
            }
        }
    }

    /// Frees the instances in `slot`'s stack region below `slot` that `alive` says can no
    /// longer return: frames left without a return.
    fn prune_below(&mut self, slot: u64, alive: impl Fn(&Instance) -> bool) -> usize {
        let Some(chain) = self.chains.get_mut(&region(slot)) else {
            return 0;
        };
        let (dead, live): (Vec<Instance>, Vec<Instance>) = chain.drain(..).partition(|i| i.slot < slot && !alive(i));
        *chain = live;
        self.forget(&dead);
        dead.len()
    }

    /// Frees every instance on `slot`: a new call just wrote its return address there.
    fn drop_at(&mut self, slot: u64) -> usize {
        let Some(chain) = self.chains.get_mut(&region(slot)) else {
            return 0;
        };
        let (dead, live): (Vec<Instance>, Vec<Instance>) = chain.drain(..).partition(|i| i.slot == slot);
        *chain = live;
        self.forget(&dead);
        dead.len()
    }

    /// The earliest instance on `slot`.
    fn first_at(&self, slot: u64) -> Option<&Instance> {
        self.chains.get(&region(slot))?.iter().find(|i| i.slot == slot)
    }

    /// The latest instance on `slot`.
    fn top_at(&self, slot: u64) -> Option<&Instance> {
        self.chains.get(&region(slot))?.iter().rev().find(|i| i.slot == slot)
    }

    /// Takes one of `probe`'s `maxactive` places, if one is free.
    fn reserve(&mut self, probe: ProbeId, maxactive: u32) -> bool {
        let n = self.in_flight.entry(probe).or_default();
        if *n >= maxactive as usize {
            return false;
        }
        *n += 1;
        true
    }

    /// Gives back a place [`reserve`](Self::reserve) took for a call not followed after all.
    fn unreserve(&mut self, probe: ProbeId) {
        if let Some(n) = self.in_flight.get_mut(&probe) {
            *n = n.saturating_sub(1);
        }
    }

    /// Records a call in the place reserved for it.
    fn push_reserved(&mut self, instance: Instance) {
        self.chains.entry(region(instance.slot)).or_default().push(instance);
    }

    /// Takes the instances on `slot` that return now, latest first: all of them, or those
    /// from the latest one entered after the guest's kretprobe swapped the slot on (see
    /// [`Instance::after_guest_swap`]).
    fn pop_at(&mut self, slot: u64) -> Vec<Instance> {
        let key = region(slot);
        let Some(chain) = self.chains.get_mut(&key) else {
            return Vec::new();
        };
        let on_slot: Vec<usize> = (0..chain.len()).filter(|&i| chain[i].slot == slot).collect();
        let first = on_slot.iter().rposition(|&i| chain[i].after_guest_swap).unwrap_or(0);
        let taking: Vec<usize> = on_slot[first..].to_vec();
        let mut returning = Vec::with_capacity(taking.len());
        for (n, i) in taking.into_iter().enumerate() {
            returning.push(chain.remove(i - n));
        }
        if chain.is_empty() {
            self.chains.remove(&key);
        }
        self.forget(&returning);
        returning.reverse();
        returning
    }

    /// Frees every instance on the stack `rsp` is on.
    fn drop_stack(&mut self, rsp: u64) -> usize {
        let dead = self.chains.remove(&region(rsp)).unwrap_or_default();
        self.forget(&dead);
        dead.len()
    }

    /// Frees the instances of `probe` for which `alive` is false.
    fn reclaim(&mut self, probe: ProbeId, alive: impl Fn(&Instance) -> bool) -> usize {
        let mut dead = Vec::new();
        for chain in self.chains.values_mut() {
            let (gone, keep): (Vec<Instance>, Vec<Instance>) =
                chain.drain(..).partition(|i| i.probe == probe && !alive(i));
            *chain = keep;
            dead.extend(gone);
        }
        self.chains.retain(|_, c| !c.is_empty());
        self.forget(&dead);
        dead.len()
    }
}

impl Tracer {
    fn lock_returns(&self) -> std::sync::MutexGuard<'_, ReturnChains> {
        self.returns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the call `i` can still return through the trampoline: its slot holds ours,
    /// or the guest's own rethook trampoline (the guest's kretprobe on the same function
    /// swapped ours after us, and returns to ours when it is done).
    fn still_swapped(&self, trampoline: Gva, i: &Instance) -> bool {
        let returns_to_us = |v: Gva| v == trampoline || self.is_guest_return_hook(v);
        match self.machine.kernel().read_u64(Gva(i.slot)) {
            Ok(v) if returns_to_us(self.through_exit_free_stubs(Gva(i.slot), Gva(v))) => true,
            // An exit-free return probe's call on the slot is returning (between the
            // function's `ret` and its code putting the real return address back, the slot
            // holds the stub's pushed slot number, or what an interrupt wrote there): its
            // slot still says where it returns to.
            Ok(_) => self
                .exit_free_slots_on(Gva(i.slot))
                .into_iter()
                .filter_map(|n| self.exit_free_field(n, crate::detour::event::returns::SLOT_RET))
                .any(|ret| returns_to_us(self.through_exit_free_stubs(Gva(i.slot), Gva(ret)))),
            Err(_) => false,
        }
    }

    /// The slots of the calls-in-flight table in use for a call whose return address was
    /// at `slot`.
    fn exit_free_slots_on(&self, slot: Gva) -> Vec<u32> {
        use crate::detour::event::returns::SLOT_FRAME;
        let (Some(table), Some(mem)) = (
            self.events.get().and_then(|s| s.returns.as_ref()),
            self.machine.event_memory(),
        ) else {
            return Vec::new();
        };
        table
            .in_use(mem)
            .into_iter()
            .filter(|&n| table.field(mem, n, SLOT_FRAME) == Some(slot.0))
            .collect()
    }

    /// Where a return through `to` at the stack slot `slot` goes after the exit-free
    /// return probes' stubs it passes (a function tail-called by a followed one: its entry
    /// kept our trampoline as the return address and put its stub in the slot): `to`
    /// itself when it is no stub in use for `slot`.
    fn through_exit_free_stubs(&self, slot: Gva, mut to: Gva) -> Gva {
        use crate::detour::event::returns::SLOT_RET;
        for _ in 0..MAX_STUBS_ON_A_SLOT {
            match self.exit_free_slot(slot, to) {
                Some(n) => match self.exit_free_field(n, SLOT_RET) {
                    Some(ret) => to = Gva(ret),
                    None => break,
                },
                None => break,
            }
        }
        to
    }

    /// The return address a followed call's stack slot stands for (the latest call on
    /// `slot`), for a stack walk that reads the trampoline there.
    /// Where a call whose return address at `slot` was `to` really returns: `to`, unless
    /// it is the guest's own return trampoline (its kretprobe swapped the address before
    /// ours saw it), then the address the guest's rethook node for that slot keeps — what
    /// the guest's own kretprobe event names as the caller.
    fn real_return_address(&self, cpu: usize, slot: Gva, to: Gva) -> Gva {
        if let Some(caller) = self.exit_free_caller(slot, to) {
            // The stub's entry found our trampoline (a function a followed one tail-called):
            // the caller is the one the first call followed on this slot returns to.
            if self.trampoline.get() == Some(&caller) {
                if let Some(first) = self.lock_returns().first_at(slot.0) {
                    return Gva(first.return_address);
                }
            }
            return caller;
        }
        if Some(to) != self.guest_return_trampoline {
            return to;
        }
        match self.machine.cpu_stacks(cpu) {
            Ok(view) => view
                .rethooks
                .and_then(|r| r.returns.iter().find(|n| n.frame == slot).map(|n| n.ret_addr))
                .unwrap_or(to),
            Err(e) => {
                tracing::debug!("vCPU {cpu}: the guest's rethooks: {e}");
                to
            }
        }
    }

    /// Whether `at` is where the guest's own return hooks (its kretprobes' trampoline, its
    /// function_graph tracer's `return_to_handler`) send a return whose address they
    /// swapped out, to return to it later.
    fn is_guest_return_hook(&self, at: Gva) -> bool {
        Some(at) == self.guest_return_trampoline || Some(at) == self.guest_graph_return
    }

    pub(super) fn return_address_at(&self, slot: Gva) -> Option<Gva> {
        self.lock_returns().top_at(slot.0).map(|i| Gva(i.return_address))
    }

    /// A return probe's entry: follow this call (swap its return address for the
    /// trampoline) unless `maxactive` calls are in flight or the entry handler declines.
    pub(super) fn enter_return_probe(&self, id: ProbeId, probe: &Probe, maxactive: u32, cpu: usize, regs: &mut Regs) {
        let Some(&trampoline) = self.trampoline.get() else {
            return;
        };
        // Stamped first, so that the entry's time is the hit's and not after our own work.
        let entered = self.stamp();
        let kernel = self.machine.kernel();
        let slot = regs.rsp;
        let missed = || {
            probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
        };
        let found = match kernel.read_u64(Gva(slot)) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(
                    "vCPU {cpu}: return probe at {}: reading the return address: {e}",
                    probe.address
                );
                return missed();
            }
        };
        let mut returns = self.lock_returns();
        let swapped_already = found == trampoline.0;
        // The guest's kretprobe or function_graph tracer, or an exit-free return probe's
        // entry (of a function a followed one tail-called), swapped our trampoline out:
        // this call returns first.
        let after_guest_swap = self.is_guest_return_hook(Gva(found))
            || (!swapped_already && self.through_exit_free_stubs(Gva(slot), Gva(found)) == trampoline);
        let mut abandoned = returns.prune_below(slot, |i| self.still_swapped(trampoline, i));
        let return_address = if swapped_already {
            if returns
                .chains
                .get(&region(slot))
                .is_some_and(|c| c.iter().any(|i| i.slot == slot && i.probe == id))
            {
                // This probe follows this call already: the entry ran again (its
                // instruction was re-executed after a fault), not a new call.
                return;
            }
            match returns.top_at(slot) {
                Some(outer) => outer.return_address,
                None => {
                    tracing::error!(
                        "vCPU {cpu}: return probe at {}: the return address at {slot:#x} is the trampoline, \
                         but no call is on record there: not followed",
                        probe.address
                    );
                    return missed();
                }
            }
        } else {
            // `call` just wrote a real return address here: whatever was followed on this
            // slot before can no longer return through it. Unless it is the guest's own
            // return trampoline: its kretprobe swapped out what was there — ours, when we
            // follow this call already (a tail call) — and returns to it later.
            if !after_guest_swap {
                abandoned += returns.drop_at(slot);
            }
            found
        };
        let mut reserved = returns.reserve(id, maxactive);
        if !reserved {
            abandoned += returns.reclaim(id, |i| self.still_swapped(trampoline, i));
            reserved = returns.reserve(id, maxactive);
        }
        drop(returns);
        self.stats
            .returns_abandoned
            .fetch_add(abandoned as u64, Ordering::Relaxed);
        if !reserved {
            return missed();
        }
        let numbers = crate::fetch::args_named(&probe.args);
        let entry_args = match numbers.as_slice() {
            [] => Vec::new(),
            numbers => crate::fetch::entry_args(
                numbers,
                &crate::fetch::FetchContext {
                    regs,
                    kernel,
                    user: None,
                    symbols: &self.view.symbols,
                    comm: None,
                    retval: None,
                    entry: None,
                },
            ),
        };
        let mut data = vec![0u8; probe.data_size];
        if let Some(entry) = &probe.pre {
            let shown_rip = regs.rip;
            regs.rip = probe.address.0;
            let mut ctx = HitContext {
                probe: id,
                cpu,
                address: probe.address,
                regs,
                kernel,
                data: &mut data,
            };
            let declined = entry(&mut ctx) == PreAction::Skip;
            regs.rip = shown_rip;
            if declined {
                self.lock_returns().unreserve(id);
                return;
            }
        }
        tracing::trace!(
            "vCPU {cpu}: return probe at {}: follows the call returning to {return_address:#x} from {slot:#x} \
             (found {found:#x}; {abandoned} abandoned)",
            probe.address
        );
        if !swapped_already {
            if let Err(e) = kernel.write_virt(Gva(slot), &trampoline.0.to_le_bytes()) {
                tracing::error!("vCPU {cpu}: return probe at {}: {e}", probe.address);
                self.lock_returns().unreserve(id);
                return missed();
            }
        }
        self.lock_returns().push_reserved(Instance {
            probe: id,
            slot,
            return_address,
            after_guest_swap,
            data,
            entered,
            entry_args,
        });
    }

    /// A task entered `do_exit` on the stack `rsp` is on: nothing on its stack will
    /// return. Its trapped calls go, and its exit-free ones when `task` (its
    /// `task_struct`) is known.
    pub(super) fn task_exits(&self, rsp: u64, task: Option<Gva>) {
        let freed = self.lock_returns().drop_stack(rsp);
        self.stats.returns_abandoned.fetch_add(freed as u64, Ordering::Relaxed);
        if let Some(task) = task {
            self.exit_free_calls_end(task);
        }
    }

    /// The task at `task` entered `do_exit` (its calls in flight are its callers, which
    /// never return) or is being freed (its calls made in `do_exit` after that hook, its
    /// final schedule among them, never return either): frees the calls exit-free return
    /// probes follow for it in the guest. Freeing at `do_exit` keeps `maxactive` from
    /// running out when tasks exit faster than RCU frees them (Linux frees a task's
    /// kretprobe instances only then). Only the owner's own entries write a slot's owner,
    /// and that task runs none now: a slot another task is taking is never touched.
    pub(super) fn exit_free_calls_end(&self, task: Gva) {
        if let (Some(table), Some(mem)) = (
            self.events.get().and_then(|s| s.returns.as_ref()),
            self.machine.event_memory(),
        ) {
            let freed = table.free_owned_by(mem, task);
            self.stats.returns_abandoned.fetch_add(freed as u64, Ordering::Relaxed);
        }
    }

    /// Where a call an exit-free return probe follows returns to, when `to` is one of its
    /// stubs (read at the stack slot `slot`): the caller the entry recorded in the call's
    /// slot, if that slot is in use for `slot`. `None` when `to` is no stub of ours.
    pub(super) fn exit_free_caller(&self, slot: Gva, to: Gva) -> Option<Gva> {
        let n = self.exit_free_slot(slot, to)?;
        self.exit_free_field(n, crate::detour::event::returns::SLOT_CALLER)
            .map(Gva)
    }

    /// The slot of the calls-in-flight table whose stub `to` is, when that slot is in use
    /// for a call whose return address was at `slot`.
    fn exit_free_slot(&self, slot: Gva, to: Gva) -> Option<u32> {
        use crate::detour::event::returns::{stub_slot, SLOT_FRAME, SLOT_OWNER};
        // Stubs are in the out-of-line area's code, which the guest cannot write.
        if !self.ool.is_some_and(|a| a.contains(to)) {
            return None;
        }
        let table = self.events.get()?.returns.as_ref()?;
        let mut stub = [0u8; 5];
        self.machine.kernel().read_virt(to, &mut stub).ok()?;
        let n = stub_slot(&stub, table.slots)?;
        let in_use = self.exit_free_field(n, SLOT_OWNER).is_some_and(|o| o != 0);
        (in_use && self.exit_free_field(n, SLOT_FRAME) == Some(slot.0)).then_some(n)
    }

    /// A field of slot `n` of the calls-in-flight table (guest memory).
    fn exit_free_field(&self, n: u32, field: i32) -> Option<u64> {
        let table = self.events.get()?.returns.as_ref()?;
        table.field(self.machine.event_memory()?, n, field)
    }

    /// The trampoline's int3: followed calls returned. Their return handlers and events,
    /// latest first, then back to the caller.
    pub(super) fn handle_return(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> BreakpointOutcome {
        let at = *self.trampoline.get().expect("a return implies a trampoline");
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(source) => return BreakpointOutcome::Fatal(EngineFault::Vcpu { cpu, at, source }),
        };
        // `ret` popped the slot that held the trampoline's address.
        let slot = regs.rsp.wrapping_sub(8);
        let returning = {
            let mut returns = self.lock_returns();
            let abandoned = returns.prune_below(slot, |i| self.still_swapped(at, i));
            self.stats
                .returns_abandoned
                .fetch_add(abandoned as u64, Ordering::Relaxed);
            returns.pop_at(slot)
        };
        tracing::trace!(
            "vCPU {cpu}: return through the trampoline from {slot:#x}: {} call(s)",
            returning.len()
        );
        let Some(return_address) = returning.first().map(|i| i.return_address) else {
            return BreakpointOutcome::Fatal(EngineFault::UnknownReturn { cpu, slot });
        };
        regs.rip = return_address;
        let reg = self.read_registry();
        let kernel = self.machine.kernel();
        let mut caller = None;
        let mut task = None;
        for mut instance in returning {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            let Some(probe) = reg.probes.get(&instance.probe).filter(|p| p.enabled) else {
                continue;
            };
            probe.counters.hits.fetch_add(1, Ordering::Relaxed);
            if probe.emit_events {
                let task = task.get_or_insert_with(|| vcpu.current_task());
                let entry = super::events::CallEntry {
                    args: &instance.entry_args,
                    at: instance.entered,
                };
                let mut event = self.hit_event(instance.probe, probe, cpu, &regs, task.as_ref(), vcpu, Some(entry));
                event.record.retprobe_caller = Some(
                    caller
                        .get_or_insert_with(|| {
                            let to = self.real_return_address(cpu, Gva(slot), Gva(return_address));
                            self.describe_frame(to).unwrap_or_else(|| format!("{:#x}", to.0))
                        })
                        .clone(),
                );
                event.record.entry_timestamp_ns = Some(instance.entered.ns);
                self.send_event(probe, event);
            }
            if let Some(ret) = &probe.post {
                let mut ctx = HitContext {
                    probe: instance.probe,
                    cpu,
                    address: probe.address,
                    regs: &mut regs,
                    kernel,
                    data: &mut instance.data,
                };
                ret(&mut ctx);
            }
        }
        match vcpu.set_regs(&regs) {
            Ok(()) => BreakpointOutcome::Handled,
            Err(source) => BreakpointOutcome::Fatal(EngineFault::Vcpu { cpu, at, source }),
        }
    }
}
