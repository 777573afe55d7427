//! Event detours' records. Invariant: **every record a detour wrote into a ring reaches
//! the consumer, with its probe's hit counted, or is counted as missed — the rings' own
//! counters (a full ring, a nested hit) in [`EngineStats::ring_missed`], a record the sink
//! refused in its probe's `nmissed`**; the host takes records without pausing the guest.
//!
//! [`EngineStats::ring_missed`]: super::EngineStats::ring_missed

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};

use hvprobe_arch::{Gpa, Gva};

use super::events::hit_record;
use super::{HitEvent, ProbeId, Tracer, COUNT};
use crate::detour::event::{EventLayout, GuestKernelFacts};
use crate::detour::ring::{EventBatch, EventRings, RingError, RingGeometry, RingReader};
use crate::regs::Regs;

/// Records per CPU ring.
const RING_CAPACITY: u32 = 256;
/// Bytes per record: the header, the task stamp, and room for the arguments.
const RECORD_SIZE: u32 = 512;
/// The rings take at most this much of the out-of-line area.
const MAX_RINGS_BYTES: u64 = 1 << 20;

/// The rings and what the engine needs to write detours into them and read them back.
pub(super) struct EventSetup {
    pub rings: EventRings,
    pub facts: GuestKernelFacts,
    reader: Mutex<(RingReader, EventBatch)>,
    /// How each probe's records are laid out, by probe id. Lock order: the registry
    /// first, then this.
    pub layouts: RwLock<HashMap<u32, EventLayout>>,
    /// The rings' missed counters last seen (full and nested, all CPUs).
    missed_seen: Mutex<u64>,
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
        // At most a quarter of the out-of-line area (the rest is for copies and detours).
        let budget = MAX_RINGS_BYTES.min(self.ool.map_or(0, |a| a.size / 4));
        let mut capacity = RING_CAPACITY;
        while u64::from(cpus) * u64::from(capacity) * u64::from(RECORD_SIZE) > budget && capacity > 16 {
            capacity /= 2;
        }
        let geometry = RingGeometry::new(cpus.max(1), capacity, RECORD_SIZE)?;
        let bytes = geometry.total_size();
        let blocks = bytes.div_ceil(super::optimize::DETOUR_BLOCK);
        let gva = self.allocate_detour(blocks).ok_or(EventSetupError::NoRoom { bytes })?;
        let rings = EventRings::new(geometry, gva, gpa_of(gva), blocks * super::optimize::DETOUR_BLOCK)?;
        rings.init(mem)?;
        let setup = EventSetup {
            rings,
            facts,
            reader: Mutex::new((RingReader::new(rings), EventBatch::new())),
            layouts: RwLock::new(HashMap::new()),
            missed_seen: Mutex::new(0),
        };
        self.events.set(setup).map_err(|_| EventSetupError::AlreadySetUp)
    }

    /// The rings of event detours, once set up.
    pub fn event_rings(&self) -> Option<&EventRings> {
        self.events.get().map(|s| &s.rings)
    }

    /// Takes every record the event detours wrote since the last drain and sends each as
    /// a [`HitEvent`] (its probe's hit counted); returns how many. Never pauses the guest.
    /// Records of one CPU come in order, and within a drain all records are in the order
    /// of the guest TSC each carries. A record's timestamp is the guest's trace clock at
    /// that TSC (its hit's own time) when that clock stamps hits, else the host time of
    /// this drain.
    pub fn drain_events(&self) -> usize {
        let (Some(setup), Some(mem)) = (self.events.get(), self.machine.event_memory()) else {
            return 0;
        };
        let mut reader = setup.reader.lock().unwrap_or_else(|e| e.into_inner());
        let (reader, batch) = &mut *reader;
        if let Err(e) = reader.drain(mem, batch) {
            tracing::error!("event rings: {e}");
            return 0;
        }
        if let Ok(missed) = setup.rings.missed(mem) {
            let total = missed.total();
            let mut seen = setup.missed_seen.lock().unwrap_or_else(|e| e.into_inner());
            if total > *seen {
                self.stats.ring_missed.fetch_add(total - *seen, COUNT);
                *seen = total;
            }
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
            let id = ProbeId(raw.probe);
            let (Some(layout), Some(probe)) = (layouts.get(&raw.probe), reg.probes.get(&id)) else {
                // A record of a probe already gone (written before its detour was retired).
                self.stats.stale.fetch_add(1, COUNT);
                continue;
            };
            taken += 1;
            self.stats.hits.fetch_add(1, COUNT);
            self.stats.optimized_events.fetch_add(1, COUNT);
            probe.counters.hits.fetch_add(1, COUNT);
            let task = layout.task(raw.record);
            let event = HitEvent {
                probe: id,
                address: probe.address,
                regs: Regs {
                    rip: probe.address.0,
                    ..Regs::default()
                },
                record: hit_record(
                    probe,
                    task.as_ref().map(|t| String::from_utf8_lossy(&t.comm).into_owned()),
                    task.as_ref().map(|t| t.pid),
                    raw.cpu as usize,
                    self.record_timestamp_ns(raw.ring as usize, raw.tsc, drained_at),
                    layout.decode(raw.record, &self.view.symbols),
                ),
            };
            self.send_event(probe, event);
        }
        taken
    }
}
