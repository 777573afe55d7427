//! What a hit records. Invariant: every hit of a probe that emits events either reaches
//! the consumer or is counted in the probe's `nmissed` — never dropped silently, and never
//! waited for (a vCPU does not stall on a slow consumer).

use hvprobe_introspection::task::TaskInfo;
use std::sync::atomic::Ordering;

use super::registry::{Probe, Registry, Site};
use super::stamps::Stamp;
use super::{HitEvent, ProbeId, ProbeKind, Tracer};
use crate::fetch::{evaluate, ArgValue, EntryValues, FetchContext};
use crate::machine::Vcpu;
use crate::output::HitRecord;
use crate::regs::Regs;
use crate::spec::{ArgType, FetchArg, FetchExpr, Register};

/// A return's call entry, as its event reads it: the `$argN` saved then, and when.
pub(super) struct CallEntry<'a> {
    pub args: &'a [(u32, Option<u64>)],
    pub at: Stamp,
}

impl Tracer {
    pub(super) fn send_event(&self, probe: &Probe, event: HitEvent) {
        if !self.sink.as_ref().is_some_and(|s| s.try_send(event)) {
            probe.counters.nmissed.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn count_missed(&self, reg: &Registry, site: &Site) {
        for id in &site.probes {
            if let Some(p) = reg.probes.get(id).filter(|p| p.enabled) {
                p.counters.nmissed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The event of a hit; `entry` is the call's entry when this is a return (its time and
    /// the arguments it saved).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hit_event(
        &self,
        id: ProbeId,
        probe: &Probe,
        cpu: usize,
        regs: &Regs,
        task: Option<&TaskInfo>,
        vcpu: &mut dyn Vcpu,
        entry: Option<CallEntry<'_>>,
    ) -> HitEvent {
        // Stamped before the fetch-args are read: the hit's time, and `$duration`'s end.
        let stamp = self.stamp();
        let timestamp_ns = stamp.ns;
        let comm = task.map(|t| t.comm.clone());
        let mut fetch_regs = *regs;
        if probe.args.iter().any(names_a_segment) {
            match vcpu.segment_selectors() {
                Ok(s) => {
                    fetch_regs.cs = u64::from(s.cs);
                    fetch_regs.ss = u64::from(s.ss);
                }
                Err(e) => tracing::warn!("vCPU {cpu}: {e}: %cs/%ss read as 0"),
            }
        }
        let user = if probe.args.iter().any(needs_user_memory) {
            vcpu.user_memory()
        } else {
            None
        };
        let ctx = FetchContext {
            regs: &fetch_regs,
            kernel: self.machine.kernel(),
            user: user.as_deref(),
            symbols: &self.view.symbols,
            comm: comm.as_deref(),
            retval: matches!(probe.kind, ProbeKind::Kretprobe { .. }).then_some(regs.rax),
            entry: entry.map(|entry| EntryValues {
                args: entry.args,
                duration_ns: stamp.since(&entry.at),
            }),
        };
        let args: Vec<(String, ArgValue)> = probe
            .args
            .iter()
            .map(|arg| (arg.name.clone(), evaluate(arg, &ctx)))
            .collect();
        let stack = probe.stack_trace.then(|| self.kernel_stack(cpu, regs));
        let mut record = hit_record(probe, comm, task.map(|t| t.pid), cpu, timestamp_ns, args);
        record.stack = stack;
        HitEvent {
            probe: id,
            address: probe.address,
            regs: *regs,
            record,
        }
    }
}

/// A kprobe hit's record, as printed: an unknown task is `<...>` with pid -1, as ftrace
/// shows one.
pub(super) fn hit_record(
    probe: &Probe,
    comm: Option<String>,
    pid: Option<i32>,
    cpu: usize,
    timestamp_ns: u64,
    args: Vec<(String, ArgValue)>,
) -> HitRecord {
    HitRecord {
        comm: comm.unwrap_or_else(|| "<...>".into()),
        pid: pid.unwrap_or(-1),
        cpu,
        timestamp_ns,
        group: probe.group.clone(),
        event: probe.event.clone(),
        location: probe.trace_location.clone(),
        retprobe_caller: None,
        args,
        entry_timestamp_ns: None,
        stack: None,
    }
}

fn expr_any(e: &FetchExpr, pred: &dyn Fn(&FetchExpr) -> bool) -> bool {
    pred(e)
        || match e {
            FetchExpr::Deref { base, .. } => expr_any(base, pred),
            _ => false,
        }
}

fn needs_user_memory(arg: &FetchArg) -> bool {
    arg.ty == ArgType::UString || expr_any(&arg.expr, &|e| matches!(e, FetchExpr::Deref { user: true, .. }))
}

/// `%cs` or `%ss` anywhere in the fetch-arg.
fn names_a_segment(arg: &FetchArg) -> bool {
    expr_any(&arg.expr, &|e| {
        matches!(e, FetchExpr::Register(Register::Cs | Register::Ss))
    })
}
