"""Specification of the CUDA-facing edges that run without a GPU: lazy driver detection, backend
choice, the module-level default allocators (on the simulated device), stream and array protocols,
and pyalloc.cupy against a stand-in `cupy` module.

The real driver path is covered by test_cuda_fake_driver.py (a fake libcuda) and, on the GPU
machine, by test_cuda_gpu.py and test_cupy_gpu.py.
"""
import contextlib
import gc
import logging
import os
import pickle
import subprocess
import sys
import threading
import types

import pytest
from hypothesis import given, settings, strategies as st

import pyalloc
from pyalloc import cuda_backend
from pyalloc.errors import NoCudaDriverError, OutOfMemoryError

from units import MiB, GiB


def run_python(code, **env):
    """Run `code` in a fresh interpreter (same sys.path); returns its stdout, stripped."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **env)
    # cwd: the tests folder, so that a source checkout's pyalloc/ (no compiled modules when the
    # package is installed elsewhere) never shadows the installed package on `-c`'s sys.path.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=full_env, timeout=120, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def sim_factory(device):
    """A 1 GiB simulated device with its own address range (pointers name their device, as on CUDA),
    taking any stream handle (any_stream: the stand-in frameworks' streams are made-up handles)."""
    return pyalloc.SimDevice(GiB, device=device, base_address=0x7F0000000000 + device * (1 << 40),
                             any_stream=True)


@pytest.fixture
def no_gpu(monkeypatch):
    """Make the cached driver probe say: no GPU, with a known reason."""
    monkeypatch.setattr(cuda_backend, "_probe_result", (0, "test: no driver here"))


@pytest.fixture
def sim_defaults():
    """Default allocators on 1 GiB simulated devices; restored to automatic choice afterwards."""
    pyalloc.set_default_backend(sim_factory)
    yield
    for alloc in pyalloc.default_allocators().values():
        alloc.backend.synchronize()
    for alloc in pyalloc.default_allocators().values():
        for seg in alloc._segments():
            for blk in seg["blocks"]:
                if blk["allocated"]:
                    alloc.free(blk["address"])
    pyalloc.set_default_backend(None)


class ArrayLike:
    """A device array of another library: only __cuda_array_interface__."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


# ------------------------------------------------------------------------------ lazy import

def test_import_pyalloc_loads_no_cuda_bindings_module():
    out = run_python("import sys, pyalloc, pyalloc.cupy, pyalloc.cuda_backend, pyalloc.defaults\n"
                     "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))")
    assert out == "[]"


def test_import_pyalloc_cupy_does_not_import_cupy():
    out = run_python("import sys, pyalloc.cupy\nprint('cupy' in sys.modules)")
    assert out == "False"


def test_module_level_malloc_on_sim_loads_no_cuda_bindings_module():
    out = run_python("import sys, pyalloc\npyalloc.set_default_backend('sim')\n"
                     "pyalloc.free(pyalloc.malloc(4096))\n"
                     "print(sorted(m for m in sys.modules if m.startswith('cuda.')))")
    assert out == "[]"


# ------------------------------------------------------------------------------ detection

def test_is_available_is_false_when_no_gpu_is_visible():
    # CUDA_VISIBLE_DEVICES="" hides every GPU: cuInit fails (or there is no driver at all).
    out = run_python("from pyalloc import cuda_backend as c\n"
                     "print(c.is_available(), c.device_count(), bool(c.unavailable_reason()))",
                     CUDA_VISIBLE_DEVICES="")
    assert out == "False 0 True"


def test_is_available_is_false_on_this_machine_without_a_driver():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present on this machine")
    assert cuda_backend.is_available() is False
    assert cuda_backend.unavailable_reason()


def test_is_available_probes_the_driver_only_once(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_backend, "_probe_result", None)
    monkeypatch.setattr(cuda_backend, "_probe", lambda: calls.append(1) or (0, "counted"))
    results = [cuda_backend.is_available() for _ in range(3)]
    assert results == [False, False, False]
    assert cuda_backend.unavailable_reason() == "counted"
    assert len(calls) == 1


def test_backend_cuda_without_gpu_raises_no_cuda_driver_error_with_the_reason(no_gpu):
    with pytest.raises(NoCudaDriverError) as info:
        pyalloc.CachingAllocator(backend="cuda")
    message = str(info.value)
    assert "test: no driver here" in message
    assert "backend='sim'" in message


def test_no_cuda_driver_error_is_a_runtime_error():
    assert issubclass(NoCudaDriverError, RuntimeError)


def test_open_device_rejects_an_ordinal_beyond_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_probe_result", (2, ""))
    with pytest.raises(ValueError, match=r"\[0, 2\).*got 2"):
        cuda_backend.open_device(2)


def test_open_device_rejects_a_non_int_device(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_probe_result", (2, ""))
    with pytest.raises(TypeError, match="got bool True"):
        cuda_backend.open_device(True)


def test_backend_none_picks_sim_without_gpu_and_logs_the_choice(no_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="pyalloc"):
        alloc = pyalloc.CachingAllocator(backend=None)
    assert alloc.backend.kind == "sim"
    messages = [r.getMessage() for r in caplog.records if r.name == "pyalloc"]
    assert len(messages) == 1
    assert "'sim'" in messages[0] and "test: no driver here" in messages[0]


def test_current_device_is_zero_without_gpu(no_gpu):
    assert cuda_backend.current_device() == 0


# ------------------------------------------------------------------------------ default allocators

def test_default_backend_none_uses_sim_without_gpu(no_gpu):
    pyalloc.set_default_backend(None)
    try:
        ptr = pyalloc.malloc(4096)
        assert pyalloc.get_allocator(0).backend.kind == "sim"
        pyalloc.free(ptr)
    finally:
        pyalloc.set_default_backend(None)


def test_sim_backend_devices_hand_out_distinct_addresses():
    pyalloc.set_default_backend("sim")
    try:
        p0, p1 = pyalloc.malloc(4096, device=0), pyalloc.malloc(4096, device=1)
        assert p0 != p1
        pyalloc.free(p1)                                     # found on device 1, not device 0
        assert (pyalloc.memory_allocated(0), pyalloc.memory_allocated(1)) == (4096, 0)
        pyalloc.free(p0)
    finally:
        pyalloc.set_default_backend(None)


def test_malloc_and_free_go_through_the_current_devices_allocator(sim_defaults):
    ptr = pyalloc.malloc(1000)
    assert ptr != 0
    assert pyalloc.memory_allocated() == 1024      # rounded to 512 bytes
    assert pyalloc.get_allocator(0).memory_allocated() == 1024
    pyalloc.free(ptr)
    assert pyalloc.memory_allocated() == 0


def test_malloc_of_zero_bytes_returns_null_and_free_of_null_is_a_noop(sim_defaults):
    assert pyalloc.malloc(0) == 0
    pyalloc.free(0)
    assert pyalloc.memory_allocated() == 0


def test_one_default_allocator_per_device_created_lazily(sim_defaults):
    assert pyalloc.default_allocators() == {}
    a0, a1 = pyalloc.get_allocator(0), pyalloc.get_allocator(1)
    assert a0 is pyalloc.get_allocator(0) and a1 is pyalloc.get_allocator(1)
    assert a0 is not a1
    assert (a0.device, a1.device) == (0, 1)
    assert (a0.backend.device, a1.backend.device) == (0, 1)
    assert sorted(pyalloc.default_allocators()) == [0, 1]


def test_malloc_on_a_device_charges_only_that_device(sim_defaults):
    ptr = pyalloc.malloc(3 * MiB, device=1)
    assert pyalloc.memory_allocated(1) == 3 * MiB
    assert pyalloc.memory_allocated(0) == 0
    pyalloc.free(ptr, device=1)
    assert pyalloc.memory_allocated(1) == 0


def test_free_without_device_finds_the_owning_allocator(sim_defaults):
    ptrs = {d: pyalloc.malloc(2 * MiB, device=d) for d in (0, 1, 2)}
    for d in (2, 0, 1):
        pyalloc.free(ptrs[d])
        assert pyalloc.memory_allocated(d) == 0
    assert sum(pyalloc.memory_allocated(d) for d in (0, 1, 2)) == 0


def test_free_of_a_foreign_pointer_raises_and_changes_nothing(sim_defaults):
    p0 = pyalloc.malloc(4096, device=0)
    pyalloc.malloc(4096, device=1)
    before = {d: pyalloc.memory_stats(d) for d in (0, 1)}
    with pytest.raises(ValueError, match="0x1234 was not allocated by pyalloc's default allocators"):
        pyalloc.free(0x1234)
    assert {d: pyalloc.memory_stats(d) for d in (0, 1)} == before
    pyalloc.free(p0)


def test_free_on_the_wrong_device_raises(sim_defaults):
    ptr = pyalloc.malloc(4096, device=0)
    pyalloc.get_allocator(1)
    with pytest.raises(ValueError, match="not allocated by this allocator"):
        pyalloc.free(ptr, device=1)
    assert pyalloc.memory_allocated(0) == 4096
    pyalloc.free(ptr, device=0)


def test_free_on_a_device_without_allocator_raises(sim_defaults):
    with pytest.raises(ValueError, match="no default allocator exists for that device"):
        pyalloc.free(0x1000, device=5)


def test_free_of_a_non_int_pointer_raises_type_error(sim_defaults):
    pyalloc.get_allocator(0)
    pyalloc.get_allocator(1)
    with pytest.raises(TypeError, match="ptr must be an int"):
        pyalloc.free("0x1000")


@pytest.mark.parametrize("device", [-1, True, 1.0, "0"])
def test_bad_device_raises_value_error(sim_defaults, device):
    with pytest.raises(ValueError, match="device must be"):
        pyalloc.malloc(4096, device=device)


def test_statistics_functions_read_the_devices_allocator(sim_defaults):
    ptr = pyalloc.malloc(5 * MiB, device=1)
    assert pyalloc.memory_allocated(1) == 5 * MiB
    assert pyalloc.memory_reserved(1) == 20 * MiB            # 1..10 MiB requests get 20 MiB segments
    assert pyalloc.memory_stats(1)["allocated_bytes.all.current"] == 5 * MiB
    pyalloc.free(ptr)
    assert pyalloc.max_memory_allocated(1) == 5 * MiB
    pyalloc.reset_peak_memory_stats(1)
    assert pyalloc.max_memory_allocated(1) == 0
    assert pyalloc.max_memory_reserved(1) == 20 * MiB
    assert "device ID 1" in pyalloc.memory_summary(1)


def test_empty_cache_releases_cached_segments_of_every_device(sim_defaults):
    for d in (0, 1):
        pyalloc.free(pyalloc.malloc(5 * MiB, device=d))
    assert [pyalloc.memory_reserved(d) for d in (0, 1)] == [20 * MiB, 20 * MiB]
    pyalloc.empty_cache()
    assert [pyalloc.memory_reserved(d) for d in (0, 1)] == [0, 0]


def test_empty_cache_of_one_device_keeps_the_others(sim_defaults):
    for d in (0, 1):
        pyalloc.free(pyalloc.malloc(5 * MiB, device=d))
    pyalloc.empty_cache(1)
    assert [pyalloc.memory_reserved(d) for d in (0, 1)] == [20 * MiB, 0]


def test_default_allocator_out_of_memory_raises_out_of_memory_error(sim_defaults):
    with pytest.raises(OutOfMemoryError) as info:
        pyalloc.malloc(2 * GiB, device=0)
    assert info.value.requested == 2 * GiB
    assert pyalloc.memory_allocated(0) == 0
    pyalloc.free(pyalloc.malloc(4096))                        # still usable


def test_set_default_backend_refuses_while_memory_is_live(sim_defaults):
    ptr = pyalloc.malloc(4096, device=1)
    before = pyalloc.get_allocator(1)
    with pytest.raises(RuntimeError, match="device 1: 4096 bytes"):
        pyalloc.set_default_backend("sim")
    assert pyalloc.get_allocator(1) is before
    pyalloc.free(ptr)


def test_set_default_backend_drops_idle_allocators(sim_defaults):
    old = pyalloc.get_allocator(0)
    pyalloc.free(pyalloc.malloc(4096))
    pyalloc.set_default_backend(sim_factory)
    assert pyalloc.default_allocators() == {}
    assert old.memory_reserved() == 0                         # emptied before being dropped
    assert pyalloc.get_allocator(0) is not old


@pytest.mark.parametrize("bad", ["gpu", 3, pyalloc.SimDevice()])
def test_set_default_backend_rejects_unknown_values(bad):
    with pytest.raises(ValueError, match="default backend must be"):
        pyalloc.set_default_backend(bad)


def test_default_allocators_are_created_once_under_concurrency(sim_defaults):
    seen = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        seen.append(pyalloc.get_allocator(3))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(a) for a in seen}) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["malloc", "free"]), st.integers(0, 2),
                          st.integers(1, 3 * MiB)), max_size=40))
def test_module_level_accounting_matches_the_live_allocations(ops):
    pyalloc.set_default_backend(sim_factory)
    live = []      # (ptr, device, rounded bytes)
    try:
        for op, device, nbytes in ops:
            if op == "malloc" or not live:
                ptr = pyalloc.malloc(nbytes, device=device)
                live.append((ptr, device, pyalloc.get_allocator(device).round_size(nbytes)))
            else:
                ptr, _, _ = live.pop(device % len(live))
                pyalloc.free(ptr)                         # owner found by lookup
            for d in range(3):
                expected = sum(n for _, dev, n in live if dev == d)
                assert pyalloc.get_allocator(d).memory_allocated() == expected
    finally:
        for ptr, _, _ in live:
            pyalloc.free(ptr)
        pyalloc.set_default_backend(None)


# ------------------------------------------------------------------------------ streams, record_stream

class CudaCoreStream:            # cuda.core's protocol
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class TorchStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class CupyStream:
    def __init__(self, handle):
        self.ptr = handle


def allocation_stream(ptr, device=0):
    for seg in pyalloc.get_allocator(device)._segments():
        for blk in seg["blocks"]:
            if blk["address"] == ptr:
                return seg["stream"]
    raise AssertionError(f"{ptr:#x} not found")


@pytest.mark.parametrize("stream, handle", [
    (5, 5), (CudaCoreStream(6), 6), (TorchStream(7), 7), (CupyStream(8), 8), (None, 0)])
def test_malloc_accepts_stream_objects(sim_defaults, stream, handle):
    ptr = pyalloc.malloc(4096, stream=stream)
    assert allocation_stream(ptr) == handle
    pyalloc.free(ptr)


def test_malloc_rejects_a_non_stream_object(sim_defaults):
    with pytest.raises(TypeError, match="expected a stream"):
        pyalloc.malloc(4096, stream="fast")


def reuse_is_deferred_until(stream_obj, used_on, obj_of):
    """Allocate on stream 1, use on `used_on`, record_stream(obj_of(ptr), stream_obj), free: the
    next same-size malloc on stream 1 must not get the block until `used_on`'s work completes."""
    sim = pyalloc.get_allocator(0).backend
    ptr = pyalloc.malloc(MiB, stream=1)
    sim.launch(used_on)                                # work on the other stream using the block
    pyalloc.record_stream(obj_of(ptr), stream_obj)
    pyalloc.free(ptr)
    while_busy = pyalloc.malloc(MiB, stream=1)
    sim.complete(used_on)
    after = pyalloc.malloc(MiB, stream=1)
    pyalloc.free(while_busy)
    pyalloc.free(after)
    return ptr, while_busy, after


@pytest.mark.parametrize("stream_obj", [2, CudaCoreStream(2), TorchStream(2), CupyStream(2)])
def test_record_stream_defers_reuse_until_the_stream_is_done(sim_defaults, stream_obj):
    ptr, while_busy, after = reuse_is_deferred_until(stream_obj, 2, lambda p: p)
    assert while_busy != ptr
    assert after == ptr


def test_record_stream_accepts_a_cuda_array_interface_object(sim_defaults):
    ptr, while_busy, after = reuse_is_deferred_until(2, 2, lambda p: ArrayLike(p, MiB))
    assert while_busy != ptr
    assert after == ptr


def test_record_stream_accepts_a_pointer_inside_the_allocation(sim_defaults):
    ptr, while_busy, after = reuse_is_deferred_until(2, 2, lambda p: ArrayLike(p + 4096, 512))
    assert while_busy != ptr
    assert after == ptr


def test_record_stream_accepts_a_cupy_style_array_view(sim_defaults):
    # A CuPy view's data pointer is inside the allocation; .data.mem.ptr is its start.
    def view(p):
        mem = types.SimpleNamespace(ptr=p, size=MiB)
        return types.SimpleNamespace(data=types.SimpleNamespace(mem=mem, ptr=p + 512))
    ptr, while_busy, after = reuse_is_deferred_until(2, 2, view)
    assert while_busy != ptr
    assert after == ptr


def test_record_stream_without_it_the_block_is_reused_at_once(sim_defaults):
    # The control for the tests above: same sequence, no record_stream.
    sim = pyalloc.get_allocator(0).backend
    ptr = pyalloc.malloc(MiB, stream=1)
    sim.launch(2)
    pyalloc.free(ptr)
    again = pyalloc.malloc(MiB, stream=1)
    assert again == ptr
    pyalloc.free(again)


def test_record_stream_of_foreign_memory_raises_value_error(sim_defaults):
    pyalloc.get_allocator(0)
    with pytest.raises(ValueError, match="not allocated by pyalloc"):
        pyalloc.record_stream(ArrayLike(0x5000, 16), 2)


def test_record_stream_rejects_a_bad_stream_without_changing_state(sim_defaults):
    ptr = pyalloc.malloc(4096, stream=1)
    with pytest.raises(TypeError, match="expected a stream"):
        pyalloc.record_stream(ptr, "s2")
    pyalloc.free(ptr)
    assert pyalloc.malloc(4096, stream=1) == ptr          # no stream use was recorded
    pyalloc.free(ptr)


def test_record_stream_rejects_an_object_without_a_pointer(sim_defaults):
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        pyalloc.record_stream(object(), 2)


def test_record_stream_of_null_is_a_noop(sim_defaults):
    pyalloc.record_stream(ArrayLike(0, 0), 2)
    pyalloc.record_stream(0, 2)


# ------------------------------------------------------------------------------ pyalloc.cupy (stand-in CuPy)

class FakeCupy:
    """Just enough of CuPy's allocator interface (cupy.cuda.*) to drive pyalloc.cupy on the sim."""

    def __init__(self):
        self.device = 0
        self.stream = 0
        self.global_allocator = self.default_allocator
        self.local = threading.local()
        fake = self

        class OutOfMemoryError(MemoryError):
            def __init__(self, size, total, limit=0):
                self._size, self._total, self._limit = size, total, limit
                super().__init__(f"Out of memory allocating {size:,} bytes")

            def __reduce__(self):
                return (type(self), (self._size, self._total, self._limit))

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                assert device_id >= 0, "pyalloc must always pass the device id"
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        @contextlib.contextmanager
        def using_allocator(allocator=None):
            previous = getattr(fake.local, "allocator", None)
            fake.local.allocator = allocator
            try:
                yield
            finally:
                fake.local.allocator = previous

        def get_allocator():
            local = getattr(fake.local, "allocator", None)
            return local if local is not None else fake.global_allocator

        def set_allocator(allocator=None):
            fake.global_allocator = allocator

        memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, UnownedMemory=UnownedMemory,
                                       MemoryPointer=MemoryPointer)
        device = types.SimpleNamespace(get_device_id=lambda: fake.device)
        self.cuda = types.SimpleNamespace(
            memory=memory, device=device, get_allocator=get_allocator, set_allocator=set_allocator,
            using_allocator=using_allocator,
            get_current_stream=lambda: types.SimpleNamespace(ptr=fake.stream))
        self.module = types.ModuleType("cupy")
        self.module.cuda = self.cuda

    def default_allocator(self, nbytes):
        return ("cupy-pool", nbytes)

    def alloc(self, nbytes):
        return self.cuda.get_allocator()(nbytes)


@pytest.fixture
def fake_cupy(monkeypatch, sim_defaults):
    import pyalloc.cupy as pc
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake.module)
    monkeypatch.setattr(pc, "_oom_class", None)          # subclass the stand-in's error, not CuPy's
    monkeypatch.setattr(pc, "_installed", None)
    monkeypatch.setattr(pc, "_check_default_backend", lambda: None)   # the sim stands in for the GPU
    monkeypatch.setattr(pc, "_check_backend", lambda alloc: None)
    yield fake
    pc._installed = None


def test_cupy_install_routes_cupy_allocations_through_pyalloc(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    mp = fake_cupy.alloc(3000)
    assert pyalloc.memory_allocated(0) == 3072
    assert mp.mem.owner.ptr == mp.ptr
    del mp
    assert pyalloc.memory_allocated(0) == 0                 # freed when CuPy drops the memory


def test_cupy_memory_size_is_the_blocks_rounded_size(fake_cupy):
    # CuPy's own pool reports the rounded size, and CuPy's tests rely on it
    # (statistics_tests/test_order.py::TestQuantile::test_percentile_memory_access: size % 512).
    import pyalloc.cupy as pc
    pc.install()
    mp = fake_cupy.alloc(1001)
    assert mp.mem.size == 1024
    assert mp.mem.size == pyalloc.get_allocator(0).round_size(1001)


def test_cupy_allocation_uses_cupys_current_device_and_stream(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    fake_cupy.device, fake_cupy.stream = 1, 9
    mp = fake_cupy.alloc(MiB)
    assert mp.mem.device_id == 1
    assert pyalloc.memory_allocated(1) == MiB and pyalloc.memory_allocated(0) == 0
    assert allocation_stream(mp.ptr, device=1) == 9
    fake_cupy.stream = 4                                    # "current" at free time does not matter
    del mp
    assert pyalloc.memory_allocated(1) == 0


def capsule(function, name):
    """A PyCapsule around a ctypes C function pointer, named like a Cython __pyx_capi__ entry."""
    import ctypes
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule.keep.append((function, name))       # the capsule holds bare pointers to both
    return new(ctypes.cast(function, ctypes.c_void_p), name, None)


capsule.keep = []


def c_entry_points(device, stream, device_signature=b"int (int __pyx_skip_dispatch)"):
    """Capsules with the signatures of CuPy's get_device_id and get_stream_ptr, answering
    `device` and `stream` (and recording the device each stream query was for)."""
    import ctypes
    asked = []

    def stream_for(dev):
        asked.append(dev)
        return stream
    device_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda skip_dispatch: device)
    stream_fn = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(stream_for)
    return (capsule(device_fn, device_signature), capsule(stream_fn, b"intptr_t (int)")), asked


def test_cupy_allocation_reads_device_and_stream_through_cupys_c_functions(fake_cupy, monkeypatch):
    import pyalloc.cupy as pc
    points, asked = c_entry_points(device=1, stream=9)
    monkeypatch.setattr(pc, "_c_entry_points", lambda cupy: points)
    fake_cupy.device, fake_cupy.stream = 0, 4            # what the Python functions would say
    fn = pc.allocator()
    assert fn.uses_c_entry_points
    assert fn.current_device_and_stream() == (1, 9)
    mp = fn(MiB)
    assert mp.mem.device_id == 1 and pyalloc.memory_allocated(1) == MiB
    assert allocation_stream(mp.ptr, device=1) == 9
    assert asked[-1] == 1                                # the stream of the device in use
    del mp
    assert pyalloc.memory_allocated(1) == 0


def test_cupy_c_functions_with_another_signature_are_not_used(fake_cupy, monkeypatch):
    import pyalloc.cupy as pc
    points, _ = c_entry_points(device=1, stream=9, device_signature=b"int (void)")
    monkeypatch.setattr(pc, "_c_entry_points", lambda cupy: points)
    fake_cupy.device, fake_cupy.stream = 0, 4
    fn = pc.allocator()
    assert not fn.uses_c_entry_points
    assert fn.current_device_and_stream() == (0, 4)
    mp = fn(4096)
    assert allocation_stream(mp.ptr, device=0) == 4
    del mp


def test_cupy_without_exported_c_functions_uses_the_python_ones(fake_cupy):
    import pyalloc.cupy as pc
    assert pc._c_entry_points(fake_cupy.module) is None  # the stand-in exports no __pyx_capi__
    assert not pc.allocator().uses_c_entry_points


def test_cupy_uninstall_restores_the_previous_allocator(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    assert pc.is_installed()
    assert pc.uninstall() is True
    assert fake_cupy.cuda.get_allocator() == fake_cupy.default_allocator
    assert fake_cupy.alloc(100) == ("cupy-pool", 100)
    assert pc.uninstall() is False


def test_cupy_memory_outlives_uninstall(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    mp = fake_cupy.alloc(4096)
    pc.uninstall()
    assert pyalloc.memory_allocated(0) == 4096
    del mp
    assert pyalloc.memory_allocated(0) == 0


def test_cupy_install_for_one_device_leaves_the_others_to_the_previous_allocator(fake_cupy):
    import pyalloc.cupy as pc
    pc.install(device=1)
    assert fake_cupy.alloc(100) == ("cupy-pool", 100)       # device 0: CuPy's allocator
    fake_cupy.device = 1
    mp = fake_cupy.alloc(4096)
    assert pyalloc.memory_allocated(1) == 4096
    del mp


def test_cupy_using_is_scoped_and_restores(fake_cupy):
    import pyalloc.cupy as pc
    with pc.using():
        mp = fake_cupy.alloc(4096)
        assert pyalloc.memory_allocated(0) == 4096
    assert fake_cupy.alloc(100) == ("cupy-pool", 100)
    del mp
    assert pyalloc.memory_allocated(0) == 0


def test_cupy_zero_byte_allocation_passes_the_device_id(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    fake_cupy.device = 1
    mp = fake_cupy.alloc(0)
    assert (mp.ptr, mp.mem.device_id) == (0, 1)


def test_cupy_out_of_memory_is_both_error_classes(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    with pytest.raises(MemoryError) as info:
        fake_cupy.alloc(4 * GiB)
    err = info.value
    assert isinstance(err, pyalloc.OutOfMemoryError)
    assert isinstance(err, fake_cupy.cuda.memory.OutOfMemoryError)
    assert err.requested == 4 * GiB and err._size == 4 * GiB
    assert "out of memory" in str(err).lower()


def test_cupy_out_of_memory_leaves_the_allocator_usable(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    with pytest.raises(MemoryError):
        fake_cupy.alloc(4 * GiB)
    mp = fake_cupy.alloc(MiB)
    assert pyalloc.memory_allocated(0) == MiB
    del mp
    pyalloc.get_allocator(0)._check_invariants()


def test_cupy_out_of_memory_error_pickles(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    with pytest.raises(MemoryError) as info:
        fake_cupy.alloc(4 * GiB)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is type(info.value)
    assert (str(copy), copy.requested, copy.total) == (str(info.value), 4 * GiB, GiB)


def test_cupy_out_of_memory_retries_after_garbage_collection(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()

    class Cycle:
        pass
    gc.disable()                                            # only pyalloc.cupy may collect here
    try:
        holder = Cycle()
        holder.self = holder
        holder.mem = fake_cupy.alloc(700 * MiB)             # held only by a reference cycle
        del holder
        assert pyalloc.memory_allocated(0) == 700 * MiB
        mp = fake_cupy.alloc(700 * MiB)                     # fits only once the cycle is collected
    finally:
        gc.enable()
    assert pyalloc.memory_allocated(0) == 700 * MiB
    del mp


def test_cupy_record_stream_of_a_cupy_allocation(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    fake_cupy.stream = 1
    sim = pyalloc.get_allocator(0).backend
    mp = fake_cupy.alloc(MiB)
    first = mp.ptr
    sim.launch(2)
    pyalloc.record_stream(mp, 2)
    del mp
    busy = fake_cupy.alloc(MiB)
    assert busy.ptr != first
    sim.complete(2)
    again = fake_cupy.alloc(MiB)
    assert again.ptr == first


# ------------------------------------------------------------------------------ captures CuPy began itself

def pool_id_of(ptr, device=0):
    for seg in pyalloc.get_allocator(device)._segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["pool_id"]
    raise AssertionError(f"{ptr:#x} is in no segment")


def test_a_capture_cupy_began_itself_is_routed_into_a_private_pool(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    sim = pyalloc.get_allocator(0).backend
    s = sim.create_stream()
    sim.begin_capture(s)
    fake_cupy.stream = s
    mp = fake_cupy.alloc(4096)
    assert pool_id_of(mp.ptr) != (0, 0)
    assert fake_cupy.cuda.get_allocator().detected_pools == [(0, pool_id_of(mp.ptr))]
    sim.destroy_graph(sim.end_capture(s))
    del mp


def test_the_route_of_a_detected_capture_ends_with_the_capture_and_its_pool_is_kept(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    alloc = pyalloc.get_allocator(0)
    sim = alloc.backend
    s = sim.create_stream()
    sim.begin_capture(s)
    fake_cupy.stream = s
    inside = fake_cupy.alloc(4096)
    pool_id = pool_id_of(inside.ptr)
    sim.destroy_graph(sim.end_capture(s))
    after = fake_cupy.alloc(4096)                        # on s again, which captures no more
    assert pool_id_of(after.ptr) == (0, 0)
    info = alloc._pool_info(pool_id)
    assert info["routed"] is False and info["use_count"] == 1     # kept: the graph may replay
    del inside, after


def test_detect_capture_error_refuses_an_allocation_in_an_unknown_capture(fake_cupy):
    import pyalloc.cupy as pc
    pc.install(detect_capture="error")
    sim = pyalloc.get_allocator(0).backend
    s = sim.create_stream()
    sim.begin_capture(s)
    fake_cupy.stream = s
    try:
        with pytest.raises(RuntimeError, match="pyalloc.cupy.graph"):
            fake_cupy.alloc(4096)
        assert pyalloc.memory_allocated(0) == 0
    finally:
        sim.destroy_graph(sim.end_capture(s))


def test_detect_capture_off_leaves_the_allocation_in_the_default_pool(fake_cupy):
    import pyalloc.cupy as pc
    pc.install(detect_capture="off")
    sim = pyalloc.get_allocator(0).backend
    s = sim.create_stream()
    sim.begin_capture(s)
    fake_cupy.stream = s
    mp = fake_cupy.alloc(4096)
    assert pool_id_of(mp.ptr) == (0, 0)
    assert sim.counters["capture_info"] == 0             # no driver query at all
    sim.destroy_graph(sim.end_capture(s))
    del mp


def test_detect_capture_asks_nothing_on_the_legacy_stream(fake_cupy):
    import pyalloc.cupy as pc
    pc.install()
    sim = pyalloc.get_allocator(0).backend
    before = sim.counters["capture_info"]
    mp = fake_cupy.alloc(4096)                           # fake_cupy.stream is 0
    assert sim.counters["capture_info"] == before
    del mp


def test_an_unknown_detect_capture_mode_is_refused(fake_cupy):
    import pyalloc.cupy as pc
    with pytest.raises(ValueError, match="detect_capture must be one of"):
        pc.install(detect_capture="sometimes")


# The module functions tell the core's pointer errors apart by type (issue 15: they matched the
# text "already freed" in the message).

def test_a_double_free_through_the_module_raises_already_freed_error_naming_the_pointer(sim_defaults):
    ptr = pyalloc.malloc(4096, device=0)
    pyalloc.malloc(4096, device=1)
    pyalloc.free(ptr)
    with pytest.raises(pyalloc.AlreadyFreedError) as err:
        pyalloc.free(ptr)
    assert err.value.ptr == ptr and isinstance(err.value, ValueError)


def test_a_foreign_pointer_raises_not_allocated_error(sim_defaults):
    pyalloc.malloc(4096, device=0)
    with pytest.raises(pyalloc.NotAllocatedError) as err:
        pyalloc.free(0x1234)
    assert err.value.ptr == 0x1234 and not isinstance(err.value, pyalloc.AlreadyFreedError)


def test_record_stream_of_a_freed_pointer_raises_already_freed_error(sim_defaults):
    ptr = pyalloc.malloc(4096, device=0)
    pyalloc.free(ptr)
    with pytest.raises(pyalloc.AlreadyFreedError):
        pyalloc.record_stream(ptr, 7)


def test_an_interior_pointer_error_names_the_allocation_it_lies_in(sim_defaults):
    alloc = pyalloc.get_allocator(0)
    ptr = alloc.malloc(4096)
    with pytest.raises(pyalloc.NotAllocatedError) as err:
        alloc.free(ptr + 512)
    assert err.value.allocation == ptr and err.value.ptr == ptr + 512
    alloc.free(ptr)


def test_cupy_hook_keeps_the_current_stream_alive_while_its_blocks_are_cached(fake_cupy):
    # CuPy destroys a stream when its object dies and the driver recycles the handle: blocks
    # cached for a dead stream would pass to the next new stream while its queued work may still
    # use them (issue 15). The hook keeps the stream object until empty_cache finds none left.
    import weakref
    import pyalloc.cupy as pc

    class Stream:
        def __init__(self, sim):
            self.sim, self.ptr = sim, sim.create_stream()

        def __del__(self):
            self.sim.destroy_stream(self.ptr)

    sim = pyalloc.get_allocator(0).backend
    current = [Stream(sim)]
    fake_cupy.cuda.get_current_stream = lambda: current[0]
    pc.install()
    fake_cupy.stream = current[0].ptr
    mp = fake_cupy.alloc(MiB)
    gone = weakref.ref(current[0])
    current[0] = None
    del mp
    assert gone() is not None
    pyalloc.empty_cache()
    assert gone() is None
