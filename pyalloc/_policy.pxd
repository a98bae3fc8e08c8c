# The policy: every decision PyTorch's allocator makes about one request, as inline functions over
# C structs (rounding, pool size class, segment size, best fit, should-split, split, merge).
# cimported by every module that needs a decision, and inlined there, so the cache-hit path in
# _core.pyx is these functions plus the commit steps of _state.pxd.
# Reference: PyTorch's c10/cuda/CUDACachingAllocator.cpp (round_size, get_pool, get_free_block,
# should_split, malloc's split and free_block's merge).
from libc.stdint cimport uintptr_t, int64_t
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport (Block, BlockPool, BlockSet, CoreState, Settings, stat_pool, unlikely,
                             ST_INACTIVE_SPLIT, ST_INACTIVE_SPLIT_BYTES)

cdef extern from *:
    """
    /* Sizes in bytes (PyTorch's constants, CUDACachingAllocator.cpp / AllocatorConfig.h). */
    static const size_t kMinBlockSize = 512;          /* requests are rounded to a multiple */
    static const size_t kSmallSize = 1048576;         /* largest rounded size of the small pool */
    static const size_t kSmallBuffer = 2097152;       /* small-pool segment and page size */
    static const size_t kMinLargeAlloc = 10485760;    /* below: large requests get kLargeBuffer */
    static const size_t kLargeBuffer = 20971520;      /* mid-size segment, large-pool page size */
    static const size_t kRoundLarge = 2097152;        /* larger segments round up to this */
    static const size_t kSizeMax = (size_t)-1;        /* "unlimited" max_split_size */
    static const unsigned long long kMaxRequest = 1ULL << 60;   /* 1 EiB: refused up front */
    static const int kRoundUpPowerOfTwoIntervals = 16;
    """
    const size_t kMinBlockSize
    const size_t kSmallSize
    const size_t kSmallBuffer
    const size_t kMinLargeAlloc
    const size_t kLargeBuffer
    const size_t kRoundLarge
    const size_t kSizeMax
    const unsigned long long kMaxRequest
    const int kRoundUpPowerOfTwoIntervals
    int __builtin_clzll(unsigned long long) nogil


cdef inline int floor_log2(size_t x) noexcept nogil:
    return 63 - __builtin_clzll(x)


cdef inline size_t roundup_power2_next_division(size_t size, size_t divisions) noexcept nogil:
    """Round `size` up to the next of `divisions` equal steps between two powers of two."""
    if (size & (size - 1)) == 0:
        return size
    cdef size_t power2_floor = (<size_t>1) << floor_log2(size)
    cdef size_t step = power2_floor >> floor_log2(divisions)
    if step == 0:
        return power2_floor << 1
    cdef size_t floor_to_step = size & ~(step - 1)
    return size if floor_to_step == size else floor_to_step + step


cdef inline size_t round_size(const Settings* s, size_t size) noexcept nogil:
    """The block size (bytes) a request of `size` bytes gets: 512-byte multiples, or the next
    power-of-two division where roundup_power2_divisions asks for one."""
    if size < kMinBlockSize:
        return kMinBlockSize
    cdef int index = floor_log2(size) - 20
    if index < 0:
        index = 0
    elif index > kRoundUpPowerOfTwoIntervals - 1:
        index = kRoundUpPowerOfTwoIntervals - 1
    cdef size_t divisions = s.roundup_divisions[index]
    if divisions > 1 and size > kMinBlockSize * divisions:
        return roundup_power2_next_division(size, divisions)
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


cdef inline bint is_small_request(size_t rounded) noexcept nogil:
    """Pool size class: rounded sizes up to 1 MiB are served by a small pool."""
    return rounded <= kSmallSize


cdef inline size_t segment_size_for(size_t rounded) noexcept nogil:
    """Bytes of the segment a new allocation of `rounded` bytes gets."""
    if rounded <= kSmallSize:
        return kSmallBuffer
    if rounded < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((rounded + kRoundLarge - 1) // kRoundLarge)


cdef inline size_t reservation_size(size_t total_bytes, size_t page) noexcept nogil:
    """Address space an expandable segment reserves: 1.125x the device's memory, in whole pages,
    so one segment per stream and pool can grow as far as physical memory allows."""
    return page * ((total_bytes + total_bytes // 8 + page - 1) // page)


cdef inline bint gc_enabled(const Settings* s) noexcept nogil:
    """garbage_collection_threshold acts only under a per-process memory limit."""
    return s.allowed_memory_maximum != kSizeMax and s.gc_threshold > 0.0


cdef inline bint is_oversize(const Settings* s, size_t size) noexcept nogil:
    """A block (or request) of `size` bytes is "oversize": at least max_split_size."""
    return size >= s.max_split_size


cdef inline bint oversize_allowed(const Settings* s, size_t block_size, size_t size) noexcept nogil:
    """Whether a free block of `block_size` bytes may serve a request of `size` rounded bytes under
    the oversize rules: an oversize block is never carved for a smaller request, and a large
    request takes one only if the excess stays under max_non_split_rounding_size."""
    if unlikely(size < s.max_split_size and block_size >= s.max_split_size):
        return False
    # (block_size >= size: the excess is compared, so a huge max_non_split_rounding_size
    # saturates instead of wrapping size + limit around to a small number.)
    return not unlikely(size >= s.max_split_size
                        and block_size - size >= s.max_non_split_rounding_size)


cdef inline size_t oversize_release_target(const Settings* s, size_t size) noexcept nogil:
    """The bytes of oversize cached segments the OOM ladder frees at least for a request of `size`
    rounded bytes: max(size, max_split_size); 0 when max_split_size is not set (no such step)."""
    if s.max_split_size == kSizeMax:
        return 0
    return size if size > s.max_split_size else s.max_split_size


cdef inline bint is_free(Block* b) noexcept nogil:
    """A block that could be handed out: not allocated and not waiting for other streams."""
    return b != NULL and not b.allocated and b.event_count == 0 and b.stream_uses.empty()


cdef inline bint mergeable(Block* b, Block* neighbour) noexcept nogil:
    """True when `neighbour` of `b` is a free block that may absorb or be absorbed by it."""
    return is_free(neighbour) and neighbour.mapped == b.mapped


cdef inline size_t expandable_size(Block* b) noexcept nogil:
    """A block's size plus the unmapped range right after it (room it can grow into)."""
    return b.size + (b.next.size if b.next != NULL and not b.next.mapped else 0)


cdef inline void gc_track(BlockPool* pool, Block* b) noexcept nogil:
    """List `b`, just (re)inserted into `pool`, among the garbage collector's candidates when it
    is one: a whole segment (unsplit, not expandable) of a large pool."""
    if not pool.is_small and not b.expandable and not b.is_split():
        pool.gc_add(b)


cdef inline void pool_insert(BlockPool* pool, Block* b) noexcept nogil:
    # Every (re)insertion restarts the block's garbage-collection age.
    b.gc_count_base = pool.get_free_blocks_call_count
    pool.blocks.insert(b)
    gc_track(pool, b)


cdef inline Block* get_free_block(const Settings* s, BlockPool* pool, uintptr_t stream,
                                  size_t size) noexcept nogil:
    """Best fit: the smallest free block of `stream` that fits, subject to the oversize rules.

    The block stays in its pool: take_block either re-sorts it (split) or removes it.
    """
    if unlikely(gc_enabled(s)):
        pool.get_free_blocks_call_count += 1
    cdef BlockSet.iterator it = pool.blocks.lower_bound(stream, size)
    if unlikely(it == pool.blocks.end() or deref(it).stream != stream):
        return NULL
    cdef BlockSet.iterator after
    if unlikely(deref(it).expandable):
        if s.expandable_segments:
            # Best fit by the size a block could grow to: a block followed by unmapped space is
            # the segment's growth frontier, kept for last while another block fits.
            after = it
            inc(after)
            while (deref(it).expandable and after != pool.blocks.end()
                   and deref(after).stream == stream
                   and expandable_size(deref(after)) < expandable_size(deref(it))):
                it = after
                inc(after)
        else:
            # Expandable segments were switched off at run time: take only ordinary blocks.
            while it != pool.blocks.end() and deref(it).expandable and deref(it).stream == stream:
                inc(it)
            if it == pool.blocks.end() or deref(it).stream != stream:
                return NULL
    cdef Block* b = deref(it)
    return b if oversize_allowed(s, b.size, size) else NULL


cdef inline bint should_split(const Settings* s, Block* b, size_t size) noexcept nogil:
    """Whether handing `size` bytes out of free block `b` leaves a remainder worth keeping."""
    cdef size_t remaining = b.size - size
    if unlikely(b.pool.owner != NULL and b.pool.owner.no_split):
        return False
    if b.pool.is_small or s.expandable_segments:
        return remaining >= kMinBlockSize
    return size < s.max_split_size and remaining > kSmallSize


# ------------------------------------------------------------------------------- block objects

cdef inline Block* new_block(CoreState* st, uintptr_t stream, size_t size, BlockPool* pool,
                             uintptr_t ptr) noexcept nogil:
    """A Block for [ptr, ptr + size) of `pool`, recycled when one is spare (no operator new on
    the cache-hit path)."""
    cdef Block* b
    if unlikely(st.spare_blocks.empty()):
        b = new Block()
    else:
        b = st.spare_blocks.back()
        st.spare_blocks.pop_back()
    b.stream = stream
    b.size = size
    b.ptr = ptr
    b.pool = pool
    b.requested_size = 0
    b.prev = NULL
    b.next = NULL
    b.allocated = False
    b.mapped = True
    b.expandable = False
    b.buffer_owned = False
    b.segment = NULL
    b.event_count = 0
    b.gc_count_base = 0
    b.stream_uses.clear()
    b.metadata_id = 0
    b.context_id = 0
    b.segment_context_id = 0
    return b


cdef inline void retire_block(CoreState* st, Block* b) noexcept nogil:
    st.spare_blocks.push_back(b)


# ------------------------------------------------------------------------------- split and merge

cdef inline void absorb_neighbour(Block* dst, Block* src) noexcept nogil:
    """dst takes over the byte range of its neighbour src in the segment's block list.

    List surgery only: pools, statistics and src's Block object are the caller's (the free path
    and the expandable map/unmap paths handle those differently). A range absorbed from below
    brings the segment's allocation stack along, which only a segment's head block carries.
    """
    if dst.prev == src:
        dst.ptr = src.ptr
        dst.prev = src.prev
        if dst.prev != NULL:
            dst.prev.next = dst
        if src.segment_context_id:
            dst.segment_context_id = src.segment_context_id
    else:
        dst.next = src.next
        if dst.next != NULL:
            dst.next.prev = dst
    dst.size += src.size
    if src.free_epoch > dst.free_epoch:
        dst.free_epoch = src.free_epoch    # the range's uses end with the later of the two


cdef inline Block* take_block(CoreState* st, Block* b, bint in_pool, size_t size) noexcept nogil:
    """Take `size` bytes out of free block `b` for a hand-out, splitting off the unused tail
    when should_split says so; returns the block to hand out (b itself, or its new front part).

    `in_pool`: b is a cached block still in its pool (else a new segment's block). Updates the
    inactive-split statistics (not for expandable segments, as PyTorch).
    """
    cdef BlockPool* pool = b.pool
    cdef Block* remaining
    cdef bint already_split = b.is_split()
    if unlikely(b.gc_listed):
        pool.gc_remove(b)       # handed out, or split: no longer a GC candidate either way
    if should_split(&st.settings, b, size):
        # The front part is handed out as a new Block; the remainder keeps its Block, shifted,
        # and its place in the pool when it still sorts there (no tree update at all).
        remaining = b
        b = new_block(st, remaining.stream, size, pool, remaining.ptr)
        b.expandable = remaining.expandable
        b.segment = remaining.segment
        b.prev = remaining.prev
        if b.prev != NULL:
            b.prev.next = b
        elif remaining.segment_context_id:
            # The front part now heads the segment: it carries the segment's allocation stack
            # (only a head holds one, so merges never drop it).
            b.segment_context_id = remaining.segment_context_id
            remaining.segment_context_id = 0
        b.next = remaining
        remaining.prev = b
        remaining.ptr += size
        remaining.size -= size
        remaining.gc_count_base = pool.get_free_blocks_call_count
        if in_pool:
            pool.blocks.reposition_smaller(remaining)
        else:
            pool.blocks.insert(remaining)
        if not b.expandable:
            if already_split:
                stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], pool.is_small, -<int64_t>b.size)
            else:
                stat_pool(&st.stats[ST_INACTIVE_SPLIT], pool.is_small, 1)
                stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], pool.is_small, <int64_t>remaining.size)
    else:
        if in_pool:
            pool.blocks.erase(b)
        if already_split and not b.expandable:
            stat_pool(&st.stats[ST_INACTIVE_SPLIT], pool.is_small, -1)
            stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], pool.is_small, -<int64_t>b.size)
    return b


cdef inline Block* merge_free_block(CoreState* st, Block* b) noexcept nogil:
    """Put block `b`, whose uses are all over, back into its pool, merged with free neighbours;
    returns the block that now holds the merged range.

    Free neighbours are already in the pool. The merged range is kept in one of their Block
    objects (the lower one), which then only needs repositioning; `b` and any second neighbour
    are retired. Updates the inactive-split statistics (not for expandable segments).
    """
    cdef BlockPool* pool = b.pool
    cdef int64_t split_blocks_delta = 0
    cdef int64_t split_bytes_delta = 0
    cdef Block* prev = b.prev if mergeable(b, b.prev) else NULL
    cdef Block* next = b.next if mergeable(b, b.next) else NULL
    cdef Block* merged
    if prev == NULL and next == NULL:
        merged = b
        b.context_id = 0
        b.metadata_id = 0
        b.requested_size = 0
        pool_insert(pool, b)
    else:
        merged = prev if prev != NULL else next
        if prev != NULL and next != NULL:
            pool.blocks.erase(next)
        # The neighbours' sizes leave the inactive-split count; the merged range re-enters it
        # below if it is still split.
        if prev != NULL:
            split_bytes_delta -= <int64_t>prev.size
            absorb_neighbour(prev, b)        # prev heads the range and keeps its context
        else:
            split_bytes_delta -= <int64_t>next.size
            absorb_neighbour(next, b)        # next becomes the head of the range
        split_blocks_delta -= 1
        if prev != NULL and next != NULL:
            split_bytes_delta -= <int64_t>next.size
            absorb_neighbour(prev, next)
            split_blocks_delta -= 1
            retire_block(st, next)
        retire_block(st, b)
        merged.gc_count_base = pool.get_free_blocks_call_count
        pool.blocks.reposition_larger(merged)
        gc_track(pool, merged)      # the neighbours were split, so none of them was listed
    merged.free_epoch = st.free_epoch      # b's uses are the range's latest
    if merged.is_split():
        split_blocks_delta += 1
        split_bytes_delta += <int64_t>merged.size
    if not merged.expandable:
        stat_pool(&st.stats[ST_INACTIVE_SPLIT], pool.is_small, split_blocks_delta)
        stat_pool(&st.stats[ST_INACTIVE_SPLIT_BYTES], pool.is_small, split_bytes_delta)
    return merged
