//! The host's time-stamp counter, and a vCPU's TSC observed against it.
//!
//! KVM gives a vCPU the TSC `host TSC × ratio + offset` (no scaling unless the VMM asks for
//! another frequency with `KVM_SET_TSC_KHZ`, which hvprobe never does). A VMM cannot read the
//! offset on every backend, but it can read the vCPU's TSC (`KVM_GET_MSRS` of `IA32_TSC`,
//! which KVM computes from its own `rdtsc` at that moment) between two reads of its own:
//! the offset is then known to within half the time between them.

/// The host CPU's time-stamp counter now (`rdtsc`; not serializing: callers that stamp an
/// event tolerate a few cycles either way).
pub fn host_tsc() -> u64 {
    // SAFETY: `rdtsc` has no memory effects and exists on every x86-64 CPU; Linux leaves
    // it usable from user mode (CR4.TSD clear). (The intrinsic is safe on newer toolchains,
    // unsafe on the minimum one.)
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

/// A vCPU's TSC read between two host TSC reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TscSample {
    pub host_before: u64,
    pub guest: u64,
    pub host_after: u64,
}

impl TscSample {
    /// `guest − host` at the middle of the bracket, in cycles (wrapping: the guest's TSC
    /// may be behind the host's).
    pub fn offset(&self) -> i64 {
        let middle = self.host_before.wrapping_add(self.width() / 2);
        self.guest.wrapping_sub(middle) as i64
    }

    /// Cycles between the two host reads: the offset is exact to within half of this.
    pub fn width(&self) -> u64 {
        self.host_after.wrapping_sub(self.host_before)
    }

    /// Whether the two samples can have the same offset (their uncertainty intervals
    /// overlap).
    pub fn agrees_with(&self, other: &TscSample) -> bool {
        let distance = self.offset().abs_diff(other.offset());
        distance <= self.width() / 2 + other.width() / 2 + 1
    }

    /// Whether the host reads are in order (a bracket that went backwards, a host CPU
    /// migration between TSCs out of step, says nothing).
    pub fn is_ordered(&self) -> bool {
        self.host_after >= self.host_before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_is_taken_at_the_middle_of_the_bracket() {
        let s = TscSample {
            host_before: 1000,
            guest: 5000,
            host_after: 1100,
        };
        assert_eq!(s.width(), 100);
        assert_eq!(s.offset(), 3950);
        let behind = TscSample {
            host_before: 1000,
            guest: 40,
            host_after: 1020,
        };
        assert_eq!(behind.offset(), -970);
    }

    #[test]
    fn samples_agree_when_their_intervals_overlap() {
        let a = TscSample {
            host_before: 0,
            guest: 10_050,
            host_after: 100,
        };
        // The same offset (10,000) seen later through a narrower bracket.
        let b = TscSample {
            host_before: 50_000,
            guest: 60_005,
            host_after: 50_010,
        };
        assert!(a.agrees_with(&b) && b.agrees_with(&a));
        // An offset 1,000 cycles away cannot be the same.
        let c = TscSample {
            host_before: 90_000,
            guest: 101_005,
            host_after: 90_010,
        };
        assert!(!a.agrees_with(&c));
    }

    #[test]
    fn the_host_counter_moves_forward() {
        let a = host_tsc();
        let b = host_tsc();
        assert!(b >= a);
    }
}
