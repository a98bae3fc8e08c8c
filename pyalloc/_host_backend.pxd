# The host-memory interface the caching host allocator (_host.pyx) calls: where pinned memory comes
# from. Events and streams are the device backend's (_backend.pxd), so that one device's streams
# serve both allocators; `device` names that backend.
#
# Contract, as _backend.pxd's: methods return 0 and raise (CudaError for a failed driver call)
# before changing anything; the caller holds its own lock and never expects a callback.
from libc.stdint cimport uintptr_t

from pyalloc._backend cimport Backend


cdef class HostBackend:
    cdef readonly Backend device       # the device backend whose streams and events blocks use
    cdef readonly str kind             # "sim" or "cuda"

    # Page-locked memory from the driver (cuMemHostAlloc / cuMemFreeHost).
    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) except -1
    cdef int host_free(self, uintptr_t ptr, size_t nbytes) except -1
    # The register path: ordinary (pageable) memory (malloc / free), its pages touched by
    # `threads` threads, then locked (cuMemHostRegister / cuMemHostUnregister).
    cdef int host_malloc(self, size_t nbytes, uintptr_t* ptr) except -1
    cdef int host_mfree(self, uintptr_t ptr, size_t nbytes) except -1
    cdef int touch_pages(self, uintptr_t ptr, size_t nbytes, int threads) except -1
    cdef int host_register(self, uintptr_t ptr, size_t nbytes) except -1
    cdef int host_unregister(self, uintptr_t ptr, size_t nbytes) except -1
    # The reuse sanitizer's check (SimDevice(check_reuse=True)): raise ReuseError when queued work
    # may still use [ptr, ptr + nbytes). The host reads and writes a block as soon as it has it,
    # so any pending use is one too many. A backend without a sanitizer does nothing.
    cdef int check_handout(self, uintptr_t ptr, size_t nbytes) except -1
