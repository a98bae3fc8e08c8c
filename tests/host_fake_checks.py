"""Scenarios for the CUDA host backend (pyalloc/_cuda_host.pyx) against tests/fake_libcuda.c; run
by test_host_fake_driver.py in a child interpreter with the fake first on LD_LIBRARY_PATH (usage:
`python host_fake_checks.py /path/to/libcuda.so.1`). Prints one JSON object: scenario name ->
{"value": ...} or {"error": ...}."""
import ctypes
import json
import sys
import traceback

fake = ctypes.CDLL(sys.argv[1])
fake.fake_count.restype = ctypes.c_long
fake.fake_count.argtypes = [ctypes.c_char_p]
fake.fake_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
fake.fake_launch.argtypes = [ctypes.c_size_t, ctypes.c_ulonglong]
fake.fake_complete.argtypes = [ctypes.c_size_t]

import pyalloc                               # noqa: E402
from pyalloc import cuda_backend             # noqa: E402
from pyalloc.host import HostAllocator       # noqa: E402

results = {}


def scenario(fn):
    try:
        results[fn.__name__] = {"value": fn()}
    except BaseException as exc:
        results[fn.__name__] = {"error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()}
    return fn


def count(what):
    return fake.fake_count(what.encode())


def host(config=""):
    return HostAllocator(cuda_backend.open_device(0), config=config)


def calls():
    return {k: count(k) for k in ("host_alloc", "host_free", "host_register", "host_unregister")}


@scenario
def default_path_uses_cumemhostalloc_once_per_block():
    h = host()
    before = calls()
    p = h.malloc(5000)
    h.free(p)
    q = h.malloc(8192)                        # a hit: no driver call
    h.free(q)
    h.empty_cache()
    after = calls()
    return {"same": p == q, **{k: after[k] - before[k] for k in after}}


@scenario
def register_path_uses_malloc_and_cumemhostregister():
    h = host("pinned_use_cuda_host_register:True,pinned_num_register_threads:4")
    before = calls()
    p = h.malloc(1 << 20)
    ctypes.memset(p, 7, 1 << 20)             # real, writable memory
    h.free(p)
    h.empty_cache()
    after = calls()
    return {k: after[k] - before[k] for k in after}


@scenario
def failed_cumemhostalloc_raises_and_changes_nothing():
    h = host()
    before = h.host_memory_stats()
    fake.fake_fail_next(b"cuMemHostAlloc", 2)
    try:
        h.malloc(4096)
        raised = None
    except pyalloc.CudaError as exc:
        raised = [exc.call, exc.result]
    return {"raised": raised, "unchanged": h.host_memory_stats() == before}


@scenario
def failed_cumemhostregister_frees_the_pages_and_changes_nothing():
    h = host("pinned_use_cuda_host_register:True")
    before, c0 = h.host_memory_stats(), calls()
    fake.fake_fail_next(b"cuMemHostRegister", 2)
    try:
        h.malloc(4096)
        raised = None
    except pyalloc.CudaError as exc:
        raised = [exc.call, exc.result]
    return {"raised": raised, "unchanged": h.host_memory_stats() == before,
            "registered": calls()["host_register"] - c0["host_register"]}


@scenario
def a_recorded_block_waits_for_the_driver_event():
    h = host()
    p = h.malloc(4096)
    fake.fake_launch(31, 1)
    h.record_event(p, 31)
    h.free(p)
    q = h.malloc(4096)                        # the event is pending: another block
    fake.fake_complete(31)
    h.free(q)
    r = h.malloc(4096)                        # collected now: p is back, last in its list
    return {"second_is_other": q != p, "after_completion": r == p}


print(json.dumps(results))
