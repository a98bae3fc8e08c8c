"""Specification of CuPy on pyalloc (pyalloc.cupy) on a real GPU.

Marked `gpu`; skipped with the reason when CuPy, a driver or a GPU is missing. Correctness is
checked by data: results computed on the GPU over pyalloc memory against NumPy or against the same
computation on CuPy's own pool.
"""

import numpy as np
import pytest

import pyalloc
from pyalloc import cuda_backend

cp = pytest.importorskip("cupy", reason="needs CuPy")

from gpu_helpers import NEEDS_GPU, HostFlag   # noqa: E402

pytestmark = NEEDS_GPU

import pyalloc.cupy as pc   # noqa: E402

from units import MiB, GiB

# Spins until the host sets *flag (or, as a safety net only, ~max_cycles GPU clocks pass), then
# writes `value` everywhere in out[0:n]. Lets a test hold a stream busy for exactly as long as it
# wants, so the checks below depend on the order of events, not on timing.
WAIT_THEN_FILL = r"""
extern "C" __global__
void wait_then_fill(const volatile int* flag, unsigned int* out, unsigned long long n,
                    unsigned int value, long long max_cycles) {
    long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { }
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x)
        out[i] = value;
}
"""


@pytest.fixture(autouse=True)
def clean_state():
    if pyalloc.get_default_backend() is not None:
        pyalloc.set_default_backend(None)
    yield
    pc.uninstall()
    cp.cuda.Device().synchronize()
    cp.fft.config.get_plan_cache().clear()
    pyalloc.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()


@pytest.fixture(scope="module")
def wait_then_fill():
    return cp.RawKernel(WAIT_THEN_FILL, "wait_then_fill")


def launch_wait_then_fill(kernel, flag, arr, value, stream):
    max_cycles = np.int64(40_000_000_000)      # ~20 s at 2 GHz: only if the host never answers
    with stream:
        kernel((32,), (256,), (np.uint64(flag.device), arr, np.uint64(arr.size), np.uint32(value),
                               max_cycles))


def test_cupy_allocations_go_through_pyalloc_and_return_when_dropped():
    pc.install()
    before = pyalloc.memory_allocated()
    a = cp.arange(1 << 20, dtype=cp.float32)
    assert pyalloc.memory_allocated() == before + 4 * MiB
    assert int(a.sum()) == (1 << 20) * ((1 << 20) - 1) // 2
    del a
    assert pyalloc.memory_allocated() == before


def test_cupy_allocation_is_made_for_cupys_current_stream():
    pc.install()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.empty(MiB, dtype=cp.uint8)
    alloc = pyalloc.get_allocator(0)
    streams = {seg["stream"] for seg in alloc._segments()
               for blk in seg["blocks"] if blk["address"] == a.data.ptr}
    assert streams == {s.ptr}, (
        f"array at {a.data.ptr:#x} ({type(a.data.mem).__name__}) not found among the blocks of "
        f"{alloc!r}: {[hex(b['address']) for seg in alloc._segments() for b in seg['blocks']][:16]}")
    del a
    s.synchronize()


def test_cupys_c_functions_are_used_and_agree_with_its_python_functions():
    # pyalloc.cupy reads the current device and stream through CuPy's exported C functions
    # (pyalloc.cupy._c_entry_points); they must say what cupy.cuda's Python functions say.
    fn = pc.allocator()
    assert fn.uses_c_entry_points, "this CuPy's __pyx_capi__ lacks get_device_id/get_stream_ptr"

    def python_view():
        return cp.cuda.Device().id, cp.cuda.get_current_stream().ptr

    assert fn.current_device_and_stream() == python_view()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        assert fn.current_device_and_stream() == python_view() == (0, s.ptr)
    with cp.cuda.Stream.ptds:
        assert fn.current_device_and_stream() == python_view()
    for d in range(cuda_backend.device_count()):
        with cp.cuda.Device(d):
            other = cp.cuda.Stream()
            with other:
                assert fn.current_device_and_stream() == python_view() == (d, other.ptr)
            assert fn.current_device_and_stream() == python_view()


def test_uninstall_restores_cupys_allocator():
    original = cp.cuda.get_allocator()
    pc.install()
    assert cp.cuda.get_allocator() is not original
    pc.uninstall()
    assert cp.cuda.get_allocator() == original


def test_using_is_scoped_to_the_block():
    original = cp.cuda.get_allocator()
    with pc.using():
        a = cp.ones(1000)
        assert pyalloc.memory_allocated() >= 8000
    assert cp.cuda.get_allocator() == original
    b = cp.ones(1000)                                   # CuPy's pool again
    assert b.data.mem.__class__.__name__ != "UnownedMemory"
    assert float(a.sum()) == 1000.0


def test_one_allocator_per_visible_device_under_cupy():
    pc.install()
    arrays = []
    for d in range(cuda_backend.device_count()):
        with cp.cuda.Device(d):
            arrays.append(cp.full(1000, d, dtype=cp.int32))
    for d, a in enumerate(arrays):
        assert a.data.mem.device_id == d
        assert a.device.id == d
        assert pyalloc.get_allocator(d).backend.device == d
        assert pyalloc.memory_allocated(d) >= 4000
        with cp.cuda.Device(d):
            assert int(a.sum()) == 1000 * d


@pytest.mark.skipif(cuda_backend.device_count() < 2, reason="needs two visible GPUs")
def test_two_gpus_arrays_on_both_devices_compute_and_free():
    pc.install()
    with cp.cuda.Device(1):
        b = cp.arange(1 << 16, dtype=cp.float64)
        b_sum = float(b.sum())
    with cp.cuda.Device(0):
        a = cp.asarray(b)                                # peer copy into pyalloc memory on device 0
        assert float(a.sum()) == b_sum
    assert pyalloc.memory_allocated(1) >= 8 * (1 << 16)
    assert pyalloc.memory_allocated(0) >= 8 * (1 << 16)
    del a, b
    assert (pyalloc.memory_allocated(0), pyalloc.memory_allocated(1)) == (0, 0)


def test_kernels_on_several_streams_over_pyalloc_memory_do_not_corrupt_each_other():
    pc.install()
    rng = np.random.default_rng(1234)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    expected, results = [], []
    for round_ in range(30):
        for i, s in enumerate(streams):
            n = int(rng.integers(1, 300_000))
            with s:
                # Temporaries are freed at once and their blocks reused by the next round's
                # arrays on the same stream while earlier kernels may still be running.
                x = cp.arange(n, dtype=cp.float64) * (i + 1)
                y = cp.sin(x) * 2.0 + round_
                results.append(y.sum())
                del x, y
            host_x = np.arange(n, dtype=np.float64) * (i + 1)
            expected.append((np.sin(host_x) * 2.0 + round_).sum())
    for s in streams:
        s.synchronize()
    got = np.array([float(r) for r in results])
    # GPU and NumPy sin differ in the last bits; a corrupted input would be off by far more.
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-9, atol=1e-6)


def test_cross_stream_use_with_record_stream_is_not_corrupted_by_reuse():
    pc.install()
    producer = cp.cuda.Stream(non_blocking=True)
    consumer = cp.cuda.Stream(non_blocking=True)
    outs, want = [], []
    for k in range(20):
        with producer:
            a = cp.full(1 << 20, k, dtype=cp.float32)
            ready = producer.record()
        consumer.wait_event(ready)
        with consumer:
            outs.append((a * 3.0).sum(dtype=cp.float64))
        pyalloc.record_stream(a, consumer)
        del a
        with producer:                                   # new arrays on the producer stream
            junk = cp.full(1 << 20, -1.0, dtype=cp.float32)
            del junk
        want.append(3.0 * k * (1 << 20))
    consumer.synchronize()
    assert [float(o) for o in outs] == want


def slow_kernel_scenario(kernel, record):
    """The buffer x is allocated on stream A, used by a slow kernel on stream B that, once released
    by the host, writes 0xBBBBBBBB over it; x is freed (on A) while that kernel waits. Then y of the
    same size is allocated on A and filled with 0xAAAAAAAA, A finishes, and only then is B released.
    Returns (x's address, y's address, y's contents after B finished, the address a later
    allocation on A gets)."""
    n = MiB                                               # uint32: 4 MiB, large pool
    a_stream = cp.cuda.Stream(non_blocking=True)
    b_stream = cp.cuda.Stream(non_blocking=True)
    flag = HostFlag()
    try:
        # Warm-up: load every kernel used below now. With CUDA's lazy module loading, loading a
        # kernel while the waiting kernel spins could wait for it (a deadlock until the safety
        # timeout) and spoil the ordering the checks rely on.
        flag.set(1)
        with a_stream:
            w = cp.zeros(n, dtype=cp.uint32)
            w.fill(0xAAAAAAAA)
        launch_wait_then_fill(kernel, flag, w, 0xBBBBBBBB, b_stream)
        cp.cuda.Device().synchronize()
        del w
        flag.set(0)
        with a_stream:
            x = cp.zeros(n, dtype=cp.uint32)
        a_stream.synchronize()
        launch_wait_then_fill(kernel, flag, x, 0xBBBBBBBB, b_stream)
        if record:
            pyalloc.record_stream(x, b_stream)
        x_ptr = x.data.ptr
        del x                                             # freed while B's kernel still waits
        with a_stream:
            y = cp.empty(n, dtype=cp.uint32)
            y.fill(0xAAAAAAAA)
        a_stream.synchronize()                            # y is filled; B has not written yet
        flag.set(1)
        b_stream.synchronize()                            # now B's kernel has written its pattern
        y_host = y.get(stream=a_stream)
        a_stream.synchronize()
        y_ptr = y.data.ptr
        with a_stream:
            z = cp.empty(n, dtype=cp.uint32)
        z_ptr = z.data.ptr
        del y, z
        return x_ptr, y_ptr, y_host, z_ptr
    finally:
        flag.set(1)
        cp.cuda.Device().synchronize()
        flag.close()


def test_recorded_buffer_is_not_reused_until_the_slow_kernel_finishes(wait_then_fill):
    pc.install()
    x_ptr, y_ptr, y_host, z_ptr = slow_kernel_scenario(wait_then_fill, record=True)
    nbytes = 4 * MiB
    assert y_ptr + nbytes <= x_ptr or x_ptr + nbytes <= y_ptr        # no overlap
    assert (y_host == 0xAAAAAAAA).all()                               # never overwritten by B


def test_recorded_buffer_is_reused_once_the_slow_kernel_has_finished(wait_then_fill):
    pc.install()
    x_ptr, _, _, z_ptr = slow_kernel_scenario(wait_then_fill, record=True)
    assert z_ptr == x_ptr


def test_without_record_stream_the_slow_kernel_corrupts_the_reused_buffer(wait_then_fill):
    # The control for the two tests above: it shows the scenario would catch a premature reuse.
    pc.install()
    x_ptr, y_ptr, y_host, _ = slow_kernel_scenario(wait_then_fill, record=False)
    assert y_ptr == x_ptr
    assert (y_host == 0xBBBBBBBB).all()


def test_out_of_memory_raises_both_pyalloc_and_cupy_errors():
    pc.install()
    _, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(MemoryError) as info:
        cp.empty(total + GiB, dtype=cp.uint8)
    err = info.value
    assert isinstance(err, pyalloc.OutOfMemoryError)
    assert isinstance(err, cp.cuda.memory.OutOfMemoryError)
    assert err.requested == total + GiB


def test_out_of_memory_is_caught_by_cupys_except_clause():
    pc.install()
    _, total = cp.cuda.runtime.memGetInfo()
    try:
        cp.empty(total + GiB, dtype=cp.uint8)
        caught = False
    except cp.cuda.memory.OutOfMemoryError:
        caught = True
    assert caught


def test_out_of_memory_leaves_the_allocator_usable():
    pc.install()
    _, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(MemoryError):
        cp.empty(total + GiB, dtype=cp.uint8)
    a = cp.arange(1000, dtype=cp.int64)
    assert int(a.sum()) == 499500
    assert pyalloc.memory_stats()["num_ooms"] >= 1
    pyalloc.get_allocator()._check_invariants()


# Indices of the cumsum results in workload()'s output (six results per size, cumsum is the fifth).
SCAN_RESULTS = {6 * i + 4 for i in range(8)}


def workload(seed):
    """FFT, matmul, reductions, scans and sorts over many sizes; results as host arrays."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (2, 3, 64, 100, 1000, 4097, 65536, 1_000_003):
        host = rng.standard_normal(n).astype(np.float32)
        x = cp.asarray(host)
        out.append(cp.fft.fft(x).get())
        out.append(cp.fft.irfft(cp.fft.rfft(x), n=n).get())
        out.append(cp.stack([x.sum(), x.mean(), x.max(), x.min(), x.std()]).get())
        out.append(cp.asarray([int(x.argmax()), int(x.argmin())]).get())
        out.append(cp.cumsum(x).get())
        out.append(cp.sort(x).get())
    for m, k, n in ((1, 1, 1), (17, 33, 9), (128, 256, 64), (512, 512, 512), (1000, 300, 700)):
        a = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        b = cp.asarray(rng.standard_normal((k, n)).astype(np.float32))
        out.append((a @ b).get())
        out.append((a @ b).sum(axis=0).get())
    cp.cuda.Device().synchronize()
    return out


def test_cupy_workload_gives_identical_results_with_and_without_pyalloc():
    reference = workload(7)
    cp.fft.config.get_plan_cache().clear()               # plans (and work areas) made anew below
    before = pyalloc.memory_stats()["allocation.all.allocated"]
    with pc.using():
        with_pyalloc = workload(7)
    served = pyalloc.memory_stats()["allocation.all.allocated"] - before
    assert served > 100                                   # pyalloc really served the workload
    assert len(reference) == len(with_pyalloc)
    for i, (r, p) in enumerate(zip(reference, with_pyalloc)):
        assert r.dtype == p.dtype and r.shape == p.shape, i
        if i in SCAN_RESULTS:
            # CUB's device-wide scan combines tile sums in whatever order the tiles finish
            # (decoupled look-back), so a float cumsum can differ run to run in the last bits
            # whatever the allocator. Every other result must be bit-identical.
            # A reordered float32 sum is off by a few units in the last place of the largest
            # partial sum it passed through.
            tolerance = 4 * float(np.spacing(np.abs(r).max()))
            np.testing.assert_allclose(p, r, rtol=0, atol=tolerance, err_msg=f"result {i}")
        else:
            assert np.array_equal(r, p), f"result {i} differs"
