"""Expandable segments (expandable_segments:True).

Every test runs on SimDevice and, where a GPU is present, on the GPU (tests/backends.py's harness,
as tests/test_core.py: [sim] and [cuda]); @sim_only marks, with the reason, those that need what
only the simulator has. The GPU's own half (memory that is written and read) is
tests/test_expandable_gpu.py.
"""
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import pyalloc
from pyalloc._expandable import expandable_reservation_size
from pyalloc.replay import replay

import backends
from backends import backend, sim_only  # noqa: F401 (backend: the autouse fixture)

from units import MiB, GiB
TRACES = Path(__file__).resolve().parent / "data"     # PyTorch traces (tests/data/README.md)
COUNTERS = "counts backend calls (SimDevice.counters)"
DEVICE_SIZE = "needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory paths"


def make(total=80 * GiB, config="expandable_segments:True"):
    """(allocator, device) of the running test (tests/backends.py's make: a SimDevice of `total`
    bytes, or on a [cuda] run the GPU, whose size a test of another size cannot ask for)."""
    dev, alloc = backends.make(config, total)
    return alloc, dev


@sim_only(COUNTERS)
def test_small_request_maps_one_2mib_page():
    a, sim = make()
    a.malloc(4096)
    stats = a.memory_stats()
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["num_device_alloc"] == 1
    assert stats["segment.all.current"] == 0          # maps are not counted as segments
    assert sim.mapped_memory == 2 * MiB
    assert sim.counters["vm_reserve"] == 1 and sim.counters["segment_alloc"] == 0


def test_large_request_maps_whole_20mib_pages():
    a, sim = make()
    a.malloc(30 * MiB)
    assert a.memory_stats()["reserved_bytes.large_pool.current"] == 40 * MiB
    assert sim.mapped_memory == 40 * MiB


def test_segment_grows_contiguously_at_its_frontier():
    a, sim = make()
    p1 = a.malloc(30 * MiB)
    p2 = a.malloc(30 * MiB)
    assert p2 == p1 + 30 * MiB
    assert a.memory_reserved() == 60 * MiB
    assert a.memory_stats()["num_device_alloc"] == 2
    assert len(sim.reservations()) == 1


@sim_only(COUNTERS)
def test_freed_expandable_block_is_reused_without_mapping():
    a, sim = make()
    p1 = a.malloc(30 * MiB)
    a.malloc(30 * MiB)
    a.free(p1)
    maps = sim.counters["vm_map"]
    assert a.malloc(30 * MiB) == p1
    assert sim.counters["vm_map"] == maps


def test_empty_cache_unmaps_everything_free_and_releases_the_reservation():
    a, sim = make()
    ptrs = [a.malloc(n) for n in (4096, 30 * MiB, 3 * MiB)]
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    stats = a.memory_stats()
    assert stats["reserved_bytes.all.current"] == 0
    assert stats["num_device_free"] == 2              # one unmap per pool
    assert sim.mapped_memory == 0
    assert sim.reservations() == []
    a._check_invariants()


def test_unmap_keeps_partial_pages_mapped():
    a, sim = make()
    first = a.malloc(25 * MiB)                         # maps pages 0 and 1 (40 MiB)
    a.malloc(10 * MiB)                                 # lives in page 1, no new map
    a.free(first)
    a.empty_cache()                                    # free range [0, 25 MiB): only page 0 is whole
    assert a.memory_reserved() == 20 * MiB
    assert sim.mapped_memory == 20 * MiB
    segments = a._segments()
    assert [(s["address"] - first, s["total_size"]) for s in segments] == [(20 * MiB, 20 * MiB)]
    a._check_invariants()


def test_unmap_first_waits_for_work_queued_on_the_segment_stream():
    a, sim = make()
    s = sim.create_stream()
    p = a.malloc(30 * MiB, s)
    sim.launch(s)
    a.free(p)
    a.empty_cache()
    assert sim.pending(s) == 0


def test_streams_get_separate_segments():
    a, sim = make()
    s = sim.create_stream()
    p0 = a.malloc(30 * MiB, 0)
    p1 = a.malloc(30 * MiB, s)
    assert len(sim.reservations()) == 2
    # Each reserves the address space PyTorch reserves for a pool (more than the device's memory).
    reserved = expandable_reservation_size(a.backend.mem_get_info()[1], False)
    assert abs(p1 - p0) >= reserved


def test_expandable_segment_sizes_lists_every_segment_including_default_stream():
    a, sim = make()
    s = sim.create_stream()
    a.malloc(4096, 0)
    a.malloc(30 * MiB, 0)
    a.malloc(50 * MiB, s)
    assert sorted(a.expandable_segment_sizes()) == sorted([
        (0, True, 2 * MiB), (0, False, 40 * MiB), (s, False, 60 * MiB)])


def run_workload(a, stream):
    """A small training-like loop: activations grow, are freed, then a second larger step."""
    for step in range(3):
        live = [a.malloc((i + 1) * 3 * MiB + step * MiB, stream) for i in range(8)]
        live += [a.malloc(8192 * (i + 1), stream) for i in range(20)]
        for p in reversed(live):
            a.free(p)


@sim_only(COUNTERS)
def test_warm_up_maps_ahead_so_the_workload_maps_nothing():
    first, _ = make()
    run_workload(first, 0)
    sizes = first.expandable_segment_sizes()
    warm, sim = make()
    warm.warm_up(sizes)
    maps = sim.counters["vm_map"]
    assert sorted(warm.expandable_segment_sizes()) == sorted(sizes)
    run_workload(warm, 0)
    assert sim.counters["vm_map"] == maps
    warm._check_invariants()


def test_warm_up_rejects_malformed_sizes_and_needs_expandable():
    a, _ = make()
    with pytest.raises(TypeError, match="tuples"):
        a.warm_up([(0, True)])
    plain, _ = make(config="")
    with pytest.raises(RuntimeError, match="expandable_segments:True"):
        plain.warm_up([(0, False, 20 * MiB)])


def test_switching_off_at_run_time_skips_expandable_blocks():
    a, sim = make()
    p = a.malloc(30 * MiB)
    a.free(p)                                          # a free 40 MiB expandable block is cached
    a._apply_settings(pyalloc.config.CudaAllocatorConfig(""))
    q = a.malloc(30 * MiB)
    assert q != p
    assert a.memory_stats()["segment.all.current"] == 1  # a plain segment, not the expandable block
    a._apply_settings(pyalloc.config.CudaAllocatorConfig("expandable_segments:True"))
    a.free(q)
    assert a.malloc(30 * MiB) in (p, q)
    a._check_invariants()


@sim_only("counts backend calls (SimDevice.counters) of an allocator that follows the process settings "
          "(no explicit config, which the harness's make always gives)")
def test_set_allocator_settings_switches_an_allocator_that_follows_process_settings():
    before = pyalloc.get_allocator_settings()
    try:
        pyalloc.set_allocator_settings("expandable_segments:True")
        sim = pyalloc.SimDevice()
        a = pyalloc.CachingAllocator(backend=sim)       # follows the process-wide settings
        a.malloc(4096)
        assert sim.counters["vm_map"] == 1
        pyalloc.set_allocator_settings("expandable_segments:False")
        a.malloc(4 * MiB)
        assert sim.counters["segment_alloc"] == 1
    finally:
        pyalloc.set_allocator_settings("expandable_segments:False," + before if before else "expandable_segments:False")


@sim_only(DEVICE_SIZE)
def test_out_of_memory_when_pages_cannot_be_mapped_and_allocator_stays_usable():
    a, sim = make(total=100 * MiB)
    p = a.malloc(60 * MiB)
    with pytest.raises(pyalloc.OutOfMemoryError):
        a.malloc(60 * MiB)
    a.free(p)
    assert a.malloc(60 * MiB)
    a._check_invariants()


@sim_only(DEVICE_SIZE)
def test_oom_flush_unmaps_free_pages_of_another_pool_and_retries():
    a, sim = make(total=100 * MiB)
    small = [a.malloc(1 * MiB) for _ in range(20)]     # 20 small pages... 20 MiB mapped in the small pool
    for p in small:
        a.free(p)
    p = a.malloc(90 * MiB)                             # needs the small pool's pages back
    assert p
    assert a.memory_stats()["num_alloc_retries"] == 1
    a._check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["malloc", "free", "empty"]),
                          st.integers(1, 64 * MiB), st.integers(0, 1)), max_size=60))
@sim_only(DEVICE_SIZE)
def test_random_sequences_keep_invariants_and_never_overlap(ops):
    a, sim = make(total=2 * GiB)
    s1 = sim.create_stream()
    live = {}
    for op, size, which in ops:
        if op == "malloc":
            try:
                p = a.malloc(size, (0, s1)[which])
            except pyalloc.OutOfMemoryError:
                continue
            for q, n in live.items():
                assert p + size <= q or q + n <= p, "live allocations overlap"
            live[p] = size
        elif op == "free" and live:
            p = next(iter(live))
            del live[p]
            a.free(p)
        elif op == "empty":
            a.empty_cache()
        a._check_invariants()
    assert a.memory_allocated() == sum(a.round_size(n) for n in live.values())


def torch_peaks():
    lines = (TRACES / "torch-peaks.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line)["tag"] == "expandable"]


@pytest.mark.parametrize("run", torch_peaks(), ids=lambda r: r["workload"])
@sim_only("replays a trace on SimDevice at PyTorch's recorded addresses (pyalloc.replay): no device of "
          "the test's")
def test_replaying_expandable_traces_reproduces_pytorch(run):
    result = replay(TRACES / f"{run['workload']}-expandable.pickle.gz", config=run["conf"])
    assert (result.peak_reserved, result.peak_allocated, result.num_device_alloc) == (
        run["peak_reserved"], run["peak_allocated"], run["num_device_alloc"])
    assert result.address_matches == result.allocations
