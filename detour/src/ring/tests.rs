//! The rings in host memory: the record protocol played by [`HostRingMemory::guest_record`],
//! wraparound, full rings, corrupt headers, a concurrent producer, and the drain's speed.

use std::sync::Arc;

use proptest::prelude::*;

use super::*;

const GVA: Gva = Gva(0xffff_ffff_8260_0000);
const GPA: Gpa = Gpa(0xd000_0000);

fn rings(cpus: u32, capacity: u32, record_size: u32) -> (EventRings, HostRingMemory) {
    let g = RingGeometry::new(cpus, capacity, record_size).unwrap();
    let rings = EventRings::new(g, GVA, GPA, g.total_size()).unwrap();
    let mem = HostRingMemory::new(GPA, g.total_size());
    rings.init(&mem).unwrap();
    (rings, mem)
}

/// A record as the detour writes it: probe id, cpu, tsc, then `value` in the first slot.
fn record(probe: u32, cpu: u32, tsc: u64, value: u64, size: usize) -> Vec<u8> {
    let mut r = vec![0u8; size];
    r[0..4].copy_from_slice(&probe.to_le_bytes());
    r[4..8].copy_from_slice(&cpu.to_le_bytes());
    r[8..16].copy_from_slice(&tsc.to_le_bytes());
    if size >= 32 {
        r[24..32].copy_from_slice(&value.to_le_bytes());
    }
    r
}

fn value(e: &RawEvent) -> u64 {
    u64::from_le_bytes(e.record[24..32].try_into().unwrap())
}

fn head_gpa(rings: &EventRings, cpu: u32) -> Gpa {
    Gpa(rings.gpa().0 + rings.geometry().ring_offset(cpu) + HEAD)
}

#[test]
fn geometry_is_checked_and_laid_out_in_cache_lines() {
    assert!(RingGeometry::new(0, 4, 32).is_err());
    assert!(RingGeometry::new(1, 3, 32).is_err(), "capacity not a power of two");
    assert!(RingGeometry::new(1, 4, 20).is_err(), "record smaller than its header");
    assert!(RingGeometry::new(1, 4, 36).is_err(), "record size not a multiple of 8");
    let g = RingGeometry::new(2, 4, 40).unwrap();
    assert_eq!(g.stride(), (128 + 160u64).next_multiple_of(64));
    assert_eq!(g.ring_offset(1), 64 + g.stride());
    assert_eq!(g.record_offset(0, 5), 64 + 128 + 40, "record 5 goes to slot 1");
    assert!(matches!(
        EventRings::new(g, GVA, GPA, g.total_size() - 1),
        Err(RingError::TooLarge { .. })
    ));
    // The miss table follows the last ring, in whole cache lines.
    assert_eq!(g.miss_table_offset(), 64 + 2 * g.stride());
    assert_eq!(g.probe_slots(), DEFAULT_PROBE_SLOTS);
    // The filter table follows the miss table, with as many entries.
    let table = 8 * u64::from(DEFAULT_PROBE_SLOTS);
    assert_eq!(g.filter_table_offset(), g.miss_table_offset() + table);
    assert_eq!(g.total_size(), g.miss_table_offset() + 2 * table);
    let small = g.with_probe_slots(3).unwrap();
    assert_eq!(small.filter_table_offset(), small.miss_table_offset() + 64);
    assert_eq!(small.total_size(), small.miss_table_offset() + 128);
    assert_eq!(small.probe_missed_offset(2), Some(small.miss_table_offset() + 16));
    assert_eq!(small.probe_missed_offset(3), None);
    assert_eq!(small.probe_filtered_offset(2), Some(small.filter_table_offset() + 16));
    assert_eq!(small.probe_filtered_offset(3), None);
    assert!(g.with_probe_slots(0).is_err());
    assert!(g.with_probe_slots(MAX_PROBE_SLOTS + 1).is_err());
    let (rings, mem) = rings(2, 4, 40);
    let mut magic = [0u8; 4];
    mem.read_phys(GPA, &mut magic).unwrap();
    assert_eq!(&magic, b"HVEV");
    let mut info = [0u8; 16];
    mem.read_phys(Gpa(GPA.0 + rings.geometry().ring_offset(1) + INFO), &mut info)
        .unwrap();
    assert_eq!(u32::from_le_bytes(info[0..4].try_into().unwrap()), 1, "the ring's cpu");
}

#[test]
fn records_come_out_in_order_across_the_wrap() {
    let (rings, mem) = rings(1, 4, 32);
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    let mut next = 0u64;
    for round in [3usize, 4, 1, 4, 2] {
        for _ in 0..round {
            assert!(mem
                .guest_record(&rings, 0, 0, &record(7, 0, 100 + next, next, 32))
                .unwrap());
            next += 1;
        }
        let summary = reader.drain(&mem, &mut batch).unwrap();
        assert_eq!(summary.records, round);
        assert!(summary.corrupt_rings.is_empty());
        let got: Vec<u64> = batch.iter().map(|e| value(&e)).collect();
        let want: Vec<u64> = (next - round as u64..next).collect();
        assert_eq!(got, want);
        for e in batch.iter() {
            assert_eq!(
                (e.ring, e.probe, e.cpu, e.tsc, e.index),
                (0, 7, 0, 100 + value(&e), value(&e))
            );
        }
    }
    assert_eq!(reader.tail(0), Some(next));
    assert_eq!(rings.missed(&mem).unwrap().total(), 0);
}

#[test]
fn records_of_several_rings_merge_by_tsc() {
    let (rings, mem) = rings(2, 8, 32);
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    for (cpu, tsc) in [(0, 10), (1, 5), (0, 20), (1, 15), (1, 30)] {
        mem.guest_record(&rings, cpu, 0, &record(1, cpu, tsc, tsc, 32)).unwrap();
    }
    reader.drain(&mem, &mut batch).unwrap();
    let by_ring: Vec<u64> = batch.iter().map(|e| e.tsc).collect();
    assert_eq!(by_ring, [10, 20, 5, 15, 30]);
    let merged: Vec<u64> = batch
        .tsc_order()
        .into_iter()
        .map(|i| batch.get(i).unwrap().tsc)
        .collect();
    assert_eq!(merged, [5, 10, 15, 20, 30]);
}

#[test]
fn a_full_ring_counts_missed_and_never_overwrites() {
    let (rings, mem) = rings(2, 4, 32);
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    // Two probes' detours (miss slots 3 and 5) on CPU 1: the first four hits fit.
    let recorded: Vec<bool> = (0..7)
        .map(|i| {
            let slot = if i % 2 == 0 { 3 } else { 5 };
            mem.guest_record(&rings, 1, slot, &record(1, 1, i, i, 32)).unwrap()
        })
        .collect();
    assert_eq!(recorded, [true, true, true, true, false, false, false]);
    let missed = rings.missed(&mem).unwrap();
    assert_eq!(missed.per_cpu[1], CpuMissed { full: 3, nested: 0 });
    assert_eq!(missed.per_cpu[0], CpuMissed::default());
    assert_eq!(missed.total(), 3);
    let per_probe: Vec<u64> = (0..6).map(|slot| rings.probe_missed(&mem, slot).unwrap()).collect();
    assert_eq!(per_probe, [0, 0, 0, 2, 0, 1], "each miss in its own detour's entry");
    reader.drain(&mem, &mut batch).unwrap();
    assert_eq!(
        batch.iter().map(|e| value(&e)).collect::<Vec<_>>(),
        [0, 1, 2, 3],
        "the first four, intact"
    );
    assert!(batch.iter().all(|e| e.ring == 1));
    // Room again.
    assert!(mem.guest_record(&rings, 1, 0, &record(1, 1, 9, 9, 32)).unwrap());
    reader.drain(&mem, &mut batch).unwrap();
    assert_eq!(batch.iter().map(|e| value(&e)).collect::<Vec<_>>(), [9]);
}

#[test]
fn an_impossible_head_is_reported_and_skipped_and_the_ring_goes_on() {
    let (rings, mem) = rings(2, 8, 32);
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    for i in 0..3 {
        mem.guest_record(&rings, 0, 0, &record(1, 0, i, i, 32)).unwrap();
    }
    reader.drain(&mem, &mut batch).unwrap();
    // Behind the tail.
    mem.store_u64_release(head_gpa(&rings, 0), 1).unwrap();
    // Far ahead on the other ring.
    mem.store_u64_release(head_gpa(&rings, 1), u64::MAX - 5).unwrap();
    let summary = reader.drain(&mem, &mut batch).unwrap();
    assert!(batch.is_empty(), "nothing from a corrupt ring is trusted");
    assert_eq!(
        summary.corrupt_rings,
        [
            CorruptRing {
                ring: 0,
                head: 1,
                tail: 3
            },
            CorruptRing {
                ring: 1,
                head: u64::MAX - 5,
                tail: 0
            }
        ]
    );
    assert_eq!(reader.corrupt_count(), 2);
    assert_eq!(reader.tail(0), Some(1), "skipped to the head");
    // The guest goes on from its head, across the u64 wrap on ring 1.
    for i in 0..9u64 {
        mem.guest_record(&rings, 1, 0, &record(2, 1, i, i, 32)).unwrap();
    }
    let summary = reader.drain(&mem, &mut batch).unwrap();
    assert!(summary.corrupt_rings.is_empty());
    assert_eq!(
        batch.iter().map(|e| value(&e)).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert_eq!(rings.missed(&mem).unwrap().per_cpu[1].full, 1);
    // A tail scribbled by the guest is not the reader's: it keeps its own.
    let tail_gpa = Gpa(rings.gpa().0 + rings.geometry().ring_offset(1) + TAIL);
    mem.store_u64_release(tail_gpa, 12345).unwrap();
    reader.drain(&mem, &mut batch).unwrap();
    assert!(batch.is_empty());
    assert_eq!(reader.tail(1), Some((u64::MAX - 5).wrapping_add(8)));
}

proptest! {
    /// Whatever the guest writes over the rings, a drain ends, reads at most a ring's
    /// worth per CPU, and never reads outside (the memory would refuse it).
    #[test]
    fn a_drain_survives_any_scribble(writes in proptest::collection::vec((0u64..2048, any::<u64>()), 0..64),
                                      rounds in 1usize..4) {
        let (rings, mem) = rings(3, 8, 48);
        let size = rings.geometry().total_size();
        let mut reader = RingReader::new(rings);
        let mut batch = EventBatch::new();
        for _ in 0..rounds {
            for (at, v) in &writes {
                let at = (at * 8) % size;
                mem.store_u64_release(Gpa(GPA.0 + at), *v).unwrap();
            }
            let summary = reader.drain(&mem, &mut batch).unwrap();
            prop_assert!(summary.records <= 3 * 8);
            prop_assert_eq!(batch.len(), summary.records);
            for e in batch.iter() {
                prop_assert_eq!(e.record.len(), 48);
                prop_assert!(e.ring < 3);
            }
        }
    }
}

/// A guest thread writing as fast as it can while the host drains: every record the
/// guest says it wrote comes out once, in order, and the rest are counted missed.
#[test]
fn a_concurrent_producer_loses_nothing_silently() {
    let (rings, mem) = rings(1, 16, 32);
    let mem = Arc::new(mem);
    let n = 50_000u64;
    let guest = {
        let mem = mem.clone();
        std::thread::spawn(move || {
            let mut written = Vec::new();
            for i in 0..n {
                if mem.guest_record(&rings, 0, 0, &record(3, 0, i, i, 32)).unwrap() {
                    written.push(i);
                }
            }
            written
        })
    };
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    let mut got = Vec::new();
    loop {
        let done = guest.is_finished();
        reader.drain(&*mem, &mut batch).unwrap();
        got.extend(batch.iter().map(|e| value(&e)));
        if done {
            reader.drain(&*mem, &mut batch).unwrap();
            got.extend(batch.iter().map(|e| value(&e)));
            break;
        }
    }
    let written = guest.join().unwrap();
    assert_eq!(got, written, "the records written, in order, each once");
    let missed = rings.missed(&*mem).unwrap().total();
    assert_eq!(got.len() as u64 + missed, n, "recorded + missed = hits");
}

/// Full rings, refilled between drains: 8 CPUs × 4096 records of 64 bytes, four rounds,
/// every round drains every record of every ring, in order. (Throughput is measured by
/// `hvprobe bench drain`, not here.)
#[test]
fn full_rings_refilled_between_drains_are_drained_whole_each_time() {
    let (cpus, capacity, size) = (8u32, 4096u32, 64usize);
    let (rings, mem) = rings(cpus, capacity, size as u32);
    let g = rings.geometry();
    // One full image per round: records with heads advanced by `capacity` each round.
    let mut image = vec![0u8; g.total_size() as usize];
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    for round in 0..4u64 {
        mem.read_phys(GPA, &mut image).unwrap();
        for cpu in 0..cpus {
            for i in 0..u64::from(capacity) {
                let index = round * u64::from(capacity) + i;
                let at = g.record_offset(cpu, index) as usize;
                image[at..at + size].copy_from_slice(&record(1, cpu, index, index, size));
            }
            let head = (round + 1) * u64::from(capacity);
            let at = (g.ring_offset(cpu) + HEAD) as usize;
            image[at..at + 8].copy_from_slice(&head.to_le_bytes());
        }
        mem.write_phys(GPA, &image).unwrap();
        let summary = reader.drain(&mem, &mut batch).unwrap();
        assert_eq!(summary.records, (cpus * capacity) as usize);
        for cpu in 0..cpus {
            let tscs: Vec<u64> = batch.iter().filter(|e| e.cpu == cpu).map(|e| e.tsc).collect();
            let first = round * u64::from(capacity);
            assert_eq!(
                tscs,
                (first..first + u64::from(capacity)).collect::<Vec<_>>(),
                "CPU {cpu}"
            );
        }
    }
}
