# cython: language_level=3
"""Base class of the device backends; see _backend.pxd for the contract."""


cdef class Backend:
    """Abstract device backend. Subclasses implement the methods declared in _backend.pxd."""

    def __init__(self, int device=0):
        self.device = device
        self.kind = "abstract"

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot allocate segments")

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot free segments")

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot report memory")

    cdef int event_create(self, uintptr_t* event) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    cdef int event_query(self, uintptr_t event) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    cdef int event_synchronize(self, uintptr_t event) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    cdef int event_destroy(self, uintptr_t event) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no streams")

    cdef int device_synchronize(self) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot synchronize")

    cdef int vm_granularity(self, size_t* nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no virtual memory operations")

    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no virtual memory operations")

    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no virtual memory operations")

    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no virtual memory operations")

    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no virtual memory operations")

    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1:
        # A backend without capture support never reports a capturing stream.
        return 0

    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        raise NotImplementedError(f"{type(self).__name__} has no graph nodes")
