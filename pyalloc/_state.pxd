# The commit steps: the one place where an allocation, a free, a split or merge or a segment change
# updates the statistics and writes its trace entry. Inline functions over CoreState, used by
# _hot.pxd (the cache hit), _blocks.pxd (split and merge), _ladder.pyx and _expandable.pyx (page
# maps and unmaps), so a statistic cannot drift between them. Statistics change nowhere else
# (tests/test_stat_writes.py checks the sources). Whether a block is oversize is the policy's
# answer (is_oversize): max_split_size is read there alone.
from libc.stdint cimport uintptr_t, int64_t, uint32_t

from pyalloc._types cimport (Block, BlockPool, CoreState, trace_record, unlikely, stat_add, stat_up, stat_down,
                             stat_pool, stat_move, stat_reset_peak, stat_reset_accumulated,
                             single_reset_accumulated, NUM_STATS,
                             ST_ALLOCATION, ST_SEGMENT, ST_ACTIVE, ST_ALLOCATED_BYTES,
                             ST_RESERVED_BYTES, ST_ACTIVE_BYTES, ST_REQUESTED_BYTES, ST_INACTIVE_SPLIT,
                             ST_INACTIVE_SPLIT_BYTES, TR_ALLOC,
                             TR_FREE_REQUESTED, TR_FREE_COMPLETED, TR_SEGMENT_ALLOC,
                             TR_SEGMENT_FREE, TR_SEGMENT_MAP, TR_SEGMENT_UNMAP, TR_OOM)
from pyalloc._policy cimport is_oversize

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


cdef inline void commit_free_completed(CoreState* st, Block* b, uint32_t context_id) noexcept nogil:
    """Every use of `b` is over: it is about to return to its pool (the caller merges it next,
    with _blocks.merge_free_block, and has taken it out of the active map)."""
    if unlikely(st.history_on):
        trace(st, TR_FREE_COMPLETED, b.ptr, b.requested_size, b.stream,
              context_id if context_id else b.context_id)
    cdef int slot = pool_slot(b.pool)
    stat_down(&st.stats[ST_ACTIVE], slot, 1)
    stat_down(&st.stats[ST_ACTIVE_BYTES], slot, <int64_t>b.size)
    stat_down(&st.stats[ST_REQUESTED_BYTES], slot, <int64_t>b.requested_size)


# inactive_split / inactive_split_bytes: the free blocks of split segments and their bytes, by
# size class. Not counted for expandable segments, as PyTorch.

cdef inline void commit_split(CoreState* st, Block* handed, Block* remaining,
                              bint already_split) noexcept nogil:
    """Free block `remaining` gave its first bytes to `handed`, a block about to be handed out;
    `already_split`: the free block was a split one before (so it was counted already)."""
    if handed.expandable:
        return
    if already_split:
        stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], handed.pool.is_small, -<int64_t>handed.size)
    else:
        stat_pool(&st.stats[ST_INACTIVE_SPLIT], handed.pool.is_small, 1)
        stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], handed.pool.is_small, <int64_t>remaining.size)


cdef inline void commit_take(CoreState* st, Block* b, bint already_split) noexcept nogil:
    """Free block `b` is handed out whole (unsplit); `already_split`: it is part of a split
    segment, so it leaves the inactive-split count."""
    if already_split and not b.expandable:
        stat_pool(&st.stats[ST_INACTIVE_SPLIT], b.pool.is_small, -1)
        stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], b.pool.is_small, -<int64_t>b.size)


cdef inline void commit_merge(CoreState* st, Block* merged, int64_t split_blocks,
                              int64_t split_bytes) noexcept nogil:
    """A freed block returned to its pool as (part of) free block `merged`: the inactive-split
    count changes by `split_blocks` blocks and `split_bytes` bytes (the merged neighbours left
    it, the merged range re-entered it if still split)."""
    if not merged.expandable:
        stat_pool(&st.stats[ST_INACTIVE_SPLIT], merged.pool.is_small, split_blocks)
        stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], merged.pool.is_small, split_bytes)


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


cdef inline void commit_device_allocation(CoreState* st, BlockPool* pool, int delta) noexcept nogil:
    """A segment, or an expandable segment's address space, of `pool` was allocated (delta 1)
    or given back (-1): a private pool counts them as its device allocations, which keep it
    alive while any is left."""
    if pool.owner != NULL:
        pool.owner.device_allocations += delta


cdef inline void commit_segment_alloc(CoreState* st, Block* segment, uint32_t context_id) noexcept nogil:
    """A new device segment, whole in block `segment`, joins its pool."""
    commit_device_memory(st, segment.pool, <int64_t>segment.size)
    commit_device_allocation(st, segment.pool, 1)
    stat_pool(&st.stats[ST_SEGMENT], segment.pool.is_small, 1)
    if is_oversize(&st.settings, segment.size):
        stat_add(&st.oversize_segments, 1)
    if st.history_on:
        trace(st, TR_SEGMENT_ALLOC, segment.ptr, segment.size, segment.stream, context_id)


cdef inline void commit_segment_free(CoreState* st, Block* segment) noexcept nogil:
    """The segment that is all of block `segment` went back to the device."""
    commit_device_memory(st, segment.pool, -<int64_t>segment.size)
    commit_device_allocation(st, segment.pool, -1)
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


cdef inline void commit_remaps(CoreState* st, int64_t pages) noexcept nogil:
    """recycle_pages: `pages` pages were mapped again from the page pool (negative: a failed
    growth put them back where they came from, so they do not count)."""
    st.page_remaps += pages


cdef inline void commit_reset_peaks(CoreState* st) noexcept nogil:
    """reset_peak_memory_stats: every statistic's peak becomes its current value."""
    cdef int k
    for k in range(NUM_STATS):
        stat_reset_peak(&st.stats[k])
    st.oversize_allocations.peak = st.oversize_allocations.current
    st.oversize_segments.peak = st.oversize_segments.current


cdef inline void commit_reset_accumulated(CoreState* st) noexcept nogil:
    """reset_accumulated_memory_stats: the cumulative allocated/freed counts and the
    retry/OOM/sync/device counters start again from 0."""
    cdef int k
    for k in range(NUM_STATS):
        stat_reset_accumulated(&st.stats[k])
    single_reset_accumulated(&st.oversize_allocations)
    single_reset_accumulated(&st.oversize_segments)
    st.num_alloc_retries = 0
    st.num_ooms = 0
    st.num_sync_all_streams = 0
    st.num_device_alloc = 0
    st.num_device_free = 0
