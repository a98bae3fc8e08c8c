# cython: language_level=3
"""Base class of the host-memory backends; see _host_backend.pxd for the contract."""
from pyalloc._backend cimport Backend


cdef class HostBackend:
    """Abstract host-memory backend over a device Backend. Subclasses: SimHost (_sim_host.pyx),
    CudaHost (_cuda_host.pyx)."""

    def __init__(self, Backend device not None):
        self.device = device
        self.kind = "abstract"

    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot allocate pinned memory")

    cdef int host_free(self, uintptr_t ptr, size_t nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot free pinned memory")

    cdef int host_malloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot allocate host memory")

    cdef int host_mfree(self, uintptr_t ptr, size_t nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot free host memory")

    cdef int touch_pages(self, uintptr_t ptr, size_t nbytes, int threads) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot touch pages")

    cdef int host_register(self, uintptr_t ptr, size_t nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot register host memory")

    cdef int host_unregister(self, uintptr_t ptr, size_t nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot unregister host memory")

    cdef int check_handout(self, uintptr_t ptr, size_t nbytes) except -1:
        return 0
