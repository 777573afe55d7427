//! `--perfetto FILE`: probe hits as a Perfetto trace (a stream of `TracePacket`s in
//! Perfetto's TrackEvent format), written as the hits come, for ui.perfetto.dev and Perfetto's
//! trace processor.
//!
//! What the trace holds:
//! - **A track per vCPU** (`vCPU N`, under one `hvprobe guest` track that orders them by
//!   number): every kprobe hit is an instant event there, named `GRP/EVENT`, category
//!   `GRP`.
//! - **Return probes as slices.** A return hit whose record knows when its call entered
//!   ([`HitRecord::entry_timestamp_ns`]) is a slice from the entry to the return, on the
//!   track of the **task** that made the call (a thread track, tid = the guest pid, named by
//!   its comm), not on a vCPU's: slices on one track must nest, and a task's calls do (they
//!   are last in, first out on its own kernel stack; the engine pairs entries and returns
//!   per stack), while on one vCPU the calls of several tasks interleave whenever one is
//!   preempted mid-call, and one call can enter on one vCPU and return on another when its
//!   task migrates. The idle tasks all have pid 0, one per CPU and never migrating, so their
//!   slices go on one track per vCPU (`swapper/N (pid 0)`). A return whose task is unknown
//!   (pid -1) cannot be placed safely and stays an instant on its vCPU's track, with its
//!   entry time as an argument.
//! - **Arguments** as debug annotations, the same fields as `--format json`: `comm`, `pid`,
//!   `cpu`, `location`, `caller` (return probes) and the fetch-args in a dictionary `args`
//!   (so that a fetch-arg named `comm` stays apart): unsigned types as unsigned integers,
//!   signed ones as integers, `x8..x64` as Perfetto's pointer values (integers it shows in
//!   hex, as ftrace prints them), strings and symbols as the text ftrace prints (strings
//!   without the quotes), arrays as arrays, and a fetch that faulted as the string
//!   `(fault)`.
//! - **Stacks** ([`HitRecord::stack`]) as TrackEvent callstacks (`callstack_iid`, interned
//!   `Callstack` of interned kernel `Frame`s: function name, the address as `rel_pc` in a
//!   `[kernel.kallsyms]` mapping that starts at 0, `KIND_KERNEL`). A return's stack is taken
//!   at the return, so it goes on the slice's end.
//!
//! Timestamps are [`HitRecord::timestamp_ns`], the guest's trace clock, in the trace's
//! default clock (BOOTTIME, so no `ClockSnapshot` is needed): the guest's clock counts from
//! the guest's boot, which is what BOOTTIME means inside the guest. It is not the host's
//! BOOTTIME; a trace recorded on the host would need a clock snapshot pairing the two to be
//! merged with this one.
//!
//! Everything is on one packet sequence (`trusted_packet_sequence_id` 1). Event names,
//! annotation names and stacks are interned: each packet that refers to interned data says
//! `SEQ_NEEDS_INCREMENTAL_STATE`, the first packet of the sequence says
//! `SEQ_INCREMENTAL_STATE_CLEARED`, and so does the first packet after the writer drops its
//! tables when they reach [`INTERNED_LIMIT`] entries, which keeps the memory of a long run
//! bounded (the writer keeps no hit, only what it interned and the tracks it described).
//! The file is a valid trace after every packet: Perfetto's `Trace` message is its repeated
//! `packet` field, so packets appended one by one make one trace.

mod proto;

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::{HitRecord, StackFrame};
use prost::Message;

use proto::{
    Callstack, DebugAnnotation, DebugAnnotationName, EventName, Frame, InternedData, InternedString, Mapping,
    ThreadDescriptor, Trace, TracePacket, TrackDescriptor, TrackEvent,
};

/// The packet sequence every packet is on.
pub const SEQUENCE_ID: u32 = 1;

/// Interned entries (names, frames, stacks) after which the writer clears its tables and
/// starts the sequence's incremental state anew.
pub const INTERNED_LIMIT: usize = 1 << 16;

/// Track uuids: one number space per kind of track, so that no two collide.
const ROOT_TRACK: u64 = 1;
fn vcpu_track(cpu: usize) -> u64 {
    1 << 32 | cpu as u64
}
fn task_track(pid: i32) -> u64 {
    2 << 32 | u64::from(pid as u32)
}
fn idle_track(cpu: usize) -> u64 {
    3 << 32 | cpu as u64
}

/// The root track's name, above the vCPU tracks.
pub const ROOT_TRACK_NAME: &str = "hvprobe guest";

/// The track name of vCPU `cpu`.
pub fn vcpu_track_name(cpu: usize) -> String {
    format!("vCPU {cpu}")
}

/// The path component of the mapping the kernel's frames are in (what `perf` calls it).
const KERNEL_MAPPING_PATH: &str = "[kernel.kallsyms]";

/// What a trace holds, for the summary at the end of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceSummary {
    /// Hits written as instants.
    pub instants: u64,
    /// Return hits written as slices (a begin and an end each).
    pub slices: u64,
    pub vcpu_tracks: usize,
    /// Thread tracks (one per guest pid) and idle tracks.
    pub task_tracks: usize,
    /// Hits with a stack.
    pub callstacks: u64,
    pub bytes: u64,
}

impl TraceSummary {
    pub fn hits(&self) -> u64 {
        self.instants + self.slices
    }
}

/// What a finished trace file holds, as one line for stderr.
pub fn summary_line(path: &str, s: &TraceSummary) -> String {
    format!(
        "Perfetto trace {path}: {} hits ({} instants, {} return slices, {} with a stack) on {} vCPU tracks and {} \
         task tracks, {} bytes",
        s.hits(),
        s.instants,
        s.slices,
        s.callstacks,
        s.vcpu_tracks,
        s.task_tracks,
        s.bytes
    )
}

/// What was interned since the sequence's incremental state was last cleared.
#[derive(Default)]
struct Interned {
    event_names: HashMap<String, u64>,
    annotation_names: HashMap<String, u64>,
    function_names: HashMap<String, u64>,
    /// By address.
    frames: HashMap<u64, u64>,
    /// By the frames' addresses, innermost first.
    callstacks: HashMap<Vec<u64>, u64>,
    kernel_mapping: Option<u64>,
}

impl Interned {
    fn len(&self) -> usize {
        self.event_names.len()
            + self.annotation_names.len()
            + self.function_names.len()
            + self.frames.len()
            + self.callstacks.len()
    }
}

/// The iid of `key` in `table`, adding it (and telling `new` to emit it) when it is new.
/// iids start at 1 per table (0 means unset) and are never reused until the tables are
/// cleared, since the table only grows until then.
fn intern<K: std::hash::Hash + Eq>(table: &mut HashMap<K, u64>, key: K, new: impl FnOnce(u64)) -> u64 {
    if let Some(&iid) = table.get(&key) {
        return iid;
    }
    let iid = table.len() as u64 + 1;
    table.insert(key, iid);
    new(iid);
    iid
}

/// Writes hits as Perfetto packets to `out`, one packet at a time.
pub struct PerfettoWriter<W: Write> {
    out: W,
    /// One packet's bytes, reused.
    scratch: Vec<u8>,
    interned: Interned,
    /// The next packet that refers to interned data must say the state was cleared.
    cleared_pending: bool,
    vcpus: BTreeSet<usize>,
    /// Described thread tracks: pid → the comm they were last described with.
    tasks: HashMap<i32, String>,
    idle: BTreeSet<usize>,
    summary: TraceSummary,
}

impl<W: Write> PerfettoWriter<W> {
    /// Starts the trace: the sequence's first packet (the root track) goes out at once.
    pub fn new(out: W) -> io::Result<Self> {
        let mut writer = PerfettoWriter {
            out,
            scratch: Vec::new(),
            interned: Interned::default(),
            cleared_pending: false,
            vcpus: BTreeSet::new(),
            tasks: HashMap::new(),
            idle: BTreeSet::new(),
            summary: TraceSummary::default(),
        };
        writer.write_packet(TracePacket {
            first_packet_on_sequence: Some(true),
            sequence_flags: Some(proto::SEQ_INCREMENTAL_STATE_CLEARED),
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(ROOT_TRACK),
                name: Some(ROOT_TRACK_NAME.into()),
                child_ordering: Some(proto::CHILD_ORDERING_EXPLICIT),
                ..Default::default()
            }),
            ..Default::default()
        })?;
        Ok(writer)
    }

    pub fn summary(&self) -> TraceSummary {
        self.summary
    }

    /// Writes one hit: an instant, or a slice for a return that knows its entry.
    pub fn write_hit(&mut self, hit: &HitRecord) -> io::Result<()> {
        let vcpu = self.vcpu_track(hit.cpu)?;
        let slice_track = match hit.entry_timestamp_ns {
            Some(_) => self.slice_track(hit)?,
            None => None,
        };
        if self.interned.len() >= INTERNED_LIMIT {
            self.interned = Interned::default();
            self.cleared_pending = true;
        }
        let mut new = InternedData::default();
        let name_iid = intern(
            &mut self.interned.event_names,
            format!("{}/{}", hit.group, hit.event),
            |iid| {
                new.event_names.push(EventName {
                    iid: Some(iid),
                    name: Some(format!("{}/{}", hit.group, hit.event)),
                })
            },
        );
        let annotations = self.annotations(hit, slice_track.is_none(), &mut new);
        let callstack_iid = hit.stack.as_deref().map(|stack| self.callstack(stack, &mut new));
        if callstack_iid.is_some() {
            self.summary.callstacks += 1;
        }
        let event = TrackEvent {
            name_iid: Some(name_iid),
            categories: vec![hit.group.clone()],
            debug_annotations: annotations,
            ..Default::default()
        };
        match (slice_track, hit.entry_timestamp_ns) {
            (Some(track), Some(entered)) => {
                // A clock that went back must not make an end before its begin.
                let begin = entered.min(hit.timestamp_ns);
                self.write_event(
                    begin,
                    TrackEvent {
                        r#type: Some(proto::TYPE_SLICE_BEGIN),
                        track_uuid: Some(track),
                        ..event
                    },
                    new,
                )?;
                self.write_event(
                    hit.timestamp_ns,
                    TrackEvent {
                        r#type: Some(proto::TYPE_SLICE_END),
                        track_uuid: Some(track),
                        callstack_iid,
                        ..Default::default()
                    },
                    InternedData::default(),
                )?;
                self.summary.slices += 1;
            }
            _ => {
                self.write_event(
                    hit.timestamp_ns,
                    TrackEvent {
                        r#type: Some(proto::TYPE_INSTANT),
                        track_uuid: Some(vcpu),
                        callstack_iid,
                        ..event
                    },
                    new,
                )?;
                self.summary.instants += 1;
            }
        }
        Ok(())
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Flushes and hands the output back.
    pub fn into_inner(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }

    /// A packet on the sequence, appended to the output as a one-packet `Trace`.
    fn write_packet(&mut self, packet: TracePacket) -> io::Result<()> {
        let packet = TracePacket {
            trusted_packet_sequence_id: Some(SEQUENCE_ID),
            ..packet
        };
        self.scratch.clear();
        Trace { packet: vec![packet] }
            .encode(&mut self.scratch)
            .map_err(io::Error::other)?;
        self.out.write_all(&self.scratch)?;
        self.summary.bytes += self.scratch.len() as u64;
        Ok(())
    }

    /// A track event at `timestamp`, with the interned data it is the first to use.
    fn write_event(&mut self, timestamp: u64, event: TrackEvent, new: InternedData) -> io::Result<()> {
        let mut flags = proto::SEQ_NEEDS_INCREMENTAL_STATE;
        if std::mem::take(&mut self.cleared_pending) {
            flags |= proto::SEQ_INCREMENTAL_STATE_CLEARED;
        }
        self.write_packet(TracePacket {
            timestamp: Some(timestamp),
            track_event: Some(event),
            interned_data: (!new.is_empty()).then_some(new),
            sequence_flags: Some(flags),
            ..Default::default()
        })
    }

    /// `cpu`'s track, described the first time.
    fn vcpu_track(&mut self, cpu: usize) -> io::Result<u64> {
        let uuid = vcpu_track(cpu);
        if self.vcpus.insert(cpu) {
            self.summary.vcpu_tracks += 1;
            self.write_packet(TracePacket {
                track_descriptor: Some(TrackDescriptor {
                    uuid: Some(uuid),
                    parent_uuid: Some(ROOT_TRACK),
                    name: Some(vcpu_track_name(cpu)),
                    sibling_order_rank: Some(cpu as i32),
                    ..Default::default()
                }),
                ..Default::default()
            })?;
        }
        Ok(uuid)
    }

    /// The track a return's slice goes on (see the module's doc), described the first time
    /// (and again when the task's comm changed, as after an exec); `None` for an unknown
    /// task.
    fn slice_track(&mut self, hit: &HitRecord) -> io::Result<Option<u64>> {
        if hit.pid < 0 {
            return Ok(None);
        }
        if hit.pid == 0 {
            let uuid = idle_track(hit.cpu);
            if self.idle.insert(hit.cpu) {
                self.summary.task_tracks += 1;
                self.write_packet(TracePacket {
                    track_descriptor: Some(TrackDescriptor {
                        uuid: Some(uuid),
                        parent_uuid: Some(ROOT_TRACK),
                        name: Some(format!("{} (pid 0)", hit.comm)),
                        // After the vCPU tracks.
                        sibling_order_rank: Some(i32::MAX / 2 + hit.cpu as i32),
                        ..Default::default()
                    }),
                    ..Default::default()
                })?;
            }
            return Ok(Some(uuid));
        }
        let uuid = task_track(hit.pid);
        if self.tasks.get(&hit.pid) != Some(&hit.comm) {
            if self.tasks.insert(hit.pid, hit.comm.clone()).is_none() {
                self.summary.task_tracks += 1;
            }
            self.write_packet(TracePacket {
                track_descriptor: Some(TrackDescriptor {
                    uuid: Some(uuid),
                    // The guest's thread-group id is not in the record: each task is shown
                    // as its own process.
                    thread: Some(ThreadDescriptor {
                        pid: Some(hit.pid),
                        tid: Some(hit.pid),
                        thread_name: Some(hit.comm.clone()),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            })?;
        }
        Ok(Some(uuid))
    }

    fn annotation_name(&mut self, name: &str, new: &mut InternedData) -> u64 {
        intern(&mut self.interned.annotation_names, name.to_owned(), |iid| {
            new.debug_annotation_names.push(DebugAnnotationName {
                iid: Some(iid),
                name: Some(name.to_owned()),
            })
        })
    }

    /// The hit's fields as debug annotations; `entry_shown` adds the entry time of a return
    /// that is an instant.
    fn annotations(&mut self, hit: &HitRecord, entry_shown: bool, new: &mut InternedData) -> Vec<DebugAnnotation> {
        let mut named = |writer: &mut Self, name: &str, value: DebugAnnotation| DebugAnnotation {
            name_iid: Some(writer.annotation_name(name, new)),
            ..value
        };
        let mut out = vec![
            named(self, "comm", string_annotation(hit.comm.clone())),
            named(
                self,
                "pid",
                DebugAnnotation {
                    int_value: Some(i64::from(hit.pid)),
                    ..Default::default()
                },
            ),
            named(
                self,
                "cpu",
                DebugAnnotation {
                    uint_value: Some(hit.cpu as u64),
                    ..Default::default()
                },
            ),
            named(self, "location", string_annotation(hit.location.clone())),
        ];
        if let Some(caller) = &hit.retprobe_caller {
            out.push(named(self, "caller", string_annotation(caller.clone())));
        }
        if let (true, Some(entered)) = (entry_shown, hit.entry_timestamp_ns) {
            out.push(named(
                self,
                "entry_timestamp_ns",
                DebugAnnotation {
                    uint_value: Some(entered),
                    ..Default::default()
                },
            ));
        }
        if !hit.args.is_empty() {
            let entries = hit
                .args
                .iter()
                .map(|(name, value)| named(self, name, arg_annotation(value)))
                .collect();
            out.push(named(
                self,
                "args",
                DebugAnnotation {
                    dict_entries: entries,
                    ..Default::default()
                },
            ));
        }
        out
    }

    /// The iid of `stack` (innermost frame first) as an interned callstack.
    fn callstack(&mut self, stack: &[StackFrame], new: &mut InternedData) -> u64 {
        let addresses: Vec<u64> = stack.iter().map(|f| f.address.0).collect();
        if let Some(&iid) = self.interned.callstacks.get(&addresses) {
            return iid;
        }
        let mapping = *self.interned.kernel_mapping.get_or_insert_with(|| {
            new.mapping_paths.push(InternedString {
                iid: Some(1),
                str: Some(KERNEL_MAPPING_PATH.as_bytes().to_vec()),
            });
            new.mappings.push(Mapping {
                iid: Some(1),
                start: Some(0),
                end: Some(u64::MAX),
                path_string_ids: vec![1],
            });
            1
        });
        // Perfetto lists a callstack's frames outermost first.
        let frame_ids = stack
            .iter()
            .rev()
            .map(|frame| {
                let function = function_name(frame);
                let function_name_id = intern(&mut self.interned.function_names, function.clone(), |iid| {
                    new.function_names.push(InternedString {
                        iid: Some(iid),
                        str: Some(function.into_bytes()),
                    })
                });
                intern(&mut self.interned.frames, frame.address.0, |iid| {
                    new.frames.push(Frame {
                        iid: Some(iid),
                        function_name_id: Some(function_name_id),
                        mapping_id: Some(mapping),
                        rel_pc: Some(frame.address.0),
                        kind: Some(proto::FRAME_KIND_KERNEL),
                    })
                })
            })
            .collect();
        intern(&mut self.interned.callstacks, addresses, |iid| {
            new.callstacks.push(Callstack {
                iid: Some(iid),
                frame_ids,
            })
        })
    }
}

/// A frame's function: the symbol without its `+0xoff/0xsize` (the offset is in the
/// frame's address), or the address in hex where no symbol covers it.
fn function_name(frame: &StackFrame) -> String {
    match &frame.symbol {
        Some(symbol) => symbol.split('+').next().unwrap_or(symbol).to_owned(),
        None => format!("{:#x}", frame.address.0),
    }
}

fn string_annotation(value: String) -> DebugAnnotation {
    DebugAnnotation {
        string_value: Some(value),
        ..Default::default()
    }
}

/// A fetch-arg's value (see the module's doc for the types).
fn arg_annotation(value: &ArgValue) -> DebugAnnotation {
    match value {
        ArgValue::Unsigned(v) => DebugAnnotation {
            uint_value: Some(*v),
            ..Default::default()
        },
        ArgValue::Signed(v) => DebugAnnotation {
            int_value: Some(*v),
            ..Default::default()
        },
        ArgValue::Hex(v) => DebugAnnotation {
            pointer_value: Some(*v),
            ..Default::default()
        },
        ArgValue::Symbol { .. } | ArgValue::Char(_) | ArgValue::Fault => string_annotation(value.to_string()),
        ArgValue::String(_) => match value.to_json() {
            // The text `--format json` has: escapes for what is not UTF-8, no quotes.
            serde_json::Value::String(text) => string_annotation(text),
            other => string_annotation(other.to_string()),
        },
        ArgValue::Array(items) => DebugAnnotation {
            array_values: items.iter().map(arg_annotation).collect(),
            ..Default::default()
        },
    }
}

/// What writing `--perfetto FILE` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PerfettoError {
    #[error("cannot create the Perfetto trace {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot write the Perfetto trace {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// The trace file of `--perfetto FILE`. A write that fails stops the trace (the file
/// keeps every packet written before) and is reported at the end; the run goes on.
pub struct PerfettoFile {
    path: PathBuf,
    writer: Option<PerfettoWriter<BufWriter<File>>>,
    failure: Option<io::Error>,
}

impl PerfettoFile {
    /// Creates (or truncates) `path` and writes the trace's first packet.
    pub fn create(path: &Path) -> Result<PerfettoFile, PerfettoError> {
        let create = |source| PerfettoError::Create {
            path: path.to_path_buf(),
            source,
        };
        let file = File::create(path).map_err(create)?;
        let mut writer = PerfettoWriter::new(BufWriter::new(file)).map_err(create)?;
        // The first packet reaches the file now, so a file that cannot take it fails here.
        writer.flush().map_err(create)?;
        Ok(PerfettoFile {
            path: path.to_path_buf(),
            writer: Some(writer),
            failure: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write_hit(&mut self, hit: &HitRecord) {
        if let Some(writer) = &mut self.writer {
            if let Err(e) = writer.write_hit(hit) {
                self.fail(e);
            }
        }
    }

    /// Pushes what is buffered to the file (the printer does after each batch, so that the
    /// file follows the run).
    pub fn flush(&mut self) {
        if let Some(writer) = &mut self.writer {
            if let Err(e) = writer.flush() {
                self.fail(e);
            }
        }
    }

    fn fail(&mut self, e: io::Error) {
        tracing::error!(
            "cannot write the Perfetto trace {}: {e}; no more hits go to it",
            self.path.display()
        );
        self.writer = None;
        self.failure = Some(e);
    }

    /// Flushes the file and says what it holds.
    pub fn finish(mut self) -> Result<TraceSummary, PerfettoError> {
        if let Some(writer) = self.writer.take() {
            let summary = writer.summary();
            match writer
                .into_inner()
                .and_then(|out| out.into_inner().map_err(|e| e.into_error()))
            {
                Ok(file) => {
                    drop(file);
                    return Ok(summary);
                }
                Err(e) => self.failure = Some(e),
            }
        }
        Err(PerfettoError::Write {
            path: self.path,
            source: self
                .failure
                .unwrap_or_else(|| io::Error::other("the trace was not written")),
        })
    }
}

#[cfg(test)]
mod tests;
