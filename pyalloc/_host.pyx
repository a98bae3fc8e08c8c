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
* empty_cache frees only blocks in the free lists (idle), never one in use or waiting for events;
* on a miss, memory comes from cuMemHostAlloc, or with pinned_use_cuda_host_register from malloc
  whose pages `pinned_num_register_threads` threads touch before cuMemHostRegister, or first from
  the reserve segment (pinned_reserve_segment_size_mb), one allocation made on the first miss and
  carved into 4 KiB-rounded blocks; a block carved from it is never freed (as in PyTorch, its
  range is not reused after empty_cache drops it).

Statistics have PyTorch's host_memory_stats keys and meanings (see HostCachingAllocator.stats).
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
    const int kBuckets
    int size_index(size_t size)
    size_t power_of_two_ceil(size_t n)
    void erase_at(EventQueue& q, size_t i)
    int64_t now_us()


cdef size_t RESERVE_ROUND = 4096
cdef size_t MAX_BLOCK = (<size_t>1) << 60       # request_size refuses more


def _stat_dict(int64_t current, int64_t peak, int64_t allocated, int64_t freed):
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


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
    # Statistics, kept as PyTorch keeps them: handed-out blocks per bucket (allocation, bytes),
    # every block (segment, reserved bytes), time in the driver's allocation and free calls.
    cdef Stat bucket_allocation[64]
    cdef Stat bucket_bytes[64]
    cdef Stat segment
    cdef Stat reserved_bytes
    cdef DurationStat host_alloc_time
    cdef DurationStat host_free_time
    # The reserve segment (pinned_reserve_segment_size_mb), made on the first miss.
    cdef bint reserve_ready
    cdef uintptr_t reserve_start
    cdef uintptr_t reserve_next
    cdef int reserve_origin
    cdef object _thread
    cdef object _stop
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

    def malloc(self, nbytes):
        """A pinned block of at least `nbytes` bytes (the next power of two); returns its address
        (an int), 0 for 0 bytes. Raises CudaError when the driver cannot allocate (nothing
        changed), ValueError/TypeError for a bad size."""
        cdef size_t n = request_size(nbytes)
        cdef uintptr_t ptr
        if n == 0:
            return 0
        self._acquire()
        try:
            ptr = self._allocate(n)
        finally:
            self._release()
        return ptr

    cdef uintptr_t _allocate(self, size_t n) except? 0:
        cdef size_t size = power_of_two_ceil(n)
        cdef int index = size_index(size)
        cdef HostBlock* block
        if not self.use_background_threads and not self.events.empty():
            self._process_events(0)
        block = self._take_free(index)
        if block == NULL and self.use_background_threads:
            self._process_events(size)
            block = self._take_free(index)
            if self._thread is None:
                self._start_thread()
        if block == NULL:
            block = self._new_block(size)
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
        self.bucket_allocation[index].increase(1)
        self.bucket_bytes[index].increase(block.size)
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
        self.segment.increase(1)
        self.reserved_bytes.increase(size)
        cdef int index = size_index(size)
        self.bucket_allocation[index].increase(1)
        self.bucket_bytes[index].increase(size)
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
        cdef int index = size_index(block.size)
        self.free_list[index].push_back(block)
        self.bucket_allocation[index].decrease(1)
        self.bucket_bytes[index].decrease(block.size)
        return True

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
        is reusable once the events recorded now on those streams completed. Raises
        NotAllocatedError for an address malloc did not return, AlreadyFreedError for a double
        free, CudaError when an event cannot be recorded (the block stays allocated)."""
        cdef uintptr_t p = device_pointer(ptr)
        if p == 0:
            return
        self._acquire()
        try:
            self._free(p)
        finally:
            self._release()

    cdef int _free(self, uintptr_t p) except -1:
        cdef HostBlock* block = self._live_block(p, "free")
        cdef int index
        cdef vector[PendingEvent] recorded
        cdef PendingEvent e
        cdef size_t i
        if block.streams.empty():
            block.allocated = False
            index = size_index(block.size)
            self.free_list[index].push_back(block)
            self.bucket_allocation[index].decrease(1)
            self.bucket_bytes[index].decrease(block.size)
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
        return 0

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
        self.segment.decrease(1)
        self.reserved_bytes.decrease(block.size)
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
        """Statistics as torch.cuda.host_memory_stats_as_nested_dict() gives them:

        * allocation, allocated_bytes: blocks (bytes) handed out and not yet back in a free list
          (a freed block waiting for events still counts), each a dict of current, peak,
          allocated (total increase) and freed (total decrease); the peak is the sum of the
          per-size peaks, as PyTorch reports it;
        * segment, reserved_bytes: every block held (bytes), idle ones included;
        * num_host_alloc, num_host_free: blocks made and released (segment.allocated, .freed);
        * host_alloc_time, host_free_time: microseconds in the driver's allocation and free
          calls (the reserve segment's own allocation included): total, max, min, count, avg.
        """
        cdef Stat allocation, allocated_bytes
        cdef int i
        self._acquire()
        try:
            for i in range(kBuckets):
                allocation.current += self.bucket_allocation[i].current
                allocation.peak += self.bucket_allocation[i].peak
                allocation.allocated += self.bucket_allocation[i].allocated
                allocation.freed += self.bucket_allocation[i].freed
                allocated_bytes.current += self.bucket_bytes[i].current
                allocated_bytes.peak += self.bucket_bytes[i].peak
                allocated_bytes.allocated += self.bucket_bytes[i].allocated
                allocated_bytes.freed += self.bucket_bytes[i].freed
            return {
                "allocation": _stat_dict(allocation.current, allocation.peak,
                                         allocation.allocated, allocation.freed),
                "segment": _stat_dict(self.segment.current, self.segment.peak,
                                      self.segment.allocated, self.segment.freed),
                "allocated_bytes": _stat_dict(allocated_bytes.current, allocated_bytes.peak,
                                              allocated_bytes.allocated, allocated_bytes.freed),
                "reserved_bytes": _stat_dict(self.reserved_bytes.current, self.reserved_bytes.peak,
                                             self.reserved_bytes.allocated, self.reserved_bytes.freed),
                "num_host_alloc": self.segment.allocated,
                "num_host_free": self.segment.freed,
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
            self.bucket_allocation[i].reset_accumulated()
            self.bucket_bytes[i].reset_accumulated()
        self.segment.reset_accumulated()
        self.reserved_bytes.reset_accumulated()
        self.host_alloc_time.reset_accumulated()
        self.host_free_time.reset_accumulated()
        self._release()

    def reset_peak_stats(self):
        """Set every peak to its current value and the timing max/min to 0."""
        cdef int i
        self._acquire()
        for i in range(kBuckets):
            self.bucket_allocation[i].reset_peak()
            self.bucket_bytes[i].reset_peak()
        self.segment.reset_peak()
        self.reserved_bytes.reset_peak()
        self.host_alloc_time.reset_peak()
        self.host_free_time.reset_peak()
        self._release()

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
        "pending" (freed, events outstanding) or "free"."""
        cdef pair[uintptr_t, HostBlock*] p
        cdef HostBlock* b
        out = []
        self._acquire()
        try:
            for p in self.blocks:
                b = p.second
                out.append((b.ptr, b.size, "allocated" if b.allocated else
                            "pending" if b.event_count else "free"))
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
        nothing, while blocks are in use or waiting for events."""
        busy = [b for b in self.block_list() if b[2] != "free"]
        if busy:
            raise RuntimeError(f"HostCachingAllocator.close: {len(busy)} blocks are in use or wait "
                               f"for events (first: {busy[0][0]:#x}, {busy[0][1]} bytes)")
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
        except Exception:
            pass            # e.g. a capture forbids queries now: the allocating thread will see it
        del alloc
        time.sleep(100e-6)
