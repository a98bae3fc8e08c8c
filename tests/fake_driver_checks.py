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

from units import MiB
DEVICE_RANGE = 0x10000000000          # fake addresses of device d lie in [(d+1)*RANGE, (d+2)*RANGE)

fake = ctypes.CDLL(sys.argv[1])
fake.fake_count.restype = ctypes.c_long
fake.fake_count.argtypes = [ctypes.c_char_p]
fake.fake_used.restype = ctypes.c_size_t
fake.fake_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
fake.fake_launch.argtypes = [ctypes.c_size_t, ctypes.c_ulonglong]
fake.fake_complete.argtypes = [ctypes.c_size_t]
fake.fake_set_stream_device.argtypes = [ctypes.c_size_t, ctypes.c_int]
fake.fake_fail_after.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
fake.fake_capture_node.restype = ctypes.c_size_t
fake.fake_capture_node.argtypes = [ctypes.c_size_t, ctypes.c_int]
fake.fake_capture_status.argtypes = [ctypes.c_size_t]
fake.fake_capture_mode.argtypes = [ctypes.c_size_t]
fake.fake_launched.restype = ctypes.c_ulonglong
fake.fake_launched.argtypes = [ctypes.c_size_t]
fake.fake_graph_launches.restype = ctypes.c_long
fake.fake_graph_launches.argtypes = [ctypes.c_size_t]
fake.fake_graph_nodes.restype = ctypes.c_long
fake.fake_graph_nodes.argtypes = [ctypes.c_size_t]
fake.fake_log.restype = ctypes.c_char_p
fake.cuMemAlloc.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]

CAPTURE_NONE, CAPTURE_ACTIVE, CAPTURE_INVALIDATED = 0, 1, 2

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


def count(what):
    return fake.fake_count(what.encode())


def driver_log():
    """The fake's log since the last reset: memory calls as name@mode, mode exchanges as
    exchange:old->new (modes: 0 global, 1 thread_local, 2 relaxed)."""
    return fake.fake_log().decode().split()


def fake_current():
    """The device whose context is current on this thread (-1: none)."""
    from pyalloc import _cuda
    return _cuda.current_device()


def cuda_error(fn, *args):
    """[call, result, name, message] of the CudaError that fn(*args) raises."""
    try:
        fn(*args)
    except pyalloc.CudaError as exc:
        return [exc.call, exc.result, exc.name, str(exc)]
    return "no error"


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
def record_stream_on_another_devices_stream():
    """A block of device 0 used on a stream of device 1: the free's event is made and recorded in
    device 1's context (the fake, as the driver, refuses an event and a stream of two contexts)."""
    a = cuda_allocator(0)
    fake.fake_set_stream_device(41, 1)
    refs_before = fake.fake_refcount(1)
    ptr = a.malloc(MiB)
    fake.fake_launch(41, 1)
    a.record_stream(ptr, 41)
    a.free(ptr)
    busy = a.malloc(MiB)
    fake.fake_complete(41)
    again = a.malloc(MiB)
    out = [busy != ptr, again == ptr, fake.fake_refcount(1) - refs_before]
    a.free(busy)
    a.free(again)
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
def a_dropped_allocation_stream_is_let_go_when_its_event_completes():
    import weakref

    class Stream:                                # a framework stream object (CuPy's has .ptr)
        def __init__(self, handle):
            self.ptr = handle

    a = cuda_allocator(0)
    s = Stream(81)
    ptr = a.malloc(MiB, stream=s)
    fake.fake_launch(81, 1)                      # work on s, still queued
    a.free(ptr)
    gone = weakref.ref(s)
    del s
    records = fake.fake_count(b"event_record")
    other = Stream(82)
    a.free(a.malloc(MiB, stream=other))          # a new stream: an event is recorded on 81
    out = [gone() is not None, fake.fake_count(b"event_record") - records]
    a.process_events()
    out.append(gone() is not None)               # the event has not completed
    fake.fake_complete(81)
    a.process_events()
    out.append(gone() is None)
    a.empty_cache()
    return out


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


# ------------------------------------------------------------------------ stream capture


@scenario
def capture_begin_passes_the_stream_and_mode():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    modes = {}
    for stream, mode in ((51, "global"), (52, "thread_local"), (53, "relaxed")):
        dev.begin_capture(stream, mode)
        modes[mode] = [fake.fake_capture_status(stream), fake.fake_capture_mode(stream)]
    dev.begin_capture(54)                       # the default mode
    modes["default"] = [fake.fake_capture_status(54), fake.fake_capture_mode(54)]
    twice = cuda_error(dev.begin_capture, 51, "global")
    legacy = cuda_error(dev.begin_capture, 0, "global")
    for stream in (51, 52, 53, 54):
        dev.destroy_graph(dev.end_capture(stream))
    return {"modes": modes, "twice": twice, "legacy": legacy, "current_after": fake_current()}


@scenario
def capture_info_reports_the_capture_id_and_terminals():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    out = {"before": dev.stream_capture_info(61)}
    dev.begin_capture(61, "global")
    first_id, out["empty"] = dev.stream_capture_info(61)
    fake.fake_launch(61, 1)
    n1 = dev.stream_capture_info(61)[1]
    root = fake.fake_capture_node(61, 0)             # joined from another stream: a 2nd terminal
    n1_and_root = dev.stream_capture_info(61)[1]
    out["terminals"] = [n1_and_root == n1 + [root], len(n1) == 1 and n1[0] != 0]
    fake.fake_launch(61, 1)                           # depends on both, replaces them
    joined = dev.stream_capture_info(61)[1]
    out["joined"] = [len(joined) == 1, joined[0] not in n1_and_root]
    dev.destroy_graph(dev.end_capture(61))
    out["after"] = dev.stream_capture_info(61)
    dev.begin_capture(61, "global")
    second_id = dev.stream_capture_info(61)[0]
    dev.destroy_graph(dev.end_capture(61))
    out["ids"] = [first_id >= 1, second_id > first_id]
    fake.fake_set_current(1)                          # the caller on another device
    dev.stream_capture_info(61)
    out["current_after"] = fake_current()
    return out


@scenario
def capture_info_of_an_invalidated_capture_is_none():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    dev.begin_capture(62, "global")
    ptr = ctypes.c_ulonglong()
    fake.fake_set_current(0)
    # A cuMemAlloc that is not relaxed, as a caller outside pyalloc might make: refused, and the
    # capture is invalidated (the driver's rule, modelled by the fake).
    refused = fake.cuMemAlloc(ctypes.byref(ptr), MiB)
    status = fake.fake_capture_status(62)
    info = dev.stream_capture_info(62)
    end = cuda_error(dev.end_capture, 62)
    return [refused, status, info, end, dev.stream_capture_info(62)]


@scenario
def capture_info_on_the_legacy_stream_during_a_capture_raises():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    dev.begin_capture(63, "global")
    try:
        return cuda_error(dev.stream_capture_info, 0)
    finally:
        dev.destroy_graph(dev.end_capture(63))


@scenario
def capture_info_error_raises_cuda_error():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    fake.fake_fail_next(b"cuStreamGetCaptureInfo", 1)
    return cuda_error(dev.stream_capture_info, 64)


@scenario
def node_parents_come_from_cugraphnodegetdependencies():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    dev.begin_capture(65, "global")
    fake.fake_launch(65, 1)
    (n1,) = dev.stream_capture_info(65)[1]
    fake.fake_launch(65, 1)
    (n2,) = dev.stream_capture_info(65)[1]
    root = fake.fake_capture_node(65, 0)
    fake.fake_launch(65, 1)
    (n3,) = dev.stream_capture_info(65)[1]
    counts_before = [count("deps_count"), count("deps_fill")]
    out = {"n1": dev.node_parents(n1), "n2": dev.node_parents(n2) == [n1],
           "n3": dev.node_parents(n3) == [n2, root]}
    # Three queries of the count; two fills (a node without parents needs none).
    out["calls"] = [count("deps_count") - counts_before[0], count("deps_fill") - counts_before[1]]
    out["bad"] = cuda_error(dev.node_parents, 0xDEAD)
    dev.destroy_graph(dev.end_capture(65))
    return out


@scenario
def graph_launch_instantiates_once_and_replays():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    dev.begin_capture(66, "global")
    fake.fake_launch(66, 3)
    graph = dev.end_capture(66)
    out = {"graph": [graph != 0, fake.fake_graph_nodes(graph), fake.fake_capture_status(66)]}
    inst0, launch0, work0 = count("instantiate"), count("launch"), fake.fake_launched(67)
    fake.fake_set_current(-1)                          # no context: ours is made current
    dev.launch_graph(graph, 67)
    dev.launch_graph(graph, 67)
    out["replays"] = [count("instantiate") - inst0, count("launch") - launch0,
                      fake.fake_graph_launches(graph), fake.fake_launched(67) - work0,
                      count("instantiate_flags")]
    out["current_after"] = fake_current()
    live = [count("graphs_live"), count("execs_live")]
    dev.destroy_graph(graph)
    out["destroyed"] = [live[0] - count("graphs_live"), live[1] - count("execs_live")]
    return out


@scenario
def graph_destroy_without_launch_destroys_only_the_graph():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    dev.begin_capture(68)
    graph = dev.end_capture(68)                        # an empty capture is a valid graph
    execs, graphs = count("exec_destroy"), count("graph_destroy")
    dev.destroy_graph(graph)
    return [count("exec_destroy") - execs, count("graph_destroy") - graphs]


@scenario
def capture_and_graph_errors_raise_cuda_error():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    out = {"end_not_capturing": cuda_error(dev.end_capture, 69)}
    dev.begin_capture(69)
    fake.fake_launch(69, 1)
    graph = dev.end_capture(69)
    fake.fake_fail_next(b"cuGraphInstantiateWithFlags", 2)
    out["instantiate"] = cuda_error(dev.launch_graph, graph, 70)
    inst = count("instantiate")
    dev.launch_graph(graph, 70)                        # nothing was cached: instantiated now
    out["instantiated_after_failure"] = count("instantiate") - inst
    fake.fake_fail_next(b"cuGraphLaunch", 1)
    out["launch"] = cuda_error(dev.launch_graph, graph, 70)
    dev.launch_graph(graph, 70)                        # the executable graph stays cached
    out["instantiated_after_launch_failure"] = count("instantiate") - inst
    fake.fake_fail_next(b"cuStreamBeginCapture", 1)
    out["begin"] = cuda_error(dev.begin_capture, 69)
    fake.fake_fail_next(b"cuGraphExecDestroy", 400)
    out["exec_destroy"] = cuda_error(dev.destroy_graph, graph)
    out["bad_graph"] = cuda_error(dev.destroy_graph, 0xBAD0)
    try:
        dev.begin_capture(69, "sideways")
        out["bad_mode"] = "no error"
    except ValueError as exc:
        out["bad_mode"] = str(exc)
    return out


@scenario
def close_destroys_the_cached_executable_graphs():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    dev.begin_capture(77)
    fake.fake_launch(77, 1)
    graph = dev.end_capture(77)
    dev.launch_graph(graph, 77)
    before = [dev.instantiated_graphs, count("execs_live")]
    dev.close()
    after = [dev.instantiated_graphs, count("execs_live")]
    graphs = count("graphs_live")
    dev2 = CudaDevice(0)
    dev2.destroy_graph(graph)                          # the graph is still the caller's
    dev2.close()
    return [before[0], after[0], before[1] - after[1], graphs - count("graphs_live")]


# --------------------------------------------------------------- relaxed mode around memory


@scenario
def segment_alloc_and_free_run_in_relaxed_mode_and_restore_it():
    a = cuda_allocator(0)
    fake.fake_log_reset()
    exchanges = count("exchange")
    ptr = a.malloc(MiB)                                # a new segment
    alloc_log = driver_log()
    per_alloc = count("exchange") - exchanges
    a.free(ptr)
    fake.fake_log_reset()
    exchanges = count("exchange")
    again = a.malloc(MiB)                              # a cache hit: no driver call at all
    hit = [again == ptr, count("exchange") - exchanges, driver_log()]
    a.free(again)
    fake.fake_log_reset()
    a.empty_cache()
    free_log = driver_log()
    fake.fake_set_thread_mode(1)                       # a caller in thread_local mode
    fake.fake_log_reset()
    a.free(a.malloc(MiB))
    a.empty_cache()
    thread_local_log = driver_log()
    mode_after = fake.fake_thread_mode()
    fake.fake_set_thread_mode(0)
    return {"alloc": alloc_log, "per_alloc": per_alloc, "hit": hit, "free": free_log,
            "thread_local": thread_local_log, "mode_after": mode_after}


@scenario
def relaxed_mode_is_restored_when_the_allocation_fails():
    a = cuda_allocator(0)
    fake.fake_log_reset()
    fake.fake_fail_next(b"cuMemAlloc", 700)
    error = cuda_error(a.malloc, MiB)
    error_log, error_mode = driver_log(), fake.fake_thread_mode()
    fake.fake_log_reset()
    try:
        a.malloc(100 * MiB)                            # more than the fake's 64 MiB
        oom = "no error"
    except pyalloc.OutOfMemoryError:
        oom = "OutOfMemoryError"
    oom_log, oom_mode = driver_log(), fake.fake_thread_mode()
    return {"error": error[:3], "error_log": error_log, "error_mode": error_mode,
            "oom": oom, "oom_log": oom_log, "oom_mode": oom_mode}


@scenario
def a_failed_mode_exchange_raises_and_allocates_nothing():
    a = cuda_allocator(0)
    allocs = count("alloc")
    fake.fake_fail_next(b"cuThreadExchangeStreamCaptureMode", 1)
    first = cuda_error(a.malloc, MiB)
    nothing_allocated = count("alloc") == allocs and a.memory_reserved() == 0
    fake.fake_fail_after(b"cuThreadExchangeStreamCaptureMode", 1, 1)   # the restoring exchange
    restore = cuda_error(a.malloc, MiB)
    fake.fake_set_thread_mode(0)
    return [first[:3], nothing_allocated, restore[:3]]


@scenario
def a_new_segment_during_a_global_capture_keeps_the_capture_valid():
    a = cuda_allocator(0)
    dev = a.backend
    dev.begin_capture(71, "global")
    fake.fake_launch(71, 1)
    before = dev.stream_capture_info(71)
    fake.fake_log_reset()
    ptr = a.malloc(30 * MiB, stream=71)                # a new segment while 71 captures
    log = driver_log()
    after = dev.stream_capture_info(71)
    status = fake.fake_capture_status(71)
    graph = dev.end_capture(71)
    dev.destroy_graph(graph)
    a.free(ptr)
    a.empty_cache()
    return {"log": log, "same_capture": after == before, "status": status,
            "mode_after": fake.fake_thread_mode()}


@scenario
def expandable_segments_map_and_unmap_in_relaxed_mode():
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True")
    dev = a.backend
    dev.begin_capture(72, "global")
    fake.fake_launch(72, 1)
    fake.fake_log_reset()
    ptr = a.malloc(6 * MiB, stream=72)                 # reserve address space, map pages
    grow_log = driver_log()
    status = fake.fake_capture_status(72)
    mapped = [dev.mapped_bytes, count("mapped_live")]
    dev.destroy_graph(dev.end_capture(72))
    a.free(ptr)
    fake.fake_log_reset()
    a.empty_cache()                                    # unmap, release
    shrink_log = driver_log()
    return {"grow": grow_log, "status": status, "mapped": mapped, "shrink": shrink_log,
            "after": [dev.mapped_bytes, count("mapped_live"), count("reserved_live")],
            "mode_after": fake.fake_thread_mode()}


@scenario
def recycle_pages_maps_kept_handles_again():
    # A free 8 MiB hole before a live block; a growth of another stream takes the hole's pages:
    # cuMemUnmap without cuMemRelease, then cuMemMap of the same handles, no cuMemCreate.
    # (The fake's device memory is shared with the other scenarios: figures are differences.)
    base = fake.fake_used(0)
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True,recycle_pages:True")
    hole = a.malloc(8 * MiB, stream=91)
    live = a.malloc(4 * MiB, stream=91)
    a.free(hole)
    used = fake.fake_used(0)
    fake.fake_log_reset()
    syncs = count("ctx_synchronize")
    ptr = a.malloc(6 * MiB, stream=92)
    grow_log = [e.split("@")[0] for e in driver_log() if not e.startswith("exchange")]
    out = {"grow": grow_log, "grow_syncs": count("ctx_synchronize") - syncs,
           "used": [used, fake.fake_used(0)],
           "reserved": [a.memory_reserved(), fake.fake_used(0) - base],
           "remaps": a.memory_stats()["num_page_remaps"]}
    a.free(ptr)
    # A growth inside use_mem_pool that runs out of memory keeps the pages it took; empty_cache
    # releases them.
    pool = a.mem_pool()
    try:
        with a.use_mem_pool(pool):
            a.malloc(1 << 40, stream=93)
    except pyalloc.OutOfMemoryError:
        pass
    kept = a.memory_stats()["page_pool_bytes"]
    del pool
    a.empty_cache()
    out["kept_then_released"] = [kept, a.memory_stats()["page_pool_bytes"], a.memory_reserved(),
                                 fake.fake_used(0) - base]
    a.free(live)
    a.empty_cache()
    return out


@scenario
def exhausted_address_space_is_out_of_memory_and_the_ladder_releases_empty_segments():
    # Each stream's expandable segment reserves about the device's size of address space; a
    # program that makes many streams can exhaust it (CUDA_ERROR_OUT_OF_MEMORY from
    # cuMemAddressReserve, seen in the H200 soak). The ladder must release the cached segments of
    # other streams, their reservations with them, and retry, not fail with a CudaError.
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True")
    ptr = a.malloc(6 * MiB, stream=81)
    a.free(ptr)                                        # stream 81's segment: cached, all free
    reserved_before = count("reserved_live")
    fake.fake_fail_next(b"cuMemAddressReserve", 2)     # CUDA_ERROR_OUT_OF_MEMORY
    ptr2 = a.malloc(6 * MiB, stream=82)                # a new stream needs a new reservation
    out = {"reserved_before": reserved_before, "reserved_after": count("reserved_live"),
           "retries": a.memory_stats()["num_alloc_retries"],
           "ooms": a.memory_stats()["num_ooms"]}
    a.free(ptr2)
    a.empty_cache()
    return out


# ------------------------------------------------------------------ events during capture


@scenario
def event_calls_during_a_capture_raise_readable_cuda_errors():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    fake.fake_launch(73, 1)
    outside = dev.record_event(73)                    # pending work, recorded before the capture
    dev.begin_capture(74, "global")
    out = {"query": cuda_error(dev.event_done, outside)}
    out["query_invalidated"] = fake.fake_capture_status(74) == CAPTURE_INVALIDATED
    out["end"] = cuda_error(dev.end_capture, 74)[:3]
    dev.begin_capture(75, "global")
    out["synchronize"] = cuda_error(dev.wait_event, outside)[:3]
    cuda_error(dev.end_capture, 75)
    dev.begin_capture(76, "relaxed")                   # relaxed: nothing is unsafe...
    inside = dev.record_event(76)
    out["relaxed_query_outside"] = dev.event_done(outside)
    out["captured_query"] = cuda_error(dev.event_done, inside)[:3]   # ...but a captured event is
    out["captured_synchronize"] = cuda_error(dev.wait_event, inside)[:3]
    dev.destroy_graph(dev.end_capture(76))
    dev.destroy_event(inside)
    dev.destroy_event(outside)
    return out


@scenario
def capture_error_names_are_readable():
    from pyalloc import _cuda
    return {code: list(_cuda.error_name(code)) for code in (900, 901, 906, 907, 908)}


def wait_event(stream, event):
    """cuStreamWaitEvent through the fake itself (CudaDevice makes no such call)."""
    return fake.cuStreamWaitEvent(ctypes.c_size_t(stream), ctypes.c_void_p(event), 0)


def capture_of(dev, stream):
    """(capture id, terminals) of `stream`, or None."""
    return dev.stream_capture_info(stream)


@scenario
def a_captured_event_forks_the_capture_and_its_end_needs_the_join():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    fake.fake_set_current(0)
    out = {}
    dev.begin_capture(71, "global")
    fake.fake_launch(71, 1)
    fork = dev.record_event(71)
    out["wait"] = wait_event(72, fork)
    out["joined"] = [capture_of(dev, 72) == capture_of(dev, 71)]    # same id, after the same node
    node = fake.fake_capture_node(72, 1)
    out["end"] = cuda_error(dev.end_capture, 71)[:3]                # 72's node is not joined back
    out["after"] = [capture_of(dev, 71), capture_of(dev, 72), node != 0]
    dev.begin_capture(71, "global")
    fork_again = dev.record_event(71)
    wait_event(73, fork_again)
    fake.fake_capture_node(73, 1)
    join = dev.record_event(73)
    out["join"] = wait_event(71, join)
    out["origin_terminals"] = len(capture_of(dev, 71)[1])         # its own (none) and 73's node
    graph = dev.end_capture(71)
    out["joined_back"] = [graph != 0, capture_of(dev, 73), fake.fake_graph_nodes(graph)]
    dev.destroy_graph(graph)
    for event in (fork, fork_again, join):
        dev.destroy_event(event)
    return out


@scenario
def capture_waits_the_driver_refuses():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    fake.fake_set_current(0)
    out = {}
    outside = dev.record_event(74)                                  # recorded outside any capture
    dev.begin_capture(75, "global")
    out["isolation"] = [wait_event(75, outside), fake.fake_capture_status(75)]
    out["isolated_end"] = cuda_error(dev.end_capture, 75)[:3]
    dev.begin_capture(75, "global")
    fork = dev.record_event(75)
    wait_event(76, fork)
    out["end_on_joined"] = [cuda_error(dev.end_capture, 76)[:3], fake.fake_capture_status(75)]
    out["end_on_origin"] = cuda_error(dev.end_capture, 75)[:3]
    out["ended_event"] = wait_event(77, fork)                      # its capture is over
    dev.begin_capture(78, "global")
    dev.begin_capture(79, "global")
    other = dev.record_event(79)
    out["merge"] = [wait_event(78, other), fake.fake_capture_status(78), fake.fake_capture_status(79)]
    for stream in (78, 79):
        cuda_error(dev.end_capture, stream)
    for event in (outside, fork, other):
        dev.destroy_event(event)
    return out


@scenario
def a_captured_memset_is_a_node_after_the_streams_terminals():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    fake.fake_set_current(0)
    fake.cuMemsetD8Async.argtypes = [ctypes.c_ulonglong, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_size_t]
    outside = [fake.cuMemsetD8Async(0x1000, 0, 1, 80), fake.fake_launched(80)]   # no work modelled
    dev.begin_capture(80, "global")
    fake.fake_launch(80, 1)
    first = capture_of(dev, 80)[1]
    result = fake.cuMemsetD8Async(0x1000, 0, 1, 80)
    memset = capture_of(dev, 80)[1]
    parents = dev.node_parents(memset[0])
    dev.destroy_graph(dev.end_capture(80))
    return {"outside": outside, "inside": [result, len(memset), memset != first, parents == first]}


@scenario
def a_destroyed_streams_event_follows_its_own_work_not_the_next_stream_with_its_handle():
    from pyalloc._cuda import CudaDevice
    dev = CudaDevice(0)
    fake.fake_set_current(0)
    fake.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint]
    fake.cuStreamDestroy.argtypes = [ctypes.c_size_t]
    first = ctypes.c_size_t()
    fake.cuStreamCreate(ctypes.byref(first), 1)
    fake.fake_launch(first.value, 1)
    event = dev.record_event(first.value)
    destroyed = fake.cuStreamDestroy(first.value)
    again = ctypes.c_size_t()
    fake.cuStreamCreate(ctypes.byref(again), 1)
    fake.fake_complete(again.value)                 # the new stream's work: none of the old
    out = [destroyed, again.value == first.value, fake.fake_launched(again.value), dev.event_done(event)]
    dev.synchronize()                               # the destroyed stream's work completes too
    out.append(dev.event_done(event))
    fake.cuStreamDestroy(again.value)
    dev.destroy_event(event)
    return out


# Last: a failed cuMemFree leaves its segment with the allocator and the fake.
@scenario
def relaxed_mode_is_restored_when_each_memory_call_fails():
    # The caller is in thread_local mode (1), so that a mode left relaxed (2) or set to global
    # (0) shows. Each entry: [CudaError's call, result, name], the log, the mode afterwards.
    out = {}
    fake.fake_set_thread_mode(1)
    try:
        a = cuda_allocator(0)
        a.free(a.malloc(MiB))
        fake.fake_fail_next(b"cuMemFree", 700)
        fake.fake_log_reset()
        out["free"] = [cuda_error(a.empty_cache)[:3], driver_log(), fake.fake_thread_mode()]
        e = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True")
        fake.fake_fail_next(b"cuMemAddressReserve", 700)
        fake.fake_log_reset()
        out["reserve"] = [cuda_error(e.malloc, 6 * MiB)[:3], driver_log(), fake.fake_thread_mode()]
        fake.fake_fail_next(b"cuMemCreate", 700)
        fake.fake_log_reset()
        out["map"] = [cuda_error(e.malloc, 6 * MiB)[:3], driver_log(), fake.fake_thread_mode()]
    finally:
        fake.fake_set_thread_mode(0)
    return out


print(json.dumps(results))
