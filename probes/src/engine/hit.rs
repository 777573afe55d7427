//! An int3 exit. Invariant: every enabled probe of the site runs once per hit, and the
//! vCPU is left where the guest expects it — past the probed instruction, in its copy for
//! a step, on its own int3 with its #BP to come, or back on the original instruction after
//! a disarm — or the VM stops with the reason. An int3 is never answered with "handled"
//! while it stays in the text unexecuted, which would loop on it forever.

use std::sync::atomic::Ordering;
use std::time::Instant;

use hvprobe_arch::{Gva, INT3};

use super::registry::{Registry, Role, Site};
use super::{BreakpointOutcome, EngineFault, HitContext, PreAction, ProbeId, ProbeKind, StepOutcome, Tracer};
use crate::insn::{Execution, InsnError};
use crate::machine::Vcpu;
use crate::regs::Regs;

impl Tracer {
    /// An int3 exit at `at` on vCPU `cpu`.
    pub fn on_breakpoint(&self, cpu: usize, vcpu: &mut dyn Vcpu, at: Gva) -> BreakpointOutcome {
        let started = Instant::now();
        let outcome = self.handle_breakpoint(cpu, vcpu, at);
        self.stats
            .handling_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }

    /// A single-step exit on vCPU `cpu`: the end of an out-of-line step.
    pub fn on_single_step(&self, cpu: usize, vcpu: &mut dyn Vcpu) -> StepOutcome {
        let started = Instant::now();
        let outcome = self.handle_single_step(cpu, vcpu);
        self.stats
            .handling_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }

    fn handle_breakpoint(&self, cpu: usize, vcpu: &mut dyn Vcpu, at: Gva) -> BreakpointOutcome {
        if self.trampoline.get() == Some(&at) {
            return self.handle_return(cpu, vcpu);
        }
        if self.in_out_of_line_area(at) {
            let reg = self.read_registry();
            if let Some(code) = reg
                .detour_codes
                .get(&at)
                .filter(|c| c.kind == super::site_jump::DetourKind::Sync)
            {
                let site = code.site;
                return self.detour_hit(cpu, vcpu, at, site, &reg);
            }
            drop(reg);
            if let Some(outcome) = self.step_trap_lost(cpu, vcpu, at) {
                return match outcome {
                    StepOutcome::Fatal(fault) => BreakpointOutcome::Fatal(fault),
                    _ => BreakpointOutcome::Handled,
                };
            }
            match self.step_guard_breakpoint(cpu, vcpu, at) {
                Some(StepOutcome::Fatal(fault)) => return BreakpointOutcome::Fatal(fault),
                Some(_) => return BreakpointOutcome::Handled,
                None => {}
            }
            // Only the trampoline, the detours' and the step guard's int3s are ours there;
            // the guest has no code there. A #BP injected here would take the guest down in
            // its own handler.
            return BreakpointOutcome::Fatal(EngineFault::UnknownOutOfLineBreakpoint { cpu, at });
        }
        if let Some(hook) = self.modules.hook_at(at) {
            // Before the site's own handling and with no lock held: it arms or disarms
            // module probes, which the vCPU must find done when it goes on.
            self.on_module_hook(hook, cpu, vcpu);
        }
        let reg = self.read_registry();
        let Some(site) = reg.sites.get(&at) else {
            return BreakpointOutcome::NotOurs;
        };
        if !site.armed || site.gone {
            return self.unarmed_site(at, site);
        }
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(source) => {
                self.count_missed(&reg, site);
                return BreakpointOutcome::Fatal(EngineFault::Vcpu { cpu, at, source });
            }
        };
        let at_hit = regs;
        let kernel = self.machine.kernel();
        let (action, posts) = self.run_pre_handlers(&reg, site, at, cpu, vcpu, &mut regs);
        if site.shared_with_guest() {
            // The guest's int3 handler expects RIP where it was; it executes the original
            // instruction itself.
            self.stats.shared_with_guest.fetch_add(1, Ordering::Relaxed);
            if regs != at_hit {
                if let Err(source) = vcpu.set_regs(&regs) {
                    return BreakpointOutcome::Fatal(EngineFault::Vcpu { cpu, at, source });
                }
            }
            // A handler that moved RIP took the guest elsewhere: its int3 was not reached.
            return if regs.rip != at.0 {
                BreakpointOutcome::Handled
            } else {
                BreakpointOutcome::HandledThenGuest
            };
        }
        if action == PreAction::Skip {
            if regs.rip == at.0 {
                return BreakpointOutcome::Fatal(EngineFault::SkipWithoutRip { cpu, at });
            }
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
            return match vcpu.set_regs(&regs) {
                Ok(()) => BreakpointOutcome::Handled,
                Err(source) => BreakpointOutcome::Fatal(EngineFault::Vcpu { cpu, at, source }),
            };
        }
        let Some(insn) = site.insn.as_ref() else {
            return BreakpointOutcome::NotOurs;
        };
        match &insn.execution {
            Execution::Emulate(emulation) => {
                match emulation.execute(insn, &mut regs, &mut super::KernelStack(kernel)) {
                    Ok(()) => {}
                    Err(source @ InsnError::Stack { .. }) => {
                        // The host cannot complete it (a stack page not present, a guard
                        // page): step it, and the CPU raises the fault the guest expects.
                        let Some(slot) = site.slot else {
                            return BreakpointOutcome::Fatal(EngineFault::NoFallback {
                                cpu,
                                at,
                                insn: insn.disassembly(),
                                source: Box::new(source),
                            });
                        };
                        self.stats.emulation_fallbacks.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("vCPU {cpu}: {source}: stepping the instruction instead");
                        return match self.start_step(cpu, vcpu, &mut regs, insn, slot, at, posts) {
                            Ok(()) => BreakpointOutcome::Handled,
                            Err(fault) => BreakpointOutcome::Fatal(fault),
                        };
                    }
                    Err(source) => {
                        return BreakpointOutcome::Fatal(EngineFault::Insn {
                            cpu,
                            at,
                            source: Box::new(source),
                        })
                    }
                }
                self.stats.emulated.fetch_add(1, Ordering::Relaxed);
                drop(reg);
                self.run_posts(cpu, &posts, &mut regs);
                match vcpu.set_regs(&regs) {
                    Ok(()) => BreakpointOutcome::Handled,
                    Err(source) => BreakpointOutcome::Fatal(EngineFault::Vcpu { cpu, at, source }),
                }
            }
            Execution::Step(_) => {
                let Some(slot) = site.slot else {
                    return BreakpointOutcome::Fatal(EngineFault::NoFallback {
                        cpu,
                        at,
                        insn: insn.disassembly(),
                        source: Box::new(InsnError::NotStepped {
                            addr: at,
                            bytes: crate::insn::HexBytes(insn.bytes.clone()),
                        }),
                    });
                };
                match self.start_step(cpu, vcpu, &mut regs, insn, slot, at, posts) {
                    Ok(()) => BreakpointOutcome::Handled,
                    Err(fault) => BreakpointOutcome::Fatal(fault),
                }
            }
            // Refused at registration: a site never holds one.
            Execution::Refuse(_) => BreakpointOutcome::NotOurs,
        }
    }

    /// Runs the pre-handlers (and events, return-probe entries, the task-exit hook) of
    /// every enabled probe of the site at `at`, with the registers of the hit: what the
    /// handlers asked for, and the post-handlers to run after the instruction.
    fn run_pre_handlers(
        &self,
        reg: &Registry,
        site: &Site,
        at: Gva,
        cpu: usize,
        vcpu: &mut dyn Vcpu,
        regs: &mut Regs,
    ) -> (PreAction, Vec<(ProbeId, Gva)>) {
        let kernel = self.machine.kernel();
        let mut posts = Vec::new();
        let mut action = PreAction::Continue;
        let mut task = None;
        let mut task_exit = false;
        for id in &site.probes {
            let Some(probe) = reg.probes.get(id).filter(|p| p.enabled) else {
                continue;
            };
            match probe.role {
                Role::TaskExit => {
                    task_exit = true;
                    continue;
                }
                Role::TaskFree => {
                    // `__put_task_struct(tsk)` or `free_task(tsk)`: nothing of that task runs
                    // any more.
                    self.exit_free_calls_end(Gva(regs.rdi));
                    continue;
                }
                // Handled before the site (see `on_module_hook`).
                Role::ModuleLoad | Role::ModuleFree => continue,
                Role::User => {}
            }
            if let ProbeKind::Kretprobe { maxactive } = probe.kind {
                self.enter_return_probe(*id, probe, maxactive, cpu, regs);
                continue;
            }
            probe.counters.hits.fetch_add(1, Ordering::Relaxed);
            // A probe moved past an ftrace NOP shows the registers of its own address
            // (the NOP changes nothing but RIP), as the guest's ftrace-based kprobe would.
            let moved = probe.address != at;
            if moved {
                regs.rip = probe.address.0;
            }
            if probe.emit_events {
                let task = task.get_or_insert_with(|| vcpu.current_task());
                let event = self.hit_event(*id, probe, cpu, regs, task.as_ref(), vcpu, None);
                self.send_event(probe, event);
            }
            if let Some(pre) = &probe.pre {
                let mut ctx = HitContext {
                    probe: *id,
                    cpu,
                    address: probe.address,
                    regs,
                    kernel,
                    data: &mut [],
                };
                action = pre(&mut ctx);
            }
            if moved && regs.rip == probe.address.0 {
                regs.rip = at.0;
            }
            if probe.post.is_some() {
                posts.push((*id, probe.address));
            }
            if action == PreAction::Skip {
                break;
            }
        }
        if task_exit {
            // After the task's own probes on `do_exit`: nothing on its stack returns.
            let exiting = task.get_or_insert_with(|| vcpu.current_task());
            self.task_exits(regs.rsp, exiting.as_ref().map(|t| t.address));
        }
        (action, posts)
    }

    /// The int3 of a sync detour at `code`, reached through the jump at `site_addr`: the
    /// handlers run with RIP at the probe address, then the relocated instructions after
    /// the int3 run natively (one exit per hit, whatever the instruction). A handler that
    /// set RIP elsewhere (and `Skip`) is obeyed. A retired detour (its site unoptimized or
    /// gone while a vCPU was on its way in) still runs the site's handlers, if any.
    fn detour_hit(
        &self,
        cpu: usize,
        vcpu: &mut dyn Vcpu,
        code: Gva,
        site_addr: Gva,
        reg: &Registry,
    ) -> BreakpointOutcome {
        let resume = Gva(code.0 + 1);
        let mut regs = match vcpu.regs() {
            Ok(r) => r,
            Err(source) => {
                return BreakpointOutcome::Fatal(EngineFault::Vcpu {
                    cpu,
                    at: site_addr,
                    source,
                })
            }
        };
        regs.rip = site_addr.0;
        let mut action = PreAction::Continue;
        match reg.sites.get(&site_addr).filter(|s| !s.gone) {
            Some(site) => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                self.stats.optimized.fetch_add(1, Ordering::Relaxed);
                let (asked, posts) = self.run_pre_handlers(reg, site, site_addr, cpu, vcpu, &mut regs);
                action = asked;
                // Only a probe added while a vCPU was on its way into a retired detour
                // can have one: its instruction is not stepped, so it cannot run.
                for (id, _) in posts {
                    if let Some(probe) = reg.probes.get(&id) {
                        probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            None => {
                self.stats.stale.fetch_add(1, Ordering::Relaxed);
            }
        }
        if action == PreAction::Skip && regs.rip == site_addr.0 {
            return BreakpointOutcome::Fatal(EngineFault::SkipWithoutRip { cpu, at: site_addr });
        }
        if regs.rip == site_addr.0 {
            regs.rip = resume.0;
        } else {
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
        }
        match vcpu.set_regs(&regs) {
            Ok(()) => BreakpointOutcome::Handled,
            Err(source) => BreakpointOutcome::Fatal(EngineFault::Vcpu {
                cpu,
                at: site_addr,
                source,
            }),
        }
    }

    fn in_out_of_line_area(&self, at: Gva) -> bool {
        self.ool.is_some_and(|a| a.contains(at))
    }

    /// An int3 exit at a site whose int3 we do not have in the text right now (disabled,
    /// globally disarmed, or gone). Whatever is there now decides: an int3 is the guest's
    /// (its own kprobe or text_poke), anything else is the original instruction we put back
    /// after this vCPU trapped, which simply runs again.
    fn unarmed_site(&self, at: Gva, site: &Site) -> BreakpointOutcome {
        let mut now = [0u8];
        match self.machine.kernel().read_virt(at, &mut now) {
            Ok(()) if now[0] != INT3 => {
                self.stats.stale.fetch_add(1, Ordering::Relaxed);
                BreakpointOutcome::Handled
            }
            Ok(()) => BreakpointOutcome::NotOurs,
            Err(e) => {
                tracing::error!(
                    "int3 exit at {at} (a site of ours, {}): cannot read it back: {e}; the guest gets the #BP",
                    if site.gone { "gone" } else { "disarmed" }
                );
                BreakpointOutcome::NotOurs
            }
        }
    }
}
