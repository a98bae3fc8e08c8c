# cython: language_level=3
"""The device allocator: the lock, malloc and free, private-pool routing, cross-stream events, the
slow path with its out-of-memory ladder, and the statistics and history readers.

Where things are decided (PyTorch's native CUDA caching allocator, c10/cuda/
CUDACachingAllocator.cpp): rounding, size classes, best fit, split and merge in _policy.pxd; the
statistics and trace entry of each allocation, free and segment change in _state.pxd; growing and
shrinking expandable segments in _expandable.pyx; argument checks in _validate.pxd. This module
calls them in PyTorch's order:

* malloc: poll completed events (no route active), choose the pool (the newest route whose filter
  accepts the request, else the default pools; small <= 1 MiB < large), best fit, split; on a miss:
  garbage collection (if configured), a new segment or expandable pages, a use_on_oom pool's
  cached blocks, releasing oversize cached blocks (max_split_size set) and retrying, releasing
  every unsplit cached segment and retrying (no route active), then OutOfMemoryError.
* free: a block used on other streams (record_stream) waits for events recorded on them, or, while
  a route is active, until no route is (events belong to the stream's own time line); others
  return to their pool at once, merged with free neighbours.

Private pools (MemPool, CUDA graphs) have ids (0, n) or (n, 0), a use count and their own small
and large pools. A route (pool id, filter) sends the allocations it accepts to its pool; filters
are "this thread" (use_mem_pool) and "this stream is in capture c" (graph capture).

Locking: every public method takes the allocator's one C-level recursive mutex. The GIL is
released while waiting for it, so a thread that holds the mutex and has released the GIL inside a
slow driver call can always finish. Recursive because a Python finalizer (a Buffer collected while
an exception object is built) may re-enter free() on the same thread. C callers on any thread
(pyalloc._capi) take the lock for cache hits only, giving up the GIL while they wait if they hold
it, and never wait for the GIL while holding the lock: a miss unlocks first, then takes the GIL.
"""
from libc.stdint cimport uintptr_t, int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.pair cimport pair
cimport cython
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec
from cpython.object cimport PyObject
from cpython.dict cimport PyDict_Next, PyDict_GetItem
from cpython.ref cimport Py_INCREF, Py_XDECREF
import threading

from pyalloc._backend cimport Backend, BACKEND_OK, BACKEND_OOM
from pyalloc._types cimport (ActiveMap, Block, BlockPool, BlockSet, CaptureUses, CoreState, MempoolId,
                             PrivatePool, Route, ROUTE_THREAD, ROUTE_CAPTURE, Stat, TraceEntry,
                             UnmappedSet, StatRow, stat_current, stat_peak, stat_allocated,
                             single_freed, stat_freed, stat_reset_peak, stat_reset_accumulated,
                             single_reset_accumulated, NUM_STATS, ST_RESERVED_BYTES,
                             ST_ALLOCATED_BYTES, ST_ACTIVE_BYTES, ST_ALLOCATION, ST_ACTIVE,
                             ST_REQUESTED_BYTES, ST_INACTIVE_SPLIT, ST_INACTIVE_SPLIT_BYTES,
                             ST_SEGMENT, TR_OOM, TR_SNAPSHOT)
from pyalloc._types cimport current_thread_key as thread_key_now
from pyalloc._types cimport likely, unlikely
from pyalloc._policy cimport (kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc,
                              kLargeBuffer, kRoundLarge, kSizeMax, kMaxRequest, round_size, is_small_request,
                              segment_size_for, gc_enabled, get_free_block, take_block,
                              new_block, retire_block, is_free)
from pyalloc._state cimport (trace, commit_alloc, commit_free_requested, commit_free_completed,
                             commit_segment_alloc, commit_segment_free)
from pyalloc._expandable cimport (try_allocate_expandable_block, unmap_block, mapped_bytes,
                                  expandable_growth_bytes, release_page_pool, page_pool_counts,
                                  page_pool_bytes,
                                  free_segment_structs)
from pyalloc._validate cimport stream_handle, device_pointer, request_size
from pyalloc._graphs cimport extend_ancestors, all_visited, add_unique
from pyalloc.errors import (OutOfMemoryError, format_bytes, AlreadyFreedError, NotAllocatedError,
                            OwnedByBufferError)


MIN_BLOCK_SIZE = kMinBlockSize
SMALL_SIZE = kSmallSize
SMALL_BUFFER = kSmallBuffer
MIN_LARGE_ALLOC = kMinLargeAlloc
LARGE_BUFFER = kLargeBuffer
ROUND_LARGE = kRoundLarge
SIZE_MAX = kSizeMax

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_NAMES = ("all", "small_pool", "large_pool")
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                 "segment_map", "segment_unmap", "snapshot", "oom")
ROUTE_FILTERS = ("thread", "capture")        # by RouteFilterKind


# ------------------------------------------------------------------------------- process state
#
# State that must be one per process lives here and nowhere else: other extension modules get
# their own copy of any variable defined in a shared header, so they reach these through _core.

cdef extern from *:
    """
    #include <atomic>
    /* This thread's metadata id (an index into _metadata_strings; 0 = none). */
    static thread_local uint32_t pyalloc_current_metadata_id = 0;
    /* Set once any thread has set metadata: until then the hot path skips the thread-local read. */
    static std::atomic<bool> pyalloc_metadata_in_use{false};
    static uint32_t pyalloc_metadata_now() noexcept {
        return pyalloc_metadata_in_use.load(std::memory_order_relaxed) ? pyalloc_current_metadata_id : 0;
    }
    static inline void pyalloc_set_metadata(uint32_t id) {
        if (id) pyalloc_metadata_in_use.store(true);
        pyalloc_current_metadata_id = id;
    }
    static inline uint32_t pyalloc_get_metadata() { return pyalloc_current_metadata_id; }
    /* Pool id counters: user-created pools get (0, n), graph-created pools (n, 0). */
    static std::atomic<int64_t> pyalloc_user_pool_ids{0};
    static std::atomic<int64_t> pyalloc_graph_pool_ids{0};
    """
    uint32_t pyalloc_metadata_now() noexcept nogil
    void pyalloc_set_metadata(uint32_t) noexcept nogil
    uint32_t pyalloc_get_metadata() noexcept nogil
    cppclass AtomicInt64 "std::atomic<int64_t>":
        int64_t fetch_add(int64_t)
    AtomicInt64 pyalloc_user_pool_ids
    AtomicInt64 pyalloc_graph_pool_ids


# Metadata strings are interned process-wide: blocks and trace entries hold a uint32 id, so
# stamping them costs nothing. The table only grows (one entry per distinct string ever set).
_metadata_strings = [""]        # id -> string; id 0 is "no metadata"
_metadata_ids = {"": 0}
_metadata_lock = threading.Lock()   # two threads interning one new string must agree on its id


def set_memory_metadata(text):
    """Set this thread's metadata string; stamped on trace entries and live blocks. "" clears it.

    Per OS thread, process-wide (all allocators), like torch.cuda.memory._set_memory_metadata.
    Raises TypeError (state unchanged) when `text` is not a str.
    """
    cdef uint32_t mid
    if not isinstance(text, str):
        raise TypeError(f"memory metadata must be a str, got {type(text).__name__} {text!r}")
    text = str(text)        # a str subclass is stored as a plain str (it is pickled in snapshots)
    mid = _metadata_ids.get(text, 0)
    if text and not mid:
        with _metadata_lock:
            mid = _metadata_ids.get(text, 0)
            if not mid:
                mid = len(_metadata_strings)
                _metadata_strings.append(text)
                _metadata_ids[text] = mid
    pyalloc_set_metadata(mid)


def get_memory_metadata():
    """This thread's metadata string ("" when none)."""
    return _metadata_strings[pyalloc_get_metadata()]


def metadata_string(uint32_t metadata_id):
    """The metadata string of an id recorded in blocks and trace entries."""
    return _metadata_strings[metadata_id]


def new_mempool_id(bint user_created):
    """A fresh private-pool id: (0, n) for a user-created pool (MemPool, graph_pool_handle),
    (n, 0) for one a graph capture creates for itself. n counts from 1, process-wide."""
    if user_created:
        return (0, pyalloc_user_pool_ids.fetch_add(1) + 1)
    return (pyalloc_graph_pool_ids.fetch_add(1) + 1, 0)


def stream_handle_of(stream):
    """The int handle of a stream given as an int or a stream object (as malloc reads it)."""
    return stream_handle(stream)


def current_thread_key():
    """The calling thread's key, as a "thread" route filter stores it."""
    return thread_key_now()


cdef MempoolId pool_id_of(object pool_id) except *:
    """A pool id given as a 2-tuple of ints >= 0 with at most one non-zero half."""
    if (not isinstance(pool_id, tuple) or len(pool_id) != 2
            or not all(type(x) is int and x >= 0 for x in pool_id)):
        raise TypeError(f"mempool_id must be a tuple of 2 integers >= 0, got {pool_id!r}")
    if pool_id[0] and pool_id[1]:
        raise ValueError(f"mempool_id {pool_id} is not a pool id: one half must be 0")
    cdef MempoolId out
    out.first = pool_id[0]
    out.second = pool_id[1]
    return out


cdef inline tuple pool_id_tuple(BlockPool* pool):
    if pool.owner == NULL:
        return (0, 0)
    return (pool.owner.id.first, pool.owner.id.second)


# ----------------------------------------------------------------------------- the allocator

cdef int never_initialized() except -1:
    raise RuntimeError(
        "this allocator was never initialized: DeviceCachingAllocator.__init__ did not run (a "
        "subclass's __init__ must call super().__init__(), and an allocator made with __new__ "
        "alone has no device)")


cdef class _NoBackend(Backend):
    """The backend of an allocator whose __init__ has not run (a subclass that skips
    super().__init__(), or cls.__new__(cls)): every call raises RuntimeError.

    __cinit__ installs it, so the core never calls a backend method through None (a segfault:
    Cython does not check for None there) and needs no check of its own on any path."""

    def __init__(self):
        self.device = -1
        self.kind = "uninitialized"

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        return never_initialized()

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        return never_initialized()

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        return never_initialized()

    cdef int event_create(self, uintptr_t* event) except -1:
        return never_initialized()

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        return never_initialized()

    cdef int event_query(self, uintptr_t event) except -1:
        return never_initialized()

    cdef int event_synchronize(self, uintptr_t event) except -1:
        return never_initialized()

    cdef int event_destroy(self, uintptr_t event) except -1:
        return never_initialized()

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        return never_initialized()

    cdef int device_synchronize(self) except -1:
        return never_initialized()

    cdef int vm_granularity(self, size_t* nbytes) except -1:
        return never_initialized()

    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1:
        return never_initialized()

    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1:
        return never_initialized()

    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        return never_initialized()

    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        return never_initialized()

    cdef int capture_begin(self, uintptr_t stream, int mode) except -1:
        return never_initialized()

    cdef int capture_end(self, uintptr_t stream, uintptr_t* graph) except -1:
        return never_initialized()

    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1:
        return never_initialized()

    cdef int graph_destroy(self, uintptr_t graph) except -1:
        return never_initialized()

    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1:
        return never_initialized()

    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        return never_initialized()


cdef Backend NO_BACKEND = _NoBackend()


cdef inline void lock_allocator(DeviceCachingAllocator a) noexcept:
    """Take the allocator's lock; wait for it with the GIL released (see the module docstring)."""
    if not a.mutex.try_lock():
        with nogil:
            a.mutex.lock()


# no_gc_clear: the collector must never take the backend away from an allocator whose Buffers
# may still be freed (a Buffer in a garbage cycle with its allocator is freed after, or while,
# the collector clears the allocator). clear_allocator below is its tp_clear instead.
@cython.no_gc_clear
cdef class DeviceCachingAllocator:
    """DeviceCachingAllocator(backend)
--

    PyTorch's caching allocator for one device, over a backend. Sizes are bytes.

    Most users construct `pyalloc.CachingAllocator`, which adds configuration, summaries,
    snapshots and MemPool objects on top of this class.
    """

    def __cinit__(self, *args, **kwargs):
        self.backend = NO_BACKEND       # until __init__: raises RuntimeError, never crashes
        self.large_blocks = new BlockPool(False, NULL)
        self.small_blocks = new BlockPool(True, NULL)
        self.st.metadata_now = pyalloc_metadata_now
        self.oom_observers = []
        self.stream_pins = {}
        self.allocation_stream_objects = {}
        # A Python lock, never held while the allocator's is taken for long: a prune's check
        # (under the allocator's lock) and its dict removals happen under it, so that a stream
        # named again meanwhile is always put back (a setter waits for the prune).
        self.pins_lock = threading.Lock()

    def __init__(self, Backend backend not None):
        self.backend = backend
        self.reuse_checked = backend.checks_reuse

    def __dealloc__(self):
        # Segments still held are not returned: the backend may be gone at interpreter exit, and
        # a device context's teardown reclaims them. Only host-side structures are freed here.
        cdef vector[Block*] blocks
        cdef Block* b
        cdef pair[MempoolId, PrivatePool*] entry
        if not pyalloc_is_finalizing():
            # Events are driver objects of the backend's context: give them back (at interpreter
            # exit the context's teardown reclaims them, as it does the segments).
            try:
                destroy_events(self, True)
            except RuntimeError:
                # CudaError or a closed CudaDevice: the context that owned them is gone and took
                # them with it; a destructor has no caller to report to.
                pass
        collect_blocks(self, &blocks)
        for b in blocks:
            Py_XDECREF(<PyObject*>b.py_address)
            del b
        for b in self.st.spare_blocks:
            Py_XDECREF(<PyObject*>b.py_address)
            del b
        self.st.spare_blocks.clear()
        free_segment_structs(&self.st)
        for entry in self.graph_pools:
            del entry.second
        self.graph_pools.clear()
        del self.large_blocks
        del self.small_blocks

    # ------------------------------------------------------------------------- for C callers

    cdef void lock(self) noexcept:
        lock_allocator(self)

    cdef void unlock(self) noexcept:
        self.mutex.unlock()

    cdef int malloc_locked(self, size_t size, uintptr_t stream, uint32_t context_id,
                           Block** out) except -1:
        return allocator_malloc(self, size, stream, context_id, out)

    cdef int free_locked(self, Block* b, uint32_t context_id) except -1:
        return allocator_free(self, b, context_id)

    cdef int empty_cache_locked(self) except -1:
        return release_cached_blocks(self)

    cdef int try_allocate_block(self, size_t size, uintptr_t stream, Block** out) except -1:
        return try_allocate(self, size, stream, out)

    cdef size_t policy_release_bytes(self, size_t size, uintptr_t stream) except? 0:
        return policy_release_bytes(self, size, stream)

    cdef int release_cached_segment(self, uintptr_t ptr, size_t size, uintptr_t stream) except -1:
        return release_cached_segment(self, ptr, size, stream)

    cdef int keep_allocation_stream(self, uintptr_t stream, object stream_object) except -1:
        """Keep `stream_object` (the stream of handle `stream`) alive while this allocator holds
        blocks of that stream: a stream destroyed with work queued still runs it, and the driver
        hands its handle to the next new stream at once, which would then be given the blocks
        cached for the old one while that work may still use them. Released by empty_cache once
        no block of the stream is left, or once the program has dropped it and its work is done
        (reap_dropped_streams, run here when the stream is new: callers keep a stream before
        allocating for it, so that a failure there allocates nothing). A reap reads every kept
        object, so it runs once the streams new since the last one number as many as the objects
        kept before them: a new stream costs the same however many are kept, and a dropped stream
        is let go within about three times as many new streams as were kept when it was dropped
        (process_events() reaps at once). (Stream 0 never dies;
        keeping an object of the other never-dying handles, CUDA's 1 and 2, costs nothing.)"""
        if stream == 0:
            return 0
        cdef bint kept
        lock_allocator(self)
        kept = self.allocation_streams_kept.count(stream) != 0
        if not kept:
            self.allocation_streams_kept.insert(stream)
        self.mutex.unlock()
        if not kept:
            with self.pins_lock:
                self.allocation_stream_objects[stream] = stream_object
            # A new stream: the program may be making streams and dropping them (CuPy destroys a
            # stream when its object dies), so let go of the ones it has dropped.
            self.streams_since_reap += 1
            if (len(self.allocation_stream_objects) > 1
                    and 2 * self.streams_since_reap >= <size_t>len(self.allocation_stream_objects)):
                self.streams_since_reap = 0
                reap_dropped_streams(self)
        return 0

    cdef raise_oom(self, size_t requested):
        raise_out_of_memory(self, requested)

    cdef bint routes_capture(self, unsigned long long capture_id) noexcept:
        """Whether a route sends the allocations of capture `capture_id` to a private pool."""
        for r in self.captures_underway:
            if r.kind == ROUTE_CAPTURE and r.value == capture_id:
                return True
        return False

    # ------------------------------------------------------------------------- settings

    def _apply_settings(self, object settings):
        """Take max_split_size, rounding, GC and expandable settings from a config object.

        `settings` has the attributes of pyalloc.config.AllocatorConfig (bytes, floats, bools).
        Values are validated by the config parser; they are checked again here only for type.
        """
        cdef size_t max_split = settings.max_split_size
        cdef size_t non_split = settings.max_non_split_rounding_size
        cdef double gc = settings.garbage_collection_threshold
        divisions = list(settings.roundup_power2_divisions)
        if len(divisions) != 16:
            raise ValueError(f"roundup_power2_divisions needs 16 buckets, got {len(divisions)}")
        cdef size_t[16] divs
        for i in range(16):
            divs[i] = divisions[i]
        cdef bint expandable = settings.expandable_segments
        cdef bint recycle = getattr(settings, "recycle_pages", False)
        cdef bint release_lock = getattr(settings, "release_lock_on_cudamalloc", False)
        cdef bint graph_reuse = getattr(settings, "graph_capture_record_stream_reuse", False)
        cdef bint graph_last_use = getattr(settings, "graph_capture_last_use_marks", False)
        cdef bint graph_cross = getattr(settings, "graph_capture_cross_stream_reuse", False)
        lock_allocator(self)
        self.st.settings.release_lock_on_malloc = release_lock
        self.st.settings.graph_reuse = graph_reuse
        self.st.settings.graph_last_use = graph_last_use
        self.st.settings.graph_cross_stream_reuse = graph_cross
        self.st.settings.max_split_size = max_split
        self.st.settings.max_non_split_rounding_size = non_split
        self.st.settings.gc_threshold = gc
        for i in range(16):
            self.st.settings.roundup_divisions[i] = divs[i]
        self.st.settings.expandable_segments = expandable
        self.st.settings.recycle_pages = recycle and expandable
        self.mutex.unlock()

    def _init_stat_max_split_size(self):
        # PyTorch reports max_split_size as it was when the device allocator was created.
        self.st.stat_max_split_size = self.st.settings.max_split_size

    def set_memory_fraction(self, fraction):
        """Cap this allocator's reserved memory at `fraction` (0.0 .. 1.0) of the device's total.

        1.0 removes the cap; 0.0 (or any fraction of less than a byte) allows no device memory:
        every new segment is out of memory, cached blocks still serve. The cap counts only
        segments of this allocator (not the CUDA context).
        """
        if type(fraction) is not float and not isinstance(fraction, (int,)) or isinstance(fraction, bool):
            raise TypeError(f"fraction must be a float in [0, 1], got {type(fraction).__name__} {fraction!r}")
        cdef double f = fraction
        if not (0.0 <= f <= 1.0):
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        cdef size_t free_bytes, total_bytes
        lock_allocator(self)
        try:
            self.backend.memory_info(&free_bytes, &total_bytes)
            self.st.settings.memory_fraction = f
            self.st.settings.allowed_memory_maximum = (<size_t>(f * <double>total_bytes) if f < 1.0
                                                       else kSizeMax)
        finally:
            self.mutex.unlock()

    def get_memory_fraction(self):
        """The fraction last set with set_memory_fraction (1.0 when none)."""
        return self.st.settings.memory_fraction

    def round_size(self, size):
        """The block size (bytes) a request of `size` bytes is rounded to under current settings."""
        return round_size(&self.st.settings, request_size(size))

    # ------------------------------------------------------------------------- malloc / free

    def malloc(self, nbytes, stream=0):
        """Allocate `nbytes` bytes for use on `stream`; returns the device pointer (0 for 0 bytes).

        Raises OutOfMemoryError when neither the cache nor the device can provide the memory,
        TypeError/ValueError for a bad size or stream (state unchanged).
        """
        cdef uintptr_t s = stream_handle(stream)
        cdef size_t size = request_size(nbytes)
        # Kept before the allocation: keeping a new stream may let go of dropped ones, which makes
        # driver calls; should one fail, nothing is allocated yet. (After an out-of-memory error
        # the object stays kept until empty_cache, or until the program drops it.) A 0-byte
        # request allocates nothing, so it keeps nothing: record_stream validates a stream so.
        if size != 0 and type(stream) is not int and s != 0 and stream is not None:
            self.keep_allocation_stream(s, stream)
        cdef Block* b = allocate_block(self, size, s)
        if b == NULL:
            return 0
        return address_object(b)

    def hold_stream(self, stream, stream_object):
        """Keep `stream_object` (the stream whose handle is `stream`, an int) alive while this
        allocator holds blocks of that stream, as malloc does for a stream object: for hooks
        that allocate with handles they worked out themselves. Released by empty_cache once no
        block of the stream is left, or once only the allocator holds the object and the work
        queued on the stream is done. Stream 0 is never held."""
        self.keep_allocation_stream(stream_handle(stream), stream_object)

    def free(self, ptr):
        """Return the memory at `ptr` (from malloc) to the cache. free(0) does nothing.

        Raises NotAllocatedError for a pointer this allocator did not hand out, AlreadyFreedError
        for one it already freed (both are PointerError, a ValueError).
        """
        self.free_pointer(device_pointer(ptr))

    cdef int free_pointer(self, uintptr_t ptr) except -1:
        """free() of a pointer already read into C (free, and the framework hooks of _hooks)."""
        release_pointer(self, ptr)
        if self.stream_pins:
            prune_stream_pins(self)
        return 0

    def record_stream(self, ptr, stream, last_use=False):
        """Declare that the memory at `ptr` is also used on `stream`.

        When it is freed, it is not reused until the work queued on `stream` up to the free has
        completed. Using the allocation stream itself is a no-op, as is ptr 0.

        A stream object (not an int handle) is kept alive by the allocator until the block's free
        has recorded its event there: CuPy destroys a stream when its object dies, and recording
        on a destroyed stream's handle crashes the driver (or, once the handle is handed to a new
        stream, waits on the wrong work). The reference is dropped at the next record_stream,
        free, process_events or empty_cache after that. An int handle must stay valid until the
        free, as with PyTorch's ExternalStream.

        last_use=True, during a CUDA-graph capture, also says that the work captured on `stream`
        so far is the block's last use there: with graph_capture_last_use_marks:True (a pyalloc
        option), the block's free marker for `stream` is the stream's terminals now, not at the
        free, so work captured on `stream` after this call does not delay its reuse. Outside a
        capture it changes nothing.
        """
        cdef uintptr_t p = device_pointer(ptr)
        cdef uintptr_t s = stream_handle(stream)
        if p == 0:
            return
        if last_use is not True and last_use is not False:
            raise TypeError(f"last_use must be True or False, got {type(last_use).__name__} {last_use!r}")
        cdef Block* b
        cdef int use
        cdef bint pin = False
        cdef bint is_object = type(stream) is not int and stream is not None
        lock_allocator(self)
        try:
            b = lookup_allocated(self, p)
            use = stream_use_state(self, b, s)
            if use != USE_KNOWN:
                if not self.backend.stream_alive(s):
                    raise ValueError(f"stream {s} was destroyed: record_stream needs a live stream "
                                     f"(the block's free records an event there)")
                if use == USE_NEEDS_MEMORY:
                    make_room_for_use(self, b, s)
                add_stream_use(self, b, s)
                pin = is_object
                if self.capture_routes:
                    mark_captured_use(self, b, s)
            elif self.capture_routes or not self.capture_uses.empty():
                unmark_real_use(self, b, s)
            if self.capture_routes:
                if last_use:
                    mark_last_use(self, b, s)
                elif not self.capture_uses.empty():
                    forget_last_use(self, b, s)
        finally:
            self.mutex.unlock()
        if pin:
            with self.pins_lock:
                self.stream_pins[s] = stream
                # Its use may be over already (another thread freed the block meanwhile, before
                # the pin existed): the next prune checks it.
                lock_allocator(self)
                self.pins_to_check.push_back(s)
                self.mutex.unlock()
        if self.stream_pins:
            prune_stream_pins(self)

    def empty_cache(self, mempool_id=None):
        """Release cached segments that hold no live block back to the device.

        With no id: every unsplit cached segment of the default pools (skipped, without an error,
        while any route into a private pool is active, as PyTorch since #158152) and of every
        freeable private pool. With a private pool's id: that pool's, if it is freeable.
        Idle cross-stream events (the event pool) are destroyed too; PyTorch keeps them.
        """
        cdef MempoolId pid
        cdef bint one_pool = mempool_id is not None and tuple(mempool_id) != (0, 0)
        if one_pool:
            pid = pool_id_of(tuple(mempool_id))
        lock_allocator(self)
        try:
            if one_pool:
                release_private_pools(self, True, pid)
            else:
                release_cached_blocks(self)
            destroy_events(self, False)
        finally:
            self.mutex.unlock()
        if self.allocation_stream_objects:
            release_allocation_streams(self)
        if self.stream_pins:
            prune_stream_pins(self)

    def process_events(self):
        """Poll outstanding cross-stream events now (malloc does this on its own), and let go of
        the allocation streams the program has dropped whose work is done.

        While a capture routes allocations to a private pool, it polls nothing (an event query
        then invalidates the capture in CUDA's global and thread-local modes); while any route is
        active, blocks freed meanwhile stay deferred (a capture's graph may still use them)."""
        lock_allocator(self)
        try:
            if not self.capture_routes:
                process_events(self)
        finally:
            self.mutex.unlock()
        if self.stream_pins:
            prune_stream_pins(self)
        if self.allocation_stream_objects:
            reap_dropped_streams(self)

    def _lock_held(self):
        """Whether any thread holds this allocator's lock now (for tests)."""
        return self.mutex.held()

    def _dry_release_bytes(self, nbytes, stream=0):
        """The dry run of the release ladder for a malloc of `nbytes` on `stream` now: the bytes
        of device memory it would give back (for tests; replay calls it from C)."""
        cdef size_t size = request_size(nbytes)
        cdef uintptr_t s = stream_handle(stream)
        lock_allocator(self)
        try:
            return policy_release_bytes(self, size, s)
        finally:
            self.mutex.unlock()

    def _stream_pin_handles(self):
        """The handles of the stream objects record_stream keeps alive now (for tests)."""
        with self.pins_lock:
            return set(self.stream_pins)

    def _outstanding_events(self):
        """Events that freed blocks wait on (for tests; while any, C callers take the slow path)."""
        return self.outstanding_events

    def _noop(self):
        """An empty method: the call-overhead floor the benchmarks compare against."""
        pass

    def _noop_malloc(self, nbytes, stream=0):
        """An empty method with malloc's signature: the floor for a call of that shape."""
        pass

    def _noop_free(self, ptr):
        """An empty method with free's signature."""
        pass

    # ------------------------------------------------------------------------- private pools

    def _create_or_incref_pool(self, pool_id, use_on_oom=None, no_split=None):
        """Create private pool `pool_id` (use count 1) or add a use to it; optionally set its
        use_on_oom / no_split flags. Returns the use count."""
        cdef MempoolId pid = pool_id_of(pool_id)
        if pid.first == 0 and pid.second == 0:
            raise ValueError("mempool_id (0, 0) is the default pool, not a private pool")
        cdef PrivatePool* pool
        lock_allocator(self)
        try:
            pool = create_or_incref_pool(self, pid)
            if use_on_oom is not None:
                pool.use_on_oom = bool(use_on_oom)
            if no_split is not None:
                pool.no_split = bool(no_split)
            return pool.use_count
        finally:
            self.mutex.unlock()

    def _set_pool_use_on_oom(self, pool_id, bint use_on_oom):
        """Set a live pool's use_on_oom flag; no effect on a pool that no longer exists."""
        cdef MempoolId pid = pool_id_of(pool_id)
        lock_allocator(self)
        it = self.graph_pools.find(pid)
        if it != self.graph_pools.end():
            deref(it).second.use_on_oom = use_on_oom
        self.mutex.unlock()

    def begin_allocate_to_pool(self, pool_id, filter):
        """Route allocations that pass `filter` to private pool `pool_id` (created, or its use
        count increased) until end_allocate_to_pool(pool_id).

        `filter`: ("thread", key), with key = pyalloc._core.current_thread_key() of the thread to
        route, or ("capture", capture_id) for the streams of one stream capture. Routes nest:
        the newest whose filter accepts an allocation wins. RuntimeError if `pool_id` is routed
        already (PyTorch: "beginAllocateToPool: already recording to mempool_id").
        """
        cdef MempoolId pid = pool_id_of(pool_id)
        if pid.first == 0 and pid.second == 0:
            raise ValueError("mempool_id (0, 0) is the default pool, not a private pool")
        if (not isinstance(filter, tuple) or len(filter) != 2 or filter[0] not in ROUTE_FILTERS
                or type(filter[1]) is not int or filter[1] < 0):
            raise TypeError(f"filter must be ('thread', key) or ('capture', capture_id), got {filter!r}")
        cdef Route route
        route.id = pid
        route.kind = ROUTE_THREAD if filter[0] == "thread" else ROUTE_CAPTURE
        route.value = filter[1]
        lock_allocator(self)
        try:
            if find_route(self, pid) >= 0:
                    raise RuntimeError(
                        f"beginAllocateToPool: already recording to mempool_id {tuple(pool_id)}")
            route.pool = create_or_incref_pool(self, pid)
            route.seq = self.last_route_seq + 1
            self.captures_underway.push_back(route)
            self.last_route_seq = route.seq
            if route.kind == ROUTE_CAPTURE:
                self.capture_routes_by_seq[route.seq] = route
                self.capture_routes += 1
            else:
                self.thread_routes[route.value].push_back(route)
        finally:
            self.mutex.unlock()

    def end_allocate_to_pool(self, pool_id):
        """Stop routing allocations to `pool_id` (its use count is not changed: release_pool).

        RuntimeError if it is not routed (PyTorch: "endAllocatePool: not currently recording to
        mempool_id")."""
        cdef MempoolId pid = pool_id_of(pool_id)
        cdef Py_ssize_t i
        cdef Route route
        lock_allocator(self)
        try:
            i = find_route(self, pid)
            if i >= 0:
                route = self.captures_underway[i]
                if route.kind == ROUTE_CAPTURE:
                    # The capture is over: its reachability cache goes; blocks still deferred
                    # wait for the post-capture path (events once no route is active).
                    self.reuse_contexts.erase(route.value)
                    self.capture_routes -= 1
                    self.capture_routes_by_seq.erase(route.seq)
                else:
                    forget_thread_route(self, route)
                self.captures_underway.erase(self.captures_underway.begin() + i)
                if self.captures_underway.empty() and not self.deferred_blocks.empty():
                    # No route is left: deferred blocks get their events now (PyTorch does this
                    # at the next malloc), so the cache-hit path checks one counter, not two.
                    flush_deferred_blocks(self)
                if route.kind == ROUTE_CAPTURE and not self.capture_uses.empty():
                    end_capture_marks(self, route.value)
            else:
                raise RuntimeError(
                    f"endAllocatePool: not currently recording to mempool_id {tuple(pool_id)}")
        finally:
            self.mutex.unlock()

    def release_pool(self, pool_id):
        """Drop one use of private pool `pool_id`. At zero uses the pool is freeable: its cached
        blocks go back to the device at the next empty_cache (or OOM flush), and the pool itself
        once it holds no device memory. ValueError for an unknown or already released pool."""
        cdef MempoolId pid = pool_id_of(pool_id)
        lock_allocator(self)
        try:
            it = self.graph_pools.find(pid)
            if it == self.graph_pools.end() or deref(it).second.use_count <= 0:
                raise ValueError(f"mempool_id {tuple(pool_id)} is not a live private pool of this allocator")
            deref(it).second.use_count -= 1
        finally:
            self.mutex.unlock()

    def _pool_info(self, pool_id):
        """A private pool's state as a dict (use_count, device_allocations, reserved_bytes,
        use_on_oom, no_split, routed), or None when the allocator has no such pool."""
        cdef MempoolId pid = pool_id_of(pool_id)
        cdef PrivatePool* pool
        cdef bint found, routed = False
        cdef int use_count = 0
        cdef int64_t device_allocations = 0, reserved_bytes = 0
        cdef bint use_on_oom = False, no_split = False
        lock_allocator(self)        # copied under the lock, read after it (see copy_segments)
        it = self.graph_pools.find(pid)
        found = it != self.graph_pools.end()
        if found:
            pool = deref(it).second
            use_count = pool.use_count
            device_allocations = pool.device_allocations
            reserved_bytes = pool.reserved_bytes
            use_on_oom = pool.use_on_oom
            no_split = pool.no_split
            routed = find_route(self, pid) >= 0
        self.mutex.unlock()
        if not found:
            return None
        return {"use_count": use_count, "device_allocations": device_allocations,
                "reserved_bytes": reserved_bytes, "use_on_oom": use_on_oom,
                "no_split": no_split, "routed": routed}

    def _private_pool_ids(self):
        """Ids of every private pool the allocator holds, freeable ones included."""
        cdef pair[MempoolId, PrivatePool*] entry
        cdef vector[MempoolId] ids
        cdef MempoolId pid
        lock_allocator(self)        # copied under the lock, read after it (see copy_segments)
        for entry in self.graph_pools:
            ids.push_back(entry.first)
        self.mutex.unlock()
        return [(pid.first, pid.second) for pid in ids]

    def _capture_stats(self):
        """Counters of the in-capture reuse walk: nodes_expanded (graph nodes whose parents were
        asked for, over the allocator's life), deferred_blocks (blocks waiting now)."""
        return {"nodes_expanded": self.nodes_expanded,
                "deferred_blocks": self.deferred_blocks.size() - self.deferred_released}

    def private_pool_bytes(self):
        """(reserved, cached): bytes of device memory held by private pools, and of those the
        bytes in cached free blocks (what the OOM message reports as "in private pools")."""
        lock_allocator(self)
        try:
            return private_reserved(self), private_cached(self)
        finally:
            self.mutex.unlock()

    # ------------------------------------------------------------------------- expandable segments

    def expandable_segment_sizes(self):
        """One (stream, is_small_pool, mapped_bytes) per live expandable segment, default stream
        included (PyTorch's getExpandableSegmentSizes skips it). Bytes are currently mapped bytes."""
        cdef vector[uintptr_t] streams
        cdef vector[size_t] mapped
        cdef vector[int] small
        cdef size_t i
        lock_allocator(self)        # copied under the lock, read after it (see copy_segments)
        for seg in self.st.expandable_segments:
            streams.push_back(seg.stream)
            small.push_back(seg.pool.is_small)
            mapped.push_back(seg.mapped)
        self.mutex.unlock()
        return [(streams[i], bool(small[i]), mapped[i]) for i in range(streams.size())]

    def warm_up(self, sizes):
        """Map memory ahead of time: `sizes` is a list like expandable_segment_sizes() returns.

        For each (stream, is_small_pool, nbytes), the stream's expandable segment of that pool is
        grown until it has nbytes mapped, so a steady state that needs no more makes no map call.
        Needs expandable_segments:True. Raises OutOfMemoryError when the device cannot back it.
        """
        if not self.st.settings.expandable_segments:
            raise RuntimeError("warm_up needs expandable segments: configure expandable_segments:True")
        plan = []
        for entry in sizes:
            try:
                stream, is_small, nbytes = entry
            except (TypeError, ValueError):
                raise TypeError(f"warm_up expects (stream, is_small_pool, bytes) tuples, got {entry!r}") from None
            plan.append((stream_handle(stream), bool(is_small), request_size(nbytes)))
        cdef Block* b
        cdef BlockPool* pool
        cdef size_t have
        for stream, is_small, nbytes in plan:
            pool = self.small_blocks if is_small else self.large_blocks
            lock_allocator(self)
            try:
                have = mapped_bytes(&self.st, pool, stream)
                rc = 0
                if nbytes > have:
                    rc = try_allocate_expandable_block(&self.st, self.backend, pool, stream,
                                                       nbytes - have, self.capture_routes == 0, &b)
                    if rc == BACKEND_OOM:
                        record_oom(self, nbytes - have, nbytes - have, stream, 0)
                    else:
                        pool.blocks.insert(b)
            finally:
                self.mutex.unlock()
            if rc == BACKEND_OOM:
                raise_out_of_memory(self, nbytes - have)

    # ------------------------------------------------------------------------- stats

    def memory_stats(self):
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
        lock_allocator(self)
        for k in range(NUM_STATS):
            stats[k] = self.st.stats[k]
        oversize[0] = self.st.oversize_allocations
        oversize[1] = self.st.oversize_segments
        counters[0] = self.st.num_alloc_retries
        counters[1] = self.st.num_ooms
        counters[2] = self.st.num_sync_all_streams
        counters[3] = self.st.num_device_alloc
        counters[4] = self.st.num_device_free
        max_split = self.st.stat_max_split_size
        cdef bint recycle = self.st.settings.recycle_pages
        cdef int64_t pool_bytes = 0, remaps = 0
        page_pool_counts(&self.st, &pool_bytes, &remaps)
        self.mutex.unlock()
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

    def memory_allocated(self):
        """Bytes in blocks handed out and not freed (allocated_bytes.all.current)."""
        return self.st.stats[ST_ALLOCATED_BYTES].all_current

    def memory_reserved(self):
        """Bytes in segments held from the device (reserved_bytes.all.current)."""
        return self.st.stats[ST_RESERVED_BYTES].all_current

    def max_memory_allocated(self):
        """Peak of memory_allocated() since creation or the last reset_peak_memory_stats()."""
        return self.st.stats[ST_ALLOCATED_BYTES].all_peak

    def max_memory_reserved(self):
        """Peak of memory_reserved() since creation or the last reset_peak_memory_stats()."""
        return self.st.stats[ST_RESERVED_BYTES].all_peak

    def reset_peak_memory_stats(self):
        """Set every statistic's peak to its current value."""
        lock_allocator(self)
        for k in range(NUM_STATS):
            stat_reset_peak(&self.st.stats[k])
        self.st.oversize_allocations.peak = self.st.oversize_allocations.current
        self.st.oversize_segments.peak = self.st.oversize_segments.current
        self.mutex.unlock()

    def reset_accumulated_memory_stats(self):
        """Zero the cumulative allocated/freed counts and the retry/OOM/sync/device counters."""
        lock_allocator(self)
        for k in range(NUM_STATS):
            stat_reset_accumulated(&self.st.stats[k])
        single_reset_accumulated(&self.st.oversize_allocations)
        single_reset_accumulated(&self.st.oversize_segments)
        self.st.num_alloc_retries = 0
        self.st.num_ooms = 0
        self.st.num_sync_all_streams = 0
        self.st.num_device_alloc = 0
        self.st.num_device_free = 0
        self.mutex.unlock()

    # ------------------------------------------------------------------------- introspection

    def _segments(self):
        """The segments as lists of blocks, sorted by address, for snapshots and checks.

        Each segment is a dict: address, total_size, stream, is_small, is_expandable, pool_id
        (the owning pool's id, (0, 0) for the default pools), context_id and blocks; each block a
        dict: address, size, requested_size, allocated, pending_free (freed, waiting for events),
        metadata_id, context_id.
        """
        cdef vector[BlockCopy] copies
        cdef BlockCopy c
        segments = []
        lock_allocator(self)
        copy_segments(self, &copies)
        self.mutex.unlock()
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

    def _set_history(self, bint enabled, size_t max_entries, uint32_t skip_mask, bint clear):
        """Switch the trace ring buffer on/off; turning it off clears it (PyTorch's semantics).

        While on, `clear` empties it, and a new `max_entries` keeps the newest entries that fit
        (PyTorch leaves a resized buffer out of order; keeping the newest is what a user wants).
        """
        if enabled and max_entries == 0:
            raise ValueError("max_entries must be >= 1 while history is on, got 0")
        cdef vector[TraceEntry] kept
        cdef size_t n, start, i
        cdef uint64_t total
        lock_allocator(self)
        try:
            if not enabled:
                self.st.history.reset(0)
            elif clear or not self.st.history_on:
                self.st.history.reset(max_entries)
            elif self.st.history.capacity != max_entries:
                n = self.st.history.entries.size()
                start = n - max_entries if n > max_entries else 0
                for i in range(start, n):
                    kept.push_back(self.st.history.at(i))
                total = self.st.history.total
                self.st.history.reset(max_entries)
                for i in range(kept.size()):
                    self.st.history.push(kept[i])
                self.st.history.total = total
            self.st.history_on = enabled
            self.st.skip_actions_mask = skip_mask
        finally:
            self.mutex.unlock()

    def _history_entries(self):
        """Trace entries oldest first as tuples
        (action, addr, size, stream, time_us, metadata_id, context_id), and the number dropped
        because the ring buffer wrapped."""
        cdef vector[TraceEntry] entries
        cdef TraceEntry e
        cdef size_t n, i
        cdef uint64_t dropped
        lock_allocator(self)        # copied under the lock, read after it (see copy_segments)
        n = self.st.history.entries.size()
        entries.reserve(n)
        for i in range(n):
            entries.push_back(self.st.history.at(i))
        dropped = self.st.history.total - n
        self.mutex.unlock()
        out = []
        for e in entries:
            out.append((TRACE_ACTIONS[e.action], e.addr, e.size, e.stream, e.time_us,
                        e.metadata_id, e.context_id))
        return out, dropped

    def _live_bytes_by_metadata(self, bint requested):
        """{metadata_id: bytes} over allocated blocks: block sizes, or requested sizes if `requested`.

        Blocks freed but waiting for stream events are not counted (the caller gave them up).
        """
        cdef vector[Block*] blocks
        cdef Block* b
        cdef unordered_map[uint32_t, size_t] sums
        lock_allocator(self)
        try:
            self.active_blocks.values(&blocks)
            for b in blocks:
                if b.allocated:
                    sums[b.metadata_id] += b.requested_size if requested else b.size
        finally:
            self.mutex.unlock()
        return {p.first: p.second for p in sums}

    def _record_snapshot_entry(self):
        """Add a `snapshot` trace entry (addr 0, size = active bytes), as taking a snapshot does."""
        lock_allocator(self)
        trace(&self.st, TR_SNAPSHOT, 0, self.st.stats[ST_ACTIVE_BYTES].all_current, 0, 0)
        self.mutex.unlock()

    def _check_invariants(self):
        """Recount every block and compare with the links, pools and statistics.

        Raises AssertionError naming the first broken invariant. For tests; O(blocks).
        The cyclic collector is paused meanwhile: the check builds Python objects under the lock,
        and a Buffer a collection freed there would change the blocks mid-count.
        """
        collecting = _gc.isenabled()
        _gc.disable()
        lock_allocator(self)
        try:
            check_invariants(self)
        finally:
            self.mutex.unlock()
            if collecting:
                _gc.enable()


# ------------------------------------------------------------------------------- garbage collection
#
# When the collector takes an allocator together with Buffers (a Buffer reachable from the
# allocator's observers, recorder or attributes, or any cycle still alive at interpreter exit),
# it clears the objects of the garbage in any order and frees each Buffer once its last
# reference goes, possibly after the allocator was cleared. So the allocator's tp_clear drops
# only the references a user can add (the OOM observers and the context recorder, which breaks
# every cycle through them) and keeps the backend: a Buffer freed later still frees through it.
# (A subclass's tp_clear clears its __dict__ first and then calls this one.)

cdef extern from *:
    """
    static void pyalloc_set_tp_clear(PyObject* type, inquiry clear) {
        ((PyTypeObject*)type)->tp_clear = clear;
    }
    """
    ctypedef int (*tp_clear_fn "inquiry")(PyObject*) noexcept
    void pyalloc_set_tp_clear(PyObject* type, tp_clear_fn clear)


# Whether the cyclic collector is running (set by a gc.callbacks entry; collections at
# interpreter exit run no callbacks, and pyalloc_is_finalizing() covers those).
cdef bint gc_collecting = False


def _note_gc_phase(phase, info):
    global gc_collecting
    gc_collecting = phase == "start"


import gc as _gc
_gc.callbacks.append(_note_gc_phase)


cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #define pyalloc_is_finalizing() Py_IsFinalizing()
    #else
    #define pyalloc_is_finalizing() _Py_IsFinalizing()
    #endif
    """
    bint pyalloc_is_finalizing() noexcept


cdef int clear_allocator(PyObject* o) noexcept:
    cdef DeviceCachingAllocator a = <DeviceCachingAllocator><object>o
    a.capture_alloc_stacks = False      # nothing left to record stacks with
    a.capture_free_stacks = False
    a.context_recorder = None
    a.oom_observers = None
    return 0


pyalloc_set_tp_clear(<PyObject*>DeviceCachingAllocator, clear_allocator)


# ------------------------------------------------------------------------------- stream uses
#
# record_stream's rule, once for the Python method and the C entry points: a block's stream uses
# are the streams other than its own that it was declared used on, each once, and every use is
# counted per stream (stream_use_counts), which is what keeps a record_stream pin alive.

cdef enum:
    USE_KNOWN = 0            # b's own stream, or a use already recorded: nothing to do
    USE_NEW = 1              # a new use; recording it allocates nothing
    USE_NEEDS_MEMORY = 2     # a new use whose recording may allocate (a C caller defers it)


cdef inline int stream_use_state(DeviceCachingAllocator a, Block* b, uintptr_t stream) noexcept nogil:
    cdef uintptr_t used
    if stream == b.stream:
        return USE_KNOWN
    for used in b.stream_uses:
        if used == stream:
            return USE_KNOWN
    if b.stream_uses.size() == b.stream_uses.capacity() or a.stream_use_counts.count(stream) == 0:
        return USE_NEEDS_MEMORY
    return USE_NEW


cdef inline void add_stream_use(DeviceCachingAllocator a, Block* b, uintptr_t stream) noexcept nogil:
    """Record a new use for which there is room (stream_use_state said USE_NEW, or
    make_room_for_use ran): allocates nothing, so it cannot fail."""
    b.stream_uses.push_back(stream)
    a.stream_use_counts[stream] += 1


cdef int make_room_for_use(DeviceCachingAllocator a, Block* b, uintptr_t stream) except -1:
    """What a USE_NEEDS_MEMORY use needs before add_stream_use: MemoryError, nothing changed but
    spare capacity, when it cannot be had."""
    b.stream_uses.reserve(b.stream_uses.size() + 1)
    a.stream_use_counts.insert(pair[uintptr_t, size_t](stream, 0))
    return 0


# ------------------------------------------------------------------------------- the cache-hit path
#
# malloc: allocate_block -> try_allocate -> allocator_malloc -> (get_pool, get_free_block,
# take_block, commit_alloc); free: release_pointer -> allocator_free -> (commit_free_requested,
# commit_free_completed). Everything else is the slow path below.

cdef inline Block* allocate_block(DeviceCachingAllocator a, size_t size, uintptr_t stream) except? NULL:
    """The block handed out for a validated request (NULL for 0 bytes); OutOfMemoryError."""
    cdef Block* b = NULL
    if try_allocate(a, size, stream, &b) == BACKEND_OOM:
        raise_out_of_memory(a, size)
    return b


cdef inline int try_allocate(DeviceCachingAllocator a, size_t size, uintptr_t stream,
                             Block** out) except -1:
    """0 with *out the block handed out for a validated request (NULL for 0 bytes), or
    BACKEND_OOM (nothing raised: callers with their own out-of-memory path skip a try)."""
    out[0] = NULL
    if size == 0:
        return 0
    cdef uint32_t context_id = 0
    if a.capture_alloc_stacks:
        context_id = a.context_recorder()
    cdef int rc
    lock_allocator(a)
    try:
        rc = allocator_malloc(a, size, stream, context_id, out)
    finally:
        a.mutex.unlock()
    return rc


cdef inline BlockPool* get_pool(DeviceCachingAllocator a, size_t size, uintptr_t stream) except NULL:
    """The pool a request of `size` rounded bytes on `stream` is served from."""
    cdef PrivatePool* private
    if not a.captures_underway.empty():
        private = routed_pool(a, stream)
        if private != NULL:
            return &private.small_blocks if is_small_request(size) else &private.large_blocks
    return a.small_blocks if is_small_request(size) else a.large_blocks


cdef inline int allocator_malloc(DeviceCachingAllocator a, size_t orig_size, uintptr_t stream,
                                 uint32_t context_id, Block** out) except -1:
    """Find or make a block for `orig_size` bytes on `stream`. Caller holds the lock.

    Returns 0 with *out set, or BACKEND_OOM with the oom_* figures set.
    """
    cdef size_t size = round_size(&a.st.settings, orig_size)
    cdef BlockPool* pool
    if a.captures_underway.empty():
        # (Blocks deferred while a route was active got their events when the last route ended.)
        if a.outstanding_events:
            process_events(a)
        pool = a.small_blocks if is_small_request(size) else a.large_blocks
    else:
        pool = get_pool(a, size, stream)
        if a.capture_routes and a.st.settings.graph_reuse and not a.deferred_blocks.empty():
            free_safe_blocks_in_capture(a, stream, pool, size)
    cdef Block* b = get_free_block(&a.st.settings, pool, stream, size)
    cdef int rc = 0
    if b == NULL:
        rc = malloc_slow(a, pool, orig_size, size, stream, context_id, out)
    else:
        out[0] = hand_out(a, take_block(&a.st, b, True, size), orig_size, context_id)
    if unlikely(a.reuse_checked) and rc == 0:
        # The sanitizer raises when the block may still be in use (the block stays handed out,
        # for the test that found it to look at).
        a.backend.check_handout(out[0].ptr, out[0].size, stream)
    return rc


cdef inline Block* hand_out(DeviceCachingAllocator a, Block* b, size_t orig_size,
                            uint32_t context_id) noexcept nogil:
    commit_alloc(&a.st, b, orig_size, pyalloc_metadata_now(), context_id)
    a.active_blocks.insert(b.ptr, b)
    return b


cdef inline int release_pointer(DeviceCachingAllocator a, uintptr_t p, bint by_buffer=False) except -1:
    """free for a validated pointer: the path shared by free() and Buffer (`by_buffer`: the
    Buffer that owns the block frees it)."""
    if p == 0:
        return 0
    cdef Block* b
    # The free call site is captured outside the lock (it runs Python), and only when history
    # asks for it (context="all"): one C test otherwise.
    cdef uint32_t context_id = 0
    if a.capture_free_stacks:
        context_id = a.context_recorder()
    lock_allocator(a)
    try:
        b = lookup_allocated(a, p)
        if unlikely(b.buffer_owned):
            free_owned_block(a, b, by_buffer, context_id)
        else:
            allocator_free(a, b, context_id)
    finally:
        a.mutex.unlock()
    return 0


cdef int free_owned_block(DeviceCachingAllocator a, Block* b, bint by_buffer,
                          uint32_t context_id) except -1:
    """Free a Buffer's block: only its Buffer may (a raw free would leave the Buffer to free
    whatever block sits at that address later). A failed free leaves the Buffer its owner."""
    if not by_buffer:
        raise OwnedByBufferError(f"pointer {b.ptr:#x} belongs to a pyalloc.Buffer: close the Buffer "
                                 f"(or drop it) instead of freeing its pointer", b.ptr)
    b.buffer_owned = False
    try:
        allocator_free(a, b, context_id)
    except BaseException:
        b.buffer_owned = True
        raise
    return 0


cdef inline Block* lookup_allocated(DeviceCachingAllocator a, uintptr_t ptr) except NULL:
    """The live block at `ptr`; ValueError for an unknown pointer or a double free."""
    cdef Block* b = a.active_blocks.get(ptr)
    if b != NULL and b.allocated:
        return b
    raise_not_allocated(a, ptr, b != NULL)     # out of line: keeps this path small enough to inline


cdef inline int allocator_free(DeviceCachingAllocator a, Block* b, uint32_t context_id) except -1:
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


cdef inline void free_unused_block(DeviceCachingAllocator a, Block* b, uint32_t context_id) noexcept nogil:
    """The free of a live block used on no other stream: back to its pool at once. The one copy
    of it, for free() and the C entry points' cache hit."""
    commit_free_requested(&a.st, b, context_id)
    a.active_blocks.erase(b.ptr)
    commit_free_completed(&a.st, b, context_id)


cdef inline void free_completed(DeviceCachingAllocator a, Block* b) noexcept:
    """The last event (or deferral) of a freed block is over."""
    if not a.capture_uses.empty():
        a.capture_uses.erase(b)
    a.active_blocks.erase(b.ptr)
    commit_free_completed(&a.st, b, 0)


cdef inline int release_pointer_in_dealloc(DeviceCachingAllocator a, uintptr_t p) except -1:
    """release_pointer for Buffer.__dealloc__: the block is freed whatever happens to the
    free-call stack.

    The stack is not recorded while the cyclic collector runs or the interpreter finalizes: the
    recorder is Python code that may itself be garbage the collector has already cleared
    (calling a cleared function crashes CPython), and the stack would only show where the
    collection happened to start. A recorder that fails otherwise costs the stack, not the free.
    """
    cdef uint32_t context_id = 0
    if a.capture_free_stacks and not gc_collecting and not pyalloc_is_finalizing():
        try:
            context_id = a.context_recorder()
        except Exception:
            context_id = 0
    lock_allocator(a)
    try:
        free_owned_block(a, lookup_allocated(a, p), True, context_id)
    finally:
        a.mutex.unlock()
    return 0


# ------------------------------------------------------------------------------- C callers' cache hits
#
# The cache-hit path again, for callers on any thread that may not hold the GIL (the C entry
# points below, which pyalloc._capi's table points at and PyTorch calls from autograd and
# data-loader threads). Each function serves only what needs no Python and no backend call;
# anything else answers "not served" with nothing changed, and the caller takes the GIL (without
# this lock) and runs the ordinary path above.

cdef extern from "Python.h":
    ctypedef struct PyThreadState
    int PyGILState_Check() nogil
    PyThreadState* PyEval_SaveThread() nogil
    void PyEval_RestoreThread(PyThreadState*) nogil


cdef inline void lock_from_any_thread(DeviceCachingAllocator a) noexcept nogil:
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


cdef inline bint needs_python(DeviceCachingAllocator a) noexcept nogil:
    # Events to poll (backend calls), routes into private pools (thread keys, capture queries),
    # history stacks (a Python recorder): the ordinary path handles them.
    return (a.outstanding_events != 0 or not a.captures_underway.empty()
            or a.capture_alloc_stacks or a.capture_free_stacks or a.reuse_checked)


cdef inline int malloc_cache_hit(DeviceCachingAllocator a, size_t size, uintptr_t stream,
                                 uintptr_t* out) noexcept nogil:
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
    b = hand_out(a, take_block(&a.st, b, True, rounded), size, 0)
    out[0] = b.ptr
    a.mutex.unlock()
    return 1


cdef inline int free_cache_hit(DeviceCachingAllocator a, uintptr_t ptr) noexcept nogil:
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


cdef inline int record_stream_cache_hit(DeviceCachingAllocator a, uintptr_t ptr, uintptr_t stream) noexcept nogil:
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


# ------------------------------------------------------------------------------- C entry points, fast half
#
# pyalloc._capi's table (pyalloc_capi.h) points its malloc, free and record_stream here, so that a
# C caller's cache hit is one call into this module with the cache hit inlined: crossing into
# another module costs an indirect call and another cache line or two on a path that, inside a
# framework's own work, runs with cold caches. What a cache hit cannot serve goes to _capi's slow
# half (the GIL, the ordinary path, errors kept per thread), which _capi registers at import.

cdef extern from "pyalloc_capi.h":
    int PYALLOC_OK

cdef extern from *:
    """
    #include <atomic>
    /* The default allocator of each device as the entry points read it without the GIL (acquire
       loads of pointers published with release stores by pyalloc._capi, which owns the
       references). */
    static std::atomic<PyObject*> pyalloc_entry_slots[PYALLOC_ENTRY_DEVICES];
    static inline PyObject* pyalloc_entry_slot_get(int d) {
        return pyalloc_entry_slots[d].load(std::memory_order_acquire);
    }
    static inline void pyalloc_entry_slot_set(int d, PyObject* a) {
        pyalloc_entry_slots[d].store(a, std::memory_order_release);
    }
    """
    PyObject* pyalloc_entry_slot_get(int d) noexcept nogil
    void pyalloc_entry_slot_set(int d, PyObject* a) noexcept nogil


cdef entry_malloc_fn malloc_slow_half = NULL
cdef entry_free_fn free_slow_half = NULL
cdef entry_record_stream_fn record_stream_slow_half = NULL


cdef void set_entry_slow_paths(entry_malloc_fn malloc_slow, entry_free_fn free_slow,
                               entry_record_stream_fn record_stream_slow) noexcept:
    global malloc_slow_half, free_slow_half, record_stream_slow_half
    malloc_slow_half = malloc_slow
    free_slow_half = free_slow
    record_stream_slow_half = record_stream_slow


cdef PyObject* entry_slot(int device) noexcept nogil:
    return pyalloc_entry_slot_get(device)


cdef void set_entry_slot(int device, PyObject* allocator) noexcept nogil:
    pyalloc_entry_slot_set(device, allocator)


cdef int entry_malloc(int device, size_t size, uintptr_t stream, uintptr_t* out) noexcept nogil:
    cdef PyObject* a
    out[0] = 0
    if unlikely(size == 0):
        return PYALLOC_OK
    if likely(0 <= device < PYALLOC_ENTRY_DEVICES and size < kMaxRequest):
        a = pyalloc_entry_slot_get(device)
        if likely(a != NULL and malloc_cache_hit(<DeviceCachingAllocator>a, size, stream, out)):
            return PYALLOC_OK
    return malloc_slow_half(device, size, stream, out)


cdef int entry_free(int device, uintptr_t ptr) noexcept nogil:
    cdef PyObject* a
    if unlikely(ptr == 0):
        return PYALLOC_OK
    if likely(0 <= device < PYALLOC_ENTRY_DEVICES):
        a = pyalloc_entry_slot_get(device)
        if likely(a != NULL and free_cache_hit(<DeviceCachingAllocator>a, ptr)):
            return PYALLOC_OK
    return free_slow_half(device, ptr)


cdef int entry_record_stream(int device, uintptr_t ptr, uintptr_t stream) noexcept nogil:
    cdef PyObject* a
    if ptr == 0:
        return PYALLOC_OK
    if 0 <= device < PYALLOC_ENTRY_DEVICES:
        a = pyalloc_entry_slot_get(device)
        if a != NULL and record_stream_cache_hit(<DeviceCachingAllocator>a, ptr, stream):
            return PYALLOC_OK
    return record_stream_slow_half(device, ptr, stream)


cdef Block* raise_not_allocated(DeviceCachingAllocator a, uintptr_t ptr, bint known) except NULL:
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


# ------------------------------------------------------------------------------- routing

cdef PrivatePool* routed_pool(DeviceCachingAllocator a, uintptr_t stream) except? NULL:
    """The pool of the newest route whose filter accepts an allocation on `stream` by this
    thread, or NULL (the default pools).

    This thread's newest route (thread_routes), unless a capture route newer than it accepts
    the stream's capture: the capture routes newer than it are tried newest first, and the
    stream's capture is asked for (once) only when there is one. Other threads' routes are not
    read, so the cost does not grow with how many are open."""
    cdef uint64_t me = thread_key_now()
    cdef uint64_t mine = 0                  # seq of this thread's newest route; 0: none
    cdef PrivatePool* pool = NULL
    cdef unsigned long long capture_id
    cdef vector[uintptr_t] terminals
    cdef int capturing = -1
    cdef unordered_map[uint64_t, vector[Route]].iterator own = a.thread_routes.find(me)
    if own != a.thread_routes.end():
        mine = deref(own).second.back().seq
        pool = deref(own).second.back().pool
    cdef cppmap[uint64_t, Route].reverse_iterator it = a.capture_routes_by_seq.rbegin()
    while it != a.capture_routes_by_seq.rend() and deref(it).first > mine:
        if capturing < 0:
            capturing = a.backend.capture_info(stream, &capture_id, &terminals)
        if capturing and capture_id == deref(it).second.value:
            return deref(it).second.pool
        inc(it)
    return pool


cdef void forget_thread_route(DeviceCachingAllocator a, Route route) noexcept:
    """Take thread route `route` (ended) out of thread_routes."""
    cdef unordered_map[uint64_t, vector[Route]].iterator own = a.thread_routes.find(route.value)
    if own == a.thread_routes.end():
        return
    cdef size_t i
    for i in range(deref(own).second.size()):
        if deref(own).second[i].seq == route.seq:
            deref(own).second.erase(deref(own).second.begin() + i)
            break
    if deref(own).second.empty():
        a.thread_routes.erase(own)


cdef Py_ssize_t find_route(DeviceCachingAllocator a, MempoolId pid) noexcept:
    """Index of the route into `pid` in captures_underway, or -1."""
    cdef size_t i
    for i in range(a.captures_underway.size()):
        if a.captures_underway[i].id == pid:
            return i
    return -1


cdef PrivatePool* create_or_incref_pool(DeviceCachingAllocator a, MempoolId pid) except NULL:
    it = a.graph_pools.find(pid)
    cdef PrivatePool* pool
    if it == a.graph_pools.end():
        pool = new PrivatePool(pid)
        a.graph_pools[pid] = pool
        return pool
    pool = deref(it).second
    if pool.use_count <= 0:
        # PyTorch asserts here; a freeable pool is brought back to life instead, which is what
        # a second MemPool with the id of a released one would expect.
        pool.use_count = 0
    pool.use_count += 1
    return pool


cdef size_t pool_free_bytes(BlockPool* pool) noexcept:
    cdef size_t total = 0
    cdef BlockSet.iterator it = pool.blocks.begin()
    while it != pool.blocks.end():
        total += deref(it).size
        inc(it)
    return total


cdef size_t private_cached(DeviceCachingAllocator a) noexcept:
    """Bytes in cached free blocks of private pools (PyTorch's "allocated in private pools")."""
    cdef size_t total = 0
    cdef pair[MempoolId, PrivatePool*] entry
    for entry in a.graph_pools:
        total += pool_free_bytes(&entry.second.small_blocks) + pool_free_bytes(&entry.second.large_blocks)
    return total


cdef size_t private_reserved(DeviceCachingAllocator a) noexcept:
    cdef size_t total = 0
    cdef pair[MempoolId, PrivatePool*] entry
    for entry in a.graph_pools:
        total += entry.second.reserved_bytes
    return total


# ------------------------------------------------------------------------------- graph capture
#
# While a capture route is active, a block freed with stream uses cannot wait for events (the work
# was only captured). It is deferred; with graph_capture_record_stream_reuse it gets free markers
# (the terminals of every stream that used it) and is reused in the capture once every marker
# precedes the allocating stream's terminals (_graphs.pyx). Otherwise, and for blocks whose markers
# are never covered, it waits until no route is active, when its captured-only stream uses are
# dropped and events are recorded for the rest.

cdef int defer_free(DeviceCachingAllocator a, Block* b) except -1:
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
        index_deferred(&a.reuse_contexts[capture_id].streams[b.stream], b, uses)
    return 0


cdef void index_deferred(StreamReuse* reuse, Block* b, CaptureUses* uses) noexcept:
    """File b under its first marker not yet known to precede its stream's terminals (from
    uses.next_marker on), or as ready when there is none."""
    cdef DeferredEntry entry = DeferredEntry(b, uses.defer_id)
    while uses.next_marker < uses.markers.size():
        if reuse.visited.count(uses.markers[uses.next_marker]) == 0:
            reuse.waiting[uses.markers[uses.next_marker]].push_back(entry)
            return
        uses.next_marker += 1
    reuse.ready.push_back(entry)


cdef inline CaptureUses* still_deferred(DeviceCachingAllocator a, DeferredEntry entry) noexcept:
    """The block's capture record when the entry is current (the block is still deferred from
    the same free), else NULL."""
    it = a.capture_uses.find(entry.first)
    if it == a.capture_uses.end() or deref(it).second.defer_id != entry.second:
        return NULL
    return &deref(it).second


cdef void release_deferred(DeviceCachingAllocator a, Block* b, CaptureUses* uses) noexcept:
    """Deferred block b is safe to reuse in the capture: out of deferred_blocks (its slot left
    NULL, compacted once half are) and back to its pool."""
    a.deferred_blocks[uses.deferred_index] = NULL
    a.deferred_released += 1
    a.deferred_marked -= 1
    forget_stream_uses(a, &b.stream_uses)
    free_completed(a, b)              # erases b's capture record
    if a.deferred_released * 2 > a.deferred_blocks.size():
        compact_deferred(a)


cdef void compact_deferred(DeviceCachingAllocator a) noexcept:
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


cdef bint free_markers(DeviceCachingAllocator a, Block* b, vector[uintptr_t]* markers,
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
        if not a.backend.capture_info(streams[i], &capture_id, &terminals):
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


cdef int mark_last_use(DeviceCachingAllocator a, Block* b, uintptr_t stream) except -1:
    """record_stream(..., last_use=True) during a capture: remember the stream's terminals now."""
    cdef vector[uintptr_t] terminals
    cdef unsigned long long capture_id = 0
    if not a.backend.capture_info(stream, &capture_id, &terminals):
        return 0
    cdef CaptureUses* uses = &a.capture_uses[b]
    cdef size_t j
    for j in range(uses.last_use.size()):
        if uses.last_use[j].first == stream:
            uses.last_use[j].second = terminals
            return 0
    uses.last_use.push_back(pair[uintptr_t, vector[uintptr_t]](stream, terminals))
    return 0


cdef void forget_last_use(DeviceCachingAllocator a, Block* b, uintptr_t stream) noexcept:
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


cdef inline bint reusable_on(DeviceCachingAllocator a, Block* b, uintptr_t stream,
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


cdef int free_safe_blocks_in_capture(DeviceCachingAllocator a, uintptr_t stream, BlockPool* pool,
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
    if not a.backend.capture_info(stream, &capture_id, &terminals) or terminals.empty():
        return 0
    cdef bint cross = a.st.settings.graph_cross_stream_reuse
    context = &a.reuse_contexts[capture_id]
    found = context.streams.find(stream)
    if found == context.streams.end() and not cross:
        return 0                      # no block of this stream waits in this capture
    cdef StreamReuse* reuse = &context.streams[stream]
    cdef vector[uintptr_t] added
    extend_ancestors(a.backend, &reuse.visited, terminals, &a.nodes_expanded, &added)
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
                index_deferred(reuse, entry.first, uses)
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
    cdef size_t max_split = a.st.settings.max_split_size
    for i in range(a.deferred_blocks.size()):
        b = a.deferred_blocks[i]
        if (b != NULL and b.stream != stream and b.pool == pool and b.size >= size
                and not (size < max_split and b.size >= max_split)
                and not (size >= max_split and b.size - size >= a.st.settings.max_non_split_rounding_size)
                and (best == NULL or b.size < best.size)
                and reusable_on(a, b, stream, private, True)
                and all_visited(&reuse.visited, a.capture_uses[b].markers)):
            best = b
    if best != NULL:
        forget_segment_stream(a, best.stream)
        a.segments_by_stream[stream] += 1
        best.stream = stream            # a whole segment moves to the stream that may use it
        release_deferred(a, best, &a.capture_uses[best])
    return 0


cdef int mark_captured_use(DeviceCachingAllocator a, Block* b, uintptr_t stream) except -1:
    """A new use of b on `stream` (record_stream, a capture route active): when the stream is
    capturing in a capture that a route sends to a private pool, only that captured work stands
    behind the use, so it is marked with the capture. A stream that is not capturing is doing
    real work, whose use must wait for an event like any other (PyTorch marks every use recorded
    while a capture is underway, on any stream: a difference)."""
    cdef unsigned long long capture_id = 0
    cdef vector[uintptr_t] terminals
    if not a.backend.capture_info(stream, &capture_id, &terminals) or not a.routes_capture(capture_id):
        return 0
    a.capture_uses[b].captured_uses.push_back(pair[uintptr_t, uint64_t](stream, capture_id))
    return 0


cdef int unmark_real_use(DeviceCachingAllocator a, Block* b, uintptr_t stream) except -1:
    """record_stream names a stream b already uses: while the stream is not capturing, that use is
    real now, whatever a capture marked before."""
    it = a.capture_uses.find(b)
    if it == a.capture_uses.end() or deref(it).second.captured_uses.empty():
        return 0
    cdef unsigned long long capture_id = 0
    cdef vector[uintptr_t] terminals
    if a.backend.capture_info(stream, &capture_id, &terminals):
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


cdef void end_capture_marks(DeviceCachingAllocator a, uint64_t capture_id) noexcept:
    """Capture `capture_id` is over (its flush, if any, has run): its marks end with it, so that a
    use the program makes of the block afterwards is never taken for captured work."""
    it = a.capture_uses.begin()
    while it != a.capture_uses.end():
        drop_marks(&deref(it).second.captured_uses, 0, capture_id)
        inc(it)


cdef void forget_capture_uses(DeviceCachingAllocator a, Block* b) noexcept:
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
    a.capture_uses.erase(it)


# ------------------------------------------------------------------------------- the slow path

cdef int malloc_slow(DeviceCachingAllocator a, BlockPool* pool, size_t orig_size, size_t size,
                     uintptr_t stream, uint32_t context_id, Block** out) except -1:
    """No cached block fits: PyTorch's ladder, from garbage collection to out of memory."""
    cdef size_t alloc_size = segment_size_for(size)
    cdef Block* b
    cdef bint routed = not a.captures_underway.empty()
    if gc_enabled(&a.st.settings):
        garbage_collect(a)
    if alloc_block(a, pool, stream, alloc_size, size, False, context_id, &b) == 0:
        return finish_new_block(a, b, orig_size, size, context_id, out)
    if pool.owner == NULL:
        b = mempool_fallback(a, stream, size)
        if b != NULL:
            out[0] = hand_out(a, take_block(&a.st, b, True, size), orig_size, context_id)
            return 0
    if (release_available_cached_blocks(a, pool, stream, size)
            and alloc_block(a, pool, stream, alloc_size, size, False, context_id, &b) == 0):
        return finish_new_block(a, b, orig_size, size, context_id, out)
    # The full flush waits for every stream's events and frees the default pools; with a route
    # active it is skipped (PyTorch: no flush inside use_mem_pool or a capture, #159674).
    if (not routed and release_cached_blocks(a) == 0
            and alloc_block(a, pool, stream, alloc_size, size, True, context_id, &b) == 0):
        return finish_new_block(a, b, orig_size, size, context_id, out)
    record_oom(a, alloc_size, size, stream, context_id)
    return BACKEND_OOM


cdef inline int finish_new_block(DeviceCachingAllocator a, Block* b, size_t orig_size, size_t size,
                                 uint32_t context_id, Block** out) except -1:
    if b.prev == NULL and not b.segment_context_id:
        b.segment_context_id = context_id
    out[0] = hand_out(a, take_block(&a.st, b, False, size), orig_size, context_id)
    return 0


cdef Block* mempool_fallback(DeviceCachingAllocator a, uintptr_t stream, size_t size) noexcept:
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


cdef int alloc_block(DeviceCachingAllocator a, BlockPool* pool, uintptr_t stream, size_t alloc_size,
                     size_t size, bint is_retry, uint32_t context_id, Block** out) except -1:
    """Get new device memory for a request of `size` rounded bytes: 0 and *out set (a free
    block out of any pool), or BACKEND_OOM.

    Ordinarily a new segment of `alloc_size` bytes; with expandable segments, pages mapped into
    the stream's expandable segment of `pool`.
    """
    if is_retry:
        a.st.num_alloc_retries += 1
    cdef size_t limit = a.st.settings.allowed_memory_maximum
    # (recycle_pages: the expandable growth checks the limit against the memory it creates)
    if (limit != kSizeMax and not a.st.settings.recycle_pages
            and a.st.total_allocated_memory + alloc_size > limit):
        return BACKEND_OOM
    if a.st.settings.expandable_segments:
        return try_allocate_expandable_block(&a.st, a.backend, pool, stream, size,
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
            rc = a.backend.segment_alloc(alloc_size, &ptr)
        finally:
            lock_allocator(a)
    else:
        rc = a.backend.segment_alloc(alloc_size, &ptr)
    if rc == BACKEND_OOM:
        return BACKEND_OOM
    cdef Block* b = new_block(&a.st, stream, alloc_size, pool, ptr)
    commit_segment_alloc(&a.st, b, context_id)
    a.segments_by_stream[stream] += 1
    out[0] = b
    return 0


cdef inline void forget_segment_stream(DeviceCachingAllocator a, uintptr_t stream) noexcept:
    """One segment of `stream` is gone (released, or moved to another stream)."""
    it = a.segments_by_stream.find(stream)
    if it == a.segments_by_stream.end():
        return
    if deref(it).second <= 1:
        a.segments_by_stream.erase(it)
    else:
        a.segments_by_stream[stream] = deref(it).second - 1


cdef int release_block(DeviceCachingAllocator a, Block* b) except -1:
    """Return the whole-segment free block `b` to the device."""
    a.backend.segment_free(b.ptr, b.size)
    commit_segment_free(&a.st, b)
    forget_segment_stream(a, b.stream)
    b.pool.blocks.erase(b)
    retire_block(&a.st, b)
    return 0


cdef int release_blocks(DeviceCachingAllocator a, BlockPool* pool) except -1:
    """Release every cached block of `pool` that is a whole segment, and unmap the whole free
    pages of expandable segments."""
    cdef BlockSet.iterator it = pool.blocks.begin()
    cdef Block* b
    cdef vector[Block*] to_unmap
    while it != pool.blocks.end():
        b = deref(it)
        inc(it)
        if b.expandable:
            # Unmapping changes the pool; collect first so the iteration stays valid.
            to_unmap.push_back(b)
        elif not b.is_split():
            release_block(a, b)
    for b in to_unmap:
        unmap_block(&a.st, a.backend, b)
    return 0


cdef int release_cached_blocks(DeviceCachingAllocator a) except -1:
    """PyTorch's release_cached_blocks({0, 0}): with no route active, wait for every event and
    release the default pools' unsplit cached segments; then release every freeable private pool.
    recycle_pages' page pool goes first (its pages are mapped nowhere: no capture uses them)."""
    release_page_pool(&a.st, a.backend)
    if a.captures_underway.empty():
        synchronize_and_free_events(a)
        release_blocks(a, a.large_blocks)
        release_blocks(a, a.small_blocks)
    cdef MempoolId none
    none.first = 0
    none.second = 0
    return release_private_pools(a, False, none)


cdef int release_private_pools(DeviceCachingAllocator a, bint only_one, MempoolId pid) except -1:
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
    if only_one and not freeable.empty() and a.captures_underway.empty():
        # Blocks of the pool may still wait for events (PyTorch syncs that pool's events).
        synchronize_and_free_events(a)
    for pool_id in freeable:
        pool = a.graph_pools[pool_id]
        release_blocks(a, &pool.large_blocks)
        release_blocks(a, &pool.small_blocks)
        if pool.device_allocations == 0:
            a.graph_pools.erase(pool_id)
            del pool
    return 0


cdef int release_available_cached_blocks(DeviceCachingAllocator a, BlockPool* pool, uintptr_t stream,
                                         size_t size) except -1:
    """Free cached oversize segments of `stream` worth at least max(size, max_split_size).

    Returns 1 when something was freed. Only meaningful when max_split_size is set.
    """
    cdef size_t max_split = a.st.settings.max_split_size
    if max_split == kSizeMax or a.capture_routes:
        # During a capture, freeing a segment would invalidate it: PyTorch does it anyway (#159594,
        # open in late 2025); pyalloc fails over to the out-of-memory error instead.
        return 0
    cdef size_t wanted = size if size > max_split else max_split      # bytes to free at least
    cdef BlockSet.iterator it = pool.blocks.lower_bound(stream, wanted)
    cdef BlockSet.iterator cur
    cdef size_t released = 0
    cdef bint is_first
    cdef Block* b
    if it == pool.blocks.end() or deref(it).stream != stream or deref(it).expandable:
        # No single block is big enough: free oversize blocks from the largest down.
        if it == pool.blocks.begin():
            return 0
        dec(it)
        while released < wanted and deref(it).size >= max_split and deref(it).stream == stream:
            cur = it
            is_first = cur == pool.blocks.begin()
            if not is_first:
                dec(it)
            b = deref(cur)
            if not b.expandable and not b.is_split():
                released += b.size
                release_block(a, b)
            if is_first:
                break
        return 1 if released >= wanted else 0
    b = deref(it)
    if b.is_split():
        return 0
    release_block(a, b)
    return 1


cdef int garbage_collect(DeviceCachingAllocator a) except -1:
    """Release aged unsplit cached segments of the default large pool beyond the GC threshold."""
    cdef size_t threshold_bytes = <size_t>(a.st.settings.gc_threshold
                                           * <double>a.st.settings.allowed_memory_maximum)
    if a.st.total_allocated_memory <= threshold_bytes or a.capture_routes:
        return 0
    cdef size_t target = a.st.total_allocated_memory - threshold_bytes
    cdef size_t reclaimed = 0
    cdef double total_age = 0.0
    cdef int64_t freeable = 0
    cdef BlockPool* pool = a.large_blocks
    cdef BlockSet.iterator it = pool.blocks.begin()
    cdef Block* b
    cdef double age_threshold, age
    while it != pool.blocks.end():
        b = deref(it)
        inc(it)
        if not b.is_split() and not b.expandable:
            total_age += <double>(pool.get_free_blocks_call_count - b.gc_count_base)
            freeable += 1
    cdef bint freed_some = True
    # Release blocks at least as old as the average, repeatedly; a pass does not stop at the
    # target, so that GC does not run again at the very next allocation.
    while reclaimed < target and freed_some and freeable > 0:
        age_threshold = total_age / <double>freeable
        freed_some = False
        it = pool.blocks.begin()
        while it != pool.blocks.end():
            b = deref(it)
            inc(it)
            if b.is_split() or b.expandable:
                continue
            age = <double>(pool.get_free_blocks_call_count - b.gc_count_base)
            if age >= age_threshold:
                freed_some = True
                reclaimed += b.size
                total_age -= age
                freeable -= 1
                release_block(a, b)
    return 0


# (cimports of the dry run below, kept beside it)
from libcpp.unordered_set cimport unordered_set
from pyalloc._types cimport ExpandableSegment, Settings


cdef size_t policy_release_bytes(DeviceCachingAllocator a, size_t orig_size,
                                 uintptr_t stream) except? 0:
    """Dry run of malloc's release ladder (malloc_slow) for `orig_size` bytes on `stream`, in the
    present state and under the present limit: the bytes of device memory that garbage
    collection, the max_split_size release and the full flush would give back before the request
    is served or runs out of memory. 0 when a cached block serves it, or new device memory comes
    without any release. Nothing changes (the GC clock included).

    For the replay (pyalloc._replay), which must tell the segment frees the policy makes inside a
    malloc from those of an empty_cache call. Approximations, all on the rare side: with a route
    active it answers 0 (no flush then, and private pools are left out); blocks awaiting events
    are not counted; expandable growth is taken to need the request rounded up to whole pages.
    """
    if orig_size == 0 or not a.captures_underway.empty():
        return 0
    cdef Settings* s = &a.st.settings
    cdef size_t size = round_size(s, orig_size)
    cdef BlockPool* pool = a.small_blocks if is_small_request(size) else a.large_blocks
    cdef size_t clock = pool.get_free_blocks_call_count
    cdef Block* hit = get_free_block(s, pool, stream, size)
    pool.get_free_blocks_call_count = clock             # a dry run: the GC clock stays
    if hit != NULL:
        return 0
    cdef size_t alloc_size = segment_size_for(size)
    # The device memory the request needs: a segment, or the pages the expandable segment's
    # growth maps now (the same walk as the real allocation). The steps that test it change no
    # expandable segment (GC and the max_split_size release skip them), and the full flush,
    # which does, is the last step: what it releases is released whether the retry fits or not.
    cdef size_t physical = (expandable_growth_bytes(&a.st, pool, stream, size) if s.expandable_segments
                            else alloc_size)
    cdef size_t free_bytes = 0, total_bytes = 0
    a.backend.memory_info(&free_bytes, &total_bytes)
    cdef size_t reserved = a.st.total_allocated_memory
    cdef size_t released = 0, threshold_bytes, target, reclaimed, large_clock, r, key_size
    cdef unordered_set[BlockPtr] gone
    cdef BlockSet.iterator it
    cdef Block* b
    cdef double total_age, age_threshold, age
    cdef int64_t freeable
    cdef bint freed_some
    cdef ExpandableSegment* seg
    cdef uintptr_t offset, first, last
    if gc_enabled(s):
        # garbage_collect, counting instead of freeing; the large pool's clock as it will be
        # after this malloc's get_free_block.
        threshold_bytes = <size_t>(s.gc_threshold * <double>s.allowed_memory_maximum)
        if reserved > threshold_bytes:
            target = reserved - threshold_bytes
            large_clock = a.large_blocks.get_free_blocks_call_count + (1 if pool == a.large_blocks else 0)
            reclaimed = 0
            total_age = 0.0
            freeable = 0
            it = a.large_blocks.blocks.begin()
            while it != a.large_blocks.blocks.end():
                b = deref(it)
                inc(it)
                if not b.is_split() and not b.expandable:
                    total_age += <double>(large_clock - b.gc_count_base)
                    freeable += 1
            freed_some = True
            while reclaimed < target and freed_some and freeable > 0:
                age_threshold = total_age / <double>freeable
                freed_some = False
                it = a.large_blocks.blocks.begin()
                while it != a.large_blocks.blocks.end():
                    b = deref(it)
                    inc(it)
                    if b.is_split() or b.expandable or gone.count(b):
                        continue
                    age = <double>(large_clock - b.gc_count_base)
                    if age >= age_threshold:
                        freed_some = True
                        reclaimed += b.size
                        total_age -= age
                        freeable -= 1
                        gone.insert(b)
            released += reclaimed
    if dry_alloc_fits(s, reserved - released, alloc_size, free_bytes + released, physical):
        return released
    if s.max_split_size != kSizeMax:
        # release_available_cached_blocks, counting instead of freeing.
        key_size = size if size > s.max_split_size else s.max_split_size
        it = pool.blocks.lower_bound(stream, key_size)
        while it != pool.blocks.end() and gone.count(deref(it)):
            inc(it)
        r = 0
        if it == pool.blocks.end() or deref(it).stream != stream or deref(it).expandable:
            while it != pool.blocks.begin():
                dec(it)
                b = deref(it)
                if r >= key_size or b.size < s.max_split_size or b.stream != stream:
                    break
                if not b.expandable and not b.is_split() and not gone.count(b):
                    r += b.size
                    gone.insert(b)
            released += r
            if r >= key_size and dry_alloc_fits(s, reserved - released, alloc_size,
                                                free_bytes + released, physical):
                return released
        elif not deref(it).is_split():
            released += deref(it).size
            gone.insert(deref(it))
            if dry_alloc_fits(s, reserved - released, alloc_size, free_bytes + released, physical):
                return released
    # release_cached_blocks: the page pool, every unsplit cached segment of the default pools,
    # and the whole pages inside free expandable blocks.
    released += page_pool_bytes(&a.st)
    cdef BlockPool* pools[2]
    pools[0] = a.large_blocks
    pools[1] = a.small_blocks
    for k in range(2):
        pool = pools[k]
        it = pool.blocks.begin()
        while it != pool.blocks.end():
            b = deref(it)
            inc(it)
            if b.expandable:
                seg = b.segment
                offset = b.ptr - seg.base
                first = seg.base + ((offset + seg.page_size - 1) // seg.page_size) * seg.page_size
                last = seg.base + ((offset + b.size) // seg.page_size) * seg.page_size
                if last > first:
                    released += last - first
            elif not b.is_split() and not gone.count(b):
                released += b.size
    return released


cdef inline bint dry_alloc_fits(Settings* s, size_t reserved, size_t alloc_size, size_t free_bytes,
                                size_t physical) noexcept:
    """Whether alloc_block would get `alloc_size` bytes with `reserved` bytes held and
    `free_bytes` free on the device (`physical`: the bytes the device must have free)."""
    if (s.allowed_memory_maximum != kSizeMax
            and reserved + (physical if s.recycle_pages else alloc_size) > s.allowed_memory_maximum):
        return False
    return physical <= free_bytes


cdef int release_cached_segment(DeviceCachingAllocator a, uintptr_t ptr, size_t size,
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


# ------------------------------------------------------------------------------- out of memory

cdef int record_oom(DeviceCachingAllocator a, size_t alloc_size, size_t rounded, uintptr_t stream,
                    uint32_t context_id) except -1:
    cdef size_t free_bytes = 0, total_bytes = 0
    a.backend.memory_info(&free_bytes, &total_bytes)
    # PyTorch's oom entry: device free bytes in addr, the rounded request (not the segment size)
    # in size, and the failing call's stream and stack.
    trace(&a.st, TR_OOM, free_bytes, rounded, stream, context_id)
    a.st.num_ooms += 1
    a.oom_alloc_size = alloc_size
    a.oom_free = free_bytes
    a.oom_total = total_bytes
    a.oom_private = private_cached(a)
    return 0


cdef raise_out_of_memory(DeviceCachingAllocator a, size_t requested):
    """Call the OOM observers, then raise OutOfMemoryError with PyTorch's figures (lock not held)."""
    allocated = a.st.stats[ST_ALLOCATED_BYTES].all_current
    reserved = a.st.stats[ST_RESERVED_BYTES].all_current
    private = a.oom_private
    capped = a.st.settings.allowed_memory_maximum != kSizeMax
    allowed = a.st.settings.allowed_memory_maximum if capped else None
    for observer in list(a.oom_observers or ()):      # None once the collector cleared it
        observer(a.backend.device, a.oom_alloc_size, allowed if capped else a.oom_total, a.oom_free)
    limit = f"{format_bytes(allowed)} allowed; " if capped else ""
    in_private = (f"with {format_bytes(private)} allocated in private pools (e.g., CUDA Graphs), "
                  if private else "")
    raise OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {format_bytes(a.oom_alloc_size)}. "
        f"GPU {a.backend.device} has a total capacity of {format_bytes(a.oom_total)} of which "
        f"{format_bytes(a.oom_free)} is free. {limit}Of the allocated memory "
        f"{format_bytes(allocated + private)} is allocated by pyalloc, {in_private}and "
        f"{format_bytes(reserved - allocated - private)} is reserved by pyalloc but unallocated. "
        "If reserved but unallocated memory is large try setting "
        "PYALLOC_CONF=expandable_segments:True (or PYTORCH_CUDA_ALLOC_CONF) to avoid "
        "fragmentation; `pyalloc tune` on a memory snapshot ranks every setting.",
        requested=requested, segment_size=a.oom_alloc_size, device=a.backend.device,
        total=a.oom_total, free=a.oom_free, allocated=allocated,
        reserved_unallocated=reserved - allocated - private, allowed=allowed)


# ------------------------------------------------------------------------------- events

cdef inline uintptr_t take_recorded_event(DeviceCachingAllocator a, uintptr_t stream) except? 0:
    """An idle event (made when none is pooled) recorded on `stream` now. As PyTorch, it is an
    event of the stream's own device: an event and a stream of different contexts cannot be
    recorded together. A failed record puts the event back and raises."""
    cdef uintptr_t event
    cdef int device = a.backend.stream_device(stream)
    if device != a.backend.device:
        event = take_foreign_event(a, device)
    elif a.event_pool.empty():
        a.backend.event_create(&event)
    else:
        event = a.event_pool.back()
        a.event_pool.pop_back()
    try:
        a.backend.event_record(event, stream)
    except BaseException:
        return_event(a, event)
        raise
    return event


cdef int insert_events(DeviceCachingAllocator a, Block* b) except -1:
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
    return 0


cdef int destroy_events(DeviceCachingAllocator a, bint outstanding) except -1:
    """Destroy the idle events of the event pool and, with `outstanding`, the events blocks still
    wait on (teardown only: those blocks are never freed then). An event whose destroy fails is
    not used again."""
    cdef uintptr_t event
    cdef EventQueues.iterator it
    if outstanding:
        for entry in a.retiring_streams:
            if entry.second != 0:
                a.foreign_event_devices.erase(entry.second)
                a.backend.event_destroy(entry.second)
        a.retiring_streams.clear()
        it = a.stream_events.begin()
        while it != a.stream_events.end():
            while not deref(it).second.empty():
                event = deref(it).second.front().first
                deref(it).second.pop_front()
                a.outstanding_events -= 1
                a.foreign_event_devices.erase(event)
                a.backend.event_destroy(event)
            it = a.stream_events.erase(it)
    while not a.event_pool.empty():
        event = a.event_pool.back()
        a.event_pool.pop_back()
        a.backend.event_destroy(event)
    cdef unordered_map[int, vector[uintptr_t]].iterator pool = a.foreign_event_pools.begin()
    while pool != a.foreign_event_pools.end():
        while not deref(pool).second.empty():
            event = deref(pool).second.back()
            deref(pool).second.pop_back()
            a.foreign_event_devices.erase(event)
            a.backend.event_destroy(event)
        pool = a.foreign_event_pools.erase(pool)
    return 0


cdef inline void forget_stream_use(DeviceCachingAllocator a, uintptr_t stream) noexcept:
    """One block stream use naming `stream` is over (its event is recorded, or it was dropped)."""
    it = a.stream_use_counts.find(stream)
    if it == a.stream_use_counts.end():
        return
    if deref(it).second <= 1:
        a.stream_use_counts.erase(it)
        if a.stream_pins:             # its pin (if any) may go now: the next prune checks it
            a.pins_to_check.push_back(stream)
    else:
        a.stream_use_counts[stream] = deref(it).second - 1


cdef void forget_stream_uses(DeviceCachingAllocator a, vector[uintptr_t]* streams) noexcept:
    """forget_stream_use for each of `streams`, which the caller then clears."""
    cdef uintptr_t s
    for s in deref(streams):
        forget_stream_use(a, s)
    streams.clear()


ctypedef int (*mark_unused_fn)(DeviceCachingAllocator, vector[uintptr_t]*, vector[char]*) except -1


cdef int drop_stream_objects(DeviceCachingAllocator a, dict objects, mark_unused_fn mark) except -1:
    """Drop the stream objects of `objects` (handle -> object: the allocation streams) that
    `mark` marks unused.

    The handles are read into C before the allocator's lock, `mark` runs under it, and the
    objects are dropped after it: no Python object is made or freed under the lock (dropping a
    CuPy stream destroys it, and a collection run there could re-enter the allocator)."""
    cdef vector[uintptr_t] c_handles
    cdef vector[char] unused
    cdef size_t i
    dropped = []
    with a.pins_lock:
        handles = list(objects)
        for h in handles:
            c_handles.push_back(<uintptr_t>h)
        unused.resize(c_handles.size(), 0)
        lock_allocator(a)
        try:
            mark(a, &c_handles, &unused)
        finally:
            a.mutex.unlock()
        for i in range(c_handles.size()):
            if unused[i]:
                dropped.append(objects.pop(handles[i], None))
    del dropped              # outside pins_lock: a stream's destructor may call back into pyalloc
    return 0


cdef int mark_streams_without_blocks(DeviceCachingAllocator a, vector[uintptr_t]* handles,
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


cdef int release_allocation_streams(DeviceCachingAllocator a) except -1:
    """Drop the allocation stream objects (keep_allocation_stream) of which no block is left."""
    return drop_stream_objects(a, a.allocation_stream_objects, mark_streams_without_blocks)


cdef extern from *:
    """
    static inline Py_ssize_t pyalloc_refcount(PyObject* o) { return Py_REFCNT(o); }
    """
    Py_ssize_t pyalloc_refcount(PyObject* o) noexcept


cdef inline void forget_retiring_stream(DeviceCachingAllocator a, uintptr_t h) noexcept:
    """Its object is let go another way (lock held): the event goes back to the pool."""
    cdef unordered_map[uintptr_t, uintptr_t].iterator it = a.retiring_streams.find(h)
    if it != a.retiring_streams.end():
        if deref(it).second != 0:
            return_event(a, deref(it).second)
        a.retiring_streams.erase(it)


cdef int reap_dropped_streams(DeviceCachingAllocator a) except -1:
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
    with a.pins_lock:
        objects = a.allocation_stream_objects
        pins = a.stream_pins
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
        lock_allocator(a)
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
                elif deref(it).second != 0 and a.backend.event_query(deref(it).second):
                    return_event(a, deref(it).second)
                    a.retiring_streams.erase(it)
                    a.allocation_streams_kept.erase(h)
                    finished.push_back(h)
        finally:
            a.mutex.unlock()
        for h in finished:
            dropped.append(objects.pop(h, None))
    del dropped              # outside pins_lock: a stream's destructor may call back into pyalloc
    return 0


cdef int prune_stream_pins(DeviceCachingAllocator a) except -1:
    """Drop the stream objects that no block stream use names any more.

    Only the handles of pins_to_check can have become unused since the last prune (a use count
    reached zero, or a pin was set), so only they are checked: a free or record_stream costs the
    same however many pins are alive. (The unlocked read of the list's size is a hint: a stale
    one leaves the check to the next prune, or takes the locks for nothing.)"""
    if a.pins_to_check.empty():
        return 0
    cdef vector[uintptr_t] handles, unused
    cdef uintptr_t h
    with a.pins_lock:
        lock_allocator(a)
        handles.swap(a.pins_to_check)
        for h in handles:
            if a.stream_use_counts.count(h) == 0:
                unused.push_back(h)
        a.mutex.unlock()
        dropped = [a.stream_pins.pop(h, None) for h in unused]
    del dropped              # outside pins_lock: a stream's destructor may call back into pyalloc
    return 0


cdef int flush_deferred_blocks(DeviceCachingAllocator a) except -1:
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


cdef int process_events(DeviceCachingAllocator a) except -1:
    """Free blocks whose events have all completed; polls each stream's events in order. Blocks
    deferred while a route is active stay deferred until no route is."""
    if not a.deferred_blocks.empty() and a.captures_underway.empty():
        flush_deferred_blocks(a)
    cdef EventQueues.iterator it = a.stream_events.begin()
    cdef EventEntry front
    while it != a.stream_events.end():
        while not deref(it).second.empty():
            front = deref(it).second.front()
            if not a.backend.event_query(front.first):
                break   # later events of this stream cannot be complete either
            deref(it).second.pop_front()
            event_done(a, front.first, front.second)
        if deref(it).second.empty():
            it = a.stream_events.erase(it)
        else:
            inc(it)
    return 0


cdef uintptr_t take_foreign_event(DeviceCachingAllocator a, int device) except? 0:
    """An idle event of device `device` (not this allocator's), made when none is pooled."""
    cdef uintptr_t event
    pool = a.foreign_event_pools.find(device)
    if pool != a.foreign_event_pools.end() and not deref(pool).second.empty():
        event = deref(pool).second.back()
        deref(pool).second.pop_back()
    else:
        a.backend.event_create_on(device, &event)
        a.foreign_event_devices[event] = device
    return event


cdef inline void return_event(DeviceCachingAllocator a, uintptr_t event) noexcept:
    """Put an idle event back in its device's pool."""
    if not a.foreign_event_devices.empty():
        it = a.foreign_event_devices.find(event)
        if it != a.foreign_event_devices.end():
            a.foreign_event_pools[deref(it).second].push_back(event)
            return
    a.event_pool.push_back(event)


cdef inline void event_done(DeviceCachingAllocator a, uintptr_t event, Block* b) noexcept:
    return_event(a, event)
    a.outstanding_events -= 1
    b.event_count -= 1
    if b.event_count == 0:
        free_completed(a, b)


cdef int synchronize_and_free_events(DeviceCachingAllocator a) except -1:
    """Wait for every outstanding event and free the blocks that were waiting on them."""
    a.st.num_sync_all_streams += 1
    if not a.deferred_blocks.empty():
        flush_deferred_blocks(a)
    cdef EventEntry front
    cdef EventQueues.iterator it = a.stream_events.begin()
    while it != a.stream_events.end():
        while not deref(it).second.empty():
            front = deref(it).second.front()
            a.backend.event_synchronize(front.first)
            deref(it).second.pop_front()
            event_done(a, front.first, front.second)
        it = a.stream_events.erase(it)
    return 0


# ------------------------------------------------------------------------------- introspection
#
# Readers copy what they report into C structs under the lock and build their Python objects
# after it. Building them under the lock let a collection run there, and a Buffer it freed
# re-entered free() on the same thread (the lock is recursive) and merged blocks mid-read: the
# snapshot's segments then did not tile.

cdef struct BlockCopy:
    uintptr_t ptr
    size_t size
    size_t requested_size
    uintptr_t stream
    MempoolId pool_id
    uint32_t metadata_id
    uint32_t context_id
    uint32_t segment_context_id
    bint allocated
    bint pending_free
    bint is_small
    bint expandable
    bint starts_segment        # the first block of a snapshot segment


cdef void copy_segments(DeviceCachingAllocator a, vector[BlockCopy]* out) noexcept:
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


cdef void collect_blocks(DeviceCachingAllocator a, vector[Block*]* out) noexcept:
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


cdef int check_invariants(DeviceCachingAllocator a) except -1:
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
    # Every pool's set must be in best-fit order with current keys (no stale entries), and every
    # private pool must know the bytes its segments hold.
    check_pool_order(a.small_blocks)
    check_pool_order(a.large_blocks)
    for entry in a.graph_pools:
        check_pool_order(&entry.second.small_blocks)
        check_pool_order(&entry.second.large_blocks)
        key = (entry.first.first, entry.first.second)
        assert entry.second.reserved_bytes == reserved_by_pool.get(key, 0), (
            f"private pool {key} counts {entry.second.reserved_bytes} reserved bytes, its "
            f"segments {reserved_by_pool.get(key, 0)}")
    return 0


# ------------------------------------------------------------------------------- Buffer

# no_gc_clear: when a Buffer is freed as part of a garbage cycle, the collector must not clear
# its allocator reference first, or __dealloc__ could not return the memory (it would leak).
@cython.no_gc_clear
@cython.auto_pickle(False)  # a pickled or copied Buffer would be a second owner of its block
@cython.freelist(64)        # one per CuPy allocation: reuse the object memory
cdef class Buffer:
    """Buffer(allocator, nbytes, stream=0)
--

    Device memory owned by a Python object: freed by close(), `with` exit or garbage collection.

    Attributes: ptr (device address), size (bytes requested), stream (handle), device (ordinal).

    A Buffer is the one owner of its block: it cannot be copied or pickled (TypeError), and
    __init__ runs once (RuntimeError on a second call, which leaves the Buffer as it was).
    """
    # (attributes declared in _core.pxd)

    def __init__(self, DeviceCachingAllocator allocator not None, nbytes, stream=0):
        if self.allocator is not None:
            # Refused rather than freeing the first block: whoever holds its pointer (a CuPy
            # array, a kernel argument) would then use freed memory without being told.
            raise RuntimeError(
                f"Buffer.__init__ runs once: this Buffer already owns {self.size} bytes at "
                f"{self.ptr:#x}; make a new Buffer instead")
        cdef size_t size = request_size(nbytes)
        cdef uintptr_t handle = stream_handle(stream)
        if size != 0 and type(stream) is not int and handle != 0 and stream is not None:
            allocator.keep_allocation_stream(handle, stream)     # before: as malloc does
        cdef Block* b = allocate_block(allocator, size, handle)
        if b != NULL:
            lock_allocator(allocator)
            b.buffer_owned = True          # only this Buffer frees it (free(ptr) raises)
            allocator.mutex.unlock()
        self.allocator = allocator
        self.size = size
        self.stream = handle
        self.ptr = b.ptr if b != NULL else 0

    @property
    def device(self):
        """The ordinal of the device the memory is on."""
        if self.allocator is None:
            raise RuntimeError("this Buffer was never initialised (made by Buffer.__new__ without "
                               "__init__): it owns no memory and has no device")
        return self.allocator.backend.device

    @property
    def closed(self):
        return self.ptr == 0 and self.size != 0

    def close(self):
        """Free the memory now. Closing twice is harmless."""
        cdef uintptr_t p = self.ptr
        if p:
            self.ptr = 0
            try:
                release_pointer(self.allocator, p, True)
            except BaseException:
                self.ptr = p               # not freed: the Buffer still owns the block
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __int__(self):
        return self.ptr

    def __reduce__(self):
        raise TypeError("a Buffer owns its device memory: it cannot be pickled or copied (the copy "
                        "would free the same block a second time)")

    def __copy__(self):
        self.__reduce__()

    def __deepcopy__(self, memo):
        self.__reduce__()

    def __repr__(self):
        if self.allocator is None:
            return "Buffer(uninitialised)"
        return (f"Buffer(ptr={self.ptr:#x}, size={self.size}, stream={self.stream}, "
                f"device={self.device})")

    def __dealloc__(self):
        if self.ptr and self.allocator is not None:
            release_pointer_in_dealloc(self.allocator, self.ptr)

