"""Stream handles the simulated device refuses, as the driver does (or would, instead of crashing):
destroyed streams and handles it never made."""
import pytest

from pyalloc import CachingAllocator, CudaError, SimDevice


def test_stream_alive_is_false_for_a_destroyed_stream():
    sim = SimDevice()
    s = sim.create_stream()
    sim.destroy_stream(s)
    assert sim.is_stream_alive(s) is False


def test_stream_alive_is_true_for_a_live_stream_and_the_default_handles():
    sim = SimDevice()
    s = sim.create_stream()
    assert [sim.is_stream_alive(h) for h in (0, 1, 2, s)] == [True] * 4


def test_a_graph_launch_on_a_destroyed_stream_is_refused():
    sim = SimDevice()
    s, dead = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s)
    sim.launch(s)
    graph = sim.end_capture(s)
    sim.destroy_stream(dead)
    with pytest.raises(CudaError, match="INVALID_HANDLE") as info:
        sim.launch_graph(graph, dead)
    assert info.value.call == "cuGraphLaunch"


@pytest.mark.parametrize("use", [
    lambda sim, h: sim.launch(h),
    lambda sim, h: sim.record_event(h),
    lambda sim, h: sim.wait_event(h, sim.record_event(0)),
    lambda sim, h: sim.synchronize_stream(h),
    lambda sim, h: sim.begin_capture(h),
], ids=["launch", "event_record", "wait_event", "synchronize", "begin_capture"])
def test_a_handle_create_stream_never_gave_out_is_refused(use):
    sim = SimDevice()
    sim.create_stream()
    with pytest.raises(CudaError, match="stream 99999 was never created"):
        use(sim, 99999)


def test_stream_alive_refuses_a_handle_never_made():
    with pytest.raises(CudaError, match="never created"):
        SimDevice().is_stream_alive(99999)


def test_streams_of_other_devices_are_not_refused():
    sim = SimDevice()
    other = SimDevice(device=1).create_stream()
    sim.launch(other)                       # a stream of device 1, launched through device 0


def test_with_the_sanitizer_malloc_on_a_handle_never_made_is_refused():
    sim = SimDevice(check_reuse=True)
    a = CachingAllocator(backend=sim, config="")
    a.free(a.malloc(10))                    # cached, but on stream 0: a miss, which asks the backend
    with pytest.raises(ValueError, match="stream 99999 was never created"):
        a.malloc(10, stream=99999)


def test_a_cache_miss_on_a_handle_never_made_is_refused_and_changes_nothing():
    sim = SimDevice()
    a = CachingAllocator(backend=sim, config="")
    a.free(a.malloc(10))
    before = a.memory_stats()
    with pytest.raises(ValueError, match="stream 99999"):
        a.malloc(10, stream=99999)
    assert a.memory_stats() == before and len(sim.segments()) == 1
    a._check_invariants()


def test_a_cache_miss_on_a_destroyed_stream_is_refused():
    sim = SimDevice()
    a = CachingAllocator(backend=sim, config="")
    s = sim.create_stream()
    sim.destroy_stream(s)
    with pytest.raises(ValueError, match=f"stream {s} was destroyed"):
        a.malloc(10, stream=s)
    assert a.memory_reserved() == 0


def test_a_cache_hit_does_not_ask_whether_its_stream_is_alive():
    sim = SimDevice()
    a = CachingAllocator(backend=sim, config="")
    s = sim.create_stream()
    a.free(a.malloc(10, stream=s))
    sim.destroy_stream(s)               # its handle is dead; the cached block is still keyed by it
    a.free(a.malloc(10, stream=s))      # served from the cache: no backend call, no refusal
