"""Replay a recorded allocator trace through pyalloc on the simulated device.

The input is a PyTorch (or pyalloc) memory snapshot recorded with history on
(torch.cuda.memory._record_memory_history(enabled="all")). Its `alloc` and `free_completed`
events are fed, in order, to a CachingAllocator on a SimDevice. With recorded placement, new
segments are put at the addresses of the trace's own `segment_alloc` entries, so a faithful
allocator hands out every allocation at the address PyTorch returned.
"""
import sys
import time
from dataclasses import dataclass, field, fields

from pyalloc.allocator import CachingAllocator
from pyalloc.snapshot import SnapshotError, load
from pyalloc._replay import replay_entries, scan_trace
from pyalloc._sim import SimDevice

DEFAULT_DEVICE_MEMORY = 80 << 30


@dataclass
class ReplayResult:
    """Figures of one replay. Byte figures are bytes; peaks are PyTorch's memory_stats peaks."""
    config: str
    placement: str
    peak_reserved: int
    peak_allocated: int
    peak_requested: int
    final_reserved: int
    num_device_alloc: int
    num_alloc_retries: int
    num_ooms: int
    allocations: int          # alloc events replayed
    address_matches: int      # allocations that landed at the trace's address
    events: int               # trace entries read
    seconds: float
    wrapped: bool             # True when the trace's ring buffer had dropped its oldest entries
    # The allocator's final snapshot (PyTorch's format) when replayed with history=True.
    snapshot: dict | None = field(default=None, repr=False, compare=False)

    @property
    def events_per_second(self):
        return self.events / self.seconds if self.seconds > 0 else float("inf")

    @property
    def reserved_over_requested(self):
        return self.peak_reserved / self.peak_requested if self.peak_requested else float("nan")

    def as_dict(self):
        """The figures as a flat dict (the snapshot, if any, is left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "snapshot"}
        out["events_per_second"] = self.events_per_second
        out["reserved_over_requested"] = self.reserved_over_requested
        return out


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


def recorded_reservations(snapshot, map_addrs, device_memory, device=0):
    """(base, reserved bytes) of the trace's expandable segments, one per pool, in the order the
    trace first maps into them (`map_addrs`: the addresses of its segment_map entries, in order):
    the base is the lowest address of that pool's expandable segments in the snapshot's final
    `segments` list."""
    from pyalloc._expandable import expandable_reservation_size
    bases = {}
    for seg in snapshot.get("segments", []):
        if seg.get("is_expandable") and seg.get("device", device) == device:
            small = seg.get("segment_type") == "small"
            bases[small] = min(bases.get(small, seg["address"]), seg["address"])
    reservations = [(base, expandable_reservation_size(device_memory, small)) for small, base in bases.items()]

    def first_map(reservation):
        base, size = reservation
        return next((i for i, a in enumerate(map_addrs) if base <= a < base + size), len(map_addrs))
    # Both pools may reserve the same number of bytes, so the reservation order must be the trace's.
    return sorted(reservations, key=first_map)


def replay(trace, *, config=None, placement="recorded", device_memory=None, device=0, progress=None,
           on_finish=None, history=False, check=True, progress_every=65536, on_start=None):
    """Replay a snapshot's allocation stream through a CachingAllocator on a SimDevice.

    Args:
        trace: a path to a snapshot (.pickle / .pickle.gz) or a snapshot dict.
        config: allocator settings string; None takes the trace's own
            allocator_settings["PYTORCH_CUDA_ALLOC_CONF"].
        placement: "recorded" puts new segments at the trace's segment_alloc addresses;
            "fresh" lets the simulated device choose, top-down as the CUDA driver tends to
            (SimDevice(top_down=True)).
        device_memory: simulated device size in bytes (default 80 GiB).
        device: which device's trace to replay.
        progress: optional callable(done_events, total_events), called after every
            `progress_every`-th event (not after free_requested entries or 0-byte allocations,
            which change nothing) and once at the end.
        progress_every: events between progress calls (default 65536); 1 calls it after every
            event that can change the allocator's figures.
        on_start: optional callable(allocator), called with the CachingAllocator before the first
            event, so that `progress` can sample its statistics (pyalloc.view draws curves so).
        on_finish: optional callable(allocator), called with the CachingAllocator once the last
            event is replayed and before the figures are read (e.g. to write its snapshot).
        history: True records the replay's own memory history (enabled="all", context=None,
            every event kept) and puts the allocator's final snapshot in ReplayResult.snapshot.
            Off by default: the replay loop then records nothing.
        check: True (the default) checks every entry before the replay (see check_trace) and
            raises SnapshotError for a corrupt one. False skips that pass under fresh placement,
            for a trace already checked (tune checks once for all its replays); recorded
            placement always scans, and so checks, the trace.
    Returns a ReplayResult.
    """
    if placement not in ("recorded", "fresh"):
        raise ValueError(f"placement must be 'recorded' or 'fresh', got {placement!r}")
    if not isinstance(history, bool):
        raise TypeError(f"history must be True or False, got {type(history).__name__} {history!r}")
    snapshot = load(trace) if not isinstance(trace, dict) else trace
    entries = trace_entries(snapshot, device)
    if config is None:
        config = (snapshot.get("allocator_settings") or {}).get("PYTORCH_CUDA_ALLOC_CONF", "") or ""
    device_memory = DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory
    # The clock covers everything after the pickle is loaded, reading the events included.
    started = time.perf_counter()
    # Fresh segments go top-down: best fit's address tie-breaks then match PyTorch's runs.
    sim = SimDevice(device_memory, device=device, top_down=placement == "fresh")
    if placement == "recorded" or check:
        segment_allocs, segment_maps = check_trace(entries, device)
    if placement == "recorded":
        sim.place_segments(segment_allocs)
        sim.place_reservations(recorded_reservations(snapshot, segment_maps, device_memory, device))
    alloc = CachingAllocator(device, backend=sim, config=config)
    if history:
        alloc.record_memory_history(enabled="all", context=None, max_entries=sys.maxsize)
    if on_start is not None:
        on_start(alloc)
    allocations, matches, _, unknown_frees = replay_entries(alloc, entries, progress, progress_every)
    seconds = time.perf_counter() - started
    if on_finish is not None:
        on_finish(alloc)
    stats = alloc.memory_stats()
    return ReplayResult(
        config=config, placement=placement,
        peak_reserved=stats["reserved_bytes.all.peak"],
        peak_allocated=stats["allocated_bytes.all.peak"],
        peak_requested=stats["requested_bytes.all.peak"],
        final_reserved=stats["reserved_bytes.all.current"],
        num_device_alloc=stats["num_device_alloc"],
        num_alloc_retries=stats["num_alloc_retries"],
        num_ooms=stats["num_ooms"],
        allocations=allocations, address_matches=matches, events=len(entries), seconds=seconds,
        wrapped=unknown_frees > 0, snapshot=alloc.snapshot() if history else None)
