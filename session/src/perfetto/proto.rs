//! The part of Perfetto's trace format that `--perfetto FILE` writes, as prost messages.
//!
//! Each message mirrors its namesake in Perfetto's `protos/perfetto/trace/` (package
//! `perfetto.protos`: `trace.proto`, `trace_packet.proto`, `track_event/track_event.proto`,
//! `track_event/track_descriptor.proto`, `track_event/thread_descriptor.proto`,
//! `track_event/debug_annotation.proto`, `interned_data/interned_data.proto`,
//! `profiling/profile_common.proto`) with the same field numbers and wire types, checked
//! against the descriptor of the `perfetto` Python package 0.59.1; fields we never set are
//! left out (a reader skips nothing it does not know: it never sees them).
//!
//! Two wire details matter for Perfetto's own decoder (protozero), which parses a field only
//! in the encoding its `.proto` declares:
//! - these protos are proto2, whose repeated scalars are **not** packed, while prost packs
//!   them unless told: every repeated scalar here says `packed = "false"`;
//! - fields of a `oneof` in the `.proto` (`TracePacket.data`, `TrackEvent.name_field`,
//!   `DebugAnnotation.value`, ...) are plain optional fields here; the writer sets at most
//!   one of each group, which is the same bytes on the wire.

/// `perfetto.protos.Trace`: the file is this message, so a file that is several of them
/// concatenated (one per packet, as the writer streams it) is one trace.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Trace {
    #[prost(message, repeated, tag = "1")]
    pub packet: Vec<TracePacket>,
}

/// `TracePacket.SequenceFlags`.
pub const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
pub const SEQ_NEEDS_INCREMENTAL_STATE: u32 = 2;

/// `perfetto.protos.TracePacket`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TracePacket {
    /// In the clock of `timestamp_clock_id`, BOOTTIME when unset.
    #[prost(uint64, optional, tag = "8")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "10")]
    pub trusted_packet_sequence_id: Option<u32>,
    #[prost(message, optional, tag = "11")]
    pub track_event: Option<TrackEvent>,
    #[prost(message, optional, tag = "12")]
    pub interned_data: Option<InternedData>,
    #[prost(uint32, optional, tag = "13")]
    pub sequence_flags: Option<u32>,
    #[prost(message, optional, tag = "60")]
    pub track_descriptor: Option<TrackDescriptor>,
    #[prost(bool, optional, tag = "87")]
    pub first_packet_on_sequence: Option<bool>,
}

/// `TrackDescriptor.ChildTracksOrdering.EXPLICIT`: children sorted by `sibling_order_rank`.
pub const CHILD_ORDERING_EXPLICIT: i32 = 3;

/// `perfetto.protos.TrackDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackDescriptor {
    #[prost(uint64, optional, tag = "1")]
    pub uuid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    #[prost(message, optional, tag = "4")]
    pub thread: Option<ThreadDescriptor>,
    #[prost(uint64, optional, tag = "5")]
    pub parent_uuid: Option<u64>,
    #[prost(int32, optional, tag = "11")]
    pub child_ordering: Option<i32>,
    #[prost(int32, optional, tag = "12")]
    pub sibling_order_rank: Option<i32>,
}

/// `perfetto.protos.ThreadDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ThreadDescriptor {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(int32, optional, tag = "2")]
    pub tid: Option<i32>,
    #[prost(string, optional, tag = "5")]
    pub thread_name: Option<String>,
}

/// `TrackEvent.Type`.
pub const TYPE_SLICE_BEGIN: i32 = 1;
pub const TYPE_SLICE_END: i32 = 2;
pub const TYPE_INSTANT: i32 = 3;

/// `perfetto.protos.TrackEvent`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackEvent {
    #[prost(message, repeated, tag = "4")]
    pub debug_annotations: Vec<DebugAnnotation>,
    #[prost(int32, optional, tag = "9")]
    pub r#type: Option<i32>,
    /// An `InternedData.event_names` iid.
    #[prost(uint64, optional, tag = "10")]
    pub name_iid: Option<u64>,
    #[prost(uint64, optional, tag = "11")]
    pub track_uuid: Option<u64>,
    #[prost(string, repeated, tag = "22")]
    pub categories: Vec<String>,
    /// An `InternedData.callstacks` iid.
    #[prost(uint64, optional, tag = "56")]
    pub callstack_iid: Option<u64>,
}

/// `perfetto.protos.DebugAnnotation`: a name (interned) and one value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DebugAnnotation {
    /// An `InternedData.debug_annotation_names` iid.
    #[prost(uint64, optional, tag = "1")]
    pub name_iid: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub uint_value: Option<u64>,
    #[prost(int64, optional, tag = "4")]
    pub int_value: Option<i64>,
    #[prost(string, optional, tag = "6")]
    pub string_value: Option<String>,
    /// An integer Perfetto shows in hex.
    #[prost(uint64, optional, tag = "7")]
    pub pointer_value: Option<u64>,
    #[prost(message, repeated, tag = "11")]
    pub dict_entries: Vec<DebugAnnotation>,
    #[prost(message, repeated, tag = "12")]
    pub array_values: Vec<DebugAnnotation>,
}

/// `perfetto.protos.InternedData`: what later packets of the sequence refer to by iid.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedData {
    #[prost(message, repeated, tag = "2")]
    pub event_names: Vec<EventName>,
    #[prost(message, repeated, tag = "3")]
    pub debug_annotation_names: Vec<DebugAnnotationName>,
    #[prost(message, repeated, tag = "5")]
    pub function_names: Vec<InternedString>,
    #[prost(message, repeated, tag = "6")]
    pub frames: Vec<Frame>,
    #[prost(message, repeated, tag = "7")]
    pub callstacks: Vec<Callstack>,
    #[prost(message, repeated, tag = "17")]
    pub mapping_paths: Vec<InternedString>,
    #[prost(message, repeated, tag = "19")]
    pub mappings: Vec<Mapping>,
}

impl InternedData {
    pub fn is_empty(&self) -> bool {
        *self == InternedData::default()
    }
}

/// `perfetto.protos.EventName`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EventName {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
}

/// `perfetto.protos.DebugAnnotationName`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DebugAnnotationName {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
}

/// `perfetto.protos.InternedString`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedString {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(bytes = "vec", optional, tag = "2")]
    pub str: Option<Vec<u8>>,
}

/// `Frame.Kind.KIND_KERNEL`.
pub const FRAME_KIND_KERNEL: i32 = 2;

/// `perfetto.protos.Frame` (profiling's frame, which a TrackEvent callstack refers to).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Frame {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    /// An `InternedData.function_names` iid.
    #[prost(uint64, optional, tag = "2")]
    pub function_name_id: Option<u64>,
    /// An `InternedData.mappings` iid; `rel_pc` is then relative to its start.
    #[prost(uint64, optional, tag = "3")]
    pub mapping_id: Option<u64>,
    #[prost(uint64, optional, tag = "4")]
    pub rel_pc: Option<u64>,
    #[prost(int32, optional, tag = "7")]
    pub kind: Option<i32>,
}

/// `perfetto.protos.Callstack`: frame iids, bottom (outermost) frame first.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Callstack {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(uint64, repeated, packed = "false", tag = "2")]
    pub frame_ids: Vec<u64>,
}

/// `perfetto.protos.Mapping`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(uint64, optional, tag = "4")]
    pub start: Option<u64>,
    #[prost(uint64, optional, tag = "5")]
    pub end: Option<u64>,
    /// `InternedData.mapping_paths` iids, the path's components.
    #[prost(uint64, repeated, packed = "false", tag = "7")]
    pub path_string_ids: Vec<u64>,
}
