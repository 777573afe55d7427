//! Event detours' records. Invariant: **every hit of an event detour reaches the consumer,
//! with its probe's hit counted, or is counted as missed — a hit the guest could not
//! record (a full ring, a nested hit, a CPU with no ring) in its probe's `nmissed` (from
//! the detour's own entry of the rings' miss table) and, per CPU, in
//! [`EngineStats::ring_missed`]; a record the sink refused in its probe's `nmissed`** —
//! **or is counted as filtered out: a hit the detour's filter discarded in the guest, in
//! its probe's hits and `filtered_in_guest` (from the detour's entry of the filter
//! table)**; the host takes records and reads the counters without pausing the guest, at
//! every drain (every 2 ms, and before every listing and removal). A vCPU the VM's stop
//! left between a miss's two counts (its ring's, then its probe's entry) never makes the
//! second: the host makes it for it, once the VM has stopped for good.
//!
//! A detour's slot (its entry of the miss table and of the filter table) belongs to one
//! event detour's code from when the code is made until the code is reclaimed (nothing can
//! run it any more; a detour the guest may have copied is never reclaimed): only then is it
//! given to another, whose counts start from what the entries hold then. A retired detour
//! that still runs (a CPU was inside it) counts for the probe it was made for.
//!
//! [`EngineStats::ring_missed`]: super::EngineStats::ring_missed

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hvprobe_arch::{Gpa, Gva};

use super::events::hit_record;
use super::registry::Counters;
use super::site_jump::{WhyNotOptimized, DETOUR_BLOCK};
use super::{HitEvent, ProbeId, Tracer};
use crate::detour::event::returns::SLOT_OWNER;
use crate::detour::event::{EventLayout, GuestKernelFacts, RETURN_SLOT_SIZE};
use crate::detour::ring::{EventBatch, EventRings, RingError, RingGeometry, RingMemory, RingReader};
use crate::regs::Regs;

/// Records per CPU ring, at most: halved (down to [`MIN_RING_CAPACITY`]) until every CPU's
/// ring and the tables fit the out-of-line area's writable part: 1024 for one CPU in the
/// VMM's 640 KiB of rings, 512 each for two.
const RING_CAPACITY: u32 = 1024;
const MIN_RING_CAPACITY: u32 = 16;
/// Bytes per record: the header, the task stamp, and room for the arguments.
const RECORD_SIZE: u32 = 512;
/// Most entries of the miss table, i.e. event detours at once (32 KiB of table; fewer in a
/// small out-of-line area, one per two detour blocks of it: no event detour is smaller).
const MAX_MISS_SLOTS: u32 = 4096;
/// Most slots of exit-free return probes' calls-in-flight table (128 KiB of the writable
/// part, taken before the rings; at most a quarter of it): `maxactive` each, so ~100
/// probes at the default of 10.
const RETURN_TABLE_SLOTS: u32 = 1024;
/// Fewer slots than this is no table (one probe at the default `maxactive` needs 10).
const MIN_RETURN_TABLE_SLOTS: u32 = 16;

/// The rings and what the engine needs to write detours into them and read them back.
pub(super) struct EventSetup {
    pub rings: EventRings,
    pub facts: GuestKernelFacts,
    reader: Mutex<(RingReader, EventBatch)>,
    /// How each probe's records are laid out, by probe id. Lock order: the registry
    /// first, then this.
    pub layouts: RwLock<HashMap<u32, EventLayout>>,
    /// The rings' missed counters last seen (full and nested, all CPUs), and when.
    missed_seen: Mutex<(u64, Instant)>,
    /// Which probe each entry of the rings' miss table counts for. Lock order: the
    /// registry first, then this.
    miss_owners: Mutex<Vec<Option<MissOwner>>>,
    /// The misses the VM's stop cut short are counted (once).
    stop_cut_misses_counted: AtomicBool,
    /// Exit-free return probes' calls in flight, when there is room for the table.
    pub returns: Option<ReturnTable>,
}

/// The calls-in-flight table of exit-free return probes (see
/// [`crate::detour::event::returns`]) and which of its slots are given to a probe's code.
/// A slot range goes back only when its code is reclaimed and every slot in it is free.
pub(super) struct ReturnTable {
    pub gva: Gva,
    gpa: Gpa,
    pub slots: u32,
    /// Per slot: given to a probe's code.
    given: Mutex<Vec<bool>>,
}

impl ReturnTable {
    /// `count` consecutive slots not given to any code: the first.
    pub fn take(&self, count: u32) -> Option<u32> {
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        let count = count as usize;
        let first = (0..=given.len().checked_sub(count)?).find(|&i| given[i..i + count].iter().all(|g| !g))?;
        given[first..first + count].iter_mut().for_each(|g| *g = true);
        Some(first as u32)
    }

    pub fn give_back(&self, first: u32, count: u32) {
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        for g in given.iter_mut().skip(first as usize).take(count as usize) {
            *g = false;
        }
    }

    fn slot_gpa(&self, slot: u32, field: i32) -> Gpa {
        Gpa(self.gpa.0 + u64::from(slot) * u64::from(RETURN_SLOT_SIZE) + field as u64)
    }

    /// A slot's field, read from guest memory (the guest's to write: a bad value makes a
    /// wrong answer for that slot, nothing more).
    pub fn field(&self, mem: &dyn RingMemory, slot: u32, field: i32) -> Option<u64> {
        (slot < self.slots)
            .then(|| mem.load_u64_acquire(self.slot_gpa(slot, field)).ok())
            .flatten()
    }

    /// Whether every slot of `first..first + count` is free (no call of its code in flight).
    pub fn all_free(&self, mem: &dyn RingMemory, first: u32, count: u32) -> bool {
        (first..first.saturating_add(count)).all(|s| self.field(mem, s, SLOT_OWNER) == Some(0))
    }

    /// The slots given to a probe's code.
    fn given_slots(&self) -> Vec<u32> {
        let given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        (0..self.slots).filter(|&s| given[s as usize]).collect()
    }

    /// The slots given to a probe's code that are in use (a call in flight).
    pub fn in_use(&self, mem: &dyn RingMemory) -> Vec<u32> {
        self.given_slots()
            .into_iter()
            .filter(|&s| self.field(mem, s, SLOT_OWNER).is_some_and(|o| o != 0))
            .collect()
    }

    /// Frees every slot `task` owns (none of its calls returns any more: it is in
    /// `do_exit`, or being freed); returns how many. A slot another task is taking is not
    /// touched: only the owner's own entries write a slot's owner, and this one runs none.
    pub fn free_owned_by(&self, mem: &dyn RingMemory, task: Gva) -> usize {
        self.given_slots()
            .into_iter()
            .filter(|&slot| {
                self.field(mem, slot, SLOT_OWNER) == Some(task.0)
                    && mem.store_u64_release(self.slot_gpa(slot, SLOT_OWNER), 0).is_ok()
            })
            .count()
    }
}

/// The probe a slot of the miss and filter tables counts for: its counters (shared with
/// the registry, so that a count taken after the probe went harms nothing), and the
/// entries' values last added to them.
struct MissOwner {
    counters: Arc<Counters>,
    seen: SlotCounts,
    /// When `seen` was read.
    seen_at: Instant,
}

/// Counts every guest-written counter step up to this many without question (a drain
/// can come late: a paused host thread, a busy machine).
const PLAUSIBLE_STEP_SLACK: u64 = 1 << 20;

/// How much a guest-written counter of hits on `cpus` vCPUs grew from `seen` to `now` in
/// `elapsed`, or `None` when that is impossible: more than one hit per nanosecond per vCPU
/// (no detour runs in under a nanosecond) beyond [`PLAUSIBLE_STEP_SLACK`]. A counter is
/// the guest's to write: without the bound a hostile kernel adds 2^64 - 1 misses at once.
/// A counter that went down (written over) grows by nothing.
pub(super) fn plausible_step(now: u64, seen: u64, elapsed: Duration, cpus: u32) -> Option<u64> {
    let step = now.saturating_sub(seen);
    let bound = u64::try_from(elapsed.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(u64::from(cpus.max(1)))
        .saturating_add(PLAUSIBLE_STEP_SLACK);
    (step <= bound).then_some(step)
}

/// A slot's entries: its miss-table and filter-table counts.
#[derive(Clone, Copy, Default)]
struct SlotCounts {
    missed: u64,
    filtered: u64,
}

impl SlotCounts {
    /// The entries of `slot` in `rings`' tables.
    fn read(rings: &EventRings, mem: &dyn RingMemory, slot: u32) -> Result<SlotCounts, RingError> {
        Ok(SlotCounts {
            missed: rings.probe_missed(mem, slot)?,
            filtered: rings.probe_filtered(mem, slot)?,
        })
    }
}

impl MissOwner {
    /// Adds to `nmissed`, and to the hits and `filtered_in_guest`, what the guest counted
    /// since the last time; returns the hits filtered out since then. An entry only grows
    /// in a well-behaved guest; a smaller value (a guest that wrote over it) is taken as
    /// the new starting point and adds nothing.
    ///
    /// A step no `cpus` vCPUs can have made since the last time ([`plausible_step`]) adds
    /// nothing either, and is counted in `rejected`.
    fn fold(&mut self, now: SlotCounts, cpus: u32, rejected: &AtomicU64) -> u64 {
        let at = Instant::now();
        let elapsed = at.saturating_duration_since(self.seen_at);
        let grown = |now: u64, seen: u64| {
            plausible_step(now, seen, elapsed, cpus).unwrap_or_else(|| {
                rejected.fetch_add(1, Ordering::Relaxed);
                0
            })
        };
        let missed = grown(now.missed, self.seen.missed);
        let filtered = grown(now.filtered, self.seen.filtered);
        self.counters.nmissed.fetch_add(missed, Ordering::Relaxed);
        self.counters.hits.fetch_add(filtered, Ordering::Relaxed);
        self.counters.filtered_in_guest.fetch_add(filtered, Ordering::Relaxed);
        self.seen = now;
        self.seen_at = at;
        filtered
    }
}

/// Why event detours cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum EventSetupError {
    #[error("the machine cannot read the rings' memory")]
    NoRingMemory,
    #[error("the out-of-line area has no room for {bytes} bytes of rings")]
    NoRoom { bytes: u64 },
    #[error("event detours are set up already")]
    AlreadySetUp,
    #[error(transparent)]
    Ring(#[from] RingError),
}

impl Tracer {
    /// Makes probes that only record (no handlers) jump-optimizable as *event detours*:
    /// the detour writes each hit into a per-CPU ring in the out-of-line area, with no exit.
    /// `gpa_of` gives the guest-physical address of an out-of-line address (the host reads
    /// the rings there while the guest runs).
    pub fn enable_event_detours(
        &self,
        cpus: u32,
        facts: GuestKernelFacts,
        gpa_of: &dyn Fn(Gva) -> Gpa,
    ) -> Result<(), EventSetupError> {
        let mem = self.machine.event_memory().ok_or(EventSetupError::NoRingMemory)?;
        let area = self.ool.map_or(0, |a| a.size);
        let slots = u32::try_from(area / (2 * DETOUR_BLOCK))
            .unwrap_or(u32::MAX)
            .clamp(1, MAX_MISS_SLOTS);
        // The rings, with their miss and filter tables, in the area's writable part, after
        // the return table when there is room for both.
        let (mut gva, mut room) = self.ool.map_or((Gva(0), 0), |a| (a.rings, a.rings_size));
        let table_slots = u32::try_from(room / 4 / u64::from(RETURN_SLOT_SIZE))
            .unwrap_or(u32::MAX)
            .min(RETURN_TABLE_SLOTS);
        let table_bytes = u64::from(table_slots) * u64::from(RETURN_SLOT_SIZE);
        let returns = (table_slots >= MIN_RETURN_TABLE_SLOTS).then(|| {
            let table = ReturnTable {
                gva,
                gpa: gpa_of(gva),
                slots: table_slots,
                given: Mutex::new(vec![false; table_slots as usize]),
            };
            gva = Gva(gva.0 + table_bytes);
            room -= table_bytes;
            table
        });
        if let Some(table) = &returns {
            for slot in 0..table.slots {
                let gpa = table.slot_gpa(slot, SLOT_OWNER);
                mem.store_u64_release(gpa, 0).map_err(|source| RingError::Memory {
                    what: "the return table",
                    gpa,
                    source,
                })?;
            }
        }
        let geometry = |capacity| RingGeometry::new(cpus.max(1), capacity, RECORD_SIZE)?.with_probe_slots(slots);
        let mut capacity = RING_CAPACITY;
        while geometry(capacity)?.total_size() > room && capacity > MIN_RING_CAPACITY {
            capacity /= 2;
        }
        let geometry = geometry(capacity)?;
        let bytes = geometry.total_size();
        if bytes > room {
            return Err(EventSetupError::NoRoom { bytes });
        }
        let rings = EventRings::new(geometry, gva, gpa_of(gva), room)?;
        rings.init(mem)?;
        let setup = EventSetup {
            rings,
            facts,
            reader: Mutex::new((RingReader::new(rings), EventBatch::new())),
            layouts: RwLock::new(HashMap::new()),
            missed_seen: Mutex::new((0, Instant::now())),
            miss_owners: Mutex::new((0..slots).map(|_| None).collect()),
            stop_cut_misses_counted: AtomicBool::new(false),
            returns,
        };
        self.events.set(setup).map_err(|_| EventSetupError::AlreadySetUp)
    }

    /// The rings of event detours, once set up.
    pub fn event_rings(&self) -> Option<&EventRings> {
        self.events.get().map(|s| &s.rings)
    }

    /// A free entry of the miss table for a new event detour of the probe with `counters`
    /// (its count starts from what the entry holds now).
    pub(super) fn take_miss_slot(&self, counters: &Arc<Counters>) -> Result<u32, WhyNotOptimized> {
        let (Some(setup), Some(mem)) = (self.events.get(), self.machine.event_memory()) else {
            return Err(WhyNotOptimized::EventCode("the event rings are not set up".into()));
        };
        let mut owners = setup.miss_owners.lock().unwrap_or_else(|e| e.into_inner());
        let slot = owners
            .iter()
            .position(Option::is_none)
            .ok_or(WhyNotOptimized::NoMissSlot {
                slots: setup.rings.geometry().probe_slots(),
            })?;
        let seen =
            SlotCounts::read(&setup.rings, mem, slot as u32).map_err(|e| WhyNotOptimized::Memory(e.to_string()))?;
        owners[slot] = Some(MissOwner {
            counters: counters.clone(),
            seen,
            seen_at: Instant::now(),
        });
        Ok(slot as u32)
    }

    /// Gives back the miss-table entry of an event detour that can no longer run (never
    /// written, or reclaimed), after adding its last count to its probe.
    pub(super) fn release_miss_slot(&self, slot: u32) {
        let (Some(setup), Some(mem)) = (self.events.get(), self.machine.event_memory()) else {
            return;
        };
        let mut owners = setup.miss_owners.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(owner) = owners.get_mut(slot as usize) {
            if let (Some(o), Ok(now)) = (owner.as_mut(), SlotCounts::read(&setup.rings, mem, slot)) {
                let filtered = o.fold(now, setup.rings.geometry().cpus(), &self.stats.ring_rejected);
                self.count_filtered_in_guest(filtered);
            }
            *owner = None;
        }
    }

    /// Adds to each event probe's `nmissed` the hits its detours counted in the miss table
    /// since the last time, and to its hits and `filtered_in_guest` those they counted in
    /// the filter table.
    fn fold_probe_misses(&self, setup: &EventSetup, mem: &dyn RingMemory) {
        let mut owners = setup.miss_owners.lock().unwrap_or_else(|e| e.into_inner());
        for (slot, owner) in owners.iter_mut().enumerate() {
            let Some(owner) = owner else { continue };
            match SlotCounts::read(&setup.rings, mem, slot as u32) {
                Ok(now) => {
                    let filtered = owner.fold(now, setup.rings.geometry().cpus(), &self.stats.ring_rejected);
                    self.count_filtered_in_guest(filtered);
                }
                Err(e) => tracing::error!("event rings: {e}"),
            }
        }
    }

    /// Once the VM has stopped for good: a vCPU that stopped between a missed hit's two
    /// counts (its ring's counter, then its probe's miss-table entry) will never make the
    /// second. Counted here in that probe's `nmissed`, so that the probes' misses and the
    /// rings' add up as they would had the guest gone on. (The detour runs with interrupts
    /// off; a stop inside an NMI or exception handler that came in between leaves the RIP
    /// in the handler, and that one miss stays in the ring's count only.)
    fn count_misses_the_stop_cut_short(&self, setup: &EventSetup) {
        if setup.stop_cut_misses_counted.load(Ordering::Acquire) {
            return;
        }
        let rips = self.machine.stopped_rips();
        if rips.is_empty() || setup.stop_cut_misses_counted.swap(true, Ordering::AcqRel) {
            return;
        }
        // The registry is held until the owners are counted: no slot goes to another
        // probe's code in between.
        let reg = self.read_registry();
        let slots = rips.iter().filter_map(|&(_, rip)| {
            let (_, code) = reg.detour_codes.range(..=Gva(rip)).next_back()?;
            code.ring_counted_miss_ips
                .iter()
                .find(|(at, _)| at.0 == rip)
                .map(|(_, slot)| *slot)
        });
        let owners = setup.miss_owners.lock().unwrap_or_else(|e| e.into_inner());
        for slot in slots {
            if let Some(Some(owner)) = owners.get(slot as usize) {
                owner.counters.nmissed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn count_filtered_in_guest(&self, hits: u64) {
        self.stats.hits.fetch_add(hits, Ordering::Relaxed);
        self.stats.filtered_in_guest.fetch_add(hits, Ordering::Relaxed);
    }

    /// Takes every record the event detours wrote since the last drain and sends each as
    /// a [`HitEvent`] (its probe's hit counted), and adds the hits each detour could not
    /// record to its probe's `nmissed`; returns how many records. Never pauses the guest.
    /// Records of one CPU come in order, and within a drain all records are in the order
    /// of the guest TSC each carries. A record's timestamp is the guest's trace clock at
    /// that TSC (its hit's own time) when that clock stamps hits, else the host time of
    /// this drain.
    pub fn drain_events(&self) -> usize {
        let (Some(setup), Some(mem)) = (self.events.get(), self.machine.event_memory()) else {
            return 0;
        };
        self.fold_probe_misses(setup, mem);
        self.count_misses_the_stop_cut_short(setup);
        let mut reader = setup.reader.lock().unwrap_or_else(|e| e.into_inner());
        let (reader, batch) = &mut *reader;
        if let Err(e) = reader.drain(mem, batch) {
            tracing::error!("event rings: {e}");
            return 0;
        }
        if let Ok(missed) = setup.rings.missed(mem) {
            let total = missed.total();
            let at = Instant::now();
            let mut seen = setup.missed_seen.lock().unwrap_or_else(|e| e.into_inner());
            let elapsed = at.saturating_duration_since(seen.1);
            match plausible_step(total, seen.0, elapsed, setup.rings.geometry().cpus()) {
                Some(step) => {
                    self.stats.ring_missed.fetch_add(step, Ordering::Relaxed);
                }
                None => {
                    self.stats.ring_rejected.fetch_add(1, Ordering::Relaxed);
                }
            }
            // A total that went down (written over) or jumped is the new starting point.
            *seen = (total, at);
        }
        if batch.is_empty() {
            return 0;
        }
        let drained_at = self.host_timestamp_ns();
        // The registry before the layouts, as the optimization pass takes them (it holds
        // the registry while it makes a detour and writes its layout).
        let reg = self.read_registry();
        let layouts = setup.layouts.read().unwrap_or_else(|e| e.into_inner());
        let mut taken = 0;
        for i in batch.tsc_order() {
            let Some(raw) = batch.get(i) else { continue };
            // The CPU number is the guest's to write; the ring is ours (one per vCPU). A
            // record that names another CPU than its ring's is forged, or from a detour
            // the guest rewrote: dropped, so that no CPU the VM does not have (a Perfetto
            // track, a `[NNN]` column) is ever reported.
            if raw.cpu != raw.ring {
                self.stats.ring_rejected.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let id = ProbeId(raw.probe);
            let (Some(layout), Some(probe)) = (layouts.get(&raw.probe), reg.probes.get(&id)) else {
                // A record of a probe already gone (written before its detour was retired).
                self.stats.stale.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            taken += 1;
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            self.stats.optimized_events.fetch_add(1, Ordering::Relaxed);
            probe.counters.hits.fetch_add(1, Ordering::Relaxed);
            let task = layout.task(raw.record);
            // An exit-free return's record: its caller and its entry's stamp.
            let call = layout.call(raw.record);
            let duration = call.and_then(|(_, entry_tsc)| self.tsc_span_ns(raw.ring as usize, entry_tsc, raw.tsc));
            let mut record = hit_record(
                probe,
                task.as_ref().map(|t| String::from_utf8_lossy(&t.comm).into_owned()),
                task.as_ref().map(|t| t.pid),
                raw.cpu as usize,
                self.record_timestamp_ns(raw.ring as usize, raw.tsc, drained_at),
                layout.decode_with(raw.record, &self.view.symbols, duration),
            );
            if let Some((caller, entry_tsc)) = call {
                record.retprobe_caller = Some(
                    self.describe_frame(caller)
                        .unwrap_or_else(|| format!("{:#x}", caller.0)),
                );
                record.entry_timestamp_ns = Some(self.record_timestamp_ns(raw.ring as usize, entry_tsc, drained_at));
            }
            let event = HitEvent {
                probe: id,
                address: probe.address,
                regs: Regs {
                    rip: probe.address.0,
                    ..Regs::default()
                },
                record,
            };
            self.send_event(probe, event);
        }
        taken
    }
}
