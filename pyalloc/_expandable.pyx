# cython: language_level=3
"""Expandable segments: one reservation of virtual address space per (stream, pool), whose pages
are mapped to physical memory as allocations need them and unmapped by empty_cache or the OOM
flush (PyTorch's ExpandableSegment in c10/cuda/CUDACachingAllocator.cpp).

The core calls these functions with its lock held, after the best-fit search of its pool failed.
Mapped ranges are ordinary free blocks of the pool (mapped = True); unmapped ranges are blocks in
the pool's `unmapped` set. Statistics and trace entries go through the commit steps of _state.pxd.
"""
from libc.stdint cimport uintptr_t
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport Block, BlockPool, CoreState, ExpandableSegment, UnmappedSet
from pyalloc._policy cimport (is_free, new_block, retire_block, absorb_neighbour, pool_insert,
                              reservation_size, kSmallBuffer, kLargeBuffer)
from pyalloc._state cimport commit_map, commit_unmap
from pyalloc._backend cimport Backend, BACKEND_OOM

cdef extern from *:
    """
    static inline pyalloc::ExpandableSegment* new_segment_struct() { return new pyalloc::ExpandableSegment(); }
    static inline void free_segment_struct(pyalloc::ExpandableSegment* s) { delete s; }
    """
    ExpandableSegment* new_segment_struct() nogil
    void free_segment_struct(ExpandableSegment*) nogil


def expandable_reservation_size(size_t total_bytes, bint small_pool):
    """Bytes of address space one expandable segment reserves on a device of `total_bytes`."""
    return reservation_size(total_bytes, kSmallBuffer if small_pool else kLargeBuffer)


cdef size_t merge_into(CoreState* st, Block* dst, Block* src) noexcept:
    """Absorb neighbour `src` into `dst` when both are free with the same mapped state.

    Returns the bytes absorbed (0: no merge). dst must not be in a pool set (its key changes).
    """
    if not is_free(src) or dst.mapped != src.mapped:
        return 0
    absorb_neighbour(dst, src)
    if src.mapped:
        dst.pool.blocks.erase(src)
    else:
        dst.pool.unmapped.erase(src)
    retire_block(st, src)
    return dst.size


cdef Block* existing_run(BlockPool* pool, uintptr_t stream, size_t size) noexcept:
    """The first block of the lowest free-or-unmapped run of `stream`'s expandable segments in
    `pool` with room for `size` bytes (starting at the free block just before an unmapped range
    when there is one), or NULL when none has room."""
    cdef Block key
    key.stream = stream
    key.ptr = 0
    cdef UnmappedSet.iterator it = pool.unmapped.lower_bound(&key)
    cdef Block* candidate
    cdef Block* walk
    cdef size_t room
    while it != pool.unmapped.end() and deref(it).stream == stream:
        candidate = deref(it)
        inc(it)
        if is_free(candidate.prev):
            candidate = candidate.prev
        room = 0
        walk = candidate
        while room < size and is_free(walk):
            room += walk.size
            walk = walk.next
        if room >= size:
            return candidate
    return NULL


cdef inline size_t pages_for(size_t nbytes, size_t page) noexcept nogil:
    return ((nbytes + page - 1) // page) * page


cdef size_t expandable_growth_bytes(BlockPool* pool, uintptr_t stream, size_t size) noexcept:
    """Bytes of physical memory try_allocate_expandable_block would map now for `size` bytes on
    `stream` (its mapping loop, counted instead of done; for the release ladder's dry run). A new
    segment maps the request's pages."""
    cdef Block* walk = existing_run(pool, stream, size)
    cdef size_t page = kSmallBuffer if pool.is_small else kLargeBuffer
    if walk == NULL:
        return pages_for(size, page)
    cdef size_t have = 0, need = 0, mapped
    while have < size:
        if walk.mapped:
            have += walk.size
        else:
            mapped = min(pages_for(size - have, page), walk.size)
            need += mapped
            have += mapped
        walk = walk.next
    return need


cdef int find_expandable_block(CoreState* st, Backend backend, BlockPool* pool, uintptr_t stream,
                               size_t size, Block** out) except -1:
    """*out = the lowest free-or-unmapped run of `stream`'s expandable segment with room for `size`
    bytes, starting at a free block just before the unmapped range when there is one; a new
    segment (all unmapped) when none has room. Returns 0, or BACKEND_OOM when the address space
    for a new segment cannot be reserved (the caller's out-of-memory ladder then releases cached
    segments, whose reservations go with them, and retries)."""
    cdef Block* candidate = existing_run(pool, stream, size)
    if candidate != NULL:
        out[0] = candidate
        return 0
    cdef size_t free_bytes = 0, total_bytes = 0
    backend.memory_info(&free_bytes, &total_bytes)
    cdef size_t page = kSmallBuffer if pool.is_small else kLargeBuffer
    cdef size_t va_size = reservation_size(total_bytes, page)
    cdef uintptr_t base = 0
    if backend.vm_reserve(va_size, &base) == BACKEND_OOM:
        return BACKEND_OOM
    cdef ExpandableSegment* seg = new_segment_struct()
    seg.base = base
    seg.size = va_size
    seg.page_size = page
    seg.stream = stream
    seg.pool = pool
    seg.mapped = 0
    st.expandable_segments.push_back(seg)
    if pool.owner != NULL:
        pool.owner.device_allocations += 1      # the reservation, until its release below
    candidate = new_block(st, stream, va_size, pool, base)
    candidate.mapped = False
    candidate.expandable = True
    candidate.segment = seg
    pool.unmapped.insert(candidate)
    out[0] = candidate
    return 0


cdef int map_block(CoreState* st, Backend backend, Block* to_map, size_t size) except -1:
    """Map the whole pages covering the first `size` bytes of unmapped block `to_map`.

    Returns 1 on success (to_map becomes a free mapped block, merged with free neighbours and
    in the pool) or 0 when the device is out of memory.
    """
    cdef ExpandableSegment* seg = to_map.segment
    cdef size_t page = seg.page_size
    cdef size_t mapped = min(pages_for(size, page), to_map.size)
    if backend.vm_map(to_map.ptr, mapped, page) == BACKEND_OOM:
        return 0
    cdef BlockPool* pool = to_map.pool
    pool.unmapped.erase(to_map)
    to_map.mapped = True
    cdef Block* rest
    if mapped < to_map.size:
        rest = new_block(st, to_map.stream, to_map.size - mapped, pool, to_map.ptr + mapped)
        rest.mapped = False
        rest.expandable = True
        rest.segment = seg
        rest.prev = to_map
        rest.next = to_map.next
        if rest.next != NULL:
            rest.next.prev = rest
        to_map.next = rest
        to_map.size = mapped
        pool.unmapped.insert(rest)
    cdef uintptr_t mapped_at = to_map.ptr
    merge_into(st, to_map, to_map.prev)
    merge_into(st, to_map, to_map.next)
    pool_insert(pool, to_map)
    seg.mapped += mapped
    commit_map(st, pool, mapped_at, mapped, to_map.stream)
    return 1


cdef int try_allocate_expandable_block(CoreState* st, Backend backend, BlockPool* pool,
                                       uintptr_t stream, size_t size, Block** out) except -1:
    """Grow `stream`'s expandable segment until a free block of `size` bytes exists there:
    0 with *out that block (out of the pool), or BACKEND_OOM."""
    cdef Block* candidate = NULL
    if find_expandable_block(st, backend, pool, stream, size, &candidate) == BACKEND_OOM:
        return BACKEND_OOM
    cdef Block* following
    cdef size_t want
    if not candidate.mapped:
        if not map_block(st, backend, candidate, min(candidate.size, size)):
            if candidate.prev == NULL and candidate.next == NULL:
                # A segment with nothing mapped (just reserved for this request): give its
                # address space back, or nothing ever would (empty_cache unmaps mapped blocks).
                release_reservation(st, backend, candidate)
            return BACKEND_OOM
    # The mapped candidate may merge away; its free run continues with unmapped blocks.
    while candidate.size < size:
        following = candidate.next
        want = size - candidate.size
        if not map_block(st, backend, following, min(want, following.size)):
            return BACKEND_OOM
        # following merged into the block before it, which now spans candidate's range.
        candidate = following
    pool.blocks.erase(candidate)
    out[0] = candidate
    return 0


cdef void split_off_mapped(CoreState* st, Block* b, uintptr_t ptr, size_t size, bint before) noexcept:
    """Link a free mapped block for [ptr, ptr + size) just before or after b (same segment)
    and put it in the pool; b's own range is the caller's to adjust."""
    cdef Block* piece = new_block(st, b.stream, size, b.pool, ptr)
    piece.expandable = True
    piece.segment = b.segment
    if before:
        piece.prev = b.prev
        piece.next = b
        if b.prev != NULL:
            b.prev.next = piece
        b.prev = piece
    else:
        piece.next = b.next
        piece.prev = b
        if b.next != NULL:
            b.next.prev = piece
        b.next = piece
    pool_insert(b.pool, piece)


cdef int unmap_block(CoreState* st, Backend backend, Block* b) except -1:
    """Unmap the whole pages inside free expandable block `b`; partial pages stay mapped."""
    cdef ExpandableSegment* seg = b.segment
    cdef size_t page = seg.page_size
    cdef uintptr_t first, last
    if whole_pages(b, &first, &last) == 0:
        return 0
    # Work queued before the free may still use these pages. PyTorch synchronizes only the
    # segment's stream; pyalloc waits for the device, because CuPy destroys a stream when its
    # object is collected, and synchronizing a destroyed stream handle is undefined.
    backend.device_synchronize()
    backend.vm_unmap(first, last - first, page)
    cdef BlockPool* pool = b.pool
    pool.blocks.erase(b)
    # Partial pages at either end stay mapped, as free blocks of their own.
    if first > b.ptr:
        split_off_mapped(st, b, b.ptr, first - b.ptr, True)
    if b.ptr + b.size > last:
        split_off_mapped(st, b, last, b.ptr + b.size - last, False)
    b.ptr = first
    b.size = last - first
    b.mapped = False
    merge_into(st, b, b.prev)
    merge_into(st, b, b.next)
    pool.unmapped.insert(b)
    seg.mapped -= last - first
    commit_unmap(st, pool, first, last - first, b.stream)
    if b.prev == NULL and b.next == NULL:
        # Nothing of the segment is mapped any more: give the address space back.
        release_reservation(st, backend, b)
    return 0


cdef int release_reservation(CoreState* st, Backend backend, Block* b) except -1:
    """Release the address space of an expandable segment that is one unmapped block `b`."""
    cdef ExpandableSegment* seg = b.segment
    cdef BlockPool* pool = b.pool
    pool.unmapped.erase(b)
    backend.vm_release(seg.base, seg.size)
    for i in range(st.expandable_segments.size()):
        if st.expandable_segments[i] == seg:
            st.expandable_segments[i] = st.expandable_segments.back()
            st.expandable_segments.pop_back()
            break
    free_segment_struct(seg)
    retire_block(st, b)
    if pool.owner != NULL:
        pool.owner.device_allocations -= 1
    return 0


cdef size_t mapped_bytes(CoreState* st, BlockPool* pool, uintptr_t stream) noexcept:
    """Bytes mapped in the expandable segments of `stream` in `pool`."""
    cdef size_t total = 0
    cdef ExpandableSegment* seg
    for i in range(st.expandable_segments.size()):
        seg = st.expandable_segments[i]
        if seg.pool == pool and seg.stream == stream:
            total += seg.mapped
    return total


cdef void free_segment_structs(CoreState* st) noexcept:
    """Delete the host-side records of every expandable segment (allocator teardown)."""
    for i in range(st.expandable_segments.size()):
        free_segment_struct(st.expandable_segments[i])
    st.expandable_segments.clear()
