"""Stream lifetime (issue 15): streams are destroyed while the allocator still holds blocks that
name them, and the driver hands a destroyed stream's handle to the next new stream.

SimDevice models both as the driver does (destroy_stream: the queued work still runs, the handle
is dead, create_stream hands it out again), so the CuPy case that crashed on the GPU (record_stream
on a stream, the stream object dropped, then the free) runs here as a CPU test. SimStream plays a
CuPy Stream: destroying its stream when the object dies. The GPU half is tests/test_stream_lifetime_gpu.py.

The allocator's tests run on SimDevice and, where a GPU is present, on the GPU (tests/backends.py's
harness, as tests/test_core.py: [sim] and [cuda]); @sim_only marks, with the reason, those that need
what only the simulator has. The test_sim_ tests specify SimDevice's model of the driver itself.
"""
import gc
import subprocess
import textwrap
import sys
import weakref

import pytest

from pyalloc import Buffer, CachingAllocator, CudaError, SimDevice

from backends import backend, make, sim_only  # noqa: F401 (backend: the autouse fixture)
from units import KiB

SIM_MODEL = "specifies SimDevice's model of the driver (the driver's own answers: test_stream_lifetime_gpu.py)"
# On a GPU a destroyed stream's handle may or may not come back from the next cuStreamCreate.
RECYCLES = "needs the driver to hand a destroyed stream's handle to the next new stream, as SimDevice does"
COUNTERS = "counts backend calls (SimDevice.counters)"


class SimStream:
    """A stream object that destroys its stream when it dies, as cupy.cuda.Stream does."""

    def __init__(self, sim):
        self.sim = sim
        self.ptr = sim.create_stream()

    def __del__(self):
        self.sim.destroy_stream(self.ptr)


# ------------------------------------------------------------------ the simulated driver

@sim_only(SIM_MODEL)
def test_sim_recording_an_event_on_a_destroyed_stream_is_invalid_handle():
    sim = SimDevice()
    s = sim.create_stream()
    sim.destroy_stream(s)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE") as err:
        sim.record_event(s)
    assert err.value.call == "cuEventRecord" and f"stream {s} was destroyed" in str(err.value)


@sim_only(SIM_MODEL)
def test_sim_launching_on_a_destroyed_stream_is_invalid_handle():
    sim = SimDevice()
    s = sim.create_stream()
    sim.destroy_stream(s)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        sim.launch(s)


@sim_only(SIM_MODEL)
def test_sim_destroying_a_stream_twice_is_invalid_handle():
    sim = SimDevice()
    s = sim.create_stream()
    sim.destroy_stream(s)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        sim.destroy_stream(s)


@sim_only(SIM_MODEL)
def test_sim_the_legacy_stream_cannot_be_destroyed():
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        SimDevice().destroy_stream(0)


@sim_only(SIM_MODEL)
def test_sim_a_new_stream_gets_the_destroyed_streams_handle():
    sim = SimDevice()
    s = sim.create_stream()
    sim.destroy_stream(s)
    assert sim.create_stream() == s and not sim.is_destroyed(s)


@sim_only(SIM_MODEL)
def test_sim_work_queued_before_destroy_still_completes_and_only_then_its_events():
    sim = SimDevice()
    s = sim.create_stream()
    sim.launch(s)
    event = sim.record_event(s)
    sim.destroy_stream(s)
    reused = sim.create_stream()
    assert reused == s and sim.pending(reused) == 0      # the new stream has none of that work
    sim.complete(reused)
    assert not sim.event_done(event)                     # completing the new stream is not enough
    sim.synchronize()
    assert sim.event_done(event)


@sim_only(SIM_MODEL)
def test_sim_an_event_of_a_stream_destroyed_with_its_work_done_stays_done_after_handle_reuse():
    sim = SimDevice()
    s = sim.create_stream()
    sim.launch(s)
    e = sim.record_event(s)
    sim.complete(s)
    sim.destroy_stream(s)
    again = sim.create_stream()
    assert again == s
    sim.launch(again, 5)                        # the new stream's work says nothing of e
    assert sim.event_done(e)


@sim_only(SIM_MODEL)
def test_sim_a_wait_on_an_event_of_a_destroyed_stream_follows_its_work():
    sim = SimDevice()
    s, other = sim.create_stream(), sim.create_stream()
    sim.launch(s)
    event = sim.record_event(s)
    sim.wait_event(other, event)
    sim.launch(other)
    sim.destroy_stream(s)
    sim.create_stream()
    sim.complete(other)                                  # finishes the awaited work first
    assert sim.event_done(event)


# ------------------------------------------------------------------ the allocator

def test_free_after_the_record_stream_stream_object_died_records_on_a_live_stream():
    sim, alloc = make()
    p = alloc.malloc(4 * KiB)
    s2 = SimStream(sim)
    sim.launch(s2.ptr)                          # work on s2 that uses p
    alloc.record_stream(p, s2)
    handle = s2.ptr
    del s2
    alloc.free(p)                               # used to record on the destroyed handle
    assert alloc.malloc(4 * KiB) != p           # p waits for s2's work
    sim.synchronize()
    assert sim.is_destroyed(handle)             # the stream died once its event was recorded
    assert alloc.malloc(4 * KiB) == p


def test_the_allocator_releases_the_stream_object_once_the_event_is_recorded():
    sim, alloc = make()
    p = alloc.malloc(4 * KiB)
    s2 = SimStream(sim)
    alloc.record_stream(p, s2)
    gone = weakref.ref(s2)
    del s2
    assert gone() is not None                   # kept: a block still names it
    alloc.free(p)
    assert gone() is None


def test_a_pin_is_let_go_at_its_blocks_free_while_other_streams_stay_pinned():
    sim, alloc = make()
    streams = [SimStream(sim) for _ in range(5)]
    blocks = [alloc.malloc(4 * KiB) for _ in streams]
    for p, s in zip(blocks, streams):
        alloc.record_stream(p, s)
    others = {s.ptr for s in streams} - {streams[2].ptr}
    gone = weakref.ref(streams[2])
    streams[2] = None
    alloc.free(blocks[2])
    assert gone() is None
    assert alloc._stream_pin_handles() == others


def test_a_stream_named_by_two_blocks_is_kept_until_both_are_freed():
    sim, alloc = make()
    p, q = alloc.malloc(4 * KiB), alloc.malloc(4 * KiB)
    s2 = SimStream(sim)
    alloc.record_stream(p, s2)
    alloc.record_stream(q, s2)
    gone = weakref.ref(s2)
    del s2
    alloc.free(p)
    assert gone() is not None
    alloc.free(q)
    assert gone() is None


def test_a_recycled_handle_does_not_release_a_block_waiting_on_the_dead_streams_work(backend):
    sim, alloc = make()
    p = alloc.malloc(4 * KiB)
    s2 = SimStream(sim)
    sim.launch(s2.ptr)
    alloc.record_stream(p, s2)
    handle = s2.ptr
    del s2
    alloc.free(p)
    s3 = SimStream(sim)
    if backend == "sim":                        # a GPU's driver may or may not recycle it
        assert s3.ptr == handle                 # the driver recycles the handle
    sim.complete(s3.ptr)                        # the new stream's work says nothing of s2's
    alloc.process_events()
    assert alloc.malloc(4 * KiB) != p
    sim.synchronize()
    assert alloc.malloc(4 * KiB) == p


def test_a_buffer_collected_after_its_record_stream_stream_died_frees_without_an_error(monkeypatch):
    sim, alloc = make()
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    buf = Buffer(alloc, 4 * KiB)
    ptr = buf.ptr
    s2 = SimStream(sim)
    alloc.record_stream(ptr, s2)
    del s2
    del buf                                     # the CuPy hook's path: Buffer.__dealloc__ frees
    gc.collect()
    assert unraisable == []
    assert alloc.memory_allocated() == 0
    sim.synchronize()
    assert alloc.malloc(4 * KiB) == ptr


def test_two_hundred_streams_made_and_dropped_in_turn_each_guard_their_own_block(backend):
    sim, alloc = make()
    handles = set()
    held = []
    for _ in range(200):
        s = SimStream(sim)
        handles.add(s.ptr)
        p = alloc.malloc(4 * KiB)
        sim.launch(s.ptr)
        alloc.record_stream(p, s)
        del s
        alloc.free(p)
        held.append(p)
    # Each stream died once its event was recorded, so the driver handed one handle round (a
    # GPU's driver need not).
    if backend == "sim":
        assert len(handles) == 1
    assert len(set(held)) == 200                # no block was reused while its work was pending
    sim.synchronize()
    alloc.process_events()
    assert alloc.memory_stats()["active_bytes.all.current"] == 0


def test_an_int_handle_is_not_kept_and_needs_no_object():
    sim, alloc = make()
    s = sim.create_stream()
    p = alloc.malloc(4 * KiB)
    alloc.record_stream(p, s)
    alloc.free(p)
    sim.synchronize()
    assert alloc.malloc(4 * KiB) == p


# ------------------------------------------------------------------ allocation streams

def test_an_allocation_stream_object_is_kept_while_the_allocator_holds_its_blocks():
    sim, alloc = make()
    s = SimStream(sim)
    p = alloc.malloc(4 * KiB, s)
    gone = weakref.ref(s)
    del s
    alloc.free(p)
    assert gone() is not None                   # its block is cached for it
    alloc.empty_cache()
    assert gone() is None


@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
def test_empty_cache_keeps_an_allocation_stream_while_a_block_of_it_is_live(config):
    sim, alloc = make(config)
    s = SimStream(sim)
    p = alloc.malloc(4 * KiB, s)
    others = [alloc.malloc(4 * KiB) for _ in range(3)]     # blocks of other streams stay live
    gone = weakref.ref(s)
    del s
    alloc.empty_cache()
    assert gone() is not None                   # p is live: its stream may still use it
    alloc.free(p)
    alloc.empty_cache()                         # p's segment goes back: no block of it is left
    assert gone() is None


def test_a_new_stream_never_gets_blocks_cached_for_a_dead_streams_queued_work():
    sim, alloc = make()
    s = SimStream(sim)
    p = alloc.malloc(4 * KiB, s)
    sim.launch(s.ptr)                           # work on s using p, still queued
    alloc.free(p)                               # stream-ordered: cached for s, no event
    handle = s.ptr
    del s
    s2 = SimStream(sim)
    assert s2.ptr != handle                     # s lives on: its handle is not recycled
    assert alloc.malloc(4 * KiB, s2) != p


def dropped_stream_with_queued_work(sim, alloc):
    """A stream the program dropped while its block was cached for it and its work still queued;
    returns (weak reference to it, its handle, the block)."""
    s = SimStream(sim)
    p = alloc.malloc(4 * KiB, s)
    sim.launch(s.ptr)
    alloc.free(p)
    gone, handle = weakref.ref(s), s.ptr
    del s
    return gone, handle, p


def test_a_dropped_stream_is_let_go_once_its_work_is_done():
    # Kept until empty_cache, every stream a program makes and drops stayed alive (on the GPU,
    # with the device memory each stream holds: the soak's growth outside pyalloc).
    sim, alloc = make()
    gone, handle, p = dropped_stream_with_queued_work(sim, alloc)
    other = SimStream(sim)
    alloc.free(alloc.malloc(4 * KiB, other))     # a new stream: the dropped one gets an event
    assert gone() is not None                    # its work is still queued
    sim.complete(handle)
    alloc.process_events()
    assert gone() is None


@sim_only(RECYCLES)
def test_the_handle_of_a_let_go_stream_brings_its_cached_block_to_the_next_stream_safely():
    sim, alloc = make()
    gone, handle, p = dropped_stream_with_queued_work(sim, alloc)
    other = SimStream(sim)
    alloc.free(alloc.malloc(4 * KiB, other))
    sim.complete(handle)
    alloc.process_events()
    new = SimStream(sim)
    assert new.ptr == handle                     # the driver hands the handle out again
    assert alloc.malloc(4 * KiB, new) == p       # the old work is over: reuse is safe


def test_a_dropped_stream_with_queued_work_is_not_let_go_while_new_streams_come():
    # New streams set off the letting-go; while the dropped stream's work is queued it must stay,
    # or the driver would hand its handle, with the block cached for it, to the next stream.
    sim, alloc = make()
    gone, handle, p = dropped_stream_with_queued_work(sim, alloc)
    newer = []
    for _ in range(3):
        newer.append(SimStream(sim))
        q = alloc.malloc(4 * KiB, newer[-1])
        assert q != p, "the block cached for the dead stream's queued work was handed out"
        alloc.free(q)
        alloc.process_events()
    assert gone() is not None and all(s.ptr != handle for s in newer)


def test_a_dropped_stream_is_let_go_while_new_streams_come_however_many_are_held():
    # A reap reads every kept stream object, so new streams set one off once they number the
    # objects kept before them; two reaps let a dropped stream go (an event, then its query).
    sim, alloc = make()
    held = [SimStream(sim) for _ in range(20)]
    for s in held:
        alloc.free(alloc.malloc(4 * KiB, s))
    gone, handle, p = dropped_stream_with_queued_work(sim, alloc)
    sim.complete(handle)
    kept = len(held) + 1
    newer = []
    while gone() is not None and len(newer) <= 3 * kept:
        newer.append(SimStream(sim))
        alloc.free(alloc.malloc(4 * KiB, newer[-1]))
    assert gone() is None, f"still kept after {len(newer)} new streams"


def test_a_stream_the_program_still_holds_is_not_let_go():
    sim, alloc = make()
    s = SimStream(sim)
    alloc.free(alloc.malloc(4 * KiB, s))
    other = SimStream(sim)
    alloc.free(alloc.malloc(4 * KiB, other))
    sim.synchronize()
    alloc.process_events()
    assert not sim.is_destroyed(s.ptr)
    assert alloc.malloc(4 * KiB, s) is not None


@sim_only(COUNTERS)
def test_the_event_of_a_dropped_stream_does_not_count_as_a_block_waiting():
    # The C entry points serve cache hits only while no block waits for an event.
    sim, alloc = make()
    gone, handle, p = dropped_stream_with_queued_work(sim, alloc)
    other = SimStream(sim)
    alloc.free(alloc.malloc(4 * KiB, other))
    assert alloc.memory_stats()["active_bytes.all.current"] == 0
    assert sim.counters["event_record"] == 1 and alloc._outstanding_events() == 0


@sim_only(COUNTERS)
def test_an_allocator_destroys_the_event_of_a_dropped_stream_when_it_dies():
    sim, alloc = make()
    gone, handle, p = dropped_stream_with_queued_work(sim, alloc)
    other = SimStream(sim)
    alloc.free(alloc.malloc(4 * KiB, other))
    assert sim.counters["event_create"] == 1
    del alloc
    gc.collect()
    assert sim.counters["event_destroy"] == 1


@sim_only("records an event on a stream destroyed behind the allocator's back: SimDevice refuses it "
          "with CUDA_ERROR_INVALID_HANDLE, a GPU's answer to a dead handle is undefined")
def test_a_failure_while_letting_go_of_dropped_streams_allocates_nothing():
    # Letting go records an event on the dropped stream; should the driver refuse (here: the
    # stream was destroyed behind the allocator's back), the malloc that set it off fails whole.
    sim, alloc = make()

    class Handle:                                 # a stream object that does not own its stream
        def __init__(self, ptr):
            self.ptr = ptr

    s, t, u = (Handle(sim.create_stream()) for _ in range(3))
    alloc.free(alloc.malloc(4 * KiB, s))
    sim.destroy_stream(s.ptr)
    del s
    allocated = alloc.memory_allocated()
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        alloc.malloc(4 * KiB, t)                  # t is new: the dropped s gets its event
    assert alloc.memory_allocated() == allocated
    alloc.free(alloc.malloc(4 * KiB, u))          # u is new too: s is not tried again
    alloc.empty_cache()                           # s goes with its block


@sim_only("makes every simulated driver call release the GIL mid-call (SimDevice.latency_us) so that "
          "four threads interleave; the fake CUDA driver that runs the [cuda] cases without a "
          "GPU is not thread-safe")
def test_threads_that_make_use_and_drop_streams_leave_nothing_behind():
    # Four threads each make a stream, allocate and free on it, drop it, over and over, while the
    # simulated driver's calls release the GIL (latency_us): the letting-go of dropped streams
    # (pins lock, allocator lock, destructors run outside both) must neither deadlock nor lose one.
    import threading
    sim, alloc = make()
    sim.latency_us = 20
    alive = [0]
    count_lock = threading.Lock()

    class Counted(SimStream):
        def __init__(self, sim):
            super().__init__(sim)
            with count_lock:
                alive[0] += 1

        def __del__(self):
            super().__del__()
            with count_lock:
                alive[0] -= 1

    errors = []

    def work():
        try:
            for _ in range(150):
                s = Counted(sim)
                p = alloc.malloc(64 * KiB, s)
                sim.launch(s.ptr)
                alloc.free(p)
                sim.complete(s.ptr)
                del s
        except BaseException as exc:     # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert errors == []
    alloc.process_events()                       # events on the streams dropped last
    alloc.process_events()                       # their work is done: let go
    assert alive[0] == 0
    alloc.empty_cache()
    assert alloc.memory_reserved() == 0


def test_a_buffer_keeps_its_stream_object_alive_like_malloc():
    sim, alloc = make()
    s = SimStream(sim)
    buf = Buffer(alloc, 4 * KiB, s)
    gone = weakref.ref(s)
    del s, buf
    assert gone() is not None
    alloc.empty_cache()
    assert gone() is None


def test_a_stream_given_only_to_record_stream_is_not_kept_as_an_allocation_stream():
    sim, alloc = make()
    p = alloc.malloc(4 * KiB)
    s = SimStream(sim)
    alloc.record_stream(p, s)
    gone = weakref.ref(s)
    del s
    alloc.free(p)
    assert gone() is None


def test_a_zero_byte_malloc_on_a_stream_object_keeps_no_stream():
    sim, alloc = make()
    s = SimStream(sim)
    assert alloc.malloc(0, s) == 0             # record_stream validates its stream this way
    gone = weakref.ref(s)
    del s
    assert gone() is None


def test_a_zero_byte_buffer_on_a_stream_object_keeps_no_stream():
    sim, alloc = make()
    s = SimStream(sim)
    buf = Buffer(alloc, 0, s)
    gone = weakref.ref(s)
    del s
    assert buf.ptr == 0 and gone() is None


@sim_only("makes a SimDevice the default backend of the module-level allocator")
def test_module_record_stream_lets_its_stream_go_once_the_free_has_recorded_on_it():
    """pyalloc.record_stream (the CuPy path): the stream object dies with the free's event
    recorded, not later (on the H200 a dropped CuPy stream stayed alive as an allocation stream
    after its work and the free were done)."""
    import pyalloc
    sim = SimDevice(1 << 30)
    pyalloc.set_default_backend(lambda device: sim)
    try:
        p = pyalloc.malloc(4 * KiB)
        s = SimStream(sim)
        sim.launch(s.ptr)
        pyalloc.record_stream(p, s)
        gone = weakref.ref(s)
        del s
        pyalloc.free(p)
        assert gone() is None
        sim.synchronize()
        pyalloc.get_allocator(0).process_events()
        assert pyalloc.malloc(4 * KiB) == p
        pyalloc.free(p)
    finally:
        pyalloc.set_default_backend(None)


# ------------------------------------------------------------------ events are given back

def allocator_with_an_event(pending):
    """An allocator on a fresh SimDevice that has made one cross-stream event: still awaited by a
    freed block (pending) or back in the event pool."""
    sim, alloc = make()
    s = sim.create_stream()
    p = alloc.malloc(4 * KiB)
    alloc.record_stream(p, s)
    sim.launch(s)
    alloc.free(p)
    if not pending:
        sim.synchronize()
        alloc.process_events()
    assert sim.counters["event_create"] == 1
    return sim, alloc


@pytest.mark.parametrize("pending", [False, True], ids=["idle", "pending"])
@sim_only(COUNTERS)
def test_an_allocator_destroys_its_events_when_it_dies(pending):
    sim, alloc = allocator_with_an_event(pending)
    del alloc
    gc.collect()
    assert sim.counters["event_destroy"] == 1


@sim_only(COUNTERS)
def test_empty_cache_destroys_the_idle_events():
    sim, alloc = allocator_with_an_event(pending=False)
    alloc.empty_cache()
    assert sim.counters["event_destroy"] == 1
    p = alloc.malloc(4 * KiB)                   # a later free makes a new one
    s = sim.create_stream()
    alloc.record_stream(p, s)
    alloc.free(p)
    assert sim.counters["event_create"] == 2


@sim_only(COUNTERS)
def test_empty_cache_keeps_the_events_blocks_still_wait_on():
    sim, alloc = allocator_with_an_event(pending=True)
    alloc.empty_cache()                          # waits for them (synchronize_and_free_events)
    assert alloc.memory_stats()["active_bytes.all.current"] == 0
    assert sim.counters["event_destroy"] == 1    # then idle, so destroyed


@sim_only("runs a SimDevice program in a child interpreter")
def test_an_allocator_alive_at_interpreter_exit_with_events_exits_cleanly(tmp_path):
    code = textwrap.dedent("""
        from pyalloc import CachingAllocator, SimDevice
        sim = SimDevice(1 << 30)
        alloc = CachingAllocator(backend=sim, config="")
        s = sim.create_stream()
        p = alloc.malloc(4096)
        alloc.record_stream(p, s)
        sim.launch(s)
        alloc.free(p)
        keep = [alloc]
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == "", (out.returncode, out.stderr)


# ------------------------------------------------------------------ streams of another device

def two_devices():
    sim0 = SimDevice(1 << 30, device=0)
    sim1 = SimDevice(1 << 30, device=1, base_address=0x7F0000000000 + (1 << 40))
    return sim0, CachingAllocator(0, backend=sim0, config=""), sim1


@sim_only(SIM_MODEL)
def test_sim_streams_made_by_device_one_belong_to_device_one():
    sim0, _, sim1 = two_devices()
    s1 = sim1.create_stream()
    assert sim0.device_of_stream(s1) == 1 and sim1.device_of_stream(s1) == 1
    assert sim0.device_of_stream(sim0.create_stream()) == 0 and sim0.device_of_stream(0) == 0


@sim_only(SIM_MODEL)
def test_sim_an_event_cannot_be_recorded_on_a_stream_of_another_device():
    sim0, _, sim1 = two_devices()
    event = sim0.create_event()
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE") as err:
        sim0.record_event(sim1.create_stream(), event)
    assert "of device 0 cannot be recorded on" in str(err.value)


@sim_only("needs two devices (two SimDevices)")
def test_a_free_used_on_another_devices_stream_records_an_event_of_that_device():
    sim0, alloc, sim1 = two_devices()
    s1 = sim1.create_stream()
    p = alloc.malloc(4 * KiB)
    alloc.record_stream(p, s1)
    sim0.launch(s1)                             # the work on device 1's stream, as sim0 sees it
    alloc.free(p)                               # used to record device 0's event on it
    assert alloc.malloc(4 * KiB) != p
    sim0.complete(s1)
    assert alloc.malloc(4 * KiB) == p


@sim_only("needs two devices (two SimDevices) and counts their event calls")
def test_events_of_another_device_are_pooled_apart_and_destroyed_with_the_allocator():
    sim0, alloc, sim1 = two_devices()
    s0, s1 = sim0.create_stream(), sim1.create_stream()
    for stream in (s1, s1, s0):
        p = alloc.malloc(4 * KiB)
        alloc.record_stream(p, stream)
        alloc.free(p)
        alloc.process_events()                  # no work queued: the event is idle again
    assert sim0.counters["event_create"] == 2   # one per device: each reused from its own pool
    del alloc
    gc.collect()
    assert sim0.counters["event_destroy"] == 2
