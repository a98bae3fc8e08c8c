"""Specification of the caching host (pinned) allocator, pyalloc.host.HostAllocator, on the
simulated device: PyTorch's CachingHostAllocator rules (power-of-two blocks, a free list per size,
record_event, empty_cache of idle blocks only), its host_memory_stats keys (PyTorch 2.13's), each pinned_* setting,
failures and bad input."""
import sys
import time

import pytest

import pyalloc
from pyalloc.host import HostAllocator

from units import KiB, MiB


def blocks_in(h, state):
    return [b for b in h.block_list() if b[2] == state]


# ------------------------------------------------------------------ sizes and free lists

@pytest.mark.parametrize("request_bytes", [1, 3, 4097, 1000000, 3 * MiB + 1])
def test_a_block_is_the_request_rounded_up_to_a_power_of_two(host, request_bytes):
    ptr = host.malloc(request_bytes)
    size = host.block_size(ptr)
    assert size >= request_bytes and size & (size - 1) == 0 and size // 2 < request_bytes


def test_zero_bytes_gives_the_null_pointer_and_no_block(host):
    assert host.malloc(0) == 0 and host.block_list() == []


def test_a_freed_block_serves_the_next_request_of_its_power_of_two(host):
    p = host.malloc(5000)
    host.free(p)
    assert host.malloc(8192) == p


def test_a_freed_block_does_not_serve_another_power_of_two(host):
    p = host.malloc(8192)
    host.free(p)
    assert host.malloc(4096) != p


def test_the_most_recently_freed_block_of_a_size_is_handed_out_first(host):
    a, b = host.malloc(4096), host.malloc(4096)
    host.free(a)
    host.free(b)
    assert host.malloc(4096) == b


def test_a_cache_hit_makes_no_host_call(host):
    host.free(host.malloc(MiB))
    before = dict(host.host.counters)
    host.free(host.malloc(MiB))
    assert host.host.counters == before


def test_blocks_are_never_split(host):
    host.free(host.malloc(MiB))
    host.malloc(4096)
    assert len(host.block_list()) == 2


# ------------------------------------------------------------------ the event rule

def freed_behind_a_queued_copy(dev, host, record=True):
    """(stream, pointer) of a 4 KiB block freed while a copy that uses it is queued on a new
    stream, with record_event(p, stream) before the free unless `record` is False."""
    s = dev.create_stream()
    p = host.malloc(4096)
    host.host.copy(s, p, 4096)
    if record:
        host.record_event(p, s)
    host.free(p)
    return s, p


def test_a_block_with_a_recorded_stream_is_not_reused_while_its_copy_is_queued(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host)
    assert host.malloc(4096) != p


def test_a_recorded_block_is_reused_once_its_stream_passed_the_free(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host)
    dev.complete(s)
    assert host.malloc(4096) == p


def test_a_block_recorded_on_two_streams_waits_for_both(dev, host):
    s1, s2 = dev.create_stream(), dev.create_stream()
    p = host.malloc(4096)
    host.host.copy(s1, p, 4096)
    host.host.copy(s2, p, 4096)
    host.record_event(p, s1)
    host.record_event(p, s2)
    host.free(p)
    dev.complete(s1)
    assert host.malloc(4096) != p


def test_a_freed_block_waiting_for_events_is_pending(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host)
    assert blocks_in(host, "pending") == [(p, 4096, "pending")]


def test_without_record_event_the_sanitizer_catches_reuse_during_a_queued_copy(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host, record=False)
    with pytest.raises(pyalloc.ReuseError):
        host.malloc(4096)


def test_the_sanitizer_refusal_leaves_the_block_in_its_free_list(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host, record=False)
    with pytest.raises(pyalloc.ReuseError):
        host.malloc(4096)
    assert host.free_list_sizes() == {4096: 1}


def test_recording_the_same_stream_twice_records_one_event(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    host.record_event(p, s)
    host.free(p)
    assert host.pending_events == 1


def test_record_event_takes_a_stream_object(dev, host):
    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr
    s = dev.create_stream()
    p = host.malloc(4096)
    host.host.copy(s, p, 4096)
    host.record_event(p, Stream(s))
    host.free(p)
    assert host.malloc(4096) != p


def test_completed_events_go_back_to_a_pool_and_are_reused(dev, host):
    s = dev.create_stream()
    for _ in range(3):
        p = host.malloc(4096)
        host.record_event(p, s)
        host.free(p)
        dev.complete(s)
    assert dev.counters["event_create"] == 1


# ------------------------------------------------------------------ empty_cache

def test_empty_cache_frees_idle_blocks(host):
    host.free(host.malloc(4096))
    host.empty_cache()
    assert host.block_list() == [] and host.host.allocations() == []


def test_empty_cache_keeps_blocks_in_use(host):
    p = host.malloc(4096)
    host.empty_cache()
    assert host.block_list() == [(p, 4096, "allocated")]


def test_empty_cache_keeps_blocks_waiting_for_events(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host)
    host.empty_cache()
    assert host.block_list() == [(p, 4096, "pending")]


def test_empty_cache_frees_blocks_whose_events_completed(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    host.free(p)
    dev.complete(s)
    host.empty_cache()
    assert host.block_list() == []


# ------------------------------------------------------------------ statistics

def test_stats_have_torchs_host_memory_stats_keys(host):
    # PyTorch 2.13's HostStats as torch.cuda.host_memory_stats() flattens it.
    stat = ["allocated", "current", "freed", "peak"]
    duration = ["avg", "count", "max", "min", "total"]
    expected = sorted([f"{k}.{m}" for k in ("active_requests", "active_bytes", "allocations",
                                             "allocated_bytes") for m in stat] +
                      [f"{k}.{m}" for k in ("host_alloc_time", "host_free_time") for m in duration] +
                      ["num_host_alloc", "num_host_free"])
    assert list(host.host_memory_stats()) == expected


def test_active_bytes_count_blocks_handed_out_at_their_rounded_size(host):
    host.malloc(3000)
    host.malloc(5000)
    s = host.stats()
    assert (s["active_bytes"]["current"], s["active_requests"]["current"]) == (4096 + 8192, 2)


def test_a_freed_block_leaves_active_but_stays_allocated(host):
    host.free(host.malloc(3000))
    s = host.stats()
    assert (s["active_bytes"]["current"], s["allocated_bytes"]["current"],
            s["allocations"]["current"]) == (0, 4096, 1)


def test_a_block_waiting_for_events_still_counts_as_active(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    host.free(p)
    assert host.stats()["active_requests"]["current"] == 1


def test_a_block_stops_being_active_when_its_events_complete(dev, host):
    s, p = freed_behind_a_queued_copy(dev, host)
    dev.complete(s)
    host.poll_events()
    assert host.stats()["active_requests"]["current"] == 0


def test_a_cache_hit_counts_an_active_request_but_no_allocation(host):
    host.free(host.malloc(4096))
    host.malloc(4096)
    s = host.stats()
    assert (s["active_requests"]["allocated"], s["allocations"]["allocated"]) == (2, 1)


def test_empty_cache_lowers_allocations_and_allocated_bytes(host):
    host.free(host.malloc(4096))
    host.empty_cache()
    s = host.stats()
    assert (s["allocations"]["current"], s["allocations"]["freed"],
            s["allocated_bytes"]["freed"]) == (0, 1, 4096)


def test_peak_of_allocated_bytes_counts_cached_blocks(host):
    host.free(host.malloc(4096))
    host.free(host.malloc(MiB))
    assert host.stats()["allocated_bytes"]["peak"] == 4096 + MiB


def test_num_host_alloc_and_free_count_driver_blocks(host):
    a, b = host.malloc(4096), host.malloc(MiB)
    host.free(a)
    host.free(b)
    host.free(host.malloc(4096))          # a hit
    host.empty_cache()
    s = host.stats()
    assert (s["num_host_alloc"], s["num_host_free"]) == (2, 2)


def test_host_alloc_time_counts_driver_calls_only(host):
    host.free(host.malloc(4096))
    host.free(host.malloc(4096))
    assert host.stats()["host_alloc_time"]["count"] == 1


def test_host_free_time_counts_each_block_given_back(host):
    host.free(host.malloc(4096))
    host.free(host.malloc(MiB))
    host.empty_cache()
    assert host.stats()["host_free_time"]["count"] == 2


def test_peak_of_active_bytes_is_the_largest_in_use(host):
    a, b = host.malloc(4096), host.malloc(4096)
    host.free(a)
    host.free(b)
    assert host.stats()["active_bytes"]["peak"] == 8192


def test_reset_peak_stats_sets_peaks_to_current(host):
    a = host.malloc(4096)
    host.free(host.malloc(4096))
    host.reset_peak_stats()
    assert host.stats()["active_bytes"]["peak"] == 4096 and a


def test_reset_accumulated_stats_zeroes_totals(host):
    host.free(host.malloc(4096))
    host.reset_accumulated_stats()
    s = host.stats()
    assert (s["active_requests"]["allocated"], s["active_requests"]["freed"],
            s["num_host_alloc"], s["host_alloc_time"]["count"]) == (0, 0, 0, 0)


# ------------------------------------------------------------------ settings

def test_by_default_memory_comes_from_cumemhostalloc(host):
    host.malloc(4096)
    assert [k for _, _, k in host.host.allocations()] == ["pinned"]


def test_register_setting_allocates_pageable_memory_and_registers_it(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True")
    p = h.malloc(MiB)
    assert (h.host.allocations(), h.host.registrations()) == ([(p, MiB, "pageable")], [(p, MiB)])


def test_register_setting_unregisters_and_frees_at_empty_cache(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True")
    h.free(h.malloc(MiB))
    h.empty_cache()
    assert (h.host.allocations(), h.host.registrations()) == ([], [])


def test_register_threads_touch_the_pages_of_a_large_block(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    p = h.malloc(MiB)
    assert h.host.touches == [(p, MiB, 8)]


def test_register_threads_touch_a_block_smaller_than_a_page_each_in_one_thread(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    p = h.malloc(16 * KiB)
    assert h.host.touches == [(p, 16 * KiB, 1)]


def test_reserve_segment_is_one_allocation_carved_into_blocks(dev):
    h = HostAllocator(dev, config="pinned_reserve_segment_size_mb:1")
    a, b = h.malloc(4096), h.malloc(100)
    assert (len(h.host.allocations()), b - a) == (1, 4096)


def test_a_block_that_does_not_fit_in_the_reserve_segment_gets_its_own(dev):
    h = HostAllocator(dev, config="pinned_reserve_segment_size_mb:1")
    h.malloc(4096)
    h.malloc(2 * MiB)
    assert sorted(n for _, n, _ in h.host.allocations()) == [MiB, 2 * MiB]


def test_reserve_segment_blocks_are_never_given_back(dev):
    h = HostAllocator(dev, config="pinned_reserve_segment_size_mb:1")
    h.free(h.malloc(4096))
    h.empty_cache()
    assert (len(h.host.allocations()), h.host.counters["host_free"]) == (1, 0)


def test_reserve_segment_blocks_count_as_host_allocations(dev):
    h = HostAllocator(dev, config="pinned_reserve_segment_size_mb:1")
    h.malloc(4096)
    s = h.stats()
    assert (s["num_host_alloc"], s["host_alloc_time"]["count"]) == (1, 1)


def queries_of_one_hit(dev, h):
    """Event queries made while this thread does one cache-hit malloc + free of 8 KiB, with one
    freed block's event left pending (its copy stays queued). The polling thread queries too, so
    it is kept off the GIL meanwhile: it runs Python between its polls, and this thread gives the
    GIL up neither on a hit nor within a long switch interval."""
    s = dev.create_stream()
    p = h.malloc(4096)
    h.host.copy(s, p, 4096)
    h.record_event(p, s)
    h.free(p)
    h.free(h.malloc(8192))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        # A sleep gives the GIL up once, so that a switch the polling thread asked for under the
        # old interval happens now; from its next sleep on it waits 60 s before asking again.
        time.sleep(0.001)
        queries = dev.counters["event_query"]
        h.free(h.malloc(8192))
        return dev.counters["event_query"] - queries
    finally:
        sys.setswitchinterval(interval)


def test_background_threads_setting_leaves_events_to_the_thread_on_a_hit(dev):
    h = HostAllocator(dev, config="pinned_use_background_threads:True")
    assert queries_of_one_hit(dev, h) == 0


def test_without_background_threads_a_hit_queries_the_pending_event(dev):
    assert queries_of_one_hit(dev, HostAllocator(dev)) > 0


def test_background_thread_returns_completed_blocks_to_their_free_list(dev):
    h = HostAllocator(dev, config="pinned_use_background_threads:True")
    s = dev.create_stream()
    h.malloc(64)                            # a miss starts the thread
    p = h.malloc(4096)
    h.record_event(p, s)
    h.free(p)
    dev.complete(s)
    deadline = time.monotonic() + 30
    while h.pending_events and time.monotonic() < deadline:
        time.sleep(0.001)
    assert h.free_list_sizes() == {4096: 1}


def test_an_error_in_the_polling_thread_is_raised_by_the_next_malloc(dev):
    h = HostAllocator(dev, config="pinned_use_background_threads:True")
    s = dev.create_stream()
    h.malloc(64)                            # a miss starts the thread
    p = h.malloc(4096)
    h.record_event(p, s)
    dev.fail_next("event_query")
    h.free(p)
    deadline = time.monotonic() + 30
    while h.background_error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="polling pinned blocks' events stopped") as info:
        h.malloc(64)
    assert info.value.__cause__ is not None
    assert h.background_error is None
    h.malloc(1 << 20)                        # a miss: polling starts again and collects p's event
    deadline = time.monotonic() + 30
    while h.pending_events and time.monotonic() < deadline:
        time.sleep(0.001)
    assert h.free_list_sizes().get(4096) == 1


def test_without_background_threads_each_allocation_collects_events_first(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    host.free(p)
    dev.complete(s)
    host.malloc(8192)
    assert host.pending_events == 0


def test_background_threads_on_a_miss_collect_events_of_the_requested_size(dev):
    h = HostAllocator(dev, config="pinned_use_background_threads:True")
    s = dev.create_stream()
    p = h.malloc(4096)
    h.record_event(p, s)
    h.free(p)
    dev.complete(s)
    assert h.malloc(4096) == p


# ------------------------------------------------------------------ failures

def test_a_failed_host_alloc_raises_cuda_error_and_changes_nothing(host):
    before = host.host_memory_stats()
    host.host.fail_next("cuMemHostAlloc")
    with pytest.raises(pyalloc.CudaError, match="cuMemHostAlloc"):
        host.malloc(4096)
    assert host.host_memory_stats() == before and host.block_list() == []


def test_a_failed_register_frees_the_pageable_memory(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True")
    h.host.fail_next("cuMemHostRegister")
    with pytest.raises(pyalloc.CudaError, match="cuMemHostRegister"):
        h.malloc(4096)
    assert (h.host.allocations(), h.block_list()) == ([], [])


def test_host_memory_beyond_capacity_raises_out_of_memory_from_the_driver(dev):
    from pyalloc._sim_host import SimHost
    h = HostAllocator(dev, config="", host=SimHost(dev, 64 * KiB))
    with pytest.raises(pyalloc.CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        h.malloc(128 * KiB)


def test_a_failed_event_record_at_free_leaves_the_block_allocated(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    dev.fail_next("event_record")
    with pytest.raises(pyalloc.CudaError):
        host.free(p)
    assert host.block_list() == [(p, 4096, "allocated")]


def test_a_free_that_failed_can_be_retried(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    dev.fail_next("event_record")
    with pytest.raises(pyalloc.CudaError):
        host.free(p)
    host.free(p)
    assert host.pending_events == 1


def test_a_failed_host_free_keeps_the_block_cached(host):
    p = host.malloc(4096)
    host.free(p)
    host.host.fail_next("cuMemFreeHost")
    with pytest.raises(pyalloc.CudaError):
        host.empty_cache()
    assert host.block_list() == [(p, 4096, "free")]


def test_a_failed_event_query_leaves_the_event_queued(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    host.free(p)
    dev.fail_next("event_query")
    with pytest.raises(pyalloc.CudaError):
        host.malloc(64)
    assert host.pending_events == 1


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), ("4096", TypeError)])
def test_a_bad_size_raises_naming_it(host, bad, error):
    with pytest.raises(error, match="size"):
        host.malloc(bad)


def test_freeing_an_unknown_pointer_raises_not_allocated(host):
    with pytest.raises(pyalloc.NotAllocatedError, match="0x1234"):
        host.free(0x1234)


def test_a_double_free_raises_already_freed(host):
    p = host.malloc(4096)
    host.free(p)
    with pytest.raises(pyalloc.AlreadyFreedError):
        host.free(p)


def test_a_double_free_leaves_the_free_list(host):
    p = host.malloc(4096)
    host.free(p)
    with pytest.raises(pyalloc.AlreadyFreedError):
        host.free(p)
    assert host.free_list_sizes() == {4096: 1}


def test_record_event_on_an_unknown_pointer_raises(host):
    with pytest.raises(pyalloc.NotAllocatedError):
        host.record_event(0x1234, 0)


def test_record_event_on_a_destroyed_stream_raises_and_records_nothing(dev, host):
    s = dev.create_stream()
    dev.destroy_stream(s)
    p = host.malloc(4096)
    with pytest.raises(ValueError, match="destroyed"):
        host.record_event(p, s)
    host.free(p)
    assert host.pending_events == 0


def test_record_event_with_a_bad_stream_raises_type_error(host):
    p = host.malloc(4096)
    with pytest.raises(TypeError, match="stream"):
        host.record_event(p, 1.5)


def test_free_of_the_null_pointer_does_nothing(host):
    host.free(0)
    assert host.block_list() == []


def test_close_refuses_while_a_block_is_in_use(host):
    host.malloc(4096)
    with pytest.raises(RuntimeError, match="in use"):
        host.close()


def test_close_frees_every_cached_block(host):
    host.free(host.malloc(4096))
    host.close()
    assert host.host.allocations() == []


# ------------------------------------------------------------------ module level

def test_module_level_host_memory_stats_is_empty_before_first_use():
    import pyalloc.host as h
    if h._default is not None:
        pytest.skip("the process-wide host allocator was used by an earlier test")
    assert pyalloc.host_memory_stats() == {}


def test_module_level_functions_act_on_the_process_wide_host_allocator(monkeypatch):
    import pyalloc.host as h
    monkeypatch.setattr(h, "_default", HostAllocator(pyalloc.SimDevice(), config=""))
    h._default.free(h._default.malloc(4096))
    pyalloc.empty_host_cache()
    assert pyalloc.host_memory_stats()["num_host_free"] == 1


def test_a_block_unregistered_whose_free_failed_is_not_handed_out_again(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True")
    p = h.malloc(4096)
    h.free(p)
    h.host.fail_next("host_mfree")
    with pytest.raises(pyalloc.CudaError):
        h.empty_cache()
    assert h.block_list() == [] and h.malloc(4096) != p


def test_a_failed_unregister_keeps_the_block_cached_and_registered(dev):
    h = HostAllocator(dev, config="pinned_use_cuda_host_register:True")
    p = h.malloc(4096)
    h.free(p)
    h.host.fail_next("cuMemHostUnregister")
    with pytest.raises(pyalloc.CudaError):
        h.empty_cache()
    assert (h.block_list(), h.host.registrations()) == ([(p, 4096, "free")], [(p, 4096)])


def test_set_default_backend_drops_an_idle_process_wide_host_allocator(monkeypatch):
    import pyalloc.host as h
    monkeypatch.setattr(h, "_default", HostAllocator(pyalloc.SimDevice(), config=""))
    h._default.free(h._default.malloc(4096))
    pyalloc.set_default_backend(pyalloc.get_default_backend())
    assert h._default is None


def test_set_default_backend_keeps_a_process_wide_host_allocator_in_use(monkeypatch):
    import pyalloc.host as h
    monkeypatch.setattr(h, "_default", HostAllocator(pyalloc.SimDevice(), config=""))
    h._default.malloc(4096)
    pyalloc.set_default_backend(pyalloc.get_default_backend())
    assert h._default is not None


def test_two_threads_allocating_and_freeing_leave_consistent_statistics(dev):
    import threading
    h = HostAllocator(dev, config="")
    sizes = [100, 4096, 5000, 70000]

    def work(seed):
        live = []
        for i in range(3000):
            if live and (i * seed) % 3 == 0:
                h.free(live.pop())
            else:
                live.append(h.malloc(sizes[(i + seed) % len(sizes)]))
        for p in live:
            h.free(p)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = h.stats()
    blocks = h.block_list()
    assert (s["active_requests"]["current"], s["allocations"]["current"]) == (0, len(blocks))
