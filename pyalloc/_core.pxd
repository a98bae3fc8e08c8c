# The device allocator's declaration, for the modules that drive it from C: the replay loop
# (_replay.pyx) and the framework entry points (_hooks.pyx).
from libc.stdint cimport uintptr_t, uint32_t
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.map cimport map as cppmap
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set

from libc.stdint cimport uint64_t
from pyalloc._types cimport (AllocatorLock, ActiveMap, Block, BlockPool, CaptureReuse, CaptureUses,
                             DeferredEntry, StreamReuse,
                             CoreState, MempoolId, PrivatePool, Route)
from pyalloc._backend cimport Backend

ctypedef pair[uintptr_t, Block*] EventEntry          # (event, block waiting on it)
ctypedef deque[EventEntry] EventQueue                 # one stream's events, oldest first
ctypedef unordered_map[uintptr_t, EventQueue] EventQueues
ctypedef Block* BlockPtr


cdef class DeviceCachingAllocator:
    # What a cache hit reads comes first and together (declaration order is the object's layout),
    # so that a malloc or free served from the cache touches few of the object's cache lines: the
    # pools, the active map, the tests of needs_python (_core.pyx), the lock's word, then the
    # settings and statistics at the start of st.
    cdef BlockPool* small_blocks                      # the default pools
    cdef BlockPool* large_blocks
    cdef ActiveMap active_blocks                      # ptr -> block handed out or awaiting events
    cdef size_t outstanding_events
    cdef vector[Route] captures_underway              # newest last
    # The same routes indexed, so that routing an allocation reads this thread's routes and the
    # capture routes, not every thread's (routed_pool): by thread key (oldest first), and by seq.
    cdef unordered_map[uint64_t, vector[Route]] thread_routes
    cdef cppmap[uint64_t, Route] capture_routes_by_seq
    cdef uint64_t last_route_seq
    cdef int capture_routes                           # routes of kind ROUTE_CAPTURE active
    cdef public bint capture_alloc_stacks              # set by the snapshot layer
    cdef public bint capture_free_stacks               # also capture the stack of each free()
    cdef readonly bint reuse_checked                   # the backend's reuse sanitizer is on
    cdef AllocatorLock mutex
    cdef CoreState st                                 # settings, statistics, history, spares
    cdef readonly Backend backend
    cdef EventQueues stream_events
    cdef vector[uintptr_t] event_pool                 # created, idle events for reuse
    cdef unordered_map[int, vector[uintptr_t]] foreign_event_pools   # the same, by other device
    cdef unordered_map[uintptr_t, int] foreign_event_devices         # event -> its other device
    # Stream lifetime: how many block stream uses (record_stream) name each stream handle, and the
    # stream objects record_stream was given, kept alive while a use names them (see record_stream).
    cdef unordered_map[uintptr_t, size_t] stream_use_counts
    cdef dict stream_pins                             # handle -> stream object
    # Handles whose use count reached zero while a pin may name them (and each newly pinned
    # handle): the only pins a prune checks, so that a free costs the same however many pins
    # are alive (prune_stream_pins).
    cdef vector[uintptr_t] pins_to_check
    # Allocation streams given as objects (framework hooks, malloc(n, stream_obj)): kept alive while
    # the allocator holds blocks of theirs, so that their handle is not handed to a new stream while
    # memory cached for the old one may still be in use by its queued work (see keep_allocation_stream).
    cdef unordered_set[uintptr_t] allocation_streams_kept
    cdef dict allocation_stream_objects               # handle -> stream object
    cdef object pins_lock                             # orders changes of the two dicts above
    cdef size_t streams_since_reap                    # new allocation streams since the last reap
    # Allocation streams the program has dropped (only the allocator holds their object): an event
    # recorded on each; once it completes, the object is let go (reap_dropped_streams).
    cdef unordered_map[uintptr_t, uintptr_t] retiring_streams     # handle -> event
    # Segments (not expandable) held, by stream: every block belongs to a segment of its stream,
    # so a stream has a block while it counts one here or owns an expandable segment
    # (mark_streams_without_blocks). Updated where segments come and go, and where one changes
    # streams (cross-stream reuse in a capture).
    cdef unordered_map[uintptr_t, size_t] segments_by_stream

    # private pools (MemPools, graph pools) and the routes into them
    cdef cppmap[MempoolId, PrivatePool*] graph_pools
    cdef vector[Block*] deferred_blocks               # freed with stream uses while routing; NULL: released
    cdef size_t deferred_released                     # NULL slots in deferred_blocks
    cdef size_t deferred_marked                       # deferred blocks with free markers (reuse candidates)
    cdef uint64_t last_defer_id                       # CaptureUses.defer_id of the newest deferral
    cdef unordered_map[BlockPtr, CaptureUses] capture_uses     # blocks used or freed in a capture
    cdef unordered_map[uint64_t, CaptureReuse] reuse_contexts  # by capture id (#162186 cache)
    cdef uint64_t nodes_expanded                      # graph nodes the reuse walks expanded

    # memory history
    cdef public object context_recorder                # callable() -> context id, or None
    cdef public list oom_observers                     # callables(device, alloc_size, total, free)

    # last OOM figures, read after the lock is dropped to build the message
    cdef size_t oom_alloc_size, oom_free, oom_total, oom_private

    # For C callers (replay, framework hooks). *_locked: the caller holds the lock.
    cdef void lock(self) noexcept
    cdef void unlock(self) noexcept
    cdef int malloc_locked(self, size_t size, uintptr_t stream, uint32_t context_id,
                           Block** out) except -1
    cdef int free_locked(self, Block* b, uint32_t context_id) except -1
    cdef int empty_cache_locked(self) except -1
    cdef int try_allocate_block(self, size_t size, uintptr_t stream, Block** out) except -1
    cdef size_t policy_release_bytes(self, size_t size, uintptr_t stream) except? 0
    cdef int release_cached_segment(self, uintptr_t ptr, size_t size, uintptr_t stream) except -1
    cdef raise_oom(self, size_t requested)
    cdef int free_pointer(self, uintptr_t ptr) except -1
    cdef int keep_allocation_stream(self, uintptr_t stream, object stream_object) except -1
    cdef bint routes_capture(self, unsigned long long capture_id) noexcept


cdef class Buffer:
    cdef readonly uintptr_t ptr
    cdef readonly size_t size
    cdef readonly uintptr_t stream
    cdef readonly DeviceCachingAllocator allocator


cdef inline object address_object(Block* b):
    """b's address as a Python int, for the caller that owns b (malloc's result).

    Blocks are handed out again and again at the same address: the int is kept on the block and
    returned again instead of allocating a new one each time. (The caller owns the block until
    free, so no other thread changes it meanwhile.)"""
    if b.py_address != NULL and b.py_address_value == b.ptr:
        return <object><PyObject*>b.py_address
    cdef object address = b.ptr          # a Python int (typed: Cython would infer a C int)
    Py_XDECREF(<PyObject*>b.py_address)
    Py_INCREF(address)
    b.py_address = <void*><PyObject*>address
    b.py_address_value = b.ptr
    return address


# The C entry points' fast half (pyalloc._capi's table points at these): a cache hit of device's
# default allocator, served under its C lock without the GIL from any thread; anything else is
# handed to the slow half that _capi registers with set_entry_slow_paths. entry_slot(device) is the
# allocator they serve (a borrowed pointer, NULL before _capi publishes one with set_entry_slot).
cdef extern from *:
    """
    #define PYALLOC_ENTRY_DEVICES 256
    """
    int PYALLOC_ENTRY_DEVICES           # device ordinals the entry points serve: [0, 256)

ctypedef int (*entry_malloc_fn)(int, size_t, uintptr_t, uintptr_t*) noexcept nogil
ctypedef int (*entry_free_fn)(int, uintptr_t) noexcept nogil
ctypedef int (*entry_record_stream_fn)(int, uintptr_t, uintptr_t) noexcept nogil

cdef int entry_malloc(int device, size_t size, uintptr_t stream, uintptr_t* out) noexcept nogil
cdef int entry_free(int device, uintptr_t ptr) noexcept nogil
cdef int entry_record_stream(int device, uintptr_t ptr, uintptr_t stream) noexcept nogil
cdef void set_entry_slow_paths(entry_malloc_fn malloc_slow, entry_free_fn free_slow,
                               entry_record_stream_fn record_stream_slow) noexcept
cdef PyObject* entry_slot(int device) noexcept nogil
cdef void set_entry_slot(int device, PyObject* allocator) noexcept nogil
