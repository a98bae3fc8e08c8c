"""The pinned host allocator (pyalloc.host.HostAllocator) on a real GPU, with CuPy.

Marked `gpu`; skipped with the reason when CuPy, a driver or a GPU is missing. The event rule is
checked by data: an asynchronous host-to-device copy from a pinned block, held in its stream
behind a kernel that spins until the host releases it, must deliver the block's data as it was
when the copy was queued, although the block was freed and a block of its size handed out and
overwritten meanwhile. Without record_event (the control) the same program hands the block out
again and the copy delivers the overwritten data.
"""
import ctypes

import numpy as np
import pytest

import pyalloc
from pyalloc import cuda_backend

cp = pytest.importorskip("cupy", reason="needs CuPy")

from gpu_helpers import NEEDS_GPU, HostFlag   # noqa: E402

pytestmark = NEEDS_GPU

from pyalloc.host import HostAllocator       # noqa: E402

N = 1 << 20          # bytes per copy

SPIN = r"""
extern "C" __global__ void spin(const volatile int* flag, long long max_cycles) {
    long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { }
}
"""


@pytest.fixture
def host():
    h = HostAllocator(cuda_backend.open_device(0), config="")
    yield h
    cp.cuda.Device(0).synchronize()


def queue_held_copy(h, stream, flag, record):
    """A pinned block filled with 0xAA, copied to a new device array on `stream` behind a spin
    kernel that waits for `flag`; record_event(block, stream) when `record`. Returns
    (block, device array)."""
    spin = cp.RawKernel(SPIN, "spin")
    src = h.malloc(N)
    ctypes.memset(src, 0xAA, N)
    dst = cp.zeros(N, dtype=cp.uint8)
    with stream:
        spin((1,), (1,), (np.uintp(flag.device), np.int64(20_000_000_000)))
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src, N, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
    if record:
        h.record_event(src, stream.ptr)
    return src, dst


def overwrite_a_new_block_then_release(h, flag, stream):
    again = h.malloc(N)
    ctypes.memset(again, 0xBB, N)
    flag.set(1)
    stream.synchronize()
    return again


def test_with_record_event_a_queued_copy_never_sees_its_block_overwritten(host):
    flag, stream = HostFlag(), cp.cuda.Stream(non_blocking=True)
    try:
        src, dst = queue_held_copy(host, stream, flag, record=True)
        host.free(src)
        again = overwrite_a_new_block_then_release(host, flag, stream)
        assert again != src and int((dst != 0xAA).sum()) == 0
    finally:
        flag.set(1)
        flag.close()


def test_without_record_event_the_reused_block_is_overwritten_under_the_copy(host):
    flag, stream = HostFlag(), cp.cuda.Stream(non_blocking=True)
    try:
        src, dst = queue_held_copy(host, stream, flag, record=False)
        host.free(src)
        again = overwrite_a_new_block_then_release(host, flag, stream)
        assert again == src and int((dst == 0xBB).sum()) == N
    finally:
        flag.set(1)
        flag.close()


@pytest.mark.parametrize("config", ["", "pinned_use_cuda_host_register:True,pinned_num_register_threads:4",
                                    "pinned_reserve_segment_size_mb:64"])
def test_each_setting_gives_memory_the_gpu_copies_from(config):
    h = HostAllocator(cuda_backend.open_device(0), config=config)
    src = h.malloc(N)
    ctypes.memset(src, 0x5C, N)
    dst = cp.empty(N, dtype=cp.uint8)
    cp.cuda.runtime.memcpy(dst.data.ptr, src, N, cp.cuda.runtime.memcpyHostToDevice)
    assert int((dst == 0x5C).sum()) == N
    h.free(src)


def test_cupyx_empty_pinned_uses_pyalloc_after_install_pinned():
    import cupyx
    import pyalloc.cupy as pc
    from pyalloc.host import get_host_allocator
    pc.install(pinned=True)
    try:
        a = cupyx.empty_pinned((1000,), dtype=np.float32)
        a[:] = 3
        assert get_host_allocator().block_size(a.ctypes.data) == 4096
        assert float(cp.asarray(a).sum()) == 3000.0
    finally:
        pc.uninstall()


def test_a_block_a_captured_graph_copies_from_is_never_handed_out_while_it_may_replay(host):
    # PyTorch's capture rule on the driver: handed out on the capturing stream, tied to it by
    # record_event and freed inside the capture, the block gets no event (the capture stays
    # valid) and is kept, so each replay copies what the program left in it.
    dev = host.device
    stream = cp.cuda.Stream(non_blocking=True)
    dst = cp.zeros(N, dtype=cp.uint8)
    stream.synchronize()
    dev.begin_capture(stream.ptr)
    src = host.malloc(N, stream.ptr)
    cp.cuda.runtime.memcpyAsync(dst.data.ptr, src, N, cp.cuda.runtime.memcpyHostToDevice,
                                stream.ptr)
    host.record_event(src, stream.ptr)
    ctypes.memset(src, 0x3C, N)         # the graph reads the block when it replays
    host.free(src)
    graph = dev.end_capture(stream.ptr)
    try:
        other = host.malloc(N)
        ctypes.memset(other, 0xBB, N)
        dev.launch_graph(graph, stream.ptr)
        stream.synchronize()
        assert other != src and int((dst == 0x3C).sum()) == N
    finally:
        dev.destroy_graph(graph)
