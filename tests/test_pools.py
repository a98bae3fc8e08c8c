"""Specification of private pools (MemPool, use_mem_pool, routing), one behaviour per test.

The rules are PyTorch's (c10/cuda/CUDACachingAllocator.cpp and torch.cuda.MemPool, late 2025): pool
ids ((0, n) made by a user, (n, 0) by a capture), use counts and routing (the innermost matching
route wins); a pool keeps its high-water mark while referenced; empty_cache under routing leaves the
default pools alone (#158152); the OOM ladder under routing (no full flush; a use_on_oom pool lends
only its cached blocks); no_split pools never split.
Everything runs on a SimDevice; expected values are worked out from those rules.
"""
import gc
import threading

import pytest

import pyalloc
from pyalloc import CachingAllocator, MemPool, OutOfMemoryError, SimDevice
from pyalloc._core import current_thread_key
from pool_helpers import make, pool_of

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30




# ------------------------------------------------------------------------------- ids and counts

def test_user_created_pool_ids_are_zero_then_a_counter():
    _, alloc = make()
    first, second = alloc.mem_pool().id, alloc.mem_pool().id
    assert first[0] == 0 and second[0] == 0
    assert second[1] > first[1] > 0


def test_graph_pool_handle_is_a_user_created_id_without_a_pool():
    _, alloc = make()
    handle = alloc.graph_pool_handle()
    assert handle[0] == 0 and handle[1] > 0
    assert alloc._pool_info(handle) is None


def test_graph_created_pool_ids_have_the_counter_first():
    from pyalloc._core import new_mempool_id
    a, b = new_mempool_id(False), new_mempool_id(False)
    assert a[1] == 0 and b[1] == 0 and b[0] > a[0] > 0


def test_a_new_mempool_has_one_use():
    _, alloc = make()
    assert alloc.mem_pool().use_count() == 1


def test_use_mem_pool_adds_a_use_for_its_scope():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        assert pool.use_count() == 2
    assert pool.use_count() == 1


# ------------------------------------------------------------------------------- routing

def test_allocations_inside_use_mem_pool_come_from_the_pool():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
    assert pool_of(alloc, ptr) == pool.id


def test_allocations_after_the_scope_come_from_the_default_pool():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.malloc(4 * KiB)
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == (0, 0)


def test_a_pools_freed_block_is_not_reused_outside_it():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
    alloc.free(ptr)
    other = alloc.malloc(4 * KiB)
    assert other != ptr and pool_of(alloc, other) == (0, 0)


def test_a_pools_freed_block_is_reused_inside_it():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
        alloc.free(ptr)
        assert alloc.malloc(4 * KiB) == ptr


def test_use_mem_pool_routes_only_the_calling_thread():
    _, alloc = make()
    pool = alloc.mem_pool()
    seen = {}
    with alloc.use_mem_pool(pool):
        worker = threading.Thread(target=lambda: seen.setdefault("ptr", alloc.malloc(4 * KiB)))
        worker.start()
        worker.join()
        mine = alloc.malloc(4 * KiB)
    assert pool_of(alloc, seen["ptr"]) == (0, 0)
    assert pool_of(alloc, mine) == pool.id


def test_nested_scopes_route_to_the_innermost_pool():
    _, alloc = make()
    outer, inner = alloc.mem_pool(), alloc.mem_pool()
    with alloc.use_mem_pool(outer):
        with alloc.use_mem_pool(inner):
            in_inner = alloc.malloc(4 * KiB)
        in_outer = alloc.malloc(4 * KiB)
    assert pool_of(alloc, in_inner) == inner.id
    assert pool_of(alloc, in_outer) == outer.id


def test_routes_are_scanned_newest_first_lifo():
    _, alloc = make()
    first, second = alloc.mem_pool(), alloc.mem_pool()
    key = ("thread", current_thread_key())
    alloc.begin_allocate_to_pool(first.id, key)
    alloc.begin_allocate_to_pool(second.id, key)
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == second.id
    alloc.end_allocate_to_pool(second.id)
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == first.id
    alloc.end_allocate_to_pool(first.id)


def test_a_threads_oldest_route_routes_it_under_newer_routes_of_other_threads():
    _, alloc = make()
    mine, theirs, also_mine = alloc.mem_pool(), alloc.mem_pool(), alloc.mem_pool()
    me = current_thread_key()
    alloc.begin_allocate_to_pool(mine.id, ("thread", me))
    alloc.begin_allocate_to_pool(theirs.id, ("thread", me + 1))
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == mine.id
    alloc.begin_allocate_to_pool(also_mine.id, ("thread", me))
    alloc.end_allocate_to_pool(mine.id)          # an older route of this thread ends first
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == also_mine.id
    alloc.end_allocate_to_pool(also_mine.id)
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == (0, 0)
    alloc.end_allocate_to_pool(theirs.id)


@pytest.mark.parametrize("capture_route_newer", [True, False])
def test_the_newer_of_a_capture_route_and_the_threads_route_takes_a_capturing_stream(
        capture_route_newer):
    sim, alloc = make()
    by_thread, by_capture = alloc.mem_pool(), alloc.mem_pool()
    stream = sim.create_stream()
    sim.begin_capture(stream)
    capture_id = sim.stream_capture_info(stream)[0]
    routes = [(by_thread.id, ("thread", current_thread_key())),
              (by_capture.id, ("capture", capture_id))]
    for pool_id, route in (routes if capture_route_newer else routes[::-1]):
        alloc.begin_allocate_to_pool(pool_id, route)
    p = alloc.malloc(4 * KiB, stream)
    assert pool_of(alloc, p) == (by_capture.id if capture_route_newer else by_thread.id)
    alloc.free(p)
    sim.end_capture(stream)
    alloc.end_allocate_to_pool(by_thread.id)
    alloc.end_allocate_to_pool(by_capture.id)


def test_a_route_for_another_thread_key_is_ignored():
    _, alloc = make()
    pool = alloc.mem_pool()
    alloc.begin_allocate_to_pool(pool.id, ("thread", current_thread_key() + 1))
    try:
        assert pool_of(alloc, alloc.malloc(4 * KiB)) == (0, 0)
    finally:
        alloc.end_allocate_to_pool(pool.id)


def test_a_capture_route_does_not_take_a_stream_that_is_not_capturing():
    _, alloc = make()
    pool = alloc.mem_pool()
    alloc.begin_allocate_to_pool(pool.id, ("capture", 7))
    try:
        assert pool_of(alloc, alloc.malloc(4 * KiB)) == (0, 0)
    finally:
        alloc.end_allocate_to_pool(pool.id)


# ------------------------------------------------------------------------------- errors

def test_routing_a_pool_twice_raises_pytorchs_error_and_keeps_one_route():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        with pytest.raises(RuntimeError, match="beginAllocateToPool: already recording to mempool_id"):
            with alloc.use_mem_pool(pool):
                pass
        assert pool.use_count() == 2
        assert pool_of(alloc, alloc.malloc(4 * KiB)) == pool.id


def test_ending_a_route_that_is_not_there_raises_pytorchs_error():
    _, alloc = make()
    with pytest.raises(RuntimeError, match="endAllocatePool: not currently recording to mempool_id"):
        alloc.end_allocate_to_pool((0, 12345))


@pytest.mark.parametrize("bad", [(0,), [0, 1], (0, -1), (1, 1), ("a", 0), None])
def test_a_malformed_pool_id_is_refused(bad):
    _, alloc = make()
    with pytest.raises((TypeError, ValueError), match="mempool_id"):
        alloc.release_pool(bad)


def test_the_default_pool_id_cannot_be_routed_to():
    _, alloc = make()
    with pytest.raises(ValueError, match=r"\(0, 0\) is the default pool"):
        alloc.begin_allocate_to_pool((0, 0), ("thread", current_thread_key()))


@pytest.mark.parametrize("bad", ["thread", ("process", 1), ("thread", -1), ("capture", "x")])
def test_a_malformed_filter_is_refused_without_a_route(bad):
    _, alloc = make()
    pool = alloc.mem_pool()
    with pytest.raises(TypeError, match="filter must be"):
        alloc.begin_allocate_to_pool(pool.id, bad)
    assert pool.use_count() == 1
    assert alloc._pool_info(pool.id)["routed"] is False


def test_releasing_an_unknown_pool_is_a_value_error():
    _, alloc = make()
    with pytest.raises(ValueError, match="not a live private pool"):
        alloc.release_pool((0, 999999))


def test_use_mem_pool_refuses_a_pool_of_another_allocator():
    _, alloc = make()
    _, other = make()
    with pytest.raises(ValueError, match="not a MemPool of this allocator"):
        alloc.use_mem_pool(other.mem_pool())


def test_mempool_flags_must_be_bools():
    _, alloc = make()
    with pytest.raises(TypeError, match="use_on_oom must be a bool"):
        alloc.mem_pool(use_on_oom=1)


# ------------------------------------------------------------------------------- release

def test_releasing_an_empty_pool_frees_its_cached_segments_and_the_pool():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.free(alloc.malloc(4 * KiB))
    assert alloc.memory_reserved() == 2 * MiB
    pool.release()
    assert alloc.memory_reserved() == 0
    assert alloc._pool_info(pool.id) is None


def test_a_released_pool_keeps_live_blocks_until_they_are_freed_and_emptied():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
    pool.release()
    info = alloc._pool_info(pool.id)
    assert info["use_count"] == 0 and info["reserved_bytes"] == 2 * MiB
    alloc.free(ptr)
    assert alloc.memory_reserved() == 2 * MiB        # freeable, but not emptied yet
    alloc.empty_cache()
    assert alloc.memory_reserved() == 0 and alloc._pool_info(pool.id) is None


def test_empty_cache_does_not_free_a_live_pools_cached_blocks():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.free(alloc.malloc(4 * KiB))
    alloc.empty_cache()
    assert pool.memory_reserved() == 2 * MiB


def test_a_collected_mempool_is_released():
    _, alloc = make()
    pool = alloc.mem_pool()
    pool_id = pool.id
    with alloc.use_mem_pool(pool):
        alloc.free(alloc.malloc(4 * KiB))
    del pool
    gc.collect()
    assert alloc._pool_info(pool_id) is None and alloc.memory_reserved() == 0


def test_releasing_twice_does_nothing_more():
    _, alloc = make()
    pool = alloc.mem_pool()
    pool.release()
    pool.release()
    assert pool.use_count() == 0


# ------------------------------------------------------------------------------- empty_cache, OOM

def test_empty_cache_inside_a_route_leaves_the_default_pools_alone():
    _, alloc = make()
    alloc.free(alloc.malloc(4 * KiB))              # a cached default-pool segment
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.empty_cache()                         # no error (#158152)
        assert alloc.memory_reserved() == 2 * MiB
    alloc.empty_cache()
    assert alloc.memory_reserved() == 0


def test_empty_cache_inside_a_route_still_frees_freeable_pools():
    _, alloc = make()
    old = alloc.mem_pool()
    with alloc.use_mem_pool(old):
        alloc.free(alloc.malloc(4 * KiB))
    old.use_count()
    alloc.release_pool(old.id)                      # freeable, cached 2 MiB
    old._released = True
    with alloc.use_mem_pool(alloc.mem_pool()):
        alloc.empty_cache()
    assert alloc._pool_info(old.id) is None


def test_oom_inside_a_route_does_not_flush_the_default_pools():
    _, alloc = make(total_memory=4 * MiB)
    cached = alloc.malloc(512 * KiB)
    alloc.free(cached)                              # the default pool caches a 2 MiB segment
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.malloc(1 * MiB)                       # the pool's own 2 MiB segment: 4 MiB in use
        alloc.malloc(1 * MiB)
        with pytest.raises(OutOfMemoryError):
            alloc.malloc(1 * MiB)                   # needs a segment; the flush is skipped
    assert alloc.memory_stats()["num_alloc_retries"] == 0
    assert alloc.malloc(512 * KiB) == cached        # the default pool kept its segment


def test_oom_outside_routes_flushes_and_retries():
    _, alloc = make(total_memory=20 * MiB)
    alloc.free(alloc.malloc(3 * MiB))               # a cached 20 MiB large segment
    alloc.malloc(4 * KiB)                           # a small segment fits only after the flush
    assert alloc.memory_stats()["num_alloc_retries"] == 1


def test_use_on_oom_pool_serves_a_default_request_from_its_cache():
    _, alloc = make(total_memory=2 * MiB)
    pool = alloc.mem_pool(use_on_oom=True)
    with alloc.use_mem_pool(pool):
        cached = alloc.malloc(4 * KiB)
        alloc.free(cached)
    assert alloc.malloc(4 * KiB) == cached         # no memory left for a default segment


def test_a_pool_without_use_on_oom_does_not_serve_default_requests():
    _, alloc = make(total_memory=2 * MiB)
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.free(alloc.malloc(4 * KiB))
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(4 * KiB)


def test_released_pool_loses_use_on_oom():
    _, alloc = make(total_memory=2 * MiB)
    pool = alloc.mem_pool(use_on_oom=True)
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
    pool.release()
    alloc.free(ptr)       # the pool is freeable; the OOM flush frees its segment for the default pool
    assert pool_of(alloc, alloc.malloc(4 * KiB)) == (0, 0)


def test_oom_message_reports_bytes_cached_in_private_pools():
    _, alloc = make(total_memory=4 * MiB)
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.free(alloc.malloc(4 * KiB))           # 2 MiB cached in the pool
    alloc.malloc(4 * KiB)                            # the default pool's 2 MiB
    with pytest.raises(OutOfMemoryError) as err:
        alloc.malloc(2 * MiB)
    text = str(err.value)
    assert "with 2.00 MiB allocated in private pools (e.g., CUDA Graphs)" in text
    assert "Of the allocated memory 2.00 MiB is allocated by pyalloc" in text
    # reserved 4 MiB - allocated 4 KiB - 2 MiB cached in the pool
    assert err.value.reserved_unallocated == 4 * MiB - 4 * KiB - 2 * MiB


def test_oom_message_hint_names_expandable_segments_and_tune():
    _, alloc = make(total_memory=2 * MiB)
    with pytest.raises(OutOfMemoryError) as err:
        alloc.malloc(4 * MiB)
    assert "expandable_segments:True" in str(err.value)
    assert "pyalloc tune" in str(err.value)


# ------------------------------------------------------------------------------- no_split

def test_no_split_pool_hands_out_whole_blocks():
    _, alloc = make()
    pool = alloc.mem_pool(no_split=True)
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
    seg = [s for s in alloc._segments() if s["pool_id"] == pool.id][0]
    assert [b["size"] for b in seg["blocks"]] == [2 * MiB]
    assert alloc.memory_stats()["inactive_split.all.current"] == 0
    alloc.free(ptr)


def test_a_splitting_pool_splits_as_the_default_pool_does():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.malloc(4 * KiB)
    seg = [s for s in alloc._segments() if s["pool_id"] == pool.id][0]
    assert [b["size"] for b in seg["blocks"]] == [4 * KiB, 2 * MiB - 4 * KiB]


# ------------------------------------------------------------------------------- streams in routes

def test_a_record_stream_free_inside_a_route_waits_until_the_route_ends():
    sim, alloc = make()
    side = sim.create_stream()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
        alloc.record_stream(ptr, side)
        alloc.free(ptr)
        assert alloc.malloc(4 * KiB) != ptr         # deferred: no events while routing
        assert alloc.memory_stats()["active_bytes.all.current"] == 8 * KiB
    alloc.malloc(1)                                 # no route: the deferred block gets its event
    assert alloc.memory_stats()["active.all.current"] == 2   # side's event completed at once
    alloc._check_invariants()


# ------------------------------------------------------------------------------- observability

def test_snapshot_segments_carry_their_pool_id():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.malloc(4 * KiB)
    alloc.malloc(4 * KiB)
    ids = sorted(tuple(s["segment_pool_id"]) for s in alloc.snapshot()["segments"])
    assert ids == sorted([(0, 0), pool.id])


def test_mempool_snapshot_holds_only_its_segments():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
    alloc.malloc(4 * KiB)
    segments = pool.snapshot()
    assert len(segments) == 1 and segments[0]["blocks"][0]["address"] == ptr


def test_private_pools_count_in_memory_stats_by_size_class():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.malloc(4 * KiB)
        alloc.malloc(3 * MiB)
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] == 4 * KiB
    assert stats["allocated_bytes.large_pool.current"] == 3 * MiB
    assert stats["reserved_bytes.all.current"] == 2 * MiB + 20 * MiB
    alloc._check_invariants()


def test_private_pool_bytes_reports_reserved_and_cached():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(4 * KiB)
        alloc.free(alloc.malloc(3 * MiB))
    assert alloc.private_pool_bytes() == (22 * MiB, 2 * MiB - 4 * KiB + 20 * MiB)
    alloc.free(ptr)


def test_memory_summary_reports_private_pools():
    _, alloc = make()
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        alloc.malloc(4 * KiB)
    assert "Private pools" in alloc.memory_summary()


# ------------------------------------------------------------------------------- expandable segments

def test_expandable_segments_grow_inside_a_private_pool():
    _, alloc = make("expandable_segments:True")
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        ptr = alloc.malloc(3 * MiB)
    assert pool_of(alloc, ptr) == pool.id
    assert pool.memory_reserved() == 20 * MiB
    alloc.free(ptr)
    pool.release()
    assert alloc.memory_reserved() == 0 and alloc._pool_info(pool.id) is None


# ------------------------------------------------------------------------------- module level

def test_module_level_mempool_lives_on_the_default_allocator():
    pyalloc.set_default_backend("sim")
    pool = pyalloc.MemPool()
    with pyalloc.use_mem_pool(pool):
        ptr = pyalloc.malloc(4 * KiB)
    assert pool.allocator is pyalloc.get_allocator()
    assert pool_of(pool.allocator, ptr) == pool.id
    pyalloc.free(ptr)
    pool.release()


def test_module_level_use_mem_pool_refuses_another_device():
    pyalloc.set_default_backend("sim")
    pool = pyalloc.MemPool(device=0)
    with pytest.raises(ValueError, match="belongs to device 0, not device 1"):
        with pyalloc.use_mem_pool(pool, device=1):
            pass
    pool.release()


def test_cupy_use_mem_pool_needs_cupy_and_pyalloc_as_its_allocator():
    import importlib.util
    import pyalloc.cupy
    pyalloc.set_default_backend("sim")
    pool = pyalloc.MemPool()
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(ImportError, match="pyalloc.cupy needs CuPy"):
            pyalloc.cupy.use_mem_pool(pool)
    else:
        with pytest.raises(RuntimeError, match="pyalloc.cupy.install"):
            pyalloc.cupy.use_mem_pool(pool)
    pool.release()
