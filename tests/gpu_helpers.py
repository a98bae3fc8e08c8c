"""Helpers shared by the CuPy GPU tests (imported by tests/test_*_gpu.py; needs CuPy and a GPU)."""
import ctypes


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
