# Block surgery: the Block objects, the one split, the take of a free block for a hand-out and the
# merge of a free one, and a pool's sorted set and GC candidates as blocks enter them. Inline
# functions over CoreState, carrying out what _policy.pxd decides; every statistic they change
# goes through a commit step of _state.pxd (commit_split, commit_take, commit_merge).
# Layers: _types <- _policy (decisions) <- _state (statistics) <- _blocks (surgery), so none of
# them cimports one above it.
# Reference: PyTorch's c10/cuda/CUDACachingAllocator.cpp (malloc's split, free_block's merge).
from libc.stdint cimport uintptr_t, int64_t

from pyalloc._types cimport Block, BlockPool, CoreState, unlikely
from pyalloc._policy cimport should_split, mergeable
from pyalloc._state cimport commit_split, commit_take, commit_merge


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


# ------------------------------------------------------------------------------- pool entry

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


# ------------------------------------------------------------------------------- split and merge

cdef inline Block* split_block(CoreState* st, Block* b, size_t size, bint front) noexcept nogil:
    """Cut block `b` in two: a new Block for its first (`front`) or last `size` bytes
    (0 < size < b.size), linked beside it in the segment's block list, and b, which keeps the
    rest of its range. Returns the new block.

    The one split: the new block has b's stream, pool, segment and expandable and mapped states.
    The rest is the caller's: which set each part goes in (b is in none, or its key there is
    stale), statistics (commit_split), the segment's allocation stack and free_epoch, which a
    hand-out and a page unmap treat differently.
    """
    cdef Block* piece
    if front:
        piece = new_block(st, b.stream, size, b.pool, b.ptr)
        piece.prev = b.prev
        piece.next = b
        if b.prev != NULL:
            b.prev.next = piece
        b.prev = piece
        b.ptr += size
    else:
        piece = new_block(st, b.stream, size, b.pool, b.ptr + (b.size - size))
        piece.prev = b
        piece.next = b.next
        if b.next != NULL:
            b.next.prev = piece
        b.next = piece
    b.size -= size
    piece.expandable = b.expandable
    piece.segment = b.segment
    piece.mapped = b.mapped
    return piece


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

    `in_pool`: b is a cached block still in its pool (else a new segment's block).
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
        b = split_block(st, remaining, size, True)
        if b.prev == NULL and remaining.segment_context_id:
            # The front part now heads the segment: it carries the segment's allocation stack
            # (only a head holds one, so merges never drop it).
            b.segment_context_id = remaining.segment_context_id
            remaining.segment_context_id = 0
        remaining.gc_count_base = pool.get_free_blocks_call_count
        if in_pool:
            pool.blocks.reposition_smaller(remaining)
        else:
            pool.blocks.insert(remaining)
        commit_split(st, b, remaining, already_split)
    else:
        if in_pool:
            pool.blocks.erase(b)
        commit_take(st, b, already_split)
    return b


cdef inline Block* merge_free_block(CoreState* st, Block* b) noexcept nogil:
    """Put block `b`, whose uses are all over, back into its pool, merged with free neighbours;
    returns the block that now holds the merged range.

    Free neighbours are already in the pool. The merged range is kept in one of their Block
    objects (the lower one), which then only needs repositioning; `b` and any second neighbour
    are retired. The inactive-split change goes to commit_merge.
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
    commit_merge(st, merged, split_blocks_delta, split_bytes_delta)
    return merged
