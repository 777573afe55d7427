//! The clock hits are stamped with. Invariant: **a host-observed moment (the host's TSC at a
//! trapped hit, or the guest TSC an event detour recorded) becomes the nanoseconds the
//! guest's ftrace `local` clock (`trace_clock_local()`, i.e. `sched_clock()`) read, or
//! would have read, at that moment** — or, when the guest's clock cannot be had, an error
//! the caller turns into host time with the reason logged, never a made-up number.
//!
//! On a Linux guest with kvm-clock (the bundled one: `kvmclock_init` registers it and makes
//! `kvm_sched_clock_read` the paravirt `sched_clock`), the guest computes, on the CPU it
//! runs on:
//!
//! ```text
//! sched_clock() = pvclock(hv_clock_per_cpu, rdtsc()) − kvm_sched_clock_offset
//! ```
//!
//! where `pvclock` is the kvm-clock page arithmetic ([`pvclock`]) and
//! `kvm_sched_clock_offset` the kvm-clock reading when the guest set it up (a static
//! variable, read once from guest memory). The host has all three: the page's
//! guest-physical address from each vCPU's `MSR_KVM_SYSTEM_TIME_NEW`, the page itself in
//! guest memory (read at every stamp: a plain memory read, no ioctl, and KVM's updates are
//! seen at once), and the guest TSC, which is the host TSC plus an offset the VMM measures
//! at every pause of the vCPUs (`KVM_GET_MSRS` of `IA32_TSC` between two host `rdtsc`s,
//! [`TscSample`]). A trapped hit is then stamped with the host's `rdtsc` on the vCPU
//! thread, converted; an event detour's record with its own TSC, converted.
//!
//! The guest's dmesg (`local_clock()`) adds `__sched_clock_offset` to the same
//! `sched_clock()` once the guest marks it stable; `trace` files use `sched_clock()` as is.

use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hvprobe_arch::paging::{PhysAccessError, PhysRead};
use hvprobe_arch::tsc::{host_tsc, TscSample};
use hvprobe_arch::Gpa;

pub mod pvclock;

use pvclock::{PvclockError, PvclockTimeInfo, PVTI_SIZE};

/// Which clock stamps hits, named as ftrace's `trace_clock` file names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TraceClock {
    /// The guest's `local` trace clock, ftrace's default (`sched_clock()`): stamps merge
    /// with the guest's `trace` file.
    #[default]
    Local,
    /// The guest's `global` trace clock (`sched_clock_cpu()`, which is also `local_clock()`,
    /// the clock of the guest's printk/dmesg timestamps): `sched_clock()` +
    /// `__sched_clock_offset` while the guest has its sched_clock marked stable.
    Global,
    /// Host time since the tracer started.
    Host,
}

/// Why the guest's clock cannot stamp a hit.
#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    #[error("the tracer has no guest clock (the log says why it could not be had)")]
    NotAttached,
    #[error("the guest's global clock (local_clock, dmesg) is not known: {0}")]
    NoGlobalClock(&'static str),
    #[error("no vCPU has a kvm-clock page (MSR_KVM_SYSTEM_TIME_NEW is 0 or disabled on every vCPU seen)")]
    NoKvmClock,
    #[error("no vCPU's TSC has been read against the host's yet")]
    NoTscSample,
    #[error("vCPU {cpu}: its kvm-clock page at {gpa} cannot be read: {source}")]
    Unreadable {
        cpu: usize,
        gpa: Gpa,
        #[source]
        source: PhysAccessError,
    },
    #[error("vCPU {cpu}: its kvm-clock page at {gpa} changed under {tries} reads in a row")]
    Torn { cpu: usize, gpa: Gpa, tries: u32 },
    #[error("vCPU {cpu}: its kvm-clock page at {gpa} is no clock: {source}")]
    BadPage { cpu: usize, gpa: Gpa, source: PvclockError },
}

/// Guest-physical addresses of the guest's `__sched_clock_stable` (a static key: its
/// `enabled` count, an `int`, comes first) and `__sched_clock_offset` (`u64`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalClockVars {
    pub stable_key: Gpa,
    pub offset: Gpa,
}

/// What a pause shows of one vCPU's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VcpuClockInput {
    /// `MSR_KVM_SYSTEM_TIME_NEW` (page address | 1 when enabled).
    pub kvm_system_time: u64,
    /// The vCPU's TSC against the host's, when it was read.
    pub tsc: Option<TscSample>,
}

/// A page read is retried this often while KVM is writing it (KVM holds the version odd
/// for a few stores).
const READ_TRIES: u32 = 4;

#[derive(Clone, Copy, Debug, Default)]
struct VcpuClock {
    page: Option<Gpa>,
    /// The narrowest bracket still consistent with the newest one.
    tsc: Option<TscSample>,
    /// The page as last read whole and valid.
    last_good: Option<PvclockTimeInfo>,
}

/// The guest's `sched_clock()` computed on the host (see the module documentation).
pub struct GuestClock {
    memory: Arc<dyn PhysRead + Send + Sync>,
    sched_clock_offset: u64,
    /// Where the guest keeps what makes its `local_clock()` of its `sched_clock()`.
    global: Option<LocalClockVars>,
    vcpus: Mutex<Vec<VcpuClock>>,
    /// Stamps made from a page read before (the page could not be read whole at the time).
    stale_stamps: AtomicU64,
    warned_stale: AtomicBool,
}

impl GuestClock {
    /// A clock for `cpus` vCPUs over guest-physical `memory`, with the guest's
    /// `kvm_sched_clock_offset`. It stamps nothing until [`observe`](Self::observe) has
    /// seen a vCPU with a kvm-clock page and a TSC sample.
    pub fn new(memory: Arc<dyn PhysRead + Send + Sync>, sched_clock_offset: u64, cpus: usize) -> Self {
        GuestClock {
            memory,
            sched_clock_offset,
            global: None,
            vcpus: Mutex::new(vec![VcpuClock::default(); cpus.max(1)]),
            stale_stamps: AtomicU64::new(0),
            warned_stale: AtomicBool::new(false),
        }
    }

    /// With where the guest keeps `__sched_clock_stable` and `__sched_clock_offset`, so
    /// that [`global_ns`](Self::global_ns) gives its `local_clock()`.
    pub fn with_local_clock_vars(mut self, vars: LocalClockVars) -> Self {
        self.global = Some(vars);
        self
    }

    /// Whether the guest's `global` clock can be computed at all (its variables are known;
    /// whether its sched_clock is stable is read at each stamp).
    pub fn has_global(&self) -> bool {
        self.global.is_some()
    }

    /// The guest's `local_clock()` (ftrace's `global` clock, dmesg's) at the moment its
    /// `sched_clock()` read `local_ns`: `local_ns + __sched_clock_offset` while
    /// `__sched_clock_stable` is on, both read now (a booted guest marks its sched_clock
    /// stable in a late initcall, after the tracer may have been built). A moment before
    /// that clock's 0 reads 0.
    pub fn global_ns(&self, local_ns: u64) -> Result<u64, ClockError> {
        let vars = self.global.ok_or(ClockError::NoGlobalClock(
            "the guest's __sched_clock_stable and __sched_clock_offset are not known",
        ))?;
        let unreadable = |_| ClockError::NoGlobalClock("__sched_clock_stable or __sched_clock_offset is unreadable");
        let mut key = [0u8; 4];
        self.memory.read_phys(vars.stable_key, &mut key).map_err(unreadable)?;
        if i32::from_le_bytes(key) <= 0 {
            return Err(ClockError::NoGlobalClock(
                "the guest's sched_clock is not marked stable (its local_clock() then filters per CPU)",
            ));
        }
        let mut offset = [0u8; 8];
        self.memory.read_phys(vars.offset, &mut offset).map_err(unreadable)?;
        let global = i128::from(local_ns) + i128::from(i64::from_le_bytes(offset));
        Ok(global.clamp(0, i128::from(u64::MAX)) as u64)
    }

    fn vcpus(&self) -> std::sync::MutexGuard<'_, Vec<VcpuClock>> {
        self.vcpus.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes what a pause showed of vCPU `cpu`: where its page is now (the guest may move
    /// or disable it) and a TSC sample. A sample whose offset agrees with the kept one
    /// replaces it only when it is narrower; one that disagrees (the guest's TSC was set)
    /// replaces it.
    pub fn observe(&self, cpu: usize, input: VcpuClockInput) {
        let mut vcpus = self.vcpus();
        let Some(v) = vcpus.get_mut(cpu) else { return };
        let page = (input.kvm_system_time & 1 == 1).then_some(Gpa(input.kvm_system_time & !1));
        if page != v.page {
            v.last_good = None;
        }
        v.page = page;
        if let Some(new) = input.tsc.filter(TscSample::is_ordered) {
            tracing::debug!(
                "vCPU {cpu}: guest TSC = host TSC {:+} cycles (bracket {} cycles)",
                new.offset(),
                new.width()
            );
            v.tsc = match v.tsc {
                Some(old) if old.agrees_with(&new) && old.width() <= new.width() => Some(old),
                Some(old) if !old.agrees_with(&new) => {
                    tracing::info!(
                        "vCPU {cpu}: guest TSC offset moved from {} to {} cycles",
                        old.offset(),
                        new.offset()
                    );
                    Some(new)
                }
                _ => Some(new),
            };
        }
    }

    /// The guest's `sched_clock()` at host TSC `host_tsc`, through the first vCPU whose
    /// page and TSC are known (with KVM's master clock, [`pvclock::PVCLOCK_TSC_STABLE_BIT`],
    /// every vCPU's page gives the same time).
    pub fn ns_at_host_tsc(&self, host_tsc: u64) -> Result<u64, ClockError> {
        let mut vcpus = self.vcpus();
        let cpu = reference_vcpu(&vcpus)?;
        let Some(tsc) = vcpus[cpu].tsc else {
            return Err(ClockError::NoTscSample);
        };
        let guest_tsc = host_tsc.wrapping_add_signed(tsc.offset());
        self.ns_on(&mut vcpus, cpu, guest_tsc)
    }

    /// The guest's `sched_clock()` now (on this host thread's `rdtsc`).
    pub fn now_ns(&self) -> Result<u64, ClockError> {
        self.ns_at_host_tsc(host_tsc())
    }

    /// The guest's `sched_clock()` at guest TSC `guest_tsc` read on vCPU `cpu` (an event
    /// detour's record), through that vCPU's page, or the first known one's.
    pub fn ns_at_guest_tsc(&self, cpu: usize, guest_tsc: u64) -> Result<u64, ClockError> {
        let mut vcpus = self.vcpus();
        let cpu = match vcpus.get(cpu) {
            Some(v) if v.page.is_some() => cpu,
            _ => reference_vcpu(&vcpus)?,
        };
        self.ns_on(&mut vcpus, cpu, guest_tsc)
    }

    /// Converts through vCPU `cpu`'s page, read now; a page that cannot be read whole and
    /// valid falls back to the last good read of it (the same line unless KVM moved it
    /// since), counted and logged once.
    fn ns_on(&self, vcpus: &mut [VcpuClock], cpu: usize, guest_tsc: u64) -> Result<u64, ClockError> {
        let v = &mut vcpus[cpu];
        let gpa = v.page.ok_or(ClockError::NoKvmClock)?;
        // KVM bumps the version around every rewrite: the same even version as the last
        // good read is the same page (one 4-byte read instead of three).
        let unchanged = v
            .last_good
            .filter(|good| read_version(&*self.memory, gpa).is_ok_and(|now| now == good.version));
        let page = match unchanged.map_or_else(|| read_page(&*self.memory, cpu, gpa), Ok) {
            Ok(page) => {
                v.last_good = Some(page);
                page
            }
            Err(e) => {
                let Some(page) = v.last_good else { return Err(e) };
                self.stale_stamps.fetch_add(1, Ordering::Relaxed);
                if !self.warned_stale.swap(true, Ordering::Relaxed) {
                    tracing::warn!("guest clock: {e}; stamping with the page as last read (logged once)");
                }
                page
            }
        };
        Ok(page.ns_at(guest_tsc).saturating_sub(self.sched_clock_offset))
    }

    /// Stamps made from an earlier read of a page that could not be read whole.
    pub fn stale_stamps(&self) -> u64 {
        self.stale_stamps.load(Ordering::Relaxed)
    }

    /// What the clock is built from, for the log: the reference vCPU's page, its TSC
    /// frequency and stability, the offset and how exactly it is known.
    pub fn describe(&self) -> String {
        let mut vcpus = self.vcpus();
        let Ok(cpu) = reference_vcpu(&vcpus) else {
            return "no kvm-clock page known".into();
        };
        let gpa = vcpus[cpu].page.unwrap_or_default();
        let page = read_page(&*self.memory, cpu, gpa).ok().or(vcpus[cpu].last_good);
        vcpus[cpu].last_good = page.or(vcpus[cpu].last_good);
        let tsc = vcpus[cpu]
            .tsc
            .map(|t| format!("guest TSC = host TSC {:+} cycles (±{})", t.offset(), t.width() / 2 + 1))
            .unwrap_or_else(|| "guest TSC not sampled yet".into());
        match page {
            Some(p) => format!(
                "kvm-clock page of vCPU {cpu} at {gpa} (TSC {} kHz, {}), kvm_sched_clock_offset {} ns, {}, {tsc}",
                p.tsc_khz(),
                if p.tsc_stable() { "stable" } else { "not flagged stable" },
                self.sched_clock_offset,
                match self.global_ns(1 << 62) {
                    // In i128: the offset is the guest's, anywhere in i64.
                    Ok(global) => format!("local_clock = sched_clock {:+} ns", i128::from(global) - (1 << 62)),
                    Err(e) => format!("no local_clock: {e}"),
                }
            ),
            None => format!("kvm-clock page of vCPU {cpu} at {gpa} unreadable, {tsc}"),
        }
    }
}

/// The first vCPU with a kvm-clock page and a TSC sample (else the first with a page).
fn reference_vcpu(vcpus: &[VcpuClock]) -> Result<usize, ClockError> {
    vcpus
        .iter()
        .position(|v| v.page.is_some() && v.tsc.is_some())
        .or_else(|| vcpus.iter().position(|v| v.page.is_some()))
        .ok_or(ClockError::NoKvmClock)
}

/// The page's version word.
fn read_version(memory: &dyn PhysRead, gpa: Gpa) -> Result<u32, PhysAccessError> {
    let mut bytes = [0u8; 4];
    memory.read_phys(gpa, &mut bytes)?;
    Ok(u32::from_le_bytes(bytes))
}

/// Reads a kvm-clock page as the guest does (`pvclock_read_begin`/`_retry`): the version,
/// the fields, the version again; a read is good when the version was even and did not
/// change. (x86 keeps loads in order; the fences keep the compiler from merging or moving
/// the three reads.)
fn read_page(memory: &dyn PhysRead, cpu: usize, gpa: Gpa) -> Result<PvclockTimeInfo, ClockError> {
    let unreadable = |source: PhysAccessError| ClockError::Unreadable { cpu, gpa, source };
    let version = || read_version(memory, gpa).map_err(unreadable);
    for _ in 0..READ_TRIES {
        let before = version()?;
        compiler_fence(Ordering::SeqCst);
        let mut bytes = [0u8; PVTI_SIZE];
        memory.read_phys(gpa, &mut bytes).map_err(unreadable)?;
        compiler_fence(Ordering::SeqCst);
        let after = version()?;
        if before != after || before & 1 != 0 {
            std::hint::spin_loop();
            continue;
        }
        let page = PvclockTimeInfo {
            version: before,
            ..PvclockTimeInfo::parse(&bytes)
        };
        page.check()
            .map_err(|source| ClockError::BadPage { cpu, gpa, source })?;
        return Ok(page);
    }
    Err(ClockError::Torn {
        cpu,
        gpa,
        tries: READ_TRIES,
    })
}

#[cfg(test)]
mod tests;
