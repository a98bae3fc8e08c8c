"""Expandable segments on a real GPU: cuMemCreate/cuMemMap/cuMemSetAccess growth, unmapping of free
pages, and data that stays intact while a segment grows and shrinks under running kernels.

Marked `gpu`; skipped with the reason when CuPy, a driver or a GPU is missing.
"""
import numpy as np
import pytest

import pyalloc
from pyalloc import cuda_backend

cp = pytest.importorskip("cupy", reason="needs CuPy")

from gpu_helpers import NEEDS_GPU, uint32_view as view   # noqa: E402

pytestmark = NEEDS_GPU

from units import MiB


@pytest.fixture
def alloc():
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True")
    yield a
    cp.cuda.Device(0).synchronize()
    a.empty_cache()
    assert a.backend.mapped_bytes == 0


def test_growth_maps_whole_pages_and_memory_is_usable(alloc):
    p = alloc.malloc(30 * MiB)
    assert alloc.memory_reserved() == 40 * MiB
    assert alloc.backend.mapped_bytes == 40 * MiB
    a = view(p, 30 * MiB, alloc)
    a[...] = 7
    assert int(a.sum(dtype=cp.uint64)) == 7 * a.size
    alloc.free(p)


def test_empty_cache_unmaps_free_pages_and_returns_device_memory(alloc):
    free_before, _ = alloc.backend.mem_get_info()
    p = alloc.malloc(200 * MiB)
    free_during, _ = alloc.backend.mem_get_info()
    assert free_before - free_during >= 200 * MiB
    alloc.free(p)
    alloc.empty_cache()
    assert alloc.backend.mapped_bytes == 0
    free_after, _ = alloc.backend.mem_get_info()
    assert free_after >= free_during + 200 * MiB


def test_segment_grows_and_shrinks_under_running_kernels_without_corruption(alloc):
    stream = cp.cuda.Stream(non_blocking=True)
    h = stream.ptr
    rng = np.random.default_rng(0)
    keep = []                       # (pointer, array, expected values) that must survive
    for step in range(6):
        # Grow: new pages mapped at the segment's frontier while earlier kernels still run.
        nbytes = int(rng.integers(5, 60)) * MiB
        p = alloc.malloc(nbytes, h)
        arr = view(p, nbytes, alloc)
        with stream:
            arr[...] = step + 1
            for q, other, value in keep:
                other += 1          # kernels over the older buffers keep running
        keep = [(q, other, value + 1) for q, other, value in keep]
        keep.append((p, arr, step + 1))
        # Shrink: drop one buffer and unmap its whole free pages (the core synchronizes the
        # segment's stream before unmapping, so the kernels above are done with them).
        if len(keep) > 2:
            q, _, _ = keep.pop(0)
            alloc.free(q)
            alloc.empty_cache()
    stream.synchronize()
    for q, arr, value in keep:
        host = cp.asnumpy(arr)
        assert (host == value).all(), f"buffer at {q:#x} corrupted"
    alloc._check_invariants()
    assert alloc.memory_stats()["num_device_free"] > 0
    for q, _, _ in keep:
        alloc.free(q)
    # Unmap while the stream still exists: unmapping synchronizes the segment's stream.
    alloc.empty_cache()
    assert alloc.backend.mapped_bytes == 0


def test_out_of_memory_while_mapping_raises_and_allocator_stays_usable(alloc):
    _, total = alloc.backend.mem_get_info()
    with pytest.raises(pyalloc.OutOfMemoryError):
        alloc.malloc(total + 20 * MiB)
    p = alloc.malloc(20 * MiB)
    view(p, 20 * MiB, alloc)[...] = 3
    alloc.free(p)
    alloc._check_invariants()


@pytest.mark.skipif(cuda_backend.device_count() < 2, reason="needs two visible GPUs")
def test_peer_device_can_copy_into_expandable_memory(alloc):
    assert 1 in alloc.backend.peers()
    p = alloc.malloc(20 * MiB)
    dst = view(p, 20 * MiB, alloc)
    with cp.cuda.Device(1):
        src = cp.full(dst.size, 5, dtype=cp.uint32)
        dst.data.copy_from_device(src.data, 20 * MiB)    # a peer copy into device 0's mapping
        cp.cuda.Device(1).synchronize()
    assert int((dst == 5).sum()) == dst.size
    del dst
    alloc.free(p)
