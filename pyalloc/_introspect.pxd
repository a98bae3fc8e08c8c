# What the allocator reports about itself (_introspect.pyx), over the device state. The readers
# (statistics, segments, history) take the lock themselves: they copy under it and build their
# Python objects after it.
from libc.stdint cimport uintptr_t, uint32_t
from libcpp.vector cimport vector

from pyalloc._types cimport Block, BlockPool, MempoolId
from pyalloc._device cimport DeviceState

cdef struct BlockCopy:
    uintptr_t ptr
    size_t size
    size_t requested_size
    uintptr_t stream
    MempoolId pool_id
    uint32_t metadata_id
    uint32_t context_id
    uint32_t segment_context_id
    bint allocated
    bint pending_free
    bint is_small
    bint expandable
    bint starts_segment        # the first block of a snapshot segment

# Lock held by the caller:
cdef void collect_blocks(DeviceState* a, vector[Block*]* out) noexcept
cdef Block* raise_not_allocated(DeviceState* a, uintptr_t ptr, bint known) except NULL
cdef void copy_segments(DeviceState* a, vector[BlockCopy]* out) noexcept
cdef int check_invariants(DeviceState* a) except -1
# Taking the lock:
cdef dict memory_stats(DeviceState* a)
cdef void reset_peak_memory_stats(DeviceState* a) noexcept
cdef void reset_accumulated_memory_stats(DeviceState* a) noexcept
cdef list segments(DeviceState* a)
cdef int set_history(DeviceState* a, bint enabled, size_t max_entries, uint32_t skip_mask,
                     bint clear) except -1
cdef tuple history_entries(DeviceState* a)
cdef dict live_bytes_by_metadata(DeviceState* a, bint requested)
cdef object pool_info(DeviceState* a, MempoolId pid)
cdef list private_pool_ids(DeviceState* a)
cdef list expandable_segment_sizes(DeviceState* a)
cdef void free_host_memory(DeviceState* a) noexcept
