//! `hvprobe bench drain`: how fast the host takes records out of the event rings, with a
//! producer that fills them as fast as it can.
//!
//! The producer is a host thread playing the guest's event detours: the rings' record
//! protocol ([`EventRings::record_as_guest`]) round-robin over the CPUs' rings, in guest
//! memory mapped as a VM's is (vm-memory's mmap, read as the engine reads it), with
//! records of a four-argument probe with the task stamp. (A guest on kvm_pvm cannot fill a
//! ring fast: each record costs ~47 emulated instructions, ~70 µs.) The consumer is what
//! the engine's drain thread does: [`RingReader::drain`], then every record decoded into
//! its values and task. Two consumers side by side: one draining in a loop, and one every
//! 2 ms, the engine's period, where a ring that fills between two drains drops records,
//! counted in the rings' `missed_full` as the guest counts them.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::GuestPhys;
use hvprobe_probes::detour::event::{event_detour, EventDetourParams, EventLayout, GuestKernelFacts};
use hvprobe_probes::detour::ring::{EventBatch, EventRings, RingGeometry, RingReader};
use hvprobe_probes::spec::{parse_line, ProbeSpec};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use crate::cli::DrainBenchArgs;

use crate::cmd::CliResult;

const RINGS_GPA: Gpa = Gpa(0x10_0000);
const RINGS_GVA: Gva = Gva(0xffff_ffff_8240_0000);
const FUNC: u64 = 0xffff_ffff_8100_0000;
const RECORD_SIZE: u32 = 128;
const PROBE_ID: u32 = 7;
/// The probe's entry in the rings' miss table.
const MISS_SLOT: u32 = 0;
/// The engine's drain period (`event-drain` thread).
const ENGINE_PERIOD: Duration = Duration::from_millis(2);

/// The probe's record layout: what the engine decodes a record with.
fn layout(rings: &EventRings) -> Result<EventLayout, Box<dyn std::error::Error>> {
    let args = match parse_line("p:bench/func func %di %si $stack1 $stack2")? {
        Some(ProbeSpec::Kprobe { args, .. }) => args,
        other => return Err(format!("the benchmark's probe: {other:?}").into()),
    };
    let kernel = GuestKernelFacts {
        cpu_number: 0x10,
        current_task: Some(0x18),
        comm_offset: Some(0x40),
        pid_offset: Some(0x20),
        copy_from_kernel_nofault: None,
        strncpy_from_kernel_nofault: None,
        copy_from_user_nofault: None,
        strncpy_from_user_nofault: None,
        thread_size: 16 << 10,
        rethooks: None,
    };
    let detour = event_detour(&EventDetourParams {
        probe_id: PROBE_ID,
        miss_slot: MISS_SLOT,
        probe_address: Gva(FUNC),
        detour_ip: Gva(RINGS_GVA.0 - 0x1000),
        args: &args,
        rings,
        kernel: &kernel,
        symbols: &symbols(),
        string_size: 32,
        record_task: true,
        filter: None,
        displaced: &|_| Ok(vec![0xc3]),
        returns: None,
    })?;
    Ok(detour.layout)
}

fn symbols() -> SymbolTable {
    SymbolTable::parse_system_map(&format!("{FUNC:016x} T func\n{:016x} T func_end\n", FUNC + 0x100))
        .expect("a two-line System.map parses")
}

/// One consumer's run: records offered by the producer, recorded, drained (and decoded),
/// missed because a ring was full, and the time it ran.
struct DrainRun {
    offered: u64,
    drained: u64,
    missed: u64,
    time: Duration,
}

fn run_consumer(
    geometry: RingGeometry,
    seconds: f64,
    period: Option<Duration>,
) -> Result<DrainRun, Box<dyn std::error::Error>> {
    let mem = Arc::new(GuestPhys(GuestMemoryMmap::from_ranges(&[(
        GuestAddress(RINGS_GPA.0),
        geometry.total_size().next_multiple_of(4096) as usize,
    )])?));
    let rings = EventRings::new(geometry, RINGS_GVA, RINGS_GPA, geometry.total_size())?;
    rings.init(&*mem)?;
    let layout = layout(&rings)?;
    let symbols = symbols();
    let stop = Arc::new(AtomicBool::new(false));
    let offered = Arc::new(AtomicU64::new(0));
    let producer = {
        let (mem, rings, stop, offered) = (mem.clone(), rings, stop.clone(), offered.clone());
        std::thread::spawn(move || -> Result<(), hvprobe_probes::detour::ring::RingError> {
            let mut record = vec![0u8; RECORD_SIZE as usize];
            record[..4].copy_from_slice(&PROBE_ID.to_le_bytes());
            record[24..28].copy_from_slice(&4242u32.to_le_bytes());
            record[32..36].copy_from_slice(b"bash");
            let cpus = rings.geometry().cpus();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let cpu = (n % u64::from(cpus)) as u32;
                record[4..8].copy_from_slice(&cpu.to_le_bytes());
                record[8..16].copy_from_slice(&n.to_le_bytes());
                record[56..64].copy_from_slice(&n.to_le_bytes());
                rings.record_as_guest(&*mem, cpu, MISS_SLOT, &record)?;
                n += 1;
            }
            offered.store(n, Ordering::Relaxed);
            Ok(())
        })
    };
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    let mut drained = 0u64;
    let mut values = 0usize;
    let mut drain = |reader: &mut RingReader, batch: &mut EventBatch| -> Result<(), Box<dyn std::error::Error>> {
        reader.drain(&*mem, batch)?;
        for e in batch.iter() {
            values += layout.decode(e.record, &symbols).len();
            if layout.task(e.record).is_none() {
                return Err("a record without its task stamp".into());
            }
        }
        drained += batch.len() as u64;
        Ok(())
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    while Instant::now() < deadline {
        drain(&mut reader, &mut batch)?;
        if let Some(period) = period {
            std::thread::sleep(period);
        }
    }
    stop.store(true, Ordering::Relaxed);
    producer.join().map_err(|_| "the producer thread panicked")??;
    drain(&mut reader, &mut batch)?;
    let time = started.elapsed();
    if values != 4 * drained as usize {
        return Err(format!("{drained} records decoded into {values} values, not 4 each").into());
    }
    let missed = rings.missed(&*mem)?.total();
    let offered = offered.load(Ordering::Relaxed);
    if drained + missed != offered {
        return Err(format!("{offered} records offered, {drained} drained and {missed} missed").into());
    }
    let probe_missed = rings.probe_missed(&*mem, MISS_SLOT)?;
    if probe_missed != missed {
        return Err(format!("the rings missed {missed} records, the probe's entry says {probe_missed}").into());
    }
    Ok(DrainRun {
        offered,
        drained,
        missed,
        time,
    })
}

pub fn bench_drain(args: DrainBenchArgs) -> CliResult {
    if args.cpus == 0 || args.runs == 0 || args.seconds <= 0.0 {
        return Err("--cpus and --runs must be at least 1, --seconds more than 0".into());
    }
    let geometry = RingGeometry::new(args.cpus, args.capacity, RECORD_SIZE)?;
    println!(
        "event-ring drain: {} rings of {} records of {} bytes (a probe with four fetch-args and the task \
         stamp), a producer thread filling them as fast as it can, {} s per run, median of {} runs:",
        args.cpus, args.capacity, RECORD_SIZE, args.seconds, args.runs
    );
    for (label, period) in [
        ("drained in a loop", None),
        ("drained every 2 ms (the engine's period)", Some(ENGINE_PERIOD)),
    ] {
        let mut runs = Vec::new();
        for _ in 0..args.runs {
            runs.push(run_consumer(geometry, args.seconds, period)?);
        }
        runs.sort_by(|a, b| {
            let rate = |r: &DrainRun| r.drained as f64 / r.time.as_secs_f64();
            rate(a).total_cmp(&rate(b))
        });
        let r = &runs[runs.len() / 2];
        let secs = r.time.as_secs_f64();
        println!(
            "  {label:<42} {:6.2} M events/s drained and decoded; producer {:6.2} M/s; dropped {} ({:.1} %)",
            r.drained as f64 / secs / 1e6,
            r.offered as f64 / secs / 1e6,
            r.missed,
            100.0 * r.missed as f64 / r.offered.max(1) as f64
        );
    }
    println!(
        "  (every record offered is drained or counted in its ring's missed_full, checked per run; the \
         producer's rate is what one host core writes, far above a guest's)"
    );
    Ok(ExitCode::SUCCESS)
}
