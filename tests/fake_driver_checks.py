"""Scenarios for pyalloc's CUDA backend against tests/fake_libcuda.c; run by test_cuda_fake_driver.py.

Run in a child interpreter whose LD_LIBRARY_PATH puts the fake libcuda.so.1 first (usage:
`python fake_driver_checks.py /path/to/libcuda.so.1`). Prints one JSON object: scenario name ->
{"value": ...} or {"error": "Type: message"}. The parent test asserts on each value.
"""
import ctypes
import json
import logging
import sys
import traceback

MiB = 1 << 20
DEVICE_RANGE = 0x10000000000          # fake addresses of device d lie in [(d+1)*RANGE, (d+2)*RANGE)

fake = ctypes.CDLL(sys.argv[1])
fake.fake_count.restype = ctypes.c_long
fake.fake_count.argtypes = [ctypes.c_char_p]
fake.fake_used.restype = ctypes.c_size_t
fake.fake_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
fake.fake_launch.argtypes = [ctypes.c_size_t, ctypes.c_ulonglong]
fake.fake_complete.argtypes = [ctypes.c_size_t]

import pyalloc                      # noqa: E402  (after the fake is loaded, to show import is lazy)
from pyalloc import cuda_backend    # noqa: E402

results = {}


def scenario(fn):
    try:
        results[fn.__name__] = {"value": fn()}
    except BaseException as exc:   # recorded, asserted on by the parent
        results[fn.__name__] = {"error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()}
    fake.fake_set_current(-1)
    return fn


def device_of(ptr):
    return ptr // DEVICE_RANGE - 1


def cuda_allocator(device=0):
    return pyalloc.CachingAllocator(device, backend="cuda")


@scenario
def probe():
    return [cuda_backend.is_available(), cuda_backend.device_count(), cuda_backend.unavailable_reason()]


@scenario
def driver_version():
    from pyalloc import _cuda
    return _cuda.driver_version()


@scenario
def backend_none_picks_cuda_and_logs():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pyalloc").addHandler(handler)
    logging.getLogger("pyalloc").setLevel(logging.INFO)
    alloc = pyalloc.CachingAllocator(backend=None)
    return [alloc.backend.kind, [r.getMessage() for r in records]]


@scenario
def open_device_out_of_range():
    try:
        cuda_backend.open_device(2)
    except ValueError as exc:
        return str(exc)
    return "no error"


@scenario
def malloc_free_and_empty_cache():
    a = cuda_allocator(0)
    ptr = a.malloc(1000)
    out = {"device": device_of(ptr), "driver_used_after_malloc": fake.fake_used(0),
           "live_segments": a.backend.live_segments}
    a.free(ptr)
    out["driver_used_after_free"] = fake.fake_used(0)
    a.empty_cache()
    out["driver_used_after_empty_cache"] = fake.fake_used(0)
    out["live_segments_after"] = a.backend.live_segments
    return out


@scenario
def context_is_restored_after_a_call():
    from pyalloc import _cuda
    a = cuda_allocator(0)
    fake.fake_set_current(1)                     # the caller (say, CuPy) is on device 1
    ptr = a.malloc(4 * MiB)
    after_malloc = _cuda.current_device()
    a.free(ptr)
    a.empty_cache()
    fake.fake_set_current(-1)                    # no context current at all
    ptr2 = a.malloc(4 * MiB)
    after_none = _cuda.current_device()
    a.free(ptr2)
    a.empty_cache()
    return [device_of(ptr), after_malloc, device_of(ptr2), after_none]


@scenario
def memory_info_from_the_driver():
    a = cuda_allocator(1)
    ptr = a.malloc(5 * MiB)
    info = list(a.backend.mem_get_info())
    a.free(ptr)
    a.empty_cache()
    return info


@scenario
def out_of_memory_raises_and_stays_usable():
    a = cuda_allocator(0)
    try:
        a.malloc(100 * MiB)
        return "no error"
    except pyalloc.OutOfMemoryError as exc:
        err = [exc.requested, exc.total, exc.free]
    ptr = a.malloc(MiB)
    a._check_invariants()
    stats = a.memory_stats()
    a.free(ptr)
    a.empty_cache()
    return {"error": err, "num_ooms": stats["num_ooms"], "allocated": stats["allocated_bytes.all.current"]}


@scenario
def out_of_memory_ladder_releases_cache_and_retries():
    a = cuda_allocator(0)
    a.free(a.malloc(40 * MiB))                   # a cached 40 MiB segment
    ptr = a.malloc(50 * MiB)                     # 40 + 50 > 64 MiB: must release the cache first
    out = {"retries": a.memory_stats()["num_alloc_retries"], "driver_used": fake.fake_used(0),
           "reserved": a.memory_reserved()}
    a.free(ptr)
    a.empty_cache()
    return out


@scenario
def memory_fraction_uses_the_driver_total():
    a = cuda_allocator(0)
    a.set_memory_fraction(0.5)
    try:
        a.malloc(40 * MiB)
        return "no error"
    except pyalloc.OutOfMemoryError as exc:
        return exc.allowed


@scenario
def record_stream_defers_reuse_until_the_event_completes():
    a = cuda_allocator(0)
    creates_before = fake.fake_count(b"event_create")
    out = []
    for _ in range(2):                           # the second round reuses the pooled event
        ptr = a.malloc(MiB, stream=11)
        fake.fake_launch(12, 1)
        a.record_stream(ptr, 12)
        a.free(ptr)
        busy = a.malloc(MiB, stream=11)
        fake.fake_complete(12)
        again = a.malloc(MiB, stream=11)
        out.append([busy != ptr, again == ptr])
        a.free(busy)
        a.free(again)
    out.append(fake.fake_count(b"event_create") - creates_before)
    out.append(fake.fake_count(b"event_flags"))
    a.empty_cache()
    return out


@scenario
def empty_cache_waits_for_pending_events():
    a = cuda_allocator(0)
    ptr = a.malloc(MiB, stream=21)
    fake.fake_launch(22, 1)
    a.record_stream(ptr, 22)
    a.free(ptr)
    a.empty_cache()                              # synchronizes the event, then releases
    return [a.memory_reserved(), fake.fake_used(0)]


@scenario
def cuda_error_names_call_and_result():
    a = cuda_allocator(0)
    fake.fake_fail_next(b"cuMemAlloc", 700)
    try:
        a.malloc(MiB)
        return "no error"
    except pyalloc.CudaError as exc:
        err = [exc.call, exc.result, exc.name, str(exc), isinstance(exc, RuntimeError)]
    a._check_invariants()
    return {"error": err, "allocated": a.memory_allocated(), "reserved": a.memory_reserved()}


@scenario
def failed_segment_free_raises_cuda_error():
    a = cuda_allocator(0)
    a.free(a.malloc(MiB))
    fake.fake_fail_next(b"cuMemFree", 1)
    try:
        a.empty_cache()
        return "no error"
    except pyalloc.CudaError as exc:
        return [exc.call, exc.name]


@scenario
def failed_event_record_leaves_state_consistent():
    a = cuda_allocator(0)
    ptr = a.malloc(MiB, stream=31)
    a.record_stream(ptr, 32)
    fake.fake_fail_next(b"cuEventRecord", 400)
    try:
        a.free(ptr)
        raised = "no error"
    except pyalloc.CudaError as exc:
        raised = exc.call
    try:
        a._check_invariants()
        consistent = True
    except AssertionError as exc:
        consistent = str(exc)
    still_allocated = a.memory_allocated() == MiB
    a.free(ptr)                      # the failed free did not happen: a second one works
    return [raised, consistent, still_allocated, a.memory_allocated()]


@scenario
def close_releases_the_primary_context():
    from pyalloc._cuda import CudaDevice
    before = fake.fake_refcount(1)
    dev = CudaDevice(1)
    retained = fake.fake_refcount(1)
    a = pyalloc.CachingAllocator(1, backend=dev)
    ptr = a.malloc(MiB)
    try:
        dev.close()
        refused = "no error"
    except RuntimeError as exc:
        refused = str(exc)
    a.free(ptr)
    a.empty_cache()
    dev.close()
    dev.close()                                  # twice is harmless
    try:
        a.malloc(MiB)
        after_close = "no error"
    except RuntimeError as exc:
        after_close = str(exc)
    return [before, retained, fake.fake_refcount(1), dev.closed, refused, after_close]


@scenario
def default_allocators_follow_the_current_context():
    pyalloc.set_default_backend(None)
    fake.fake_set_current(1)
    p1 = pyalloc.malloc(MiB)                     # device=None: the current context's device
    cur = pyalloc.current_device()
    fake.fake_set_current(-1)
    p0 = pyalloc.malloc(MiB)                     # no current context: device 0
    kinds = [pyalloc.get_allocator(d).backend.kind for d in (0, 1)]
    pyalloc.free(p1)                             # looked up among the default allocators
    pyalloc.free(p0)
    out = [device_of(p1), cur, device_of(p0), kinds,
           pyalloc.memory_allocated(0), pyalloc.memory_allocated(1)]
    pyalloc.empty_cache()
    return out


@scenario
def default_allocator_rejects_an_invisible_device():
    try:
        pyalloc.malloc(MiB, device=5)
        return "no error"
    except ValueError as exc:
        return str(exc)


@scenario
def pointer_device_from_the_driver():
    from pyalloc import _cuda
    ptr = pyalloc.malloc(MiB, device=1)
    d = _cuda.pointer_device(ptr)
    pyalloc.free(ptr)
    return d


print(json.dumps(results))
