# cython: language_level=3
"""SimDevice: a deterministic simulated CUDA device.

It is a real backend, not a test double: `pyalloc replay` and `pyalloc tune` run on it. It models

* device memory: a total capacity (bytes), live segments, out of memory when they would exceed it;
* addresses: deterministic first-fit in a 2 MiB aligned address range, or addresses the caller
  queued with `place_segments` (how a replay puts segments where PyTorch's driver put them);
* streams with pending work: `launch(stream)` queues a unit of work, `complete(stream)` finishes
  queued work in order, `synchronize()` finishes everything;
* events that complete only when the work queued on their stream before the record completes;
* cross-stream waits: work launched on a stream after `wait_event` cannot complete before the event;
* virtual memory for expandable segments: address-space reservations (deterministic, or queued with
  `place_reservations`) whose 2 MiB pages are mapped to physical memory and unmapped on demand;
  mapped pages count against the same capacity as segments.

Every backend call is counted in `counters`, so tests can prove a cache hit makes none.
"""
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.map cimport map as cppmap
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec

from pyalloc._backend cimport Backend, BACKEND_OK, BACKEND_OOM

cdef size_t MiB = 1 << 20
cdef size_t GiB = 1 << 30
cdef size_t TOP_DOWN_RANGE = <size_t>1 << 40    # top_down places segments below base_address + this
cdef size_t GRANULE = 2 * MiB      # mapping granularity of the simulated virtual memory


cdef struct Barrier:
    uint64_t position      # index of the first work item that must wait
    uintptr_t stream       # stream of the awaited event
    uint64_t target        # work count that stream must reach
    uint64_t seq           # when the wait was queued (device-wide order of records and waits)
    uint64_t event_seq     # when the awaited event was recorded


cdef struct StreamState:
    uint64_t launched      # work items queued so far
    uint64_t completed     # work items finished so far (a prefix of the queue)


cdef struct EventState:
    uintptr_t stream
    uint64_t target        # completed count the stream must reach; 0 = never recorded
    bint recorded
    uint64_t seq           # when it was last recorded


cdef class SimDevice(Backend):
    """A simulated device. Sizes are bytes; handles (streams, events, addresses) are ints.

    Args:
        total_memory: device capacity in bytes (default 80 GiB).
        device: device ordinal reported to the allocator (default 0).
        base_address: lowest address handed out for segments (default 0x7f0000000000).
        alignment: alignment of segment addresses in bytes (default 2 MiB, like cudaMalloc).
        top_down: where a new segment goes when no address is queued for it (place_segments).
            False (default): the lowest free address from base_address up. True: the highest free
            address below base_address + 1 TiB, as the CUDA driver tends to hand them out. Best
            fit breaks ties between equal free blocks by address, so this choice changes which
            blocks get split: with top_down, replays of the H200 traces in tests/data under
            settings other than the recorded one reproduce PyTorch's peaks for those settings
            (first fit missed one by 2.9%).

    Attributes: counters (calls per backend operation); segment_alloc_hook, a callable(nbytes)
    run at the start of every segment allocation (None by default), where a test can look at the
    allocator in the middle of one (e.g. what other threads can do while the "driver" allocates).
    """

    cdef readonly size_t total_memory
    cdef readonly size_t used_memory
    cdef readonly uintptr_t base_address
    cdef readonly bint top_down
    cdef readonly size_t alignment
    cdef cppmap[uintptr_t, size_t] _segments          # live segments: address -> bytes
    cdef dict _placements                              # bytes -> list of queued addresses
    cdef Py_ssize_t _pending_placements
    cdef unordered_map[uintptr_t, StreamState] _streams
    cdef unordered_map[uintptr_t, deque[Barrier]] _barriers
    cdef unordered_map[uintptr_t, EventState] _events
    cdef cppmap[uintptr_t, size_t] _reservations        # reserved address ranges: base -> bytes
    cdef unordered_set[uintptr_t] _mapped_pages         # granule addresses currently mapped
    cdef dict _reservation_placements                  # bytes -> list of queued base addresses
    cdef readonly uintptr_t reservation_base
    cdef uintptr_t _next_stream
    cdef uintptr_t _next_event
    cdef uint64_t _seq                                 # orders event records and waits
    cdef public dict counters
    cdef public object segment_alloc_hook              # callable(nbytes) or None, see the class doc

    def __init__(self, size_t total_memory=80 * GiB, *, int device=0,
                 uintptr_t base_address=0x7f0000000000, size_t alignment=2 * MiB, bint top_down=False):
        if total_memory == 0:
            raise ValueError("total_memory must be a positive number of bytes, got 0")
        if alignment == 0 or (alignment & (alignment - 1)) != 0:
            raise ValueError(f"alignment must be a power of two in bytes, got {alignment}")
        self.device = device
        self.kind = "sim"
        self.total_memory = total_memory
        self.used_memory = 0
        self.base_address = base_address
        self.alignment = alignment
        self.top_down = top_down
        self._placements = {}
        self._reservation_placements = {}
        self.reservation_base = 0x200000000000
        self._pending_placements = 0
        self._next_stream = 1
        self._next_event = 1
        self.counters = dict.fromkeys(
            ("segment_alloc", "segment_free", "memory_info", "event_create", "event_record",
             "event_query", "event_synchronize", "event_destroy", "stream_synchronize",
             "device_synchronize", "vm_reserve", "vm_release", "vm_map", "vm_unmap"), 0)

    def __repr__(self):
        return (f"SimDevice(total_memory={self.total_memory}, device={self.device}, "
                f"used_memory={self.used_memory}, segments={self._segments.size()})")

    # ---------------------------------------------------------------- placement and segments

    def place_segments(self, placements):
        """Queue addresses for future segments: an iterable of (address, size_bytes).

        A later segment allocation of exactly `size_bytes` takes the oldest queued address of that
        size; sizes with nothing queued fall back to first-fit placement.
        """
        items = [(int(a), int(s)) for a, s in placements]
        for addr, size in items:
            if addr <= 0 or size <= 0:
                raise ValueError(f"placement ({addr:#x}, {size}) needs a positive address and size")
        for addr, size in items:
            self._placements.setdefault(size, []).append(addr)
        self._pending_placements += len(items)

    @property
    def pending_placements(self):
        """Number of queued segment addresses not used yet."""
        return self._pending_placements

    def segments(self):
        """Live segments as a sorted list of (address, size_bytes)."""
        return [(p.first, p.second) for p in self._segments]

    cdef bint _overlaps(self, uintptr_t addr, size_t nbytes):
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.upper_bound(addr)
        if it != self._segments.end() and deref(it).first < addr + nbytes:
            return True
        if it != self._segments.begin():
            dec(it)
            if deref(it).first + deref(it).second > addr:
                return True
        return False

    cdef uintptr_t _first_fit(self, size_t nbytes):
        cdef uintptr_t cursor = self.base_address
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.lower_bound(cursor)
        while it != self._segments.end():
            if deref(it).first >= cursor + nbytes:
                break
            if deref(it).first + deref(it).second > cursor:
                cursor = deref(it).first + deref(it).second
                cursor = (cursor + self.alignment - 1) & ~(self.alignment - 1)
            inc(it)
        return cursor

    cdef uintptr_t _top_fit(self, size_t nbytes):
        # Highest aligned address below base + 1 TiB where nbytes fit; first fit if none does.
        cdef uintptr_t top = self.base_address + TOP_DOWN_RANGE
        if nbytes > TOP_DOWN_RANGE:
            return self._first_fit(nbytes)
        cdef uintptr_t addr = (top - nbytes) & ~(self.alignment - 1)
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.lower_bound(top)
        cdef uintptr_t start, end
        while it != self._segments.begin():
            dec(it)
            start = deref(it).first
            end = start + deref(it).second
            if end <= addr:
                break
            if start < addr + nbytes:          # overlaps: go below this segment
                if start < self.base_address + nbytes:
                    return self._first_fit(nbytes)
                addr = (start - nbytes) & ~(self.alignment - 1)
        if addr < self.base_address:
            return self._first_fit(nbytes)
        return addr

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        self.counters["segment_alloc"] += 1
        if self.segment_alloc_hook is not None:
            self.segment_alloc_hook(nbytes)
        if nbytes > self.total_memory - self.used_memory:
            return BACKEND_OOM
        cdef uintptr_t addr
        queue = self._placements.get(nbytes)
        if queue:
            addr = queue.pop(0)
            self._pending_placements -= 1
            if self._overlaps(addr, nbytes):
                raise RuntimeError(
                    f"SimDevice: placed segment {addr:#x} (+{nbytes} bytes) overlaps a live segment; "
                    "the placement queue does not match this allocation sequence")
        elif self.top_down:
            addr = self._top_fit(nbytes)
        else:
            addr = self._first_fit(nbytes)
        self._segments[addr] = nbytes
        self.used_memory += nbytes
        ptr[0] = addr
        return BACKEND_OK

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        self.counters["segment_free"] += 1
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.find(ptr)
        if it == self._segments.end() or deref(it).second != nbytes:
            raise RuntimeError(f"SimDevice: free of {ptr:#x} ({nbytes} bytes), which is not a live segment")
        self._segments.erase(it)
        self.used_memory -= nbytes
        return BACKEND_OK

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        self.counters["memory_info"] += 1
        free_bytes[0] = self.total_memory - self.used_memory
        total_bytes[0] = self.total_memory
        return BACKEND_OK

    def mem_get_info(self):
        """(free_bytes, total_bytes), like cudaMemGetInfo."""
        return self.total_memory - self.used_memory, self.total_memory

    # ---------------------------------------------------------------- virtual memory

    def place_reservations(self, placements):
        """Queue base addresses for future address-space reservations: (address, size_bytes) pairs.

        A later reservation of exactly `size_bytes` takes the oldest queued address of that size
        (how a replay puts expandable segments where PyTorch's driver put them).
        """
        items = [(int(a), int(s)) for a, s in placements]
        for addr, size in items:
            if addr <= 0 or size <= 0 or addr % GRANULE:
                raise ValueError(f"reservation ({addr:#x}, {size}) needs a positive, 2 MiB aligned address and size")
        for addr, size in items:
            self._reservation_placements.setdefault(size, []).append(addr)

    @property
    def mapped_memory(self):
        """Bytes of physical memory mapped into reservations."""
        return self._mapped_pages.size() * GRANULE

    def is_mapped(self, uintptr_t addr, size_t nbytes):
        """True when every 2 MiB page touching [addr, addr + nbytes) is mapped."""
        cdef uintptr_t page = addr & ~(GRANULE - 1)
        while page < addr + nbytes:
            if not self._mapped_pages.count(page):
                return False
            page += GRANULE
        return True

    def reservations(self):
        """Live reservations as a sorted list of (base address, size_bytes)."""
        return [(p.first, p.second) for p in self._reservations]

    cdef int vm_granularity(self, size_t* nbytes) except -1:
        nbytes[0] = GRANULE
        return BACKEND_OK

    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1:
        self.counters["vm_reserve"] += 1
        if nbytes == 0 or nbytes % GRANULE:
            raise ValueError(f"SimDevice: reservation of {nbytes} bytes is not a multiple of 2 MiB")
        cdef uintptr_t addr
        cdef cppmap[uintptr_t, size_t].iterator it
        queue = self._reservation_placements.get(nbytes)
        if queue:
            addr = queue.pop(0)
        else:
            # First fit above reservation_base, past every live reservation.
            addr = self.reservation_base
            it = self._reservations.begin()
            while it != self._reservations.end():
                if deref(it).first < addr + nbytes and deref(it).first + deref(it).second > addr:
                    addr = deref(it).first + deref(it).second
                inc(it)
        self._reservations[addr] = nbytes
        base[0] = addr
        return BACKEND_OK

    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1:
        self.counters["vm_release"] += 1
        cdef cppmap[uintptr_t, size_t].iterator it = self._reservations.find(base)
        if it == self._reservations.end() or deref(it).second != nbytes:
            raise RuntimeError(f"SimDevice: release of {base:#x} ({nbytes} bytes), which is not a reservation")
        cdef uintptr_t page = base
        while page < base + nbytes:
            if self._mapped_pages.count(page):
                raise RuntimeError(f"SimDevice: release of reservation {base:#x} with page {page:#x} still mapped")
            page += GRANULE
        self._reservations.erase(it)
        return BACKEND_OK

    cdef int _check_range(self, uintptr_t addr, size_t nbytes, str what) except -1:
        if nbytes == 0 or addr % GRANULE or nbytes % GRANULE:
            raise ValueError(f"SimDevice: {what} of {nbytes} bytes at {addr:#x} is not whole 2 MiB pages")
        cdef cppmap[uintptr_t, size_t].iterator it = self._reservations.upper_bound(addr)
        if it == self._reservations.begin():
            raise RuntimeError(f"SimDevice: {what} at {addr:#x} outside every reservation")
        dec(it)
        if addr + nbytes > deref(it).first + deref(it).second:
            raise RuntimeError(f"SimDevice: {what} at {addr:#x} (+{nbytes}) runs past its reservation")
        return 0

    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page_size) except -1:
        self.counters["vm_map"] += 1
        self._check_range(addr, nbytes, "map")
        if nbytes > self.total_memory - self.used_memory:
            return BACKEND_OOM
        cdef uintptr_t page = addr
        while page < addr + nbytes:
            if self._mapped_pages.count(page):
                raise RuntimeError(f"SimDevice: page {page:#x} mapped twice")
            page += GRANULE
        page = addr
        while page < addr + nbytes:
            self._mapped_pages.insert(page)
            page += GRANULE
        self.used_memory += nbytes
        return BACKEND_OK

    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page_size) except -1:
        self.counters["vm_unmap"] += 1
        self._check_range(addr, nbytes, "unmap")
        cdef uintptr_t page = addr
        while page < addr + nbytes:
            if not self._mapped_pages.count(page):
                raise RuntimeError(f"SimDevice: unmap of page {page:#x}, which is not mapped")
            page += GRANULE
        page = addr
        while page < addr + nbytes:
            self._mapped_pages.erase(page)
            page += GRANULE
        self.used_memory -= nbytes
        return BACKEND_OK

    # ---------------------------------------------------------------- streams and work

    def create_stream(self):
        """A new stream handle (a positive int; 0 is the default stream)."""
        cdef uintptr_t s = self._next_stream
        self._next_stream += 1
        self._streams[s] = StreamState(0, 0)
        return s

    cdef StreamState* _stream(self, uintptr_t stream):
        # operator[] default-constructs: every int is a usable stream handle.
        return &self._streams[stream]

    def launch(self, uintptr_t stream=0, uint64_t count=1):
        """Queue `count` units of work on `stream`; returns the stream's queued total."""
        cdef StreamState* s = self._stream(stream)
        s.launched += count
        return s.launched

    def pending(self, uintptr_t stream=0):
        """Units of work queued on `stream` and not completed."""
        cdef StreamState* s = self._stream(stream)
        return s.launched - s.completed

    cdef uint64_t _advance(self, uintptr_t stream, uint64_t target) except? 0:
        """Complete work on `stream` up to `target` items, finishing awaited work first."""
        cdef StreamState* s = self._stream(stream)
        cdef deque[Barrier]* barriers
        cdef Barrier b
        cdef uint64_t start = s.completed
        if target > s.launched:
            target = s.launched
        while s.completed < target:
            barriers = &self._barriers[stream]
            if not barriers.empty() and barriers.front().position <= s.completed:
                b = barriers.front()
                self._finish(b.stream, b.target, b.event_seq)
                barriers = &self._barriers[stream]
                barriers.pop_front()
                s = self._stream(stream)
                continue
            if not barriers.empty() and barriers.front().position < target:
                s.completed = barriers.front().position
            else:
                s.completed = target
        return s.completed - start

    # A wait queued right after a stream's last work item has the same position as an event
    # recorded there; `seq` tells whether the wait came before the record (and so holds the event
    # back, as cudaStreamWaitEvent orders every later command) or after it. Following only
    # earlier waits also keeps these walks finite.

    cdef bint _reached(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1:
        """True when the work queued on `stream` up to `target` items, and the waits queued
        there before `before_seq`, have completed."""
        if self._stream(stream).completed < target:
            return False
        cdef deque[Barrier]* barriers = &self._barriers[stream]
        cdef Barrier b
        cdef size_t i = 0
        while i < barriers.size() and deref(barriers)[i].position <= target:
            b = deref(barriers)[i]
            if b.seq < before_seq and not self._reached(b.stream, b.target, b.event_seq):
                return False
            barriers = &self._barriers[stream]
            i += 1
        return True

    cdef int _finish(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1:
        """Complete `stream` up to `target` items and the awaited work of the waits queued
        there before `before_seq`."""
        self._advance(stream, target)
        cdef deque[Barrier]* barriers = &self._barriers[stream]
        cdef Barrier b
        cdef size_t i = 0
        while i < barriers.size() and deref(barriers)[i].position <= target:
            b = deref(barriers)[i]
            if b.seq < before_seq:
                self._finish(b.stream, b.target, b.event_seq)
            barriers = &self._barriers[stream]
            i += 1
        return 0

    def complete(self, uintptr_t stream=0, count=None):
        """Finish queued work on `stream` in order (all of it by default, else `count` items).

        Work that waits on another stream's event finishes that stream's awaited work first, as
        the GPU would. Returns the number of items of `stream` completed.
        """
        cdef StreamState* s = self._stream(stream)
        cdef uint64_t target = s.launched if count is None else min(s.completed + <uint64_t>count, s.launched)
        return self._advance(stream, target)

    def synchronize(self):
        """Finish all queued work on every stream (cudaDeviceSynchronize)."""
        cdef vector[uintptr_t] streams
        cdef pair[uintptr_t, StreamState] p
        for p in self._streams:
            streams.push_back(p.first)
        for s in streams:
            self._advance(s, self._stream(s).launched)

    cdef int device_synchronize(self) except -1:
        self.counters["device_synchronize"] += 1
        self.synchronize()
        return BACKEND_OK

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        self.counters["stream_synchronize"] += 1
        self._finish(stream, self._stream(stream).launched, self._seq + 1)
        return BACKEND_OK

    # ---------------------------------------------------------------- events

    cdef int event_create(self, uintptr_t* event) except -1:
        self.counters["event_create"] += 1
        event[0] = self._next_event
        self._events[self._next_event] = EventState(0, 0, False, 0)
        self._next_event += 1
        return BACKEND_OK

    cdef EventState* _event(self, uintptr_t event) except NULL:
        cdef unordered_map[uintptr_t, EventState].iterator it = self._events.find(event)
        if it == self._events.end():
            raise ValueError(f"SimDevice: unknown event handle {event}")
        return &deref(it).second

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        self.counters["event_record"] += 1
        cdef EventState* e = self._event(event)
        e.stream = stream
        e.target = self._stream(stream).launched
        e.recorded = True
        self._seq += 1
        e.seq = self._seq
        return BACKEND_OK

    cdef int event_query(self, uintptr_t event) except -1:
        self.counters["event_query"] += 1
        cdef EventState* e = self._event(event)
        if not e.recorded:
            return 1
        return 1 if self._reached(e.stream, e.target, e.seq) else 0

    cdef int event_synchronize(self, uintptr_t event) except -1:
        self.counters["event_synchronize"] += 1
        cdef EventState* e = self._event(event)
        if e.recorded:
            self._finish(e.stream, e.target, e.seq)
        return BACKEND_OK

    cdef int event_destroy(self, uintptr_t event) except -1:
        self.counters["event_destroy"] += 1
        self._event(event)
        self._events.erase(event)
        return BACKEND_OK

    def record_event(self, uintptr_t stream=0):
        """Create an event and record it on `stream` now; returns its handle."""
        cdef uintptr_t ev
        self.event_create(&ev)
        self.event_record(ev, stream)
        return ev

    def event_done(self, uintptr_t event):
        """True when the work queued before the event's record has completed."""
        return self.event_query(event) == 1

    def wait_event(self, uintptr_t stream, uintptr_t event):
        """Make work launched on `stream` from now on wait for `event` (cudaStreamWaitEvent)."""
        cdef EventState* e = self._event(event)
        if not e.recorded or e.stream == stream:
            return
        self._seq += 1
        self._barriers[stream].push_back(
            Barrier(self._stream(stream).launched, e.stream, e.target, self._seq, e.seq))
