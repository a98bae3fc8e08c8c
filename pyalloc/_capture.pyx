# cython: language_level=3
"""Frees during a CUDA-graph capture: deferred frees, free markers and their reuse in the capture
(#162186), the marks of stream uses that only captured work stands behind.

While a capture route is active, a block freed with stream uses cannot wait for events (the work
was only captured). It is deferred; with graph_capture_record_stream_reuse it gets free markers
(the terminals of every stream that used it) and is reused in the capture once every marker
precedes the allocating stream's terminals (_graphs.pyx). Otherwise, and for blocks whose markers
are never covered, it waits until no route is active, when its captured-only stream uses are
dropped and events are recorded for the rest (_events.flush_deferred_blocks).
"""
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport (Block, BlockPool, CaptureReuse, CaptureUses, DeferredEntry, PrivatePool,
                             StreamReuse)
from pyalloc._policy cimport get_free_block, oversize_allowed
from pyalloc._device cimport (DeviceState, backend_of, routes_capture, forget_stream_use,
                              forget_block_uses, free_completed, forget_segment_stream)
from pyalloc._graphs cimport extend_ancestors, is_visited, all_visited, add_unique


cdef int defer_free(DeviceState* a, Block* b) except -1:
    """Queue b (freed with stream uses while a route is active) until it may be reused. All or
    nothing: the markers are worked out first, and a backend call that fails there leaves b
    allocated, as if the free had not been called."""
    cdef vector[uintptr_t] markers
    cdef unsigned long long capture_id = 0
    cdef bint has_markers = False
    if a.capture_routes and a.st.settings.graph_reuse:
        has_markers = free_markers(a, b, &markers, &capture_id)
    a.deferred_blocks.push_back(b)
    if has_markers:
        uses = &a.capture_uses[b]
        uses.markers.swap(markers)
        uses.has_markers = True
        uses.next_marker = 0
        a.last_defer_id += 1
        uses.defer_id = a.last_defer_id
        uses.deferred_index = a.deferred_blocks.size() - 1
        a.deferred_marked += 1
        context = &a.reuse_contexts[capture_id]
        index_deferred(context, &context.streams[b.stream], b, uses)
    return 0


cdef int index_deferred(CaptureReuse* graph, StreamReuse* reuse, Block* b,
                        CaptureUses* uses) except -1:
    """File b under its first marker not yet known to precede its stream's terminals (from
    uses.next_marker on), or as ready when there is none."""
    cdef DeferredEntry entry = DeferredEntry(b, uses.defer_id)
    cdef uintptr_t marker
    while uses.next_marker < uses.markers.size():
        marker = uses.markers[uses.next_marker]
        if not is_visited(graph, reuse, marker):
            graph.set_waited_on(graph.intern(marker))    # the walks report it when they reach it
            reuse.waiting[marker].push_back(entry)
            return 0
        uses.next_marker += 1
    reuse.ready.push_back(entry)
    return 0


cdef inline CaptureUses* still_deferred(DeviceState* a, DeferredEntry entry) noexcept:
    """The block's capture record when the entry is current (the block is still deferred from
    the same free), else NULL."""
    it = a.capture_uses.find(entry.first)
    if it == a.capture_uses.end() or deref(it).second.defer_id != entry.second:
        return NULL
    return &deref(it).second


cdef void release_deferred(DeviceState* a, Block* b, CaptureUses* uses) noexcept:
    """Deferred block b is safe to reuse in the capture: out of deferred_blocks (its slot left
    NULL, compacted once half are) and back to its pool."""
    a.deferred_blocks[uses.deferred_index] = NULL
    a.deferred_released += 1
    a.deferred_marked -= 1
    forget_block_uses(a, b)
    free_completed(a, b)              # erases b's capture record
    if a.deferred_released * 2 > a.deferred_blocks.size():
        compact_deferred(a)


cdef void compact_deferred(DeviceState* a) noexcept:
    """Drop the NULL slots of deferred_blocks, keeping the order, and renumber the slots."""
    cdef size_t i, kept = 0
    cdef Block* b
    for i in range(a.deferred_blocks.size()):
        b = a.deferred_blocks[i]
        if b == NULL:
            continue
        a.deferred_blocks[kept] = b
        it = a.capture_uses.find(b)
        if it != a.capture_uses.end():
            deref(it).second.deferred_index = kept
        kept += 1
    a.deferred_blocks.resize(kept)
    a.deferred_released = 0


cdef bint free_markers(DeviceState* a, Block* b, vector[uintptr_t]* markers,
                       unsigned long long* capture) except -1:
    """True with `markers` the free markers of b (and *capture its capture's id): the terminals of its allocation stream and every
    stream that used it (or, with graph_capture_last_use_marks, those at a stream's last-use
    mark). False when one of those streams is not in the same capture: b then waits for the end
    of the capture."""
    cdef vector[uintptr_t] streams
    streams.push_back(b.stream)
    for s in b.stream_uses:
        streams.push_back(s)
    cdef vector[uintptr_t] terminals
    cdef unsigned long long capture_id = 0, first_id = 0
    cdef size_t i, j
    cdef bint marked
    it = a.capture_uses.find(b)
    cdef CaptureUses* uses = NULL
    if it != a.capture_uses.end():
        uses = &deref(it).second
    for i in range(streams.size()):
        terminals.clear()
        if not backend_of(a).capture_info(streams[i], &capture_id, &terminals):
            return False
        if i == 0:
            first_id = capture_id
        elif capture_id != first_id:
            return False
        marked = False
        if a.st.settings.graph_last_use and uses != NULL:
            for j in range(uses.last_use.size()):
                if uses.last_use[j].first == streams[i]:
                    add_unique(markers, uses.last_use[j].second)
                    marked = True
                    break
        if not marked:
            add_unique(markers, terminals)
    capture[0] = first_id
    return True


cdef int mark_last_use(DeviceState* a, Block* b, uintptr_t stream) except -1:
    """record_stream(..., last_use=True) during a capture: remember the stream's terminals now."""
    cdef vector[uintptr_t] terminals
    cdef unsigned long long capture_id = 0
    if not backend_of(a).capture_info(stream, &capture_id, &terminals):
        return 0
    cdef CaptureUses* uses = &a.capture_uses[b]
    cdef size_t j
    for j in range(uses.last_use.size()):
        if uses.last_use[j].first == stream:
            uses.last_use[j].second = terminals
            return 0
    uses.last_use.push_back(pair[uintptr_t, vector[uintptr_t]](stream, terminals))
    return 0


cdef void forget_last_use(DeviceState* a, Block* b, uintptr_t stream) noexcept:
    """record_stream without last_use: the block is used on `stream` again, so a last-use mark
    made there before no longer holds (the free's marker for `stream` is its terminals then)."""
    it = a.capture_uses.find(b)
    if it == a.capture_uses.end():
        return
    cdef size_t j
    marks = &deref(it).second.last_use
    for j in range(marks.size()):
        if deref(marks)[j].first == stream:
            marks.erase(marks.begin() + j)
            return


cdef inline bint reusable_on(DeviceState* a, Block* b, uintptr_t stream,
                             PrivatePool* pool, bint other_streams) noexcept:
    """Whether deferred block b is a candidate for reuse by an allocation on `stream` routed to
    `pool`: a block of that pool with free markers, on `stream` itself (PyTorch's per-stream rule)
    or, with `other_streams`, a whole non-expandable segment of another stream (it can change
    streams: no other block shares its segment)."""
    if b.pool.owner != pool or pool == NULL:
        return False
    it = a.capture_uses.find(b)
    if it == a.capture_uses.end() or not deref(it).second.has_markers:
        return False
    if b.stream == stream:
        return True
    return other_streams and b.prev == NULL and b.next == NULL and not b.expandable


cdef int free_safe_blocks_in_capture(DeviceState* a, uintptr_t stream, BlockPool* pool,
                                     size_t size) except -1:
    """Before an allocation of `size` rounded bytes on `stream` from `pool` during a capture:
    free the deferred blocks of `stream` whose markers all precede its terminals (#162186); with
    graph_capture_cross_stream_reuse, when `pool` still has no block that fits, also move the
    smallest fitting whole segment of another stream whose markers precede them to `stream`.

    The walk adds only the nodes new since the last one, and only the blocks waiting on those
    nodes are looked at: the cost follows what changed in the graph, not how many blocks wait."""
    if a.deferred_marked == 0:
        return 0
    cdef vector[uintptr_t] terminals
    cdef unsigned long long capture_id = 0
    if not backend_of(a).capture_info(stream, &capture_id, &terminals) or terminals.empty():
        return 0
    cdef bint cross = a.st.settings.graph_cross_stream_reuse
    context = &a.reuse_contexts[capture_id]
    found = context.streams.find(stream)
    if found == context.streams.end() and not cross:
        return 0                      # no block of this stream waits in this capture
    cdef StreamReuse* reuse = &context.streams[stream]
    cdef vector[uintptr_t] added
    extend_ancestors(backend_of(a), context, reuse, terminals, &a.nodes_expanded, &added)
    cdef uintptr_t node
    cdef vector[DeferredEntry] woken
    cdef DeferredEntry entry
    cdef CaptureUses* uses
    for node in added:
        waiting = reuse.waiting.find(node)
        if waiting == reuse.waiting.end():
            continue
        woken.swap(deref(waiting).second)
        reuse.waiting.erase(waiting)
        for entry in woken:
            uses = still_deferred(a, entry)
            if uses != NULL:
                uses.next_marker += 1
                index_deferred(context, reuse, entry.first, uses)
        woken.clear()
    # The graph orders every later use on `stream` after these blocks' last uses: no event.
    cdef PrivatePool* private = pool.owner
    cdef size_t i, kept = 0
    for i in range(reuse.ready.size()):
        entry = reuse.ready[i]
        uses = still_deferred(a, entry)
        if uses == NULL:
            continue
        if entry.first.pool.owner == private and private != NULL:
            release_deferred(a, entry.first, uses)
        else:
            reuse.ready[kept] = entry             # another pool's: its own malloc frees it
            kept += 1

    reuse.ready.resize(kept)
    if not cross or get_free_block(&a.st.settings, pool, stream, size) != NULL:
        return 0
    # Nothing of `stream`'s own fits: one whole segment of another stream, the smallest that the
    # best-fit rules would give this request, moves here. (A scan of the deferred blocks: it runs
    # only when the pool has no block that fits.)
    cdef Block* b
    cdef Block* best = NULL
    for i in range(a.deferred_blocks.size()):
        b = a.deferred_blocks[i]
        if (b != NULL and b.stream != stream and b.pool == pool and b.size >= size
                and oversize_allowed(&a.st.settings, b.size, size)
                and (best == NULL or b.size < best.size)
                and reusable_on(a, b, stream, private, True)
                and all_visited(context, reuse, a.capture_uses[b].markers)):
            best = b
    if best != NULL:
        forget_segment_stream(a, best.stream)
        a.segments_by_stream[stream] += 1
        best.stream = stream            # a whole segment moves to the stream that may use it
        release_deferred(a, best, &a.capture_uses[best])
    return 0


cdef int mark_captured_use(DeviceState* a, Block* b, uintptr_t stream) except -1:
    """A new use of b on `stream` (record_stream, a capture route active): when the stream is
    capturing in a capture that a route sends to a private pool, only that captured work stands
    behind the use, so it is marked with the capture. A stream that is not capturing is doing
    real work, whose use must wait for an event like any other (PyTorch marks every use recorded
    while a capture is underway, on any stream: a difference)."""
    cdef unsigned long long capture_id = 0
    cdef vector[uintptr_t] terminals
    if not backend_of(a).capture_info(stream, &capture_id, &terminals) or not routes_capture(a, capture_id):
        return 0
    a.capture_uses[b].captured_uses.push_back(pair[uintptr_t, uint64_t](stream, capture_id))
    return 0


cdef int unmark_real_use(DeviceState* a, Block* b, uintptr_t stream) except -1:
    """record_stream names a stream b already uses: while the stream is not capturing, that use is
    real now, whatever a capture marked before."""
    it = a.capture_uses.find(b)
    if it == a.capture_uses.end() or deref(it).second.captured_uses.empty():
        return 0
    cdef unsigned long long capture_id = 0
    cdef vector[uintptr_t] terminals
    if backend_of(a).capture_info(stream, &capture_id, &terminals):
        return 0
    drop_marks(&deref(it).second.captured_uses, stream, 0)
    return 0


cdef void drop_marks(vector[pair[uintptr_t, uint64_t]]* marks, uintptr_t stream,
                     uint64_t capture_id) noexcept:
    """Remove the marks naming `stream` (capture_id 0) or capture `capture_id` (stream 0)."""
    cdef size_t i = 0
    while i < marks.size():
        if (stream != 0 and deref(marks)[i].first == stream) or (
                capture_id != 0 and deref(marks)[i].second == capture_id):
            deref(marks)[i] = marks.back()
            marks.pop_back()
        else:
            i += 1


cdef void end_capture_marks(DeviceState* a, uint64_t capture_id) noexcept:
    """Capture `capture_id` is over (its flush, if any, has run): its marks end with it, so that a
    use the program makes of the block afterwards is never taken for captured work."""
    it = a.capture_uses.begin()
    while it != a.capture_uses.end():
        drop_marks(&deref(it).second.captured_uses, 0, capture_id)
        inc(it)


cdef void forget_capture_uses(DeviceState* a, Block* b) noexcept:
    """At the flush after the captures: drop b's stream uses that only captured work stands
    behind (still marked), and its capture record."""
    it = a.capture_uses.find(b)
    if it == a.capture_uses.end():
        return
    cdef vector[uintptr_t] kept
    cdef uintptr_t s
    cdef pair[uintptr_t, uint64_t] mark
    cdef bint captured
    for s in b.stream_uses:
        captured = False
        for mark in deref(it).second.captured_uses:
            if mark.first == s:
                captured = True
                break
        if not captured:
            kept.push_back(s)
        else:
            forget_stream_use(a, s)
    b.stream_uses.swap(kept)
    b.drop_use_index()                # (a later new use rebuilds it from what is kept)
    a.capture_uses.erase(it)
