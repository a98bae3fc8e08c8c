"""Specification of SimDevice, the simulated device, as a backend in its own right.

SimDevice's segment calls are C-level (the allocator's backend interface), so segment placement and
device memory are observed through a CachingAllocator running on it; streams, events and counters
are driven through SimDevice's Python methods.
"""

import pytest

import pyalloc
from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice

from units import KiB, MiB, GiB
BASE = 0x7F0000000000      # SimDevice's documented default base_address


def make(total_memory=80 * GiB, config="", **sim_kwargs):
    # BASE is the first live SimDevice's default; given explicitly, the placement tests hold
    # while devices of other tests live (they get other default ranges).
    sim_kwargs.setdefault("base_address", BASE)
    sim = SimDevice(total_memory, **sim_kwargs)
    return sim, CachingAllocator(backend=sim, config=config)


# ------------------------------------------------------------------------------ construction

def test_default_device_is_80_gib_and_empty():
    sim = SimDevice()
    assert sim.total_memory == 80 * GiB
    assert sim.used_memory == 0
    assert sim.mem_get_info() == (80 * GiB, 80 * GiB)
    assert sim.segments() == []
    assert sim.pending_placements == 0
    assert sim.device == 0 and sim.kind == "sim"


def test_device_ordinal_is_reported():
    sim = SimDevice(device=3)
    assert sim.device == 3
    assert CachingAllocator(3, backend=sim).device == 3


def test_zero_total_memory_is_rejected():
    with pytest.raises(ValueError, match="total_memory"):
        SimDevice(0)


@pytest.mark.parametrize("alignment", [0, 3, 3 * MiB])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError, match=str(alignment)):
        SimDevice(alignment=alignment)


# ------------------------------------------------------------------------------ addresses

def test_first_segment_starts_at_the_base_address():
    sim, alloc = make()
    ptr = alloc.malloc(512)
    assert sim.segments() == [(BASE, 2 * MiB)]
    assert ptr == BASE


def test_same_sequence_gives_same_addresses():
    def run():
        sim, alloc = make()
        s1 = sim.create_stream()
        ptrs = [alloc.malloc(n, s) for n, s in
                [(1000, 0), (3 * MiB, 0), (12 * MiB, s1), (700, s1), (25 * MiB, 0)]]
        alloc.free(ptrs[2])
        alloc.empty_cache()
        ptrs.append(alloc.malloc(5 * MiB, s1))
        return ptrs, sim.segments()

    assert run() == run()


def test_segments_are_packed_back_to_back_at_2_mib_alignment():
    sim, alloc = make()
    alloc.malloc(512)              # 2 MiB small segment
    alloc.malloc(3 * MiB)          # 20 MiB segment
    # Another stream, so that the 20 MiB segment's free tail is not reused.
    alloc.malloc(11 * MiB, sim.create_stream())   # 12 MiB segment (rounded up to 2 MiB)
    assert sim.segments() == [(BASE, 2 * MiB), (BASE + 2 * MiB, 20 * MiB),
                              (BASE + 22 * MiB, 12 * MiB)]
    assert all(addr % (2 * MiB) == 0 for addr, _ in sim.segments())


def test_alignment_setting_spaces_segments():
    sim, alloc = make(alignment=64 * MiB)
    alloc.malloc(512)
    alloc.malloc(3 * MiB)
    assert [a for a, _ in sim.segments()] == [BASE, BASE + 64 * MiB]


def test_base_address_setting_moves_segments():
    sim, alloc = make(base_address=0x100000000)
    assert alloc.malloc(512) == 0x100000000


def test_freed_range_is_reused_first_fit():
    sim, alloc = make()
    a = alloc.malloc(12 * MiB)                   # [BASE, +12 MiB)
    alloc.malloc(512)                            # [BASE+12 MiB, +2 MiB), stays live
    alloc.free(a)
    alloc.empty_cache()                          # releases only the 12 MiB segment
    assert sim.segments() == [(BASE + 12 * MiB, 2 * MiB)]
    # A 20 MiB segment does not fit the 12 MiB hole: it goes after the live segment.
    alloc.malloc(4 * MiB)
    assert (BASE + 14 * MiB, 20 * MiB) in sim.segments()
    # A 12 MiB segment (on another stream, so no cached block serves it) fits the hole exactly.
    assert alloc.malloc(11 * MiB, sim.create_stream()) == BASE
    assert (BASE, 12 * MiB) in sim.segments()


# ------------------------------------------------------------------------------ memory and OOM

def test_used_memory_and_mem_get_info_follow_segments():
    sim, alloc = make(total_memory=1 * GiB)
    alloc.malloc(512)
    alloc.malloc(3 * MiB)
    assert sim.used_memory == 22 * MiB
    assert sim.mem_get_info() == (1 * GiB - 22 * MiB, 1 * GiB)


def test_segment_beyond_total_memory_is_out_of_memory():
    sim, alloc = make(total_memory=16 * MiB)
    # 3 MiB is less than the device holds, but its segment is 20 MiB.
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(3 * MiB)
    assert sim.segments() == [] and sim.used_memory == 0


def test_segments_fill_total_memory_exactly():
    sim, alloc = make(total_memory=6 * MiB)
    for _ in range(3):
        alloc.malloc(1 * MiB, sim.create_stream())    # one 2 MiB segment per stream
    assert sim.mem_get_info() == (0, 6 * MiB)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(512, sim.create_stream())


def test_freed_segment_returns_memory():
    sim, alloc = make(total_memory=20 * MiB)
    p = alloc.malloc(3 * MiB)
    alloc.free(p)
    alloc.empty_cache()
    assert sim.mem_get_info() == (20 * MiB, 20 * MiB)
    alloc.malloc(3 * MiB, sim.create_stream())        # fits again


# ------------------------------------------------------------------------------ placement queue

def test_place_segments_queues_addresses_per_size_in_order():
    sim, alloc = make()
    a, b, c = 0x200000000, 0x300000000, 0x400000000
    sim.place_segments([(a, 2 * MiB), (b, 20 * MiB), (c, 2 * MiB)])
    assert sim.pending_placements == 3
    s1 = sim.create_stream()
    assert alloc.malloc(3 * MiB) == b                # the 20 MiB queue
    assert alloc.malloc(512) == a                    # the 2 MiB queue, oldest first
    assert alloc.malloc(512, s1) == c                # the 2 MiB queue, next
    assert sim.pending_placements == 0
    # Nothing queued any more: first fit from the base address.
    assert alloc.malloc(512, sim.create_stream()) == BASE


def test_place_segments_other_sizes_fall_back_to_first_fit():
    sim, alloc = make()
    sim.place_segments([(0x200000000, 20 * MiB)])
    assert alloc.malloc(512) == BASE
    assert sim.pending_placements == 1


def test_place_segments_accumulates_across_calls():
    sim, alloc = make()
    sim.place_segments([(0x200000000, 2 * MiB)])
    sim.place_segments([(0x300000000, 2 * MiB)])
    assert sim.pending_placements == 2
    assert alloc.malloc(512) == 0x200000000
    assert alloc.malloc(512, sim.create_stream()) == 0x300000000


def test_placement_overlapping_a_live_segment_raises():
    sim, alloc = make()
    alloc.malloc(3 * MiB)                            # [BASE, +20 MiB)
    sim.place_segments([(BASE + 4 * MiB, 2 * MiB)])
    with pytest.raises(RuntimeError, match="overlaps a live segment"):
        alloc.malloc(512)
    # The allocator did not count a segment it never got.
    assert alloc.memory_stats()["segment.all.current"] == 1
    alloc._check_invariants()


@pytest.mark.parametrize("placement", [(0, 2 * MiB), (-4096, 2 * MiB), (0x200000000, 0),
                                       (0x200000000, -1)])
def test_place_segments_rejects_non_positive_address_or_size(placement):
    sim = SimDevice()
    with pytest.raises(ValueError, match="positive"):
        sim.place_segments([placement])
    assert sim.pending_placements == 0


def test_place_segments_bad_entry_queues_nothing():
    sim = SimDevice()
    with pytest.raises(ValueError):
        sim.place_segments([(0x200000000, 2 * MiB), (0, 2 * MiB)])
    assert sim.pending_placements == 0


# ------------------------------------------------------------------------------ streams and work

def test_create_stream_gives_distinct_positive_handles():
    sim = SimDevice()
    streams = [sim.create_stream() for _ in range(5)]
    assert len(set(streams)) == 5
    assert all(isinstance(s, int) and s > 0 for s in streams)


def test_launch_queues_work_and_returns_total():
    sim = SimDevice()
    s = sim.create_stream()
    assert sim.launch(s) == 1
    assert sim.launch(s, 3) == 4
    assert sim.pending(s) == 4
    assert sim.pending(0) == 0


def test_complete_finishes_work_in_order():
    sim = SimDevice()
    s = sim.create_stream()
    sim.launch(s, 5)
    assert sim.complete(s, 2) == 2
    assert sim.pending(s) == 3
    assert sim.complete(s) == 3
    assert sim.pending(s) == 0
    assert sim.complete(s) == 0


def test_complete_never_finishes_more_than_queued():
    sim = SimDevice()
    sim.launch(0, 2)
    assert sim.complete(0, 10) == 2
    assert sim.pending(0) == 0


def test_streams_progress_independently():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a, 2)
    sim.launch(b, 3)
    sim.complete(a)
    assert sim.pending(a) == 0 and sim.pending(b) == 3


def test_synchronize_finishes_every_stream():
    sim = SimDevice()
    streams = [0] + [sim.create_stream() for _ in range(3)]
    for i, s in enumerate(streams):
        sim.launch(s, i + 1)
    sim.synchronize()
    assert [sim.pending(s) for s in streams] == [0, 0, 0, 0]


# ------------------------------------------------------------------------------ events

def test_event_on_idle_stream_is_done():
    sim = SimDevice()
    assert sim.event_done(sim.record_event(sim.create_stream()))


def test_event_completes_only_when_earlier_work_completes():
    sim = SimDevice()
    s = sim.create_stream()
    sim.launch(s, 2)
    ev = sim.record_event(s)
    assert not sim.event_done(ev)
    sim.complete(s, 1)
    assert not sim.event_done(ev)
    sim.complete(s, 1)
    assert sim.event_done(ev)


def test_event_ignores_work_queued_after_it():
    sim = SimDevice()
    s = sim.create_stream()
    sim.launch(s)
    ev = sim.record_event(s)
    sim.launch(s, 4)
    sim.complete(s, 1)
    assert sim.event_done(ev)
    assert sim.pending(s) == 4


def test_event_ignores_other_streams():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a)
    sim.launch(b)
    ev = sim.record_event(a)
    sim.complete(b)
    assert not sim.event_done(ev)
    sim.complete(a)
    assert sim.event_done(ev)


def test_events_are_distinct_handles():
    sim = SimDevice()
    assert len({sim.record_event(0) for _ in range(4)}) == 4


def test_unknown_event_is_rejected():
    sim = SimDevice()
    with pytest.raises(ValueError, match="12345"):
        sim.event_done(12345)
    with pytest.raises(ValueError, match="12345"):
        sim.wait_event(0, 12345)


# ------------------------------------------------------------------------------ cross-stream waits

def test_work_after_wait_cannot_complete_before_awaited_work():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a, 2)
    ev = sim.record_event(a)
    sim.wait_event(b, ev)
    sim.launch(b)
    sim.complete(b)
    # b's work ran, so the work on a it waited for has run too.
    assert sim.pending(b) == 0
    assert sim.pending(a) == 0
    assert sim.event_done(ev)


def test_wait_does_not_pull_in_work_queued_after_the_event():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a, 1)
    ev = sim.record_event(a)
    sim.launch(a, 3)                 # after the event: b does not wait for these
    sim.wait_event(b, ev)
    sim.launch(b)
    sim.complete(b)
    assert sim.pending(a) == 3


def test_work_before_wait_completes_without_awaited_work():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a)
    ev = sim.record_event(a)
    sim.launch(b)                    # queued before the wait
    sim.wait_event(b, ev)
    sim.launch(b)                    # queued after the wait
    assert sim.complete(b, 1) == 1
    assert sim.pending(a) == 1       # the first item of b did not need a
    sim.complete(b, 1)
    assert sim.pending(a) == 0


def test_event_recorded_after_wait_waits_for_the_awaited_work():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a)
    ev_a = sim.record_event(a)
    sim.wait_event(b, ev_a)
    sim.launch(b)
    ev_b = sim.record_event(b)
    assert not sim.event_done(ev_b)
    sim.complete(a)
    assert not sim.event_done(ev_b)      # b's own item still pending
    sim.complete(b)
    assert sim.event_done(ev_b)


def test_event_recorded_right_after_wait_is_not_done_before_awaited_work():
    # cudaStreamWaitEvent orders everything queued on the stream later, event records included.
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a)
    ev_a = sim.record_event(a)
    sim.wait_event(b, ev_a)
    ev_b = sim.record_event(b)
    assert not sim.event_done(ev_b)
    sim.complete(a)
    assert sim.event_done(ev_b)


def test_event_after_chained_waits_waits_for_the_first_stream():
    sim = SimDevice()
    a, b, c = (sim.create_stream() for _ in range(3))
    sim.launch(a)
    sim.wait_event(b, sim.record_event(a))
    sim.wait_event(c, sim.record_event(b))     # b's event holds a's work back
    ev_c = sim.record_event(c)
    assert not sim.event_done(ev_c)
    sim.complete(a)
    assert sim.event_done(ev_c)


def test_wait_queued_after_a_record_does_not_hold_that_event_back():
    # a: work, record ev_a; b: wait ev_a, record ev_b; a: wait ev_b. The wait on a comes after
    # ev_a, so ev_a depends only on a's work (and the mutual waits are no cycle).
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a)
    ev_a = sim.record_event(a)
    sim.wait_event(b, ev_a)
    ev_b = sim.record_event(b)
    sim.wait_event(a, ev_b)
    assert not sim.event_done(ev_a) and not sim.event_done(ev_b)
    sim.complete(a)
    assert sim.event_done(ev_a) and sim.event_done(ev_b)


def test_work_after_a_wait_on_a_waiting_stream_waits_for_the_first_stream():
    sim = SimDevice()
    a, b, c = (sim.create_stream() for _ in range(3))
    sim.launch(a)
    sim.wait_event(b, sim.record_event(a))
    sim.wait_event(c, sim.record_event(b))     # no work on b between its wait and its event
    sim.launch(c)
    sim.complete(c)
    assert sim.pending(a) == 0


def test_event_synchronize_completes_awaited_work():
    # The allocator's empty_cache synchronizes the events of blocks freed with recorded streams.
    sim, alloc = make()
    a, b = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(512)
    alloc.record_stream(p, b)
    sim.launch(a)
    sim.wait_event(b, sim.record_event(a))
    alloc.free(p)                              # records an event on b, after its wait on a
    alloc.empty_cache()
    assert sim.pending(a) == 0
    assert sim.counters["event_synchronize"] == 1


def test_waits_chain_across_three_streams():
    sim = SimDevice()
    a, b, c = (sim.create_stream() for _ in range(3))
    sim.launch(a)
    sim.wait_event(b, sim.record_event(a))
    sim.launch(b)
    sim.wait_event(c, sim.record_event(b))
    sim.launch(c)
    sim.complete(c)
    assert (sim.pending(a), sim.pending(b), sim.pending(c)) == (0, 0, 0)


def test_wait_on_own_stream_event_is_a_no_op():
    sim = SimDevice()
    a = sim.create_stream()
    sim.launch(a)
    sim.wait_event(a, sim.record_event(a))
    sim.launch(a)
    assert sim.complete(a, 1) == 1
    assert sim.pending(a) == 1


def test_synchronize_resolves_waits():
    sim = SimDevice()
    a, b = sim.create_stream(), sim.create_stream()
    sim.launch(a, 2)
    sim.wait_event(b, sim.record_event(a))
    sim.launch(b, 2)
    sim.synchronize()
    assert sim.pending(a) == 0 and sim.pending(b) == 0


# ------------------------------------------------------------------------------ counters

def test_counters_start_at_zero():
    sim = SimDevice()
    assert set(sim.counters) >= {"segment_alloc", "segment_free", "memory_info", "event_create",
                                 "event_record", "event_query", "event_synchronize",
                                 "event_destroy", "stream_synchronize"}
    assert all(v == 0 for v in sim.counters.values())


def test_counters_count_segment_calls():
    sim, alloc = make()
    p = alloc.malloc(512)
    q = alloc.malloc(3 * MiB)
    assert sim.counters["segment_alloc"] == 2
    alloc.free(p)
    alloc.free(q)
    alloc.empty_cache()
    assert sim.counters["segment_free"] == 2


def test_counters_count_event_calls():
    sim = SimDevice()
    s = sim.create_stream()
    sim.launch(s)
    ev = sim.record_event(s)
    sim.event_done(ev)
    sim.event_done(ev)
    assert sim.counters["event_create"] == 1
    assert sim.counters["event_record"] == 1
    assert sim.counters["event_query"] == 2


def test_counters_count_failed_segment_attempts():
    sim, alloc = make(total_memory=16 * MiB)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(3 * MiB)
    # The first attempt, then the retry after the full cache flush (no max_split_size: no
    # oversize release step in between).
    assert sim.counters["segment_alloc"] == 2
    assert sim.counters["segment_free"] == 0


def test_sim_device_is_exported():
    assert pyalloc.SimDevice is SimDevice
    assert "SimDevice" in repr(SimDevice(4 * MiB))


def test_a_segment_free_waits_for_the_work_of_every_stream_as_cudafree_does():
    sim, alloc = make(1 << 30)
    s, other = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(4 * KiB, s)
    sim.launch(s)                                 # may still use p
    sim.launch(other)
    on_s, on_other = sim.record_event(s), sim.record_event(other)
    alloc.free(p)                                 # its own stream: cached without an event
    alloc.empty_cache()                           # cudaFree of the segment waits for the device
    assert sim.event_done(on_s) and sim.event_done(on_other)


def test_an_empty_cache_that_frees_no_segment_leaves_queued_work_queued():
    sim, alloc = make(1 << 30)
    s = sim.create_stream()
    p, q = alloc.malloc(4 * KiB, s), alloc.malloc(4 * KiB, s)    # one small segment
    sim.launch(s)
    on_s = sim.record_event(s)
    alloc.free(p)
    alloc.empty_cache()                           # q keeps the segment: no cudaFree
    assert not sim.event_done(on_s)
    alloc.free(q)
