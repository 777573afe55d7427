//! A host-side sampling profiler of the guest: pauses all vCPUs at a fixed period, notes
//! where each one was, and names the guest functions it was in. It needs nothing in the
//! guest; it is how the bundled guest's boot was trimmed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use hvprobe_arch::Gva;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_vmm::VcpuControl;

/// A running sampler.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<u64>>,
}

impl Sampler {
    pub fn start(control: Arc<VcpuControl>, period: Duration) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut rips = Vec::new();
            while !stop_flag.load(Ordering::Relaxed) && control.stop_reason().is_none() {
                std::thread::sleep(period);
                let paused = control.pause_all();
                for cpu in 0..control.vcpu_count() {
                    if let Some(regs) = paused.regs(cpu) {
                        rips.push(regs.rip);
                    }
                }
            }
            rips
        });
        Sampler { stop, thread }
    }

    /// Stops sampling and returns the instruction pointers seen.
    pub fn finish(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The `top` guest functions by samples, named from the kernel's symbols.
pub fn report(rips: &[u64], symbols: &SymbolTable, top: usize) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for rip in rips {
        let name = match symbols.describe(Gva(*rip)) {
            Some(d) if *rip >= 0xffff_8000_0000_0000 => d.symbol.name.clone(),
            Some(_) | None if *rip < 0xffff_8000_0000_0000 => "[user space]".to_string(),
            _ => "[unknown]".to_string(),
        };
        *counts.entry(name).or_default() += 1;
    }
    let mut ranked: Vec<_> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let total = rips.len().max(1);
    let mut out = format!("hvprobe: {} samples; hottest guest functions:\n", rips.len());
    for (name, n) in ranked.into_iter().take(top) {
        out.push_str(&format!("{:6} {:5.1}%  {name}\n", n, 100.0 * n as f64 / total as f64));
    }
    out
}
