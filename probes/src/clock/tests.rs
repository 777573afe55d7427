use std::sync::Mutex;

use super::*;

/// Guest-physical memory of one page, which a test rewrites as KVM (or a hostile guest)
/// would.
struct PageMemory {
    base: u64,
    bytes: Mutex<Vec<u8>>,
}

impl PageMemory {
    fn new(base: u64) -> Arc<Self> {
        Arc::new(PageMemory {
            base,
            bytes: Mutex::new(vec![0; 4096]),
        })
    }

    fn write_page(&self, at: u64, page: &PvclockTimeInfo) {
        let mut b = self.bytes.lock().unwrap();
        let o = (at - self.base) as usize;
        b[o..o + 4].copy_from_slice(&page.version.to_le_bytes());
        b[o + 8..o + 16].copy_from_slice(&page.tsc_timestamp.to_le_bytes());
        b[o + 16..o + 24].copy_from_slice(&page.system_time.to_le_bytes());
        b[o + 24..o + 28].copy_from_slice(&page.tsc_to_system_mul.to_le_bytes());
        b[o + 28] = page.tsc_shift as u8;
        b[o + 29] = page.flags;
    }
}

impl PhysRead for PageMemory {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        let b = self.bytes.lock().unwrap();
        let not_memory = hvprobe_arch::paging::PhysAccessError::NotMemory { gpa, len: buf.len() };
        let start = gpa.0.checked_sub(self.base).ok_or(not_memory.clone())? as usize;
        let src = b.get(start..start + buf.len()).ok_or(not_memory)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

const PAGE: u64 = 0x1ea_7000;

/// A 1 GHz kvm-clock that read 5 s at guest TSC 1,000,000.
fn one_ghz(version: u32) -> PvclockTimeInfo {
    PvclockTimeInfo {
        version,
        tsc_timestamp: 1_000_000,
        system_time: 5_000_000_000,
        tsc_to_system_mul: 0x8000_0000,
        tsc_shift: 1,
        flags: pvclock::PVCLOCK_TSC_STABLE_BIT,
    }
}

/// A vCPU whose guest TSC is the host's + 500 cycles, read exactly.
fn input(kvm_system_time: u64) -> VcpuClockInput {
    VcpuClockInput {
        kvm_system_time,
        tsc: Some(TscSample {
            host_before: 100,
            guest: 600,
            host_after: 100,
        }),
    }
}

#[test]
fn a_host_moment_is_the_guests_sched_clock_then() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE + 64, &one_ghz(4));
    // kvm_sched_clock_offset: the kvm-clock read 1.5 s when the guest set sched_clock up.
    let clock = GuestClock::new(mem.clone(), 1_500_000_000, 2);
    assert!(matches!(clock.now_ns(), Err(ClockError::NoKvmClock)));
    clock.observe(1, input(PAGE + 64 + 1));
    // Host TSC 1,999,500 = guest TSC 2,000,000: 1,000,000 cycles = 1 ms after the stamp,
    // kvm-clock 5.001 s, sched_clock 3.501 s.
    assert_eq!(clock.ns_at_host_tsc(1_999_500).unwrap(), 3_501_000_000);
    // A record of vCPU 0 (no page of its own known) goes through vCPU 1's.
    assert_eq!(clock.ns_at_guest_tsc(0, 2_000_000).unwrap(), 3_501_000_000);
    // A TSC from before KVM last wrote the page follows the same line back.
    assert_eq!(clock.ns_at_guest_tsc(1, 0).unwrap(), 3_499_000_000);
}

#[test]
fn kvm_rewriting_the_page_is_seen_at_the_next_stamp() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE, &one_ghz(2));
    let clock = GuestClock::new(mem.clone(), 0, 1);
    clock.observe(0, input(PAGE | 1));
    assert_eq!(clock.ns_at_guest_tsc(0, 1_000_000).unwrap(), 5_000_000_000);
    // KVM moves the line (a master-clock update): 10 µs later at the same TSC.
    mem.write_page(
        PAGE,
        &PvclockTimeInfo {
            system_time: 5_000_010_000,
            ..one_ghz(4)
        },
    );
    assert_eq!(clock.ns_at_guest_tsc(0, 1_000_000).unwrap(), 5_000_010_000);
}

#[test]
fn a_page_being_written_or_garbled_falls_back_to_the_last_good_read() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE, &one_ghz(2));
    let clock = GuestClock::new(mem.clone(), 0, 1);
    clock.observe(0, input(PAGE | 1));
    let good = clock.ns_at_guest_tsc(0, 3_000_000).unwrap();
    // Odd version forever (a guest holding the page "being written"): the last good read.
    mem.write_page(PAGE, &one_ghz(3));
    assert_eq!(clock.ns_at_guest_tsc(0, 3_000_000).unwrap(), good);
    // A multiplier of 0: the same.
    mem.write_page(
        PAGE,
        &PvclockTimeInfo {
            tsc_to_system_mul: 0,
            ..one_ghz(6)
        },
    );
    assert_eq!(clock.ns_at_guest_tsc(0, 3_000_000).unwrap(), good);
    assert_eq!(clock.stale_stamps(), 2);
}

#[test]
fn without_a_good_read_ever_the_clock_says_why() {
    let mem = PageMemory::new(PAGE);
    let clock = GuestClock::new(mem.clone(), 0, 1);
    // Never written: no clock.
    clock.observe(0, input(PAGE | 1));
    assert!(matches!(
        clock.now_ns(),
        Err(ClockError::BadPage {
            source: PvclockError::ZeroMultiplier,
            ..
        })
    ));
    // The guest points the MSR outside memory: unreadable, not a panic.
    clock.observe(0, input(0xdead_0000_0001));
    assert!(matches!(clock.now_ns(), Err(ClockError::Unreadable { .. })));
    // Disabled (bit 0 clear).
    clock.observe(0, input(PAGE));
    assert!(matches!(clock.now_ns(), Err(ClockError::NoKvmClock)));
    // A page but no TSC sample.
    let fresh = GuestClock::new(mem, 0, 1);
    fresh.observe(
        0,
        VcpuClockInput {
            kvm_system_time: PAGE | 1,
            tsc: None,
        },
    );
    assert!(matches!(fresh.now_ns(), Err(ClockError::NoTscSample)));
}

#[test]
fn a_moved_page_forgets_the_old_pages_last_read() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE, &one_ghz(2));
    let clock = GuestClock::new(mem.clone(), 0, 1);
    clock.observe(0, input(PAGE | 1));
    clock.now_ns().unwrap();
    // The guest moves its page to an unwritten one: the old page's line is not used.
    clock.observe(0, input((PAGE + 256) | 1));
    assert!(matches!(clock.now_ns(), Err(ClockError::BadPage { .. })));
}

#[test]
fn the_narrowest_consistent_tsc_bracket_is_kept_and_a_moved_offset_replaces_it() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE, &one_ghz(2));
    let clock = GuestClock::new(mem.clone(), 0, 1);
    let sample = |host_before, guest, host_after| VcpuClockInput {
        kvm_system_time: PAGE | 1,
        tsc: Some(TscSample {
            host_before,
            guest,
            host_after,
        }),
    };
    // Offset 1,000,000 ± 50 cycles.
    clock.observe(0, sample(0, 1_000_050, 100));
    // The same offset later, ± 5: kept instead.
    clock.observe(0, sample(10_000, 1_010_005, 10_010));
    // A wider one that agrees: ignored.
    clock.observe(0, sample(20_000, 1_020_400, 20_800));
    assert_eq!(clock.vcpus()[0].tsc.unwrap().width(), 10);
    // A bracket that went backwards says nothing.
    clock.observe(0, sample(30_010, 7, 30_000));
    assert_eq!(clock.vcpus()[0].tsc.unwrap().width(), 10);
    // The guest's TSC was set: the new offset wins even though it is wider.
    clock.observe(0, sample(40_000, 9_040_050, 40_100));
    assert_eq!(clock.vcpus()[0].tsc.unwrap().offset(), 9_000_000);
}

#[test]
fn the_global_clock_adds_the_guests_signed_offset_while_it_is_stable_and_stops_at_zero() {
    let mem = PageMemory::new(PAGE);
    let local_only = GuestClock::new(mem.clone(), 0, 1);
    assert!(!local_only.has_global());
    assert!(matches!(local_only.global_ns(5), Err(ClockError::NoGlobalClock(_))));
    let vars = LocalClockVars {
        stable_key: Gpa(PAGE + 0x100),
        offset: Gpa(PAGE + 0x108),
    };
    let clock = GuestClock::new(mem.clone(), 0, 1).with_local_clock_vars(vars);
    assert!(clock.has_global());
    let set = |key: i32, offset: i64| {
        let mut b = mem.bytes.lock().unwrap();
        b[0x100..0x104].copy_from_slice(&key.to_le_bytes());
        b[0x108..0x110].copy_from_slice(&offset.to_le_bytes());
    };
    // Not marked stable yet (a booted guest before its late initcalls): no global clock.
    set(0, 0);
    assert!(matches!(clock.global_ns(5), Err(ClockError::NoGlobalClock(_))));
    // The bundled guest's: "sched_clock: Marking stable (…)->(36117509076, -3116539187)".
    set(1, -3_116_539_187);
    assert_eq!(clock.global_ns(36_117_509_076).unwrap(), 33_000_969_889);
    assert_eq!(clock.global_ns(1_000).unwrap(), 0);
    set(1, 7);
    assert_eq!(clock.global_ns(u64::MAX).unwrap(), u64::MAX);
}

#[test]
fn an_unchanged_version_reuses_the_last_read() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE, &one_ghz(2));
    let clock = GuestClock::new(mem.clone(), 0, 1);
    clock.observe(0, input(PAGE | 1));
    let first = clock.ns_at_guest_tsc(0, 2_000_000).unwrap();
    // Fields rewritten without the version bump KVM always makes: not a new page to us (the
    // stamp reads the version word only), and never a torn one.
    mem.write_page(
        PAGE,
        &PvclockTimeInfo {
            tsc_to_system_mul: 0,
            ..one_ghz(2)
        },
    );
    assert_eq!(clock.ns_at_guest_tsc(0, 2_000_000).unwrap(), first);
    assert_eq!(clock.stale_stamps(), 0);
}

/// `__sched_clock_offset` is the guest's. Describing the clock with an
/// offset near the top of the range overflowed the difference it prints (a panic in a
/// debug build).
#[test]
fn describing_the_clock_survives_any_guest_offset() {
    let mem = PageMemory::new(PAGE);
    mem.write_page(PAGE + 64, &one_ghz(4));
    let vars = LocalClockVars {
        stable_key: Gpa(PAGE + 0x100),
        offset: Gpa(PAGE + 0x108),
    };
    let clock = GuestClock::new(mem.clone(), u64::MAX, 1).with_local_clock_vars(vars);
    clock.observe(0, input(PAGE + 64 + 1));
    for offset in [i64::MAX, i64::MIN, -1, 0] {
        {
            let mut b = mem.bytes.lock().unwrap();
            b[0x100..0x104].copy_from_slice(&1i32.to_le_bytes());
            b[0x108..0x110].copy_from_slice(&offset.to_le_bytes());
        }
        let text = clock.describe();
        assert!(text.contains("local_clock = sched_clock"), "{text}");
    }
}
