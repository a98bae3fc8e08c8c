"""Replay a recorded allocator trace through pyalloc on the simulated device.

The input is a PyTorch (or pyalloc) memory snapshot recorded with history on
(torch.cuda.memory._record_memory_history(enabled="all")). Its `alloc` and `free_completed`
events are fed, in order, to a CachingAllocator on a SimDevice. With recorded placement, new
segments are put at the addresses of the trace's own `segment_alloc` entries, so a faithful
allocator hands out every allocation at the address PyTorch returned.
"""
import math
import sys
import time
import types
from dataclasses import dataclass, field, fields

from pyalloc.config import CudaAllocatorConfig

from pyalloc.allocator import CachingAllocator
from pyalloc.snapshot import SnapshotError
# The trace's own facts live in pyalloc.trace; these names stay importable from here.
from pyalloc.trace import (Trace, as_trace, check_trace, looks_wrapped, own_config,  # noqa: F401
                           trace_devices, trace_entries)
from pyalloc._replay import replay_entries
from pyalloc._sim import SimDevice

DEFAULT_DEVICE_MEMORY = 80 << 30
MiB = 1 << 20


@dataclass
class OomRequest:
    """One `oom` entry of the trace, as the replay attempted it. Bytes are bytes.

    index: the entry's index in the trace; size: the request PyTorch could not serve (its
    rounded size, as the oom entry records it); stream; device_free: the device's free bytes
    PyTorch saw then (cudaMemGetInfo); reserved / allocated: the replay's reserved and allocated
    bytes at that moment (after the out-of-memory ladder when the attempt failed; before the
    request when it fitted or was not attempted); fits: whether the replay served it (None: not
    attempted); margin: when it fits, the bytes a new segment could still have taken after it
    (the device, or the memory fraction's limit, minus reserved); when it does not, minus the
    bytes its segment was short of."""
    index: int
    size: int
    stream: int
    device_free: int
    reserved: int
    allocated: int
    fits: bool | None
    margin: int

    @property
    def cached_free(self):
        """Reserved bytes that sat free in the cache (fragmentation): reserved - allocated."""
        return self.reserved - self.allocated

    def as_dict(self):
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["cached_free"] = self.cached_free
        return out


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
    device_memory: int = DEFAULT_DEVICE_MEMORY   # bytes of the simulated device
    memory_fraction: float | None = None         # the per-process memory fraction in force
    allowed_memory: int | None = None            # floor(fraction x device_memory) under one
    empty_cache_calls: int = 0                   # segment-free runs replayed as empty_cache()
    unmatched_releases: int = 0                  # literal_releases: segment frees not found
    failed_allocations: int = 0                  # alloc entries that ran out of memory
    first_failed_alloc: int | None = None        # index of the first of them
    # The trace's oom entries as replayed (OomRequest); the releases it replayed as calls.
    oom_requests: list = field(default_factory=list, repr=False, compare=False)
    release_calls: list = field(default_factory=list, repr=False, compare=False)
    # The allocator's final snapshot (PyTorch's format) when replayed with history=True.
    snapshot: dict | None = field(default=None, repr=False, compare=False)

    @property
    def oom_requests_fitting(self):
        """How many of the trace's oom requests fitted in this replay."""
        return sum(1 for r in self.oom_requests if r.fits)

    @property
    def events_per_second(self):
        return self.events / self.seconds if self.seconds > 0 else float("inf")

    @property
    def reserved_over_requested(self):
        return self.peak_reserved / self.peak_requested if self.peak_requested else float("nan")

    def as_dict(self):
        """The figures as a flat dict (the snapshot, if any, is left out)."""
        skip = ("snapshot", "oom_requests", "release_calls")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["oom_requests"] = [r.as_dict() for r in self.oom_requests]
        out["oom_requests_fitting"] = self.oom_requests_fitting
        out["events_per_second"] = self.events_per_second
        out["reserved_over_requested"] = self.reserved_over_requested
        return out


def recorded_reservations(trace, device_memory):
    """(base, reserved bytes) of a Trace's expandable segments, one per pool, in the order the
    trace first maps into them (its segment_map entries): the base is the lowest address of that
    pool's expandable segments in the snapshot's final `segments` list. Reservation sizes are
    those of a device of `device_memory` bytes."""
    from pyalloc._expandable import expandable_reservation_size
    map_addrs = trace.segment_maps
    bases = {}
    for seg in trace.expandable_segments:
        small = seg.get("segment_type") == "small"
        bases[small] = min(bases.get(small, seg["address"]), seg["address"])
    reservations = [(base, expandable_reservation_size(device_memory, small)) for small, base in bases.items()]

    def first_map(reservation):
        base, size = reservation
        return next((i for i, a in enumerate(map_addrs) if base <= a < base + size), len(map_addrs))
    # Both pools may reserve the same number of bytes, so the reservation order must be the trace's.
    return sorted(reservations, key=first_map)


def segment_size_for(rounded):
    """Bytes of the segment PyTorch asks the device for to serve a request of `rounded` bytes
    (already rounded): 2 MiB for a small request (<= 1 MiB), 20 MiB below 10 MiB, else the
    request rounded up to 2 MiB (reference 1.4). A copy of the core's rule (_policy.pxd
    segment_size_for), which Python cannot reach; tests/test_replay_oom.py pins it to PyTorch's."""
    if rounded <= 1 << 20:
        return 2 * MiB
    if rounded < 10 * MiB:
        return 20 * MiB
    return -(-rounded // (2 * MiB)) * (2 * MiB)


def settings_key(settings):
    """A hashable of what a CudaAllocatorConfig sets, not of its text: two strings that mean the
    same settings ('max_split_size_mb:128' and 'max_split_size_mb:128,') replay identically and
    have the same key."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                        for k, v in vars(settings).items() if k != "last_settings_string"))


def same_settings(config, other):
    """True when the setting strings `config` and `other` set the same values (ConfigError for a
    malformed one)."""
    return settings_key(CudaAllocatorConfig(config)) == settings_key(CudaAllocatorConfig(other))


def check_memory_fraction(memory_fraction):
    """memory_fraction itself when it is None or a number in (0, 1]; TypeError / ValueError
    naming it otherwise."""
    if memory_fraction is None:
        return None
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
        raise TypeError(f"memory_fraction must be a number in (0, 1], got "
                        f"{type(memory_fraction).__name__} {memory_fraction!r}")
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    return float(memory_fraction)


def fraction_in_force(config, memory_fraction):
    """The per-process memory fraction a replay under setting string `config` runs with:
    `memory_fraction` when given, else the setting's own per_process_memory_fraction; None when
    that is 1.0 (no fraction) or `config` does not parse. PyTorch applies the setting's fraction
    at construction exactly as torch.cuda.set_per_process_memory_fraction, so every step that
    models the run's limit (classifying its segment frees, deriving the device from a recorded
    OOM, --fit's scaling) must see the fraction whichever way it was given."""
    if memory_fraction is not None:
        return memory_fraction
    try:
        fraction = CudaAllocatorConfig(config).per_process_memory_fraction
    except ValueError:       # a malformed setting: the replay itself reports it
        return None
    return fraction if fraction < 1.0 else None


def gc_without_fraction(config, memory_fraction):
    """True when setting string `config` sets garbage_collection_threshold but no memory fraction
    below 1 is in force (neither `memory_fraction` nor its per_process_memory_fraction): PyTorch's
    GC then does nothing, and neither does the replay's. For a trace recorded under
    torch.cuda.set_per_process_memory_fraction, the fraction must be given to replay its GC."""
    try:
        settings = CudaAllocatorConfig(config)
    except ValueError:
        return False
    fraction = memory_fraction if memory_fraction is not None else settings.per_process_memory_fraction
    return settings.garbage_collection_threshold > 0.0 and fraction >= 1.0


def allowed_bytes(device_memory, memory_fraction):
    """The allocator's limit on a device of `device_memory` bytes under `memory_fraction`:
    floor(fraction x device_memory) as PyTorch computes it, or None for no fraction (or 1.0)."""
    if memory_fraction is None or memory_fraction >= 1.0:
        return None
    return int(memory_fraction * float(device_memory))


def device_for_allowed(allowed, memory_fraction):
    """The largest device size (bytes) whose limit under `memory_fraction` is at most `allowed`
    bytes (`allowed` itself without a fraction below 1)."""
    if memory_fraction is None or memory_fraction >= 1.0:
        return allowed
    size = int(allowed / memory_fraction) + 2
    while size > 1 and int(memory_fraction * float(size)) > allowed:
        size -= 1
    return size


def trace_segment_bytes(entries):
    """Sum of the sizes of the trace's segment_alloc and segment_map entries: more than it ever
    held at once."""
    return sum(e["size"] for e in entries if e["action"] in ("segment_alloc", "segment_map"))


def roomy_device(entries):
    """A device size (bytes) on which the trace cannot run out of memory: at least 80 GiB, and
    more than every segment the trace made."""
    return max(DEFAULT_DEVICE_MEMORY, -(-2 * trace_segment_bytes(entries) // (2 * MiB)) * 2 * MiB)


@dataclass
class RecordedOom:
    """A trace's recorded out-of-memory: its first `oom` entry, and the limit the trace implies.

    Bytes are bytes. index, size (the rounded request), stream, device_free: the first oom
    entry's; reserved / allocated: reserved and allocated bytes right after the out-of-memory
    ladder (the replay's, at the trace's addresses, so PyTorch's); segment_size: what the
    request asked the device for; count: the trace's oom entries. limit: the largest allocator
    limit consistent with every oom entry: min over them of (reserved + segment_size - 1) and
    (reserved + device_free) (a capped run fails the first, a full device the second);
    peak_reserved: the most the run held (successfully), a lower bound on the limit;
    device_memory: the device size to replay it on (limit itself, or the largest device whose
    memory_fraction gives at most `limit`)."""
    index: int
    size: int
    stream: int
    device_free: int
    reserved: int
    allocated: int
    segment_size: int
    count: int
    limit: int
    peak_reserved: int
    device_memory: int
    memory_fraction: float | None = None

    @property
    def cached_free(self):
        """Bytes reserved but free in the cache at the OOM (fragmentation)."""
        return self.reserved - self.allocated

    @property
    def consistent(self):
        """False when the run held more than `limit` at some point (the limit changed during the
        run, or other processes took device memory)."""
        return self.peak_reserved <= self.limit

    def as_dict(self):
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(cached_free=self.cached_free, consistent=self.consistent)
        return out


def implied_device_memory(oom):
    """The device (bytes) to replay a run on when none is given: oom.device_memory, the largest
    device consistent with its recorded OOM. SnapshotError when that is below one byte (an oom
    entry with nothing reserved and 0 bytes free on the device: the run could hold no memory,
    and no simulated device is that small); the caller must then be told the device size."""
    if oom.device_memory < 1:
        raise SnapshotError(
            f"its oom entry {oom.index:,} records {oom.device_free:,} bytes free on the device with "
            f"{oom.reserved:,} bytes reserved: the run could hold no memory at all, which no device "
            "size reproduces; give the device's size (--device-memory)")
    return oom.device_memory


def recorded_oom(trace, *, device=0, memory_fraction=None, check=True):
    """The first recorded out-of-memory of a trace and the device limit it implies
    (RecordedOom), or None when the trace holds no `oom` entry.

    The figures at each oom entry come from a replay under the trace's own setting, at the trace's
    addresses, on a device too big to run out of memory and with no memory fraction, oom requests
    not attempted, every segment_free releasing the very segment the trace freed
    (literal_releases): the allocator's state at each oom entry is then PyTorch's after its
    ladder, whatever limit the run had. (Where the recorded addresses do not fit, a fresh replay
    with the ladder's releases taken as empty_cache() calls, exact only when every policy release
    was a full flush.) `memory_fraction`: the fraction the run had, if the user knows it
    (device_memory is then the device under that fraction). `trace`: a Trace, a snapshot dict
    or a path (pyalloc.trace.as_trace); a Trace keeps the answer, per fraction.
    """
    memory_fraction = check_memory_fraction(memory_fraction)
    trace = as_trace(trace, device, check=check)
    if not trace.has_ooms:
        return None
    return trace.derived(("recorded_oom", memory_fraction),
                         lambda: _measure_recorded_oom(trace, memory_fraction))


def _measure_recorded_oom(trace, memory_fraction):
    """recorded_oom's replay and arithmetic, for a Trace that holds oom entries."""
    kwargs = dict(config=trace.own_config, device_memory=roomy_device(trace.entries),
                  device=trace.device, memory_fraction=1.0, attempt_ooms=False,
                  empty_cache_calls=None, check=False)
    try:
        measured = replay(trace, placement="recorded", literal_releases=True, **kwargs)
    except RuntimeError:      # the recorded addresses do not fit this replay
        measured = replay(trace, placement="fresh", **kwargs)
    bounds = []
    for r in measured.oom_requests:
        segment = segment_size_for(r.size)
        bounds.append(min(r.reserved + segment - 1, r.reserved + r.device_free))
    first = measured.oom_requests[0]
    limit = min(bounds)
    return RecordedOom(
        index=first.index, size=first.size, stream=first.stream, device_free=first.device_free,
        reserved=first.reserved, allocated=first.allocated,
        segment_size=segment_size_for(first.size), count=len(measured.oom_requests), limit=limit,
        peak_reserved=measured.peak_reserved,
        device_memory=device_for_allowed(limit, memory_fraction), memory_fraction=memory_fraction)


def classify_releases(trace, *, device=0, device_memory=None, memory_fraction=None):
    """The entry indices of a trace's segment-free runs that are empty_cache() calls (the others
    are releases of the allocator's own policy), decided by a replay under the trace's own
    setting, at its addresses where they fit (else fresh), on `device_memory` bytes under
    `memory_fraction` (the run's own limit: with another, the ladder's releases look like calls).
    None when the trace's own setting cannot be replayed here (each replay then classifies under
    its own setting). The rule: _replay.replay_entries. `trace`: a Trace, a snapshot dict or a
    path (pyalloc.trace.as_trace); a Trace keeps the answer per device size and fraction, so
    the replays of one trace under other settings classify once (each caller gets its own list).
    """
    trace = as_trace(trace, device, check=False)
    device_memory = DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory
    calls = trace.derived(("release_calls", device_memory, memory_fraction),
                          lambda: _classify_releases(trace, device_memory, memory_fraction))
    return None if calls is None else list(calls)


def _classify_releases(trace, device_memory, memory_fraction):
    """classify_releases' replay: a tuple of entry indices, or None."""
    kwargs = dict(config=trace.own_config, device_memory=device_memory, device=trace.device,
                  memory_fraction=memory_fraction, empty_cache_calls=None, check=False)
    try:
        try:
            return tuple(replay(trace, placement="recorded", **kwargs).release_calls)
        except RuntimeError:
            return tuple(replay(trace, placement="fresh", **kwargs).release_calls)
    except ValueError:     # a malformed own setting (ConfigError) or a corrupt entry
        return None


def traced_reservations(entries, device_memory):
    """(base, reserved bytes) of every expandable segment the trace's segment_map and
    segment_unmap entries imply, in the order they were reserved. A stream has one expandable
    segment per pool while it lives: a map of a (stream, pool) with none live starts one at its
    address (PyTorch maps a new segment from its base up); a segment whose mapped bytes all went
    (empty_cache, the flush) was released, and a later map reserves anew. Small-pool maps are
    single 2 MiB pages (a small request needs one), large-pool maps whole 20 MiB pages; an unmap
    belongs to the live segment of its stream with the highest base at or below it. Reservation
    sizes are those of a device of `device_memory` (the run's own are not in the trace)."""
    from pyalloc._expandable import expandable_reservation_size
    live = {}          # (stream, small) -> [base, mapped bytes]
    out = []
    for e in entries:
        action = e["action"]
        if action != "segment_map" and action != "segment_unmap":
            continue
        addr, size, stream = e["addr"], e["size"], e.get("stream", 0)
        if action == "segment_map":
            key = (stream, size % (20 * MiB) != 0)
            seg = live.get(key)
            if seg is None or addr < seg[0]:
                seg = live[key] = [addr, 0]
                out.append((addr, expandable_reservation_size(device_memory, key[1])))
            seg[1] += size
            continue
        owners = [(seg[0], key) for key, seg in live.items() if key[0] == stream and seg[0] <= addr]
        if owners:
            key = max(owners)[1]
            live[key][1] -= size
            if live[key][1] <= 0:
                del live[key]
    return out


def _foreign_release_calls(trace, config, own, check, device, device_memory, memory_fraction):
    """The entries to replay as empty_cache() calls when `config` is not the trace's own setting
    `own` (classify_releases under the own setting, same device memory in bytes and fraction);
    None under the own setting, where the replay classifies as it goes."""
    if config == own:
        return None
    try:
        foreign = not same_settings(config, own)
    except ValueError:     # the own setting does not parse here: classify under `config`
        foreign = False
    if not foreign:
        return None
    if check:      # a corrupt entry is reported as such, not as a failed classification
        trace.check()
    return classify_releases(trace, device=device, device_memory=device_memory,
                             memory_fraction=memory_fraction)


def _replay_device(trace, placement, device_memory, device, check):
    """The SimDevice of `device_memory` bytes a replay runs on: under recorded placement its new
    segments and expandable reservations go where the trace's did; fresh ones go top-down.
    Checks the trace's entries first when `check` or recorded placement asks (SnapshotError)."""
    # Fresh segments go top-down: best fit's address tie-breaks then match PyTorch's runs.
    sim = SimDevice(device_memory, device=device, top_down=placement == "fresh", any_stream=True)
    if placement == "recorded" or check:
        trace.check()
    if placement == "recorded":
        sim.place_segments(trace.segment_allocs)
        if trace.segment_maps:
            reservations = traced_reservations(trace.entries, device_memory)
            # A trace that starts after its segments were reserved (a wrapped ring buffer) maps
            # below the first address it saw of a segment: when a final segment lies outside
            # every reservation so found, the final snapshot's segments know better.
            final = [seg["address"] for seg in trace.expandable_segments]
            if not all(any(base <= a < base + size for base, size in reservations) for a in final):
                reservations = recorded_reservations(trace, device_memory)
            sim.place_reservations(reservations)
    return sim


def replay(trace, *, config=None, placement="recorded", device_memory=None, device=0, progress=None,
           on_finish=None, history=False, check=True, progress_every=65536, on_start=None,
           memory_fraction=None, empty_cache_calls=None, attempt_ooms=True, literal_releases=False):
    """Replay a snapshot's allocation stream through a CachingAllocator on a SimDevice.

    Args:
        trace: a path to a snapshot (.pickle / .pickle.gz), a snapshot dict, or a
            pyalloc.trace.Trace of `device` (read once and shared by many replays: what it
            has checked or classified is not done again).
        config: allocator settings string; None takes the trace's own
            allocator_settings["PYTORCH_CUDA_ALLOC_CONF"].
        placement: "recorded" puts new segments at the trace's segment_alloc addresses;
            "fresh" lets the simulated device choose, top-down as the CUDA driver tends to
            (SimDevice(top_down=True)).
        device_memory: simulated device size in bytes (default 80 GiB).
        memory_fraction: None keeps the setting's own per_process_memory_fraction (none: no
            limit but the device); a number in (0, 1] models
            torch.cuda.set_per_process_memory_fraction: the allocator may hold at most
            floor(fraction x device_memory) bytes, and garbage_collection_threshold, which acts
            only under a fraction below 1, counts from that limit. 1.0 removes a fraction.
        device: which device's trace to replay.
        empty_cache_calls: the entry indices to replay as empty_cache() calls (every other
            segment_free / segment_unmap is the policy's, made by the replay's allocator itself):
            classify_releases' answer. None (the default): under the trace's own setting the
            replay classifies as it goes; under another, classify_releases runs first, under the
            own setting, the same device memory and fraction.
        attempt_ooms: True (the default) attempts the request of every `oom` entry (see the
            module docstring); False only measures the allocator there (OomRequest.fits None).
        literal_releases: True frees exactly the segments the trace frees (recorded placement
            under the own setting), for measuring the trace's state at its oom entries on a
            device too big to run out of memory; the counts of the ladder are then not PyTorch's.
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
            for a trace already checked; recorded placement always scans, and so checks, the
            trace. A Trace checks once: a later replay of it does not scan again.
    Returns a ReplayResult. Its `seconds` cover everything after the pickle is loaded: the
    check when this replay makes it, and reading the events.
    """
    if placement not in ("recorded", "fresh"):
        raise ValueError(f"placement must be 'recorded' or 'fresh', got {placement!r}")
    if not isinstance(history, bool):
        raise TypeError(f"history must be True or False, got {type(history).__name__} {history!r}")
    memory_fraction = check_memory_fraction(memory_fraction)
    # Loaded here (a path) without the check, which the clock below covers.
    trace = as_trace(trace, device, check=False)
    entries = trace.entries
    own = trace.own_config
    if config is None:
        config = own
    device_memory = DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory
    # A fraction in `config` is the run's limit as much as one given as memory_fraction: the
    # classification below replays the own setting, which does not carry it.
    memory_fraction = fraction_in_force(config, memory_fraction)
    if empty_cache_calls is None:
        empty_cache_calls = _foreign_release_calls(trace, config, own, check, device, device_memory,
                                                   memory_fraction)
    # The clock covers everything after the pickle is loaded, reading the events included.
    started = time.perf_counter()
    sim = _replay_device(trace, placement, device_memory, device, check)
    alloc = CachingAllocator(device, backend=sim, config=config)
    if memory_fraction is not None:
        alloc.set_memory_fraction(memory_fraction)
    fraction = alloc.get_memory_fraction()
    if history:
        alloc.record_memory_history(enabled="all", context=None, max_entries=sys.maxsize)
    if on_start is not None:
        on_start(alloc)
    (allocations, matches, failed, unknown_frees, calls, oom_rows,
     first_failed, unmatched) = replay_entries(alloc, entries, progress, progress_every,
                                               empty_cache_calls, attempt_ooms, literal_releases)
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
        wrapped=unknown_frees > 0, device_memory=device_memory,
        memory_fraction=fraction if fraction < 1.0 else None,
        allowed_memory=allowed_bytes(device_memory, fraction),
        empty_cache_calls=len(calls), failed_allocations=failed, unmatched_releases=unmatched,
        first_failed_alloc=first_failed if first_failed >= 0 else None,
        oom_requests=[OomRequest(*row) for row in oom_rows], release_calls=list(calls),
        snapshot=alloc.snapshot() if history else None)


FIT_STEP = 2 * MiB


def fit_device_memory(trace, *, config=None, device=0, memory_fraction=None, empty_cache_calls=None,
                      check=True, ceiling=None, device_memory=None):
    """The smallest device memory (bytes, a multiple of 2 MiB) on which the whole trace, its oom
    requests included, replays under `config` without an out-of-memory; None when it runs out
    of memory even on `ceiling` bytes (default: roomy_device, more than every segment the trace
    made, over the fraction). `memory_fraction` as in replay: the device is then the one whose fraction gives the
    limit. Found by bisection over fresh-placement replays (recorded addresses belong to the
    trace's own limit), between a device whose limit is below the peak allocated bytes (it
    cannot fit) and one that fits. This assumes that a larger device never does worse, which
    holds for the ladder's frees and limits but not for every placement: the answer is a size
    that fits with the next 2 MiB below it not fitting. `empty_cache_calls` as in replay
    (classify_releases' answer; None classifies it first, under the own setting on
    `device_memory`: the device the run had, by default the one its recorded OOM implies, else
    80 GiB, as replay and tune take it). `trace` as in replay: every replay of the bisection
    shares one Trace."""
    memory_fraction = check_memory_fraction(memory_fraction)
    trace = as_trace(trace, device, check=check)
    entries = trace.entries
    if config is None:
        config = trace.own_config
    memory_fraction = fraction_in_force(config, memory_fraction)
    if empty_cache_calls is None:
        if device_memory is None:
            oom = recorded_oom(trace, device=device, memory_fraction=memory_fraction, check=False)
            device_memory = implied_device_memory(oom) if oom is not None else DEFAULT_DEVICE_MEMORY
        empty_cache_calls = classify_releases(trace, device=device, memory_fraction=memory_fraction,
                                              device_memory=device_memory)
    fraction = memory_fraction if memory_fraction is not None and memory_fraction < 1.0 else 1.0
    if ceiling is None:
        ceiling = -(-int(roomy_device(entries) / fraction) // FIT_STEP) * FIT_STEP
    kwargs = dict(config=config, placement="fresh", device=device, memory_fraction=memory_fraction,
                  empty_cache_calls=empty_cache_calls, check=False)

    def runs(size):
        return replay(trace, device_memory=size, **kwargs).num_ooms == 0

    roomy = replay(trace, device_memory=ceiling, **kwargs)
    if roomy.num_ooms:
        return None

    def up(size):
        return -(-size // FIT_STEP) * FIT_STEP

    # Above: the first 2 MiB multiple whose limit holds the roomy run's peak reserved bytes
    # (doubled while it does not fit: a smaller limit moves the GC threshold); below: the last
    # one whose limit is under the peak allocated bytes, which cannot fit.
    hi = up(math.ceil(roomy.peak_reserved / fraction))
    while not runs(hi):
        if hi >= ceiling:
            return None
        hi = min(up(ceiling), up(2 * hi))
    lo = max(0, up(math.ceil(roomy.peak_allocated / fraction)) - FIT_STEP)
    while hi - lo > FIT_STEP:
        mid = lo + ((hi - lo) // (2 * FIT_STEP)) * FIT_STEP
        if mid <= lo:
            mid = lo + FIT_STEP
        if runs(mid):
            hi = mid
        else:
            lo = mid
    return hi


class _CallableModule(types.ModuleType):
    """This module's type: calling the module calls its replay(). The package exposes the
    module as pyalloc.replay, so that `import pyalloc.replay` and pyalloc.replay.recorded_oom
    reach the module, while `pyalloc.replay(trace, ...)`, as the README shows it, still replays
    (before, the package's attribute was the function, which hid the module of that name)."""

    def __call__(self, *args, **kwargs):
        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
