# The policy: every decision PyTorch's allocator makes about one request, as inline functions over
# C structs (rounding, pool size class, segment size, best fit, should-split, the oversize rule).
# The only reader of max_split_size and its sibling settings. It decides and changes nothing: the
# block surgery that carries a decision out is _blocks.pxd's, the statistics _state.pxd's. cimported
# by every module that needs a decision, and inlined there, so the cache-hit path in _hot.pxd is
# these functions, _blocks.pxd's take and merge and the commit steps of _state.pxd.
# Reference: PyTorch's c10/cuda/CUDACachingAllocator.cpp (round_size, get_pool, get_free_block,
# should_split).
from libc.stdint cimport uintptr_t
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport Block, BlockPool, BlockSet, Settings, unlikely

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
