"""Specification of the pinned host allocator during CUDA-graph capture, on the simulated device.

PyTorch 2.13's rule (aten/src/ATen/core/CachingHostAllocator.h, was_allocated_during_stream_capture_;
aten/src/ATen/cuda/CachingHostAllocator.cpp, query_event): a block handed out while the allocating
stream captures is marked; its free records no event (an event recorded in a capture marks no real
completion, and querying one breaks the capture), so with record_event streams it is kept for good
(the graph may replay its copies at any time) and without them it goes back to its free list; an
allocation on a capturing stream queries no event. pyalloc also treats as captured a block that
record_event tied to a capturing stream, or that is freed while such a stream captures
(docs/differences.md). malloc's `stream` argument stands for PyTorch's current stream. A copy is
`h.host.copy(stream, ptr, nbytes)`: during a capture it becomes a graph node that uses the block.
"""
import pytest


def captured_copy_freed(dev, host, s):
    """A 4 KiB block handed out on capturing stream `s`, copied in the capture, tied to `s` by
    record_event and freed there; the capture is ended. Returns the block's address."""
    dev.begin_capture(s)
    p = host.malloc(4096, s)
    host.host.copy(s, p, 4096)
    host.record_event(p, s)
    host.free(p)
    dev.end_capture(s)
    return p


def event_calls(dev):
    return {k: dev.counters[k] for k in ("event_create", "event_record", "event_query")}


def test_a_block_used_by_a_capture_is_never_handed_out_again(dev, host):
    p = captured_copy_freed(dev, host, dev.create_stream())
    dev.synchronize()
    assert host.malloc(4096) != p


def test_a_block_used_by_a_capture_is_kept_in_the_captured_state(dev, host):
    p = captured_copy_freed(dev, host, dev.create_stream())
    assert host.block_list() == [(p, 4096, "captured")]


def test_freeing_a_block_used_by_a_capture_makes_no_event_call(dev, host):
    s = dev.create_stream()
    dev.begin_capture(s)
    p = host.malloc(4096, s)
    host.host.copy(s, p, 4096)
    host.record_event(p, s)
    before = event_calls(dev)
    host.free(p)
    assert event_calls(dev) == before


def test_the_capture_stays_valid_after_a_block_used_in_it_is_freed(dev, host):
    s = dev.create_stream()
    dev.begin_capture(s)
    p = host.malloc(4096, s)
    host.host.copy(s, p, 4096)
    host.record_event(p, s)
    host.free(p)
    assert dev.end_capture(s)


def test_a_block_handed_out_in_a_capture_without_record_event_is_reused(dev, host):
    s = dev.create_stream()
    dev.begin_capture(s)
    p = host.malloc(4096, s)
    host.free(p)
    assert host.malloc(4096, s) == p


def test_a_malloc_on_a_capturing_stream_queries_no_event(dev, host):
    side, s = dev.create_stream(), dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, side)
    host.free(p)                            # an event waits in the queue
    dev.begin_capture(s)
    before = dev.counters["event_query"]
    host.malloc(4096, s)
    assert dev.counters["event_query"] == before


def test_a_malloc_on_a_capturing_stream_keeps_the_capture_valid(dev, host):
    side, s = dev.create_stream(), dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, side)
    host.free(p)
    dev.begin_capture(s)
    host.malloc(4096, s)
    assert dev.end_capture(s)


def test_a_malloc_on_a_capturing_stream_does_not_reuse_a_block_waiting_for_events(dev, host):
    side, s = dev.create_stream(), dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, side)
    host.free(p)
    dev.complete(side)                      # done, but nobody may ask during the capture
    dev.begin_capture(s)
    assert host.malloc(4096, s) != p


def test_malloc_takes_a_stream_object(dev, host):
    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr
    s = dev.create_stream()
    dev.begin_capture(s)
    p = host.malloc(4096, Stream(s))
    host.record_event(p, s)
    host.free(p)
    assert host.block_list() == [(p, 4096, "captured")]


def test_record_event_on_a_capturing_stream_keeps_a_block_handed_out_before(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    dev.begin_capture(s)
    host.host.copy(s, p, 4096)
    host.record_event(p, s)
    before = event_calls(dev)
    host.free(p)
    assert (host.block_list(), event_calls(dev)) == ([(p, 4096, "captured")], before)


def test_a_block_freed_while_its_recorded_stream_captures_gets_no_event(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.record_event(p, s)
    dev.begin_capture(s)
    before = event_calls(dev)
    host.free(p)
    assert (host.block_list(), event_calls(dev)) == ([(p, 4096, "captured")], before)


def test_a_block_handed_out_after_the_capture_is_no_longer_marked(dev, host):
    s, side = dev.create_stream(), dev.create_stream()
    dev.begin_capture(s)
    p = host.malloc(4096, s)
    host.free(p)
    dev.end_capture(s)
    assert host.malloc(4096) == p
    host.record_event(p, side)
    host.free(p)
    assert host.block_list() == [(p, 4096, "pending")]


def test_a_kept_captured_block_still_counts_as_an_active_request(dev, host):
    captured_copy_freed(dev, host, dev.create_stream())
    s = host.stats()
    assert (s["active_requests"]["current"], s["active_bytes"]["current"]) == (1, 4096)


def test_empty_cache_keeps_a_captured_block(dev, host):
    p = captured_copy_freed(dev, host, dev.create_stream())
    host.empty_cache()
    assert host.block_list() == [(p, 4096, "captured")]


def test_a_replayed_graph_never_sees_its_block_handed_out(dev, host):
    s = dev.create_stream()
    dev.begin_capture(s)
    p = host.malloc(4096, s)
    host.host.copy(s, p, 4096)
    host.record_event(p, s)
    host.free(p)
    graph = dev.end_capture(s)
    dev.launch_graph(graph, s)              # queued: the sanitizer refuses any handout of p
    assert host.malloc(4096) != p


def test_malloc_refuses_a_destroyed_stream_naming_it(dev, host):
    s = dev.create_stream()
    dev.destroy_stream(s)
    with pytest.raises(ValueError, match=f"stream {s:#x} was destroyed"):
        host.malloc(4096, s)


def test_close_refuses_while_a_block_is_kept_for_a_graph(dev, host):
    captured_copy_freed(dev, host, dev.create_stream())
    with pytest.raises(RuntimeError, match="kept for a CUDA graph"):
        host.close()
