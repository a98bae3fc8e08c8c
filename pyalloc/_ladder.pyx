# cython: language_level=3
"""The slow path: what malloc does when no cached block fits (PyTorch's order, from garbage
collection to out of memory), the release steps it takes, empty_cache's release, and the dry run
of the ladder that replay's release classification uses.

The ladder: garbage collection (if configured), a new segment or expandable pages, a use_on_oom
pool's cached blocks, releasing oversize cached blocks (max_split_size set) and retrying, releasing
every unsplit cached segment and retrying (no route active), then out of memory.

Each release step takes a ReleaseCount: NULL frees (the real ladder); a count only counts what it
would free and remembers those blocks as gone (the dry run, policy_release_bytes). So the dry run
is the ladder itself, and cannot drift from it (tests/test_ladder_dry_run.py compares them).
"""
from libc.stdint cimport uintptr_t, int64_t, uint32_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec

from pyalloc._backend cimport BACKEND_OOM
from pyalloc._types cimport (Block, BlockPool, BlockSet, MempoolId, PrivatePool, Settings, TR_OOM,
                             sort_best_fit,
                             ST_ALLOCATED_BYTES, ST_RESERVED_BYTES)
from pyalloc._policy cimport (kSizeMax, round_size, is_small_request, segment_size_for, gc_enabled,
                              get_free_block, is_oversize, oversize_release_target)
from pyalloc._blocks cimport take_block, new_block, retire_block
from pyalloc._state cimport commit_segment_alloc, commit_segment_free, commit_retry, commit_oom
from pyalloc._expandable cimport (try_allocate_expandable_block, unmap_block, expandable_growth_bytes,
                                  whole_pages, mapped_bytes, release_page_pool, page_pool_bytes)
from pyalloc._device cimport (DeviceState, ReleaseCount, backend_of, lock_device, hand_out, find_route,
                              forget_segment_stream)
from pyalloc._routing cimport private_cached
from pyalloc._events cimport synchronize_and_free_events, stream_is_alive
from pyalloc.errors import OutOfMemoryError, format_bytes


# ------------------------------------------------------------------------------- malloc's slow path

cdef int malloc_slow(DeviceState* a, BlockPool* pool, size_t orig_size, size_t size,
                     uintptr_t stream, uint32_t metadata_id, uint32_t context_id,
                     Block** out) except -1:
    """No cached block of `pool` fits `size` rounded bytes (orig_size requested) on `stream`: run
    the ladder. 0 with *out handed out, or BACKEND_OOM with the oom_* figures set. ValueError,
    nothing changed, for a stream the backend says is not alive (a cache hit never asks)."""
    cdef Block* b = NULL
    cdef bint cached = False
    if not stream_is_alive(a, stream):
        if gc_enabled(&a.st.settings):
            pool.get_free_blocks_call_count -= 1        # the failed search did not happen
        raise ValueError(f"stream {stream} was destroyed: malloc needs a live stream")
    if ladder(a, NULL, pool, stream, size, context_id, &b, &cached) == BACKEND_OOM:
        record_oom(a, segment_size_for(size), size, stream, context_id)
        return BACKEND_OOM
    if not cached and b.prev == NULL and not b.segment_context_id:
        b.segment_context_id = context_id
    out[0] = hand_out(a, take_block(&a.st, b, cached, size), orig_size, metadata_id, context_id)
    return 0


cdef int ladder(DeviceState* a, ReleaseCount* dry, BlockPool* pool, uintptr_t stream, size_t size,
                uint32_t context_id, Block** out, bint* cached) except -1:
    """PyTorch's ladder for `size` rounded bytes on `stream` from `pool`: 0 with *out a free block
    (a new one, or with *cached a use_on_oom pool's cached block, still in its pool), or
    BACKEND_OOM. With `dry`, nothing changes: releases are counted in it (see the module doc)."""
    cdef size_t alloc_size = segment_size_for(size)
    cached[0] = False
    if gc_enabled(&a.st.settings):
        garbage_collect(a, dry)
    if new_memory(a, dry, pool, stream, alloc_size, size, False, context_id, out) == 0:
        return 0
    if pool.owner == NULL:
        out[0] = mempool_fallback(a, stream, size)
        if out[0] != NULL:
            cached[0] = True
            return 0
    if (release_available_cached_blocks(a, dry, pool, stream, size)
            and new_memory(a, dry, pool, stream, alloc_size, size, False, context_id, out) == 0):
        return 0
    # The full flush waits for every stream's events and frees the default pools; with a route
    # active it is skipped (PyTorch: no flush inside use_mem_pool or a capture, #159674).
    if (a.captures_underway.empty() and release_cached_blocks(a, dry) == 0
            and new_memory(a, dry, pool, stream, alloc_size, size, True, context_id, out) == 0):
        return 0
    return BACKEND_OOM


cdef Block* mempool_fallback(DeviceState* a, uintptr_t stream, size_t size) noexcept:
    """A cached block of a use_on_oom pool that fits (PyTorch's try_mempool_fallback: cached
    blocks only, never a new segment in that pool)."""
    cdef Block* b
    cdef BlockPool* pool
    cdef pair[MempoolId, PrivatePool*] entry
    for entry in a.graph_pools:
        if not entry.second.use_on_oom:
            continue
        pool = &entry.second.small_blocks if is_small_request(size) else &entry.second.large_blocks
        b = get_free_block(&a.st.settings, pool, stream, size)
        if b != NULL:
            return b
    return NULL


cdef int new_memory(DeviceState* a, ReleaseCount* dry, BlockPool* pool, uintptr_t stream,
                    size_t alloc_size, size_t size, bint is_retry, uint32_t context_id,
                    Block** out) except -1:
    """One attempt of the ladder to get new device memory: alloc_block, or in a dry run whether
    it would succeed after the releases counted so far."""
    if dry == NULL:
        return alloc_block(a, pool, stream, alloc_size, size, is_retry, context_id, out)
    cdef size_t limit = a.st.settings.allowed_memory_maximum
    # (recycle_pages: the growth counts against the limit only the memory it creates)
    cdef size_t counted_size = dry.physical if a.st.settings.recycle_pages else alloc_size
    if limit != kSizeMax and dry.reserved - dry.released + counted_size > limit:
        return BACKEND_OOM
    return 0 if dry.physical <= dry.free_bytes + dry.released else BACKEND_OOM


cdef int alloc_block(DeviceState* a, BlockPool* pool, uintptr_t stream, size_t alloc_size,
                     size_t size, bint is_retry, uint32_t context_id, Block** out) except -1:
    """Get new device memory for a request of `size` rounded bytes: 0 and *out set (a free
    block out of any pool), or BACKEND_OOM.

    Ordinarily a new segment of `alloc_size` bytes; with expandable segments, pages mapped into
    the stream's expandable segment of `pool`.
    """
    if is_retry:
        commit_retry(&a.st)
    cdef size_t limit = a.st.settings.allowed_memory_maximum
    # (recycle_pages: the expandable growth checks the limit against the memory it creates)
    if (limit != kSizeMax and not a.st.settings.recycle_pages
            and a.st.total_allocated_memory + alloc_size > limit):
        return BACKEND_OOM
    if a.st.settings.expandable_segments:
        return try_allocate_expandable_block(&a.st, backend_of(a), pool, stream, size,
                                             a.capture_routes == 0, out)
    cdef uintptr_t ptr = 0
    cdef int rc
    if a.st.settings.release_lock_on_malloc:
        # PyTorch's release_lock_on_cudamalloc: other threads may use the cache while the
        # driver allocates (cuMemAlloc can take milliseconds). Nothing read before the call is
        # relied on after it but the memory-limit check above, which, as in PyTorch, another
        # thread's allocation in between can make stale by one segment.
        a.mutex.unlock()
        try:
            rc = backend_of(a).segment_alloc(alloc_size, &ptr)
        finally:
            lock_device(a)
    else:
        rc = backend_of(a).segment_alloc(alloc_size, &ptr)
    if rc == BACKEND_OOM:
        return BACKEND_OOM
    cdef Block* b = new_block(&a.st, stream, alloc_size, pool, ptr)
    commit_segment_alloc(&a.st, b, context_id)
    a.segments_by_stream[stream] += 1
    out[0] = b
    return 0


# ------------------------------------------------------------------------------- release steps

cdef inline bint counted(ReleaseCount* dry, Block* b) noexcept:
    """Whether a dry run has counted `b` as released already (the real ladder has no such block)."""
    return dry != NULL and dry.gone.count(b) != 0


cdef int release_block(DeviceState* a, Block* b) except -1:
    """Return the whole-segment free block `b` to the device."""
    backend_of(a).segment_free(b.ptr, b.size)
    commit_segment_free(&a.st, b)
    forget_segment_stream(a, b.stream)
    b.pool.gc_remove(b)
    b.pool.blocks.erase(b)
    retire_block(&a.st, b)
    return 0


cdef inline int release_segment(DeviceState* a, ReleaseCount* dry, Block* b) except -1:
    """The release step: free the whole-segment free block `b`, or count it."""
    if dry == NULL:
        return release_block(a, b)
    dry.released += b.size
    dry.gone.insert(b)
    return 0


cdef int release_blocks(DeviceState* a, ReleaseCount* dry, BlockPool* pool) except -1:
    """Release every cached block of `pool` that is a whole segment, and unmap the whole free
    pages of expandable segments."""
    cdef BlockSet.iterator it = pool.blocks.begin()
    cdef Block* b
    cdef vector[Block*] to_unmap
    cdef uintptr_t first, last
    while it != pool.blocks.end():
        b = deref(it)
        inc(it)
        if b.expandable:
            if dry != NULL:
                dry.released += whole_pages(b, &first, &last)
            else:
                to_unmap.push_back(b)    # unmapping changes the pool: after the iteration
        elif not b.is_split() and not counted(dry, b):
            release_segment(a, dry, b)
    for b in to_unmap:
        unmap_block(&a.st, backend_of(a), b)
    return 0


cdef int release_cached_blocks(DeviceState* a, ReleaseCount* dry) except -1:
    """PyTorch's release_cached_blocks({0, 0}): with no route active, wait for every event and
    release the default pools' unsplit cached segments; then release every freeable private pool.
    recycle_pages' page pool goes first (its pages are mapped nowhere: no capture uses them).
    (A dry run cannot wait: blocks still waiting for events are not counted.)"""
    if dry == NULL:
        release_page_pool(&a.st, backend_of(a))
    else:
        dry.released += page_pool_bytes(&a.st)
    if a.captures_underway.empty():
        if dry == NULL:
            synchronize_and_free_events(a)
        release_blocks(a, dry, a.large_blocks)
        release_blocks(a, dry, a.small_blocks)
    cdef MempoolId none
    none.first = 0
    none.second = 0
    return release_private_pools(a, dry, False, none)


cdef int release_private_pools(DeviceState* a, ReleaseCount* dry, bint only_one,
                               MempoolId pid) except -1:
    """Release the cached segments of freeable private pools (all, or only `pid`), and forget a
    pool once it holds no device memory."""
    cdef vector[MempoolId] freeable
    cdef PrivatePool* pool
    cdef pair[MempoolId, PrivatePool*] entry
    if a.capture_routes:
        return 0        # freeing device memory would invalidate the capture (see release_available...)
    for entry in a.graph_pools:
        # A pool a live route names stays, whatever its use count: the route points at it.
        if (entry.second.use_count <= 0 and (not only_one or entry.first == pid)
                and find_route(a, entry.first) < 0):
            freeable.push_back(entry.first)
    if only_one and not freeable.empty() and a.captures_underway.empty() and dry == NULL:
        # Blocks of the pool may still wait for events (PyTorch syncs that pool's events).
        synchronize_and_free_events(a)
    for pool_id in freeable:
        pool = a.graph_pools[pool_id]
        release_blocks(a, dry, &pool.large_blocks)
        release_blocks(a, dry, &pool.small_blocks)
        if pool.device_allocations == 0 and dry == NULL:
            a.graph_pools.erase(pool_id)
            del pool
    return 0


cdef int release_available_cached_blocks(DeviceState* a, ReleaseCount* dry, BlockPool* pool,
                                         uintptr_t stream, size_t size) except -1:
    """Free cached oversize segments of `stream` worth at least max(size, max_split_size).

    Returns 1 when something was freed. Only meaningful when max_split_size is set.
    """
    cdef size_t wanted = oversize_release_target(&a.st.settings, size)   # bytes to free at least
    if wanted == 0 or a.capture_routes:
        # During a capture, freeing a segment would invalidate it: PyTorch does it anyway (#159594,
        # open in late 2025); pyalloc fails over to the out-of-memory error instead.
        return 0
    cdef BlockSet.iterator it = pool.blocks.lower_bound(stream, wanted)
    cdef BlockSet.iterator cur
    cdef size_t released = 0
    cdef bint is_first
    cdef Block* b
    while it != pool.blocks.end() and counted(dry, deref(it)):
        inc(it)
    if it == pool.blocks.end() or deref(it).stream != stream or deref(it).expandable:
        # No single block is big enough: free oversize blocks from the largest down.
        if it == pool.blocks.begin():
            return 0
        dec(it)
        while (released < wanted and is_oversize(&a.st.settings, deref(it).size)
               and deref(it).stream == stream):
            cur = it
            is_first = cur == pool.blocks.begin()
            if not is_first:
                dec(it)
            b = deref(cur)
            if not b.expandable and not b.is_split() and not counted(dry, b):
                released += b.size
                release_segment(a, dry, b)
            if is_first:
                break
        return 1 if released >= wanted else 0
    b = deref(it)
    if b.is_split():
        return 0
    release_segment(a, dry, b)
    return 1


cdef int garbage_collect(DeviceState* a, ReleaseCount* dry) except -1:
    """Release aged unsplit cached segments of the default large pool beyond the GC threshold.

    PyTorch's choice, without its walks of the whole pool: each pass releases every candidate at
    least as old as the candidates' average age, in the pool's order. The candidates are listed
    oldest first (BlockPool.gc_add), so a pass's blocks are the list's next prefix and the average
    comes from the list's count and sum of gc_count_base: a pass costs O(k log k) for the k blocks
    it releases. A dry run releases nothing from the list and walks on past what it counted.
    """
    cdef size_t threshold_bytes = <size_t>(a.st.settings.gc_threshold
                                           * <double>a.st.settings.allowed_memory_maximum)
    if a.st.total_allocated_memory <= threshold_bytes or a.capture_routes:
        return 0
    cdef size_t target = a.st.total_allocated_memory - threshold_bytes
    cdef size_t reclaimed = 0
    cdef BlockPool* pool = a.large_blocks
    # The clock as the real malloc's search has left it (a dry run's search put it back).
    cdef int64_t clock = pool.get_free_blocks_call_count + (dry.clock_offset if dry != NULL else 0)
    cdef int64_t freeable = pool.gc_count
    # The sum of the ages, exact in int64 as PyTorch's double sum is below 2**53.
    cdef double total_age = <double>(freeable * clock - pool.gc_base_sum)
    cdef Block* first = pool.gc_head      # the oldest candidate not yet released in this call
    cdef vector[Block*] batch
    cdef double age_threshold, age
    cdef Block* b
    # Release blocks at least as old as the average, repeatedly; a pass does not stop at the
    # target, so that GC does not run again at the very next allocation.
    while reclaimed < target and freeable > 0:
        age_threshold = total_age / <double>freeable
        batch.clear()
        while first != NULL and <double>(clock - first.gc_count_base) >= age_threshold:
            batch.push_back(first)
            first = first.gc_next       # read before release_segment unlists the block
        if batch.empty():
            break
        sort_best_fit(batch)
        for b in batch:
            age = <double>(clock - b.gc_count_base)
            reclaimed += b.size
            total_age -= age
            freeable -= 1
            release_segment(a, dry, b)
    return 0


# ------------------------------------------------------------------------------- the dry run

cdef size_t policy_release_bytes(DeviceState* a, size_t orig_size, uintptr_t stream) except? 0:
    """Dry run of malloc's ladder for `orig_size` bytes on `stream`, in the present state and under
    the present limit: the bytes of device memory that its release steps would give back before
    the request is served or runs out of memory. 0 when a cached block serves it, or new device
    memory comes without any release. Nothing changes (the GC clock included).

    For the replay (pyalloc._replay), which must tell the segment frees the policy makes inside a
    malloc from those of an empty_cache call. Approximations, all on the rare side: with a route
    active it answers 0 (no flush then); blocks awaiting events are not counted.
    """
    if orig_size == 0 or not a.captures_underway.empty():
        return 0
    cdef Settings* s = &a.st.settings
    cdef size_t size = round_size(s, orig_size)
    cdef BlockPool* pool = a.small_blocks if is_small_request(size) else a.large_blocks
    cdef int64_t clock = pool.get_free_blocks_call_count
    cdef Block* hit = get_free_block(s, pool, stream, size)
    pool.get_free_blocks_call_count = clock             # a dry run: the GC clock stays
    if hit != NULL:
        return 0
    cdef ReleaseCount dry
    cdef size_t total_bytes = 0
    backend_of(a).memory_info(&dry.free_bytes, &total_bytes)
    dry.reserved = a.st.total_allocated_memory
    dry.clock_offset = 1 if pool == a.large_blocks and gc_enabled(s) else 0
    # The device memory the request needs: a segment, or the pages the expandable segment's
    # growth maps now (the same walk as the real allocation). The steps that test it change no
    # expandable segment (GC and the max_split_size release skip them), and the full flush,
    # which does, is the last step: what it releases is released whether the retry fits or not.
    dry.physical = (expandable_growth_bytes(&a.st, pool, stream, size) if s.expandable_segments
                    else segment_size_for(size))
    cdef Block* b = NULL
    cdef bint cached = False
    ladder(a, &dry, pool, stream, size, 0, &b, &cached)
    return dry.released


# ------------------------------------------------------------------------------- other releases

cdef int release_cached_segment(DeviceState* a, uintptr_t ptr, size_t size,
                                uintptr_t stream) except -1:
    """Release the cached segment at `ptr` of `size` bytes on `stream` when it is one free,
    unsplit block of a default pool: 1 when released, 0 when there is no such block. For the
    replay's measuring pass, which frees exactly the segments a trace freed."""
    cdef Block key
    key.stream = stream
    key.size = size
    key.ptr = ptr
    cdef BlockPool* pools[2]
    pools[0] = a.large_blocks
    pools[1] = a.small_blocks
    cdef BlockSet.iterator it
    cdef Block* b
    for k in range(2):
        it = pools[k].blocks.lower_bound(&key)
        if it != pools[k].blocks.end():
            b = deref(it)
            if b.ptr == ptr and b.size == size and not b.is_split() and not b.expandable:
                release_block(a, b)
                return 1
    return 0


cdef int release_cached(DeviceState* a) except -1:
    """empty_cache() without a pool id: release_cached_blocks, for real."""
    return release_cached_blocks(a, NULL)


cdef int release_pool(DeviceState* a, MempoolId pid) except -1:
    """empty_cache(mempool_id): release that private pool's cached segments if it is freeable."""
    return release_private_pools(a, NULL, True, pid)


cdef size_t grow_expandable(DeviceState* a, bint is_small, uintptr_t stream, size_t nbytes) except? 0:
    """warm_up's step: grow `stream`'s expandable segment of the small or large default pool until
    it has `nbytes` mapped. 0, or the bytes that could not be mapped (oom_* figures set)."""
    cdef BlockPool* pool = a.small_blocks if is_small else a.large_blocks
    cdef size_t have = mapped_bytes(&a.st, pool, stream)
    cdef Block* b
    if nbytes <= have:
        return 0
    if try_allocate_expandable_block(&a.st, backend_of(a), pool, stream, nbytes - have,
                                     a.capture_routes == 0, &b) == BACKEND_OOM:
        record_oom(a, nbytes - have, nbytes - have, stream, 0)
        return nbytes - have
    pool.blocks.insert(b)
    return 0


# ------------------------------------------------------------------------------- out of memory

cdef int record_oom(DeviceState* a, size_t alloc_size, size_t rounded, uintptr_t stream,
                    uint32_t context_id) except -1:
    """Keep the figures of a failed request for the error (built after the lock is dropped)."""
    cdef size_t free_bytes = 0, total_bytes = 0
    backend_of(a).memory_info(&free_bytes, &total_bytes)
    commit_oom(&a.st, free_bytes, rounded, stream, context_id)
    a.oom_alloc_size = alloc_size
    a.oom_free = free_bytes
    a.oom_total = total_bytes
    a.oom_private = private_cached(a)
    return 0


cdef raise_oom_error(DeviceState* a, list observers, int device, size_t requested):
    """Call `observers` (the allocator's OOM observers; None once the collector cleared them), then
    raise OutOfMemoryError with PyTorch's figures for the last failed request (lock not held)."""
    allocated = a.st.stats[ST_ALLOCATED_BYTES].all_current
    reserved = a.st.stats[ST_RESERVED_BYTES].all_current
    private = a.oom_private
    capped = a.st.settings.allowed_memory_maximum != kSizeMax
    allowed = a.st.settings.allowed_memory_maximum if capped else None
    for observer in list(observers or ()):
        observer(device, a.oom_alloc_size, allowed if capped else a.oom_total, a.oom_free)
    limit = f"{format_bytes(allowed)} allowed; " if capped else ""
    in_private = (f"with {format_bytes(private)} allocated in private pools (e.g., CUDA Graphs), "
                  if private else "")
    raise OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {format_bytes(a.oom_alloc_size)}. "
        f"GPU {device} has a total capacity of {format_bytes(a.oom_total)} of which "
        f"{format_bytes(a.oom_free)} is free. {limit}Of the allocated memory "
        f"{format_bytes(allocated + private)} is allocated by pyalloc, {in_private}and "
        f"{format_bytes(reserved - allocated - private)} is reserved by pyalloc but unallocated. "
        "If reserved but unallocated memory is large try setting "
        "PYALLOC_CONF=expandable_segments:True (or PYTORCH_CUDA_ALLOC_CONF) to avoid "
        "fragmentation; `pyalloc tune` on a memory snapshot ranks every setting.",
        requested=requested, segment_size=a.oom_alloc_size, device=device,
        total=a.oom_total, free=a.oom_free, allocated=allocated,
        reserved_unallocated=reserved - allocated - private, allowed=allowed)
