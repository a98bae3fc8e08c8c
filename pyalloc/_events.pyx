# cython: language_level=3
"""Cross-stream events and stream lifetime.

A block freed with stream uses (record_stream) waits for an event recorded on each of those
streams at the free, polled in order per stream (process_events) or waited for (the OOM flush,
empty_cache). Events are pooled per device. Stream objects the allocator keeps alive (the
record_stream pins and the allocation streams of keep_allocation_stream) are let go here once no
block use names them, or once the program dropped them and their queued work is done.
"""
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from cython.operator cimport dereference as deref, preincrement as inc
from cpython.object cimport PyObject
from cpython.dict cimport PyDict_Next, PyDict_GetItem

from pyalloc._types cimport Block, ExpandableSegment
from pyalloc._state cimport commit_sync_all
from pyalloc._expandable cimport destroy_mark_events
from pyalloc._device cimport (DeviceState, EventEntry, EventQueues, backend_of, lock_device,
                              forget_stream_uses, free_completed, stream_use_state, add_stream_use,
                              make_room_for_use, USE_KNOWN, USE_NEEDS_MEMORY)
from pyalloc._capture cimport (forget_capture_uses, mark_captured_use, unmark_real_use, mark_last_use,
                               forget_last_use)
from pyalloc.errors import CudaError


cdef inline uintptr_t take_recorded_event(DeviceState* a, uintptr_t stream) except? 0:
    """An idle event (made when none is pooled) recorded on `stream` now. As PyTorch, it is an
    event of the stream's own device: an event and a stream of different contexts cannot be
    recorded together. A failed record puts the event back and raises."""
    cdef uintptr_t event
    cdef int device = backend_of(a).stream_device(stream)
    if device != backend_of(a).device:
        event = take_foreign_event(a, device)
    elif a.event_pool.empty():
        backend_of(a).event_create(&event)
    else:
        event = a.event_pool.back()
        a.event_pool.pop_back()
    try:
        backend_of(a).event_record(event, stream)
    except BaseException:
        return_event(a, event)
        raise
    return event


cdef int insert_events(DeviceState* a, Block* b) except -1:
    """Record an event on every stream that used `b`; b returns to its pool when all complete."""
    cdef vector[uintptr_t] streams
    streams.swap(b.stream_uses)
    cdef uintptr_t event
    cdef uintptr_t stream
    cdef size_t done = 0
    try:
        for stream in streams:
            event = take_recorded_event(a, stream)
            b.event_count += 1
            a.stream_events[stream].push_back(EventEntry(event, b))
            a.outstanding_events += 1
            done += 1
    except BaseException:
        # Undo: the events recorded so far are the newest of their streams' queues.
        for i in range(done):
            stream = streams[i]
            return_event(a, a.stream_events[stream].back().first)
            a.stream_events[stream].pop_back()
            if a.stream_events[stream].empty():
                a.stream_events.erase(stream)
            b.event_count -= 1
            a.outstanding_events -= 1
        b.stream_uses.swap(streams)
        raise
    # The events hold what is needed of these streams from now on: their uses are over.
    forget_stream_uses(a, &streams)
    b.drop_use_index()
    return 0


cdef int destroy_events(DeviceState* a, bint outstanding) except -1:
    """Destroy the idle events of the event pool and, with `outstanding`, the events blocks still
    wait on (teardown only: those blocks are never freed then). An event whose destroy fails is
    not used again."""
    cdef uintptr_t event
    cdef EventQueues.iterator it
    if outstanding:
        for entry in a.retiring_streams:
            if entry.second != 0:
                a.foreign_event_devices.erase(entry.second)
                backend_of(a).event_destroy(entry.second)
        a.retiring_streams.clear()
        it = a.stream_events.begin()
        while it != a.stream_events.end():
            while not deref(it).second.empty():
                event = deref(it).second.front().first
                deref(it).second.pop_front()
                a.outstanding_events -= 1
                a.foreign_event_devices.erase(event)
                backend_of(a).event_destroy(event)
            it = a.stream_events.erase(it)
    while not a.event_pool.empty():
        event = a.event_pool.back()
        a.event_pool.pop_back()
        backend_of(a).event_destroy(event)
    cdef unordered_map[int, vector[uintptr_t]].iterator pool = a.foreign_event_pools.begin()
    while pool != a.foreign_event_pools.end():
        while not deref(pool).second.empty():
            event = deref(pool).second.back()
            deref(pool).second.pop_back()
            a.foreign_event_devices.erase(event)
            backend_of(a).event_destroy(event)
        pool = a.foreign_event_pools.erase(pool)
    destroy_mark_events(&a.st, backend_of(a), outstanding)
    return 0


cdef int drop_stream_objects(DeviceState* a, object pins_lock, dict objects,
                             mark_unused_fn mark) except -1:
    """Drop the stream objects of `objects` (handle -> object: the allocation streams) that
    `mark` marks unused.

    The handles are read into C before the allocator's lock, `mark` runs under it, and the
    objects are dropped after it: no Python object is made or freed under the lock (dropping a
    CuPy stream destroys it, and a collection run there could re-enter the allocator)."""
    cdef vector[uintptr_t] c_handles
    cdef vector[char] unused
    cdef size_t i
    dropped = []
    with pins_lock:
        handles = list(objects)
        for h in handles:
            c_handles.push_back(<uintptr_t>h)
        unused.resize(c_handles.size(), 0)
        lock_device(a)
        try:
            mark(a, &c_handles, &unused)
        finally:
            a.mutex.unlock()
        for i in range(c_handles.size()):
            if unused[i]:
                dropped.append(objects.pop(handles[i], None))
    del dropped              # outside pins_lock: a stream's destructor may call back into pyalloc
    return 0


cdef int mark_streams_without_blocks(DeviceState* a, vector[uintptr_t]* handles,
                                     vector[char]* unused) except -1:
    """(Lock held.) The allocation streams of which no block is left; they are no longer kept.

    Every block is in a segment of its own stream: the segments are counted by stream
    (segments_by_stream), and the expandable ones are few (one a stream and pool kind), so the
    cost follows the streams and segments, not the blocks."""
    cdef unordered_set[uintptr_t] in_use
    cdef ExpandableSegment* seg
    cdef size_t i
    for seg in a.st.expandable_segments:
        in_use.insert(seg.stream)
    for i in range(handles.size()):
        if not in_use.count(deref(handles)[i]) and not a.segments_by_stream.count(deref(handles)[i]):
            deref(unused)[i] = 1
            a.allocation_streams_kept.erase(deref(handles)[i])
            forget_retiring_stream(a, deref(handles)[i])
    return 0


cdef int release_allocation_streams(DeviceState* a, object pins_lock, dict objects) except -1:
    """Drop the allocation stream objects (`objects`, handle -> object: see
    DeviceCachingAllocator.keep_allocation_stream) of which no block is left."""
    return drop_stream_objects(a, pins_lock, objects, mark_streams_without_blocks)


cdef extern from *:
    """
    static inline Py_ssize_t pyalloc_refcount(PyObject* o) { return Py_REFCNT(o); }
    """
    Py_ssize_t pyalloc_refcount(PyObject* o) noexcept


cdef inline void forget_retiring_stream(DeviceState* a, uintptr_t h) noexcept:
    """Its object is let go another way (lock held): the event goes back to the pool."""
    cdef unordered_map[uintptr_t, uintptr_t].iterator it = a.retiring_streams.find(h)
    if it != a.retiring_streams.end():
        if deref(it).second != 0:
            return_event(a, deref(it).second)
        a.retiring_streams.erase(it)


cdef int reap_dropped_streams(DeviceState* a, object pins_lock, dict objects, dict pins) except -1:
    """Let go of the allocation stream objects the program has dropped, once their work is done.

    keep_allocation_stream holds each stream object while blocks of its stream may be cached, so
    that the driver cannot hand its handle to a new stream while its queued work may still use
    them. Held until empty_cache, every stream a program makes and drops would stay alive, and
    each keeps driver resources on the device (a soak on the H200 that replaced streams ~23
    times a second showed 1.6 GB in use outside pyalloc after 150 s: about half a MiB a stream,
    if that was all streams). So a stream whose object only the allocator holds (its dict, and
    the record_stream pins) gets an event recorded on it; once that event has completed, nothing
    queued on the stream is left, and its object is dropped, which destroys the stream. Its
    cached blocks stay keyed by the handle: the next stream to get that handle may reuse them,
    which is safe now. Called when a new allocation stream appears and from process_events();
    nothing while a capture is underway
    (no event may be recorded then)."""
    cdef vector[uintptr_t] dropped_handles, still_held, finished
    cdef PyObject* key
    cdef PyObject* value
    cdef PyObject* pinned
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t holders
    cdef uintptr_t h
    cdef unordered_map[uintptr_t, uintptr_t].iterator it
    if a.capture_routes or not a.captures_underway.empty():
        return 0
    dropped = []
    with pins_lock:
        # Borrowed references only: each count is what holds the object outside this loop.
        while PyDict_Next(objects, &pos, &key, &value):
            holders = 1
            pinned = PyDict_GetItem(pins, <object>key)
            if pinned == value:
                holders += 1
            h = <object>key
            if pyalloc_refcount(value) <= holders:
                dropped_handles.push_back(h)
            else:
                still_held.push_back(h)
        lock_device(a)
        try:
            for h in still_held:       # dropped once, then taken up again (gc.get_referrers...)
                forget_retiring_stream(a, h)
            for h in dropped_handles:
                it = a.retiring_streams.find(h)
                if it == a.retiring_streams.end():
                    try:
                        a.retiring_streams[h] = take_recorded_event(a, h)
                    except BaseException:
                        # Not tried again (event 0): the object stays until empty_cache finds
                        # no block of its stream, so one bad stream cannot fail every malloc.
                        a.retiring_streams[h] = 0
                        raise
                elif deref(it).second != 0 and backend_of(a).event_query(deref(it).second):
                    return_event(a, deref(it).second)
                    a.retiring_streams.erase(it)
                    a.allocation_streams_kept.erase(h)
                    # recycle_pages: the stream's blocks' work is over, and the stream goes.
                    a.st.free_epoch += 1
                    a.st.completed_epoch[h] = a.st.free_epoch
                    a.st.destroyed_streams.insert(h)
                    finished.push_back(h)
        finally:
            a.mutex.unlock()
        for h in finished:
            dropped.append(objects.pop(h, None))
    del dropped              # outside pins_lock: a stream's destructor may call back into pyalloc
    return 0


cdef int prune_stream_pins(DeviceState* a, object pins_lock, dict pins) except -1:
    """Drop the record_stream pins (`pins`, handle -> stream object) that no block stream use
    names any more.

    Only the handles of pins_to_check can have become unused since the last prune (a use count
    reached zero, or a pin was set), so only they are checked: a free or record_stream costs the
    same however many pins are alive. (The unlocked read of the list's size is a hint: a stale
    one leaves the check to the next prune, or takes the locks for nothing.)"""
    if a.pins_to_check.empty():
        return 0
    cdef vector[uintptr_t] handles, unused
    cdef uintptr_t h
    with pins_lock:
        lock_device(a)
        handles.swap(a.pins_to_check)
        for h in handles:
            if a.stream_use_counts.count(h) == 0:
                unused.push_back(h)
        a.mutex.unlock()
        dropped = [pins.pop(h, None) for h in unused]
        lock_device(a)
        a.has_pins = len(pins) != 0
        a.mutex.unlock()
    del dropped              # outside pins_lock: a stream's destructor may call back into pyalloc
    return 0


cdef int pin_stream(DeviceState* a, object pins_lock, dict pins, uintptr_t s, object stream) except -1:
    """Keep stream object `stream` (handle `s`) while a block stream use names it (record_stream)."""
    with pins_lock:
        pins[s] = stream
        # Its use may be over already (another thread freed the block meanwhile, before the
        # pin existed): the next prune checks it.
        lock_device(a)
        a.has_pins = True
        a.pins_to_check.push_back(s)
        a.mutex.unlock()
    return 0


cdef int flush_deferred_blocks(DeviceState* a) except -1:
    """Blocks freed with stream uses while a route was active: now that none is, record their
    events (or free them when they wait for nothing)."""
    cdef vector[Block*] blocks
    blocks.swap(a.deferred_blocks)
    a.deferred_released = 0
    a.deferred_marked = 0             # the routes are over: no block is a reuse candidate now
    cdef size_t i
    try:
        for i in range(blocks.size()):
            if blocks[i] == NULL:
                continue              # released during its capture
            if not a.capture_uses.empty():
                forget_capture_uses(a, blocks[i])
            if blocks[i].stream_uses.empty():
                free_completed(a, blocks[i])
            else:
                insert_events(a, blocks[i])
    except BaseException:
        for j in range(i, blocks.size()):
            if blocks[j] != NULL:
                a.deferred_blocks.push_back(blocks[j])
        raise
    return 0


cdef inline bint poll_stream(DeviceState* a, EventQueues.iterator it) except -1:
    """Free the blocks of the stream at `it` whose events have completed, oldest first; True
    when none of its events is left."""
    cdef EventEntry front
    while not deref(it).second.empty():
        front = deref(it).second.front()
        if not backend_of(a).event_query(front.first):
            return False    # later events of this stream cannot be complete either
        deref(it).second.pop_front()
        event_done(a, front.first, front.second)
    return True


cdef int process_events(DeviceState* a) except -1:
    """Free blocks whose events have all completed; polls each stream's events in order. Blocks
    deferred while a route is active stay deferred until no route is."""
    if not a.deferred_blocks.empty() and a.captures_underway.empty():
        flush_deferred_blocks(a)
    cdef EventQueues.iterator it = a.stream_events.begin()
    while it != a.stream_events.end():
        if poll_stream(a, it):
            it = a.stream_events.erase(it)
        else:
            inc(it)
    return 0


cdef int process_some_events(DeviceState* a, size_t streams) except -1:
    """process_events for at most `streams` streams, in turn from where the last call stopped
    (event_poll_streams): a malloc's cost then does not grow with the streams that have pending
    events. Every stream is reached within ceil(S / streams) calls while no stream gets its first
    event (a new stream's queue can reorder the turn: each cache miss polls them all anyway)."""
    if not a.deferred_blocks.empty() and a.captures_underway.empty():
        flush_deferred_blocks(a)
    cdef size_t n = a.stream_events.size()
    if n == 0:
        return 0
    if streams > n:
        streams = n
    cdef EventQueues.iterator it = a.stream_events.find(a.event_poll_next)
    if it == a.stream_events.end():
        it = a.stream_events.begin()
    cdef size_t i
    for i in range(streams):
        if it == a.stream_events.end():
            it = a.stream_events.begin()
        if poll_stream(a, it):
            it = a.stream_events.erase(it)
        else:
            inc(it)
    if it == a.stream_events.end():
        it = a.stream_events.begin()
    a.event_poll_next = deref(it).first if it != a.stream_events.end() else 0
    return 0


cdef uintptr_t take_foreign_event(DeviceState* a, int device) except? 0:
    """An idle event of device `device` (not this allocator's), made when none is pooled."""
    cdef uintptr_t event
    pool = a.foreign_event_pools.find(device)
    if pool != a.foreign_event_pools.end() and not deref(pool).second.empty():
        event = deref(pool).second.back()
        deref(pool).second.pop_back()
    else:
        backend_of(a).event_create_on(device, &event)
        a.foreign_event_devices[event] = device
    return event


cdef inline void return_event(DeviceState* a, uintptr_t event) noexcept:
    """Put an idle event back in its device's pool."""
    if not a.foreign_event_devices.empty():
        it = a.foreign_event_devices.find(event)
        if it != a.foreign_event_devices.end():
            a.foreign_event_pools[deref(it).second].push_back(event)
            return
    a.event_pool.push_back(event)


cdef inline void event_done(DeviceState* a, uintptr_t event, Block* b) noexcept:
    return_event(a, event)
    a.outstanding_events -= 1
    b.event_count -= 1
    if b.event_count == 0:
        free_completed(a, b)


cdef int synchronize_and_free_events(DeviceState* a) except -1:
    """Wait for every outstanding event and free the blocks that were waiting on them."""
    commit_sync_all(&a.st)
    if not a.deferred_blocks.empty():
        flush_deferred_blocks(a)
    cdef EventEntry front
    cdef EventQueues.iterator it = a.stream_events.begin()
    while it != a.stream_events.end():
        while not deref(it).second.empty():
            front = deref(it).second.front()
            backend_of(a).event_synchronize(front.first)
            deref(it).second.pop_front()
            event_done(a, front.first, front.second)
        it = a.stream_events.erase(it)
    return 0


# ------------------------------------------------------------------------------- stream uses

cdef bint record_use(DeviceState* a, Block* b, uintptr_t s, bint last_use) except -1:
    """record_stream's rule for live block `b` and stream `s` (lock held): True when a new use
    was recorded (its stream object, if any, is then pinned). ValueError for a stream that is
    not alive, nothing changed."""
    cdef int use = stream_use_state(a, b, s)
    cdef bint added = False
    if use != USE_KNOWN:
        if not stream_is_alive(a, s):
            raise ValueError(f"stream {s} was destroyed: record_stream needs a live stream "
                             f"(the block's free records an event there)")
        if use == USE_NEEDS_MEMORY:
            make_room_for_use(a, b, s)
        add_stream_use(a, b, s)
        added = True
        if a.capture_routes:
            mark_captured_use(a, b, s)
    elif a.capture_routes or not a.capture_uses.empty():
        unmark_real_use(a, b, s)
    if a.capture_routes:
        if last_use:
            mark_last_use(a, b, s)
        elif not a.capture_uses.empty():
            forget_last_use(a, b, s)
    return added


cdef bint stream_is_alive(DeviceState* a, uintptr_t stream) except -1:
    """Whether the backend says `stream` may be used; ValueError for a handle it never made."""
    try:
        return backend_of(a).stream_alive(stream) != 0
    except CudaError as err:
        raise ValueError(f"stream {stream} is not a stream the backend knows: {err}") from err


cdef int keep_allocation_stream(DeviceState* a, object pins_lock, dict objects, dict pins,
                                uintptr_t stream, object stream_object) except -1:
    """DeviceCachingAllocator.keep_allocation_stream: keep `stream_object` in `objects` while
    blocks of `stream` may be cached (`pins`: the record_stream pins, see reap_dropped_streams)."""
    if stream == 0:
        return 0
    cdef bint kept
    lock_device(a)
    kept = a.allocation_streams_kept.count(stream) != 0
    if not kept:
        a.allocation_streams_kept.insert(stream)
        a.st.destroyed_streams.erase(stream)     # the handle names a live stream again
    a.mutex.unlock()
    if not kept:
        with pins_lock:
            objects[stream] = stream_object
        # A new stream: the program may be making streams and dropping them (CuPy destroys a
        # stream when its object dies), so let go of the ones it has dropped. A reap reads every
        # kept object, so it runs once the streams new since the last one number as many as the
        # objects kept before them: a new stream costs the same however many are kept, and a
        # dropped stream is let go within about three times as many new streams as were kept
        # when it was dropped (process_events() reaps at once).
        a.streams_since_reap += 1
        if len(objects) > 1 and 2 * a.streams_since_reap >= <size_t>len(objects):
            a.streams_since_reap = 0
            reap_dropped_streams(a, pins_lock, objects, pins)
    return 0
