# Expandable segments (expandable_segments:True): the slow path that grows and shrinks a stream's
# reserved address range page by page. Called by _core.pyx with the allocator's lock held.
from libc.stdint cimport uintptr_t, int64_t

from pyalloc._types cimport Block, BlockPool, CoreState
from pyalloc._backend cimport Backend

cdef int try_allocate_expandable_block(CoreState* st, Backend backend, BlockPool* pool,
                                       uintptr_t stream, size_t size, bint may_unmap,
                                       Block** out) except -1
cdef size_t expandable_growth_bytes(CoreState* st, BlockPool* pool, uintptr_t stream,
                                    size_t size) noexcept
cdef int release_page_pool(CoreState* st, Backend backend) except -1
cdef void page_pool_counts(CoreState* st, int64_t* pool_bytes, int64_t* remaps) noexcept
cdef size_t page_pool_bytes(CoreState* st) noexcept nogil
cdef int unmap_block(CoreState* st, Backend backend, Block* b) except -1
cdef size_t mapped_bytes(CoreState* st, BlockPool* pool, uintptr_t stream) noexcept
cdef void free_segment_structs(CoreState* st) noexcept
cdef int destroy_mark_events(CoreState* st, Backend backend, bint outstanding) except -1


cdef inline size_t whole_pages(Block* b, uintptr_t* first, uintptr_t* last) noexcept nogil:
    """The whole pages inside expandable block `b`: [*first, *last), and their bytes (0: none).
    What unmap_block unmaps, and what the release ladder's dry run counts for it."""
    cdef size_t page = b.segment.page_size
    cdef uintptr_t base = b.segment.base
    cdef uintptr_t offset = b.ptr - base
    first[0] = base + ((offset + page - 1) // page) * page
    last[0] = base + ((offset + b.size) // page) * page
    return last[0] - first[0] if last[0] > first[0] else 0
