"""Specification of the CUDA backend on a real GPU, through the driver only (no CuPy needed).

Marked `gpu`; skipped with the reason when no driver or GPU is visible. Data are checked with
cuda.bindings.driver's Python API (memset, copy back), in the device's primary context.
"""
import threading

import numpy as np
import pytest

import pyalloc
from pyalloc import cuda_backend

from gpu_helpers import NEEDS_GPU   # noqa: E402

pytestmark = NEEDS_GPU

from units import MiB, GiB


def drv(fn, *args):
    """Call a cuda.bindings.driver function; assert success; return its outputs."""
    out = fn(*args)
    if not isinstance(out, tuple):
        out = (out,)
    err, rest = out[0], out[1:]
    assert int(err) == 0, f"{fn.__name__}{args} failed with {err!r}"
    return rest[0] if len(rest) == 1 else rest


@pytest.fixture(scope="module")
def driver():
    from cuda.bindings import driver as d
    drv(d.cuInit, 0)
    return d


def primary_context(driver, device):
    dev = drv(driver.cuDeviceGet, device)
    ctx = drv(driver.cuDevicePrimaryCtxRetain, dev)
    return ctx


def fill_and_read(driver, device, ptr, nbytes, value):
    """memset `nbytes` at `ptr` to `value` in `device`'s context, copy back, restore the context."""
    previous = drv(driver.cuCtxGetCurrent)
    drv(driver.cuCtxSetCurrent, primary_context(driver, device))
    try:
        drv(driver.cuMemsetD8, ptr, value, nbytes)
        host = np.empty(nbytes, dtype=np.uint8)
        drv(driver.cuMemcpyDtoH, host.ctypes.data, ptr, nbytes)
        drv(driver.cuCtxSynchronize)
    finally:
        drv(driver.cuCtxSetCurrent, previous)
    return host


@pytest.fixture
def alloc():
    a = pyalloc.CachingAllocator(0, backend="cuda")
    yield a
    a.empty_cache()


@pytest.fixture
def gpu_defaults():
    pyalloc.set_default_backend(None)
    yield
    pyalloc.empty_cache()


def test_backend_none_picks_the_gpu():
    assert pyalloc.CachingAllocator(backend=None).backend.kind == "cuda"


def test_one_default_allocator_per_visible_device(gpu_defaults):
    from pyalloc import _cuda
    count = cuda_backend.device_count()
    allocators = [pyalloc.get_allocator(d) for d in range(count)]
    assert len({id(a) for a in allocators}) == count
    for d, a in enumerate(allocators):
        assert (a.device, a.backend.kind) == (d, "cuda")
        ptr = pyalloc.malloc(MiB, device=d)
        assert _cuda.pointer_device(ptr) == d
        pyalloc.free(ptr)
        assert pyalloc.memory_allocated(d) == 0


def test_default_allocator_rejects_a_device_beyond_the_visible_ones(gpu_defaults):
    with pytest.raises(ValueError, match="visible"):
        pyalloc.get_allocator(cuda_backend.device_count())


def test_allocated_memory_holds_data(driver, alloc):
    ptr = alloc.malloc(3 * MiB)
    host = fill_and_read(driver, 0, ptr, 3 * MiB, 0x5A)
    assert (host == 0x5A).all()
    alloc.free(ptr)


def test_a_cache_hit_reuses_the_block_without_a_driver_call(alloc):
    ptr = alloc.malloc(MiB)
    alloc.free(ptr)
    segments = alloc.memory_stats()["num_device_alloc"]
    assert alloc.malloc(MiB) == ptr
    assert alloc.memory_stats()["num_device_alloc"] == segments
    alloc.free(ptr)


def test_memory_info_reports_the_devices_total(driver, alloc):
    total = drv(driver.cuDeviceTotalMem, drv(driver.cuDeviceGet, 0))
    free, reported_total = alloc.backend.mem_get_info()
    assert reported_total == total
    assert 0 < free <= total


def test_empty_cache_returns_segments_to_the_driver(alloc):
    alloc.free(alloc.malloc(GiB))
    free_before, _ = alloc.backend.mem_get_info()
    # Device memory the backend holds: cuMemAlloc segments, or pages mapped for expandable
    # segments when PYALLOC_CONF turns those on (a 1 GiB request maps whole 20 MiB pages).
    held = alloc.backend.live_bytes + alloc.backend.mapped_bytes
    assert GiB <= held < GiB + 20 * MiB
    alloc.empty_cache()
    free_after, _ = alloc.backend.mem_get_info()
    assert alloc.backend.live_bytes + alloc.backend.mapped_bytes == 0 and alloc.memory_reserved() == 0
    assert free_after - free_before >= GiB - 64 * MiB      # the driver's figure, not ours


def test_out_of_memory_on_the_device_raises_out_of_memory_error(alloc):
    _, total = alloc.backend.mem_get_info()
    with pytest.raises(pyalloc.OutOfMemoryError) as info:
        alloc.malloc(total + GiB)
    err = info.value
    assert err.requested == total + GiB
    assert err.total == total
    assert "out of memory" in str(err).lower()


def test_out_of_memory_leaves_the_allocator_usable(driver, alloc):
    _, total = alloc.backend.mem_get_info()
    with pytest.raises(pyalloc.OutOfMemoryError):
        alloc.malloc(total + GiB)
    ptr = alloc.malloc(MiB)
    assert (fill_and_read(driver, 0, ptr, MiB, 7) == 7).all()
    alloc.free(ptr)
    assert alloc.memory_stats()["num_ooms"] == 1
    alloc._check_invariants()


def test_filling_the_device_ends_in_out_of_memory_and_frees_back(alloc):
    chunk = 4 * GiB
    ptrs = []
    with pytest.raises(pyalloc.OutOfMemoryError):
        for _ in range(1000):
            ptrs.append(alloc.malloc(chunk))
    assert len(ptrs) >= 1
    for p in ptrs:
        alloc.free(p)
    alloc.empty_cache()
    assert alloc.memory_reserved() == 0
    alloc.free(alloc.malloc(chunk))                             # the device is usable again


def test_the_callers_current_context_is_left_as_it_was(driver, alloc):
    drv(driver.cuCtxSetCurrent, driver.CUcontext(0))
    ptr = alloc.malloc(50 * MiB)                               # a new segment: a driver call
    assert int(drv(driver.cuCtxGetCurrent)) == 0
    alloc.free(ptr)
    alloc.empty_cache()
    assert int(drv(driver.cuCtxGetCurrent)) == 0


def test_record_stream_event_completes_on_an_idle_stream(driver, alloc):
    ctx = primary_context(driver, 0)
    drv(driver.cuCtxSetCurrent, ctx)
    stream = drv(driver.cuStreamCreate, 1)                      # CU_STREAM_NON_BLOCKING
    try:
        ptr = alloc.malloc(MiB)
        alloc.record_stream(ptr, int(stream))
        alloc.free(ptr)
        drv(driver.cuStreamSynchronize, stream)
        assert alloc.malloc(MiB) == ptr                         # the event has completed
        alloc.free(ptr)
    finally:
        drv(driver.cuStreamDestroy, stream)


@pytest.mark.parametrize("config", ["", "release_lock_on_cudamalloc:True"])
def test_concurrent_threads_allocate_and_free_consistently(config):
    # With release_lock_on_cudamalloc the lock is let go during each cuMemAlloc (GIL released
    # too), so other threads' cache hits and frees run in the middle of segment allocations.
    a = pyalloc.CachingAllocator(0, backend="cuda", config=config)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                sizes = rng.integers(1, 64 * MiB, size=4)
                ptrs = [a.malloc(int(n)) for n in sizes]
                for p in ptrs:
                    a.free(p)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    a._check_invariants()
    assert a.memory_allocated() == 0
    a.empty_cache()


@pytest.mark.skipif(cuda_backend.device_count() < 2, reason="needs two visible GPUs")
def test_two_gpus_each_allocator_serves_its_own_device(driver, gpu_defaults):
    from pyalloc import _cuda
    drv(driver.cuCtxSetCurrent, primary_context(driver, 0))     # the caller works on device 0
    p1 = pyalloc.malloc(8 * MiB, device=1)
    p0 = pyalloc.malloc(8 * MiB, device=0)
    assert (_cuda.pointer_device(p0), _cuda.pointer_device(p1)) == (0, 1)
    assert _cuda.current_device() == 0                          # pyalloc switched and restored
    assert (fill_and_read(driver, 1, p1, 8 * MiB, 0x11) == 0x11).all()
    assert (fill_and_read(driver, 0, p0, 8 * MiB, 0x22) == 0x22).all()
    assert pyalloc.memory_allocated(1) == 8 * MiB
    pyalloc.free(p1)                                            # found on device 1 by lookup
    pyalloc.free(p0)
    assert (pyalloc.memory_allocated(0), pyalloc.memory_allocated(1)) == (0, 0)


@pytest.mark.skipif(cuda_backend.device_count() < 2, reason="needs two visible GPUs")
def test_two_gpus_device_none_follows_the_current_context(driver, gpu_defaults):
    from pyalloc import _cuda
    previous = drv(driver.cuCtxGetCurrent)
    drv(driver.cuCtxSetCurrent, primary_context(driver, 1))
    try:
        ptr = pyalloc.malloc(MiB)
        assert _cuda.pointer_device(ptr) == 1
        assert pyalloc.memory_allocated(1) == MiB
        pyalloc.free(ptr)
    finally:
        # Later tests (and CuPy, whose current device follows the context) expect device 0.
        drv(driver.cuCtxSetCurrent, previous)


# ------------------------------------------------------------------------------ stream capture
#
# Captures go through the backend (begin_capture .. end_capture, launch_graph, destroy_graph);
# the captured work is queued with cuda.bindings.driver's cuMemsetD8Async, whose nodes are memset
# nodes of the graph.

CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2


@pytest.fixture
def capture_stream(driver):
    """A non-blocking stream on device 0 (PyTorch captures on such side streams), with device 0's
    context current for the test's own driver calls. A capture a failing test left open is ended
    (and its graph destroyed) before the stream is."""
    previous = drv(driver.cuCtxGetCurrent)
    drv(driver.cuCtxSetCurrent, primary_context(driver, 0))
    stream = drv(driver.cuStreamCreate, CU_STREAM_NON_BLOCKING)
    yield stream
    status = drv(driver.cuStreamIsCapturing, stream)
    if status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
        out = driver.cuStreamEndCapture(stream)
        if isinstance(out, tuple) and len(out) > 1 and out[1] is not None and int(out[1]):
            driver.cuGraphDestroy(out[1])
    drv(driver.cuStreamSynchronize, stream)
    drv(driver.cuStreamDestroy, stream)
    drv(driver.cuCtxSetCurrent, previous)


def read_back(driver, ptr, nbytes):
    """Device bytes at `ptr`, copied to the host (device 0's context must be current)."""
    host = np.empty(nbytes, dtype=np.uint8)
    drv(driver.cuMemcpyDtoH, host.ctypes.data, ptr, nbytes)
    return host


def zero(driver, ptr, nbytes):
    drv(driver.cuMemsetD8, ptr, 0, nbytes)
    drv(driver.cuCtxSynchronize)


def current_capture_mode(driver):
    """This thread's capture mode (cuThreadExchangeStreamCaptureMode there and back)."""
    previous = drv(driver.cuThreadExchangeStreamCaptureMode,
                   driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    drv(driver.cuThreadExchangeStreamCaptureMode, previous)
    return previous


def capture_two_memsets(driver, dev, stream, buf, nbytes):
    """Capture, on `stream`: set all of buf to 0x11, then its second half to 0x22. Returns
    [capture info after the first memset, after the second]; the capture is left open."""
    dev.begin_capture(int(stream), "global")
    drv(driver.cuMemsetD8Async, buf, 0x11, nbytes, stream)
    after_first = dev.stream_capture_info(int(stream))
    drv(driver.cuMemsetD8Async, buf + nbytes // 2, 0x22, nbytes // 2, stream)
    after_second = dev.stream_capture_info(int(stream))
    return after_first, after_second


def expected_after_replay(nbytes):
    want = np.full(nbytes, 0x11, dtype=np.uint8)
    want[nbytes // 2:] = 0x22
    return want


def test_capture_info_is_none_when_nothing_captures(alloc, capture_stream):
    assert alloc.backend.stream_capture_info(int(capture_stream)) is None
    assert alloc.backend.stream_capture_info(0) is None


def test_capture_info_reports_the_capture_id_and_the_memset_node_as_terminal(driver, alloc, capture_stream):
    dev = alloc.backend
    buf = alloc.malloc(4 * MiB)
    first, second = capture_two_memsets(driver, dev, capture_stream, buf, 4 * MiB)
    capture_id, terminals = first
    assert isinstance(capture_id, int) and len(terminals) == 1 and terminals[0] != 0
    node_type = drv(driver.cuGraphNodeGetType, driver.CUgraphNode(terminals[0]))
    assert node_type == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET
    assert second[0] == capture_id                          # the same capture sequence
    assert len(second[1]) == 1 and second[1][0] != terminals[0]
    # The same figures as cuda-python's own query: (err, status, id, graph, deps, edges, n).
    out = driver.cuStreamGetCaptureInfo(capture_stream)
    assert int(out[0]) == 0
    assert out[1] == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert int(out[2]) == capture_id
    assert [int(n) for n in out[4]] == second[1]
    alloc.backend.destroy_graph(dev.end_capture(int(capture_stream)))
    assert dev.stream_capture_info(int(capture_stream)) is None
    alloc.free(buf)


def test_node_parents_of_the_second_memset_is_the_first(driver, alloc, capture_stream):
    dev = alloc.backend
    buf = alloc.malloc(4 * MiB)
    (_, (first,)), (_, (second,)) = capture_two_memsets(driver, dev, capture_stream, buf, 4 * MiB)
    assert dev.node_parents(second) == [first]
    assert dev.node_parents(first) == []
    dev.destroy_graph(dev.end_capture(int(capture_stream)))
    alloc.free(buf)


def test_end_capture_returns_a_graph_that_launch_graph_replays(driver, alloc, capture_stream):
    dev = alloc.backend
    n = 4 * MiB
    buf = alloc.malloc(n)
    zero(driver, buf, n)
    capture_two_memsets(driver, dev, capture_stream, buf, n)
    graph = dev.end_capture(int(capture_stream))
    assert graph != 0
    assert (read_back(driver, buf, n) == 0).all()           # captured, not run
    dev.launch_graph(graph, int(capture_stream))
    drv(driver.cuStreamSynchronize, capture_stream)
    assert (read_back(driver, buf, n) == expected_after_replay(n)).all()
    assert dev.instantiated_graphs == 1
    zero(driver, buf, n)
    dev.launch_graph(graph)                                 # again, on the legacy stream
    drv(driver.cuCtxSynchronize)
    assert (read_back(driver, buf, n) == expected_after_replay(n)).all()
    assert dev.instantiated_graphs == 1                     # instantiated once
    dev.destroy_graph(graph)
    assert dev.instantiated_graphs == 0
    alloc.free(buf)


def test_destroy_graph_of_a_graph_never_launched(alloc, capture_stream):
    dev = alloc.backend
    dev.begin_capture(int(capture_stream), "global")
    graph = dev.end_capture(int(capture_stream))            # an empty capture is a graph too
    assert graph != 0
    dev.destroy_graph(graph)
    assert dev.instantiated_graphs == 0


def test_a_new_segment_during_a_global_capture_succeeds_and_keeps_the_capture(driver, alloc, capture_stream):
    dev = alloc.backend
    n = 4 * MiB
    buf = alloc.malloc(n)
    zero(driver, buf, n)
    (capture_id, _), (_, terminals) = capture_two_memsets(driver, dev, capture_stream, buf, n)
    reserved = alloc.memory_reserved()
    extra = alloc.malloc(64 * MiB, stream=int(capture_stream))   # needs a new segment
    assert alloc.memory_reserved() > reserved
    assert dev.stream_capture_info(int(capture_stream)) == (capture_id, terminals)   # still valid
    assert current_capture_mode(driver) == driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    graph = dev.end_capture(int(capture_stream))
    dev.launch_graph(graph, int(capture_stream))
    drv(driver.cuStreamSynchronize, capture_stream)
    assert (read_back(driver, buf, n) == expected_after_replay(n)).all()
    dev.destroy_graph(graph)
    assert (fill_and_read(driver, 0, extra, MiB, 0x33) == 0x33).all()   # the new memory works
    alloc.free(extra)
    alloc.free(buf)


def test_a_plain_cumemalloc_during_a_global_capture_is_refused_and_invalidates_it(driver, alloc, capture_stream):
    # Why the backend relaxes the capture mode: without it the driver refuses the allocation.
    dev = alloc.backend
    dev.begin_capture(int(capture_stream), "global")
    out = driver.cuMemAlloc(MiB)
    if int(out[0]) == 0:
        driver.cuMemFree(out[1])
    assert out[0] == driver.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert dev.stream_capture_info(int(capture_stream)) is None   # invalidated
    with pytest.raises(pyalloc.CudaError) as info:
        dev.end_capture(int(capture_stream))
    assert (info.value.call, info.value.name) == ("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    assert dev.stream_capture_info(int(capture_stream)) is None   # ended all the same


def test_querying_an_event_recorded_in_the_capture_raises_a_readable_cuda_error(driver, alloc, capture_stream):
    dev = alloc.backend
    event = drv(driver.cuEventCreate, CU_EVENT_DISABLE_TIMING)
    try:
        dev.begin_capture(int(capture_stream), "relaxed")
        drv(driver.cuEventRecord, event, capture_stream)
        with pytest.raises(pyalloc.CudaError) as info:
            dev.event_done(int(event))
        err = info.value
        assert err.call == "cuEventQuery"
        assert err.name in ("CUDA_ERROR_CAPTURED_EVENT", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
        assert str(err).startswith(f"cuEventQuery failed with {err.name} {err.result} (")
        try:
            dev.destroy_graph(dev.end_capture(int(capture_stream)))
        except pyalloc.CudaError:
            pass                                            # the query may have invalidated it
    finally:
        drv(driver.cuEventDestroy, event)


def test_begin_capture_on_the_legacy_stream_raises_cuda_error(alloc):
    try:
        alloc.backend.begin_capture(0, "global")
    except pyalloc.CudaError as exc:
        assert exc.call == "cuStreamBeginCapture"
    else:                                                   # never leave the legacy stream capturing
        alloc.backend.destroy_graph(alloc.backend.end_capture(0))
        pytest.fail("cuStreamBeginCapture on the legacy stream succeeded")
    assert alloc.backend.stream_capture_info(0) is None


def test_capture_errors_have_the_drivers_names():
    from pyalloc import _cuda
    for code, name in ((900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
                       (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
                       (907, "CUDA_ERROR_CAPTURED_EVENT")):
        got, description = _cuda.error_name(code)
        assert got == name and description
