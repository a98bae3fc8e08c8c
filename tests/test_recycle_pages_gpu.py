"""recycle_pages on a real GPU: a growth that takes the pages of another stream's free block
(cuMemUnmap keeping the cuMemCreate handles, cuMemMap + cuMemSetAccess of them elsewhere), with
the data of live blocks intact and the recycled memory usable.

Marked `gpu`; skipped with the reason when CuPy, a driver or a GPU is missing.
"""
import pytest

import pyalloc

cp = pytest.importorskip("cupy", reason="needs CuPy")

from gpu_helpers import NEEDS_GPU, uint32_view as view   # noqa: E402

pytestmark = NEEDS_GPU

from units import MiB


@pytest.fixture
def alloc():
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True,recycle_pages:True")
    yield a
    cp.cuda.Device(0).synchronize()
    a.empty_cache()


@pytest.fixture
def streams():
    return [cp.cuda.Stream(non_blocking=True) for _ in range(2)]


def hole_and_guard(alloc, stream, nbytes=30 * MiB):
    """A freed block of nbytes before a live 4 MiB guard on `stream`; returns (hole, guard)."""
    hole = alloc.malloc(nbytes, stream.ptr)
    guard = alloc.malloc(4 * MiB, stream.ptr)
    alloc.free(hole)
    return hole, guard


def test_a_growth_maps_another_streams_free_pages_without_new_memory(alloc, streams):
    hole_and_guard(alloc, streams[0])
    mapped = alloc.backend.mapped_bytes
    p = alloc.malloc(20 * MiB, streams[1].ptr)
    assert alloc.memory_stats()["num_page_remaps"] == 10
    assert alloc.backend.mapped_bytes == mapped and alloc.memory_reserved() == mapped
    alloc.free(p)


def test_recycled_pages_hold_what_is_written_there(alloc, streams):
    hole_and_guard(alloc, streams[0])
    p = alloc.malloc(20 * MiB, streams[1].ptr)
    with streams[1]:
        a = view(p, 20 * MiB, alloc)
        a[...] = 0xC0FFEE
        total = int(a.sum(dtype=cp.uint64))
    assert total == 0xC0FFEE * a.size
    alloc.free(p)


def test_a_live_neighbour_keeps_its_data_while_the_pages_beside_it_move(alloc, streams):
    hole, guard = hole_and_guard(alloc, streams[0])
    g = view(guard, 4 * MiB, alloc)
    with streams[0]:
        g[...] = cp.arange(g.size, dtype=cp.uint32)
    p = alloc.malloc(20 * MiB, streams[1].ptr)          # synchronizes, unmaps, maps elsewhere
    with streams[1]:
        view(p, 20 * MiB, alloc)[...] = 1
    with streams[0]:
        ok = bool((g == cp.arange(g.size, dtype=cp.uint32)).all())
    assert ok
    alloc.free(p)


def test_a_block_whose_pages_were_taken_is_usable_again(alloc, streams):
    hole, _ = hole_and_guard(alloc, streams[0])
    alloc.malloc(20 * MiB, streams[1].ptr)
    again = alloc.malloc(30 * MiB, streams[0].ptr)
    with streams[0]:
        a = view(again, 30 * MiB, alloc)
        a[...] = 3
        total = int(a.sum(dtype=cp.uint64))
    assert again == hole and total == 3 * a.size


def test_empty_cache_gives_the_device_its_memory_back(alloc, streams):
    free_before, _ = alloc.backend.mem_get_info()
    hole, guard = hole_and_guard(alloc, streams[0], 200 * MiB)
    p = alloc.malloc(100 * MiB, streams[1].ptr)
    alloc.free(p)
    alloc.free(guard)
    cp.cuda.Device(0).synchronize()
    alloc.empty_cache()
    free_after, _ = alloc.backend.mem_get_info()
    assert alloc.backend.mapped_bytes == 0 and free_after >= free_before - 2 * MiB
