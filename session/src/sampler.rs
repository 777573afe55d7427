//! A host-side sampling profiler of the guest: pauses all vCPUs at a fixed period, notes
//! where each one was, and names the guest functions it was in. It needs nothing in the
//! guest; it is how the bundled guest's boot was trimmed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use hvprobe_arch::Gva;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::task::TaskInfo;
use hvprobe_vmm::VcpuControl;
use vm_memory::GuestMemoryMmap;

use hvprobe_live::{live_memory, TaskContext};

/// Where one vCPU was when it was sampled.
#[derive(Clone, Debug)]
pub struct Sample {
    pub rip: u64,
    pub user_mode: bool,
    /// The running task, once the kernel is up and its `task_struct` layout known.
    pub task: Option<TaskInfo>,
}

/// A running sampler.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    /// Starts sampling every `period`. Tasks are named once `tasks` is filled in.
    pub fn start(
        control: Arc<VcpuControl>,
        mem: GuestMemoryMmap,
        period: Duration,
        tasks: Arc<OnceLock<TaskContext>>,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop_flag.load(Ordering::Relaxed) && control.stop_reason().is_none() {
                std::thread::sleep(period);
                let paused = match control.pause_all() {
                    Ok(paused) => paused,
                    Err(e) => {
                        tracing::warn!("sampler: a sample skipped: {e}");
                        continue;
                    }
                };
                for cpu in 0..control.vcpu_count() {
                    let Some(state) = paused.state(cpu) else { continue };
                    let task = tasks
                        .get()
                        .and_then(|ctx| ctx.current(&live_memory(&mem, &state), &state).ok());
                    samples.push(Sample {
                        rip: state.regs.rip,
                        user_mode: !state.in_kernel_mode(),
                        task,
                    });
                }
            }
            samples
        });
        Sampler { stop, thread }
    }

    /// Stops sampling and returns the samples.
    pub fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// What a run prints of its samples: the hottest places (named with `symbols`) and the
/// busiest user tasks, or why the places cannot be named.
pub fn summary(samples: &[Sample], symbols: Option<&SymbolTable>) -> String {
    match symbols {
        Some(symbols) => report(samples, symbols, 30) + &task_report(samples, 10),
        None => format!(
            "hvprobe: {} samples taken, but no kernel symbols to name them\n",
            samples.len()
        ),
    }
}

/// Tasks by the share of user-mode samples they ran in: `comm (pid N)` lines.
pub fn task_report(samples: &[Sample], top: usize) -> String {
    let user: Vec<&Sample> = samples.iter().filter(|s| s.user_mode).collect();
    let mut counts: HashMap<(String, i32), usize> = HashMap::new();
    let mut unnamed = 0;
    for s in &user {
        match &s.task {
            Some(t) => *counts.entry((t.comm.clone(), t.pid)).or_default() += 1,
            None => unnamed += 1,
        }
    }
    let mut ranked: Vec<_> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut out = format!("hvprobe: {} user-mode samples; tasks:\n", user.len());
    for ((comm, pid), n) in ranked.into_iter().take(top) {
        out.push_str(&format!(
            "{n:6} {:5.1}%  {} (pid {pid})\n",
            100.0 * n as f64 / user.len().max(1) as f64,
            hvprobe_probes::output::escape_guest_text(&comm),
        ));
    }
    if unnamed > 0 {
        out.push_str(&format!(
            "{unnamed:6}         (task unknown: before the kernel was introspected, or $comm unavailable)\n"
        ));
    }
    out
}

/// The `top` guest functions by samples, named from the kernel's symbols.
pub fn report(samples: &[Sample], symbols: &SymbolTable, top: usize) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for rip in samples.iter().map(|s| &s.rip) {
        let name = match symbols.describe(Gva(*rip)) {
            Some(d) if *rip >= 0xffff_8000_0000_0000 => d.symbol.name.clone(),
            Some(_) | None if *rip < 0xffff_8000_0000_0000 => "[user space]".to_string(),
            _ => "[unknown]".to_string(),
        };
        *counts.entry(name).or_default() += 1;
    }
    let mut ranked: Vec<_> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let total = samples.len().max(1);
    let mut out = format!("hvprobe: {} samples; hottest guest functions:\n", samples.len());
    for (name, n) in ranked.into_iter().take(top) {
        out.push_str(&format!("{:6} {:5.1}%  {name}\n", n, 100.0 * n as f64 / total as f64));
    }
    out
}
