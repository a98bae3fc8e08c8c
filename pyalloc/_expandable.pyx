# cython: language_level=3
"""Expandable segments: one reservation of virtual address space per (stream, pool), whose pages
are mapped to physical memory as allocations need them and unmapped by empty_cache or the OOM
flush (PyTorch's ExpandableSegment in c10/cuda/CUDACachingAllocator.cpp).

The core calls these functions with its lock held, after the best-fit search of its pool failed.
Mapped ranges are ordinary free blocks of the pool (mapped = True); unmapped ranges are blocks in
the pool's `unmapped` set. Statistics and trace entries go through the commit steps of _state.pxd.

recycle_pages (pyalloc only): pages are 2 MiB in both pools, and the physical pages of a device
are recycled between its segments, of both size classes. Whole pages inside free blocks of the
default pools are unmapped into a pool of physical pages (CoreState.free_pages, by the class that
counts them) lazily: when a segment must grow and the page pool holds fewer pages than the growth
maps, just enough of them are taken, largest free block first, never from the run that the
growth maps into. Every map takes pages from the page pool (its own class's first) before it
creates memory. The page pool's pages count as reserved; release_page_pool (the
full flush: empty_cache and the out-of-memory ladder) gives them back first. Nothing is unmapped
while a capture is under way (may_unmap false): a captured graph keeps using the addresses of
its blocks, and cuMemUnmap synchronizes, which a capture forbids.
"""
from libcpp.vector cimport vector
from libcpp.algorithm cimport find
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.unordered_map cimport unordered_map
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec

from pyalloc._types cimport (Block, BlockPool, BlockSet, CoreState, EpochMark, ExpandableSegment,
                             UnmappedSet)
from pyalloc._policy cimport is_free, reservation_size, kSmallBuffer, kLargeBuffer
from pyalloc._blocks cimport new_block, retire_block, absorb_neighbour, pool_insert, split_block
from pyalloc._state cimport (commit_map, commit_unmap, commit_page_pool, commit_page_pool_release,
                             commit_remaps, commit_device_allocation)
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


cdef inline size_t page_of(CoreState* st, BlockPool* pool) noexcept nogil:
    """Bytes of one page of a new expandable segment of `pool`: PyTorch's 2 MiB (small pool) or
    20 MiB (large pool); 2 MiB, the driver's granularity, in both under recycle_pages, so that a
    free block gives all the whole pages it holds."""
    return kSmallBuffer if pool.is_small or st.settings.recycle_pages else kLargeBuffer


cdef size_t page_pool_bytes(CoreState* st) noexcept nogil:
    """Bytes of physical memory in the page pools of both size classes (recycle_pages)."""
    return (st.free_pages[0].size() + st.free_pages[1].size()) * kSmallBuffer


cdef size_t run_growth(CoreState* st, BlockPool* pool, uintptr_t stream, size_t size,
                       Block* walk) noexcept:
    """Bytes of pages try_allocate_expandable_block maps for `size` bytes on `stream` into the
    run that starts at `walk` (existing_run's answer; NULL: a new segment, which maps the
    request's pages)."""
    if walk == NULL:
        return pages_for(size, page_of(st, pool))
    cdef size_t have = 0, need = 0, mapped
    while have < size:
        if walk.mapped:
            have += walk.size
        else:
            mapped = min(pages_for(size - have, walk.segment.page_size), walk.size)
            need += mapped
            have += mapped
        walk = walk.next
    return need


cdef size_t expandable_growth_bytes(CoreState* st, BlockPool* pool, uintptr_t stream,
                                    size_t size) noexcept:
    """Bytes of new device memory try_allocate_expandable_block would create now for `size` bytes
    on `stream` (its mapping, counted instead of done; for the release ladder's dry run): the
    pages it maps, less, under recycle_pages, those the page pool and the recyclable free pages
    give (no capture is under way when the ladder's dry run asks)."""
    cdef Block* run = existing_run(pool, stream, size)
    cdef size_t need = run_growth(st, pool, stream, size, run)
    if not st.settings.recycle_pages:
        return need
    cdef size_t have = page_pool_bytes(st)
    if need <= have:
        return 0
    cdef vector[Block*] victims
    have += recyclable_pages(st, pool, stream, size, run, &victims)
    return need - have if need > have else 0


cdef size_t recyclable_pages(CoreState* st, BlockPool* pool, uintptr_t stream, size_t size,
                             Block* run, vector[Block*]* victims) noexcept:
    """The free blocks with whole pages to give to the page pool (those of the default pools'
    expandable segments), in the order they give them (largest block first), into *victims;
    returns their whole pages' bytes. Blocks of the run that a growth for `size` bytes on `stream` maps into
    (from `run`, existing_run's answer) are left out: their pages are the growth's own."""
    cdef uintptr_t run_lo = 0, run_hi = 0
    cdef ExpandableSegment* run_seg = NULL
    cdef Block* walk = run
    cdef size_t room = 0
    if run != NULL:
        run_seg = run.segment
        run_lo = run.ptr
        while room < size and walk != NULL and is_free(walk):
            room += walk.size
            walk = walk.next
        run_hi = run_lo + room
    cdef vector[BlockPool*] pools
    cdef ExpandableSegment* seg
    cdef size_t i, j
    cdef bint known
    for i in range(st.expandable_segments.size()):
        seg = st.expandable_segments[i]
        if seg.pool.owner != NULL:
            continue            # a private pool's pages stay: its graphs may replay into them
        known = False
        for j in range(pools.size()):
            known = known or pools[j] == seg.pool
        if not known:
            pools.push_back(seg.pool)
    cdef size_t total = 0
    cdef uintptr_t first, last
    cdef BlockSet.iterator it
    cdef Block* b
    cdef size_t start = victims.size()
    for j in range(pools.size()):
        it = pools[j].blocks.end()
        while it != pools[j].blocks.begin():
            dec(it)
            b = deref(it)
            if not b.expandable or b.segment.page_size != kSmallBuffer:
                continue
            if b.segment == run_seg and b.ptr < run_hi and b.ptr + b.size > run_lo:
                continue
            whole_pages(b, &first, &last)
            if last > first:
                victims.push_back(b)
                total += last - first
    # Largest first across the pools (each pool's blocks came largest first).
    cdef Block* t
    for i in range(start + 1, victims.size()):
        j = i
        while j > start and victims[0][j - 1].size < victims[0][j].size:
            t = victims[0][j - 1]
            victims[0][j - 1] = victims[0][j]
            victims[0][j] = t
            j -= 1
    return total


# ------------------------------------------------------------- when pages may be unmapped at once
#
# A growth under recycle_pages records an event (an EpochMark) on its stream. Once the event has
# completed, the work queued on that stream before it is over, so the pages of the stream's free
# blocks stamped (Block.free_epoch, at their return to the pool) before the mark can be unmapped
# without waiting. A training loop's growths thus take pages that the previous iteration freed
# while the device still runs the current one.

cdef enum:
    kMarksPerStream = 4     # outstanding marks kept per stream (a stream far behind gets no more)


cdef size_t outstanding_marks(CoreState* st, uintptr_t stream) noexcept:
    cdef size_t outstanding = 0
    for i in range(st.epoch_marks.size()):
        outstanding += st.epoch_marks[i].stream == stream
    return outstanding


cdef int record_mark(CoreState* st, Backend backend, uintptr_t stream) except -1:
    """Record an epoch mark on `stream` (a live allocation stream: the growth's own), unless it
    has kMarksPerStream outstanding. A failing driver call leaves the marks as they were."""
    if outstanding_marks(st, stream) >= kMarksPerStream:
        poll_marks(st, backend)         # those the device has passed make room
        if outstanding_marks(st, stream) >= kMarksPerStream:
            return 0
    cdef uintptr_t event = 0
    if st.spare_mark_events.empty():
        backend.event_create(&event)
        st.spare_mark_events.push_back(event)
    event = st.spare_mark_events.back()
    backend.event_record(event, stream)
    st.spare_mark_events.pop_back()
    st.free_epoch += 1
    st.epoch_marks.push_back(EpochMark(stream, event, st.free_epoch))
    return 0


cdef int poll_marks(CoreState* st, Backend backend) except -1:
    """Query the outstanding marks; a completed one raises its stream's completed_epoch and its
    event becomes spare. All queries come first, so a failing one changes nothing."""
    cdef vector[char] done
    cdef size_t i, kept = 0
    cdef EpochMark m
    for i in range(st.epoch_marks.size()):
        done.push_back(backend.event_query(st.epoch_marks[i].event) == 1)
    for i in range(st.epoch_marks.size()):
        m = st.epoch_marks[i]
        if done[i]:
            if st.completed_epoch[m.stream] < m.epoch:
                st.completed_epoch[m.stream] = m.epoch
            st.spare_mark_events.push_back(m.event)
        else:
            st.epoch_marks[kept] = m
            kept += 1
    st.epoch_marks.resize(kept)
    return 0


cdef bint unmap_is_safe(CoreState* st, Block* b) noexcept:
    """No work queued before free block `b` returned to its pool can still use its pages: it was
    never used, or the device was synchronized since, or a mark recorded on its stream since has
    completed."""
    if b.free_epoch == 0 or b.free_epoch < st.synced_epoch:
        return True
    cdef unordered_map[uintptr_t, uint64_t].iterator it = st.completed_epoch.find(b.stream)
    return it != st.completed_epoch.end() and b.free_epoch < deref(it).second


cdef int synchronize_for_unmap(CoreState* st, Backend backend) except -1:
    """Wait for the device before unmapping pages whose work may not be over; every block freed
    until now is then safe to unmap."""
    backend.device_synchronize()
    st.free_epoch += 1
    st.synced_epoch = st.free_epoch
    return 0


cdef bint mark_victim_streams(CoreState* st, Backend backend, vector[Block*]* victims) except -1:
    """Record a mark on each stream of the victims whose work is not known to be over (a
    stream that is idle passes it at once: its blocks become safe without a wait; the growth's
    own may have had no room for the growth's first mark); not on a stream the allocator
    destroyed, nor one the backend says is gone. True when one was tried.
    (A block in the pool has no uses left on other streams: its free waited for their events.)"""
    cdef vector[uintptr_t] marked
    cdef Block* b
    for b in victims[0]:
        if unmap_is_safe(st, b) or st.destroyed_streams.count(b.stream) != 0:
            continue
        if find(marked.begin(), marked.end(), b.stream) != marked.end():
            continue
        marked.push_back(b.stream)
        if backend.stream_alive(b.stream) == 1:
            record_mark(st, backend, b.stream)
    return not marked.empty()


cdef bint creation_fits(CoreState* st, Backend backend, size_t created) except -1:
    """`created` bytes of new device memory fit both under the memory limit (which, under
    recycle_pages, counts the memory created) and in the device's free memory now."""
    cdef size_t limit = st.settings.allowed_memory_maximum
    if limit != <size_t>-1 and st.total_allocated_memory + created > limit:
        return False
    cdef size_t free_bytes = 0, total_bytes = 0
    backend.memory_info(&free_bytes, &total_bytes)
    return created <= free_bytes


cdef int destroy_mark_events(CoreState* st, Backend backend, bint outstanding) except -1:
    """Destroy the spare mark events and, with `outstanding` (teardown), the outstanding marks'."""
    cdef uintptr_t event
    if outstanding:
        while not st.epoch_marks.empty():
            event = st.epoch_marks.back().event
            st.epoch_marks.pop_back()
            backend.event_destroy(event)
    while not st.spare_mark_events.empty():
        event = st.spare_mark_events.back()
        st.spare_mark_events.pop_back()
        backend.event_destroy(event)
    return 0


cdef struct Taken:
    ExpandableSegment* seg      # pages [lo, hi) of seg went to the page pool
    uintptr_t lo
    uintptr_t hi


cdef int recycle_for_growth(CoreState* st, Backend backend, BlockPool* pool, uintptr_t stream,
                            size_t size, vector[Taken]* taken) except -1:
    """recycle_pages: before a growth for `size` bytes on `stream` maps pages, unmap into the page
    pool as many whole free pages as it needs beyond what the pool holds; each range unmapped is
    appended to *taken (as soon as it is: a failure later in the growth puts them back)."""
    # Every growth marks its stream, so that a later one knows which frees the device is past.
    record_mark(st, backend, stream)
    cdef Block* run = existing_run(pool, stream, size)
    cdef size_t need = run_growth(st, pool, stream, size, run)
    cdef size_t have = page_pool_bytes(st)
    if need <= have:
        return 0
    cdef vector[Block*] victims
    if recyclable_pages(st, pool, stream, size, run, &victims) == 0:
        return 0
    cdef size_t want = need - have, take
    cdef uintptr_t first, last
    cdef Block* b
    cdef ExpandableSegment* seg
    # cuMemUnmap does not wait for the device: work queued before a block's free may still use
    # its pages, and would fault. Only the blocks whose work is known to be over give pages, and
    # nothing waits, unless the memory the growth would then create does not fit (the memory
    # limit, or the device's free memory): then the device is synchronized and every free block
    # may give (largest first, as always). A wait costs the growth the whole queue's run time
    # (a training step: 25.5 against 20.1 ms on the H200 when every such growth waited,
    # docs/recycle_pages.md), creating costs memory only while the work runs: the next
    # growths take those pages.
    poll_marks(st, backend)
    if mark_victim_streams(st, backend, &victims):
        poll_marks(st, backend)
    cdef vector[Block*] ready
    cdef size_t ready_bytes = 0
    for b in victims:
        if unmap_is_safe(st, b):
            ready.push_back(b)
            ready_bytes += whole_pages(b, &first, &last)
    if ready.size() == victims.size():
        pass                            # nothing to wait for
    elif ready_bytes >= want or creation_fits(st, backend, want - ready_bytes):
        victims.swap(ready)
    else:
        synchronize_for_unmap(st, backend)
    for b in victims:
        if want == 0:
            break
        whole_pages(b, &first, &last)
        take = min(last - first, want)
        seg = b.segment
        unmap_range(st, backend, b, last - take, last, True)
        taken.push_back(Taken(seg, last - take, last))
        want -= take
    return 0


cdef int put_back(CoreState* st, Backend backend, vector[Taken]* taken) except -1:
    """Map the ranges of *taken back where they were, from the page pool, newest first: a growth
    that failed on a driver call then leaves the blocks as they were (trace entries apart)."""
    cdef Block key
    cdef UnmappedSet.iterator it
    cdef Block* u
    cdef Taken t
    cdef size_t i = taken.size()
    cdef BlockPool* pool
    while i > 0:
        i -= 1
        t = taken[0][i]
        pool = t.seg.pool
        key.stream = t.seg.stream
        key.ptr = t.lo
        it = pool.unmapped.upper_bound(&key)
        dec(it)
        u = deref(it)
        if u.ptr < t.lo:
            # Split the unmapped block at lo: its head stays unmapped, before it.
            pool.unmapped.erase(u)
            pool.unmapped.insert(split_block(st, u, t.lo - u.ptr, True))
            pool.unmapped.insert(u)
        if map_block(st, backend, u, t.hi - t.lo):
            commit_remaps(st, -<int64_t>((t.hi - t.lo) // t.seg.page_size))
    taken.clear()
    return 0


cdef void queue_emptied(CoreState* st, vector[Taken]* taken) noexcept:
    """Queue the segments that recycle_for_growth left with nothing mapped on
    st.emptied_segments (their address space is released later: see release_emptied_segments)."""
    cdef ExpandableSegment* seg
    cdef size_t i, j
    cdef bint seen
    for i in range(taken.size()):
        seg = taken[0][i].seg
        seen = False
        for j in range(st.emptied_segments.size()):
            seen = seen or st.emptied_segments[j] == seg
        if not seen and seg.mapped == 0:
            st.emptied_segments.push_back(seg)
    taken.clear()


cdef int release_emptied_segments(CoreState* st, Backend backend) except -1:
    """Give back the address space of the queued segments that still have nothing mapped (a
    growth during a capture may have mapped there since), one at a time: each is off the queue
    once released, whatever fails after it."""
    cdef Block key
    cdef UnmappedSet.iterator it
    cdef ExpandableSegment* seg
    cdef Block* b
    while not st.emptied_segments.empty():
        seg = st.emptied_segments.back()
        if seg.mapped == 0:
            key.stream = seg.stream
            key.ptr = seg.base
            it = seg.pool.unmapped.find(&key)
            if it != seg.pool.unmapped.end():
                b = deref(it)
                if b.prev == NULL and b.next == NULL:
                    release_reservation(st, backend, b)
        st.emptied_segments.pop_back()
    return 0


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
    cdef size_t page = page_of(st, pool)
    # The address space PyTorch reserves for the pool (a whole number of 2 MiB pages too).
    cdef size_t va_size = reservation_size(total_bytes, kSmallBuffer if pool.is_small else kLargeBuffer)
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
    commit_device_allocation(st, pool, 1)      # the reservation, until its release below
    candidate = new_block(st, stream, va_size, pool, base)
    candidate.mapped = False
    candidate.expandable = True
    candidate.segment = seg
    pool.unmapped.insert(candidate)
    out[0] = candidate
    return 0


cdef int map_block(CoreState* st, Backend backend, Block* to_map, size_t size) except -1:
    """Map the whole pages covering the first `size` bytes of unmapped block `to_map`, taking
    them from the page pool first under recycle_pages.

    Returns 1 on success (to_map becomes a free mapped block, merged with free neighbours and
    in the pool) or 0 when the device (or, under recycle_pages, the memory limit, which counts
    the device memory created) has not the memory; nothing is mapped then.
    """
    cdef ExpandableSegment* seg = to_map.segment
    cdef size_t page = seg.page_size
    cdef size_t mapped = min(pages_for(size, page), to_map.size)
    cdef size_t reuse = 0, k = 0 if to_map.pool.is_small else 1
    cdef vector[uintptr_t]* own = &st.free_pages[k]
    cdef vector[uintptr_t]* other = &st.free_pages[1 - k]
    if st.settings.recycle_pages and page == kSmallBuffer:
        reuse = min(mapped // page, own.size() + other.size())
    cdef size_t created = mapped - reuse * page
    cdef size_t limit = st.settings.allowed_memory_maximum
    if st.settings.recycle_pages and limit != <size_t>-1 and st.total_allocated_memory + created > limit:
        return 0
    # The pages to reuse: the last ones of its own class, then of the other, taken off the pool
    # once everything is mapped.
    cdef size_t from_own = min(reuse, own.size()), i
    cdef vector[uintptr_t] chosen
    for i in range(from_own):
        chosen.push_back(own[0][own.size() - from_own + i])
    for i in range(reuse - from_own):
        chosen.push_back(other[0][other.size() - (reuse - from_own) + i])
    cdef uintptr_t* handles = chosen.data()
    if reuse:
        backend.vm_map_handles(to_map.ptr, page, reuse, handles)
    cdef int rc = 0
    if created:
        try:
            rc = backend.vm_map(to_map.ptr + reuse * page, created, page)
        except BaseException:
            if reuse:
                backend.vm_unmap_keep(to_map.ptr, page, reuse, handles)
            raise
        if rc == BACKEND_OOM:
            if reuse:
                backend.vm_unmap_keep(to_map.ptr, page, reuse, handles)
            return 0
    cdef BlockPool* pool = to_map.pool
    own.resize(own.size() - from_own)
    other.resize(other.size() - (reuse - from_own))
    pool.unmapped.erase(to_map)
    if mapped < to_map.size:
        # The range past the mapped pages stays unmapped, a block of its own after to_map.
        pool.unmapped.insert(split_block(st, to_map, to_map.size - mapped, False))
    to_map.mapped = True
    cdef uintptr_t mapped_at = to_map.ptr
    merge_into(st, to_map, to_map.prev)
    merge_into(st, to_map, to_map.next)
    pool_insert(pool, to_map)
    seg.mapped += mapped
    if from_own:
        commit_page_pool(st, pool, pool.is_small, -<int64_t>(from_own * page))
    if reuse > from_own:
        commit_page_pool(st, pool, not pool.is_small, -<int64_t>((reuse - from_own) * page))
    commit_remaps(st, <int64_t>reuse)
    commit_map(st, pool, mapped_at, mapped, to_map.stream, created)
    return 1


cdef int try_allocate_expandable_block(CoreState* st, Backend backend, BlockPool* pool,
                                       uintptr_t stream, size_t size, bint may_unmap,
                                       Block** out) except -1:
    """Grow `stream`'s expandable segment until a free block of `size` bytes exists there:
    0 with *out that block (out of the pool), or BACKEND_OOM. `may_unmap`: no capture is under
    way, so that recycle_pages may unmap free pages for the growth."""
    if not (st.settings.recycle_pages and may_unmap):
        return grow(st, backend, pool, stream, size, out)
    cdef vector[Taken] taken
    cdef int rc
    # Before anything changes: a failure here leaves the allocator as it was.
    release_emptied_segments(st, backend)
    try:
        recycle_for_growth(st, backend, pool, stream, size, &taken)
        rc = grow(st, backend, pool, stream, size, out)
    except BaseException:
        put_back(st, backend, &taken)
        raise
    queue_emptied(st, &taken)
    return rc


cdef int grow(CoreState* st, Backend backend, BlockPool* pool, uintptr_t stream, size_t size,
              Block** out) except -1:
    """try_allocate_expandable_block's growth once the page pool holds what it takes."""
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


cdef void split_off_free(CoreState* st, Block* b, size_t size, bint front) noexcept:
    """Cut the first (`front`) or last `size` bytes of free mapped block `b` (out of its pool)
    into a free block of their own, in the pool. Its pages' uses ended with b's: it inherits b's
    free_epoch, so that recycle_pages may still unmap them without waiting."""
    cdef Block* piece = split_block(st, b, size, front)
    piece.free_epoch = b.free_epoch
    pool_insert(b.pool, piece)


cdef int unmap_block(CoreState* st, Backend backend, Block* b) except -1:
    """Unmap the whole pages inside free expandable block `b` and give their memory back to the
    device; partial pages stay mapped."""
    cdef uintptr_t first, last
    if whole_pages(b, &first, &last) == 0:
        return 0
    # Work queued before the free may still use these pages. PyTorch synchronizes only the
    # segment's stream; pyalloc waits for the device, because CuPy destroys a stream when its
    # object is collected, and synchronizing a destroyed stream handle is undefined.
    synchronize_for_unmap(st, backend)
    return unmap_range(st, backend, b, first, last, False)


cdef int unmap_range(CoreState* st, Backend backend, Block* b, uintptr_t first, uintptr_t last,
                     bint keep) except -1:
    """Unmap pages [first, last) inside free expandable block `b` (the caller synchronized):
    into the page pool when `keep`, else back to the device. What stays of b around the range
    stays mapped, as free blocks of its own."""
    cdef ExpandableSegment* seg = b.segment
    cdef size_t page = seg.page_size
    cdef size_t count = (last - first) // page
    cdef BlockPool* pool = b.pool
    cdef size_t k = 0 if pool.is_small else 1
    cdef size_t had = st.free_pages[k].size()
    if keep:
        st.free_pages[k].resize(had + count)
        try:
            backend.vm_unmap_keep(first, page, count, st.free_pages[k].data() + had)
        except BaseException:
            st.free_pages[k].resize(had)
            raise
    else:
        backend.vm_unmap(first, last - first, page)
    pool.blocks.erase(b)
    if first > b.ptr:
        split_off_free(st, b, first - b.ptr, True)
    if b.ptr + b.size > last:
        split_off_free(st, b, b.ptr + b.size - last, False)
    b.mapped = False                    # b is [first, last) now
    merge_into(st, b, b.prev)
    merge_into(st, b, b.next)
    pool.unmapped.insert(b)
    seg.mapped -= last - first
    if keep:
        commit_page_pool(st, pool, pool.is_small, <int64_t>(last - first))
    commit_unmap(st, pool, first, last - first, b.stream, keep)
    if b.prev == NULL and b.next == NULL and not keep:
        # Nothing of the segment is mapped any more: give the address space back.
        release_reservation(st, backend, b)
    return 0


cdef int release_page_pool(CoreState* st, Backend backend) except -1:
    """Give the page pool's physical pages back to the device, and the emptied segments' address
    space (recycle_pages; the first step of the full flush)."""
    cdef size_t k
    release_emptied_segments(st, backend)
    for k in range(2):
        # A page a call at a time: each page the device took back is off the pool, whatever
        # fails after it.
        while not st.free_pages[k].empty():
            backend.vm_free_handles(kSmallBuffer, 1, &st.free_pages[k].back())
            st.free_pages[k].pop_back()
            commit_page_pool_release(st, k == 0, kSmallBuffer)
    return 0


cdef void page_pool_counts(CoreState* st, int64_t* pool_bytes, int64_t* remaps) noexcept:
    """recycle_pages' statistics: bytes in the page pool and pages mapped again from it."""
    pool_bytes[0] = <int64_t>page_pool_bytes(st)
    remaps[0] = st.page_remaps


cdef int release_reservation(CoreState* st, Backend backend, Block* b) except -1:
    """Release the address space of an expandable segment that is one unmapped block `b`."""
    cdef ExpandableSegment* seg = b.segment
    cdef BlockPool* pool = b.pool
    backend.vm_release(seg.base, seg.size)     # first: if it fails, nothing has changed
    pool.unmapped.erase(b)
    for i in range(st.expandable_segments.size()):
        if st.expandable_segments[i] == seg:
            st.expandable_segments[i] = st.expandable_segments.back()
            st.expandable_segments.pop_back()
            break
    free_segment_struct(seg)
    retire_block(st, b)
    commit_device_allocation(st, pool, -1)
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
    st.emptied_segments.clear()
