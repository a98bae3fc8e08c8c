"""Replay a recorded allocator trace through pyalloc on the simulated device.

The input is a PyTorch (or pyalloc) memory snapshot recorded with history on
(torch.cuda.memory._record_memory_history(enabled="all")). Its `alloc` and `free_completed`
events are fed, in order, to a CachingAllocator on a SimDevice. With recorded placement, new
segments are put at the addresses of the trace's own `segment_alloc` entries, so a faithful
allocator hands out every allocation at the address PyTorch returned.
"""
import time
from dataclasses import asdict, dataclass

from pyalloc.allocator import CachingAllocator
from pyalloc.errors import OutOfMemoryError
from pyalloc.snapshot import SnapshotError, load
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

    @property
    def events_per_second(self):
        return self.events / self.seconds if self.seconds > 0 else float("inf")

    @property
    def reserved_over_requested(self):
        return self.peak_reserved / self.peak_requested if self.peak_requested else float("nan")

    def as_dict(self):
        out = asdict(self)
        out["events_per_second"] = self.events_per_second
        out["reserved_over_requested"] = self.reserved_over_requested
        return out


def trace_entries(snapshot, device=0):
    """The trace of `device` in a snapshot dict, or SnapshotError when it has none."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise SnapshotError(
            "the snapshot holds no allocator trace for device "
            f"{device}: record it with torch.cuda.memory._record_memory_history(enabled='all') "
            "(enabled='state' or no history keeps no trace)")
    return traces[device]


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


def recorded_placements(entries):
    """(address, size) of each segment_alloc in trace order: where PyTorch's driver put segments."""
    return [(e["addr"], e["size"]) for e in entries if e["action"] == "segment_alloc"]


def recorded_reservations(snapshot, entries, device_memory, device=0):
    """(base, reserved bytes) of the trace's expandable segments, one per pool, in the order the
    trace first maps into them: the base is the lowest address of that pool's expandable segments
    in the snapshot's final `segments` list."""
    from pyalloc._core import expandable_reservation_size
    bases = {}
    for seg in snapshot.get("segments", []):
        if seg.get("is_expandable") and seg.get("device", device) == device:
            small = seg.get("segment_type") == "small"
            bases[small] = min(bases.get(small, seg["address"]), seg["address"])
    reservations = [(base, expandable_reservation_size(device_memory, small)) for small, base in bases.items()]
    map_addrs = [e["addr"] for e in entries if e["action"] == "segment_map"]

    def first_map(reservation):
        base, size = reservation
        return next((i for i, a in enumerate(map_addrs) if base <= a < base + size), len(map_addrs))
    # Both pools may reserve the same number of bytes, so the reservation order must be the trace's.
    return sorted(reservations, key=first_map)


def replay(trace, *, config=None, placement="recorded", device_memory=None, device=0, progress=None):
    """Replay a snapshot's allocation stream through a CachingAllocator on a SimDevice.

    Args:
        trace: a path to a snapshot (.pickle / .pickle.gz) or a snapshot dict.
        config: allocator settings string; None takes the trace's own
            allocator_settings["PYTORCH_CUDA_ALLOC_CONF"].
        placement: "recorded" puts new segments at the trace's segment_alloc addresses;
            "fresh" lets the simulated device choose.
        device_memory: simulated device size in bytes (default 80 GiB).
        device: which device's trace to replay.
        progress: optional callable(done_events, total_events), called every 4096 events.
    Returns a ReplayResult.
    """
    if placement not in ("recorded", "fresh"):
        raise ValueError(f"placement must be 'recorded' or 'fresh', got {placement!r}")
    snapshot = load(trace) if not isinstance(trace, dict) else trace
    entries = trace_entries(snapshot, device)
    if config is None:
        config = (snapshot.get("allocator_settings") or {}).get("PYTORCH_CUDA_ALLOC_CONF", "") or ""
    device_memory = DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory
    sim = SimDevice(device_memory, device=device)
    if placement == "recorded":
        sim.place_segments(recorded_placements(entries))
        sim.place_reservations(recorded_reservations(snapshot, entries, device_memory, device))
    alloc = CachingAllocator(device, backend=sim, config=config)

    live = {}          # trace address -> our pointer
    allocations = matches = 0
    in_segment_free_run = False
    total = len(entries)
    started = time.perf_counter()
    for i, e in enumerate(entries):
        action = e["action"]
        if action == "alloc":
            allocations += 1
            try:
                ptr = alloc.malloc(e["size"], e["stream"])
            except OutOfMemoryError:
                continue
            live[e["addr"]] = ptr
            matches += ptr == e["addr"]
        elif action == "free_completed":
            ptr = live.pop(e["addr"], None)
            if ptr is not None:
                alloc.free(ptr)
        elif action == "segment_free" and not in_segment_free_run:
            # A run of segment_free entries is what empty_cache() leaves in a trace.
            alloc.empty_cache()
        in_segment_free_run = action == "segment_free"
        if progress is not None and (i & 4095) == 0:
            progress(i, total)
    seconds = time.perf_counter() - started
    if progress is not None:
        progress(total, total)
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
        allocations=allocations, address_matches=matches, events=total, seconds=seconds,
        wrapped=looks_wrapped(entries))
