"""One recorded trace, loaded and checked once, shared by replay, tune and view.

A `Trace` is a snapshot's allocator trace on one device with what every command reads from it:
its entries, the setting it was recorded with (own_config), whether it holds releases and oom
entries (trace_flags), whether it starts mid-run (looks_wrapped), and the segment addresses the
scan that checks it finds (scan_trace). Each is read from the snapshot once. Figures that take a
replay to find (the recorded OOM, which segment frees were empty_cache() calls) are kept on it
too (Trace.derived): pyalloc.replay computes them the first time a command asks, and every later
replay of the same trace (tune's grid, --fit's bisection, tune --html's curves) reuses them.

Only the standard library and pyalloc._replay's scan are used here; the replays that the kept
figures come from live in pyalloc.replay, which builds on this module.
"""
from __future__ import annotations

import copy
import os
from functools import cached_property

from pyalloc._replay import scan_trace, trace_flags
from pyalloc.snapshot import DEFAULT_MAX_BYTES, SnapshotError, load


def trace_devices(snapshot):
    """The device ordinals whose allocator trace in a snapshot dict is not empty."""
    return [i for i, t in enumerate(snapshot.get("device_traces") or []) if t]


def trace_entries(snapshot, device=0):
    """The trace of `device` in a snapshot dict, or SnapshotError when it has none (naming the
    devices whose traces it holds, when there are any)."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        others = trace_devices(snapshot)
        if others:
            raise SnapshotError(
                f"the snapshot holds no allocator trace for device {device}; it holds traces for "
                f"device{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}")
        raise SnapshotError(
            "the snapshot holds no allocator trace for device "
            f"{device}: record it with torch.cuda.memory._record_memory_history(enabled='all') "
            "(enabled='state' or no history keeps no trace)")
    return traces[device]


def check_trace(entries, device=0):
    """scan_trace(entries), with a corrupt entry reported as SnapshotError naming the device, the
    entry index and the field (an entry that is not a dict, a missing action, an addr, size or
    stream that is not an int in range)."""
    try:
        return scan_trace(entries)
    except ValueError as err:
        raise SnapshotError(f"corrupt snapshot: device {device} {err}") from None


def own_config(snapshot):
    """The PYTORCH_CUDA_ALLOC_CONF a snapshot was recorded with ('' when it does not say);
    SnapshotError when it is stored as something other than a string (PyTorch writes a str)."""
    settings = snapshot.get("allocator_settings")
    if not isinstance(settings, dict):
        return ""
    config = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if config is None:
        return ""
    if not isinstance(config, str):
        raise SnapshotError(f"corrupt snapshot: allocator_settings['PYTORCH_CUDA_ALLOC_CONF'] is "
                            f"{type(config).__name__} {config!r:.80}, expected the setting string")
    return config


def looks_wrapped(entries):
    """True when the trace starts in the middle of a run: frees of blocks it never saw allocated."""
    seen = set()
    for e in entries:
        action = e["action"]
        if action == "alloc":
            seen.add(e["addr"])
        elif action in ("free_requested", "free_completed") and e["addr"] not in seen:
            return True
    return False


# The fields of a final segment that recorded placement reads (pyalloc.replay's reservations):
# the base addresses of the trace's expandable segments, where their reservations go.
_PLACEMENT_FIELDS = ("address", "total_size", "device", "segment_type", "is_expandable")


class Trace:
    """A snapshot's allocator trace on one device, read once.

    snapshot: the snapshot dict; device: the device ordinal; entries: its trace (the list in
    snapshot["device_traces"][device]); own_config: the PYTORCH_CUDA_ALLOC_CONF it was recorded
    with ('' when it does not say); path: the file it was loaded from (None for a dict).
    Made with check=True (the default), every entry is checked at once (SnapshotError naming
    the first corrupt one); with check=False on first use of segment_allocs / segment_maps.
    SnapshotError also when the snapshot holds no trace for `device`, or a setting that is not
    a string. The lazily computed attributes are kept: nothing here is computed twice.
    """

    def __init__(self, snapshot, device=0, *, path=None, check=True):
        self.snapshot = snapshot
        self.device = device
        self.path = None if path is None else str(path)
        self.entries = trace_entries(snapshot, device)
        self.own_config = own_config(snapshot)
        self._derived = {}
        if check:
            self.check()

    @classmethod
    def load(cls, path, device=0, *, max_bytes=DEFAULT_MAX_BYTES, check=True):
        """The Trace of `device` in the snapshot file `path` (pyalloc.snapshot.load, `max_bytes`
        as there: the largest file and decompressed pickle read, in bytes; None: no limit)."""
        return cls(load(path, max_bytes=max_bytes), device, path=os.fspath(path), check=check)

    def check(self):
        """Check every entry (SnapshotError naming the first corrupt one), once."""
        self._scan  # noqa: B018 -- computing it is the check

    @cached_property
    def _scan(self):
        return check_trace(self.entries, self.device)

    @property
    def segment_allocs(self):
        """[(addr, size)] of the trace's segment_alloc entries, in order (bytes)."""
        return self._scan[0]

    @property
    def segment_maps(self):
        """[addr] of the trace's segment_map entries, in order."""
        return self._scan[1]

    @cached_property
    def _flags(self):
        return trace_flags(self.entries)

    @property
    def has_releases(self):
        """True when the trace holds segment_free or segment_unmap entries."""
        return self._flags[0]

    @property
    def has_ooms(self):
        """True when the trace holds an `oom` entry (a request PyTorch could not serve)."""
        return self._flags[1]

    @cached_property
    def wrapped(self):
        """True when the trace starts in the middle of the run (looks_wrapped)."""
        return looks_wrapped(self.entries)

    @cached_property
    def allocations(self):
        """The number of its alloc entries."""
        return sum(1 for e in self.entries if e["action"] == "alloc")

    @cached_property
    def expandable_segments(self):
        """The final `segments` of its device that are expandable (recorded placement reads
        their base addresses)."""
        device = self.device
        return [seg for seg in self.snapshot.get("segments") or []
                if seg.get("is_expandable") and seg.get("device", device) == device]

    def derived(self, key, compute):
        """The figure kept under `key` (a hashable naming it and its parameters), computed by
        compute() the first time it is asked for. An exception from compute() is not kept."""
        try:
            return self._derived[key]
        except KeyError:
            pass
        value = self._derived[key] = compute()
        return value

    def slim(self):
        """This trace over a copy of its snapshot that holds only what a replay reads: the
        traces, the settings and the placement fields of the expandable segments (a worker
        process keeps no blocks or frames). What was already computed comes along."""
        out = copy.copy(self)       # a new __dict__ holding the same values
        out._derived = dict(self._derived)
        out.snapshot = {
            "segments": [{k: seg[k] for k in _PLACEMENT_FIELDS if k in seg}
                         for seg in self.snapshot.get("segments") or [] if seg.get("is_expandable")],
            "device_traces": self.snapshot.get("device_traces") or [],
            "allocator_settings": self.snapshot.get("allocator_settings")}
        # Kept, it would hold on to the full segment dicts (their blocks and frames).
        out.__dict__.pop("expandable_segments", None)
        return out

    def __repr__(self):
        where = self.path if self.path is not None else "<snapshot>"
        return f"<Trace {where} device {self.device}: {len(self.entries):,} entries>"


def as_trace(trace, device=0, *, check=True):
    """`trace` as a Trace of `device`: a Trace itself (checked now when `check`), a snapshot dict,
    or the path of a snapshot file. ValueError for a Trace of another device."""
    if isinstance(trace, Trace):
        if trace.device != device:
            raise ValueError(f"the Trace is device {trace.device}'s, but device={device} was asked for")
        if check:
            trace.check()
        return trace
    if isinstance(trace, dict):
        return Trace(trace, device, check=check)
    return Trace.load(trace, device, check=check)
