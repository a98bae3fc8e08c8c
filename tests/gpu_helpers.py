"""Helpers shared by the GPU tests (imported by tests/test_*_gpu.py). Importing this module needs
neither CuPy nor a GPU; HostFlag needs both."""
import ctypes

import pytest

from pyalloc import cuda_backend

# A GPU test module's marks: `gpu`, and skipped, with the reason, where no GPU is visible.
NEEDS_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_backend.is_available(),
                       reason=f"needs an NVIDIA GPU: {cuda_backend.unavailable_reason()}"),
]


def uint32_view(ptr, nbytes, owner):
    """A CuPy uint32 array over pyalloc memory on device 0 (the owner keeps the allocator alive)."""
    import cupy as cp
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id=0)
    return cp.ndarray((nbytes // 4,), dtype=cp.uint32, memptr=cp.cuda.MemoryPointer(mem, 0))


class HostFlag:
    """An int in mapped pinned host memory: the host writes it, a kernel polls it."""

    def __init__(self):
        import cupy as cp
        self._rt = rt = cp.cuda.runtime
        self.host = rt.hostAlloc(4, rt.hostAllocMapped)
        self.device = rt.pointerGetAttributes(self.host).devicePointer
        self.set(0)

    def set(self, value):
        ctypes.c_int.from_address(self.host).value = value

    def close(self):
        self._rt.freeHost(self.host)


def let_numba_cuda_compile_with_this_numpy():
    """numba-cuda 0.30 registers an overload of numpy.row_stack when NumPy >= 2.0 (in
    numba/cuda/np/arrayobj.py, imported when the first kernel compiles); NumPy 2.5 removed
    row_stack, so every compile raised AttributeError on the GPU machine. row_stack was an alias
    of vstack: put it back as one before compiling. Returns whether the alias was added."""
    import numpy
    if hasattr(numpy, "row_stack"):
        return False
    numpy.row_stack = numpy.vstack
    return True
