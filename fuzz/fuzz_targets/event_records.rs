//! Fuzzes the host's side of event detours over ring memory a hostile kernel controls:
//! the drain (`RingReader::drain`: heads, tails and records are the guest's to write)
//! and the decoding of each record it takes (`EventLayout::decode_with`, `task`, `call`),
//! for a layout with every kind of value an event detour records — strings, arrays, the
//! fault mask, the task stamp and an exit-free return's caller, entry TSC and `$duration`.
//!
//! The input is the rings' memory itself (one CPU, 8 records of 256 bytes; what the input
//! does not cover stays zero). Checked: nothing panics; a drain takes at most a ring's
//! worth of records, each no larger than a record; each decode gives one value per
//! argument and arrays of their length.
#![no_main]

use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::detour::event::{ArgKind, ArgLayout, EventLayout, ReturnFields};
use hvprobe_probes::detour::ring::{EventBatch, EventRings, HostRingMemory, RingGeometry, RingReader};
use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::detour::ring::RingMemory;
use hvprobe_probes::spec::ArgType;
use libfuzzer_sys::fuzz_target;

const BASE: u64 = 0x10_0000;

fn layout() -> EventLayout {
    let arg = |name: &str, ty, array_len, slot, fault_bit, kind| ArgLayout {
        name: name.into(),
        ty,
        array_len,
        slot,
        fault_bit,
        kind,
    };
    EventLayout {
        probe_id: 1,
        size: 256,
        faults_written: true,
        task: Some(24),
        ret: Some(ReturnFields {
            caller: 48,
            entry_tsc: 56,
        }),
        args: vec![
            arg("ret", ArgType::S64, None, 72, None, ArgKind::Value),
            arg("lat", ArgType::U64, None, 80, None, ArgKind::Duration),
            arg("s", ArgType::String, None, 88, Some(2), ArgKind::String { area: 120, len: 64 }),
            arg("a", ArgType::X16, Some(8), 96, Some(3), ArgKind::Array { area: 184, elem: 2, count: 8 }),
            arg("f", ArgType::U32, None, 104, None, ArgKind::Fault),
            arg("sym", ArgType::Symbol, None, 112, None, ArgKind::Value),
            // Out of the record: always `(fault)`, never a panic.
            arg("far", ArgType::U64, None, 4096, None, ArgKind::Value),
            arg("fars", ArgType::String, None, 4096, None, ArgKind::String { area: 250, len: 64 }),
        ],
    }
}

fuzz_target!(|data: &[u8]| {
    let geometry = RingGeometry::new(1, 8, 256).expect("geometry");
    let size = geometry.total_size();
    let rings = EventRings::new(geometry, Gva(0xffff_ffff_c000_0000), Gpa(BASE), size).expect("rings");
    let mem = HostRingMemory::new(Gpa(BASE), size);
    for (i, chunk) in data.chunks(8).take((size / 8) as usize).enumerate() {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        let _ = mem.store_u64_release(Gpa(BASE + 8 * i as u64), u64::from_le_bytes(word));
    }
    let symbols = SymbolTable::parse_system_map("ffffffff81000000 T _stext\nffffffff81000100 T func\n")
        .expect("symbols");
    let layout = layout();
    let mut reader = RingReader::new(rings);
    let mut batch = EventBatch::new();
    for _ in 0..2 {
        if reader.drain(&mem, &mut batch).is_err() {
            continue;
        }
        assert!(batch.iter().count() <= 8, "more records than a ring holds");
        for event in batch.iter() {
            assert!(event.record.len() <= 256);
            let values = layout.decode_with(event.record, &symbols, Some(event.tsc));
            assert_eq!(values.len(), layout.args.len());
            if let (_, ArgValue::Array(a)) = &values[3] {
                assert_eq!(a.len(), 8);
            }
            let _ = layout.task(event.record);
            let _ = layout.call(event.record);
        }
    }
});
