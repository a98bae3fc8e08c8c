"""Specification of the framework hooks on a real GPU: Numba (pyalloc.numba), cuda.core
(pyalloc.cuda_core), and all four frameworks (with CuPy and PyTorch) on one allocator.

Marked `gpu`; skipped with the reason when a GPU, Numba or cuda.core is missing. The four-framework
checks run in a fresh interpreter (tests/frameworks_one_pool.py): each framework chooses its
allocator once per process, before its first use of the GPU. The Numba tests here install the
plugin in this process, which works as long as nothing in it used Numba's GPU support before
(no other test file does); the context-reset test runs in its own interpreter, since a reset
unloads the kernels this process compiled.
"""
import ctypes
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pyalloc

from gpu_helpers import NEEDS_GPU, let_numba_cuda_compile_with_this_numpy

pytestmark = NEEDS_GPU

from units import MiB, GiB
# Reuse tests empty the cache, allocate for a stream of their own and use this size, so that best
# fit can only pick the blocks the test made: which address comes back then says what was reusable.
ODD_BYTES = 5 * MiB + 12 * 1024
ODD_ELEMENTS = ODD_BYTES // 4
HERE = Path(__file__).resolve().parent


def alloc0():
    return pyalloc.get_allocator(0)


def live(ptr):
    """Whether `ptr` lies in a block pyalloc's default allocator of device 0 has handed out."""
    for seg in alloc0()._segments():
        for blk in seg["blocks"]:
            if blk["allocated"] and blk["address"] <= ptr < blk["address"] + blk["size"]:
                return True
    return False


def segment_of(ptr):
    for seg in alloc0()._segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"{ptr:#x} is in no segment of {alloc0()!r}")


def run_python(code, tmp_path, env=None, timeout=300):
    """Run `code` in a fresh interpreter outside the checkout; return its stdout (asserting rc 0)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, **(env or {})))
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(autouse=True)
def gpu_defaults():
    if pyalloc.get_default_backend() is not None:
        pyalloc.set_default_backend(None)
    yield
    gc.collect()


# ============================================================================== Numba

@pytest.fixture(scope="module")
def cuda():
    numba_cuda = pytest.importorskip("numba.cuda", reason="needs numba and numba-cuda")
    import pyalloc.numba as pn
    pn.install()           # RuntimeError if this process used Numba's GPU support before
    if not numba_cuda.is_available():
        pytest.skip("Numba sees no usable GPU")
    assert isinstance(numba_cuda.current_context().memory_manager, pn.PyallocMemoryManager)
    return numba_cuda


@pytest.fixture(scope="module")
def kernels(cuda):
    """Numba kernels; skips with the reason where Numba cannot compile (no NVVM)."""
    def probe(x):
        x[0] = 1

    let_numba_cuda_compile_with_this_numpy()
    try:
        cuda.jit("void(int32[:])")(probe)                 # compiles now: is NVVM there?
    except Exception as exc:         # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"Numba cannot compile kernels here: {type(exc).__name__}: {exc}")

    @cuda.jit
    def write_index(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = i

    @cuda.jit
    def wait_then_fill(flag, out, value, max_iters):
        # Spins until the host sets flag[0] (or, as a safety net only, max_iters sleeps of ~1 us
        # pass), then fills `out`: holds a stream busy for as long as the test wants.
        n = 0
        while flag[0] == 0 and n < max_iters:
            cuda.nanosleep(1000)
            n += 1
        for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[j] = value

    return {"write_index": write_index, "wait_then_fill": wait_then_fill}


def numba_ptr(arr):
    return arr.__cuda_array_interface__["data"][0]


def test_numba_device_array_is_a_pyalloc_block(cuda):
    a = cuda.device_array(MiB, dtype=np.uint8)
    assert live(numba_ptr(a))


def test_numba_kernel_writes_pyalloc_memory_and_the_host_reads_it_back(cuda, kernels):
    a = cuda.device_array(100_000, dtype=np.float32)
    kernels["write_index"][(a.size + 255) // 256, 256](a)
    assert np.array_equal(a.copy_to_host(), np.arange(100_000, dtype=np.float32))


def test_numba_to_device_and_back_round_trips_through_pyalloc_memory(cuda):
    host = np.random.default_rng(18).standard_normal(50_000)
    d = cuda.to_device(host)
    assert live(numba_ptr(d))
    assert np.array_equal(d.copy_to_host(), host)


def test_numba_memory_is_freed_when_the_array_is_dropped(cuda):
    a = cuda.device_array(MiB, dtype=np.uint8)
    ptr = numba_ptr(a)
    del a
    gc.collect()
    assert not live(ptr)


def test_numba_slice_keeps_the_memory_alive_after_its_base_is_dropped(cuda, kernels):
    a = cuda.device_array(4096, dtype=np.float32)
    kernels["write_index"][16, 256](a)
    tail = a[1024:]
    ptr = numba_ptr(a)
    del a
    gc.collect()
    assert live(ptr)
    assert np.array_equal(tail.copy_to_host(), np.arange(1024, 4096, dtype=np.float32))
    del tail
    gc.collect()
    assert not live(ptr)


def more_than_the_device():
    return alloc0().backend.mem_get_info()[1] + GiB


def test_numba_out_of_memory_raises_pyalloc_and_numba_errors(cuda):
    from numba.cuda.cudadrv import driver
    import pyalloc.numba as pn
    nbytes = more_than_the_device()
    with pytest.raises(pyalloc.OutOfMemoryError) as info:
        cuda.device_array(nbytes, dtype=np.uint8)
    assert isinstance(info.value, driver.CudaAPIError)
    assert info.value.code == pn._numba_bindings(driver)[1]       # CUDA_ERROR_OUT_OF_MEMORY
    assert info.value.requested == nbytes


def test_numba_out_of_memory_leaves_the_allocator_usable(cuda):
    with pytest.raises(pyalloc.OutOfMemoryError):
        cuda.device_array(more_than_the_device(), dtype=np.uint8)
    a = cuda.device_array(MiB, dtype=np.uint8)
    assert live(numba_ptr(a))


def test_numba_defer_cleanup_holds_frees_until_the_block_ends(cuda):
    with cuda.defer_cleanup():
        a = cuda.device_array(MiB, dtype=np.uint8)
        ptr = numba_ptr(a)
        del a
        gc.collect()
        assert live(ptr)
    assert not live(ptr)


def test_numba_memory_info_is_the_devices_total_and_at_least_its_free_memory(cuda):
    free, total = cuda.current_context().get_memory_info()
    device_free, device_total = alloc0().backend.mem_get_info()
    assert total == device_total
    assert free >= device_free - 256 * MiB          # the device's figure moves between the calls


def test_numba_allocation_stream_allocates_for_that_stream(cuda):
    import pyalloc.numba as pn
    s = cuda.stream()
    with pn.allocation_stream(s):
        a = cuda.device_array(3 * MiB, dtype=np.uint8)
    blocks = [seg["stream"] for seg in alloc0()._segments() for b in seg["blocks"]
              if b["allocated"] and b["address"] == numba_ptr(a)]
    assert blocks == [int(s.handle)]


def test_numba_pinned_and_mapped_host_memory_still_work(cuda, kernels):
    pinned = cuda.pinned_array(1000, dtype=np.float32)
    mapped = cuda.mapped_array(1000, dtype=np.float32)
    kernels["write_index"][4, 256](mapped)
    cuda.synchronize()
    pinned[:] = 1
    assert np.array_equal(mapped, np.arange(1000, dtype=np.float32)) and pinned.sum() == 1000


def test_numba_ipc_handle_is_the_pyalloc_segments_with_the_blocks_offset(cuda):
    if alloc0().settings.expandable_segments:
        pytest.skip("expandable segments: IPC is not implemented (see the next test)")
    first = cuda.device_array(4096, dtype=np.uint8)
    second = cuda.device_array(4096, dtype=np.uint8)
    handle = cuda.current_context().get_ipc_handle(second.gpu_data)
    seg = segment_of(numba_ptr(second))
    assert handle.offset == numba_ptr(second) - seg["address"]
    assert handle.size == 4096 and live(numba_ptr(first))


def test_numba_ipc_handle_opens_in_another_process_at_the_blocks_data(cuda, kernels, tmp_path):
    """Numba's get_ipc_handle on pyalloc memory (the segment's handle and the block's offset),
    opened in another process. The handle's 64 bytes travel as bytes and the child opens them
    with cuda.bindings: numba-cuda 0.30's own pickling of a handle reads CUipcMemHandle.reserved,
    which cuda-bindings 13.5 no longer has (that fails under Numba's own allocator too)."""
    if alloc0().settings.expandable_segments:
        pytest.skip("expandable segments: IPC is not implemented")
    import ctypes
    padding = cuda.device_array(1000, dtype=np.float32)      # so the block is not at offset 0
    shared = cuda.device_array(4096, dtype=np.float32)
    kernels["write_index"][16, 256](shared)
    cuda.synchronize()
    ipc = cuda.current_context().get_ipc_handle(shared.gpu_data)
    assert ipc.offset > 0
    (tmp_path / "handle.bin").write_bytes(ctypes.string_at(ipc.handle.getPtr(), 64))
    out = run_python(f"""
        import ctypes
        import numpy as np
        from cuda.bindings import driver as d
        def ok(result):
            assert result[0] == d.CUresult.CUDA_SUCCESS, result[0]
            return result[1:]
        ok(d.cuInit(0))
        (dev,) = ok(d.cuDeviceGet(0))
        (ctx,) = ok(d.cuDevicePrimaryCtxRetain(dev))
        ok(d.cuCtxSetCurrent(ctx))
        handle = d.CUipcMemHandle()
        raw = open("handle.bin", "rb").read()
        ctypes.memmove(handle.getPtr(), raw, len(raw))
        (base,) = ok(d.cuIpcOpenMemHandle(handle, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        host = np.zeros(4096, dtype=np.float32)
        ok(d.cuMemcpyDtoH(host.ctypes.data, int(base) + {ipc.offset}, host.nbytes))
        print(int(host.sum()), int(host[-1]))
    """, tmp_path, timeout=60)
    assert out.split()[-2:] == [str(4095 * 4096 // 2), "4095"]
    assert live(numba_ptr(padding))


def test_numba_ipc_handle_of_an_expandable_segment_raises_not_implemented(cuda):
    if not alloc0().settings.expandable_segments:
        pytest.skip("needs PYALLOC_CONF=expandable_segments:True (tools/gpu-round.sh runs it so)")
    a = cuda.device_array(4096, dtype=np.uint8)
    with pytest.raises(NotImplementedError, match="expandable segment"):
        a.get_ipc_handle()


def busy_stream_scenario(cuda, kernels, record):
    """A kernel on stream s waits for a host flag while using array `a`; `a` is dropped, optionally
    after pyalloc.record_stream(a, s). Returns (a's address, the address a new array of the same
    size gets while s is still busy, its address once s is done).

    The arrays are allocated for a stream of their own (s0), so that the only blocks best fit can
    choose from are this scenario's: a's segment is [a | rest], and a new array gets a's block
    exactly when a is free (while busy, b takes the rest; after, a's block is the exact fit)."""
    import pyalloc.numba as pn
    pyalloc.empty_cache()
    flag = cuda.mapped_array(1, dtype=np.int32)
    flag[0] = 0
    s, s0 = cuda.stream(), cuda.stream()
    with pn.allocation_stream(s0):
        a = cuda.device_array(ODD_ELEMENTS, dtype=np.int32)
        kernels["wait_then_fill"][32, 256, s](flag, a, 7, 20_000_000)
        if record:
            pyalloc.record_stream(a, s)
        ptr = numba_ptr(a)
        del a
        gc.collect()
        b = cuda.device_array(ODD_ELEMENTS, dtype=np.int32)      # while s is still busy
        flag[0] = 1
        s.synchronize()
        c = cuda.device_array(ODD_ELEMENTS, dtype=np.int32)      # once s is done
    result = (ptr, numba_ptr(b), numba_ptr(c))
    del b, c
    return result


def test_numba_record_stream_keeps_the_block_until_the_streams_work_is_done(cuda, kernels):
    ptr, while_busy, after = busy_stream_scenario(cuda, kernels, record=True)
    assert while_busy != ptr
    assert after == ptr


def test_numba_without_record_stream_the_block_is_reused_while_the_stream_is_busy(cuda, kernels):
    # The hazard record_stream exists for: stream order covers only the allocation stream.
    ptr, while_busy, _ = busy_stream_scenario(cuda, kernels, record=False)
    assert while_busy == ptr


def test_numba_context_reset_frees_numbas_memory_and_empties_the_cache(tmp_path):
    pytest.importorskip("numba.cuda", reason="needs numba and numba-cuda")
    out = run_python("""
        import gc, json
        import numpy as np
        import pyalloc, pyalloc.numba
        pyalloc.numba.install()
        from numba import cuda
        alloc = pyalloc.get_allocator(0)
        kept = cuda.device_array(1 << 20, dtype=np.uint8)
        dropped = cuda.device_array(3 << 20, dtype=np.uint8)
        del dropped
        gc.collect()
        before = (alloc.memory_allocated(), alloc.memory_reserved())
        cuda.current_context().reset()
        print(json.dumps({"before": before,
                          "after": (alloc.memory_allocated(), alloc.memory_reserved())}))
    """, tmp_path)
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["before"][0] > 0 and figures["before"][1] > 0
    assert figures["after"] == [0, 0]


def test_numba_environment_variable_puts_numba_on_pyalloc(tmp_path):
    pytest.importorskip("numba.cuda", reason="needs numba and numba-cuda")
    out = run_python("""
        import numpy as np
        from numba import cuda
        import pyalloc, pyalloc.numba
        a = cuda.device_array(1 << 20, dtype=np.uint8)
        print(pyalloc.numba.is_installed(), pyalloc.memory_allocated(0))
    """, tmp_path, env={"NUMBA_CUDA_MEMORY_MANAGER": "pyalloc.numba"})
    installed, allocated = out.split()[-2:]
    assert installed == "True" and int(allocated) >= 1 << 20


# ============================================================================== cuda.core

@pytest.fixture(scope="module")
def core():
    from pyalloc import cuda_core as pcc
    try:
        module = pcc.import_cuda_core()
    except ImportError as exc:
        pytest.skip(str(exc))
    module.Device(0).set_current()
    return module


@pytest.fixture
def mr(core):
    from pyalloc.cuda_core import PyallocMemoryResource
    return PyallocMemoryResource(0)


@pytest.fixture
def streams(core):
    dev = core.Device(0)
    return dev.create_stream(), dev.create_stream()


def driver_call(fn, *args):
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    assert int(out[0]) == 0, f"{fn.__name__} failed with {out[0]!r}"
    return out[1] if len(out) == 2 else out[1:]


def read_back(ptr, nbytes):
    from cuda.bindings import driver
    host = np.empty(nbytes, dtype=np.uint8)
    driver_call(driver.cuMemcpyDtoH, host.ctypes.data, ptr, nbytes)
    return host


class MappedFlag:
    """An int32 in mapped pinned host memory; a stream made to wait on it (cuStreamWaitValue32)
    stays busy until the host sets it."""

    def __init__(self):
        from cuda.bindings import driver
        self.driver = driver
        self.host = driver_call(driver.cuMemHostAlloc, 4, driver.CU_MEMHOSTALLOC_DEVICEMAP)
        self.device = driver_call(driver.cuMemHostGetDevicePointer, self.host, 0)
        self.set(0)

    def set(self, value):
        ctypes.c_int32.from_address(int(self.host)).value = value

    def block(self, stream_handle):
        d = self.driver
        driver_call(d.cuStreamWaitValue32, stream_handle, self.device, 1,
                    int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))

    def close(self):
        self.driver.cuMemFreeHost(self.host)


def handle_of(stream):
    return int(stream.handle)


def test_cuda_core_buffer_is_a_pyalloc_block_of_the_resource(mr, streams):
    buf = mr.allocate(MiB, stream=streams[0])
    assert live(int(buf.handle))
    assert (buf.size, buf.device_id, buf.memory_resource is mr, buf.is_device_accessible) == \
        (MiB, 0, True, True)
    buf.close()


def test_cuda_core_buffer_is_allocated_for_its_stream(mr, streams):
    buf = mr.allocate(3 * MiB, stream=streams[0])
    assert segment_of(int(buf.handle))["stream"] == handle_of(streams[0])
    buf.close()


def test_cuda_core_buffer_holds_what_the_device_writes(mr, streams):
    from cuda.bindings import driver
    buf = mr.allocate(MiB, stream=streams[0])
    driver_call(driver.cuMemsetD8Async, int(buf.handle), 0xAB, MiB, handle_of(streams[0]))
    streams[0].sync()
    assert (read_back(int(buf.handle), MiB) == 0xAB).all()
    buf.close()


def test_cuda_core_copy_between_two_pyalloc_buffers(mr, streams):
    from cuda.bindings import driver
    src = mr.allocate(MiB, stream=streams[0])
    driver_call(driver.cuMemsetD8Async, int(src.handle), 0x5A, MiB, handle_of(streams[0]))
    dst = src.copy_to(stream=streams[0])         # cuda.core allocates dst through the resource
    streams[0].sync()
    assert dst.memory_resource is mr and live(int(dst.handle))
    assert (read_back(int(dst.handle), MiB) == 0x5A).all()
    src.close()
    dst.close()


def test_cuda_core_kernel_writes_a_pyalloc_buffer(core, mr, streams):
    code = r'extern "C" __global__ void fill(unsigned int* out, unsigned long long n, unsigned int v)' \
           r' { unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;' \
           r' if (i < n) out[i] = v; }'
    dev = core.Device(0)
    try:
        options = core.ProgramOptions(arch=f"sm_{dev.arch}")
        kernel = core.Program(code, code_type="c++", options=options).compile("cubin").get_kernel("fill")
    except Exception as exc:         # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"cuda.core cannot compile kernels here (NVRTC): {type(exc).__name__}: {exc}")
    n = 100_000
    buf = mr.allocate(4 * n, stream=streams[0])
    config = core.LaunchConfig(grid=(n + 255) // 256, block=256)
    core.launch(streams[0], config, kernel, buf, np.uint64(n), np.uint32(0xC0FFEE))
    streams[0].sync()
    assert (read_back(int(buf.handle), 4 * n).view(np.uint32) == 0xC0FFEE).all()
    buf.close()


def test_cuda_core_closed_buffer_goes_back_to_pyalloc(mr, streams):
    buf = mr.allocate(MiB, stream=streams[0])
    ptr = int(buf.handle)
    buf.close()
    assert not live(ptr)


def test_cuda_core_dropped_buffer_goes_back_to_pyalloc(mr, streams):
    buf = mr.allocate(MiB, stream=streams[0])
    ptr = int(buf.handle)
    del buf
    gc.collect()
    assert not live(ptr)


def test_cuda_core_buffer_closed_on_another_stream_waits_for_that_streams_work(mr, streams):
    s1, s2 = streams
    flag = MappedFlag()
    try:
        pyalloc.empty_cache()
        buf = mr.allocate(ODD_BYTES, stream=s1)
        ptr = int(buf.handle)
        flag.block(handle_of(s2))             # s2 is busy until the flag is set
        buf.close(s2)                         # a free ordered on s2
        while_busy = mr.allocate(ODD_BYTES, stream=s1)
        flag.set(1)
        s2.sync()
        after = mr.allocate(ODD_BYTES, stream=s1)
        assert int(while_busy.handle) != ptr
        assert int(after.handle) == ptr
        while_busy.close()
        after.close()
    finally:
        flag.set(1)
        s2.sync()
        flag.close()


def test_cuda_core_buffer_closed_on_its_own_stream_is_reused_at_once(mr, streams):
    s1, _ = streams
    pyalloc.empty_cache()
    buf = mr.allocate(ODD_BYTES, stream=s1)
    ptr = int(buf.handle)
    buf.close()
    again = mr.allocate(ODD_BYTES, stream=s1)
    assert int(again.handle) == ptr
    again.close()


def test_cuda_core_out_of_memory_raises_pyalloc_out_of_memory_error(mr, streams):
    before = alloc0().memory_allocated()
    with pytest.raises(pyalloc.OutOfMemoryError):
        mr.allocate(more_than_the_device(), stream=streams[0])
    assert alloc0().memory_allocated() == before


def test_cuda_core_empty_cache_gives_a_closed_buffers_memory_back_to_the_device(mr, streams):
    buf = mr.allocate(64 * MiB, stream=streams[0])
    buf.close()
    cached = alloc0().memory_reserved()
    pyalloc.empty_cache()
    assert alloc0().memory_reserved() <= cached - 64 * MiB


# ============================================================================== one pool for all

@pytest.fixture(scope="module")
def one_pool(tmp_path_factory):
    """The checks of tests/frameworks_one_pool.py, run once in a fresh interpreter."""
    for name in ("cupy", "torch", "numba.cuda"):
        pytest.importorskip(name, reason=f"the four-framework test needs {name}")
    from pyalloc import cuda_core as pcc
    try:
        pcc.import_cuda_core()
    except ImportError as exc:
        pytest.skip(str(exc))
    out = subprocess.run([sys.executable, str(HERE / "frameworks_one_pool.py")],
                         cwd=tmp_path_factory.mktemp("one_pool"), capture_output=True, text=True,
                         timeout=400, env=dict(os.environ))
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


ONE_POOL_CHECKS = [
    "numba_allocates_from_pyalloc", "cupy_allocates_from_pyalloc", "cuda_core_allocates_from_pyalloc",
    "torch_allocates_from_pyalloc", "memory_stats_counts_every_framework",
    "numba_array_in_torch_lives_until_torch_drops_it", "cupy_array_in_numba_lives_until_numba_drops_it",
    "numba_kernel_computes_on_cupy_memory",
    "torch_tensor_in_cupy_lives_until_cupy_drops_it", "cupy_array_in_torch_lives_until_torch_drops_it",
    "cuda_core_buffer_in_cupy_lives_until_cupy_drops_it", "everything_is_freed_at_the_end",
]


@pytest.mark.parametrize("check", ONE_POOL_CHECKS)
def test_four_frameworks_in_one_process_share_one_allocator(one_pool, check):
    result = one_pool[check]
    if result.startswith("skip: "):
        pytest.skip(f"{check}: needs {result[6:]}")
    assert result == "ok", f"{check}: {result}\n(versions: {one_pool.get('_versions')})"


def test_four_frameworks_run_with_pyalloc_torch_installed(one_pool):
    if not one_pool["_versions"]["torch_hook"]:
        pytest.skip("pyalloc.torch with install() is not in this build: PyTorch used its own allocator")
    assert one_pool["torch_allocates_from_pyalloc"] == "ok"
