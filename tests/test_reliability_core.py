"""Nothing handed out twice, nothing crashes: the core's failures found by a hostile probe.

Each test pins one behaviour that used to fail on the simulated device: a pool used after it was
deleted, a free that raised halfway, a stream use dropped at the end of a capture while its
kernel was still queued, a deferred block released during a capture, a Buffer's block freed
behind its back, the C entry points losing a stream pin, a crash on an uninitialised Buffer, a
MemPool bound to a retired default allocator. Crashes run in a subprocess, so that the old
behaviour fails the test instead of killing the run.
"""
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import pyalloc
from pyalloc import Buffer, CachingAllocator, CudaError, PointerError, SimDevice
from pyalloc._core import current_thread_key
from pool_helpers import make, pool_of
from test_capi import sim_defaults, table as c_table   # noqa: F401 (sim_defaults: a fixture)
from pyalloc import _capi

from units import KiB, MiB
REUSE = "graph_capture_record_stream_reuse:True"


def run_python(code):
    """Run `code` in a fresh interpreter from the tests folder (so that a source checkout never
    shadows the installed package); returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))


def in_thread(fn):
    """Run fn() on a new thread and wait for it; re-raises its exception here."""
    box = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as e:        # handed to the caller below
            box["error"] = e
    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


# ------------------------------------------------------------------ 1. a routed pool stays alive

def test_a_pool_named_by_a_live_route_is_not_deleted_by_empty_cache():
    sim, alloc = make()
    pid = (0, 991)
    alloc.begin_allocate_to_pool(pid, ("thread", current_thread_key()))
    alloc.release_pool(pid)              # its last use, while the route still names it
    alloc.empty_cache()
    ptr = alloc.malloc(MiB)
    assert pool_of(alloc, ptr) == pid    # the routed malloc lands in the routed pool
    alloc.free(ptr)
    alloc.end_allocate_to_pool(pid)
    alloc.empty_cache()                  # now it may go
    assert alloc._pool_info(pid) is None


def test_a_pool_released_while_routed_is_deleted_once_the_route_ends_and_it_is_empty():
    sim, alloc = make()
    pid = (0, 992)
    alloc.begin_allocate_to_pool(pid, ("thread", current_thread_key()))
    alloc.release_pool(pid)
    alloc.free(alloc.malloc(MiB))
    alloc.end_allocate_to_pool(pid)
    alloc.empty_cache()
    assert alloc._pool_info(pid) is None and alloc.memory_reserved() == 0


# ------------------------------------------------------------------ 2. a free that raises changes nothing

def test_record_stream_refuses_a_destroyed_stream():
    sim, alloc = make()
    side = sim.create_stream()
    sim.destroy_stream(side)
    p = alloc.malloc(MiB)
    with pytest.raises(ValueError, match=f"stream {side}"):
        alloc.record_stream(p, side)
    alloc.free(p)                        # no use was recorded: the free needs no event
    assert alloc.memory_allocated() == 0 and sim.counters["event_record"] == 0


FREE_FAILS_IN_CAPTURE = """
    import pyalloc
    from pyalloc import CachingAllocator, CudaError, SimDevice
    sim = SimDevice()
    alloc = CachingAllocator(backend=sim, config="graph_capture_record_stream_reuse:True")
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s):
        p = alloc.malloc(1 << 20, s)
        alloc.record_stream(p, side)
        sim.destroy_stream(side)         # the program broke its promise: the handle is dead
        for attempt in range(3):
            try:
                alloc.free(p)
            except CudaError:
                pass
            else:
                raise SystemExit("the free succeeded")
            alloc._check_invariants()
            print(alloc.memory_allocated(), alloc._capture_stats()["deferred_blocks"])
        q = alloc.malloc(1 << 20, s)
        print(q != p)
"""


def test_a_free_that_fails_in_a_capture_leaves_the_block_allocated_and_is_retried_safely():
    out = run_python(FREE_FAILS_IN_CAPTURE)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[:3] == ["1048576 0"] * 3          # still allocated, never queued as deferred
    assert lines[3] == "True"                      # and never handed out again


# ------------------------------------------------------------------ 3. capture end keeps real uses

def test_a_real_stream_use_recorded_during_another_threads_capture_is_kept():
    sim, alloc = make()
    s, t, side = sim.create_stream(), sim.create_stream(), sim.create_stream()
    with alloc.graph(s, capture_error_mode="thread_local") as graph:      # kept: no reset below
        def thread_b():
            p = alloc.malloc(MiB, t)                    # t is not capturing: the default pool
            sim.launch(side, uses=(p,))                 # real work, queued on side
            alloc.record_stream(p, side)
            alloc.free(p)
            return p
        p = in_thread(thread_b)
    assert sim.pending(side) == 1
    q = alloc.malloc(MiB, t)
    assert q != p                                       # side's kernel still uses p
    sim.synchronize()
    alloc.free(q)


# ------------------------------------------------------------------ 4. process_events during a capture

def test_process_events_during_a_global_capture_leaves_the_capture_valid():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(MiB, s)
    sim.launch(side, uses=(p,))
    alloc.record_stream(p, side)
    alloc.free(p)                                       # waits on an event recorded on side
    assert alloc._outstanding_events() == 1
    with alloc.graph(s):
        alloc.process_events()                          # no event query is legal now
        assert sim.capture_status(s) == "active"


def test_process_events_during_a_capture_releases_no_deferred_block():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s, capture_error_mode="relaxed"):
        p = alloc.malloc(MiB, s)                        # from the graph's pool
        sim.launch(side, uses=(p,))                     # real work: side is not capturing
        alloc.record_stream(p, side)
        alloc.free(p)                                   # deferred: a route is active
        alloc.process_events()
        q = alloc.malloc(MiB, s)
        assert q != p
    sim.synchronize()


# ------------------------------------------------------------------ 5. capture marks end with their capture

def test_a_capture_use_mark_does_not_outlive_its_capture():
    sim, alloc = make()
    t, s = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(MiB, t)
    with alloc.graph(s) as graph:                       # kept: no reset below
        sim.launch(s, uses=(p,))                        # used in the graph on s
        alloc.record_stream(p, s)
    sim.launch(s, uses=(p,))                            # then used for real on s
    alloc.record_stream(p, s)
    pool = alloc.mem_pool()
    entered, leave = threading.Event(), threading.Event()

    def other_thread():
        with alloc.use_mem_pool(pool):
            entered.set()
            leave.wait(10)
    worker = threading.Thread(target=other_thread)
    worker.start()
    entered.wait(10)
    alloc.free(p)                                       # deferred while the other route is open
    leave.set()
    worker.join()
    assert sim.pending(s) == 1
    assert alloc.malloc(MiB, t) != p                    # s's kernel still uses p
    sim.synchronize()


# ------------------------------------------------------------------ 6. a Buffer's block is the Buffer's

def test_raw_free_of_a_buffers_block_raises_and_leaves_the_buffer_owning_it():
    sim, alloc = make()
    buf = alloc.allocate(MiB)
    with pytest.raises(PointerError, match="Buffer"):
        alloc.free(buf.ptr)
    assert alloc.memory_allocated() == MiB
    other = alloc.malloc(MiB)
    assert other != buf.ptr                             # still the Buffer's
    buf.close()
    alloc.free(other)
    assert alloc.memory_allocated() == 0


def test_raw_free_of_a_buffers_block_through_the_c_entry_points_raises(sim_defaults):
    alloc = pyalloc.get_allocator(0)
    buf = alloc.allocate(MiB)
    assert c_table().free(0, buf.ptr) != 0
    with pytest.raises(PointerError, match="Buffer"):
        _capi.raise_last_error()
    assert alloc.memory_allocated() == MiB
    buf.close()
    assert alloc.memory_allocated() == 0


def test_a_buffer_whose_close_fails_still_owns_its_block():
    sim, alloc = make()
    side = sim.create_stream()
    buf = alloc.allocate(MiB)
    alloc.record_stream(buf.ptr, side)
    sim.destroy_stream(side)                            # its event cannot be recorded now
    with pytest.raises(CudaError):
        buf.close()
    assert not buf.closed and buf.ptr != 0 and alloc.memory_allocated() == MiB
    assert sim.create_stream() == side                  # the handle lives again (driver order)
    buf.close()
    assert buf.closed and alloc.memory_allocated() == 0


# ------------------------------------------------------------------ 7. one record_stream for C and Python

class StreamObject:
    """A framework's stream object (what record_stream pins): its handle by __cuda_stream__."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def test_a_stream_recorded_from_c_counts_as_a_use_that_keeps_its_pin(sim_defaults):
    alloc = pyalloc.get_allocator(0)
    stream = StreamObject(alloc.backend.create_stream())
    from_python, from_c = alloc.malloc(MiB), alloc.malloc(MiB)
    alloc.record_stream(from_python, stream)            # pins the object
    assert c_table().record_stream(0, from_c, stream.handle) == 0
    assert c_table().free(0, from_c) == 0               # from_c's use of the stream is over
    assert stream.handle in alloc._stream_pin_handles()           # from_python's use still names it
    alloc.free(from_python)
    alloc.backend.synchronize()
    alloc.process_events()
    assert stream.handle not in alloc._stream_pin_handles()
    assert alloc.memory_allocated() == 0


# ------------------------------------------------------------------ 8. an uninitialised Buffer

def test_an_uninitialised_buffer_has_a_repr_and_no_device():
    out = run_python("""
        from pyalloc import Buffer
        b = Buffer.__new__(Buffer)
        print(repr(b))
        try:
            b.device
        except RuntimeError as e:
            print("RuntimeError", e)
        b.close()
    """)
    assert out.returncode == 0, out.stderr
    assert "uninitialised" in out.stdout and "RuntimeError" in out.stdout


# ------------------------------------------------------------------ 9. a MemPool of a retired default

def test_use_mem_pool_refuses_a_pool_of_a_retired_default_allocator():
    pyalloc.set_default_backend("sim")
    try:
        pool = pyalloc.MemPool()
        pyalloc.set_default_backend(lambda d: SimDevice(device=d))
        with pytest.raises(RuntimeError, match="set_default_backend"):
            with pyalloc.use_mem_pool(pool):
                pass
        assert pyalloc.memory_allocated() == 0
    finally:
        pyalloc.set_default_backend(None)
