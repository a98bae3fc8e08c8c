# The cache-hit path, once: malloc, free and record_stream of a block the cache holds, as inline
# functions over the device state, inlined into their callers. The Python methods of
# DeviceCachingAllocator (_core.pyx) call allocator_malloc / allocator_free, which fall through to
# the slow path (_ladder), events (_events), routing (_routing) and capture (_capture) only when
# the cache cannot serve; the C entry points (_core.pyx, pyalloc._capi's table) call the *_cache_hit
# functions, which serve only what needs no Python and no backend call, from any thread, without
# the GIL, and otherwise answer "not served" with nothing changed.
#
# malloc: allocator_malloc -> (get_free_block, take_block, hand_out -> commit_alloc);
# free: allocator_free -> free_unused_block -> (commit_free_requested, commit_free_completed,
# merge_free_block).
from libc.stdint cimport uintptr_t, uint32_t

from pyalloc._types cimport Block, BlockPool, PrivatePool, likely, unlikely
from pyalloc._policy cimport round_size, is_small_request, gc_enabled, get_free_block
from pyalloc._blocks cimport take_block, merge_free_block
from pyalloc._state cimport commit_free_requested, commit_free_completed
from pyalloc._device cimport (DeviceState, backend_of, hand_out, stream_use_state, add_stream_use,
                              USE_NEW, USE_NEEDS_MEMORY)
from pyalloc._routing cimport routed_pool
from pyalloc._capture cimport defer_free, free_safe_blocks_in_capture
from pyalloc._events cimport insert_events, process_events, process_some_events
from pyalloc._ladder cimport malloc_slow
from pyalloc._introspect cimport raise_not_allocated


cdef inline BlockPool* get_pool(DeviceState* a, size_t size, uintptr_t stream) except NULL:
    """The pool a request of `size` rounded bytes on `stream` is served from."""
    cdef PrivatePool* private
    if not a.captures_underway.empty():
        private = routed_pool(a, stream)
        if private != NULL:
            return &private.small_blocks if is_small_request(size) else &private.large_blocks
    return a.small_blocks if is_small_request(size) else a.large_blocks


cdef inline int allocator_malloc(DeviceState* a, size_t orig_size, uintptr_t stream,
                                 uint32_t metadata_id, uint32_t context_id, Block** out) except -1:
    """Find or make a block for `orig_size` bytes on `stream`. Caller holds the lock.

    Returns 0 with *out set, or BACKEND_OOM with the oom_* figures set.
    """
    cdef size_t size = round_size(&a.st.settings, orig_size)
    cdef BlockPool* pool
    if a.captures_underway.empty():
        # (Blocks deferred while a route was active got their events when the last route ended.)
        if a.outstanding_events:
            if a.st.settings.event_poll_streams == 0:
                process_events(a)
            else:
                process_some_events(a, a.st.settings.event_poll_streams)
        pool = a.small_blocks if is_small_request(size) else a.large_blocks
    else:
        pool = get_pool(a, size, stream)
        if a.capture_routes and a.st.settings.graph_reuse and not a.deferred_blocks.empty():
            free_safe_blocks_in_capture(a, stream, pool, size)
    cdef Block* b = get_free_block(&a.st.settings, pool, stream, size)
    cdef int rc = 0
    if unlikely(b == NULL and a.outstanding_events and a.st.settings.event_poll_streams != 0
                and a.captures_underway.empty()):
        # Polling in turn: before a miss, every stream's completed events, as PyTorch, and the
        # search again (the GC clock counts one search per malloc, as PyTorch's).
        process_events(a)
        if gc_enabled(&a.st.settings):
            pool.get_free_blocks_call_count -= 1
        b = get_free_block(&a.st.settings, pool, stream, size)
    if b == NULL:
        rc = malloc_slow(a, pool, orig_size, size, stream, metadata_id, context_id, out)
    else:
        out[0] = hand_out(a, take_block(&a.st, b, True, size), orig_size, metadata_id, context_id)
    if unlikely(a.reuse_checked) and rc == 0:
        # The sanitizer raises when the block may still be in use (the block stays handed out,
        # for the test that found it to look at).
        backend_of(a).check_handout(out[0].ptr, out[0].size, stream)
    return rc


cdef inline Block* lookup_allocated(DeviceState* a, uintptr_t ptr) except NULL:
    """The live block at `ptr`; ValueError for an unknown pointer or a double free."""
    cdef Block* b = a.active_blocks.get(ptr)
    if b != NULL and b.allocated:
        return b
    raise_not_allocated(a, ptr, b != NULL)     # out of line: keeps this path small enough to inline


cdef inline int allocator_free(DeviceState* a, Block* b, uint32_t context_id) except -1:
    """Free live block `b` (lock held): back to its pool, or waiting for its other streams."""
    if b.stream_uses.empty():
        free_unused_block(a, b, context_id)
        return 0
    # Events first: if recording one fails, insert_events undoes its work and the block is still
    # allocated, so the caller's free simply did not happen (defer_free is all or nothing too).
    if a.captures_underway.empty():
        insert_events(a, b)
    else:
        defer_free(a, b)
    commit_free_requested(&a.st, b, context_id)
    return 0


cdef inline void free_unused_block(DeviceState* a, Block* b, uint32_t context_id) noexcept nogil:
    """The free of a live block used on no other stream: back to its pool at once. The one copy
    of it, for free() and the C entry points' cache hit."""
    commit_free_requested(&a.st, b, context_id)
    a.active_blocks.erase(b.ptr)
    commit_free_completed(&a.st, b, context_id)
    merge_free_block(&a.st, b)


# ------------------------------------------------------------------------------- C callers
#
# C callers on any thread (pyalloc._capi) take the lock for cache hits only, giving up the GIL
# while they wait if they hold it, and never wait for the GIL while holding the lock: a miss
# unlocks first, then the caller takes the GIL and runs the ordinary path above.

cdef extern from "Python.h":
    ctypedef struct PyThreadState
    int PyGILState_Check() nogil
    PyThreadState* PyEval_SaveThread() nogil
    void PyEval_RestoreThread(PyThreadState*) nogil


cdef inline void lock_from_any_thread(DeviceState* a) noexcept nogil:
    """Take the lock for a C caller that may or may not hold the GIL. One that holds it gives it up
    while it waits: the lock's holder may need the GIL to finish (a slow path running Python, a
    backend call that released it), and waiting for the lock with the GIL would deadlock."""
    cdef PyThreadState* ts
    if likely(a.mutex.try_lock()):
        return
    if PyGILState_Check():
        ts = PyEval_SaveThread()
        a.mutex.lock()
        PyEval_RestoreThread(ts)
    else:
        a.mutex.lock()


cdef inline bint needs_python(DeviceState* a) noexcept nogil:
    # Events to poll (backend calls), routes into private pools (thread keys, capture queries),
    # history stacks (a Python recorder): the ordinary path handles them.
    return (a.outstanding_events != 0 or not a.captures_underway.empty()
            or a.capture_alloc_stacks or a.capture_free_stacks or a.reuse_checked)


cdef inline int malloc_cache_hit(DeviceState* a, size_t size, uintptr_t stream,
                                 uint32_t metadata_id, uintptr_t* out) noexcept nogil:
    """malloc of `size` bytes (0 < size < kMaxRequest) on `stream` from the cache: 1 with *out the
    pointer, or 0 (not served, nothing changed)."""
    cdef size_t rounded = round_size(&a.st.settings, size)
    cdef BlockPool* pool = a.small_blocks if is_small_request(rounded) else a.large_blocks
    cdef Block* b
    lock_from_any_thread(a)
    if unlikely(needs_python(a)):
        a.mutex.unlock()
        return 0
    b = get_free_block(&a.st.settings, pool, stream, rounded)
    if unlikely(b == NULL):
        if gc_enabled(&a.st.settings):
            pool.get_free_blocks_call_count -= 1     # the ordinary path counts this search
        a.mutex.unlock()
        return 0
    b = hand_out(a, take_block(&a.st, b, True, rounded), size, metadata_id, 0)
    out[0] = b.ptr
    a.mutex.unlock()
    return 1


cdef inline int free_cache_hit(DeviceState* a, uintptr_t ptr) noexcept nogil:
    """free of a live block used on no other stream: 1 done, or 0 (not done: another case, or a
    bad pointer whose error the ordinary path raises)."""
    cdef Block* b
    lock_from_any_thread(a)
    b = a.active_blocks.get(ptr)
    if unlikely(b == NULL or not b.allocated or b.buffer_owned or not b.stream_uses.empty()
                or needs_python(a)):
        a.mutex.unlock()
        return 0
    free_unused_block(a, b, 0)
    a.mutex.unlock()
    return 1


cdef inline int record_stream_cache_hit(DeviceState* a, uintptr_t ptr, uintptr_t stream) noexcept nogil:
    """record_stream of a live block outside any route, where recording the use allocates
    nothing: 1 done, or 0 (not done)."""
    cdef Block* b
    cdef int use
    lock_from_any_thread(a)
    b = a.active_blocks.get(ptr)
    if b == NULL or not b.allocated or a.capture_routes or not a.captures_underway.empty():
        a.mutex.unlock()
        return 0
    use = stream_use_state(a, b, stream)
    if use == USE_NEEDS_MEMORY or (use == USE_NEW and a.reuse_checked):
        a.mutex.unlock()           # may fail (or the sanitizer checks the stream): Python's path
        return 0
    if use == USE_NEW:
        add_stream_use(a, b, stream)
    a.mutex.unlock()
    return 1
