"""pyalloc's C entry points (pyalloc._capi, pyalloc_capi.h) and the PyTorch allocator library,
called through ctypes on simulated default allocators: no GPU and no torch needed.

ctypes.CDLL functions release the GIL for the call, so Python threads calling the entry points
through them are C callers without the GIL; ctypes.PyDLL functions keep it (a C caller that holds
the GIL, as torch.empty is).
"""
import ctypes
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest

import pyalloc
from pyalloc import _capi

from units import KiB, MiB, GiB

MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_size_t))
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t)
CODE = ctypes.CFUNCTYPE(ctypes.c_int)
MESSAGE = ctypes.CFUNCTYPE(ctypes.c_char_p)


class Table(ctypes.Structure):
    """pyalloc_capi (pyalloc_capi.h), field for field."""
    _fields_ = [("version", ctypes.c_uint32), ("size", ctypes.c_uint32), ("malloc", MALLOC),
                ("free", FREE), ("record_stream", RECORD), ("error_code", CODE),
                ("error_message", MESSAGE), ("take_error", ctypes.c_void_p),
                ("release_error", ctypes.c_void_p), ("raise_error", ctypes.c_void_p),
                ("empty_cache", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int))]


def table():
    return Table.from_address(_capi.table_address())


def c_malloc(size, stream=0, device=0):
    """(code, pointer) from the table's malloc, called without the GIL."""
    out = ctypes.c_size_t()
    return table().malloc(device, size, stream, ctypes.byref(out)), out.value


def sim_device(device, latency_us=0):
    sim = pyalloc.SimDevice(GiB, device=device, base_address=0x7F0000000000 + device * (1 << 40))
    sim.latency_us = latency_us
    return sim


@pytest.fixture
def sim_defaults():
    pyalloc.set_default_backend(sim_device)
    _capi.clear_last_error()
    yield
    pyalloc.set_default_backend(None)


# ------------------------------------------------------------------------------- the table

def test_capsule_holds_the_table_under_its_documented_name():
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    assert get_name(_capi.table) == b"pyalloc._capi.table" == _capi.CAPSULE_NAME.encode()
    assert get_pointer(_capi.table, b"pyalloc._capi.table") == _capi.table_address()


def test_table_reports_its_version_and_size():
    t = table()
    assert t.version == _capi.VERSION == 1
    assert t.size == ctypes.sizeof(Table)


def test_malloc_and_free_through_the_table_use_the_default_allocator(sim_defaults):
    code, ptr = c_malloc(1000)
    assert code == 0 and ptr != 0
    assert pyalloc.memory_allocated(0) == 1024
    assert _capi.published_allocator(0) is pyalloc.get_allocator(0)
    assert table().free(0, ptr) == 0
    assert pyalloc.memory_allocated(0) == 0


def test_cache_hits_through_the_table_take_no_slow_path_and_a_miss_does(sim_defaults):
    code, ptr = c_malloc(1 << 20)                      # a miss: a new segment, with the GIL
    assert code == 0 and table().free(0, ptr) == 0
    before = _capi.slow_path_calls()
    for _ in range(10):
        code, ptr = c_malloc(1 << 20)
        assert code == 0 and table().free(0, ptr) == 0
    assert _capi.slow_path_calls() == before
    code, big = c_malloc(64 << 20)                     # no cached block this large
    assert code == 0 and table().free(0, big) == 0
    after = _capi.slow_path_calls()
    assert after["malloc"] == before["malloc"] + 1 and after["free"] == before["free"]


def test_cache_hit_through_the_table_reuses_the_freed_block(sim_defaults):
    _, first = c_malloc(4096)
    table().free(0, first)
    segments = pyalloc.memory_stats(0)["segment.all.allocated"]
    code, second = c_malloc(4096)
    assert (code, second) == (0, first)
    assert pyalloc.memory_stats(0)["segment.all.allocated"] == segments     # no new segment
    table().free(0, second)


def test_zero_bytes_give_a_null_pointer_and_free_of_null_does_nothing(sim_defaults):
    assert c_malloc(0) == (0, 0)
    assert table().free(0, 0) == 0
    assert pyalloc.memory_allocated(0) == 0


def test_double_free_returns_a_bad_argument_code_and_keeps_the_exception(sim_defaults):
    _, ptr = c_malloc(512)
    table().free(0, ptr)
    assert table().free(0, ptr) == _capi.ERROR_CODES["bad_argument"]
    code, message, exc = _capi.last_error()
    assert code == table().error_code() == 2
    assert "double free" in message and message.encode() == table().error_message()
    assert isinstance(exc, ValueError)
    with pytest.raises(ValueError, match="double free"):
        _capi.raise_last_error()


def test_out_of_memory_returns_its_code_and_raises_pyallocs_error_afterwards(sim_defaults):
    code, ptr = c_malloc(2 * GiB)
    assert (code, ptr) == (_capi.ERROR_CODES["out_of_memory"], 0)
    assert "out of memory" in table().error_message().decode()
    with pytest.raises(pyalloc.OutOfMemoryError) as info:
        _capi.raise_last_error()
    assert info.value.requested == 2 * GiB
    assert pyalloc.memory_allocated(0) == 0


def test_bad_device_returns_a_bad_argument_code(sim_defaults):
    assert c_malloc(512, device=-3)[0] == 2
    assert "device" in _capi.last_error()[1]


def test_errors_are_kept_per_thread(sim_defaults):
    _, ptr = c_malloc(512)
    table().free(0, ptr)
    table().free(0, ptr)                       # this thread: double free
    seen = []
    worker = threading.Thread(target=lambda: seen.append((c_malloc(4 * GiB)[0], _capi.last_error()[0])))
    worker.start()
    worker.join()
    assert seen == [(1, 1)]                    # the other thread: its own out-of-memory
    assert _capi.last_error()[0] == 2


def test_exception_translator_changes_the_kept_exception(sim_defaults):
    class Translated(MemoryError):
        pass
    _capi.set_exception_translator(lambda exc: Translated(str(exc)))
    try:
        c_malloc(2 * GiB)
        assert isinstance(_capi.last_error()[2], Translated)
    finally:
        _capi.set_exception_translator(None)


def test_record_stream_through_the_table_delays_reuse_until_the_stream_is_done(sim_defaults):
    sim = pyalloc.get_allocator(0).backend
    other = sim.create_stream()
    _, ptr = c_malloc(MiB)
    sim.launch(other, 1)                       # pending work on the other stream
    assert table().record_stream(0, ptr, other) == 0
    table().free(0, ptr)
    assert pyalloc.memory_stats(0)["active_bytes.all.current"] == MiB   # waits for the stream
    _, again = c_malloc(MiB)
    assert again != ptr
    table().free(0, again)
    sim.synchronize()


def test_record_stream_with_device_minus_one_finds_the_owner(sim_defaults):
    pyalloc.get_allocator(1)
    code, ptr = c_malloc(MiB, device=1)
    stream = pyalloc.get_allocator(1).backend.create_stream()
    assert table().record_stream(-1, ptr, stream) == 0
    assert ptr in [b["address"] for s in pyalloc.get_allocator(1)._segments() for b in s["blocks"]
                   if stream in b.get("stream_uses", [stream])]
    table().free(1, ptr)


def test_empty_cache_through_the_table_releases_cached_segments(sim_defaults):
    _, ptr = c_malloc(4 * MiB)
    table().free(0, ptr)
    assert pyalloc.memory_reserved(0) > 0
    assert table().empty_cache(-1) == 0
    assert pyalloc.memory_reserved(0) == 0


def test_changing_the_default_backend_republishes_the_allocator(sim_defaults):
    _, ptr = c_malloc(512)
    table().free(0, ptr)
    old = _capi.published_allocator(0)
    pyalloc.set_default_backend(sim_device)
    assert _capi.published_allocator(0) is None
    _, ptr = c_malloc(512)
    assert _capi.published_allocator(0) is pyalloc.get_allocator(0) is not old
    table().free(0, ptr)


# ------------------------------------------------------------------------------- the torch library

def torch_library(kind=ctypes.CDLL):
    from pyalloc import torch as pt
    pt.library()                                    # loads and binds it
    lib = kind(pt.library_path())
    lib.pyalloc_torch_malloc.restype = ctypes.c_void_p
    lib.pyalloc_torch_malloc.argtypes = (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    lib.pyalloc_torch_free.restype = None
    lib.pyalloc_torch_free.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    lib.pyalloc_torch_record_stream.restype = None
    lib.pyalloc_torch_record_stream.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    return lib


def test_importing_pyalloc_torch_does_not_import_torch():
    code = "import sys, pyalloc.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), check=True)
    assert out.stdout.strip() == "False"


def test_torch_library_exports_the_symbols_pytorch_loads():
    from pyalloc import torch as pt
    lib = ctypes.CDLL(pt.library_path())
    for name in (pt.ALLOC_SYMBOL, pt.FREE_SYMBOL, "pyalloc_torch_bind", "pyalloc_torch_record_stream",
                 "pyalloc_torch_empty_cache"):
        assert pt.symbol_address(name) == ctypes.cast(getattr(lib, name), ctypes.c_void_p).value != 0


@pytest.mark.parametrize("version, known", [
    ("2.11.0+cu130", True), ("2.0.1", True), ("1.13.1", False), ("3.0.0", False)])
def test_torch_oom_carries_python_errors_only_for_checked_torch_versions(version, known):
    import pyalloc.torch
    assert pyalloc.torch.python_error_layout_known(version) is known


def test_torch_library_exports_the_error_mode_switch():
    import pyalloc.torch
    lib = pyalloc.torch.library()
    lib.pyalloc_torch_carry_python_errors.argtypes = (ctypes.c_int,)
    lib.pyalloc_torch_carry_python_errors(0)
    lib.pyalloc_torch_carry_python_errors(1)
    assert pyalloc.torch.symbol_address("pyalloc_torch_carry_python_errors")


def test_torch_library_is_bound_to_pyallocs_table():
    lib = torch_library()
    assert lib.pyalloc_torch_is_bound() == 1


def test_torch_library_refuses_a_table_of_another_version():
    from pyalloc import torch as pt
    lib = ctypes.CDLL(pt.library_path())
    lib.pyalloc_torch_bind.argtypes = (ctypes.c_void_p,)
    fake = Table(version=99, size=ctypes.sizeof(Table))
    assert lib.pyalloc_torch_bind(ctypes.addressof(fake)) == -1
    assert lib.pyalloc_torch_is_bound() == 1             # still bound to the real table


def test_torch_library_allocates_and_frees_through_the_default_allocator(sim_defaults):
    lib = torch_library()
    ptr = lib.pyalloc_torch_malloc(3000, 0, None)
    assert ptr and pyalloc.memory_allocated(0) == 3072
    lib.pyalloc_torch_free(ptr, 3000, 0, None)
    assert pyalloc.memory_allocated(0) == 0


def test_torch_library_allocates_for_the_given_device_and_stream(sim_defaults):
    lib = torch_library()
    stream = pyalloc.get_allocator(1).backend.create_stream()
    ptr = lib.pyalloc_torch_malloc(MiB, 1, stream)
    seg = [s for s in pyalloc.get_allocator(1)._segments() if s["address"] <= ptr < s["address"] + s["total_size"]]
    assert seg and seg[0]["stream"] == stream
    assert pyalloc.memory_allocated(0) == 0
    lib.pyalloc_torch_free(ptr, MiB, 1, stream)
    assert pyalloc.memory_allocated(1) == 0


def bench_pair(lib):
    m, f = lib.pyalloc_torch_bench_malloc, lib.pyalloc_torch_bench_free
    m.restype, m.argtypes = ctypes.c_void_p, (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    f.restype, f.argtypes = None, (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    lib.pyalloc_torch_bench_select.argtypes = (ctypes.c_int,)
    return m, f


def test_torch_library_bench_pair_in_one_slot_mode_keeps_the_freed_block(sim_defaults):
    lib = torch_library()
    m, f = bench_pair(lib)
    lib.pyalloc_torch_bench_select(1)
    try:
        ptr = m(MiB, 0, None)
        f(ptr, MiB, 0, None)
        assert pyalloc.memory_allocated(0) == MiB          # held in the slot, not given back
        assert m(MiB, 0, None) == ptr                       # and handed out again from there
        f(ptr, MiB, 0, None)
    finally:
        lib.pyalloc_torch_bench_select(0)
    assert pyalloc.memory_allocated(0) == 0                 # selecting pyalloc gave it back


def test_torch_library_bench_pair_in_pyalloc_mode_is_pyallocs_pair(sim_defaults):
    lib = torch_library()
    m, f = bench_pair(lib)
    lib.pyalloc_torch_bench_select(0)
    ptr = m(MiB, 0, None)
    assert pyalloc.memory_allocated(0) == MiB
    f(ptr, MiB, 0, None)
    assert pyalloc.memory_allocated(0) == 0


def test_torch_library_failed_free_is_reported_on_stderr(sim_defaults):
    code = textwrap.dedent("""
        import ctypes, pyalloc, pyalloc.torch as pt
        pyalloc.set_default_backend("sim")
        pt.library()
        lib = ctypes.CDLL(pt.library_path())
        lib.pyalloc_torch_free.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        lib.pyalloc_torch_free(0x1234, 16, 0, None)
        print("alive")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=60)
    assert out.stdout.strip() == "alive"
    assert "pyalloc: free of 0x1234 on device 0 failed" in out.stderr
    assert "not allocated by this allocator" in out.stderr


# ------------------------------------------------------------------------------- threads

def test_c_caller_holding_the_gil_gives_it_up_while_it_waits_for_the_lock():
    # A Python thread holds the allocator's lock inside a backend call that released the GIL and
    # then needs the GIL back; a C caller holding the GIL (PyDLL) asks for the lock meanwhile. It
    # must wait without the GIL, or neither can go on. (In a subprocess: a deadlock there is a
    # timeout here, not a hung test run.)
    code = textwrap.dedent("""
        import ctypes, threading, time, pyalloc, pyalloc.torch as pt
        sim = pyalloc.SimDevice(1 << 30)
        pyalloc.set_default_backend(lambda d: sim)
        alloc = pyalloc.get_allocator(0)
        pt.library()
        lib = ctypes.PyDLL(pt.library_path())          # calls keep the GIL
        lib.pyalloc_torch_malloc.restype = ctypes.c_void_p
        lib.pyalloc_torch_malloc.argtypes = (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        lib.pyalloc_torch_free.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        # through the library: publishes the allocator for the cache-hit path, and caches a
        # small block that the call below is served from
        lib.pyalloc_torch_free(lib.pyalloc_torch_malloc(512, 0, None), 512, 0, None)
        inside = threading.Event()
        def slow_driver(nbytes):
            inside.set()
            time.sleep(0.3)                            # the GIL released, the lock held
        sim.segment_alloc_hook = slow_driver
        worker = threading.Thread(target=lambda: alloc.free(alloc.malloc(64 << 20)))
        worker.start()
        inside.wait()
        ptr = lib.pyalloc_torch_malloc(512, 0, None)   # waits for the lock
        worker.join()
        print("served", ptr != 0, alloc.memory_allocated())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["served", "True", "512"]


def run_contended(workers, iterations, latency_us, seed=0):
    """Threads allocating and freeing on device 0's default allocator at once: each entry of
    `workers` is "c" (the table through ctypes: no GIL) or "py" (CachingAllocator methods).
    Returns (handed-out pointers that were live twice, mallocs, frees)."""
    pyalloc.set_default_backend(lambda d: sim_device(d, latency_us))
    alloc = pyalloc.get_allocator(0)
    live, doubles, counts, guard = {}, [], [0, 0], threading.Lock()
    start = threading.Barrier(len(workers))
    errors = []

    def note_malloc(ptr):
        with guard:
            if ptr in live:
                doubles.append(ptr)
            live[ptr] = True
            counts[0] += 1

    def note_free(ptr):
        with guard:
            del live[ptr]
            counts[1] += 1

    def work(kind, rng):
        held = []
        try:
            start.wait()
            for _ in range(iterations):
                if held and (len(held) > 6 or rng.random() < 0.45):
                    ptr = held.pop(rng.randrange(len(held)))
                    note_free(ptr)
                    if kind == "c":
                        assert table().free(0, ptr) == 0, _capi.last_error()
                    else:
                        alloc.free(ptr)
                    continue
                # mostly small cache hits, now and then a size that needs a new segment
                size = rng.choice((512, 4 * KiB, 64 * KiB, 1 * MiB, 3 * MiB, 24 * MiB))
                if kind == "c":
                    code, ptr = c_malloc(size)
                    assert code == 0, _capi.last_error()
                else:
                    ptr = alloc.malloc(size)
                note_malloc(ptr)
                held.append(ptr)
            for ptr in held:
                note_free(ptr)
                if kind == "c":
                    assert table().free(0, ptr) == 0
                else:
                    alloc.free(ptr)
        except BaseException as exc:       # reported by the test, with the thread's kind
            errors.append((kind, exc))

    threads = [threading.Thread(target=work, args=(kind, random.Random(seed + i)))
               for i, kind in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "threads still running: deadlock?"
    assert errors == []
    return doubles, counts[0], counts[1]


@pytest.mark.parametrize("workers", [("c", "c", "c", "c"), ("c", "py", "c", "py")],
                         ids=["c-threads", "c-and-python-threads"])
def test_contended_threads_never_share_a_block_and_stats_balance(workers):
    try:
        doubles, mallocs, frees = run_contended(workers, iterations=400, latency_us=200)
        alloc = pyalloc.get_allocator(0)
        stats = alloc.memory_stats()
        assert doubles == []
        assert mallocs == frees and mallocs > 0
        assert stats["allocation.all.allocated"] == mallocs
        assert stats["allocation.all.freed"] == frees
        assert alloc.memory_allocated() == 0
        alloc._check_invariants()
        assert alloc.backend.counters["segment_alloc"] > 1    # the slow path ran too, contended
    finally:
        pyalloc.set_default_backend(None)


# ------------------------------------------------------------------------------- same decisions

from hypothesis import given, settings, strategies as st

OPS = st.lists(st.one_of(
    st.tuples(st.just("malloc"), st.sampled_from([1, 512, 513, 4096, 100_000, MiB, MiB + 1, 5 * MiB, 30 * MiB])),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("record"), st.integers(0, 50)),
    st.tuples(st.just("sync"), st.just(0))), max_size=60)


def replay_ops(ops, through_table):
    """Run `ops` on a fresh default allocator of device 0; returns (pointers, stats)."""
    pyalloc.set_default_backend(sim_device)
    alloc = pyalloc.get_allocator(0)
    sim = alloc.backend
    side = sim.create_stream()
    live, pointers = [], []
    for op, arg in ops:
        if op == "malloc":
            if through_table:
                code, ptr = c_malloc(arg)
                assert code == 0
            else:
                ptr = alloc.malloc(arg)
            live.append(ptr)
            pointers.append(ptr)
        elif op == "free" and live:
            ptr = live.pop(arg % len(live))
            assert (table().free(0, ptr) == 0) if through_table else alloc.free(ptr) is None
        elif op == "record" and live:
            sim.launch(side, 1)
            ptr = live[arg % len(live)]
            assert (table().record_stream(0, ptr, side) == 0) if through_table else \
                alloc.record_stream(ptr, side) is None
        elif op == "sync":
            sim.synchronize()
    stats = alloc.memory_stats()
    alloc._check_invariants()
    for ptr in live:
        alloc.free(ptr)
    sim.synchronize()
    return pointers, stats


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_entry_points_make_the_same_decisions_as_the_python_methods(ops):
    try:
        assert replay_ops(ops, through_table=True) == replay_ops(ops, through_table=False)
    finally:
        pyalloc.set_default_backend(None)
