//! The kvm-clock page (`struct pvclock_vcpu_time_info`, the pvclock ABI KVM and Xen share)
//! and the guest kernel's arithmetic on it, as Linux 6.1 has it in
//! `arch/x86/include/asm/pvclock.h`: `__pvclock_read_cycles` and `pvclock_scale_delta`.
//!
//! The page belongs to the guest (KVM writes it, but so can the guest): every field is
//! checked before it is used, and the arithmetic never panics whatever the fields hold.

/// Bytes of `struct pvclock_vcpu_time_info`.
pub const PVTI_SIZE: usize = 32;
/// `flags`: the TSCs of all vCPUs are in step and the page of every vCPU gives the same
/// time (KVM's master clock); the guest then skips its global monotonic clamp.
pub const PVCLOCK_TSC_STABLE_BIT: u8 = 1 << 0;
/// `flags`: the host stopped the guest (the guest clears it and pets its watchdogs).
pub const PVCLOCK_GUEST_STOPPED: u8 = 1 << 1;
/// `tsc_shift` KVM ever writes lies well inside this (it is `kvm_get_time_scale`'s shift
/// for a TSC between MHz and THz); anything outside is not a clock.
const SHIFT_RANGE: std::ops::RangeInclusive<i8> = -32..=32;

/// One vCPU's kvm-clock parameters: `system_time` ns at `tsc_timestamp`, and
/// `tsc_to_system_mul / 2^32 × 2^tsc_shift` ns per TSC cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PvclockTimeInfo {
    /// Odd while KVM is writing the page.
    pub version: u32,
    pub tsc_timestamp: u64,
    pub system_time: u64,
    pub tsc_to_system_mul: u32,
    pub tsc_shift: i8,
    pub flags: u8,
}

/// Why a kvm-clock page cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PvclockError {
    #[error("version {0} is odd: KVM is writing the page")]
    BeingWritten(u32),
    #[error("tsc_to_system_mul is 0: the page was never written")]
    ZeroMultiplier,
    #[error("tsc_shift {0} is not one KVM writes")]
    ShiftOutOfRange(i8),
}

impl PvclockTimeInfo {
    /// The page's fields, little-endian at their ABI offsets.
    pub fn parse(bytes: &[u8; PVTI_SIZE]) -> Self {
        let u32_at = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let u64_at = |at: usize| u64::from(u32_at(at)) | (u64::from(u32_at(at + 4)) << 32);
        PvclockTimeInfo {
            version: u32_at(0),
            tsc_timestamp: u64_at(8),
            system_time: u64_at(16),
            tsc_to_system_mul: u32_at(24),
            tsc_shift: bytes[28] as i8,
            flags: bytes[29],
        }
    }

    /// Whether the fields describe a clock (a consistent read of a written page).
    pub fn check(&self) -> Result<(), PvclockError> {
        if self.version & 1 != 0 {
            return Err(PvclockError::BeingWritten(self.version));
        }
        if self.tsc_to_system_mul == 0 {
            return Err(PvclockError::ZeroMultiplier);
        }
        if !SHIFT_RANGE.contains(&self.tsc_shift) {
            return Err(PvclockError::ShiftOutOfRange(self.tsc_shift));
        }
        Ok(())
    }

    /// Whether KVM vouches that every vCPU's page gives the same time.
    pub fn tsc_stable(&self) -> bool {
        self.flags & PVCLOCK_TSC_STABLE_BIT != 0
    }

    /// kvm-clock nanoseconds at guest TSC `tsc`: `__pvclock_read_cycles` for a TSC at or
    /// after `tsc_timestamp` (the only ones the guest itself reads, so bit for bit its
    /// result, wrapping included). For an earlier TSC (a record written before KVM last
    /// updated the page, converted afterwards) the same line is followed backwards, which
    /// the guest's unsigned `tsc - tsc_timestamp` cannot do; it stops at 0.
    pub fn ns_at(&self, tsc: u64) -> u64 {
        if tsc >= self.tsc_timestamp {
            let delta = tsc - self.tsc_timestamp;
            self.system_time
                .wrapping_add(scale_delta(delta, self.tsc_to_system_mul, self.tsc_shift))
        } else {
            let delta = self.tsc_timestamp - tsc;
            self.system_time
                .saturating_sub(scale_delta(delta, self.tsc_to_system_mul, self.tsc_shift))
        }
    }

    /// The TSC frequency the page implies, in kHz (`pvclock_tsc_khz`); 0 for a page that
    /// fails [`check`](Self::check).
    pub fn tsc_khz(&self) -> u64 {
        if self.check().is_err() {
            return 0;
        }
        let khz = (1_000_000u64 << 32) / u64::from(self.tsc_to_system_mul);
        if self.tsc_shift < 0 {
            khz << (-self.tsc_shift)
        } else {
            khz >> self.tsc_shift
        }
    }
}

/// `pvclock_scale_delta`: `delta` shifted by `shift` (left when positive, right when
/// negative; bits shifted out are lost, as in C), times the 32.32 fixed-point `mul_frac`,
/// keeping bits 32..96 of the 128-bit product (`mulq; shrd $32`). Shifts of 64 or more
/// (undefined in C, never written by KVM) give 0 here.
pub fn scale_delta(delta: u64, mul_frac: u32, shift: i8) -> u64 {
    let amount = u32::from(shift.unsigned_abs());
    let shifted = if shift < 0 {
        delta.checked_shr(amount).unwrap_or(0)
    } else {
        delta.checked_shl(amount).unwrap_or(0)
    };
    ((u128::from(shifted) * u128::from(mul_frac)) >> 32) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(version: u32, tsc_timestamp: u64, system_time: u64, mul: u32, shift: i8, flags: u8) -> [u8; PVTI_SIZE] {
        let mut b = [0u8; PVTI_SIZE];
        b[0..4].copy_from_slice(&version.to_le_bytes());
        b[8..16].copy_from_slice(&tsc_timestamp.to_le_bytes());
        b[16..24].copy_from_slice(&system_time.to_le_bytes());
        b[24..28].copy_from_slice(&mul.to_le_bytes());
        b[28] = shift as u8;
        b[29] = flags;
        b
    }

    #[test]
    fn fields_are_read_at_the_abi_offsets() {
        let p = PvclockTimeInfo::parse(&page(6, 0x1122_3344_5566_7788, 987_654_321, 0x8000_0000, -1, 3));
        assert_eq!(
            p,
            PvclockTimeInfo {
                version: 6,
                tsc_timestamp: 0x1122_3344_5566_7788,
                system_time: 987_654_321,
                tsc_to_system_mul: 0x8000_0000,
                tsc_shift: -1,
                flags: 3,
            }
        );
        assert!(p.tsc_stable());
    }

    // Each expectation below is worked by hand from the kernel's formula:
    // ((delta << shift or >> -shift) * mul) >> 32, then + system_time.

    #[test]
    fn a_1ghz_tsc_is_one_ns_per_cycle() {
        // 1 GHz: KVM writes mul = 2^31, shift = 1 (2 × 0.5 ns).
        // delta = 1000: (1000 << 1) * 2^31 >> 32 = 2000 / 2 = 1000.
        assert_eq!(scale_delta(1000, 0x8000_0000, 1), 1000);
        let p = PvclockTimeInfo::parse(&page(2, 5_000, 70_000, 0x8000_0000, 1, 1));
        assert_eq!(p.ns_at(6_000), 71_000);
        assert_eq!(p.tsc_khz(), 1_000_000);
    }

    #[test]
    fn a_negative_shift_divides_first_and_drops_the_low_bits() {
        // 4 GHz: 0.25 ns a cycle = (mul 2^31 = 0.5) × 2^-1.
        // delta = 4001: 4001 >> 1 = 2000 (the odd cycle is lost), 2000 * 2^31 >> 32 = 1000.
        assert_eq!(scale_delta(4001, 0x8000_0000, -1), 1000);
        let p = PvclockTimeInfo::parse(&page(2, 0, 10, 0x8000_0000, -1, 0));
        assert_eq!(p.ns_at(4001), 1010);
        assert_eq!(p.tsc_khz(), 4_000_000);
    }

    #[test]
    fn a_typical_host_tsc_rounds_down_like_the_kernel() {
        // A 2.4 GHz TSC: 1/2.4 ns a cycle = 0.41666 = mul/2^32 × 2^-1 with
        // mul = floor(2^33 / 2.4) = floor(3579139413.33) = 3579139413 = 0xd555_5555.
        // delta = 2_400_000_000 (one second): 2.4e9 >> 1 = 1.2e9;
        // 1.2e9 × 3579139413 = 4294967295600000000; >> 32 (÷ 4294967296) = 999999999.86 → 999999999.
        assert_eq!(scale_delta(2_400_000_000, 0xd555_5555, -1), 999_999_999);
    }

    #[test]
    fn the_product_needs_all_128_bits() {
        // delta = 2^60 (a TSC far from the page's stamp), mul = 0xffff_ffff, shift = +2:
        // 2^60 << 2 = 2^62; 2^62 × (2^32 − 1) = 2^94 − 2^62, which does not fit in 64 bits;
        // >> 32 = 2^62 − 2^30 = 0x3fff_ffff_c000_0000.
        assert_eq!(scale_delta(1 << 60, 0xffff_ffff, 2), 0x3fff_ffff_c000_0000);
        // Bits shifted out on the left are lost, as in C: 2^63 << 1 = 0.
        assert_eq!(scale_delta(1 << 63, 0xffff_ffff, 1), 0);
        // And the 64-bit result wraps like the kernel's `system_time + offset`.
        let p = PvclockTimeInfo::parse(&page(2, 0, u64::MAX - 5, 0x8000_0000, 1, 0));
        assert_eq!(p.ns_at(10), 4);
    }

    #[test]
    fn a_tsc_before_the_stamp_follows_the_line_backwards_and_stops_at_zero() {
        let p = PvclockTimeInfo::parse(&page(2, 10_000, 50_000, 0x8000_0000, 1, 1));
        assert_eq!(p.ns_at(9_000), 49_000);
        assert_eq!(p.ns_at(0), 40_000);
        let young = PvclockTimeInfo::parse(&page(2, 10_000, 500, 0x8000_0000, 1, 1));
        assert_eq!(young.ns_at(0), 0);
    }

    #[test]
    fn pages_that_are_no_clock_are_refused_and_never_panic() {
        let odd = PvclockTimeInfo::parse(&page(7, 0, 0, 1, 0, 0));
        assert_eq!(odd.check(), Err(PvclockError::BeingWritten(7)));
        let unwritten = PvclockTimeInfo::parse(&[0; PVTI_SIZE]);
        assert_eq!(unwritten.check(), Err(PvclockError::ZeroMultiplier));
        assert_eq!(unwritten.tsc_khz(), 0);
        let shifted = PvclockTimeInfo::parse(&page(2, 0, 0, 1, 100, 0));
        assert_eq!(shifted.check(), Err(PvclockError::ShiftOutOfRange(100)));
        // The arithmetic itself takes anything.
        for shift in [i8::MIN, -64, -63, 63, 64, i8::MAX] {
            let _ = scale_delta(u64::MAX, u32::MAX, shift);
            let _ = PvclockTimeInfo::parse(&page(2, u64::MAX, u64::MAX, u32::MAX, shift, 0xff)).ns_at(0);
        }
        assert_eq!(scale_delta(u64::MAX, u32::MAX, -64), 0);
        assert_eq!(scale_delta(u64::MAX, u32::MAX, 64), 0);
    }
}
