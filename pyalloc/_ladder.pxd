# The slow path and the out-of-memory ladder (_ladder.pyx), over the device state.
from libc.stdint cimport uintptr_t, uint32_t

from pyalloc._types cimport Block, BlockPool, MempoolId
from pyalloc._device cimport DeviceState

cdef int malloc_slow(DeviceState* a, BlockPool* pool, size_t orig_size, size_t size,
                     uintptr_t stream, uint32_t metadata_id, uint32_t context_id,
                     Block** out) except -1
cdef size_t policy_release_bytes(DeviceState* a, size_t orig_size, uintptr_t stream) except? 0
cdef int release_cached(DeviceState* a) except -1
cdef int release_pool(DeviceState* a, MempoolId pid) except -1
cdef int release_cached_segment(DeviceState* a, uintptr_t ptr, size_t size,
                                uintptr_t stream) except -1
cdef int record_oom(DeviceState* a, size_t alloc_size, size_t rounded, uintptr_t stream,
                    uint32_t context_id) except -1
cdef size_t grow_expandable(DeviceState* a, bint is_small, uintptr_t stream, size_t nbytes) except? 0
cdef raise_oom_error(DeviceState* a, list observers, int device, size_t requested)
