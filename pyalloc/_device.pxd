# The device allocator's state (_device.h), declared once, and the small steps every module of the
# core shares over it: the lock, the backend, a block's stream uses, the hand-out and the end of a
# free. The modules over this state: _hot.pxd (the cache hit), _ladder (slow path and OOM ladder),
# _routing (private pools and routes), _capture (frees during a capture), _events (events and
# stream lifetime), _introspect (statistics, copies, invariants); _core.pyx is the Python class.
from libc.stdint cimport uintptr_t, int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.map cimport map as cppmap
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from cpython.object cimport PyObject
from cython.operator cimport dereference as deref

from pyalloc._types cimport (AllocatorLock, ActiveMap, Block, BlockPool, CaptureReuse, CaptureUses,
                             CoreState, MempoolId, PrivatePool, Route, ROUTE_CAPTURE)
from pyalloc._backend cimport Backend
from pyalloc._state cimport commit_alloc, commit_free_completed
from pyalloc._blocks cimport merge_free_block

ctypedef pair[uintptr_t, Block*] EventEntry          # (event, block waiting on it)
ctypedef deque[EventEntry] EventQueue                 # one stream's events, oldest first
ctypedef unordered_map[uintptr_t, EventQueue] EventQueues
ctypedef Block* BlockPtr

cdef extern from "_device.h" namespace "pyalloc" nogil:
    cdef cppclass ReleaseCount:
        size_t released
        unordered_set[BlockPtr] gone
        int64_t clock_offset
        size_t reserved
        size_t free_bytes
        size_t physical

    cdef cppclass DeviceState:
        BlockPool* small_blocks
        BlockPool* large_blocks
        ActiveMap active_blocks
        size_t outstanding_events
        vector[Route] captures_underway
        int capture_routes
        bint capture_alloc_stacks
        bint capture_free_stacks
        bint reuse_checked
        AllocatorLock mutex
        CoreState st
        PyObject* backend
        EventQueues stream_events
        uintptr_t event_poll_next
        vector[uintptr_t] event_pool
        unordered_map[int, vector[uintptr_t]] foreign_event_pools
        unordered_map[uintptr_t, int] foreign_event_devices
        unordered_map[uintptr_t, size_t] stream_use_counts
        unordered_set[uintptr_t] allocation_streams_kept
        unordered_map[uintptr_t, uintptr_t] retiring_streams
        size_t streams_since_reap
        vector[uintptr_t] pins_to_check
        bint has_pins
        unordered_map[uintptr_t, size_t] segments_by_stream
        unordered_map[uint64_t, vector[Route]] thread_routes
        cppmap[uint64_t, Route] capture_routes_by_seq
        uint64_t last_route_seq
        cppmap[MempoolId, PrivatePool*] graph_pools
        vector[Block*] deferred_blocks
        size_t deferred_released
        size_t deferred_marked
        uint64_t last_defer_id
        unordered_map[BlockPtr, CaptureUses] capture_uses
        unordered_map[uint64_t, CaptureReuse] reuse_contexts
        uint64_t nodes_expanded
        size_t oom_alloc_size, oom_free, oom_total, oom_private


cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #define pyalloc_is_finalizing() Py_IsFinalizing()
    #else
    #define pyalloc_is_finalizing() _Py_IsFinalizing()
    #endif
    """
    bint pyalloc_is_finalizing() noexcept     # the interpreter is shutting down


cdef inline Backend backend_of(DeviceState* a):
    """The allocator's backend (the allocator object owns the reference; slow paths only)."""
    return <Backend>a.backend


cdef inline void lock_device(DeviceState* a) noexcept:
    """Take the allocator's lock; wait for it with the GIL released, so that a thread that holds
    the lock and released the GIL inside a slow driver call can always finish."""
    if not a.mutex.try_lock():
        with nogil:
            a.mutex.lock()


cdef inline Py_ssize_t find_route(DeviceState* a, MempoolId pid) noexcept:
    """Index of the route into `pid` in captures_underway, or -1."""
    cdef size_t i
    for i in range(a.captures_underway.size()):
        if a.captures_underway[i].id == pid:
            return i
    return -1


cdef inline bint routes_capture(DeviceState* a, unsigned long long capture_id) noexcept:
    """Whether a route sends the allocations of capture `capture_id` to a private pool."""
    for r in a.captures_underway:
        if r.kind == ROUTE_CAPTURE and r.value == capture_id:
            return True
    return False


# ------------------------------------------------------------------------------- stream uses
#
# record_stream's rule, once for the Python method and the C entry points: a block's stream uses
# are the streams other than its own that it was declared used on, each once, and every use is
# counted per stream (stream_use_counts), which is what keeps a record_stream pin alive.

cdef enum:
    USE_KNOWN = 0            # b's own stream, or a use already recorded: nothing to do
    USE_NEW = 1              # a new use; recording it allocates nothing
    USE_NEEDS_MEMORY = 2     # a new use whose recording may allocate (a C caller defers it)


cdef inline int stream_use_state(DeviceState* a, Block* b, uintptr_t stream) noexcept nogil:
    if stream == b.stream or b.uses_stream(stream):
        return USE_KNOWN
    if (b.stream_uses.size() == b.stream_uses.capacity() or a.stream_use_counts.count(stream) == 0
            or b.new_use_indexed()):
        return USE_NEEDS_MEMORY       # (from 8 uses on, a new one enters the block's index too)
    return USE_NEW


cdef inline void add_stream_use(DeviceState* a, Block* b, uintptr_t stream) noexcept nogil:
    """Record a new use for which there is room (stream_use_state said USE_NEW, or
    make_room_for_use ran): allocates nothing, so it cannot fail."""
    b.stream_uses.push_back(stream)
    a.stream_use_counts[stream] += 1


cdef inline int make_room_for_use(DeviceState* a, Block* b, uintptr_t stream) except -1:
    """What a USE_NEEDS_MEMORY use needs before add_stream_use: MemoryError, nothing changed but
    spare capacity, when it cannot be had."""
    b.stream_uses.reserve(b.stream_uses.size() + 1)
    a.stream_use_counts.insert(pair[uintptr_t, size_t](stream, 0))
    b.index_use(stream)               # last: it may fail, and its entry is the use itself
    return 0


cdef inline void forget_stream_use(DeviceState* a, uintptr_t stream) noexcept:
    """One block stream use naming `stream` is over (its event is recorded, or it was dropped)."""
    it = a.stream_use_counts.find(stream)
    if it == a.stream_use_counts.end():
        return
    if deref(it).second <= 1:
        a.stream_use_counts.erase(it)
        if a.has_pins:                # its pin (if any) may go now: the next prune checks it
            a.pins_to_check.push_back(stream)
    else:
        a.stream_use_counts[stream] = deref(it).second - 1


cdef inline void forget_stream_uses(DeviceState* a, vector[uintptr_t]* streams) noexcept:
    """forget_stream_use for each of `streams`, which are then cleared."""
    cdef uintptr_t s
    for s in deref(streams):
        forget_stream_use(a, s)
    streams.clear()


cdef inline void forget_block_uses(DeviceState* a, Block* b) noexcept:
    """forget_stream_uses of all of b's stream uses, and its use index with them."""
    forget_stream_uses(a, &b.stream_uses)
    b.drop_use_index()


cdef inline void forget_segment_stream(DeviceState* a, uintptr_t stream) noexcept:
    """One segment of `stream` is gone (released, or moved to another stream)."""
    it = a.segments_by_stream.find(stream)
    if it == a.segments_by_stream.end():
        return
    if deref(it).second <= 1:
        a.segments_by_stream.erase(it)
    else:
        a.segments_by_stream[stream] = deref(it).second - 1


# ------------------------------------------------------------------------------- hand-out and free

cdef inline Block* hand_out(DeviceState* a, Block* b, size_t orig_size, uint32_t metadata_id,
                            uint32_t context_id) noexcept nogil:
    """Block `b` (out of its pool) goes to the caller of a request of `orig_size` bytes."""
    commit_alloc(&a.st, b, orig_size, metadata_id, context_id)
    a.active_blocks.insert(b.ptr, b)
    return b


cdef inline void free_completed(DeviceState* a, Block* b) noexcept:
    """The last event (or deferral) of a freed block is over: back to its pool."""
    if not a.capture_uses.empty():
        a.capture_uses.erase(b)
    a.active_blocks.erase(b.ptr)
    commit_free_completed(&a.st, b, 0)
    merge_free_block(&a.st, b)
