"""The reuse sanitizer of the simulated device (SimDevice(check_reuse=True)), one behaviour per test.

With it on, SimDevice records every use a kernel queues (`launch(stream, count, uses)`, graph
launches) or a live capture holds, and check_handout (the allocator's call for every block it
hands out; `check_reuse` from Python) raises ReuseError when a block may still be used by work
that is not ordered before the receiving stream's next work.
"""
import pytest

from pyalloc import CachingAllocator, SimDevice
from pyalloc.errors import ReuseError

from units import KiB, MiB
P = 0x10000          # an address the tests' kernels use; the sanitizer never dereferences it
N = 4 * KiB


def device():
    sim = SimDevice(check_reuse=True)
    return sim, sim.create_stream(), sim.create_stream(), sim.create_stream()


def sanitized_allocator():
    """A CachingAllocator on a SimDevice with the sanitizer on, and two streams of that device."""
    sim = SimDevice(check_reuse=True)
    return sim, CachingAllocator(backend=sim, config=""), sim.create_stream(), sim.create_stream()


def join(sim, into, frm):
    """`into`'s later work waits for the work queued on `frm` so far."""
    sim.wait_event(into, sim.record_event(frm))


# ------------------------------------------------------------------------------- queued uses

def test_a_use_on_the_receiving_stream_is_ordered():
    sim, s1, _, _ = device()
    sim.launch(s1, uses=[(P, N)])
    sim.check_reuse(P, N, s1)


def test_a_use_on_another_stream_with_no_wait_is_flagged():
    sim, s1, s2, _ = device()
    sim.launch(s1, uses=[(P, N)])
    with pytest.raises(ReuseError):
        sim.check_reuse(P, N, s2)


def test_the_error_names_the_block_the_streams_and_the_launch():
    sim, s1, s2, _ = device()
    sim.launch(s2)
    sim.launch(s1, 3, uses=[(P, N)])           # the second launch
    with pytest.raises(ReuseError) as info:
        sim.check_reuse(P + 16, 64, s2)
    err = info.value
    assert (err.ptr, err.nbytes, err.stream, err.use_stream) == (P + 16, 64, s2, s1)
    assert err.operation == f"launch #2 on stream {s1}"
    assert f"{P + 16:#x} (+64 bytes)" in str(err) and f"stream {s2}" in str(err)
    assert f"launch #2 on stream {s1}" in str(err)


def test_a_use_that_does_not_overlap_the_block_is_not_flagged():
    sim, s1, s2, _ = device()
    sim.launch(s1, uses=[(P, N)])
    sim.check_reuse(P + N, N, s2)
    sim.check_reuse(P - N, N, s2)


def test_an_int_use_covers_one_byte():
    sim, s1, s2, _ = device()
    sim.launch(s1, uses=[P])
    sim.check_reuse(P + 1, N, s2)
    with pytest.raises(ReuseError):
        sim.check_reuse(P - 16, 17, s2)


def test_a_wait_on_an_event_after_the_use_orders_it():
    sim, s1, s2, _ = device()
    sim.launch(s1, uses=[(P, N)])
    join(sim, s2, s1)
    sim.check_reuse(P, N, s2)


def test_a_wait_on_an_event_before_the_use_does_not_order_it():
    sim, s1, s2, _ = device()
    event = sim.record_event(s1)
    sim.launch(s1, uses=[(P, N)])
    sim.wait_event(s2, event)
    with pytest.raises(ReuseError):
        sim.check_reuse(P, N, s2)


def test_waits_order_a_use_transitively():
    sim, s1, s2, s3 = device()
    sim.launch(s1, uses=[(P, N)])
    join(sim, s2, s1)
    sim.launch(s2)
    join(sim, s3, s2)                           # s3 waits for s2, which waited for s1
    sim.check_reuse(P, N, s3)


def test_a_wait_queued_after_the_awaited_event_was_recorded_does_not_pass_on():
    sim, s1, s2, s3 = device()
    sim.launch(s1, uses=[(P, N)])
    event = sim.record_event(s2)                # recorded before s2 waits for s1
    join(sim, s2, s1)
    sim.wait_event(s3, event)
    with pytest.raises(ReuseError):
        sim.check_reuse(P, N, s3)


def test_completed_work_is_not_flagged():
    sim, s1, s2, _ = device()
    sim.launch(s1, uses=[(P, N)])
    sim.complete(s1)
    sim.check_reuse(P, N, s2)


def test_completed_uses_are_pruned():
    sim, s1, _, _ = device()
    for _ in range(100):
        sim.launch(s1, uses=[(P, N)])
    sim.launch(s1, uses=[(P, N)])
    sim.complete(s1, 100)
    assert len(sim.pending_uses()) == 1


def test_a_destroyed_streams_pending_use_is_still_flagged():
    sim, s1, s2, _ = device()
    sim.launch(s1, uses=[(P, N)])
    sim.destroy_stream(s1)
    again = sim.create_stream()                 # the driver hands the handle out again
    assert again == s1
    with pytest.raises(ReuseError, match="destroyed"):
        sim.check_reuse(P, N, again)
    with pytest.raises(ReuseError):
        sim.check_reuse(P, N, s2)


def test_the_sanitizer_is_off_by_default():
    sim = SimDevice()
    s1, s2 = sim.create_stream(), sim.create_stream()
    sim.launch(s1, uses=[(P, N)])
    assert sim.pending_uses() == []
    sim.check_reuse(P, N, s2)


# ------------------------------------------------------------------------------- captured uses

def test_a_captured_use_is_flagged_for_a_stream_outside_the_capture():
    sim, s1, s2, _ = device()
    sim.begin_capture(s1)
    sim.launch(s1, uses=[(P, N)])
    with pytest.raises(ReuseError, match="capture 1"):
        sim.check_reuse(P, N, s2)


def test_a_captured_use_is_not_flagged_for_a_stream_it_precedes():
    sim, s1, _, _ = device()
    sim.begin_capture(s1)
    sim.launch(s1, uses=[(P, N)])
    sim.launch(s1)                              # the use is now an ancestor of s1's terminal
    sim.check_reuse(P, N, s1)


def test_a_captured_use_not_joined_into_a_stream_of_the_capture_is_flagged():
    sim, s1, s2, _ = device()
    sim.begin_capture(s1)
    join(sim, s2, s1)
    sim.launch(s2, uses=[(P, N)])
    with pytest.raises(ReuseError, match="does not precede"):
        sim.check_reuse(P, N, s1)


def test_a_captured_use_joined_back_is_not_flagged():
    sim, s1, s2, _ = device()
    sim.begin_capture(s1)
    join(sim, s2, s1)
    sim.launch(s2, uses=[(P, N)])
    join(sim, s1, s2)
    sim.check_reuse(P, N, s1)


def test_a_capture_that_ended_holds_no_use():
    sim, s1, s2, _ = device()
    sim.begin_capture(s1)
    sim.launch(s1, uses=[(P, N)])
    sim.end_capture(s1)
    sim.check_reuse(P, N, s2)


def test_a_launched_graphs_uses_are_pending_until_its_work_completes():
    sim, s1, s2, _ = device()
    sim.begin_capture(s1)
    sim.launch(s1, uses=[(P, N)])
    graph = sim.end_capture(s1)
    sim.launch_graph(graph, s1)
    with pytest.raises(ReuseError, match=f"graph {graph} launched on stream {s1}"):
        sim.check_reuse(P, N, s2)
    sim.complete(s1)
    sim.check_reuse(P, N, s2)


def test_graph_nodes_keep_int_uses_as_given():
    sim, s1, _, _ = device()
    sim.begin_capture(s1)
    sim.launch(s1, uses=[P, (P + N, 64)])
    [(_, _, uses)] = sim.graph_nodes(sim.end_capture(s1))
    assert uses == [P, (P + N, 64)]


# ------------------------------------------------------------------------------- the allocator

def test_the_allocator_calls_the_check_for_every_block_it_hands_out():
    sim, a, _, _ = sanitized_allocator()
    ptrs = [a.malloc(size) for size in (100, 100, 3 * MiB)]
    a.free(ptrs[0])
    a.malloc(100)                               # a cache hit
    assert sim.counters["check_handout"] == 4


def test_the_allocator_with_record_stream_is_never_flagged():
    sim, a, s0, s1 = sanitized_allocator()
    ptr = a.malloc(N, s0)
    a.record_stream(ptr, s1)
    sim.launch(s1, uses=[(ptr, N)])
    a.free(ptr)
    other = a.malloc(N, s0)                     # s1 still uses ptr: another block
    sim.complete(s1)
    again = a.malloc(N, s0)
    assert ptr not in (other,) and again == ptr  # (the sanitizer let both through)


def test_a_block_freed_without_record_stream_while_another_stream_uses_it_is_flagged():
    sim, a, s0, s1 = sanitized_allocator()
    ptr = a.malloc(N, s0)
    sim.launch(s1, uses=[(ptr, N)])             # the program forgot record_stream(ptr, s1)
    a.free(ptr)
    with pytest.raises(ReuseError) as info:
        a.malloc(N, s0)
    assert info.value.ptr == ptr and info.value.use_stream == s1
