//! The guest's trace clock on a running VM: what [`GuestClock`] needs, read from the guest
//! and its vCPUs (see `hvprobe_probes::clock` for the arithmetic and why).

use std::sync::Arc;

use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::clock::{GuestClock, LocalClockVars, VcpuClockInput};
use hvprobe_vmm::VcpuState;
use vm_memory::GuestMemoryMmap;

use crate::memory::{GuestPhys, LiveKernel};

/// The paravirt `sched_clock` the guest calls (a static call's target): kvm-clock's when
/// it is `kvm_sched_clock_read`.
const SCHED_CLOCK_CALL: &str = "__SCK__pv_sched_clock";
const KVM_SCHED_CLOCK: &str = "kvm_sched_clock_read";
const KVM_SCHED_CLOCK_OFFSET: &str = "kvm_sched_clock_offset";
/// The static key that is on while the guest's sched_clock is stable (its `enabled` count
/// is the first `int` of `struct static_key`), and the offset `local_clock()` then adds.
const SCHED_CLOCK_STABLE: &str = "__sched_clock_stable";
const SCHED_CLOCK_TO_LOCAL: &str = "__sched_clock_offset";

/// Why the guest's trace clock cannot be computed on the host.
#[derive(Debug, thiserror::Error)]
pub enum GuestClockError {
    #[error("the guest kernel has no symbol {0} (no paravirt sched_clock, or no kvm-clock built in)")]
    NoSymbol(&'static str),
    #[error("reading {what} in guest memory: {source}")]
    Memory {
        what: &'static str,
        #[source]
        source: MemoryError,
    },
    #[error(
        "the guest's sched_clock is {target}, not kvm-clock's {KVM_SCHED_CLOCK} (booted without kvm-clock?): \
         only a kvm-clock sched_clock is computed on the host"
    )]
    NotKvmClock { target: String },
}

/// The guest's trace clock over guest memory `mem`, for `cpus` vCPUs: checks that the
/// guest's `sched_clock()` is kvm-clock's, reads `kvm_sched_clock_offset` (a static the
/// guest sets once at boot) through `kernel`, finds where `__sched_clock_stable` and
/// `__sched_clock_offset` are (the `global` clock; read at each stamp, since a booted
/// guest sets them in a late initcall, after the kernel is up), and takes what `states`
/// (vCPUs' published states) show of their kvm-clock pages and TSCs.
pub fn guest_clock(
    mem: &GuestMemoryMmap,
    kernel: &LiveKernel,
    symbols: &SymbolTable,
    cpus: usize,
    states: &[(usize, VcpuState)],
) -> Result<Arc<GuestClock>, GuestClockError> {
    let addr = |name: &'static str| {
        symbols
            .lookup(name)
            .map(|s| s.addr)
            .ok_or(GuestClockError::NoSymbol(name))
    };
    let read = |what: &'static str, at: Gva| {
        kernel
            .read_u64(at)
            .map_err(|source| GuestClockError::Memory { what, source })
    };
    let target = read(SCHED_CLOCK_CALL, addr(SCHED_CLOCK_CALL)?)?;
    let kvm = addr(KVM_SCHED_CLOCK)?;
    if target != kvm.0 {
        let target = symbols
            .describe(Gva(target))
            .map(|d| d.to_string())
            .unwrap_or_else(|| format!("{target:#x}"));
        return Err(GuestClockError::NotKvmClock { target });
    }
    let offset = read(KVM_SCHED_CLOCK_OFFSET, addr(KVM_SCHED_CLOCK_OFFSET)?)?;
    let mut clock = GuestClock::new(Arc::new(GuestPhys(mem.clone())), offset, cpus);
    match local_clock_vars(kernel, symbols) {
        Ok(vars) => clock = clock.with_local_clock_vars(vars),
        Err(e) => tracing::info!("no `global` clock (local_clock): {e}"),
    }
    let clock = Arc::new(clock);
    for (cpu, state) in states {
        observe(&clock, *cpu, state);
    }
    Ok(clock)
}

/// The guest-physical addresses of `__sched_clock_stable` and `__sched_clock_offset`
/// (kernel image data: they stay where they are).
fn local_clock_vars(kernel: &LiveKernel, symbols: &SymbolTable) -> Result<LocalClockVars, GuestClockError> {
    let gpa = |name: &'static str| -> Result<Gpa, GuestClockError> {
        let at = symbols
            .lookup(name)
            .map(|s| s.addr)
            .ok_or(GuestClockError::NoSymbol(name))?;
        let t = kernel
            .0
            .translate(at)
            .map_err(|source| GuestClockError::Memory { what: name, source })?;
        Ok(t.gpa)
    };
    Ok(LocalClockVars {
        stable_key: gpa(SCHED_CLOCK_STABLE)?,
        offset: gpa(SCHED_CLOCK_TO_LOCAL)?,
    })
}

/// Gives `clock` what vCPU `cpu`'s published state shows: where its kvm-clock page is and
/// its TSC against the host's.
pub fn observe(clock: &GuestClock, cpu: usize, state: &VcpuState) {
    clock.observe(
        cpu,
        VcpuClockInput {
            kvm_system_time: state.kvm_system_time,
            tsc: state.tsc,
        },
    );
}
