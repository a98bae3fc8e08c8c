# The commit steps: the one place where an allocation, a free or a segment change updates the
# statistics and writes its trace entry. Inline functions over CoreState, used by _core.pyx (the
# hot path) and _expandable.pyx (page maps and unmaps), so a statistic cannot drift between them.
from libc.stdint cimport uintptr_t, int64_t, uint32_t

from pyalloc._types cimport (Block, BlockPool, CoreState, trace_record, unlikely, stat_add, stat_up, stat_down,
                             stat_pool, stat_move, ST_ALLOCATION, ST_SEGMENT, ST_ACTIVE, ST_ALLOCATED_BYTES,
                             ST_RESERVED_BYTES, ST_ACTIVE_BYTES, ST_REQUESTED_BYTES, TR_ALLOC,
                             TR_FREE_REQUESTED, TR_FREE_COMPLETED, TR_SEGMENT_ALLOC,
                             TR_SEGMENT_FREE, TR_SEGMENT_MAP, TR_SEGMENT_UNMAP, TR_OOM)
from pyalloc._policy cimport merge_free_block, is_oversize


cdef inline void trace(CoreState* st, int action, uintptr_t addr, size_t size, uintptr_t stream,
                       uint32_t context_id) noexcept nogil:
    """Append a trace entry to the history ring when history is on and `action` is not skipped
    (the append itself is out of line: the hot path keeps only this test). The commit steps test
    history_on before calling too, so that their arguments (a select among context ids) are
    computed only when history is on: without that test the cache-hit pair measured 4 more
    instructions and 2 more instruction cache lines (bench/cold_entry_pair.py --callgrind)."""
    if unlikely(st.history_on) and not (st.skip_actions_mask >> action) & 1:
        trace_record(st, action, addr, size, stream, context_id)


cdef inline int pool_slot(BlockPool* pool) noexcept nogil:
    """The statistics slot of a pool's size class: 1 small_pool, 2 large_pool (0 is "all")."""
    return 1 if pool.is_small else 2


cdef inline void commit_alloc(CoreState* st, Block* b, size_t orig_size, uint32_t metadata_id,
                              uint32_t context_id) noexcept nogil:
    """Block `b` is handed out for a request of `orig_size` bytes."""
    b.allocated = True
    b.requested_size = orig_size
    b.metadata_id = metadata_id
    b.context_id = context_id
    cdef int slot = pool_slot(b.pool)
    stat_up(&st.stats[ST_ALLOCATION], slot, 1)
    stat_up(&st.stats[ST_ALLOCATED_BYTES], slot, <int64_t>b.size)
    stat_up(&st.stats[ST_ACTIVE], slot, 1)
    stat_up(&st.stats[ST_ACTIVE_BYTES], slot, <int64_t>b.size)
    stat_up(&st.stats[ST_REQUESTED_BYTES], slot, <int64_t>orig_size)
    if unlikely(is_oversize(&st.settings, b.size)):
        stat_add(&st.oversize_allocations, 1)
    if unlikely(st.history_on):
        trace(st, TR_ALLOC, b.ptr, orig_size, b.stream, context_id)


cdef inline void commit_free_requested(CoreState* st, Block* b, uint32_t context_id) noexcept nogil:
    """The caller gave `b` up; it may still wait for other streams before it is reusable.
    `context_id`: the free call's stack (0: the entry carries the allocation stack)."""
    b.allocated = False
    cdef int slot = pool_slot(b.pool)
    stat_down(&st.stats[ST_ALLOCATION], slot, 1)
    stat_down(&st.stats[ST_ALLOCATED_BYTES], slot, <int64_t>b.size)
    if unlikely(st.history_on):
        trace(st, TR_FREE_REQUESTED, b.ptr, b.requested_size, b.stream,
              context_id if context_id else b.context_id)
    if unlikely(is_oversize(&st.settings, b.size)):
        stat_add(&st.oversize_allocations, -1)


cdef inline Block* commit_free_completed(CoreState* st, Block* b, uint32_t context_id) noexcept nogil:
    """Every use of `b` is over: it returns to its pool, merged with free neighbours (the block
    holding the merged range is returned). The caller has taken it out of the active map."""
    if unlikely(st.history_on):
        trace(st, TR_FREE_COMPLETED, b.ptr, b.requested_size, b.stream,
              context_id if context_id else b.context_id)
    cdef int slot = pool_slot(b.pool)
    cdef int64_t size = <int64_t>b.size
    cdef int64_t requested = <int64_t>b.requested_size
    cdef Block* merged = merge_free_block(st, b)
    stat_down(&st.stats[ST_ACTIVE], slot, 1)
    stat_down(&st.stats[ST_ACTIVE_BYTES], slot, size)
    stat_down(&st.stats[ST_REQUESTED_BYTES], slot, requested)
    return merged


cdef inline void commit_device_memory(CoreState* st, BlockPool* pool, int64_t delta) noexcept nogil:
    """Reserved memory of `pool` changed by `delta` bytes (a segment or a page range)."""
    st.total_allocated_memory += delta
    stat_pool(&st.stats[ST_RESERVED_BYTES], pool.is_small, delta)
    if pool.owner != NULL:
        pool.owner.reserved_bytes += delta
    if delta > 0:
        st.num_device_alloc += 1
    else:
        st.num_device_free += 1


cdef inline void commit_segment_alloc(CoreState* st, Block* segment, uint32_t context_id) noexcept nogil:
    """A new device segment, whole in block `segment`, joins its pool."""
    commit_device_memory(st, segment.pool, <int64_t>segment.size)
    if segment.pool.owner != NULL:
        segment.pool.owner.device_allocations += 1
    stat_pool(&st.stats[ST_SEGMENT], segment.pool.is_small, 1)
    if is_oversize(&st.settings, segment.size):
        stat_add(&st.oversize_segments, 1)
    if st.history_on:
        trace(st, TR_SEGMENT_ALLOC, segment.ptr, segment.size, segment.stream, context_id)


cdef inline void commit_segment_free(CoreState* st, Block* segment) noexcept nogil:
    """The segment that is all of block `segment` went back to the device."""
    commit_device_memory(st, segment.pool, -<int64_t>segment.size)
    if segment.pool.owner != NULL:
        segment.pool.owner.device_allocations -= 1
    stat_pool(&st.stats[ST_SEGMENT], segment.pool.is_small, -1)
    if is_oversize(&st.settings, segment.size):
        stat_add(&st.oversize_segments, -1)
    if st.history_on:
        trace(st, TR_SEGMENT_FREE, segment.ptr, segment.size, segment.stream, 0)


cdef inline void commit_map(CoreState* st, BlockPool* pool, uintptr_t ptr, size_t size,
                            uintptr_t stream, size_t created) noexcept nogil:
    """Pages [ptr, ptr + size) of an expandable segment of `pool` were mapped; `created` bytes of
    them are new device memory (the rest came from the page pool: see commit_page_pool)."""
    if created:
        commit_device_memory(st, pool, <int64_t>created)
    if st.history_on:
        trace(st, TR_SEGMENT_MAP, ptr, size, stream, 0)


cdef inline void commit_unmap(CoreState* st, BlockPool* pool, uintptr_t ptr, size_t size,
                              uintptr_t stream, bint kept) noexcept nogil:
    """Pages [ptr, ptr + size) of an expandable segment of `pool` were unmapped; `kept`: their
    memory went to the page pool (see commit_page_pool), else back to the device."""
    if not kept:
        commit_device_memory(st, pool, -<int64_t>size)
    if st.history_on:
        trace(st, TR_SEGMENT_UNMAP, ptr, size, stream, 0)


cdef inline void commit_retry(CoreState* st) noexcept nogil:
    """The OOM ladder retries a device allocation after its full flush."""
    st.num_alloc_retries += 1


cdef inline void commit_sync_all(CoreState* st) noexcept nogil:
    """Every stream's events were waited for (the full flush, empty_cache)."""
    st.num_sync_all_streams += 1


cdef inline void commit_oom(CoreState* st, size_t free_bytes, size_t rounded, uintptr_t stream,
                            uint32_t context_id) noexcept nogil:
    """A request of `rounded` bytes on `stream` ran out of memory with `free_bytes` free on the
    device. PyTorch's oom entry: device free bytes in addr, the rounded request (not the segment
    size) in size, and the failing call's stream and stack."""
    st.num_ooms += 1
    trace(st, TR_OOM, free_bytes, rounded, stream, context_id)


cdef inline void commit_page_pool(CoreState* st, BlockPool* pool, bint counted_small,
                                  int64_t delta) noexcept nogil:
    """recycle_pages: `delta` bytes of pages left `pool`'s mapped pages for the page pool, where
    size class `counted_small` counts them (delta > 0), or came from there into `pool` (delta <
    0). Reserved bytes stay physical: the total is unchanged, the bytes move between the size
    classes' rows when the two differ (as neither an allocation nor a free), and a private pool
    stops (or starts) counting them."""
    if counted_small != pool.is_small:
        if delta > 0:
            stat_move(&st.stats[ST_RESERVED_BYTES], pool_slot(pool), 1 if counted_small else 2, delta)
        else:
            stat_move(&st.stats[ST_RESERVED_BYTES], 1 if counted_small else 2, pool_slot(pool), -delta)
    if pool.owner != NULL:
        pool.owner.reserved_bytes -= delta


cdef inline void commit_page_pool_release(CoreState* st, bint counted_small, size_t size) noexcept nogil:
    """recycle_pages: `size` bytes of the page pool's pages of size class `counted_small` went
    back to the device."""
    st.total_allocated_memory -= size
    stat_pool(&st.stats[ST_RESERVED_BYTES], counted_small, -<int64_t>size)
    st.num_device_free += 1
