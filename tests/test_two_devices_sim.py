"""Two simulated devices: private pools and graph captures stay per device (the CPU half of the
two-GPU checks; the GPU half needs a host with two GPUs, tests/test_*_gpu.py marks those)."""
import pyalloc
from pyalloc import CachingAllocator, SimDevice
from pool_helpers import pool_of

from units import KiB


def two_allocators():
    a0 = CachingAllocator(0, backend=SimDevice(device=0, base_address=0x7F0000000000))
    a1 = CachingAllocator(1, backend=SimDevice(device=1, base_address=0x7F0000000000 + (1 << 40)))
    return a0, a1



def test_a_route_on_one_device_leaves_the_other_devices_allocations_alone():
    a0, a1 = two_allocators()
    pool = a1.mem_pool()
    with a1.use_mem_pool(pool):
        on1, on0 = a1.malloc(4 * KiB), a0.malloc(4 * KiB)
    assert pool_of(a1, on1) == pool.id and pool_of(a0, on0) == (0, 0)
    assert a0._private_pool_ids() == []


def test_pool_ids_are_unique_across_devices():
    a0, a1 = two_allocators()
    assert a0.mem_pool().id != a1.mem_pool().id


def test_graphs_on_two_devices_have_separate_pools():
    a0, a1 = two_allocators()
    s0, s1 = a0.backend.create_stream(), a1.backend.create_stream()
    with a0.graph(s0) as g0:
        p0 = a0.malloc(4 * KiB, s0)
        with a1.graph(s1) as g1:
            p1 = a1.malloc(4 * KiB, s1)
    assert g0.pool() != g1.pool()
    assert pool_of(a0, p0) == g0.pool() and pool_of(a1, p1) == g1.pool()
    assert a0._pool_info(g1.pool()) is None and a1._pool_info(g0.pool()) is None


def test_a_capture_on_one_device_does_not_route_the_other_devices_streams():
    a0, a1 = two_allocators()
    s0, s1 = a0.backend.create_stream(), a1.backend.create_stream()
    with a1.graph(s1):
        p0 = a0.malloc(4 * KiB, s0)
    assert pool_of(a0, p0) == (0, 0)


def test_module_level_mempool_on_device_1_routes_only_device_1():
    pyalloc.set_default_backend("sim")
    try:
        pool = pyalloc.MemPool(device=1)
        with pyalloc.use_mem_pool(pool):
            on1, on0 = pyalloc.malloc(4 * KiB, device=1), pyalloc.malloc(4 * KiB, device=0)
        assert pool_of(pyalloc.get_allocator(1), on1) == pool.id
        assert pool_of(pyalloc.get_allocator(0), on0) == (0, 0)
        pyalloc.free(on1)
        pyalloc.free(on0)
        pool.release()
    finally:
        pyalloc.set_default_backend(None)
