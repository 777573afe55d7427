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
/// The per-CPU pointer through which each CPU's `kvm_sched_clock_read` finds its kvm-clock
/// page (`this_cpu_pvti()`), and the array of the CPUs' per-CPU area offsets.
const HV_CLOCK_PER_CPU: &str = "hv_clock_per_cpu";
const PER_CPU_OFFSET: &str = "__per_cpu_offset";

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
    observe_guest_pages(&clock, kernel, symbols, cpus);
    for (cpu, state) in states {
        observe(&clock, *cpu, state);
    }
    Ok(clock)
}

/// Gives `clock` every CPU's kvm-clock page as the guest itself finds it
/// ([`kvm_clock_page`]), so that a record an event detour took on any vCPU is converted
/// through that vCPU's own page from the start, not only after a pause has read the vCPU's
/// MSR: a restored snapshot is armed before its vCPUs run, and no pause may follow. (On
/// hardware KVM the vCPUs of a restored 2-vCPU guest had TSCs milliseconds apart, so another
/// vCPU's page put its records 1.9–2.9 ms off the guest's own clock.) A CPU whose page
/// cannot be found is left to the pauses, logged.
fn observe_guest_pages(clock: &GuestClock, kernel: &LiveKernel, symbols: &SymbolTable, cpus: usize) {
    let (Some(per_cpu_offset), Some(pointer)) = (symbols.lookup(PER_CPU_OFFSET), symbols.lookup(HV_CLOCK_PER_CPU))
    else {
        tracing::info!(
            "no {PER_CPU_OFFSET} or {HV_CLOCK_PER_CPU} in the guest's symbols: each vCPU's kvm-clock page is \
             known once a pause has read its MSR (until then, vCPU 0's converts its records)"
        );
        return;
    };
    let translate = |gva: Gva| kernel.memory.translate(gva).map(|t| t.gpa);
    for cpu in 0..cpus {
        match kvm_clock_page(kernel, &translate, per_cpu_offset.addr, pointer.addr.0, cpu) {
            Ok(Some(gpa)) => clock.observe(
                cpu,
                VcpuClockInput {
                    kvm_system_time: gpa.0 | 1,
                    tsc: None,
                },
            ),
            Ok(None) => tracing::debug!("CPU {cpu}: the guest has no kvm-clock page for it"),
            Err(e) => tracing::info!("CPU {cpu}: its kvm-clock page cannot be found in guest memory: {e}"),
        }
    }
}

/// Where the guest's CPU `cpu` reads its kvm-clock page, guest-physical: the pointer at
/// `hv_clock_per_cpu` (the per-CPU variable's offset, `pointer_offset`) in that CPU's
/// per-CPU area (`__per_cpu_offset[cpu]`, the array at `per_cpu_offset`). The pointer is
/// the CPU's `pvclock_vsyscall_time_info`, whose first member is the page KVM writes: the
/// address the guest put in that vCPU's `MSR_KVM_SYSTEM_TIME_NEW`. `None` when the pointer
/// is null (a CPU never brought up, or kvm-clock not set up on it).
pub fn kvm_clock_page(
    kernel: &dyn GuestVirtRead,
    translate: &dyn Fn(Gva) -> Result<Gpa, MemoryError>,
    per_cpu_offset: Gva,
    pointer_offset: u64,
    cpu: usize,
) -> Result<Option<Gpa>, MemoryError> {
    let slot = Gva(per_cpu_offset.0.wrapping_add(8 * cpu as u64));
    let area = kernel.read_u64(slot)?;
    let pvti = kernel.read_u64(Gva(area.wrapping_add(pointer_offset)))?;
    if pvti == 0 {
        return Ok(None);
    }
    translate(Gva(pvti)).map(Some)
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
            .memory
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

#[cfg(test)]
mod tests {
    use hvprobe_arch::paging::PagingMode;
    use hvprobe_arch::tsc::TscSample;
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::memory::test_tables::{map_kernel, memory, Tables};
    use crate::memory::KernelPageTables;

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const END: u64 = TEXT + (16 << 20);
    /// The kernel image is at guest-physical 4 MiB.
    const PHYS: u64 = 4 << 20;
    const TABLES: Tables = Tables {
        pml4: 0x1000,
        pdpt: 0x2000,
        pd: 0x3000,
    };
    const KVM_READ: u64 = TEXT + 0x1000;
    const DATA: u64 = TEXT + 0x20_0000;
    const STATIC_CALL: u64 = DATA;
    const OFFSET_VAR: u64 = DATA + 0x10;
    const PER_CPU_OFFSETS: u64 = DATA + 0x100;
    /// `hv_clock_per_cpu`'s offset in a per-CPU area (the bundled kernel's).
    const HV_CLOCK_PER_CPU_OFFSET: u64 = 0x1_af48;
    const AREAS: [u64; 3] = [TEXT + 0x40_0000, TEXT + 0x50_0000, TEXT + 0x58_0000];
    /// `hv_clock_boot`: CPU n's `pvclock_vsyscall_time_info` is 64 bytes after CPU n-1's.
    const PAGES: u64 = TEXT + 0x60_0000;

    fn gpa(va: u64) -> u64 {
        va - TEXT + PHYS
    }

    fn symbols() -> SymbolTable {
        SymbolTable::parse_system_map(&format!(
            "{HV_CLOCK_PER_CPU_OFFSET:016x} D hv_clock_per_cpu\n\
             {TEXT:016x} T _text\n\
             {KVM_READ:016x} T kvm_sched_clock_read\n\
             {STATIC_CALL:016x} D __SCK__pv_sched_clock\n\
             {OFFSET_VAR:016x} b kvm_sched_clock_offset\n\
             {PER_CPU_OFFSETS:016x} D __per_cpu_offset\n\
             {END:016x} B _end\n"
        ))
        .unwrap()
    }

    /// A 1 GHz kvm-clock page that reads 5 s at TSC `tsc_timestamp`.
    fn write_page(mem: &GuestMemoryMmap, va: u64, tsc_timestamp: u64) {
        let at = |o: u64| GuestAddress(gpa(va) + o);
        mem.write_obj(2u32, at(0)).unwrap();
        mem.write_obj(tsc_timestamp, at(8)).unwrap();
        mem.write_obj(5_000_000_000u64, at(16)).unwrap();
        mem.write_obj(0x8000_0000u32, at(24)).unwrap();
        mem.write_obj(1u8, at(28)).unwrap();
    }

    /// A guest of three possible CPUs with kvm-clock as its sched_clock, booted with
    /// `kvm_sched_clock_offset` 1.5 s: CPUs 0 and 1 have their pages (CPU 1's TSC is
    /// 1,000,000 cycles ahead of CPU 0's, and its page says so), CPU 2 was never brought up.
    fn guest() -> (GuestMemoryMmap, LiveKernel) {
        let mem = memory();
        map_kernel(&mem, TABLES, TEXT, END, gpa);
        let write = |va: u64, value: u64| mem.write_obj(value, GuestAddress(gpa(va))).unwrap();
        write(STATIC_CALL, KVM_READ);
        write(OFFSET_VAR, 1_500_000_000);
        for (cpu, area) in AREAS.iter().enumerate() {
            write(PER_CPU_OFFSETS + 8 * cpu as u64, *area);
        }
        write(AREAS[0] + HV_CLOCK_PER_CPU_OFFSET, PAGES);
        write(AREAS[1] + HV_CLOCK_PER_CPU_OFFSET, PAGES + 64);
        write_page(&mem, PAGES, 1_000_000);
        write_page(&mem, PAGES + 64, 2_000_000);
        let kernel = KernelPageTables::for_tests(Gpa(TABLES.pml4), PagingMode::Level4).memory(&mem);
        (mem, kernel)
    }

    #[test]
    fn each_cpus_page_is_found_through_the_guests_own_per_cpu_pointer() {
        let (_mem, kernel) = guest();
        let translate = |gva: Gva| kernel.memory.translate(gva).map(|t| t.gpa);
        let page = |cpu| kvm_clock_page(&kernel, &translate, Gva(PER_CPU_OFFSETS), HV_CLOCK_PER_CPU_OFFSET, cpu);
        assert_eq!(page(0).unwrap(), Some(Gpa(gpa(PAGES))));
        assert_eq!(page(1).unwrap(), Some(Gpa(gpa(PAGES + 64))));
        assert_eq!(page(2).unwrap(), None, "a null pointer is no page");
        // A per-CPU area outside the kernel's mapping is an error, not a page.
        assert!(kvm_clock_page(&kernel, &translate, Gva(PER_CPU_OFFSETS), 32 << 20, 0).is_err());
    }

    #[test]
    fn records_of_a_vcpu_no_pause_has_seen_are_converted_through_its_own_page() {
        let (mem, kernel) = guest();
        // As `build_tracer` for a restored snapshot: vCPU 0's state only (its MSR and a
        // TSC sample), and no pause before the hits.
        let clock = guest_clock(&mem, &kernel, &symbols(), 2, &[]).unwrap();
        clock.observe(
            0,
            VcpuClockInput {
                kvm_system_time: gpa(PAGES) | 1,
                tsc: Some(TscSample {
                    host_before: 100,
                    guest: 600,
                    host_after: 100,
                }),
            },
        );
        // The same moment on both CPUs: 1 ms after their pages' 5 s, sched_clock 3.501 s.
        assert_eq!(clock.ns_at_guest_tsc(0, 2_000_000).unwrap(), 3_501_000_000);
        assert_eq!(
            clock.ns_at_guest_tsc(1, 3_000_000).unwrap(),
            3_501_000_000,
            "vCPU 1's record went through another vCPU's page"
        );
        // A trapped hit is host time through vCPU 0, the one with a TSC sample.
        assert_eq!(clock.ns_at_host_tsc(1_999_500).unwrap(), 3_501_000_000);
    }
}
