//! Kernel stacks at a hit. Invariant: a stack is read only while the hitting vCPU is
//! stopped, only within that CPU's own stacks, and a return probe's trampoline never
//! stands for a caller: a slot that holds it is read as the return address it replaced.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use hvprobe_arch::Gva;
use hvprobe_introspection::unwind::{unwind, OrcTable, StartRegs, UnwindEnd};

use super::Tracer;
use crate::output::StackFrame;
use crate::regs::Regs;

/// At most this many frame descriptions are kept (a few MiB); then they start over.
const MAX_FRAME_NAMES: usize = 1 << 16;

impl Tracer {
    /// The guest's ORC data, read from its memory on first use (a run that never asks
    /// for a stack never reads it); `None`, logged once, when the guest has none.
    fn orc(&self) -> Option<&Arc<OrcTable>> {
        self.orc
            .get_or_init(|| match OrcTable::read(self.machine.kernel(), &self.view.symbols) {
                Ok(t) => {
                    tracing::info!("kernel stacks: {} ORC entries read from the guest", t.len());
                    Some(Arc::new(t))
                }
                Err(e) => {
                    tracing::warn!("kernel stacks cannot be unwound: {e}");
                    None
                }
            })
            .as_ref()
    }

    /// The kernel stack of the task stopped on `cpu` with `regs`, innermost first (the
    /// stopped address, then each caller's return address). Where the walk cannot go on
    /// (no ORC data, a stack that is not where it should be) it ends, and says why in
    /// the log; the frames found so far are the stack.
    pub(super) fn kernel_stack(&self, cpu: usize, regs: &Regs) -> Vec<StackFrame> {
        // Read once, before the clock starts: the per-hit cost is the walk's.
        let orc = self.orc();
        let started = Instant::now();
        let frames = match orc.and_then(|orc| self.unwound(orc, cpu, regs)) {
            Some((_, Some(UnwindEnd::NotText(ip)))) if self.relist_modules_for(ip) => {
                // Code of a module loaded since the list was read: once more with it.
                orc.and_then(|orc| self.unwound(orc, cpu, regs))
                    .map_or_else(|| vec![Gva(regs.rip)], |(f, _)| f)
            }
            Some((frames, _)) => frames,
            None => vec![Gva(regs.rip)],
        };
        let stack = {
            let mut names = self.frame_names.lock().unwrap_or_else(|e| e.into_inner());
            if names.len() > MAX_FRAME_NAMES {
                names.clear();
            }
            frames
                .into_iter()
                .map(|address| StackFrame {
                    address,
                    symbol: names
                        .entry(address)
                        .or_insert_with(|| self.describe_frame(address))
                        .clone(),
                })
                .collect()
        };
        self.stats.stacks_unwound.fetch_add(1, Ordering::Relaxed);
        self.stats
            .unwind_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        stack
    }

    /// `func+0xoff/0xsize`, with ` [mod]` for a module's code, as ftrace's stack traces
    /// print a frame.
    pub(super) fn describe_frame(&self, address: Gva) -> Option<String> {
        if let Some(d) = self.view.symbols.describe(address) {
            return Some(d.to_string());
        }
        let module = self.module_containing(address)?;
        let d = module.symbols.describe(address)?;
        Some(format!("{d} [{}]", module.name))
    }

    /// The frames, and how the walk ended when it ended early.
    fn unwound(&self, orc: &OrcTable, cpu: usize, regs: &Regs) -> Option<(Vec<Gva>, Option<UnwindEnd>)> {
        let view = match self.machine.cpu_stacks(cpu) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("vCPU {cpu}: kernel stacks: {e}");
                return None;
            }
        };
        let trampoline = self.trampoline.get().copied();
        let recover = |ip: Gva, slot: Gva| match trampoline {
            Some(t) if t == ip => self.return_address_at(slot).unwrap_or(ip),
            _ => self.exit_free_caller(slot, ip).unwrap_or(ip),
        };
        let start = StartRegs {
            ip: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
            // A hit is in kernel mode; `cs` is not read at every hit.
            cs: 0,
            r10: regs.r10,
            r13: regs.r13,
            di: regs.rdi,
            dx: regs.rdx,
        };
        let modules = self.loaded_modules();
        let tables = super::modules::KernelAndLoaded {
            kernel: orc,
            modules: &modules,
        };
        let walked = unwind(
            &tables,
            self.machine.kernel(),
            start,
            &view.stacks,
            view.rethooks.as_ref(),
            &recover,
        );
        if let UnwindEnd::Error(why) = &walked.end {
            tracing::debug!("vCPU {cpu}: the stack at {:#x} ends early: {why}", regs.rip);
        }
        let end = matches!(walked.end, UnwindEnd::NotText(_)).then_some(walked.end);
        Some((walked.frames, end))
    }
}
