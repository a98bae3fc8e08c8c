# cython: language_level=3
"""What the allocator reports about itself: every block it owns, the error for a pointer that is not
a live allocation, statistics, segment copies for snapshots, the history ring, and the recount
behind _check_invariants.

Readers copy what they report into C structs under the lock and build their Python objects
after it. Building them under the lock let a collection run there, and a Buffer it freed
re-entered free() on the same thread (the lock is recursive) and merged blocks mid-read: the
snapshot's segments then did not tile.
"""
from libc.stdint cimport uintptr_t, int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from libcpp.pair cimport pair
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport (Block, BlockPool, BlockSet, MempoolId, PrivatePool, UnmappedSet, Stat,
                             StatRow, TraceEntry, stat_current, stat_peak, stat_allocated,
                             single_freed, stat_freed, NUM_STATS, ST_ALLOCATED_BYTES, ST_ACTIVE,
                             ST_ACTIVE_BYTES, ST_ALLOCATION, ST_REQUESTED_BYTES, ST_INACTIVE_SPLIT,
                             ST_INACTIVE_SPLIT_BYTES, ST_SEGMENT, ST_RESERVED_BYTES)
from pyalloc._policy cimport kMinBlockSize, kSizeMax, kSmallBuffer, is_free
from pyalloc._state cimport commit_reset_peaks, commit_reset_accumulated
from pyalloc._device cimport DeviceState, lock_device, find_route
from pyalloc._expandable cimport free_segment_structs, page_pool_counts
from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF
from pyalloc.errors import AlreadyFreedError, NotAllocatedError

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_NAMES = ("all", "small_pool", "large_pool")
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                 "segment_map", "segment_unmap", "snapshot", "oom")


cdef inline tuple pool_id_tuple(BlockPool* pool):
    if pool.owner == NULL:
        return (0, 0)
    return (pool.owner.id.first, pool.owner.id.second)


cdef Block* raise_not_allocated(DeviceState* a, uintptr_t ptr, bint known) except NULL:
    """The error for a pointer that is not a live allocation (lock held; an error path, so it may
    look at every block): a double free when the address lies in this allocator's free memory
    (the freed block may have merged with its neighbours since), else a foreign pointer."""
    cdef vector[Block*] blocks
    cdef Block* b
    if not known:
        collect_blocks(a, &blocks)
        for b in blocks:
            if b.mapped and b.ptr <= ptr < b.ptr + b.size:
                if b.allocated:
                    raise NotAllocatedError(f"pointer {ptr:#x} is inside the allocation at {b.ptr:#x} "
                                            f"({b.size} bytes), not its start", ptr, b.ptr)
                known = True
                break
    if known:
        raise AlreadyFreedError(f"pointer {ptr:#x} was already freed (double free)", ptr)
    raise NotAllocatedError(f"pointer {ptr:#x} was not allocated by this allocator", ptr)


cdef void copy_segments(DeviceState* a, vector[BlockCopy]* out) noexcept:
    """Every mapped block, segment by segment (lock held). A cudaMalloc segment is one snapshot
    segment; an expandable segment is one per contiguous mapped range (PyTorch's convention)."""
    cdef vector[Block*] blocks
    cdef Block* head
    cdef Block* b
    cdef BlockCopy c
    cdef bint starts
    collect_blocks(a, &blocks)
    for head in blocks:
        if head.prev != NULL:
            continue
        starts = True
        b = head
        while b != NULL:
            if not b.mapped:
                starts = True
                b = b.next
                continue
            c.ptr = b.ptr
            c.size = b.size
            c.requested_size = b.requested_size
            c.stream = b.stream
            if b.pool.owner == NULL:
                c.pool_id.first = 0
                c.pool_id.second = 0
            else:
                c.pool_id = b.pool.owner.id
            c.metadata_id = b.metadata_id
            c.context_id = b.context_id
            c.segment_context_id = b.segment_context_id
            c.allocated = b.allocated
            c.pending_free = (not b.allocated) and (b.event_count > 0 or not b.stream_uses.empty())
            c.is_small = b.pool.is_small
            c.expandable = b.expandable
            c.starts_segment = starts
            starts = False
            out.push_back(c)
            b = b.next


cdef void collect_pool(BlockPool* pool, vector[Block*]* out) noexcept:
    cdef BlockSet.iterator it = pool.blocks.begin()
    while it != pool.blocks.end():
        out.push_back(deref(it))
        inc(it)
    cdef UnmappedSet.iterator uit = pool.unmapped.begin()
    while uit != pool.unmapped.end():
        out.push_back(deref(uit))
        inc(uit)


cdef void collect_blocks(DeviceState* a, vector[Block*]* out) noexcept:
    """Every block the allocator owns: free ones from the pools, the rest from active_blocks."""
    cdef pair[MempoolId, PrivatePool*] entry
    collect_pool(a.small_blocks, out)
    collect_pool(a.large_blocks, out)
    for entry in a.graph_pools:
        collect_pool(&entry.second.small_blocks, out)
        collect_pool(&entry.second.large_blocks, out)
    a.active_blocks.values(out)


cdef int check_pool_order(BlockPool* pool) except -1:
    cdef BlockSet.iterator it = pool.blocks.begin()
    cdef Block* last = NULL
    cdef Block* b
    while it != pool.blocks.end():
        b = deref(it)
        if last != NULL:
            assert (last.stream, last.size, last.ptr) < (b.stream, b.size, b.ptr), (
                f"pool out of best-fit order at block {b.ptr:#x}")
        last = b
        inc(it)
    return 0


cdef int check_gc_candidates(BlockPool* pool) except -1:
    """The pool's garbage-collection candidates are exactly its free whole segments (large pools
    only), listed by gc_count_base, with the right count and sum."""
    cdef BlockSet.iterator it = pool.blocks.begin()
    cdef Block* b
    cdef int64_t count = 0, base_sum = 0
    while it != pool.blocks.end():
        b = deref(it)
        inc(it)
        candidate = not pool.is_small and not b.expandable and not b.is_split()
        assert b.gc_listed == candidate, f"block {b.ptr:#x}: gc_listed={b.gc_listed}, a candidate: {candidate}"
        if candidate:
            count += 1
            base_sum += b.gc_count_base
    assert (count, base_sum) == (pool.gc_count, pool.gc_base_sum), (
        f"GC candidates: {count} blocks with base sum {base_sum}, the pool counts "
        f"{pool.gc_count} and {pool.gc_base_sum}")
    b = pool.gc_head
    listed = 0
    while b != NULL:
        assert b.gc_listed and b.pool == pool, f"block {b.ptr:#x} listed as a candidate of another pool"
        assert b.gc_next == NULL or b.gc_next.gc_count_base >= b.gc_count_base, (
            f"GC candidates out of age order at block {b.ptr:#x}")
        listed += 1
        b = b.gc_next
    assert listed == count, f"{listed} GC candidates linked, {count} counted"
    return 0


cdef int check_use_index(Block* b) except -1:
    """A block's use index, when it has one, holds exactly its stream uses."""
    if b.use_index == NULL:
        return 0
    uses = set(b.stream_uses)
    assert len(uses) == b.stream_uses.size(), f"block {b.ptr:#x} lists a stream use twice"
    assert set(deref(b.use_index)) == uses, f"block {b.ptr:#x}: use index differs from its stream uses"
    return 0


cdef int check_invariants(DeviceState* a) except -1:
    """The recount behind DeviceCachingAllocator._check_invariants (lock held)."""
    cdef vector[Block*] blocks
    cdef Block* b
    cdef Block* head
    cdef int64_t recount[9][3]
    cdef int p
    cdef pair[MempoolId, PrivatePool*] entry
    for k in range(NUM_STATS):
        for p in range(3):
            recount[k][p] = 0
    collect_blocks(a, &blocks)
    seen = set()
    reserved_by_pool = {}
    segments_by_stream = {}
    for head in blocks:
        if head.prev != NULL:
            continue
        p = 1 if head.pool.is_small else 2
        seg_size = 0
        b = head
        split = head.next != NULL
        while b != NULL:
            assert b.ptr not in seen, f"block {b.ptr:#x} reached twice"
            seen.add(b.ptr)
            assert b.pool == head.pool and b.stream == head.stream, f"block {b.ptr:#x} in a foreign segment"
            if b.next != NULL:
                assert b.next.prev == b, f"broken back link at {b.ptr:#x}"
                assert b.ptr + b.size == b.next.ptr, f"gap or overlap after {b.ptr:#x}"
            assert b.size % kMinBlockSize == 0, f"block {b.ptr:#x} size {b.size} not a multiple of 512"
            check_use_index(b)
            b_free = is_free(b)
            in_pool = b.pool.blocks.contains(b)
            in_unmapped = b.pool.unmapped.find(b) != b.pool.unmapped.end()
            in_active = a.active_blocks.get(b.ptr) != NULL
            assert b.expandable == head.expandable, f"block {b.ptr:#x}: expandable flag differs in its segment"
            if not b.mapped:
                assert b.expandable and b_free and in_unmapped and not in_pool and not in_active, (
                    f"unmapped block {b.ptr:#x} misfiled")
                assert (b.ptr - b.segment.base) % b.segment.page_size == 0 and b.size % b.segment.page_size == 0, (
                    f"unmapped block {b.ptr:#x} is not whole pages")
                b = b.next
                continue
            assert not in_unmapped, f"mapped block {b.ptr:#x} in the unmapped set"
            assert b_free == in_pool, f"block {b.ptr:#x}: free={b_free} but in_pool={in_pool}"
            assert (not b_free) == in_active, f"block {b.ptr:#x}: active map disagrees"
            if b_free and b.next != NULL and b.next.mapped:
                assert not is_free(b.next), f"free neighbours {b.ptr:#x} and {b.next.ptr:#x} not merged"
            if b.allocated:
                recount[ST_ALLOCATION][p] += 1
                recount[ST_ALLOCATED_BYTES][p] += b.size
            if not b_free:
                recount[ST_ACTIVE][p] += 1
                recount[ST_ACTIVE_BYTES][p] += b.size
                recount[ST_REQUESTED_BYTES][p] += b.requested_size
            elif split and not b.expandable:
                recount[ST_INACTIVE_SPLIT][p] += 1
                recount[ST_INACTIVE_SPLIT_BYTES][p] += b.size
            seg_size += b.size
            b = b.next
        if not head.expandable:
            recount[ST_SEGMENT][p] += 1     # expandable maps are not counted as segments
            segments_by_stream[head.stream] = segments_by_stream.get(head.stream, 0) + 1
        recount[ST_RESERVED_BYTES][p] += seg_size
        key = pool_id_tuple(head.pool)
        reserved_by_pool[key] = reserved_by_pool.get(key, 0) + seg_size
        if head.expandable:
            assert head.segment.mapped == seg_size, (
                f"expandable segment {head.segment.base:#x} counts {head.segment.mapped} mapped "
                f"bytes, its blocks {seg_size}")
    for k in range(NUM_STATS):
        if k == ST_RESERVED_BYTES:      # recycle_pages' page pool, by the class that counts it
            recount[k][1] += a.st.free_pages[0].size() * kSmallBuffer
            recount[k][2] += a.st.free_pages[1].size() * kSmallBuffer
        recount[k][0] = recount[k][1] + recount[k][2]
        for p in range(3):
            assert recount[k][p] == stat_current(&a.st.stats[k], p), (
                f"{STAT_NAMES[k]}.{POOL_NAMES[p]}.current is {stat_current(&a.st.stats[k], p)}, "
                f"recount gives {recount[k][p]}")
    assert a.st.total_allocated_memory == <size_t>recount[ST_RESERVED_BYTES][0]
    counted = dict(a.segments_by_stream)
    assert counted == segments_by_stream, (
        f"segments by stream: counted {counted}, recount gives {segments_by_stream}")
    live_segments = {<uintptr_t>seg for seg in a.st.expandable_segments}
    for seg in a.st.emptied_segments:
        assert <uintptr_t>seg in live_segments, f"emptied segment {seg.base:#x} is not a live segment"
    # Every pool's set must be in best-fit order with current keys (no stale entries), and every
    # private pool must know the bytes its segments hold.
    check_pool_order(a.small_blocks)
    check_pool_order(a.large_blocks)
    check_gc_candidates(a.small_blocks)
    check_gc_candidates(a.large_blocks)
    for entry in a.graph_pools:
        check_pool_order(&entry.second.small_blocks)
        check_pool_order(&entry.second.large_blocks)
        check_gc_candidates(&entry.second.small_blocks)
        check_gc_candidates(&entry.second.large_blocks)
        key = (entry.first.first, entry.first.second)
        assert entry.second.reserved_bytes == reserved_by_pool.get(key, 0), (
            f"private pool {key} counts {entry.second.reserved_bytes} reserved bytes, its "
            f"segments {reserved_by_pool.get(key, 0)}")
    return 0


# ------------------------------------------------------------------------------- readers

cdef dict memory_stats(DeviceState* a):
    """PyTorch's flat statistics dict: "{stat}.{all|small_pool|large_pool}.{current|peak|allocated|freed}"
    plus num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free,
    max_split_size and oversize_allocations/oversize_segments.{current|peak|allocated|freed}.
    Byte statistics are in bytes; private pools count in the same rows, by size class, as in
    PyTorch. Keys are sorted, as torch.cuda.memory_stats returns them.
    """
    # Copied under the lock, read into Python objects after it (see copy_segments).
    cdef StatRow stats[9]
    cdef Stat oversize[2]
    cdef int64_t counters[5]
    cdef size_t max_split
    cdef Stat s
    cdef int k, p
    lock_device(a)
    for k in range(NUM_STATS):
        stats[k] = a.st.stats[k]
    oversize[0] = a.st.oversize_allocations
    oversize[1] = a.st.oversize_segments
    counters[0] = a.st.num_alloc_retries
    counters[1] = a.st.num_ooms
    counters[2] = a.st.num_sync_all_streams
    counters[3] = a.st.num_device_alloc
    counters[4] = a.st.num_device_free
    max_split = a.st.stat_max_split_size
    cdef bint recycle = a.st.settings.recycle_pages
    cdef int64_t pool_bytes = 0, remaps = 0
    page_pool_counts(&a.st, &pool_bytes, &remaps)
    a.mutex.unlock()
    out = {}
    for k in range(NUM_STATS):
        for p in range(3):
            prefix = f"{STAT_NAMES[k]}.{POOL_NAMES[p]}."
            out[prefix + "current"] = stat_current(&stats[k], p)
            out[prefix + "peak"] = stat_peak(&stats[k], p)
            out[prefix + "allocated"] = stat_allocated(&stats[k], p)
            out[prefix + "freed"] = stat_freed(&stats[k], p)
    for k, name in enumerate(("oversize_allocations", "oversize_segments")):
        s = oversize[k]
        out[name + ".current"] = s.current
        out[name + ".peak"] = s.peak
        out[name + ".allocated"] = s.allocated
        out[name + ".freed"] = single_freed(&s)
    for k, name in enumerate(("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                              "num_device_alloc", "num_device_free")):
        out[name] = counters[k]
    out["max_split_size"] = -1 if max_split == kSizeMax else max_split
    if recycle:     # recycle_pages: reserved_bytes count these pool bytes too
        out["page_pool_bytes"] = pool_bytes
        out["num_page_remaps"] = remaps
    return dict(sorted(out.items()))


cdef void reset_peak_memory_stats(DeviceState* a) noexcept:
    """Set every statistic's peak to its current value."""
    lock_device(a)
    commit_reset_peaks(&a.st)
    a.mutex.unlock()


cdef void reset_accumulated_memory_stats(DeviceState* a) noexcept:
    """Zero the cumulative allocated/freed counts and the retry/OOM/sync/device counters."""
    lock_device(a)
    commit_reset_accumulated(&a.st)
    a.mutex.unlock()


cdef list segments(DeviceState* a):
    """The segments as lists of blocks, sorted by address, for snapshots and checks.

    Each segment is a dict: address, total_size, stream, is_small, is_expandable, pool_id
    (the owning pool's id, (0, 0) for the default pools), context_id and blocks; each block a
    dict: address, size, requested_size, allocated, pending_free (freed, waiting for events),
    metadata_id, context_id.
    """
    cdef vector[BlockCopy] copies
    cdef BlockCopy c
    segments = []
    lock_device(a)
    copy_segments(a, &copies)
    a.mutex.unlock()
    for c in copies:
        if c.starts_segment:
            seg_blocks = []
            segment = {
                "address": c.ptr, "total_size": 0, "stream": c.stream,
                "is_small": c.is_small, "is_expandable": c.expandable,
                "pool_id": (c.pool_id.first, c.pool_id.second),
                "context_id": c.segment_context_id, "blocks": seg_blocks,
            }
            segments.append(segment)
        seg_blocks.append({
            "address": c.ptr, "size": c.size, "requested_size": c.requested_size,
            "allocated": c.allocated, "pending_free": c.pending_free,
            "metadata_id": c.metadata_id, "context_id": c.context_id,
        })
        segment["total_size"] += c.size
    segments.sort(key=lambda s: s["address"])
    return segments


cdef int set_history(DeviceState* a, bint enabled, size_t max_entries, uint32_t skip_mask,
                     bint clear) except -1:
    """Switch the trace ring buffer on/off; turning it off clears it (PyTorch's semantics).

    While on, `clear` empties it, and a new `max_entries` keeps the newest entries that fit
    (PyTorch leaves a resized buffer out of order; keeping the newest is what a user wants).
    The caller checked that max_entries >= 1 while enabled.
    """
    cdef vector[TraceEntry] kept
    cdef size_t n, start, i
    cdef uint64_t total
    lock_device(a)
    try:
        if not enabled:
            a.st.history.reset(0)
        elif clear or not a.st.history_on:
            a.st.history.reset(max_entries)
        elif a.st.history.capacity != max_entries:
            n = a.st.history.entries.size()
            start = n - max_entries if n > max_entries else 0
            for i in range(start, n):
                kept.push_back(a.st.history.at(i))
            total = a.st.history.total
            a.st.history.reset(max_entries)
            for i in range(kept.size()):
                a.st.history.push(kept[i])
            a.st.history.total = total
        a.st.history_on = enabled
        a.st.skip_actions_mask = skip_mask
    finally:
        a.mutex.unlock()


cdef tuple history_entries(DeviceState* a):
    """Trace entries oldest first as tuples
    (action, addr, size, stream, time_us, metadata_id, context_id), and the number dropped
    because the ring buffer wrapped."""
    cdef vector[TraceEntry] entries
    cdef TraceEntry e
    cdef size_t n, i
    cdef uint64_t dropped
    lock_device(a)        # copied under the lock, read after it (see copy_segments)
    n = a.st.history.entries.size()
    entries.reserve(n)
    for i in range(n):
        entries.push_back(a.st.history.at(i))
    dropped = a.st.history.total - n
    a.mutex.unlock()
    out = []
    for e in entries:
        out.append((TRACE_ACTIONS[e.action], e.addr, e.size, e.stream, e.time_us,
                    e.metadata_id, e.context_id))
    return out, dropped


cdef dict live_bytes_by_metadata(DeviceState* a, bint requested):
    """{metadata_id: bytes} over allocated blocks: block sizes, or requested sizes if `requested`.

    Blocks freed but waiting for stream events are not counted (the caller gave them up).
    """
    cdef vector[Block*] blocks
    cdef Block* b
    cdef unordered_map[uint32_t, size_t] sums
    lock_device(a)
    try:
        a.active_blocks.values(&blocks)
        for b in blocks:
            if b.allocated:
                sums[b.metadata_id] += b.requested_size if requested else b.size
    finally:
        a.mutex.unlock()
    return {p.first: p.second for p in sums}


cdef object pool_info(DeviceState* a, MempoolId pid):
    """Private pool `pid`'s state as a dict, or None (see DeviceCachingAllocator._pool_info)."""
    cdef PrivatePool* pool
    cdef bint found, routed = False
    cdef int use_count = 0
    cdef int64_t device_allocations = 0, reserved_bytes = 0
    cdef bint use_on_oom = False, no_split = False
    lock_device(a)        # copied under the lock, read after it (see copy_segments)
    it = a.graph_pools.find(pid)
    found = it != a.graph_pools.end()
    if found:
        pool = deref(it).second
        use_count = pool.use_count
        device_allocations = pool.device_allocations
        reserved_bytes = pool.reserved_bytes
        use_on_oom = pool.use_on_oom
        no_split = pool.no_split
        routed = find_route(a, pid) >= 0
    a.mutex.unlock()
    if not found:
        return None
    return {"use_count": use_count, "device_allocations": device_allocations,
            "reserved_bytes": reserved_bytes, "use_on_oom": use_on_oom,
            "no_split": no_split, "routed": routed}


cdef list private_pool_ids(DeviceState* a):
    """Ids of every private pool, freeable ones included."""
    cdef pair[MempoolId, PrivatePool*] entry
    cdef vector[MempoolId] ids
    cdef MempoolId pid
    lock_device(a)        # copied under the lock, read after it (see copy_segments)
    for entry in a.graph_pools:
        ids.push_back(entry.first)
    a.mutex.unlock()
    return [(pid.first, pid.second) for pid in ids]


cdef list expandable_segment_sizes(DeviceState* a):
    """One (stream, is_small_pool, mapped_bytes) per live expandable segment."""
    cdef vector[uintptr_t] streams
    cdef vector[size_t] mapped
    cdef vector[int] small
    cdef size_t i
    lock_device(a)        # copied under the lock, read after it (see copy_segments)
    for seg in a.st.expandable_segments:
        streams.push_back(seg.stream)
        small.push_back(seg.pool.is_small)
        mapped.push_back(seg.mapped)
    a.mutex.unlock()
    return [(streams[i], bool(small[i]), mapped[i]) for i in range(streams.size())]


cdef void free_host_memory(DeviceState* a) noexcept:
    """Delete every Block, pool and segment record of the allocator (its teardown). Device memory
    is not given back: the backend may be gone at interpreter exit, and a device context's
    teardown reclaims it."""
    cdef vector[Block*] blocks
    cdef Block* b
    cdef pair[MempoolId, PrivatePool*] entry
    collect_blocks(a, &blocks)
    for b in blocks:
        Py_XDECREF(<PyObject*>b.py_address)
        del b
    for b in a.st.spare_blocks:
        Py_XDECREF(<PyObject*>b.py_address)
        del b
    a.st.spare_blocks.clear()
    free_segment_structs(&a.st)
    for entry in a.graph_pools:
        del entry.second
    a.graph_pools.clear()
    del a.large_blocks
    del a.small_blocks
