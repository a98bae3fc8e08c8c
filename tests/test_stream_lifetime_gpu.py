"""Stream lifetime with CuPy on a real GPU (issue 15): CuPy destroys a stream when its object dies,
and the driver hands the freed handle to the next new stream.

Marked `gpu`; skipped with the reason when CuPy, a driver or a GPU is missing. The CPU half, on
SimDevice's model of stream destruction, is tests/test_stream_lifetime.py.
"""
import os
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import pyalloc

cp = pytest.importorskip("cupy", reason="needs CuPy")

from gpu_helpers import NEEDS_GPU, HostFlag   # noqa: E402

pytestmark = NEEDS_GPU

import pyalloc.cupy as pc   # noqa: E402

from units import MiB

# Spins until the host sets *flag (or ~max_cycles GPU clocks pass, a safety net), then adds 1 to
# every element of data[0:n]: holds a stream busy, using `data`, for as long as the test wants.
WAIT_THEN_ADD = r"""
extern "C" __global__
void wait_then_add(const volatile int* flag, float* data, unsigned long long n, long long max_cycles) {
    long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { }
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x)
        data[i] += 1.0f;
}
"""


@pytest.fixture(autouse=True)
def cupy_on_pyalloc():
    if pyalloc.get_default_backend() is not None:
        pyalloc.set_default_backend(None)
    pc.install()
    pyalloc.empty_cache()              # best fit below must not find blocks of earlier tests
    yield
    pc.uninstall()
    cp.cuda.Device().synchronize()
    pyalloc.get_allocator(cp.cuda.Device().id).process_events()
    pyalloc.empty_cache()


def test_freeing_an_array_after_its_record_stream_stream_died_does_not_crash():
    # A fresh interpreter: before the fix this killed the process (SIGSEGV in cuEventRecord).
    code = textwrap.dedent("""
        import cupy, pyalloc, pyalloc.cupy
        pyalloc.cupy.install()
        a = cupy.ones(1 << 20, dtype=cupy.float32)
        s2 = cupy.cuda.Stream(non_blocking=True)
        with s2:
            b = a * 2
        pyalloc.record_stream(a, s2)
        del s2
        del a
        cupy.cuda.Device().synchronize()
        assert float(b.sum()) == 2 * (1 << 20)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


def test_memory_used_on_a_dropped_stream_is_not_reused_before_that_streams_work_ends():
    kernel = cp.RawKernel(WAIT_THEN_ADD, "wait_then_add")
    flag = HostFlag()
    try:
        n = 1 << 20
        a = cp.zeros(n, dtype=cp.float32)
        address = a.data.ptr
        s2 = cp.cuda.Stream(non_blocking=True)
        with s2:
            kernel((64,), (256,), (np.uint64(flag.device), a, np.uint64(n), np.int64(40_000_000_000)))
        pyalloc.record_stream(a, s2)
        gone = weakref.ref(s2)
        del s2, a                                # the stream lives on while its event is pending
        while_busy = cp.empty(n, dtype=cp.float32)
        assert while_busy.data.ptr != address    # still in use by the dropped stream's kernel
        flag.set(1)
        cp.cuda.Device().synchronize()
        pyalloc.get_allocator(cp.cuda.Device().id).process_events()
        assert gone() is None                    # released once its event was recorded
        after = cp.empty(n, dtype=cp.float32)
        assert after.data.ptr == address
    finally:
        flag.set(1)
        cp.cuda.Device().synchronize()
        flag.close()


def test_two_hundred_streams_created_and_dropped_in_turn_each_guard_their_arrays():
    kernel = cp.ElementwiseKernel("float32 x", "float32 y", "y = x + 1.0f", "pyalloc_add_one")
    alloc = pyalloc.get_allocator(cp.cuda.Device().id)
    allocated_before = alloc.memory_allocated()
    alive = []
    n = 1 << 16
    total = 0.0
    for i in range(200):
        s = cp.cuda.Stream(non_blocking=True)
        x = cp.full(n, float(i), dtype=cp.float32)      # on the default stream
        cp.cuda.Device().synchronize()
        with s:
            y = kernel(x)                                # x used on s
            total += float(y.sum())                      # on s too; float() waits for it
        pyalloc.record_stream(x, s)
        alive.append(weakref.ref(s))
        del s, x, y
    cp.cuda.Device().synchronize()
    alloc.process_events()
    alloc.process_events()              # the first records the last streams' events, this one sees them done
    assert total == sum(n * (i + 1.0) for i in range(200))
    assert alloc.memory_allocated() == allocated_before
    # y was allocated on each stream: the allocator kept each stream while its work could be
    # queued, and let it go once an event showed that work done (its handle, and y's cached
    # block, may then pass to a later stream: safe, nothing of the old stream is left to run).
    assert sum(ref() is not None for ref in alive) == 0
    pyalloc.empty_cache()
    assert all(ref() is None for ref in alive)


def test_a_stream_dropped_with_queued_work_does_not_pass_its_cached_blocks_to_a_new_stream():
    kernel = cp.RawKernel(WAIT_THEN_ADD, "wait_then_add")
    flag = HostFlag()
    try:
        n = 1 << 20
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            a = cp.zeros(n, dtype=cp.float32)
            address = a.data.ptr
            kernel((64,), (256,), (np.uint64(flag.device), a, np.uint64(n), np.int64(40_000_000_000)))
        handle = s.ptr
        del a, s                                 # a's block is cached for s; s's kernel still runs
        s2 = cp.cuda.Stream(non_blocking=True)
        with s2:
            b = cp.empty(n, dtype=cp.float32)
        assert s2.ptr != handle and b.data.ptr != address
        flag.set(1)
        cp.cuda.Device().synchronize()
    finally:
        flag.set(1)
        cp.cuda.Device().synchronize()
        flag.close()
