# cython: language_level=3
"""The device allocator's Python class: DeviceCachingAllocator checks arguments, takes the lock and
holds the Python objects (the backend, the stream objects it keeps alive, the OOM observers and
the history recorder); its state is one C struct (DeviceState, _device.h) that the modules of the
core work on:

* _hot.pxd: the cache hit (malloc, free, record_stream), once, inline and GIL-free, for the methods
  here and the C entry points below;
* _ladder: the slow path and the out-of-memory ladder, and its dry run (the same code);
* _routing: private pools and the routes into them; _capture: frees during a graph capture;
* _events: cross-stream events and stream lifetime; _introspect: statistics, copies, invariants;
* _policy.pxd, _state.pxd and _blocks.pxd: every decision about one request, the commit steps (the
  only code that changes statistics and writes trace entries), and the block surgery (split, take,
  merge); _expandable: expandable segments.

Locking: every public method takes the allocator's one C-level recursive mutex. The GIL is
released while waiting for it, so a thread that holds the mutex and has released the GIL inside a
slow driver call can always finish. Recursive because a Python finalizer (a Buffer collected while
an exception object is built) may re-enter free() on the same thread. C callers on any thread
(pyalloc._capi) take the lock for cache hits only, giving up the GIL while they wait if they hold
it, and never wait for the GIL while holding the lock: a miss unlocks first, then takes the GIL.
"""
from libc.stdint cimport uintptr_t, int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
cimport cython
from cython.operator cimport dereference as deref
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
import threading
import gc as _gc

from pyalloc._backend cimport Backend, BACKEND_OK, BACKEND_OOM
from pyalloc._types cimport (Block, BlockPool, MempoolId, PrivatePool, Route, Settings, ROUTE_THREAD,
                             ROUTE_CAPTURE, ST_RESERVED_BYTES, ST_ALLOCATED_BYTES, ST_ACTIVE_BYTES,
                             TR_SNAPSHOT)
from pyalloc._types cimport current_thread_key as thread_key_now
from pyalloc._types cimport likely, unlikely
from pyalloc._policy cimport (kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc,
                              kLargeBuffer, kRoundLarge, kSizeMax, kMaxRequest, round_size)
from pyalloc._state cimport trace
from pyalloc._validate cimport stream_handle, device_pointer, request_size
from pyalloc._device cimport DeviceState, lock_device, routes_capture, pyalloc_is_finalizing
from pyalloc._hot cimport (allocator_malloc, allocator_free, lookup_allocated, malloc_cache_hit,
                           free_cache_hit, record_stream_cache_hit)
from pyalloc._ladder cimport (policy_release_bytes, release_cached, release_pool,
                              release_cached_segment, grow_expandable, raise_oom_error)
from pyalloc._routing cimport (create_or_incref_pool, private_cached, private_reserved, begin_route,
                               end_route)
from pyalloc._events cimport (destroy_events, process_events, release_allocation_streams,
                              reap_dropped_streams, prune_stream_pins, record_use,
                              keep_allocation_stream, pin_stream)
from pyalloc._introspect cimport (free_host_memory, check_invariants, memory_stats, segments,
                                  reset_peak_memory_stats, reset_accumulated_memory_stats,
                                  set_history, history_entries, live_bytes_by_metadata, pool_info,
                                  private_pool_ids, expandable_segment_sizes)
from pyalloc._introspect import STAT_NAMES, POOL_NAMES, TRACE_ACTIONS
from pyalloc.errors import OwnedByBufferError


MIN_BLOCK_SIZE = kMinBlockSize
SMALL_SIZE = kSmallSize
SMALL_BUFFER = kSmallBuffer
MIN_LARGE_ALLOC = kMinLargeAlloc
LARGE_BUFFER = kLargeBuffer
ROUND_LARGE = kRoundLarge
SIZE_MAX = kSizeMax

ROUTE_FILTERS = ("thread", "capture")        # by RouteFilterKind


# ------------------------------------------------------------------------------- process state
#
# State that must be one per process lives here and nowhere else: other extension modules get
# their own copy of any variable defined in a shared header, so they reach these through _core.

cdef extern from *:
    """
    #include <atomic>
    /* This thread's metadata id (an index into pyalloc._metadata's strings; 0 = none). */
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


def _set_thread_metadata_id(uint32_t metadata_id):
    """Stamp this thread's later allocations with `metadata_id` (pyalloc._metadata interns them)."""
    pyalloc_set_metadata(metadata_id)


def _thread_metadata_id():
    """This thread's metadata id (0: none)."""
    return pyalloc_get_metadata()


def new_mempool_id(bint user_created):
    """A fresh private-pool id: (0, n) for a user-created pool (MemPool, graph_pool_handle),
    (n, 0) for one a graph capture creates for itself. n counts from 1, process-wide."""
    if user_created:
        return (0, pyalloc_user_pool_ids.fetch_add(1) + 1)
    return (pyalloc_graph_pool_ids.fetch_add(1) + 1, 0)


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


# ----------------------------------------------------------------------------- the allocator

cdef Backend UNINITIALISED_BACKEND = Backend(-1)


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
        # Until __init__, the Backend base class: every call raises RuntimeError, never crashes.
        self.backend = UNINITIALISED_BACKEND
        self.d.backend = <PyObject*>self.backend
        self.d.st.metadata_now = pyalloc_metadata_now
        self.oom_observers = []
        self.stream_pins = {}
        self.allocation_stream_objects = {}
        # A Python lock, never held while the allocator's is taken for long: a prune's check
        # (under the allocator's lock) and its dict removals happen under it, so that a stream
        # named again meanwhile is always put back (a setter waits for the prune).
        self.pins_lock = threading.Lock()

    def __init__(self, Backend backend not None):
        self.backend = backend
        self.d.backend = <PyObject*>backend
        self.d.reuse_checked = backend.checks_reuse

    def __dealloc__(self):
        # Segments still held are not returned: the backend may be gone at interpreter exit, and
        # a device context's teardown reclaims them. Only host-side structures are freed here.
        if not pyalloc_is_finalizing():
            # Events are driver objects of the backend's context: give them back (at interpreter
            # exit the context's teardown reclaims them, as it does the segments).
            try:
                destroy_events(&self.d, True)
            except RuntimeError:
                # CudaError or a closed CudaDevice: the context that owned them is gone and took
                # them with it; a destructor has no caller to report to.
                pass
        free_host_memory(&self.d)

    @property
    def capture_alloc_stacks(self):
        """Whether malloc records its caller's stack (set by the snapshot layer)."""
        return self.d.capture_alloc_stacks

    @capture_alloc_stacks.setter
    def capture_alloc_stacks(self, bint value):
        self.d.capture_alloc_stacks = value

    @property
    def capture_free_stacks(self):
        """Whether free records its caller's stack too (history context "all")."""
        return self.d.capture_free_stacks

    @capture_free_stacks.setter
    def capture_free_stacks(self, bint value):
        self.d.capture_free_stacks = value

    @property
    def reuse_checked(self):
        """Whether the backend's reuse sanitizer checks every hand-out (SimDevice(check_reuse=True))."""
        return self.d.reuse_checked

    # ------------------------------------------------------------------------- for C callers

    cdef void lock(self) noexcept:
        lock_device(&self.d)

    cdef void unlock(self) noexcept:
        self.d.mutex.unlock()

    cdef int malloc_locked(self, size_t size, uintptr_t stream, uint32_t context_id,
                           Block** out) except -1:
        return allocator_malloc(&self.d, size, stream, pyalloc_metadata_now(), context_id, out)

    cdef int free_locked(self, Block* b, uint32_t context_id) except -1:
        return allocator_free(&self.d, b, context_id)

    cdef int empty_cache_locked(self) except -1:
        return release_cached(&self.d)

    cdef int try_allocate_block(self, size_t size, uintptr_t stream, Block** out) except -1:
        return try_allocate(self, size, stream, out)

    cdef size_t policy_release_bytes(self, size_t size, uintptr_t stream) except? 0:
        return policy_release_bytes(&self.d, size, stream)

    cdef int release_cached_segment(self, uintptr_t ptr, size_t size, uintptr_t stream) except -1:
        return release_cached_segment(&self.d, ptr, size, stream)

    cdef int keep_allocation_stream(self, uintptr_t stream, object stream_object) except -1:
        """Keep `stream_object` (the stream of handle `stream`) alive while this allocator holds
        blocks of that stream: a stream destroyed with work queued still runs it, and the driver
        hands its handle to the next new stream at once, which would then be given the blocks
        cached for the old one while that work may still use them. Released by empty_cache once
        no block of the stream is left, or once the program has dropped it and its work is done
        (reap_dropped_streams, run here when the stream is new: callers keep a stream before
        allocating for it, so that a failure there allocates nothing). (Stream 0 never dies;
        keeping an object of the other never-dying handles, CUDA's 1 and 2, costs nothing.)"""
        return keep_allocation_stream(&self.d, self.pins_lock, self.allocation_stream_objects,
                                      self.stream_pins, stream, stream_object)

    cdef Block* allocate_owned(self, size_t size, uintptr_t stream) except? NULL:
        """A block for a Buffer (NULL for 0 bytes): only that Buffer may free it."""
        cdef Block* b = allocate_block(self, size, stream)
        if b != NULL:
            lock_device(&self.d)
            b.buffer_owned = True          # only the Buffer frees it (free(ptr) raises)
            self.d.mutex.unlock()
        return b

    cdef raise_oom(self, size_t requested):
        raise_out_of_memory(self, requested)

    cdef bint routes_capture(self, unsigned long long capture_id) noexcept:
        """Whether a route sends the allocations of capture `capture_id` to a private pool."""
        return routes_capture(&self.d, capture_id)

    # ------------------------------------------------------------------------- settings

    def _apply_settings(self, object settings):
        """Take max_split_size, rounding, GC and expandable settings from a config object.

        `settings` has the attributes of pyalloc.config.AllocatorConfig (bytes, floats, bools).
        Values are validated by the config parser; they are checked again here only for type.
        """
        cdef Settings s          # read whole before the lock: a bad value changes nothing
        s.max_split_size = settings.max_split_size
        s.max_non_split_rounding_size = settings.max_non_split_rounding_size
        s.gc_threshold = settings.garbage_collection_threshold
        divisions = list(settings.roundup_power2_divisions)
        if len(divisions) != 16:
            raise ValueError(f"roundup_power2_divisions needs 16 buckets, got {len(divisions)}")
        for i in range(16):
            s.roundup_divisions[i] = divisions[i]
        s.expandable_segments = settings.expandable_segments
        s.recycle_pages = getattr(settings, "recycle_pages", False) and s.expandable_segments
        s.release_lock_on_malloc = getattr(settings, "release_lock_on_cudamalloc", False)
        s.graph_reuse = getattr(settings, "graph_capture_record_stream_reuse", False)
        s.graph_last_use = getattr(settings, "graph_capture_last_use_marks", False)
        s.graph_cross_stream_reuse = getattr(settings, "graph_capture_cross_stream_reuse", False)
        s.event_poll_streams = getattr(settings, "event_poll_streams", 0)
        lock_device(&self.d)
        s.allowed_memory_maximum = self.d.st.settings.allowed_memory_maximum   # set_memory_fraction's
        s.memory_fraction = self.d.st.settings.memory_fraction
        self.d.st.settings = s
        self.d.mutex.unlock()

    def _init_stat_max_split_size(self):
        # PyTorch reports max_split_size as it was when the device allocator was created.
        self.d.st.stat_max_split_size = self.d.st.settings.max_split_size

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
        lock_device(&self.d)
        try:
            self.backend.memory_info(&free_bytes, &total_bytes)
            self.d.st.settings.memory_fraction = f
            self.d.st.settings.allowed_memory_maximum = (<size_t>(f * <double>total_bytes) if f < 1.0
                                                       else kSizeMax)
        finally:
            self.d.mutex.unlock()

    def get_memory_fraction(self):
        """The fraction last set with set_memory_fraction (1.0 when none)."""
        return self.d.st.settings.memory_fraction

    def round_size(self, size):
        """The block size (bytes) a request of `size` bytes is rounded to under current settings."""
        return round_size(&self.d.st.settings, request_size(size))

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
            prune_stream_pins(&self.d, self.pins_lock, self.stream_pins)
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
        cdef bint pin
        lock_device(&self.d)
        try:
            pin = record_use(&self.d, lookup_allocated(&self.d, p), s, last_use) and (
                type(stream) is not int and stream is not None)
        finally:
            self.d.mutex.unlock()
        if pin:
            pin_stream(&self.d, self.pins_lock, self.stream_pins, s, stream)
        if self.stream_pins:
            prune_stream_pins(&self.d, self.pins_lock, self.stream_pins)

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
        lock_device(&self.d)
        try:
            if one_pool:
                release_pool(&self.d, pid)
            else:
                release_cached(&self.d)
            destroy_events(&self.d, False)
        finally:
            self.d.mutex.unlock()
        if self.allocation_stream_objects:
            release_allocation_streams(&self.d, self.pins_lock, self.allocation_stream_objects)
        if self.stream_pins:
            prune_stream_pins(&self.d, self.pins_lock, self.stream_pins)

    def process_events(self):
        """Poll outstanding cross-stream events now (malloc does this on its own), and let go of
        the allocation streams the program has dropped whose work is done.

        While a capture routes allocations to a private pool, it polls nothing (an event query
        then invalidates the capture in CUDA's global and thread-local modes); while any route is
        active, blocks freed meanwhile stay deferred (a capture's graph may still use them)."""
        lock_device(&self.d)
        try:
            if not self.d.capture_routes:
                process_events(&self.d)
        finally:
            self.d.mutex.unlock()
        if self.stream_pins:
            prune_stream_pins(&self.d, self.pins_lock, self.stream_pins)
        if self.allocation_stream_objects:
            reap_dropped_streams(&self.d, self.pins_lock, self.allocation_stream_objects,
                                 self.stream_pins)

    def _lock_held(self):
        """Whether any thread holds this allocator's lock now (for tests)."""
        return self.d.mutex.held()

    def _dry_release_bytes(self, nbytes, stream=0):
        """The dry run of the release ladder for a malloc of `nbytes` on `stream` now: the bytes
        of device memory it would give back (for tests; replay calls it from C)."""
        cdef size_t size = request_size(nbytes)
        cdef uintptr_t s = stream_handle(stream)
        lock_device(&self.d)
        try:
            return policy_release_bytes(&self.d, size, s)
        finally:
            self.d.mutex.unlock()

    def _stream_pin_handles(self):
        """The handles of the stream objects record_stream keeps alive now (for tests)."""
        with self.pins_lock:
            return set(self.stream_pins)

    def _outstanding_events(self):
        """Events that freed blocks wait on (for tests; while any, C callers take the slow path)."""
        return self.d.outstanding_events

    # ------------------------------------------------------------------------- private pools

    def _create_or_incref_pool(self, pool_id, use_on_oom=None, no_split=None):
        """Create private pool `pool_id` (use count 1) or add a use to it; optionally set its
        use_on_oom / no_split flags. Returns the use count."""
        cdef MempoolId pid = pool_id_of(pool_id)
        if pid.first == 0 and pid.second == 0:
            raise ValueError("mempool_id (0, 0) is the default pool, not a private pool")
        cdef PrivatePool* pool
        lock_device(&self.d)
        try:
            pool = create_or_incref_pool(&self.d, pid)
            if use_on_oom is not None:
                pool.use_on_oom = bool(use_on_oom)
            if no_split is not None:
                pool.no_split = bool(no_split)
            return pool.use_count
        finally:
            self.d.mutex.unlock()

    def _set_pool_use_on_oom(self, pool_id, bint use_on_oom):
        """Set a live pool's use_on_oom flag; no effect on a pool that no longer exists."""
        cdef MempoolId pid = pool_id_of(pool_id)
        lock_device(&self.d)
        it = self.d.graph_pools.find(pid)
        if it != self.d.graph_pools.end():
            deref(it).second.use_on_oom = use_on_oom
        self.d.mutex.unlock()

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
        lock_device(&self.d)
        try:
            begin_route(&self.d, route)
        finally:
            self.d.mutex.unlock()

    def end_allocate_to_pool(self, pool_id):
        """Stop routing allocations to `pool_id` (its use count is not changed: release_pool).

        RuntimeError if it is not routed (PyTorch: "endAllocatePool: not currently recording to
        mempool_id")."""
        cdef MempoolId pid = pool_id_of(pool_id)
        lock_device(&self.d)
        try:
            end_route(&self.d, pid)
        finally:
            self.d.mutex.unlock()

    def release_pool(self, pool_id):
        """Drop one use of private pool `pool_id`. At zero uses the pool is freeable: its cached
        blocks go back to the device at the next empty_cache (or OOM flush), and the pool itself
        once it holds no device memory. ValueError for an unknown or already released pool."""
        cdef MempoolId pid = pool_id_of(pool_id)
        lock_device(&self.d)
        try:
            it = self.d.graph_pools.find(pid)
            if it == self.d.graph_pools.end() or deref(it).second.use_count <= 0:
                raise ValueError(f"mempool_id {tuple(pool_id)} is not a live private pool of this allocator")
            deref(it).second.use_count -= 1
        finally:
            self.d.mutex.unlock()

    def _pool_info(self, pool_id):
        """A private pool's state as a dict (use_count, device_allocations, reserved_bytes,
        use_on_oom, no_split, routed), or None when the allocator has no such pool."""
        return pool_info(&self.d, pool_id_of(pool_id))

    def _private_pool_ids(self):
        """Ids of every private pool the allocator holds, freeable ones included."""
        return private_pool_ids(&self.d)

    def _capture_stats(self):
        """Counters of the in-capture reuse walk: nodes_expanded (graph nodes whose parents were
        asked for, over the allocator's life), deferred_blocks (blocks waiting now)."""
        return {"nodes_expanded": self.d.nodes_expanded,
                "deferred_blocks": self.d.deferred_blocks.size() - self.d.deferred_released}

    def private_pool_bytes(self):
        """(reserved, cached): bytes of device memory held by private pools, and of those the
        bytes in cached free blocks (what the OOM message reports as "in private pools")."""
        lock_device(&self.d)
        try:
            return private_reserved(&self.d), private_cached(&self.d)
        finally:
            self.d.mutex.unlock()

    # ------------------------------------------------------------------------- expandable segments

    def expandable_segment_sizes(self):
        """One (stream, is_small_pool, mapped_bytes) per live expandable segment, default stream
        included (PyTorch's getExpandableSegmentSizes skips it). Bytes are currently mapped bytes."""
        return expandable_segment_sizes(&self.d)

    def warm_up(self, sizes):
        """Map memory ahead of time: `sizes` is a list like expandable_segment_sizes() returns.

        For each (stream, is_small_pool, nbytes), the stream's expandable segment of that pool is
        grown until it has nbytes mapped, so a steady state that needs no more makes no map call.
        Needs expandable_segments:True. Raises OutOfMemoryError when the device cannot back it.
        """
        if not self.d.st.settings.expandable_segments:
            raise RuntimeError("warm_up needs expandable segments: configure expandable_segments:True")
        plan = []
        for entry in sizes:
            try:
                stream, is_small, nbytes = entry
            except (TypeError, ValueError):
                raise TypeError(f"warm_up expects (stream, is_small_pool, bytes) tuples, got {entry!r}") from None
            plan.append((stream_handle(stream), bool(is_small), request_size(nbytes)))
        cdef size_t missing
        for stream, is_small, nbytes in plan:
            lock_device(&self.d)
            try:
                missing = grow_expandable(&self.d, is_small, stream, nbytes)
            finally:
                self.d.mutex.unlock()
            if missing:
                raise_out_of_memory(self, missing)

    # ------------------------------------------------------------------------- stats

    def memory_stats(self):
        """PyTorch's flat statistics dict: "{stat}.{all|small_pool|large_pool}.{current|peak|allocated|freed}"
        plus num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free,
        max_split_size and oversize_allocations/oversize_segments.{current|peak|allocated|freed}.
        Byte statistics are in bytes; private pools count in the same rows, by size class, as in
        PyTorch. Keys are sorted, as torch.cuda.memory_stats returns them.
        """
        return memory_stats(&self.d)

    def memory_allocated(self):
        """Bytes in blocks handed out and not freed (allocated_bytes.all.current)."""
        return self.d.st.stats[ST_ALLOCATED_BYTES].all_current

    def memory_reserved(self):
        """Bytes in segments held from the device (reserved_bytes.all.current)."""
        return self.d.st.stats[ST_RESERVED_BYTES].all_current

    def max_memory_allocated(self):
        """Peak of memory_allocated() since creation or the last reset_peak_memory_stats()."""
        return self.d.st.stats[ST_ALLOCATED_BYTES].all_peak

    def max_memory_reserved(self):
        """Peak of memory_reserved() since creation or the last reset_peak_memory_stats()."""
        return self.d.st.stats[ST_RESERVED_BYTES].all_peak

    def reset_peak_memory_stats(self):
        """Set every statistic's peak to its current value."""
        reset_peak_memory_stats(&self.d)

    def reset_accumulated_memory_stats(self):
        """Zero the cumulative allocated/freed counts and the retry/OOM/sync/device counters."""
        reset_accumulated_memory_stats(&self.d)

    # ------------------------------------------------------------------------- introspection

    def _segments(self):
        """The segments as lists of blocks, sorted by address, for snapshots and checks.

        Each segment is a dict: address, total_size, stream, is_small, is_expandable, pool_id
        (the owning pool's id, (0, 0) for the default pools), context_id and blocks; each block a
        dict: address, size, requested_size, allocated, pending_free (freed, waiting for events),
        metadata_id, context_id.
        """
        return segments(&self.d)

    def _set_history(self, bint enabled, size_t max_entries, uint32_t skip_mask, bint clear):
        """Switch the trace ring buffer on/off; turning it off clears it (PyTorch's semantics).

        While on, `clear` empties it, and a new `max_entries` keeps the newest entries that fit
        (PyTorch leaves a resized buffer out of order; keeping the newest is what a user wants).
        """
        if enabled and max_entries == 0:
            raise ValueError("max_entries must be >= 1 while history is on, got 0")
        set_history(&self.d, enabled, max_entries, skip_mask, clear)

    def _history_entries(self):
        """Trace entries oldest first as tuples
        (action, addr, size, stream, time_us, metadata_id, context_id), and the number dropped
        because the ring buffer wrapped."""
        return history_entries(&self.d)

    def _live_bytes_by_metadata(self, bint requested):
        """{metadata_id: bytes} over allocated blocks: block sizes, or requested sizes if `requested`.

        Blocks freed but waiting for stream events are not counted (the caller gave them up).
        """
        return live_bytes_by_metadata(&self.d, requested)

    def _record_snapshot_entry(self):
        """Add a `snapshot` trace entry (addr 0, size = active bytes), as taking a snapshot does."""
        lock_device(&self.d)
        trace(&self.d.st, TR_SNAPSHOT, 0, self.d.st.stats[ST_ACTIVE_BYTES].all_current, 0, 0)
        self.d.mutex.unlock()

    def _check_invariants(self):
        """Recount every block and compare with the links, pools and statistics.

        Raises AssertionError naming the first broken invariant. For tests; O(blocks).
        The cyclic collector is paused meanwhile: the check builds Python objects under the lock,
        and a Buffer a collection freed there would change the blocks mid-count.
        """
        collecting = _gc.isenabled()
        _gc.disable()
        lock_device(&self.d)
        try:
            check_invariants(&self.d)
        finally:
            self.d.mutex.unlock()
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


cdef int clear_allocator(PyObject* o) noexcept:
    cdef DeviceCachingAllocator a = <DeviceCachingAllocator><object>o
    a.capture_alloc_stacks = False      # nothing left to record stacks with
    a.capture_free_stacks = False
    a.context_recorder = None
    a.oom_observers = None
    return 0


pyalloc_set_tp_clear(<PyObject*>DeviceCachingAllocator, clear_allocator)


# ------------------------------------------------------------------------------- Python callers' paths
#
# What the methods (and Buffer) run around the cache hit: the history recorder, the lock, the
# out-of-memory error, and Buffer ownership.

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
    if a.d.capture_alloc_stacks:
        context_id = a.context_recorder()
    cdef int rc
    lock_device(&a.d)
    try:
        rc = allocator_malloc(&a.d, size, stream, pyalloc_metadata_now(), context_id, out)
    finally:
        a.d.mutex.unlock()
    return rc


cdef inline int release_pointer(DeviceCachingAllocator a, uintptr_t p) except -1:
    """free for a validated pointer (free(), the framework hooks)."""
    if p == 0:
        return 0
    cdef Block* b
    # The free call site is captured outside the lock (it runs Python), and only when history
    # asks for it (context="all"): one C test otherwise.
    cdef uint32_t context_id = 0
    if a.d.capture_free_stacks:
        context_id = a.context_recorder()
    lock_device(&a.d)
    try:
        b = lookup_allocated(&a.d, p)
        if unlikely(b.buffer_owned):
            # Only its Buffer may free it (_buffer.pyx): a raw free would leave the Buffer to
            # free whatever block sits at that address later.
            raise OwnedByBufferError(f"pointer {b.ptr:#x} belongs to a pyalloc.Buffer: close the "
                                     f"Buffer (or drop it) instead of freeing its pointer", b.ptr)
        allocator_free(&a.d, b, context_id)
    finally:
        a.d.mutex.unlock()
    return 0


cdef raise_out_of_memory(DeviceCachingAllocator a, size_t requested):
    """Call the OOM observers, then raise OutOfMemoryError (lock not held)."""
    raise_oom_error(&a.d, a.oom_observers, a.backend.device, requested)


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
        if likely(a != NULL and malloc_cache_hit(&(<DeviceCachingAllocator>a).d, size, stream, pyalloc_metadata_now(), out)):
            return PYALLOC_OK
    return malloc_slow_half(device, size, stream, out)


cdef int entry_free(int device, uintptr_t ptr) noexcept nogil:
    cdef PyObject* a
    if unlikely(ptr == 0):
        return PYALLOC_OK
    if likely(0 <= device < PYALLOC_ENTRY_DEVICES):
        a = pyalloc_entry_slot_get(device)
        if likely(a != NULL and free_cache_hit(&(<DeviceCachingAllocator>a).d, ptr)):
            return PYALLOC_OK
    return free_slow_half(device, ptr)


cdef int entry_record_stream(int device, uintptr_t ptr, uintptr_t stream) noexcept nogil:
    cdef PyObject* a
    if ptr == 0:
        return PYALLOC_OK
    if 0 <= device < PYALLOC_ENTRY_DEVICES:
        a = pyalloc_entry_slot_get(device)
        if a != NULL and record_stream_cache_hit(&(<DeviceCachingAllocator>a).d, ptr, stream):
            return PYALLOC_OK
    return record_stream_slow_half(device, ptr, stream)
