# cython: language_level=3
"""The caching allocator of pinned host memory, with the rules of PyTorch's CachingHostAllocator
(aten/src/ATen/core/CachingHostAllocator.h, aten/src/ATen/cuda/CachingHostAllocator.cpp):

* a request of n bytes gets a block of the next power of two (1 byte: 1 byte), never split;
* free blocks wait in one free list per power of two, most recently freed handed out first;
* record_event(ptr, stream) notes that `stream` uses a block; freeing it then records an event on
  each such stream, and the block returns to its free list only when all those events completed
  (a host block used by a queued copy is never handed out again before the copy has run);
* completed events are collected at the start of each allocation (or, with
  pinned_use_background_threads, by a thread polling every 100 us, and for the requested size
  only on a miss);
* CUDA-graph capture (PyTorch 2.13's rule): a block handed out while malloc's stream captures is
  marked captured; freeing it records no event (an event recorded in a capture marks no real
  completion, and querying one breaks the capture), so with record_event streams it is never
  reused, without them it goes back to its free list; a malloc on a capturing stream queries no
  event;
* empty_cache frees only blocks in the free lists (idle), never one in use or waiting for events;
* on a miss, memory comes from cuMemHostAlloc, or with pinned_use_cuda_host_register from malloc
  whose pages `pinned_num_register_threads` threads touch before cuMemHostRegister, or first from
  the reserve segment (pinned_reserve_segment_size_mb), one allocation made on the first miss and
  carved into 4 KiB-rounded blocks; a block carved from it is never freed (as in PyTorch, its
  range is not reused after empty_cache drops it).

Statistics have PyTorch 2.13's host_memory_stats keys and meanings (see HostCachingAllocator.stats).
The memory history (HostAllocator.record_memory_history) keeps entries in the device allocator's
format: alloc, free_requested, free_completed, segment_alloc (a block made), segment_free.
Every operation completes or changes nothing when a backend call fails; the cache-hit pair
(malloc then free, no stream recorded) makes no backend call and allocates no Python object
beyond the returned int.
"""
from libc.stdint cimport uintptr_t, int64_t
from libcpp.deque cimport deque
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from cython.operator cimport dereference as deref

from pyalloc._backend cimport Backend
from pyalloc._host_backend cimport HostBackend
from pyalloc._validate cimport stream_handle, device_pointer, request_size
from pyalloc.errors import AlreadyFreedError, NotAllocatedError


cdef extern from "<mutex>" namespace "std" nogil:
    cdef cppclass mutex:
        void lock()
        void unlock()
        bint try_lock()


cdef extern from "_host_types.h" namespace "pyalloc_host" nogil:
    cdef enum Origin:
        HOST_ALLOC
        REGISTERED
        RESERVED
        UNREGISTERED
    cdef cppclass HostBlock:
        uintptr_t ptr
        size_t size
        bint allocated
        size_t event_count
        int origin
        bint captured
        uintptr_t stream
        unsigned int stack_id
        vector[uintptr_t] streams
    cdef cppclass Stat:
        int64_t current, peak, allocated, freed
        void increase(int64_t n)
        void decrease(int64_t n)
        void reset_accumulated()
        void reset_peak()
    cdef cppclass DurationStat:
        int64_t total, count, max, min
        void increase(int64_t us)
        void reset_accumulated()
        void reset_peak()
    cdef struct PendingEvent:
        uintptr_t event
        int device
        HostBlock* block
    cdef cppclass EventQueue:
        bint empty()
        size_t size()
        PendingEvent& operator[](size_t)
        PendingEvent& back()
        void pop_back()
        void push_front(PendingEvent&)
    cdef enum HostAction:
        H_ALLOC
        H_FREE_REQUESTED
        H_FREE_COMPLETED
        H_SEGMENT_ALLOC
        H_SEGMENT_FREE
    cdef struct HostTraceEntry:
        int action
        uintptr_t addr
        size_t size
        uintptr_t stream
        int64_t time_us
        unsigned int stack_id
    cdef cppclass HostTrace:
        deque[HostTraceEntry] entries
        size_t capacity
        unsigned int skip_mask
        void push(int action, uintptr_t addr, size_t size, uintptr_t stream, unsigned int stack_id)
        void resize(size_t cap)
    const int kBuckets
    int size_index(size_t size)
    size_t power_of_two_ceil(size_t n)
    void erase_at(EventQueue& q, size_t i)
    int64_t now_us()


cdef size_t RESERVE_ROUND = 4096
cdef size_t MAX_BLOCK = (<size_t>1) << 60       # request_size refuses more

# The memory history's actions, by HostAction value (the device allocator's names for them).
HOST_TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")


cdef dict _stat_dict(Stat* st):
    return {"current": st.current, "peak": st.peak, "allocated": st.allocated, "freed": st.freed}


cdef void _add_bucket(Stat* total, Stat* bucket) noexcept:
    """PyTorch's add_bucket_stats: per-size stats summed, peaks included."""
    total.current += bucket.current
    total.peak += bucket.peak
    total.allocated += bucket.allocated
    total.freed += bucket.freed


cdef str _state(HostBlock* b):
    """A block's state for block_list: "allocated", "captured" (freed after a use in a CUDA
    graph, kept for good), "pending" (freed, events outstanding) or "free"."""
    if b.allocated:
        return "allocated"
    if b.event_count:
        return "captured" if b.captured else "pending"
    return "free"


cdef class HostCachingAllocator:
    """Caching allocator of pinned host memory over a device backend's events and a host backend.

    Args:
        device: the device Backend (SimDevice, CudaDevice) whose streams and events blocks use.
        host: the HostBackend giving memory (SimHost over a SimDevice, CudaHost over a CudaDevice).
        use_host_register: pinned_use_cuda_host_register (default False: cuMemHostAlloc).
        num_register_threads: pinned_num_register_threads, threads touching pages on the register
            path for blocks of at least 4 KiB per thread (default 1).
        reserve_segment_size: pinned_reserve_segment_size_mb in bytes (default 0: none).
        use_background_threads: pinned_use_background_threads (default False).

    Sizes are bytes; pointers and streams are ints (streams may be stream objects). Most users want
    pyalloc.host.HostAllocator, which reads these from the allocator settings.
    """
    cdef readonly Backend device
    cdef readonly HostBackend host
    cdef readonly bint use_host_register
    cdef readonly int num_register_threads
    cdef readonly size_t reserve_segment_size
    cdef readonly bint use_background_threads
    cdef readonly unsigned long long background_passes   # event-polling passes of the thread
    cdef mutex lock
    cdef unordered_map[uintptr_t, HostBlock*] blocks     # every block, by address
    cdef vector[deque[HostBlock*]] free_list             # index: log2(block size)
    cdef EventQueue events                               # newest first; collected from the back
    cdef unordered_map[int, vector[uintptr_t]] event_pool   # device -> completed events to reuse
    # Statistics, kept as PyTorch 2.13 keeps them (HostStatsStaged): blocks handed out and not
    # yet reusable, per bucket (active_requests, active_bytes); every block the allocator owns
    # (allocations, allocated_bytes); time in the driver's allocation and free calls.
    cdef Stat bucket_active[64]
    cdef Stat bucket_active_bytes[64]
    cdef Stat allocations
    cdef Stat allocated_bytes
    cdef DurationStat host_alloc_time
    cdef DurationStat host_free_time
    # The reserve segment (pinned_reserve_segment_size_mb), made on the first miss.
    cdef bint reserve_ready
    cdef uintptr_t reserve_start
    cdef uintptr_t reserve_next
    cdef int reserve_origin
    cdef object _thread
    cdef readonly object background_error    # what stopped the polling thread, until malloc raises it
    cdef object _stop
    # The memory history (HostAllocator.record_memory_history): off while trace.capacity is 0.
    cdef HostTrace trace
    cdef bint alloc_stacks                   # call stack_recorder at malloc (context set)
    cdef bint free_stacks                    # and at free (context "all")
    cdef object stack_recorder               # () -> uint32 stack id (pyalloc.snapshot.StackTable)
    cdef object __weakref__

    def __cinit__(self):
        self.free_list.resize(kBuckets)

    def __init__(self, Backend device not None, HostBackend host not None, *,
                 bint use_host_register=False, int num_register_threads=1,
                 size_t reserve_segment_size=0, bint use_background_threads=False):
        if host.device is not device:
            raise ValueError(f"the host backend {host!r} serves {host.device!r}, not {device!r}")
        if num_register_threads < 1 or num_register_threads > 128:
            raise ValueError(f"num_register_threads must be in [1, 128], got {num_register_threads}")
        if not self.blocks.empty():
            raise RuntimeError("HostCachingAllocator.__init__ called again on an allocator in use")
        self.device = device
        self.host = host
        self.use_host_register = use_host_register
        self.num_register_threads = num_register_threads
        self.reserve_segment_size = reserve_segment_size
        self.use_background_threads = use_background_threads

    def __dealloc__(self):
        # The memory itself stays with the process (close() gives it back): a block handed out
        # as a raw pointer may still be in use when the allocator object goes.
        cdef pair[uintptr_t, HostBlock*] p
        for p in self.blocks:
            del p.second
        self.blocks.clear()

    # ------------------------------------------------------------------ the lock

    cdef inline void _acquire(self) noexcept:
        if not self.lock.try_lock():
            with nogil:             # another thread may be in a backend call with the GIL released
                self.lock.lock()

    cdef inline void _release(self) noexcept:
        self.lock.unlock()

    # ------------------------------------------------------------------ allocate

    def malloc(self, nbytes, stream=None):
        """A pinned block of at least `nbytes` bytes (the next power of two); returns its address
        (an int), 0 for 0 bytes.

        `stream` (an int handle or a stream object; default None: the legacy stream 0) is the
        stream the caller works on, PyTorch's current stream: while it captures a CUDA graph,
        no event is queried (PyTorch's query_event answers "not ready" during a capture) and
        the block is marked as used by the capture (see free). Raises CudaError when the driver
        cannot allocate (nothing changed), ValueError/TypeError for a bad size, ValueError for
        a destroyed stream."""
        cdef size_t n = request_size(nbytes)
        cdef uintptr_t s = 0 if stream is None else stream_handle(stream)
        if s and not self.device.stream_alive(s):
            raise ValueError(f"malloc: stream {s:#x} was destroyed")
        cdef uintptr_t ptr
        cdef unsigned int stack_id = 0
        if self.background_error is not None:
            self._raise_background_error()
        if n == 0:
            return 0
        if self.alloc_stacks:
            stack_id = self.stack_recorder()    # Python: before the lock is taken
        self._acquire()
        try:
            ptr = self._allocate(n, s, stack_id)
        finally:
            self._release()
        return ptr

    cdef bint _capturing(self, uintptr_t stream) except -1:
        """Whether `stream` captures now. The legacy stream never does (CUDA refuses to capture
        it), which keeps the default call free of a driver query."""
        cdef unsigned long long capture_id = 0
        cdef vector[uintptr_t] terminals
        if stream == 0:
            return False
        return self.device.capture_info(stream, &capture_id, &terminals) == 1

    cdef uintptr_t _allocate(self, size_t n, uintptr_t stream, unsigned int stack_id) except? 0:
        cdef size_t size = power_of_two_ceil(n)
        cdef int index = size_index(size)
        cdef HostBlock* block
        # The legacy stream (the default) never captures: no backend call, nor the query's
        # locals, on the default path.
        cdef bint capturing = stream != 0 and self._capturing(stream)
        if not capturing and not self.use_background_threads and not self.events.empty():
            self._process_events(0)
        block = self._take_free(index)
        if block == NULL and self.use_background_threads and not capturing:
            self._process_events(size)
            block = self._take_free(index)
            if self._thread is None:
                self._start_thread()
        if block == NULL:
            block = self._new_block(size)
        block.captured = capturing
        block.stream = stream
        block.stack_id = stack_id
        if self.trace.capacity:
            self.trace.push(H_ALLOC, block.ptr, block.size, stream, stack_id)
        return block.ptr

    cdef HostBlock* _take_free(self, int index) except? NULL:
        cdef deque[HostBlock*]* fl = &self.free_list[index]
        cdef HostBlock* block
        if fl.empty():
            return NULL
        block = fl.back()
        if self.device.checks_reuse:
            self.host.check_handout(block.ptr, block.size)     # raises before anything changes
        fl.pop_back()
        block.allocated = True
        self.bucket_active[index].increase(1)
        self.bucket_active_bytes[index].increase(block.size)
        return block

    cdef HostBlock* _new_block(self, size_t size) except NULL:
        cdef uintptr_t ptr = 0
        cdef int origin
        cdef size_t carved = (size + RESERVE_ROUND - 1) & ~(RESERVE_ROUND - 1)
        if self.reserve_segment_size and not self.reserve_ready:
            origin = self._driver_alloc(self.reserve_segment_size, &ptr)
            self.reserve_start = self.reserve_next = ptr
            self.reserve_origin = origin
            self.reserve_ready = True
        if self.reserve_ready and self.reserve_next + carved <= self.reserve_start + self.reserve_segment_size:
            ptr = self.reserve_next
            origin = RESERVED
        else:
            origin = self._driver_alloc(size, &ptr)
        cdef HostBlock* block = new HostBlock()
        block.ptr = ptr
        block.size = size
        block.allocated = True
        block.origin = origin
        if origin == RESERVED:
            self.reserve_next += carved
        self.blocks[ptr] = block
        self.allocations.increase(1)
        self.allocated_bytes.increase(size)
        cdef int index = size_index(size)
        self.bucket_active[index].increase(1)
        self.bucket_active_bytes[index].increase(size)
        if self.trace.capacity:
            self.trace.push(H_SEGMENT_ALLOC, ptr, size, 0, 0)
        return block

    cdef int _driver_alloc(self, size_t size, uintptr_t* ptr) except -1:
        """Memory from the driver (the register path or cuMemHostAlloc), timed into
        host_alloc_time; returns the block's origin. Nothing is left allocated when it raises."""
        cdef int64_t start = now_us()
        cdef int threads = self.num_register_threads
        if self.use_host_register:
            if threads > 1 and size < RESERVE_ROUND * <size_t>threads:
                threads = 1          # fewer pages than threads: PyTorch touches them in one
            self.host.host_malloc(size, ptr)
            try:
                self.host.touch_pages(ptr[0], size, threads)
                self.host.host_register(ptr[0], size)
            except BaseException:
                self.host.host_mfree(ptr[0], size)
                raise
            origin = REGISTERED
        else:
            self.host.host_alloc(size, ptr)
            origin = HOST_ALLOC
        self.host_alloc_time.increase(now_us() - start)
        return origin

    # ------------------------------------------------------------------ events

    cdef int _process_events(self, size_t size) except -1:
        """Collect completed events, oldest first: all of them up to the first pending one
        (size 0), or, for one size, the events of blocks of that size until one block is free
        again (the background-thread mode's miss)."""
        cdef size_t i
        cdef PendingEvent e
        if size == 0:
            while not self.events.empty():
                e = self.events.back()
                if not self.device.event_query(e.event):
                    return 0
                self.events.pop_back()
                self._event_done(e)
            return 0
        i = self.events.size()
        while i > 0:
            i -= 1
            e = self.events[i]
            if e.block.size != size or not self.device.event_query(e.event):
                continue
            erase_at(self.events, i)
            if self._event_done(e):
                return 0
        return 0

    cdef bint _event_done(self, PendingEvent e) except -1:
        """One event of a freed block completed: pool the event; the block goes back to its free
        list after its last one. Returns whether it did."""
        self.event_pool[e.device].push_back(e.event)
        cdef HostBlock* block = e.block
        block.event_count -= 1
        if block.event_count:
            return False
        self._make_reusable(block)
        return True

    cdef inline void _make_reusable(self, HostBlock* block) noexcept:
        """A freed block whose uses are over goes back to its free list (the end of its
        active_requests count, and of its free in the memory history)."""
        cdef int index = size_index(block.size)
        self.free_list[index].push_back(block)
        self.bucket_active[index].decrease(1)
        self.bucket_active_bytes[index].decrease(block.size)
        if self.trace.capacity:
            self.trace.push(H_FREE_COMPLETED, block.ptr, block.size, block.stream, block.stack_id)

    cdef int _record(self, uintptr_t stream, PendingEvent* out) except -1:
        """An event recorded on `stream` now (from the pool of the stream's device when it has
        one). When recording fails the event goes back to the pool and this raises."""
        cdef int dev = self.device.stream_device(stream)
        cdef vector[uintptr_t]* pool = &self.event_pool[dev]
        cdef uintptr_t event = 0
        if not pool.empty():
            event = pool.back()
            pool.pop_back()
        elif dev == self.device.device:
            self.device.event_create(&event)
        else:
            self.device.event_create_on(dev, &event)
        try:
            self.device.event_record(event, stream)
        except BaseException:
            self.event_pool[dev].push_back(event)
            raise
        out.event = event
        out.device = dev
        return 0

    # ------------------------------------------------------------------ free, record_event

    cdef HostBlock* _live_block(self, uintptr_t ptr, str call) except NULL:
        cdef unordered_map[uintptr_t, HostBlock*].iterator it = self.blocks.find(ptr)
        if it == self.blocks.end():
            raise NotAllocatedError(
                f"{call}: {ptr:#x} is not a pinned block of this host allocator (expected an "
                "address malloc returned)", ptr)
        if not deref(it).second.allocated:
            raise AlreadyFreedError(f"{call}: pinned block {ptr:#x} was freed already", ptr)
        return deref(it).second

    def free(self, ptr):
        """Give back the block at `ptr` (0: nothing). A block that record_event tied to streams
        is reusable once the events recorded now on those streams completed. A block whose use
        was captured into a CUDA graph (handed out by malloc on a capturing stream, as PyTorch's
        rule; or, beyond PyTorch, named by record_event for a capturing stream or freed while
        such a stream captures) gets no event: without record_event streams it is reusable at
        once, with them it is kept for good ("captured"), since the graph may replay. Raises
        NotAllocatedError for an address malloc did not return, AlreadyFreedError for a double
        free, CudaError when an event cannot be recorded (the block stays allocated)."""
        cdef uintptr_t p = device_pointer(ptr)
        cdef unsigned int stack_id = 0
        if p == 0:
            return
        if self.free_stacks:
            stack_id = self.stack_recorder()
        self._acquire()
        try:
            self._free(p, stack_id)
        finally:
            self._release()

    cdef int _free(self, uintptr_t p, unsigned int stack_id) except -1:
        cdef HostBlock* block = self._live_block(p, "free")
        cdef vector[PendingEvent] recorded
        cdef PendingEvent e
        cdef size_t i
        if block.streams.empty():
            block.allocated = False
            self._trace_free_requested(block, stack_id)
            self._make_reusable(block)
            return 0
        if block.captured or self._any_capturing(block):
            # PyTorch's rule for a block used during a capture: no event (an event recorded in
            # a capture marks no real completion, and querying one breaks the capture); the
            # block stays counted as active and is never handed out again, since the graph may
            # replay its copies at any time.
            block.captured = True
            block.allocated = False
            block.event_count += block.streams.size()
            block.streams.clear()
            self._trace_free_requested(block, stack_id)
            return 0
        try:
            for i in range(block.streams.size()):
                self._record(block.streams[i], &e)
                e.block = block
                recorded.push_back(e)
        except BaseException:
            for i in range(recorded.size()):     # unused after all: back to their pools
                self.event_pool[recorded[i].device].push_back(recorded[i].event)
            raise
        block.allocated = False
        block.event_count += recorded.size()
        block.streams.clear()
        for i in range(recorded.size()):
            self.events.push_front(recorded[i])
        self._trace_free_requested(block, stack_id)
        return 0

    cdef bint _any_capturing(self, HostBlock* block) except -1:
        """Whether a stream record_event named for `block` captures now (its use since then
        may be graph work: pyalloc treats it as captured, where PyTorch records an event on
        the capturing stream; docs/differences.md)."""
        cdef size_t i
        for i in range(block.streams.size()):
            if self._capturing(block.streams[i]):
                return True
        return False

    cdef inline void _trace_free_requested(self, HostBlock* block, unsigned int stack_id) noexcept:
        if self.trace.capacity:
            self.trace.push(H_FREE_REQUESTED, block.ptr, block.size, block.stream,
                            stack_id if stack_id else block.stack_id)

    def record_event(self, ptr, stream):
        """Note that work on `stream` (an int handle or a stream object) uses the block at `ptr`,
        as torch's record_stream on a pinned tensor: when the block is freed, it is not handed
        out again before that work (everything queued on `stream` by the free) completed.
        Raises NotAllocatedError / AlreadyFreedError for a pointer that is not a live block,
        ValueError for a destroyed stream."""
        cdef uintptr_t p = device_pointer(ptr)
        cdef uintptr_t s = stream_handle(stream)
        cdef HostBlock* block
        cdef size_t i
        self._acquire()
        try:
            block = self._live_block(p, "record_event")
            if not self.device.stream_alive(s):
                raise ValueError(f"record_event: stream {s:#x} was destroyed")
            if self._capturing(s):
                block.captured = True       # a use inside a graph, which may replay at any time
            for i in range(block.streams.size()):
                if block.streams[i] == s:
                    return
            block.streams.push_back(s)
        finally:
            self._release()

    # ------------------------------------------------------------------ cache and statistics

    def empty_cache(self):
        """Free every idle block (in a free list, its events completed) to the driver. Blocks in
        use or waiting for events stay. When a driver call fails, the blocks freed before it are
        gone and the rest stay cached."""
        cdef int index
        cdef HostBlock* block
        self._acquire()
        try:
            self._process_events(0)
            for index in range(kBuckets):
                while not self.free_list[index].empty():
                    block = self.free_list[index].back()
                    try:
                        self._release_memory(block)
                    except BaseException:
                        # Unregistered but not freed: no longer pinned, so it must not be
                        # handed out again; the cache lets it go (its pages leak).
                        if block.origin == UNREGISTERED:
                            self._drop_idle(index, block)
                        raise
                    self._drop_idle(index, block)
        finally:
            self._release()

    cdef void _drop_idle(self, int index, HostBlock* block) noexcept:
        """Forget the idle block at the back of free list `index` (its memory is given back)."""
        self.free_list[index].pop_back()
        self.blocks.erase(block.ptr)
        self.allocations.decrease(1)
        self.allocated_bytes.decrease(block.size)
        if self.trace.capacity:
            self.trace.push(H_SEGMENT_FREE, block.ptr, block.size, 0, 0)
        del block

    cdef int _release_memory(self, HostBlock* block) except -1:
        cdef int64_t start
        if block.origin == RESERVED:
            return 0                 # the reserve segment is never given back
        start = now_us()
        if block.origin == REGISTERED:
            self.host.host_unregister(block.ptr, block.size)
            block.origin = UNREGISTERED    # a failing free() now must not unregister twice
        if block.origin == HOST_ALLOC:
            self.host.host_free(block.ptr, block.size)
        else:
            self.host.host_mfree(block.ptr, block.size)
        self.host_free_time.increase(now_us() - start)
        return 0

    def stats(self):
        """Statistics as torch.cuda.host_memory_stats_as_nested_dict() gives them in PyTorch 2.13
        (HostStats of aten/src/ATen/core/CachingHostAllocator.h):

        * active_requests, active_bytes: blocks (bytes) handed out and not yet reusable: a block
          counts from its handout until it is back in a free list, so a freed block waiting for
          events (or kept after a capture) still counts. Each a dict of current, peak,
          allocated (total increase) and freed (total decrease); the peak is the sum of the
          per-size peaks, as PyTorch reports it (an upper bound of the true peak);
        * allocations, allocated_bytes: every block the allocator owns (bytes), in use or cached:
          up when a block is made, down when empty_cache gives one back;
        * num_host_alloc, num_host_free: blocks made and given back (allocations.allocated,
          .freed; a block carved from the reserve segment counts as made, as in PyTorch);
        * host_alloc_time, host_free_time: microseconds in the driver's allocation and free
          calls (the reserve segment's own allocation included): total, max, min, count, avg.
        """
        cdef Stat active, active_bytes
        cdef int i
        self._acquire()
        try:
            for i in range(kBuckets):
                _add_bucket(&active, &self.bucket_active[i])
                _add_bucket(&active_bytes, &self.bucket_active_bytes[i])
            return {
                "active_requests": _stat_dict(&active),
                "active_bytes": _stat_dict(&active_bytes),
                "allocations": _stat_dict(&self.allocations),
                "allocated_bytes": _stat_dict(&self.allocated_bytes),
                "num_host_alloc": self.allocations.allocated,
                "num_host_free": self.allocations.freed,
                "host_alloc_time": _durations(&self.host_alloc_time),
                "host_free_time": _durations(&self.host_free_time),
            }
        finally:
            self._release()

    def reset_accumulated_stats(self):
        """Zero the allocated/freed totals and the timing totals and counts."""
        cdef int i
        self._acquire()
        for i in range(kBuckets):
            self.bucket_active[i].reset_accumulated()
            self.bucket_active_bytes[i].reset_accumulated()
        self.allocations.reset_accumulated()
        self.allocated_bytes.reset_accumulated()
        self.host_alloc_time.reset_accumulated()
        self.host_free_time.reset_accumulated()
        self._release()

    def reset_peak_stats(self):
        """Set every peak to its current value and the timing max/min to 0."""
        cdef int i
        self._acquire()
        for i in range(kBuckets):
            self.bucket_active[i].reset_peak()
            self.bucket_active_bytes[i].reset_peak()
        self.allocations.reset_peak()
        self.allocated_bytes.reset_peak()
        self.host_alloc_time.reset_peak()
        self.host_free_time.reset_peak()
        self._release()

    # ------------------------------------------------------------------ memory history

    def _set_history(self, size_t capacity, unsigned int skip_mask, bint clear, recorder,
                     bint alloc_stacks, bint free_stacks):
        """HostAllocator.record_memory_history's switch: keep at most `capacity` entries (0: off,
        the history cleared), not those whose bit 1 << action is in `skip_mask`; `recorder`
        gives stack ids at malloc (alloc_stacks) and free (free_stacks)."""
        self._acquire()
        if clear or capacity == 0:
            self.trace.entries.clear()
        self.trace.resize(capacity)
        self.trace.skip_mask = skip_mask
        self.stack_recorder = recorder
        self.alloc_stacks = alloc_stacks and recorder is not None
        self.free_stacks = free_stacks and recorder is not None
        self._release()

    def _history_entries(self):
        """The history, oldest first: (action name, address, bytes, stream, time_us, stack id)."""
        cdef HostTraceEntry e
        out = []
        self._acquire()
        try:
            for e in self.trace.entries:
                out.append((HOST_TRACE_ACTIONS[e.action], e.addr, e.size, e.stream, e.time_us,
                            e.stack_id))
        finally:
            self._release()
        return out

    def _block_records(self):
        """Every block as (address, bytes, state, stream, stack id), sorted (the snapshot's)."""
        cdef pair[uintptr_t, HostBlock*] p
        out = []
        self._acquire()
        try:
            for p in self.blocks:
                out.append((p.second.ptr, p.second.size, _state(p.second), p.second.stream,
                            p.second.stack_id))
        finally:
            self._release()
        return sorted(out)

    # ------------------------------------------------------------------ introspection

    def block_size(self, ptr):
        """The size in bytes of the live block at `ptr` (NotAllocatedError otherwise)."""
        cdef uintptr_t p = device_pointer(ptr)
        self._acquire()
        try:
            return self._live_block(p, "block_size").size
        finally:
            self._release()

    def block_list(self):
        """Every block as a sorted list of (address, bytes, state), state one of "allocated",
        "pending" (freed, events outstanding), "captured" (freed after a use captured into a
        CUDA graph: kept, never reused) or "free"."""
        cdef pair[uintptr_t, HostBlock*] p
        cdef HostBlock* b
        out = []
        self._acquire()
        try:
            for p in self.blocks:
                b = p.second
                out.append((b.ptr, b.size, _state(b)))
        finally:
            self._release()
        return sorted(out)

    def free_list_sizes(self):
        """{block size: idle blocks} for the non-empty free lists."""
        cdef int i
        return {(<size_t>1) << i: self.free_list[i].size()
                for i in range(kBuckets) if not self.free_list[i].empty()}

    @property
    def pending_events(self):
        """Events recorded at frees and not yet seen completed."""
        return self.events.size()

    # ------------------------------------------------------------------ background polling

    def poll_events(self):
        """Collect completed events now (what every allocation does first, or the background
        thread with pinned_use_background_threads)."""
        self._acquire()
        try:
            self._process_events(0)
            self.background_passes += 1
        finally:
            self._release()

    def _background_stopped(self, error):
        """The polling thread's last act when a poll raised: keep the error for the allocating
        thread (a thread's exception has no caller to reach) and let the thread end, since what
        failed would fail again every 100 us."""
        self.background_error = error

    cdef int _raise_background_error(self) except -1:
        error = self.background_error
        self.background_error = None
        self._thread = None             # the next miss starts a new one
        raise RuntimeError(
            f"pinned_use_background_threads: the thread polling pinned blocks' events stopped on "
            f"{type(error).__name__}: {error}; a new one starts at the next allocation that misses "
            f"the cache") from error

    cdef int _start_thread(self) except -1:
        import threading
        import weakref
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_poll_loop, args=(weakref.ref(self), self._stop),
                                        name="pyalloc-host-events", daemon=True)
        self._thread.start()
        return 0

    def close(self):
        """Stop the polling thread and free every cached block. Raises RuntimeError, changing
        nothing, while blocks are in use, waiting for events or kept for a CUDA graph (state
        "captured": kept for the process's life, as PyTorch keeps them)."""
        busy = [b for b in self.block_list() if b[2] != "free"]
        if busy:
            raise RuntimeError(f"HostCachingAllocator.close: {len(busy)} blocks are in use, wait "
                               f"for events or are kept for a CUDA graph (first: {busy[0][0]:#x}, "
                               f"{busy[0][1]} bytes, {busy[0][2]})")
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._stop = None
        self.empty_cache()
        cdef pair[int, vector[uintptr_t]] p
        cdef uintptr_t ev
        self._acquire()
        try:
            for p in self.event_pool:
                for ev in p.second:
                    self.device.event_destroy(ev)
            self.event_pool.clear()
        finally:
            self._release()


cdef dict _durations(DurationStat* d):
    return {"total": d.total, "max": d.max, "min": d.min, "count": d.count,
            "avg": d.total // d.count if d.count else 0}


def _poll_loop(ref, stop):
    """The background thread of pinned_use_background_threads: collect completed events every
    100 us (PyTorch's interval) while the allocator lives."""
    import time
    while not stop.is_set():
        alloc = ref()
        if alloc is None:
            return
        try:
            alloc.poll_events()
        except BaseException as error:
            alloc._background_stopped(error)
            return
        del alloc
        time.sleep(100e-6)
