//! The event rings: where an event detour ([`super::event`]) records a probe hit inside the
//! guest, and the host's drain of them.
//!
//! # Layout
//!
//! One range of guest memory (inside the out-of-line area: never RAM to the guest, mapped
//! supervisor-only), given by the host at a guest-virtual address (what the detour code
//! uses) and the guest-physical address behind it (what the host reads through the mmap):
//!
//! ```text
//! +0      global header, 64 bytes
//!           +0  u32 magic "HVEV", u32 version
//!           +8  u32 cpus, u32 capacity (records per CPU, a power of two)
//!           +16 u32 record size, u32 ring stride
//!           +24 u64 bad_cpu   guest: hits on a CPU number with no ring (counted, not recorded)
//!           +32 u32 probe slots (entries of the miss table), u32 0   host, at init (informational)
//! +64     ring of CPU 0, `stride` bytes; ring of CPU n at +64 + n * stride
//!           +0   u64 head           guest: records written so far (free-running)
//!           +8   u64 missed_full    guest: hits dropped because the ring was full
//!           +16  u64 missed_nested  guest: hits dropped because the detour was re-entered
//!                                   on this CPU (an NMI or exception during a record)
//!           +24  u8  busy           guest: 1 while this CPU writes a record
//!           +32  u32 cpu, u32 capacity, u32 record size, u32 magic   host, at init (informational)
//!           +64  u64 tail           host: records consumed so far (its own cache line)
//!           +128 records: `capacity` slots of `record size` bytes, record `i` in slot
//!                `i % capacity`
//! +64 + cpus * stride   the miss table: `probe slots` u64s, one per event detour (its
//!                       *miss slot*, given by the host), shared by all CPUs
//!           u64 missed      guest: hits of that detour's probe not recorded, for any reason
//!                           (full ring, nested, bad CPU)
//! +64 + cpus * stride + round64(8 * probe slots)   the filter table: `probe slots` u64s, at
//!                       the same slots as the miss table
//!           u64 filtered    guest: hits of that detour's probe its event filter discarded
//!                           (written only by detours that run a filter, see
//!                           [`super::event::filter`])
//! ```
//!
//! A record starts with a 24-byte header — `u32 probe id`, `u32 cpu` (the guest's
//! `cpu_number`), `u64 tsc` (`rdtsc` at the hit), `u64 faults` (bit `i`: fetch-arg `i`
//! faulted; written only by probes with an argument that can fault) — followed by one `u64`
//! value slot per fetch-arg and then the byte areas of the string, `$comm` and array
//! arguments. What the slots mean is per probe: [`super::event::EventLayout`].
//!
//! # Ordering contract
//!
//! Each ring has one producer, the guest CPU whose `cpu_number` selects it, writing with
//! interrupts off, and one consumer, the host.
//!
//! - Guest, per hit: `busy = 1`; read `head` and `tail`; if `head - tail >= capacity`
//!   count `missed_full` and stop; else write the record into slot `head % capacity`
//!   with plain stores, then publish it with `head += 1` (one aligned 8-byte store); `busy =
//!   0`.
//! - Host, per drain: read `head` (one aligned 8-byte load, acquire); read the records
//!   `tail..head`; then publish `tail = head` (one aligned 8-byte store, release).
//!
//! Why this is correct on x86 (TSO), with the guest using plain `mov`s and the host
//! reading the same physical pages through its mapping of guest memory: stores become
//! visible to other CPUs in program order, so a host that sees the new `head` also sees
//! every record store before it; loads are not reordered with older loads, so the host's
//! record reads after its `head` load see at least that much; and loads are not reordered
//! with later stores, so the host has finished reading a slot before its `tail` store
//! lets the guest reuse it, and the guest has read `tail` before it overwrites anything.
//! The host's acquire load and release store keep the Rust compiler from moving its reads
//! across them (on x86 they are plain `mov`s too). Aligned 8-byte loads and stores are
//! single-copy atomic, so neither side sees a torn `head` or `tail`; the host never
//! re-reads `tail` from guest memory (it keeps its own copy) and never trusts `head`.
//!
//! Nothing on a guest CPU interleaves with its own record: interrupts are off while it is
//! written, and what interrupts can still run (an NMI, a #PF taken in a fault-safe copy,
//! a #MC) and hits another event probe finds `busy` set and counts `missed_nested`.
//!
//! # Per-probe misses
//!
//! Every hit that is not recorded is counted twice by the guest: in its CPU's ring header
//! (`missed_full`, `missed_nested`) or `bad_cpu`, as above, and in the miss table's entry
//! of the detour that lost it (the detour knows its own entry: the host gives it when it
//! generates the code), so that the host can add it to that probe's `nmissed`. The entry is
//! shared by every CPU that runs the detour, so the guest counts with one `lock inc qword
//! [entry]`: one instruction, so nothing on the same CPU (an NMI, an exception, taken only
//! between instructions) can split it, and locked, so no other CPU's increment is lost.
//! The host only reads an entry (one aligned 8-byte load: single-copy atomic), keeps the
//! value it last saw, and adds the difference; an entry is given to a new detour only once
//! the detour that had it can no longer run, and the host takes what the entry holds then
//! as its starting point (it never writes the table after [`EventRings::init`]). Only the
//! miss paths touch the table: a recorded hit runs the same instructions as without it.
//!
//! # Per-probe filtered hits
//!
//! A detour that runs its event's filter ([`super::event::filter`]) and finds a hit
//! filtered out publishes no record and counts the hit in its entry of the filter table,
//! the way misses are counted (`lock inc`, the detour's own slot). The host adds it to the
//! probe's hits (a filtered-out hit is a hit, as in `kprobe_profile`) and to its filtered
//! count. Only that path touches the table.
//!
//! # The host treats ring memory as hostile
//!
//! The guest can write anything anywhere in the rings. The reader keeps `tail` itself,
//! bounds every read by the geometry it was given (never by a length in guest memory), and
//! when a `head` is impossible (behind `tail`, or more than `capacity` ahead) it counts the
//! ring as corrupt, skips to that `head` and goes on: a drain reads at most `capacity`
//! records per CPU and always ends.

use std::sync::atomic::{AtomicU64, Ordering};

use hvprobe_arch::paging::{PhysRead, PhysWrite};
use hvprobe_arch::{Gpa, Gva};

/// `"HVEV"`, little-endian.
pub const RING_MAGIC: u32 = u32::from_le_bytes(*b"HVEV");
pub const RING_VERSION: u32 = 3;

/// Bytes of the global header before the first ring.
pub const GLOBAL_HEADER_SIZE: u64 = 64;
/// Offset in the global header of the `bad_cpu` counter.
pub const GLOBAL_BAD_CPU: u64 = 24;
/// Offset in the global header of the number of miss-table entries.
pub const GLOBAL_PROBE_SLOTS: u64 = 32;

/// Offsets in a per-CPU ring header.
pub const HEAD: u64 = 0;
pub const MISSED_FULL: u64 = 8;
pub const MISSED_NESTED: u64 = 16;
pub const BUSY: u64 = 24;
pub const INFO: u64 = 32;
pub const TAIL: u64 = 64;
/// Bytes of a per-CPU ring header: the records start here.
pub const CPU_HEADER_SIZE: u64 = 128;

/// Offsets in a record.
pub const RECORD_PROBE: u64 = 0;
pub const RECORD_CPU: u64 = 4;
pub const RECORD_TSC: u64 = 8;
pub const RECORD_FAULTS: u64 = 16;
/// Bytes of a record's header: the value slots start here.
pub const RECORD_HEADER_SIZE: u32 = 24;

/// Largest ring capacity accepted (records per CPU).
pub const MAX_CAPACITY: u32 = 1 << 20;
/// Largest record accepted.
pub const MAX_RECORD_SIZE: u32 = 4096;
/// Most CPUs (rings) accepted.
pub const MAX_CPUS: u32 = 1024;
/// Miss-table entries of [`RingGeometry::new`] (event detours that can exist at once).
pub const DEFAULT_PROBE_SLOTS: u32 = 1024;
/// Most miss-table entries accepted.
pub const MAX_PROBE_SLOTS: u32 = 1 << 16;

/// Why a ring geometry or a drain failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    #[error("bad ring geometry: {0}")]
    Geometry(#[from] GeometryError),
    #[error("{table} entry {slot} does not exist: the table has {slots}")]
    NoSuchSlot { table: &'static str, slot: u32, slots: u32 },
    #[error("the rings ({size:#x} bytes) do not fit the {available:#x} bytes given at {gpa}")]
    TooLarge { size: u64, available: u64, gpa: Gpa },
    #[error("{what} at {gpa}: {source}")]
    Memory {
        what: &'static str,
        gpa: Gpa,
        #[source]
        source: hvprobe_arch::paging::PhysAccessError,
    },
}

/// A ring shape or placement the rings cannot have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("{0} CPUs: 1 to {MAX_CPUS} are supported")]
    Cpus(u32),
    #[error("capacity {0}: a power of two up to {MAX_CAPACITY} records")]
    Capacity(u32),
    #[error("record size {0}: a multiple of 8 from {RECORD_HEADER_SIZE} to {MAX_RECORD_SIZE}")]
    RecordSize(u32),
    #[error("{0} miss-table entries: 1 to {MAX_PROBE_SLOTS} are supported")]
    ProbeSlots(u32),
    #[error("the rings at {gva} ({gpa}) must be 64-byte aligned")]
    Unaligned { gva: Gva, gpa: Gpa },
    #[error("the rings wrap around the address space")]
    Wraps,
}

/// An atomic access the ring memory cannot make: `head`, `tail` and the counters are
/// aligned words.
#[derive(Debug, thiserror::Error)]
#[error("not 8-byte aligned")]
struct NotAligned;

/// Guest-physical memory as the drain needs it: the existing byte-wise traits for records
/// and initialisation, plus single-copy-atomic aligned 8-byte accesses for `head` and
/// `tail` (a byte-wise copy could tear them).
pub trait RingMemory: PhysRead + PhysWrite {
    /// One atomic load of the aligned `u64` at `gpa`, with acquire ordering.
    fn load_u64_acquire(&self, gpa: Gpa) -> Result<u64, hvprobe_arch::paging::PhysAccessError>;
    /// One atomic store of the aligned `u64` at `gpa`, with release ordering.
    fn store_u64_release(&self, gpa: Gpa, value: u64) -> Result<(), hvprobe_arch::paging::PhysAccessError>;
}

impl<T: RingMemory + ?Sized> RingMemory for &T {
    fn load_u64_acquire(&self, gpa: Gpa) -> Result<u64, hvprobe_arch::paging::PhysAccessError> {
        (**self).load_u64_acquire(gpa)
    }
    fn store_u64_release(&self, gpa: Gpa, value: u64) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        (**self).store_u64_release(gpa, value)
    }
}

/// The shape of the rings: how many, how many records each, how big a record, and how
/// many entries the miss table has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingGeometry {
    cpus: u32,
    capacity: u32,
    record_size: u32,
    probe_slots: u32,
}

impl RingGeometry {
    /// `cpus` rings (1..=[`MAX_CPUS`]) of `capacity` records (a power of two,
    /// 1..=[`MAX_CAPACITY`]) of `record_size` bytes (a multiple of 8, from
    /// [`RECORD_HEADER_SIZE`] to [`MAX_RECORD_SIZE`]), and a miss table of
    /// [`DEFAULT_PROBE_SLOTS`] entries ([`RingGeometry::with_probe_slots`]).
    pub fn new(cpus: u32, capacity: u32, record_size: u32) -> Result<Self, RingError> {
        if cpus == 0 || cpus > MAX_CPUS {
            return Err(GeometryError::Cpus(cpus).into());
        }
        if !capacity.is_power_of_two() || capacity > MAX_CAPACITY {
            return Err(GeometryError::Capacity(capacity).into());
        }
        if !record_size.is_multiple_of(8) || !(RECORD_HEADER_SIZE..=MAX_RECORD_SIZE).contains(&record_size) {
            return Err(GeometryError::RecordSize(record_size).into());
        }
        Ok(RingGeometry {
            cpus,
            capacity,
            record_size,
            probe_slots: DEFAULT_PROBE_SLOTS,
        })
    }

    /// The same rings with a miss table of `slots` entries (1..=[`MAX_PROBE_SLOTS`]): at
    /// most that many event detours at once.
    pub fn with_probe_slots(self, slots: u32) -> Result<Self, RingError> {
        if slots == 0 || slots > MAX_PROBE_SLOTS {
            return Err(GeometryError::ProbeSlots(slots).into());
        }
        Ok(RingGeometry {
            probe_slots: slots,
            ..self
        })
    }

    pub fn cpus(&self) -> u32 {
        self.cpus
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn record_size(&self) -> u32 {
        self.record_size
    }

    /// Entries of the miss table.
    pub fn probe_slots(&self) -> u32 {
        self.probe_slots
    }

    /// Bytes from one CPU's ring to the next (a multiple of 64, so that every ring's
    /// header starts a cache line).
    pub fn stride(&self) -> u64 {
        (CPU_HEADER_SIZE + u64::from(self.capacity) * u64::from(self.record_size)).next_multiple_of(64)
    }

    /// Bytes all of it takes.
    pub fn total_size(&self) -> u64 {
        self.filter_table_offset() + self.table_size()
    }

    /// Bytes of the miss table, and of the filter table (a multiple of 64).
    fn table_size(&self) -> u64 {
        (8 * u64::from(self.probe_slots)).next_multiple_of(64)
    }

    /// Offset of the miss table from the start (after the last ring).
    pub fn miss_table_offset(&self) -> u64 {
        GLOBAL_HEADER_SIZE + u64::from(self.cpus) * self.stride()
    }

    /// Offset of miss-table entry `slot` from the start, if there is one.
    pub fn probe_missed_offset(&self, slot: u32) -> Option<u64> {
        (slot < self.probe_slots).then(|| self.miss_table_offset() + 8 * u64::from(slot))
    }

    /// Offset of the filter table from the start (after the miss table).
    pub fn filter_table_offset(&self) -> u64 {
        self.miss_table_offset() + self.table_size()
    }

    /// Offset of filter-table entry `slot` from the start, if there is one.
    pub fn probe_filtered_offset(&self, slot: u32) -> Option<u64> {
        (slot < self.probe_slots).then(|| self.filter_table_offset() + 8 * u64::from(slot))
    }

    /// Offset of CPU `cpu`'s ring from the start.
    pub fn ring_offset(&self, cpu: u32) -> u64 {
        GLOBAL_HEADER_SIZE + u64::from(cpu) * self.stride()
    }

    /// Offset of the slot record number `index` of CPU `cpu` goes to.
    pub fn record_offset(&self, cpu: u32, index: u64) -> u64 {
        let slot = index & u64::from(self.capacity - 1);
        self.ring_offset(cpu) + CPU_HEADER_SIZE + slot * u64::from(self.record_size)
    }
}

/// The rings at a place in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventRings {
    geometry: RingGeometry,
    gva: Gva,
    gpa: Gpa,
}

impl EventRings {
    /// Rings of `geometry` at `gva` (as the guest's detour code addresses them) backed by
    /// the guest-physical `gpa..gpa + available` (contiguous: inside the out-of-line area).
    pub fn new(geometry: RingGeometry, gva: Gva, gpa: Gpa, available: u64) -> Result<Self, RingError> {
        let size = geometry.total_size();
        if size > available {
            return Err(RingError::TooLarge { size, available, gpa });
        }
        if !gva.0.is_multiple_of(64) || !gpa.0.is_multiple_of(64) {
            return Err(GeometryError::Unaligned { gva, gpa }.into());
        }
        if gva.0.checked_add(size).is_none() || gpa.0.checked_add(size).is_none() {
            return Err(GeometryError::Wraps.into());
        }
        Ok(EventRings { geometry, gva, gpa })
    }

    pub fn geometry(&self) -> RingGeometry {
        self.geometry
    }

    pub fn gva(&self) -> Gva {
        self.gva
    }

    pub fn gpa(&self) -> Gpa {
        self.gpa
    }

    fn at(&self, offset: u64) -> Gpa {
        Gpa(self.gpa.0 + offset)
    }

    /// Zeroes the rings and writes the headers. Only while no detour can write to them
    /// (before any probe uses them, or with every vCPU paused and no detour running).
    pub fn init(&self, mem: &dyn RingMemory) -> Result<(), RingError> {
        let g = self.geometry;
        let mut header = vec![0u8; GLOBAL_HEADER_SIZE as usize];
        let put = |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        put(&mut header, 0, RING_MAGIC);
        put(&mut header, 4, RING_VERSION);
        put(&mut header, 8, g.cpus);
        put(&mut header, 12, g.capacity);
        put(&mut header, 16, g.record_size);
        put(&mut header, 20, u32::try_from(g.stride()).unwrap_or(u32::MAX));
        put(&mut header, GLOBAL_PROBE_SLOTS as usize, g.probe_slots);
        write(mem, "the rings' global header", self.gpa, &header)?;
        let zeros = vec![0u8; 64 << 10];
        let mut done = GLOBAL_HEADER_SIZE;
        while done < g.total_size() {
            let n = (g.total_size() - done).min(zeros.len() as u64) as usize;
            write(mem, "the rings", self.at(done), &zeros[..n])?;
            done += n as u64;
        }
        for cpu in 0..g.cpus {
            let mut info = [0u8; 16];
            put(&mut info, 0, cpu);
            put(&mut info, 4, g.capacity);
            put(&mut info, 8, g.record_size);
            put(&mut info, 12, RING_MAGIC);
            write(mem, "a ring's header", self.at(g.ring_offset(cpu) + INFO), &info)?;
        }
        Ok(())
    }

    /// The guest-written loss counters (`bad_cpu` and each ring's `missed_*`). Numbers the
    /// guest wrote: meaningful only if it is well-behaved, harmless otherwise.
    pub fn missed(&self, mem: &dyn RingMemory) -> Result<MissedCounts, RingError> {
        let g = self.geometry;
        let bad_cpu = load(mem, "bad_cpu", self.at(GLOBAL_BAD_CPU))?;
        let mut per_cpu = Vec::with_capacity(g.cpus as usize);
        for cpu in 0..g.cpus {
            let ring = g.ring_offset(cpu);
            per_cpu.push(CpuMissed {
                full: load(mem, "missed_full", self.at(ring + MISSED_FULL))?,
                nested: load(mem, "missed_nested", self.at(ring + MISSED_NESTED))?,
            });
        }
        Ok(MissedCounts { bad_cpu, per_cpu })
    }

    /// Miss-table entry `slot`: the hits its detour did not record, as the guest counted
    /// them (a number the guest wrote).
    pub fn probe_missed(&self, mem: &dyn RingMemory, slot: u32) -> Result<u64, RingError> {
        let offset = self.geometry.probe_missed_offset(slot).ok_or(RingError::NoSuchSlot {
            table: "miss-table",
            slot,
            slots: self.geometry.probe_slots,
        })?;
        load(mem, "a miss-table entry", self.at(offset))
    }

    /// The guest-virtual address of miss-table entry `slot` (what a detour increments).
    pub fn probe_missed_gva(&self, slot: u32) -> Option<Gva> {
        let offset = self.geometry.probe_missed_offset(slot)?;
        Some(Gva(self.gva.0 + offset))
    }

    /// Filter-table entry `slot`: the hits its detour's filter discarded, as the guest
    /// counted them (a number the guest wrote).
    pub fn probe_filtered(&self, mem: &dyn RingMemory, slot: u32) -> Result<u64, RingError> {
        let offset = self.geometry.probe_filtered_offset(slot).ok_or(RingError::NoSuchSlot {
            table: "filter-table",
            slot,
            slots: self.geometry.probe_slots,
        })?;
        load(mem, "a filter-table entry", self.at(offset))
    }

    /// The guest-virtual address of filter-table entry `slot` (what a detour increments).
    pub fn probe_filtered_gva(&self, slot: u32) -> Option<Gva> {
        let offset = self.geometry.probe_filtered_offset(slot)?;
        Some(Gva(self.gva.0 + offset))
    }
}

fn write(mem: &dyn RingMemory, what: &'static str, gpa: Gpa, data: &[u8]) -> Result<(), RingError> {
    mem.write_phys(gpa, data)
        .map_err(|source| RingError::Memory { what, gpa, source })
}

fn load(mem: &dyn RingMemory, what: &'static str, gpa: Gpa) -> Result<u64, RingError> {
    mem.load_u64_acquire(gpa)
        .map_err(|source| RingError::Memory { what, gpa, source })
}

fn store(mem: &dyn RingMemory, what: &'static str, gpa: Gpa, value: u64) -> Result<(), RingError> {
    mem.store_u64_release(gpa, value)
        .map_err(|source| RingError::Memory { what, gpa, source })
}

/// Hits the guest counted instead of recording them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MissedCounts {
    /// Hits on a CPU whose number has no ring.
    pub bad_cpu: u64,
    pub per_cpu: Vec<CpuMissed>,
}

impl MissedCounts {
    /// Every hit not recorded: what `nmissed` adds up for the event probes on these rings.
    pub fn total(&self) -> u64 {
        self.per_cpu
            .iter()
            .fold(self.bad_cpu, |t, c| t.saturating_add(c.full).saturating_add(c.nested))
    }
}

/// One CPU's losses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuMissed {
    /// The ring was full (the host is behind).
    pub full: u64,
    /// The detour was entered again on this CPU while it wrote a record.
    pub nested: u64,
}

/// One drained record, as [`EventBatch::iter`] shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawEvent<'a> {
    /// The ring it was in.
    pub ring: u32,
    /// Its position in that ring (records of a ring are numbered from 0 in order).
    pub index: u64,
    pub probe: u32,
    /// The CPU number the guest wrote (equal to `ring` unless the guest misbehaves).
    pub cpu: u32,
    pub tsc: u64,
    /// The whole record, header included (`record_size` bytes): what
    /// [`super::event::EventLayout::decode`] takes.
    pub record: &'a [u8],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Meta {
    ring: u32,
    index: u64,
}

/// Records taken by a drain, kept in one buffer (reused across drains: no allocation per
/// record). Records of one ring are in ring order; rings follow each other (merge them
/// by `tsc` for one timeline).
#[derive(Clone, Debug, Default)]
pub struct EventBatch {
    record_size: usize,
    bytes: Vec<u8>,
    meta: Vec<Meta>,
}

impl EventBatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.meta.len()
    }

    pub fn is_empty(&self) -> bool {
        self.meta.is_empty()
    }

    pub fn clear(&mut self) {
        self.bytes.clear();
        self.meta.clear();
    }

    pub fn get(&self, i: usize) -> Option<RawEvent<'_>> {
        let meta = self.meta.get(i)?;
        let record = self.bytes.get(i * self.record_size..(i + 1) * self.record_size)?;
        let u32_at = |at: u64| u32::from_le_bytes(record[at as usize..at as usize + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |at: u64| u64::from_le_bytes(record[at as usize..at as usize + 8].try_into().unwrap_or([0; 8]));
        Some(RawEvent {
            ring: meta.ring,
            index: meta.index,
            probe: u32_at(RECORD_PROBE),
            cpu: u32_at(RECORD_CPU),
            tsc: u64_at(RECORD_TSC),
            record,
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = RawEvent<'_>> + '_ {
        (0..self.len()).filter_map(move |i| self.get(i))
    }

    /// The records' positions in one timeline across rings: by `tsc`, ties (and a
    /// guest whose TSCs are not in step) kept in ring order. Each ring's own order is
    /// its true order; the merge is only as good as the guest's TSC synchronisation.
    pub fn tsc_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.sort_by_key(|&i| self.get(i).map_or(0, |e| e.tsc));
        order
    }
}

/// What one drain did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainSummary {
    /// Records taken, all rings.
    pub records: usize,
    /// Rings whose `head` was impossible this time (skipped to it; their records lost).
    pub corrupt_rings: Vec<CorruptRing>,
}

/// A ring whose guest-written `head` could not be right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CorruptRing {
    pub ring: u32,
    pub head: u64,
    pub tail: u64,
}

/// The host's consumer of the rings: it owns every ring's `tail`.
#[derive(Clone, Debug)]
pub struct RingReader {
    rings: EventRings,
    tails: Vec<u64>,
    corrupt: u64,
}

impl RingReader {
    /// A reader of rings just [`EventRings::init`]ialised (every tail 0).
    pub fn new(rings: EventRings) -> Self {
        RingReader {
            rings,
            tails: vec![0; rings.geometry.cpus as usize],
            corrupt: 0,
        }
    }

    pub fn rings(&self) -> &EventRings {
        &self.rings
    }

    /// Records consumed so far from CPU `cpu`'s ring.
    pub fn tail(&self, cpu: u32) -> Option<u64> {
        self.tails.get(cpu as usize).copied()
    }

    /// How many times a ring's `head` was found impossible.
    pub fn corrupt_count(&self) -> u64 {
        self.corrupt
    }

    /// Appends every record published since the last drain, ring by ring, to `batch`
    /// (emptied first), and gives the slots back to the guest. Never pauses the guest;
    /// reads at most `capacity` records per ring; an impossible `head` is reported and
    /// skipped to.
    pub fn drain(&mut self, mem: &dyn RingMemory, batch: &mut EventBatch) -> Result<DrainSummary, RingError> {
        let g = self.rings.geometry;
        let record_size = g.record_size as usize;
        batch.clear();
        batch.record_size = record_size;
        let mut summary = DrainSummary::default();
        for cpu in 0..g.cpus {
            let ring = g.ring_offset(cpu);
            let tail = self.tails[cpu as usize];
            let head = load(mem, "a ring's head", self.rings.at(ring + HEAD))?;
            let pending = head.wrapping_sub(tail);
            if pending == 0 {
                continue;
            }
            if pending > u64::from(g.capacity) {
                // Behind the tail (huge as unsigned) or more than a ring ahead: the guest
                // wrote something that is not a head. Skip to it; nothing there is trusted.
                summary.corrupt_rings.push(CorruptRing { ring: cpu, head, tail });
                self.corrupt += 1;
                self.publish(mem, cpu, head)?;
                continue;
            }
            // At most two contiguous runs of slots (before and after the wrap).
            let mut index = tail;
            while index != head {
                let slot = index & u64::from(g.capacity - 1);
                let run = (u64::from(g.capacity) - slot).min(head.wrapping_sub(index));
                let from = batch.bytes.len();
                batch.bytes.resize(from + run as usize * record_size, 0);
                let gpa = self.rings.at(g.record_offset(cpu, index));
                mem.read_phys(gpa, &mut batch.bytes[from..])
                    .map_err(|source| RingError::Memory {
                        what: "records",
                        gpa,
                        source,
                    })?;
                batch.meta.extend((0..run).map(|i| Meta {
                    ring: cpu,
                    index: index.wrapping_add(i),
                }));
                index = index.wrapping_add(run);
            }
            summary.records += pending as usize;
            self.publish(mem, cpu, head)?;
        }
        Ok(summary)
    }

    fn publish(&mut self, mem: &dyn RingMemory, cpu: u32, tail: u64) -> Result<(), RingError> {
        let gpa = self.rings.at(self.rings.geometry.ring_offset(cpu) + TAIL);
        mem.store_u64_release(gpa, tail).map_err(|source| RingError::Memory {
            what: "a ring's tail",
            gpa,
            source,
        })?;
        self.tails[cpu as usize] = tail;
        Ok(())
    }
}

/// Guest-physical memory in host memory, for tests and benchmarks of the rings: `len`
/// bytes from `base`, held as atomic words so that a thread playing the guest and one
/// playing the host may share it.
#[derive(Debug)]
pub struct HostRingMemory {
    base: Gpa,
    words: Box<[AtomicU64]>,
}

impl HostRingMemory {
    pub fn new(base: Gpa, len: u64) -> Self {
        let words = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        HostRingMemory { base, words }
    }

    /// The word index and byte shift of `gpa`, if `len` bytes from it are inside.
    fn locate(&self, gpa: Gpa, len: usize) -> Result<(usize, usize), hvprobe_arch::paging::PhysAccessError> {
        let off = gpa
            .0
            .checked_sub(self.base.0)
            .filter(|off| {
                off.checked_add(len as u64)
                    .is_some_and(|end| end <= self.words.len() as u64 * 8)
            })
            .ok_or(hvprobe_arch::paging::PhysAccessError::NotMemory { gpa, len })?;
        Ok(((off / 8) as usize, (off % 8) as usize))
    }

    /// Plays the guest's detour on this memory: [`EventRings::record_as_guest`].
    pub fn guest_record(&self, rings: &EventRings, cpu: u32, miss_slot: u32, record: &[u8]) -> Result<bool, RingError> {
        rings.record_as_guest(self, cpu, miss_slot, record)
    }
}

impl EventRings {
    /// Plays the guest's detour: the record protocol of the module docs, for one hit on
    /// `cpu` of the detour with miss-table entry `miss_slot`, whose record is `record`
    /// (header included; at most `record_size` bytes), in `mem`. Returns whether it was
    /// recorded (else `missed_full` and the entry were counted). For tests and benchmarks
    /// (one thread playing the guest: the entry's increment is not atomic here).
    pub fn record_as_guest(
        &self,
        mem: &dyn RingMemory,
        cpu: u32,
        miss_slot: u32,
        record: &[u8],
    ) -> Result<bool, RingError> {
        let g = self.geometry();
        let ring = self.gpa().0 + g.ring_offset(cpu);
        let head = load(mem, "a ring's head", Gpa(ring + HEAD))?;
        let tail = load(mem, "a ring's tail", Gpa(ring + TAIL))?;
        if head.wrapping_sub(tail) >= u64::from(g.capacity()) {
            let entry = g.probe_missed_offset(miss_slot).ok_or(RingError::NoSuchSlot {
                table: "miss-table",
                slot: miss_slot,
                slots: g.probe_slots(),
            })?;
            for at in [ring + MISSED_FULL, self.gpa().0 + entry] {
                let missed = load(mem, "a miss counter", Gpa(at))?;
                store(mem, "a miss counter", Gpa(at), missed.wrapping_add(1))?;
            }
            return Ok(false);
        }
        let len = record.len().min(g.record_size() as usize);
        let at = Gpa(self.gpa().0 + g.record_offset(cpu, head));
        mem.write_phys(at, &record[..len]).map_err(|source| RingError::Memory {
            what: "a record",
            gpa: at,
            source,
        })?;
        store(mem, "a ring's head", Gpa(ring + HEAD), head.wrapping_add(1))?;
        Ok(true)
    }
}

impl PhysRead for HostRingMemory {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        let (mut word, shift) = self.locate(gpa, buf.len())?;
        let mut done = 0;
        let mut skip = shift;
        while done < buf.len() {
            let bytes = self.words[word].load(Ordering::Relaxed).to_le_bytes();
            let n = (8 - skip).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&bytes[skip..skip + n]);
            done += n;
            skip = 0;
            word += 1;
        }
        Ok(())
    }
}

impl PhysWrite for HostRingMemory {
    fn write_phys(&self, gpa: Gpa, data: &[u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        let (mut word, shift) = self.locate(gpa, data.len())?;
        let mut done = 0;
        let mut skip = shift;
        while done < data.len() {
            let n = (8 - skip).min(data.len() - done);
            let mut bytes = self.words[word].load(Ordering::Relaxed).to_le_bytes();
            bytes[skip..skip + n].copy_from_slice(&data[done..done + n]);
            self.words[word].store(u64::from_le_bytes(bytes), Ordering::Relaxed);
            done += n;
            skip = 0;
            word += 1;
        }
        Ok(())
    }
}

impl RingMemory for HostRingMemory {
    fn load_u64_acquire(&self, gpa: Gpa) -> Result<u64, hvprobe_arch::paging::PhysAccessError> {
        match self.locate(gpa, 8)? {
            (word, 0) => Ok(self.words[word].load(Ordering::Acquire)),
            _ => Err(hvprobe_arch::paging::PhysAccessError::backend(NotAligned)),
        }
    }

    fn store_u64_release(&self, gpa: Gpa, value: u64) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        match self.locate(gpa, 8)? {
            (word, 0) => {
                self.words[word].store(value, Ordering::Release);
                Ok(())
            }
            _ => Err(hvprobe_arch::paging::PhysAccessError::backend(NotAligned)),
        }
    }
}

#[cfg(test)]
mod tests;
