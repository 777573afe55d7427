#!/usr/bin/env python3
"""An independent reader of hvprobe's `--perfetto FILE` traces, for the tests.

It decodes the file with the classes Perfetto itself generates from its
`perfetto_trace.proto` and ships in the `perfetto` PyPI package
(`perfetto.protos.perfetto.trace.perfetto_trace_pb2`), with Google's `protobuf`
runtime: nothing of hvprobe's encoder is shared. It then does what Perfetto's
trace processor does with TrackEvents, as far as the tests need: it keeps the
interned data of each packet sequence under the `sequence_flags` rules (a
packet that needs incremental state is only valid after one that cleared it;
a clear drops what was interned), resolves names, debug annotations and
callstacks, and pairs each TYPE_SLICE_END with the latest open
TYPE_SLICE_BEGIN of its track after sorting by timestamp (stable), checking
that the pairing is the one the file meant (its writer puts each end right
after its begin) - that is, that the slices nest on their tracks.

Usage: perfetto_reader.py TRACE
Prints one JSON object: {"tracks": [...], "events": [...], "errors": [...]}.
Exits 3 (with a message on stderr) when the perfetto package cannot be imported.
"""

import json
import sys

try:
    from google.protobuf.unknown_fields import UnknownFieldSet
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TracePacket, TrackEvent
except ImportError as e:  # the test turns this into a failure that says what to install
    print(f"cannot import Perfetto's trace protos: {e}", file=sys.stderr)
    sys.exit(3)

CLEARED = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = TracePacket.SEQ_NEEDS_INCREMENTAL_STATE


class Interned:
    """One sequence's interned tables."""

    def __init__(self):
        self.event_names = {}
        self.annotation_names = {}
        self.function_names = {}
        self.frames = {}
        self.callstacks = {}

    def take(self, data):
        for n in data.event_names:
            self.event_names[n.iid] = n.name
        for n in data.debug_annotation_names:
            self.annotation_names[n.iid] = n.name
        for s in data.function_names:
            self.function_names[s.iid] = s.str.decode("utf-8", "replace")
        for f in data.frames:
            self.frames[f.iid] = f
        for c in data.callstacks:
            self.callstacks[c.iid] = list(c.frame_ids)


def annotation_value(a, interned, errors):
    kind = a.WhichOneof("value")
    if kind == "uint_value":
        return {"uint": a.uint_value}
    if kind == "int_value":
        return {"int": a.int_value}
    if kind == "pointer_value":
        return {"pointer": a.pointer_value}
    if kind == "string_value":
        return {"string": a.string_value}
    if kind == "bool_value":
        return {"bool": a.bool_value}
    if kind == "double_value":
        return {"double": a.double_value}
    if a.dict_entries:
        # A list of [name, value], to keep the order the event gave them in.
        return {"dict": annotation_pairs(a.dict_entries, interned, errors)}
    if a.array_values:
        return {"array": [annotation_value(v, interned, errors) for v in a.array_values]}
    errors.append(f"annotation with no value: {a}")
    return None


def annotations(items, interned, errors):
    out = {}
    for name, value in annotation_pairs(items, interned, errors):
        if name in out:
            errors.append(f"annotation {name!r} twice on one event")
        out[name] = value
    return out


def annotation_pairs(items, interned, errors):
    out = []
    for a in items:
        if a.HasField("name_iid"):
            name = interned.annotation_names.get(a.name_iid)
            if name is None:
                errors.append(f"annotation name iid {a.name_iid} is not interned")
                continue
        else:
            name = a.name
        out.append([name, annotation_value(a, interned, errors)])
    return out


def callstack(iid, interned, errors):
    frames = []
    for frame_iid in interned.callstacks.get(iid, []):
        f = interned.frames.get(frame_iid)
        if f is None:
            errors.append(f"frame iid {frame_iid} is not interned")
            continue
        frames.append(
            {
                "function": interned.function_names.get(f.function_name_id),
                "rel_pc": f.rel_pc,
                "kernel": f.kind == f.KIND_KERNEL,
            }
        )
    if iid not in interned.callstacks:
        errors.append(f"callstack iid {iid} is not interned")
    return frames


def unknown_fields(message, where, errors):
    """Fields the trace proto does not have (a wrong field number in the writer), anywhere."""
    if len(UnknownFieldSet(message)):
        numbers = sorted({f.field_number for f in UnknownFieldSet(message)})
        errors.append(f"{where}: fields {numbers} are not in {message.DESCRIPTOR.full_name}")
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        values = value if field.is_repeated else [value]
        for v in values:
            unknown_fields(v, f"{where}.{field.name}", errors)


def read(path):
    trace = Trace()
    with open(path, "rb") as f:
        trace.ParseFromString(f.read())
    errors = []
    tracks = {}
    state = {}  # sequence id -> Interned, once cleared
    raw = []  # (ts, file index, event dict) for every track event
    for index, p in enumerate(trace.packet):
        unknown_fields(p, f"packet {index}", errors)
        if not p.HasField("trusted_packet_sequence_id"):
            errors.append(f"packet {index} has no trusted_packet_sequence_id")
        seq = p.trusted_packet_sequence_id
        if p.sequence_flags & CLEARED:
            state[seq] = Interned()
        interned = state.get(seq)
        if p.HasField("interned_data"):
            if interned is None:
                errors.append(f"packet {index} interns data before its sequence's state was cleared")
            else:
                interned.take(p.interned_data)
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            track = {"uuid": d.uuid, "name": d.name if d.HasField("name") else None}
            if d.HasField("parent_uuid"):
                track["parent"] = d.parent_uuid
            if d.HasField("thread"):
                track["thread"] = {"pid": d.thread.pid, "tid": d.thread.tid, "name": d.thread.thread_name}
            tracks[d.uuid] = track
        if p.HasField("track_event"):
            e = p.track_event
            if p.sequence_flags & NEEDS and interned is None:
                errors.append(f"packet {index} needs incremental state that was never cleared")
                continue
            interned = interned or Interned()
            if e.HasField("name_iid"):
                name = interned.event_names.get(e.name_iid)
                if name is None:
                    errors.append(f"packet {index}: event name iid {e.name_iid} is not interned")
            else:
                name = e.name if e.HasField("name") else None
            event = {
                "type": TrackEvent.Type.Name(e.type),
                "ts": p.timestamp,
                "track": e.track_uuid,
                "name": name,
                "categories": list(e.categories),
                "args": annotations(e.debug_annotations, interned, errors),
            }
            if e.HasField("callstack_iid"):
                event["callstack"] = callstack(e.callstack_iid, interned, errors)
            if e.track_uuid not in tracks:
                errors.append(f"packet {index}: track {e.track_uuid} is not described before its first event")
            raw.append((p.timestamp, index, event))

    # What the trace processor does: sort (stable) by timestamp, then pair per track.
    begin_at = {}  # file index of a BEGIN -> its event
    intended = {}  # file index of an END -> file index of the BEGIN the writer put before it
    last_begin_on_track = {}
    for ts, index, event in raw:
        if event["type"] == "TYPE_SLICE_BEGIN":
            begin_at[index] = event
            last_begin_on_track[event["track"]] = index
        elif event["type"] == "TYPE_SLICE_END":
            intended[index] = last_begin_on_track.get(event["track"])
    events = []
    open_slices = {}
    for ts, index, event in sorted(raw, key=lambda r: (r[0], r[1])):
        kind = event["type"]
        if kind == "TYPE_INSTANT":
            events.append(dict(event, kind="instant"))
        elif kind == "TYPE_SLICE_BEGIN":
            open_slices.setdefault(event["track"], []).append(index)
        elif kind == "TYPE_SLICE_END":
            stack = open_slices.get(event["track"], [])
            if not stack:
                errors.append(f"slice end at {ts} on track {event['track']} with no slice open")
                continue
            begin_index = stack.pop()
            if begin_index != intended.get(index):
                errors.append(f"slices do not nest on track {event['track']}: the end at {ts} closes another slice")
            begin = begin_at[begin_index]
            slice_ = dict(begin, kind="slice", end_ts=ts)
            slice_["args"] = dict(begin["args"], **event["args"])
            if "callstack" in event:
                slice_["callstack"] = event["callstack"]
            events.append(slice_)
        else:
            errors.append(f"unexpected event type {kind}")
    for track, stack in open_slices.items():
        if stack:
            errors.append(f"{len(stack)} slices never end on track {track}")
    return {"tracks": list(tracks.values()), "events": events, "errors": errors}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(read(sys.argv[1])))
