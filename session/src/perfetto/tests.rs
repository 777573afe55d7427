use hvprobe_arch::Gva;

use super::*;

fn hit(cpu: usize, pid: i32, event: &str, timestamp_ns: u64) -> HitRecord {
    HitRecord {
        comm: "sh".into(),
        pid,
        cpu,
        timestamp_ns,
        group: "grp".into(),
        event: event.into(),
        location: "vfs_read+0x0/0x140".into(),
        retprobe_caller: None,
        args: Vec::new(),
        entry_timestamp_ns: None,
        stack: None,
    }
}

fn ret(cpu: usize, pid: i32, entered: u64, returned: u64) -> HitRecord {
    HitRecord {
        retprobe_caller: Some("ksys_read+0x6b/0x9c".into()),
        entry_timestamp_ns: Some(entered),
        args: vec![("ret".into(), ArgValue::Hex(1))],
        ..hit(cpu, pid, "ret", returned)
    }
}

fn packets(hits: &[HitRecord]) -> Vec<TracePacket> {
    let mut writer = PerfettoWriter::new(Vec::new()).unwrap();
    for h in hits {
        writer.write_hit(h).unwrap();
    }
    let bytes = writer.into_inner().unwrap();
    Trace::decode(&bytes[..]).unwrap().packet
}

fn events(packets: &[TracePacket]) -> Vec<(u64, &TrackEvent)> {
    packets
        .iter()
        .filter_map(|p| Some((p.timestamp.unwrap_or(0), p.track_event.as_ref()?)))
        .collect()
}

/// The interned tables as a reader holds them after `packets`, honouring the clears.
#[derive(Default)]
struct Tables {
    event_names: HashMap<u64, String>,
    annotation_names: HashMap<u64, String>,
    function_names: HashMap<u64, String>,
    frames: HashMap<u64, Frame>,
    callstacks: HashMap<u64, Vec<u64>>,
}

impl Tables {
    fn take(&mut self, packet: &TracePacket) {
        if packet.sequence_flags.unwrap_or(0) & proto::SEQ_INCREMENTAL_STATE_CLEARED != 0 {
            *self = Tables::default();
        }
        if let Some(d) = &packet.interned_data {
            for n in &d.event_names {
                self.event_names.insert(n.iid.unwrap(), n.name.clone().unwrap());
            }
            for n in &d.debug_annotation_names {
                self.annotation_names.insert(n.iid.unwrap(), n.name.clone().unwrap());
            }
            for n in &d.function_names {
                self.function_names
                    .insert(n.iid.unwrap(), String::from_utf8(n.str.clone().unwrap()).unwrap());
            }
            for f in &d.frames {
                self.frames.insert(f.iid.unwrap(), f.clone());
            }
            for c in &d.callstacks {
                self.callstacks.insert(c.iid.unwrap(), c.frame_ids.clone());
            }
        }
    }

    /// The annotations as `name=value` texts, a dictionary's entries as `dict.name=value`.
    fn annotations(&self, list: &[DebugAnnotation], prefix: &str) -> Vec<String> {
        let mut out = Vec::new();
        for a in list {
            let name = format!("{prefix}{}", self.annotation_names[&a.name_iid.unwrap()]);
            if !a.dict_entries.is_empty() {
                out.extend(self.annotations(&a.dict_entries, &format!("{name}.")));
            } else {
                out.push(format!("{name}={}", value_text(a)));
            }
        }
        out
    }
}

fn value_text(a: &DebugAnnotation) -> String {
    if let Some(v) = a.uint_value {
        format!("u{v}")
    } else if let Some(v) = a.int_value {
        format!("i{v}")
    } else if let Some(v) = a.pointer_value {
        format!("p{v:#x}")
    } else if let Some(v) = &a.string_value {
        format!("s{v:?}")
    } else {
        format!(
            "[{}]",
            a.array_values.iter().map(value_text).collect::<Vec<_>>().join(",")
        )
    }
}

#[test]
fn an_empty_trace_is_the_root_track_starting_the_sequence() {
    let p = packets(&[]);
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].first_packet_on_sequence, Some(true));
    assert_eq!(p[0].sequence_flags, Some(proto::SEQ_INCREMENTAL_STATE_CLEARED));
    assert_eq!(p[0].trusted_packet_sequence_id, Some(SEQUENCE_ID));
    let root = p[0].track_descriptor.as_ref().unwrap();
    assert_eq!(root.name.as_deref(), Some(ROOT_TRACK_NAME));
    assert_eq!(root.child_ordering, Some(proto::CHILD_ORDERING_EXPLICIT));
}

#[test]
fn a_kprobe_hit_is_an_instant_on_its_vcpus_track_with_typed_args() {
    let mut h = hit(1, 42, "open", 1_500);
    h.args = vec![
        ("count".into(), ArgValue::Unsigned(3)),
        ("delta".into(), ArgValue::Signed(-2)),
        ("flags".into(), ArgValue::Hex(0x8000)),
        ("path".into(), ArgValue::String(b"/etc/passwd".to_vec())),
        (
            "fn".into(),
            ArgValue::Symbol {
                address: 0xffff_ffff_8100_0000,
                description: Some("vfs_read+0x0/0x140".into()),
            },
        ),
        ("bad".into(), ArgValue::Fault),
        (
            "arr".into(),
            ArgValue::Array(vec![ArgValue::Unsigned(1), ArgValue::Fault]),
        ),
    ];
    let p = packets(&[h]);
    let mut tables = Tables::default();
    p.iter().for_each(|p| tables.take(p));
    assert!(p.iter().all(|p| p.trusted_packet_sequence_id == Some(SEQUENCE_ID)));
    let track = p[1].track_descriptor.as_ref().unwrap();
    assert_eq!(
        (
            track.uuid,
            track.parent_uuid,
            track.name.as_deref(),
            track.sibling_order_rank
        ),
        (Some(vcpu_track(1)), Some(ROOT_TRACK), Some("vCPU 1"), Some(1))
    );
    let ev = events(&p);
    assert_eq!(ev.len(), 1);
    let (ts, e) = ev[0];
    assert_eq!(ts, 1_500);
    assert_eq!(e.r#type, Some(proto::TYPE_INSTANT));
    assert_eq!(e.track_uuid, Some(vcpu_track(1)));
    assert_eq!(tables.event_names[&e.name_iid.unwrap()], "grp/open");
    assert_eq!(e.categories, ["grp"]);
    assert_eq!(
        tables.annotations(&e.debug_annotations, ""),
        [
            "comm=s\"sh\"",
            "pid=i42",
            "cpu=u1",
            "location=s\"vfs_read+0x0/0x140\"",
            "args.count=u3",
            "args.delta=i-2",
            "args.flags=p0x8000",
            "args.path=s\"/etc/passwd\"",
            "args.fn=s\"vfs_read+0x0/0x140\"",
            "args.bad=s\"(fault)\"",
            "args.arr=[u1,s\"(fault)\"]",
        ]
    );
    let event_packet = p.iter().find(|p| p.track_event.is_some()).unwrap();
    assert_eq!(event_packet.sequence_flags, Some(proto::SEQ_NEEDS_INCREMENTAL_STATE));
}

#[test]
fn names_are_interned_once_per_sequence() {
    let p = packets(&[hit(0, 1, "a", 1), hit(0, 1, "a", 2), hit(0, 1, "b", 3)]);
    let with_events: Vec<&TracePacket> = p.iter().filter(|p| p.track_event.is_some()).collect();
    let new_names: Vec<usize> = with_events
        .iter()
        .map(|p| p.interned_data.as_ref().map_or(0, |d| d.event_names.len()))
        .collect();
    assert_eq!(new_names, [1, 0, 1]);
    let iids: Vec<u64> = with_events
        .iter()
        .map(|p| p.track_event.as_ref().unwrap().name_iid.unwrap())
        .collect();
    assert_eq!(iids, [1, 1, 2]);
    // The annotation names went with the first event only.
    assert!(with_events[1].interned_data.is_none());
}

#[test]
fn a_return_with_its_entry_is_a_slice_on_its_tasks_track() {
    let p = packets(&[ret(1, 42, 100, 250)]);
    let mut tables = Tables::default();
    p.iter().for_each(|p| tables.take(p));
    let thread = p
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref())
        .find(|t| t.thread.is_some())
        .unwrap();
    assert_eq!(thread.uuid, Some(task_track(42)));
    let t = thread.thread.as_ref().unwrap();
    assert_eq!(
        (t.pid, t.tid, t.thread_name.as_deref()),
        (Some(42), Some(42), Some("sh"))
    );
    let ev = events(&p);
    assert_eq!(ev.len(), 2);
    let ((begin_ts, begin), (end_ts, end)) = (ev[0], ev[1]);
    assert_eq!((begin_ts, end_ts), (100, 250));
    assert_eq!(begin.r#type, Some(proto::TYPE_SLICE_BEGIN));
    assert_eq!(end.r#type, Some(proto::TYPE_SLICE_END));
    assert_eq!(
        (begin.track_uuid, end.track_uuid),
        (Some(task_track(42)), Some(task_track(42)))
    );
    assert_eq!(tables.event_names[&begin.name_iid.unwrap()], "grp/ret");
    assert_eq!(
        tables.annotations(&begin.debug_annotations, ""),
        [
            "comm=s\"sh\"",
            "pid=i42",
            "cpu=u1",
            "location=s\"vfs_read+0x0/0x140\"",
            "caller=s\"ksys_read+0x6b/0x9c\"",
            "args.ret=p0x1",
        ]
    );
    // The vCPU's track exists (the hit's vCPU), with nothing on it.
    assert!(p
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref())
        .any(|t| t.uuid == Some(vcpu_track(1))));
}

#[test]
fn idle_tasks_get_a_slice_track_per_vcpu_and_an_unknown_task_an_instant() {
    let mut idle0 = ret(0, 0, 10, 20);
    idle0.comm = "swapper/0".into();
    let mut idle1 = ret(1, 0, 11, 21);
    idle1.comm = "swapper/1".into();
    let mut unknown = ret(1, -1, 30, 40);
    unknown.comm = "<...>".into();
    let p = packets(&[idle0, idle1, unknown]);
    let mut tables = Tables::default();
    p.iter().for_each(|p| tables.take(p));
    let names: Vec<&str> = p
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref()?.name.as_deref())
        .collect();
    assert_eq!(
        names,
        [
            ROOT_TRACK_NAME,
            "vCPU 0",
            "swapper/0 (pid 0)",
            "vCPU 1",
            "swapper/1 (pid 0)"
        ]
    );
    let ev = events(&p);
    let tracks: Vec<(Option<i32>, Option<u64>)> = ev.iter().map(|(_, e)| (e.r#type, e.track_uuid)).collect();
    assert_eq!(
        tracks,
        [
            (Some(proto::TYPE_SLICE_BEGIN), Some(idle_track(0))),
            (Some(proto::TYPE_SLICE_END), Some(idle_track(0))),
            (Some(proto::TYPE_SLICE_BEGIN), Some(idle_track(1))),
            (Some(proto::TYPE_SLICE_END), Some(idle_track(1))),
            (Some(proto::TYPE_INSTANT), Some(vcpu_track(1))),
        ]
    );
    let (ts, instant) = ev[4];
    assert_eq!(ts, 40);
    assert!(tables
        .annotations(&instant.debug_annotations, "")
        .contains(&"entry_timestamp_ns=u30".to_string()));
}

#[test]
fn a_new_comm_describes_the_tasks_track_again() {
    let mut after_exec = ret(0, 42, 30, 40);
    after_exec.comm = "cat".into();
    let p = packets(&[ret(0, 42, 10, 20), ret(0, 42, 12, 18), after_exec]);
    let names: Vec<&str> = p
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref()?.thread.as_ref()?.thread_name.as_deref())
        .collect();
    assert_eq!(names, ["sh", "cat"]);
}

#[test]
fn stacks_are_interned_callstacks_outermost_frame_first() {
    let stack = vec![
        StackFrame {
            address: Gva(0xffff_ffff_8115_707b),
            symbol: Some("vfs_read+0x0/0x140".into()),
        },
        StackFrame {
            address: Gva(0xffff_ffff_8115_7512),
            symbol: Some("ksys_read+0x6b/0x9c".into()),
        },
        StackFrame {
            address: Gva(0xffff_c900_0000_1234),
            symbol: None,
        },
    ];
    let mut first = hit(0, 7, "read", 5);
    first.stack = Some(stack.clone());
    let mut again = hit(0, 7, "read", 6);
    again.stack = Some(stack);
    let mut a_return = ret(0, 7, 1, 9);
    a_return.stack = Some(vec![StackFrame {
        address: Gva(0xffff_ffff_8115_7512),
        symbol: Some("ksys_read+0x6b/0x9c".into()),
    }]);
    let p = packets(&[first, again, a_return]);
    let mut tables = Tables::default();
    p.iter().for_each(|p| tables.take(p));
    let ev = events(&p);
    let stacks: Vec<Option<u64>> = ev.iter().map(|(_, e)| e.callstack_iid).collect();
    // The return's stack is on its end: it was taken at the return.
    assert_eq!(stacks, [Some(1), Some(1), None, Some(2)]);
    let functions = |iid: u64| -> Vec<(String, u64)> {
        tables.callstacks[&iid]
            .iter()
            .map(|f| {
                let frame = &tables.frames[f];
                assert_eq!(frame.kind, Some(proto::FRAME_KIND_KERNEL));
                assert_eq!(frame.mapping_id, Some(1));
                (
                    tables.function_names[&frame.function_name_id.unwrap()].clone(),
                    frame.rel_pc.unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(
        functions(1),
        [
            ("0xffffc90000001234".to_string(), 0xffff_c900_0000_1234),
            ("ksys_read".to_string(), 0xffff_ffff_8115_7512),
            ("vfs_read".to_string(), 0xffff_ffff_8115_707b),
        ]
    );
    assert_eq!(functions(2), [("ksys_read".to_string(), 0xffff_ffff_8115_7512)]);
    // The shared frame was interned once; the mapping once, with its path.
    let new_frames: usize = p
        .iter()
        .filter_map(|p| p.interned_data.as_ref())
        .map(|d| d.frames.len())
        .sum();
    assert_eq!(new_frames, 3);
    let mappings: Vec<&Mapping> = p
        .iter()
        .filter_map(|p| p.interned_data.as_ref())
        .flat_map(|d| &d.mappings)
        .collect();
    assert_eq!(mappings.len(), 1);
    assert_eq!(
        (mappings[0].start, mappings[0].path_string_ids.as_slice()),
        (Some(0), &[1][..])
    );
}

#[test]
fn full_tables_clear_the_sequences_incremental_state() {
    // Each distinct event name is one entry, plus the five annotation names of the first.
    let hits: Vec<HitRecord> = (0..INTERNED_LIMIT)
        .map(|i| hit(0, 1, &format!("e{i}"), i as u64))
        .collect();
    let p = packets(&hits);
    let event_packets: Vec<&TracePacket> = p.iter().filter(|p| p.track_event.is_some()).collect();
    let cleared: Vec<usize> = event_packets
        .iter()
        .enumerate()
        .filter(|(_, p)| p.sequence_flags.unwrap() & proto::SEQ_INCREMENTAL_STATE_CLEARED != 0)
        .map(|(i, _)| i)
        .collect();
    // 4 annotation names + N event names reach the limit after N = LIMIT - 4 events.
    assert_eq!(cleared, [INTERNED_LIMIT - 4]);
    let after = event_packets[INTERNED_LIMIT - 4];
    assert!(after.sequence_flags.unwrap() & proto::SEQ_NEEDS_INCREMENTAL_STATE != 0);
    let data = after.interned_data.as_ref().unwrap();
    assert_eq!(data.event_names[0].iid, Some(1), "iids start again");
    assert_eq!(data.debug_annotation_names.len(), 4, "annotation names again");
    let mut tables = Tables::default();
    for packet in &p {
        tables.take(packet);
        if let Some(e) = &packet.track_event {
            // Every reference resolves in the state as the reader holds it.
            assert!(tables.event_names.contains_key(&e.name_iid.unwrap()));
            tables.annotations(&e.debug_annotations, "");
        }
    }
}

#[test]
fn an_unwritable_file_is_refused_with_its_path() {
    let dir = std::env::temp_dir().join(format!("hvprobe-perfetto-test-{}", std::process::id()));
    let path = dir.join("no-such-dir").join("t.pftrace");
    let e = PerfettoFile::create(&path).err().expect("the directory does not exist");
    assert!(matches!(e, PerfettoError::Create { .. }));
    assert!(e.to_string().contains("no-such-dir/t.pftrace"), "{e}");
}

#[test]
fn a_file_holds_the_trace_when_finished() {
    let path = std::env::temp_dir().join(format!("hvprobe-perfetto-test-{}.pftrace", std::process::id()));
    let mut file = PerfettoFile::create(&path).unwrap();
    file.write_hit(&hit(0, 1, "a", 1));
    file.write_hit(&ret(1, 2, 3, 4));
    let summary = file.finish().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        (
            summary.instants,
            summary.slices,
            summary.vcpu_tracks,
            summary.task_tracks
        ),
        (1, 1, 2, 1)
    );
    assert_eq!(summary.bytes, bytes.len() as u64);
    assert_eq!(Trace::decode(&bytes[..]).unwrap().packet.len(), 1 + 2 + 1 + 1 + 2);
}
