"""Where the memory went: a recorded trace's memory over time, for `pyalloc view` and tune's plots.

`analyze(snapshot)` walks a snapshot's ``device_traces`` (alloc, free_requested, free_completed,
segment_alloc, segment_free, segment_map, segment_unmap, oom) and rebuilds what the allocator held
after every event:

* reserved bytes: the trace's segment events (cudaMalloc'd segments and mapped expandable pages);
* requested bytes: the sizes the trace's alloc entries record (PyTorch records the caller's size,
  not the block's);
* allocated bytes: block sizes. The trace does not record them, so they come from replaying the
  trace through pyalloc under its own setting (pyalloc.replay, which reproduces PyTorch's figures
  on the traces in tests/data): an alloc's block is what memory_allocated() grew by at that event. When
  the setting cannot be replayed, allocated bytes are left out and the page says why.

Like PyTorch's statistics, allocated and requested bytes drop at free_requested; the block stays
in its segment (pending free) until free_completed.

A wrapped trace (the ring buffer dropped its oldest entries, or recording started late) begins
with memory already in use. Its starting state is what the snapshot's final ``segments`` imply:
segments and live blocks the trace never allocated were there from the start, and so were blocks
and segments it frees before allocating them.

The timeline keeps, per bucket of events, the minimum and maximum of each figure, so the peak
survives any downsampling. Only the standard library is used here (and in pyalloc.report_html).
"""
from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass, field

from pyalloc.errors import format_bytes
from pyalloc.replay import DEFAULT_DEVICE_MEMORY, replay
from pyalloc.trace import as_trace

SERIES = ("reserved", "allocated", "requested")
DEFAULT_BUCKETS = 2000      # timeline points: ~2 per pixel of a wide screen
TOP_ALLOCATIONS = 20
MAX_FRAMES = 40             # frames kept per allocation in the page
CURVE_POINTS = 1000         # samples per setting in tune's chart


@dataclass
class Allocation:
    """One block handed out. Event indices: `start` the alloc (-1: live before the trace began),
    `free_requested` / `end` the free entries (None: not freed within the trace)."""
    addr: int
    requested: int
    size: int                       # block bytes (== requested rounded when `estimated`)
    tag: str
    start: int
    stream: int = 0
    frames: list = field(default_factory=list)
    free_requested: int | None = None
    end: int | None = None
    estimated: bool = False         # block size guessed (no replay, or a block from before the trace)

    def live_at(self, t):
        return self.start <= t and (self.end is None or self.end > t)

    def pending_at(self, t):
        return self.free_requested is not None and self.free_requested <= t


@dataclass
class Range:
    """Reserved device memory: a segment (segment_alloc) or a mapped piece of an expandable
    segment (segment_map), live over events [start, end)."""
    addr: int
    size: int
    start: int
    end: int | None = None
    expandable: bool = False

    def live_at(self, t):
        return self.start <= t and (self.end is None or self.end > t)


@dataclass
class Oom:
    event: int
    requested: int                  # the (rounded) request that failed
    device_free: int
    stream: int
    time_us: int | None
    tag: str
    frames: list


@dataclass
class Moment:
    """The allocator's state after one event: segments (addr, size, expandable), sorted by address,
    and the blocks live in them, each with its state ('allocated' or 'pending_free')."""
    name: str
    title: str
    event: int
    segments: list
    blocks: list                    # [(Allocation, state)]

    @property
    def reserved(self):
        return sum(s[1] for s in self.segments)

    @property
    def allocated(self):
        return sum(a.size for a, state in self.blocks if state == "allocated")


@dataclass
class MemoryView:
    """What analyze() found; byte figures are bytes, `event` fields are trace entry indices."""
    path: str
    device: int
    events: int
    config: str
    bucket: int                     # events per timeline bucket
    starts: list                    # first event index of each bucket
    times_ms: list                  # time of each bucket's first event, ms after the first event
    lo: dict                        # series name -> per-bucket minimum (allocated absent if unknown)
    hi: dict                        # series name -> per-bucket maximum
    peaks: dict                     # series name -> (bytes, first event at that value)
    ooms: list
    moments: list
    top: list                       # largest allocations live at the peak
    tags: list                      # (tag, bytes at the peak, the tag's own peak, allocations)
    wrapped: bool
    initial: dict                   # what was in use before the first event (reserved, allocated, ...)
    allocated_note: str | None      # why allocated bytes are not shown, or None
    notes: list
    final_reserved_snapshot: int | None
    final_reserved_trace: int
    event_ms: dict = field(default_factory=dict)   # ms after the first event, for the events named above

    @property
    def peak_moment(self):
        return self.moments[0]

    @property
    def peak_series(self):
        return "allocated" if "allocated" in self.hi else "requested"


# ------------------------------------------------------------------------------- strings of the trace

class _Strings:
    """The tags (user_metadata) and stacks (frames) of a trace, checked as they are read: the page
    and the summary print them, so a value of another shape (a str for frames, a name nested
    100,000 lists deep) is SnapshotError naming where it is, not an exception deep in printing.
    PyTorch shares one frames list between the entries of a stack: each list is checked once."""

    def __init__(self):
        self._checked = set()       # id() of frame lists already checked (the snapshot keeps them alive)

    def tag(self, record, where):
        tag = record.get("user_metadata")
        if not tag:
            return ""
        if not isinstance(tag, str):
            raise _shape_error(where, "user_metadata", tag, "a string")
        return tag

    def frames(self, record, where):
        frames = record.get("frames")
        if not frames:
            return []
        if id(frames) in self._checked:
            return frames
        if not isinstance(frames, list):
            raise _shape_error(where, "frames", frames, "a list of frame dicts")
        for k, frame in enumerate(frames):
            if not isinstance(frame, dict):
                raise _shape_error(where, f"frames[{k}]", frame, "a dict")
            for key, kind, words in (("name", str, "a string"), ("filename", str, "a string"),
                                     ("line", int, "an int")):
                value = frame.get(key)
                if value is not None and not isinstance(value, kind):
                    raise _shape_error(where, f"frames[{k}][{key!r}]", value, words)
        self._checked.add(id(frames))
        return frames


def _shape_error(where, name, value, expected):
    """SnapshotError for a value of the wrong type; `where` names the record: a trace entry's
    index (formatted only here, so that the walk over a long trace pays nothing for it) or words."""
    from pyalloc.snapshot import SnapshotError
    if isinstance(where, int):
        where = f"trace entry {where:,}"
    # The type only, never the value: its repr is what cannot be printed (nesting, size).
    return SnapshotError(f"corrupt snapshot: {where}: {name} is a {type(value).__name__}, "
                         f"expected {expected}")


# ------------------------------------------------------------------------------- starting state

def _round_block(size):
    # PyTorch's minimum rounding (512-byte multiples): the guess for blocks the replay never saw.
    return max(512, (size + 511) // 512 * 512)


def _subtract(ranges, start, end):
    out = []
    for s, e in ranges:
        if e <= start or s >= end:
            out.append((s, e))
            continue
        if s < start:
            out.append((s, start))
        if e > end:
            out.append((end, e))
    return out


def _add(ranges, start, end):
    merged = _subtract(ranges, start, end) + [(start, end)]
    merged.sort()
    out = []
    for s, e in merged:
        if out and out[-1][1] >= s:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _prescan(entries):
    """One pass over actions and addresses: what the trace frees before allocating, what it
    allocates at all, its map/unmap events, and reserved bytes' running maximum."""
    allocated, freed_first = set(), {}
    seg_allocated, seg_freed_first = set(), {}
    maps = []
    reserved = peak_reserved = 0
    for i, e in enumerate(entries):
        action = e["action"]
        if action == "alloc":
            allocated.add(e["addr"])
        elif action == "free_requested" or action == "free_completed":
            addr = e["addr"]
            if addr not in allocated and addr not in freed_first:
                freed_first[addr] = i
        elif action == "segment_alloc":
            seg_allocated.add(e["addr"])
            reserved += e["size"]
        elif action == "segment_free":
            addr = e["addr"]
            if addr not in seg_allocated and addr not in seg_freed_first:
                seg_freed_first[addr] = e["size"]
            reserved -= e["size"]
        elif action == "segment_map" or action == "segment_unmap":
            maps.append((action == "segment_map", e["addr"], e["size"]))
            reserved += e["size"] if action == "segment_map" else -e["size"]
        if reserved > peak_reserved:
            peak_reserved = reserved
    return allocated, freed_first, seg_allocated, seg_freed_first, maps, peak_reserved


def _initial_state(snapshot, entries, device, scan, strings):
    """Blocks and reserved ranges in use before the first event (empty for a complete trace);
    `strings` (_Strings) checks their tags and stacks."""
    allocated, freed_first, seg_allocated, seg_freed_first, maps, _ = scan
    segments = [s for s in snapshot.get("segments") or [] if s.get("device", device) == device]
    blocks = []
    # Blocks freed before the trace allocates them: the free entry has the requested size.
    for addr, i in freed_first.items():
        e = entries[i]
        blocks.append(Allocation(addr, e["size"], _round_block(e["size"]), strings.tag(e, i),
                                 -1, e.get("stream", 0), strings.frames(e, i), estimated=True))
    # Blocks live at the end that the trace never allocated.
    for seg in segments:
        for b in seg.get("blocks") or []:
            if b.get("state", "inactive") == "inactive" or b["address"] in allocated or b["address"] in freed_first:
                continue
            where = f"the block at {b['address']:#x} of the final segments"
            blocks.append(Allocation(
                b["address"], b.get("requested_size", b["size"]), b["size"], strings.tag(b, where),
                -1, seg.get("stream", 0), strings.frames(b, where),
                free_requested=-1 if b.get("state") == "active_pending_free" else None))
    ranges = []
    for seg in segments:
        if not seg.get("is_expandable") and seg["address"] not in seg_allocated:
            ranges.append(Range(seg["address"], seg["total_size"], -1))
    for addr, size in seg_freed_first.items():
        ranges.append(Range(addr, size, -1))
    # Expandable segments: undo the trace's maps and unmaps, newest first, on the final mapping.
    mapped = []
    for seg in segments:
        if seg.get("is_expandable") and seg["total_size"]:
            mapped = _add(mapped, seg["address"], seg["address"] + seg["total_size"])
    for is_map, addr, size in reversed(maps):
        mapped = _subtract(mapped, addr, addr + size) if is_map else _add(mapped, addr, addr + size)
    ranges += [Range(s, e - s, -1, expandable=True) for s, e in mapped]
    return blocks, ranges


# ------------------------------------------------------------------------------- block sizes

def _replay_device_memory(peak_reserved):
    # The simulated device must hold the trace's peak; the default keeps recorded expandable
    # reservations where pyalloc.replay expects them.
    if peak_reserved <= DEFAULT_DEVICE_MEMORY * 0.9:
        return DEFAULT_DEVICE_MEMORY
    return 1 << math.ceil(math.log2(peak_reserved * 1.25))


def _block_sizes(trace, config, peak_reserved):
    """{alloc event index: block bytes} from a replay of the Trace `trace` under `config`, and a
    note (None when every alloc got a block), or (None, reason) when the setting cannot be
    replayed. `peak_reserved`: the trace's most reserved bytes, which the device must hold."""
    from pyalloc.config import ConfigError
    from pyalloc.snapshot import SnapshotError

    points, values = [], []
    holder = []

    def sample(done, total):
        points.append(done)
        values.append(holder[0].memory_allocated())

    last_error = None
    for placement in ("recorded", "fresh"):
        points.clear()
        values.clear()
        holder.clear()
        try:
            replay(trace, config=config, placement=placement, device=trace.device,
                   device_memory=_replay_device_memory(peak_reserved),
                   progress=sample, progress_every=1, on_start=holder.append)
        except (ConfigError, SnapshotError) as err:
            reason = (str(err) or type(err).__name__).splitlines()[0]   # ConfigError adds a caret line
            return None, f"the trace's setting {config!r} cannot be replayed by this pyalloc: {reason}"
        except (RuntimeError, ValueError, MemoryError) as err:
            last_error = err       # recorded addresses that do not fit: try fresh placement
            continue
        break
    else:
        return None, f"replaying the trace failed ({type(last_error).__name__}: {last_error})"
    sizes = {}
    before = 0
    entries = trace.entries
    n = len(entries)
    missing = 0
    for i, value in zip(points, values):
        if i < n and entries[i]["action"] == "alloc":
            if value > before:
                sizes[i] = value - before
            elif entries[i]["size"]:
                missing += 1     # the replay ran out of memory there
        before = value
    note = (f"{missing:,} allocations failed in the replay; their block sizes are estimates"
            if missing else None)
    return sizes, note


# ------------------------------------------------------------------------------- the walk

def _allocated_sizes(trace, config, peak_reserved, block_sizes):
    """(block sizes, have_allocated, allocated_note, notes) for analyze: the replay's
    {alloc event index: block bytes} ({} when allocated bytes are not known), whether they are,
    why not (None when they are), and the page's notes so far (a replay's partial failure)."""
    notes = []
    if block_sizes:
        sizes, allocated_note = _block_sizes(trace, config, peak_reserved)
    else:
        sizes, allocated_note = None, "allocated bytes were not computed (no replay asked for)"
    if sizes is None:
        return {}, False, allocated_note, notes
    if allocated_note:     # some allocations failed in the replay: a note, not a missing series
        notes.append(allocated_note)
    return sizes, True, None, notes


class _Walk:
    """What the allocator holds as the walk applies the trace's entries one by one: live blocks
    (by address) and every block seen, reserved ranges, bytes reserved / allocated / requested,
    per-tag live bytes, peaks and counts, and the trace's oom entries. Starts from the blocks and
    ranges in use before the first event (_initial_state)."""

    def __init__(self, init_blocks, init_ranges, sizes, strings):
        self.sizes = sizes              # {alloc event index: block bytes} from the replay
        self.strings = strings
        self.live = {}
        self.allocs = list(init_blocks)
        self.ranges = list(init_ranges)
        self.segs = {}                  # address -> Range of a live cudaMalloc'd segment
        self.mapped = {}                # address -> Range of a mapped piece of an expandable segment
        self.tag_live, self.tag_peak, self.tag_count = {}, {}, {}
        self.ooms = []
        reserved = requested = allocated = 0
        for r in init_ranges:
            reserved += r.size
            if r.expandable:
                self.mapped[r.addr] = r
            else:
                self.segs[r.addr] = r
        for a in init_blocks:
            self.live[a.addr] = a
            if a.free_requested is None:
                requested += a.requested
                allocated += a.size
                self.tag_live[a.tag] = self.tag_live.get(a.tag, 0) + a.size
        for tag, v in self.tag_live.items():
            self.tag_peak[tag] = v
        self.reserved, self.requested, self.allocated = reserved, requested, allocated
        self.initial = {"reserved": reserved, "allocated": allocated, "requested": requested,
                        "blocks": len(init_blocks), "segments": len(init_ranges)}

    def _alloc(self, i, e):
        size = e["size"]
        block = self.sizes.get(i)
        strings = self.strings
        a = Allocation(e["addr"], size, block if block is not None else _round_block(size),
                       strings.tag(e, i), i, e.get("stream", 0),
                       strings.frames(e, i),
                       estimated=block is None)
        self.live[a.addr] = a
        self.allocs.append(a)
        self.requested += size
        self.allocated += a.size
        tag = a.tag
        v = self.tag_live[tag] = self.tag_live.get(tag, 0) + a.size
        self.tag_count[tag] = self.tag_count.get(tag, 0) + 1
        if v > self.tag_peak.get(tag, 0):
            self.tag_peak[tag] = v
        return True

    def _free(self, i, e):
        # free_requested drops the figures; free_completed (after it, or alone) ends the block.
        a = self.live.get(e["addr"])
        if a is None:
            return False
        changed = a.free_requested is None
        if changed:
            a.free_requested = i
            self.requested -= a.requested
            self.allocated -= a.size
            self.tag_live[a.tag] -= a.size
        if e["action"] == "free_completed":
            a.end = i
            del self.live[a.addr]
        return changed

    def _segment_alloc(self, i, e):
        r = self.segs[e["addr"]] = Range(e["addr"], e["size"], i)
        self.ranges.append(r)
        self.reserved += e["size"]
        return True

    def _segment_free(self, i, e):
        r = self.segs.pop(e["addr"], None)
        if r is None:
            return False
        r.end = i
        self.reserved -= r.size
        return True

    def _segment_map(self, i, e):
        r = self.mapped[e["addr"]] = Range(e["addr"], e["size"], i, expandable=True)
        self.ranges.append(r)
        self.reserved += e["size"]
        return True

    def _segment_unmap(self, i, e):
        mapped = self.mapped
        start, end = e["addr"], e["addr"] + e["size"]
        for r in [r for r in mapped.values() if r.addr < end and r.addr + r.size > start]:
            del mapped[r.addr]
            r.end = i
            self.reserved -= min(end, r.addr + r.size) - max(start, r.addr)
            for s, t in ((r.addr, start), (end, r.addr + r.size)):
                if t > s:      # the parts of the piece left mapped
                    piece = mapped[s] = Range(s, t - s, i, expandable=True)
                    self.ranges.append(piece)
        return True

    def _other(self, i, e):
        # Any other action changes no figure; an oom entry is kept for the page.
        if e["action"] == "oom":
            strings = self.strings
            self.ooms.append(Oom(i, e.get("size", 0), e.get("device_free", e.get("addr", 0)),
                                 e.get("stream", 0), e.get("time_us"), strings.tag(e, i),
                                 strings.frames(e, i)))
        return False

    # How each action changes the state: handler(walk, event index, entry) -> True when it
    # changed a figure. Other actions go to _other.
    HANDLERS = {"alloc": _alloc, "free_requested": _free, "free_completed": _free,
                 "segment_alloc": _segment_alloc, "segment_free": _segment_free,
                 "segment_map": _segment_map, "segment_unmap": _segment_unmap}


def _timeline(entries, walk, bucket):
    """Apply every entry to `walk` (_Walk), keeping per bucket of `bucket` events the minimum
    and maximum of each figure (so that no downsampling loses a peak), and each figure's peak.
    Returns (bucket starts, their times in ms after the first timed event, lo, hi,
    peaks {series: (bytes, first event at that value)}, the first event's time_us or None)."""
    starts, times = [], []
    lo = {s: [] for s in SERIES}
    hi = {s: [] for s in SERIES}
    lo_r = hi_r = lo_a = hi_a = lo_q = hi_q = 0
    peak_r = peak_a = peak_q = -1
    at_r = at_a = at_q = 0
    t0 = None
    next_start = 0
    handlers, other = walk.HANDLERS, _Walk._other
    for i, e in enumerate(entries):
        changed = handlers.get(e["action"], other)(walk, i, e)
        reserved, allocated, requested = walk.reserved, walk.allocated, walk.requested
        if i == next_start:
            if i:
                lo["reserved"].append(lo_r), hi["reserved"].append(hi_r)
                lo["allocated"].append(lo_a), hi["allocated"].append(hi_a)
                lo["requested"].append(lo_q), hi["requested"].append(hi_q)
            lo_r = hi_r = reserved
            lo_a = hi_a = allocated
            lo_q = hi_q = requested
            starts.append(i)
            time_us = e.get("time_us")
            if t0 is None and time_us is not None:
                t0 = time_us
            times.append(round((time_us - t0) / 1000, 3) if time_us is not None and t0 is not None else None)
            next_start += bucket
        elif changed:
            if reserved > hi_r:
                hi_r = reserved
            elif reserved < lo_r:
                lo_r = reserved
            if allocated > hi_a:
                hi_a = allocated
            elif allocated < lo_a:
                lo_a = allocated
            if requested > hi_q:
                hi_q = requested
            elif requested < lo_q:
                lo_q = requested
        else:
            continue
        if reserved > peak_r:
            peak_r, at_r = reserved, i
        if allocated > peak_a:
            peak_a, at_a = allocated, i
        if requested > peak_q:
            peak_q, at_q = requested, i
    if starts:     # the last bucket, unless the trace is empty
        lo["reserved"].append(lo_r), hi["reserved"].append(hi_r)
        lo["allocated"].append(lo_a), hi["allocated"].append(hi_a)
        lo["requested"].append(lo_q), hi["requested"].append(hi_q)
    peaks = {"reserved": (peak_r, at_r), "allocated": (peak_a, at_a), "requested": (peak_q, at_q)}
    return starts, times, lo, hi, peaks, t0


def _moment(name, title, t, ranges, allocs):
    """The Moment after event `t`: the Ranges and Allocations live then, in address order."""
    segments = []
    for r in sorted((r for r in ranges if r.live_at(t)), key=lambda r: r.addr):
        # Adjacent mapped pieces of an expandable segment show as one segment.
        if r.expandable and segments and segments[-1][2] and segments[-1][0] + segments[-1][1] == r.addr:
            segments[-1] = (segments[-1][0], segments[-1][1] + r.size, True)
        else:
            segments.append((r.addr, r.size, r.expandable))
    blocks = [(a, "pending_free" if a.pending_at(t) else "allocated") for a in allocs if a.live_at(t)]
    blocks.sort(key=lambda b: b[0].addr)
    return Moment(name, title, t, segments, blocks)


def _peak_tables(peak, walk, top):
    """(the `top` largest blocks allocated at the Moment `peak`, the tag rows
    (tag, bytes at the peak, the tag's own peak, allocations) largest first)."""
    top_blocks = sorted((a for a, state in peak.blocks if state == "allocated"),
                        key=lambda a: (-a.size, a.start))[:top]
    at_peak = {}
    for a, state in peak.blocks:
        if state == "allocated":
            at_peak[a.tag] = at_peak.get(a.tag, 0) + a.size
    tag_peak, tag_count = walk.tag_peak, walk.tag_count
    tags = sorted(((t, at_peak.get(t, 0), tag_peak.get(t, 0), tag_count.get(t, 0))
                   for t in set(tag_peak) | set(at_peak)),
                  key=lambda x: (-x[1], -x[2], x[0]))
    return top_blocks, tags


def _event_times(entries, t0, events):
    """{event index: ms after the first timed event (time_us t0)} of the `events` that have a time."""
    event_ms = {}
    if t0 is not None:
        n = len(entries)
        for i in events:
            time_us = entries[i].get("time_us") if 0 <= i < n else None
            if time_us is not None:
                event_ms[i] = (time_us - t0) / 1000
    return event_ms


def _wrapped_notes(init_blocks, initial):
    """The page's notes on a trace that starts with memory in use (see the module docstring)."""
    notes = [(
        "The trace starts in the middle of the run (its ring buffer wrapped, or recording started "
        f"late): {len(init_blocks):,} blocks ({format_bytes(initial['allocated'])}) and "
        f"{format_bytes(initial['reserved'])} of segments were in use before its first event. "
        "This page starts from what the snapshot's final segments imply: segments and live blocks "
        "the trace never allocated, and those it frees before allocating them.")]
    if any(a.estimated and a.start < 0 for a in init_blocks):
        notes.append("Blocks freed before the trace allocates them have estimated sizes (their "
                     "requested size rounded to 512 bytes).")
    return notes


def analyze(snapshot, *, device=0, path="", buckets=DEFAULT_BUCKETS, top=TOP_ALLOCATIONS,
            block_sizes=True):
    """Rebuild a trace's memory over time (see the module docstring). Returns a MemoryView.

    `snapshot`: a snapshot dict or a pyalloc.trace.Trace of `device` (the command line's, read
    once). `block_sizes=False` skips the replay: allocated bytes are then not reported. Raises
    SnapshotError when the snapshot holds no trace for `device`, or a tag or stack of the wrong
    shape (_Strings).
    """
    # No check here: the walk reads only what it finds, and the replay checks what it reads.
    trace = as_trace(snapshot, device, check=False)
    snapshot = trace.snapshot
    entries = trace.entries
    n = len(entries)
    config = trace.own_config
    strings = _Strings()
    scan = _prescan(entries)
    init_blocks, init_ranges = _initial_state(snapshot, entries, device, scan, strings)
    sizes, have_allocated, allocated_note, notes = _allocated_sizes(trace, config, scan[-1],
                                                                    block_sizes)
    walk = _Walk(init_blocks, init_ranges, sizes, strings)
    initial = walk.initial
    wrapped = bool(init_blocks or init_ranges)
    bucket = max(1, math.ceil(n / max(1, buckets)))
    starts, times, lo, hi, peaks, t0 = _timeline(entries, walk, bucket)
    if not have_allocated:
        del lo["allocated"], hi["allocated"], peaks["allocated"]
    ooms, reserved = walk.ooms, walk.reserved

    series = "allocated" if have_allocated else "requested"
    moments = [_moment("peak", f"peak {series}", peaks[series][1], walk.ranges, walk.allocs)]
    if ooms:
        moments.append(_moment("oom", "first out-of-memory" if len(ooms) > 1 else "out-of-memory",
                               ooms[0].event, walk.ranges, walk.allocs))
    top_blocks, tags = _peak_tables(moments[0], walk, top)
    event_ms = _event_times(entries, t0, {e for _, e in peaks.values()} | {o.event for o in ooms}
                            | {a.start for a in top_blocks})
    final_snapshot = None
    if snapshot.get("segments"):
        final_snapshot = sum(s["total_size"] for s in snapshot["segments"] if s.get("device", device) == device)
    if wrapped:
        first, *more = _wrapped_notes(init_blocks, initial)
        notes.insert(0, first)
        notes.extend(more)
    if final_snapshot is not None and final_snapshot != reserved:
        notes.append(f"The trace ends with {format_bytes(reserved)} reserved but the snapshot's segments "
                     f"hold {format_bytes(final_snapshot)}: events are missing from the trace.")
    return MemoryView(
        path=str(path), device=device, events=n, config=config, bucket=bucket, starts=starts,
        times_ms=times, lo=lo, hi=hi, peaks=peaks, ooms=ooms, moments=moments, top=top_blocks,
        tags=tags, wrapped=wrapped, initial=initial, allocated_note=allocated_note, notes=notes,
        final_reserved_snapshot=final_snapshot, final_reserved_trace=reserved, event_ms=event_ms)


# ------------------------------------------------------------------------------- text summary

def _tag_label(tag):
    return tag if tag else "(no tag)"


def format_ms(ms):
    """A time after the trace's first event, given in milliseconds, in the unit of its size:
    microseconds below 1 ms, milliseconds below 1 s, seconds above ('640 us', '2.46 ms',
    '2.844 s'), so that times of one size read alike in every trace (the page's fmtTime agrees)."""
    if ms < 1:
        return f"{ms * 1000:.0f} us"
    if ms < 1000:
        return f"{ms:.2f} ms"
    return f"{ms / 1000:.3f} s"


def _when(view, event):
    t = view_time_ms(view, event)
    if t is None:
        return f"event {event:,}"
    return f"event {event:,} ({format_ms(t)} into the trace)"


def view_time_ms(view, event):
    """Milliseconds from the first event to `event` (to its bucket's start for events analyze()
    did not name; None without timestamps)."""
    if event in view.event_ms:
        return view.event_ms[event]
    if not view.starts or event < 0:
        return None
    k = min(len(view.starts) - 1, event // view.bucket)
    return view.times_ms[k]


# Characters a terminal must not receive from a trace: C0 controls, DEL and C1 controls (ESC
# starts sequences that retitle the window or clear the screen; C1's CSI does the same), and lone
# surrogates (a str that was never valid Unicode: no encoding can write it, print() raises).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape_char(match):
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xff else f"\\u{code:04x}"


def terminal_safe(text):
    """`text` with every character of _UNPRINTABLE written as its Python escape (ESC as \\x1b,
    a lone surrogate as \\ud800): visible, and harmless to the terminal that prints it."""
    return _UNPRINTABLE.sub(_escape_char, text)


def format_summary(view, top_tags=5, width=100):
    """The terminal summary of `pyalloc view` without -o: peaks and when, OOMs, top tags. Its
    lines hold the trace's own strings (path, setting, tags), each line passed through
    terminal_safe and wrapped at `width` columns (continuations indented by 4; a path or a word
    longer than that is not broken)."""
    out = [f"{view.path or 'snapshot'}: {view.events:,} events on device {view.device}, "
           f"setting {view.config or '(defaults)'}"]
    for name in SERIES:
        if name in view.peaks:
            value, event = view.peaks[name]
            out.append(f"peak {name + ':':<11}{format_bytes(value)} ({value:,} bytes) at {_when(view, event)}")
        else:
            out.append(f"peak {name + ':':<11}- ({view.allocated_note})")
    if view.ooms:
        first = view.ooms[0]
        out.append(f"out of memory: {len(view.ooms):,} (first at {_when(view, first.event)}: "
                   f"{format_bytes(first.requested)} requested, {format_bytes(first.device_free)} free "
                   "on the device)")
    else:
        out.append("out of memory: none")
    shown = [t for t in view.tags if t[1]][:top_tags]
    if shown and not (len(shown) == 1 and shown[0][0] == ""):
        out.append(f"tags at the peak ({view.peak_series}): " + ", ".join(
            f"{_tag_label(t)} {format_bytes(b)}" for t, b, _, _ in shown))
    for note in view.notes:
        out.append("note: " + note)
    return "\n".join(textwrap.fill(terminal_safe(line), width, subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False) for line in out)


# ------------------------------------------------------------------------------- tune's curves

def reserved_curve(snapshot, config, *, placement="fresh", device=0, device_memory=None,
                   points=CURVE_POINTS, memory_fraction=None, empty_cache_calls=None):
    """Reserved bytes over a replay of the trace under `config`: (event indices, maxima), the
    maximum of memory_reserved() over the events since the previous point, about `points` of
    them. The replay's progress callback samples the allocator; the peak statistic is reset at
    each sample, so each point is that stretch's own maximum and the curve's maximum is the
    replay's peak reserved. `snapshot`: a snapshot dict or a pyalloc.trace.Trace of `device`."""
    trace = as_trace(snapshot, device, check=False)
    every = max(1, len(trace.entries) // max(1, points))
    xs, ys = [0], [0]
    holder = []

    def sample(done, total):
        allocator = holder[0]
        xs.append(done)
        ys.append(allocator.max_memory_reserved())
        allocator.reset_peak_memory_stats()

    replay(trace, config=config, placement=placement, device=device, device_memory=device_memory,
           progress=sample, progress_every=every, on_start=holder.append,
           memory_fraction=memory_fraction, empty_cache_calls=empty_cache_calls)
    return xs, ys


def tune_curves(result, snapshot, *, points=CURVE_POINTS):
    """{id(row): reserved_curve(...)} for a pyalloc.tune.TuneResult's ranked rows and its baseline,
    each replayed again as tune replayed it (same setting, placement, device, device size, memory
    fraction and empty_cache calls). `snapshot`: a snapshot dict or a Trace, read once for all."""
    trace = as_trace(snapshot, result.device, check=False)
    curves = {}
    for row in list(result.rows) + [result.baseline]:
        if row.result is not None:
            curves[id(row)] = reserved_curve(trace, row.config, placement=row.placement,
                                             device=result.device, device_memory=result.device_memory,
                                             points=points, memory_fraction=result.memory_fraction,
                                             empty_cache_calls=result.empty_cache_calls)
    return curves
