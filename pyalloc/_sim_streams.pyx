# cython: language_level=3
"""SimDevice's streams and events: when simulated work runs, and what may still use memory.

It owns the work queues (per stream: items launched and completed), the cross-stream waits
(barriers) and the walks that complete work through them, the events and their device, stream
lifetime (create hands the most recently destroyed handle out again; a destroyed stream's queued
work runs on under an internal orphan handle), and the reuse sanitizer's use records with the
ordering walk (frontier) that decides whether a use is ordered before a stream's next work.
Counts are work items; positions are a stream's launched totals.

Capture is not here: SimDevice (_sim.pyx) asks _sim_capture first whether a stream captures or an
event is a capture event, and only otherwise calls in here. The errors raised here are the ones
SimDevice has always raised, word for word.
"""
from libc.stdint cimport uintptr_t, uint64_t, UINT64_MAX
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from cython.operator cimport dereference as deref
cimport cython

from pyalloc._backend cimport BACKEND_OK
from pyalloc.errors import CudaError, ReuseError
import collections

# Work still queued on a destroyed stream runs on under an internal handle from here up (no
# handle a caller uses), so that its events complete as that work does, whoever gets the handle.
cdef uintptr_t ORPHAN_STREAMS = <uintptr_t>1 << 63
# The internal handle of every destroyed stream whose work was all done (its StreamState says
# so for any target); orphans with work still queued get handles after it.
cdef uintptr_t DONE_STREAM = ORPHAN_STREAMS
# Streams of device d (d > 0) are numbered from d * DEVICE_STREAMS up; handles below
# DEVICE_STREAMS (0, the per-thread handles, small ints tests use) are every device's own.
cdef uintptr_t DEVICE_STREAMS = <uintptr_t>1 << 40


# ---------------------------------------------------------------- kernel uses (the reuse sanitizer)

cdef object _use(object u):
    """A kernel's use as given to launch: an address (an int, 1 byte) or (address, nbytes)."""
    if isinstance(u, tuple) or isinstance(u, list):
        if len(u) != 2:
            raise TypeError(f"SimDevice: a use is an address or (address, nbytes), got {u!r}")
        addr, nbytes = int(u[0]), int(u[1])
        if addr < 0 or nbytes <= 0:
            raise ValueError(f"SimDevice: a use (address, nbytes) needs an address >= 0 and "
                             f"nbytes > 0, got ({addr:#x}, {nbytes})")
        return (addr, nbytes)
    addr = int(u)
    if addr < 0:
        raise ValueError(f"SimDevice: a use's address must be >= 0, got {addr}")
    return addr


cdef tuple uses_of(object uses):
    return tuple([_use(u) for u in uses])


cdef list spans(tuple uses):
    """[start, end) byte ranges of normalized uses."""
    return [(u[0], u[0] + u[1]) if type(u) is tuple else (u, u + 1) for u in uses]


cdef str op_text(tuple op):
    """What queued a use, for ReuseError: ("launch", n, stream) or ("graph", handle, stream)."""
    if op[0] == "launch":
        return f"launch #{op[1]} on stream {op[2]}"
    return f"graph {op[1]} launched on stream {op[2]}"


# no_gc_clear: SimDevice's tables must outlive a collection that takes its allocator (see the note
# above SimDevice); this object is one of them.
@cython.no_gc_clear
@cython.final
cdef class Streams:
    """The streams and events of the SimDevice of ordinal `device`."""

    def __init__(self, int device, bint checks_reuse):
        self.device = device
        self.checks_reuse = checks_reuse
        self.uses = {}
        self.launches = 0
        self.next_stream = 1 + <uintptr_t>device * DEVICE_STREAMS if 0 < device < 4096 else 1
        self.first_stream = self.next_stream
        self.next_orphan = DONE_STREAM + 1
        self.streams[DONE_STREAM] = StreamState(UINT64_MAX, UINT64_MAX)
        self.next_event = 1

    # ---------------------------------------------------------------- stream lifetime

    cdef uintptr_t create(self):
        """A new stream handle: the most recently destroyed one first, as the driver does."""
        cdef uintptr_t s
        if not self.reusable.empty():
            s = self.reusable.back()
            self.reusable.pop_back()
            self.destroyed.erase(s)
        else:
            s = self.next_stream
            self.next_stream += 1
        self.streams[s] = StreamState(0, 0)
        return s

    cdef int destroy(self, uintptr_t stream, bint in_capture) except -1:
        """cuStreamDestroy (see SimDevice.destroy_stream); `in_capture`: the stream is in a live
        capture, which the driver refuses."""
        self.check_alive(stream, "cuStreamDestroy")
        if stream == 0 or stream >= ORPHAN_STREAMS or in_capture:
            raise CudaError("cuStreamDestroy", 400, "CUDA_ERROR_INVALID_HANDLE",
                            f"SimDevice: stream {stream} cannot be destroyed (the legacy stream, or "
                            "a stream in a capture)")
        cdef StreamState state = self.streams[stream]
        self.streams.erase(stream)
        cdef uintptr_t orphan = DONE_STREAM
        if state.completed < state.launched or self.queue(stream) != NULL:
            # Work (or waits) still queued: it lives on under an internal handle.
            orphan = self.next_orphan
            self.next_orphan += 1
            self.streams[orphan] = state
            if self.queue(stream) != NULL:
                self.barriers[orphan] = self.barriers[stream]
        # Else everything queued on it is done: its events and the waits on it follow
        # DONE_STREAM, whose work is all complete for good (no state kept per stream).
        self.barriers.erase(stream)
        if self.uses:
            # Its pending uses are those of the orphaned work (none when all of it is done).
            q = self.uses.pop(stream, None)
            if q is not None and orphan != DONE_STREAM:
                self.uses[orphan] = q
        # Events recorded on it and waits on it elsewhere now follow the orphaned work.
        cdef pair[uintptr_t, EventState] ev
        for ev in self.events:
            if ev.second.stream == stream:
                self.events[ev.first].stream = orphan
        cdef pair[uintptr_t, deque[Barrier]] queue
        cdef size_t i
        for queue in self.barriers:
            for i in range(queue.second.size()):
                if queue.second[i].stream == stream:
                    self.barriers[queue.first][i].stream = orphan
        self.destroyed.insert(stream)
        self.reusable.push_back(stream)
        return 0

    cdef int check_alive(self, uintptr_t stream, str call) except -1:
        """CudaError INVALID_HANDLE, named `call`, for a destroyed or never created stream."""
        if not self.destroyed.empty() and self.destroyed.count(stream):
            raise CudaError(call, 400, "CUDA_ERROR_INVALID_HANDLE",
                            f"SimDevice: stream {stream} was destroyed (cuStreamDestroy); a "
                            "driver may crash on such a handle")
        if stream > 2 and stream < ORPHAN_STREAMS and not (self.first_stream <= stream < self.next_stream):
            self.check_known(stream, call)
        return 0

    cdef int check_not_destroyed(self, uintptr_t stream, str call) except -1:
        """check_alive for destroyed handles only (capture_info's rule, see SimDevice)."""
        if not self.destroyed.empty() and self.destroyed.count(stream):
            self.check_alive(stream, call)
        return 0

    cdef int check_known(self, uintptr_t stream, str call) except -1:
        """CudaError INVALID_HANDLE for a handle of this device that create_stream never gave
        out (0, 1 and 2, the legacy and per-thread handles, are always valid; streams of other
        devices are theirs to know; internal orphan handles are not a caller's)."""
        if stream <= 2 or stream >= ORPHAN_STREAMS or self.any_handle:
            return 0
        cdef uintptr_t first = self.first_stream
        if first <= stream < self.next_stream or self.stream_device(stream) != self.device:
            return 0
        made = (f"create_stream gave out {first}..{self.next_stream - 1}"
                if self.next_stream > first else "create_stream gave out none yet")
        raise CudaError(call, 400, "CUDA_ERROR_INVALID_HANDLE",
                        f"SimDevice: stream {stream} was never created on device {self.device} "
                        f"({made}; 0, 1 and 2 are the legacy and per-thread default streams); a "
                        "driver may crash on such a handle")

    cdef int alive(self, uintptr_t stream) except -1:
        """Backend.stream_alive: 0 for a destroyed stream, 1 for a live one; CudaError
        INVALID_HANDLE for a handle of this device that create_stream never gave out."""
        if not self.destroyed.empty() and self.destroyed.count(stream):
            return 0
        if stream > 2 and stream < ORPHAN_STREAMS and not (self.first_stream <= stream < self.next_stream):
            self.check_known(stream, "cuStreamQuery")
        return 1

    cdef int stream_device(self, uintptr_t stream) noexcept:
        """The ordinal of the device `stream` belongs to (see SimDevice's module doc)."""
        if stream < DEVICE_STREAMS or stream >= ORPHAN_STREAMS:
            return self.device
        return <int>(stream // DEVICE_STREAMS)

    # ---------------------------------------------------------------- work and waits

    cdef StreamState* state(self, uintptr_t stream):
        # operator[] default-constructs: every int is a usable stream handle.
        return &self.streams[stream]

    cdef uint64_t launch(self, uintptr_t stream, uint64_t count, object uses) except? 0:
        """Queue `count` items on a stream not capturing; returns its launched total."""
        cdef StreamState* s = self.state(stream)
        s.launched += count
        cdef uint64_t launched = s.launched
        if self.checks_reuse:
            self.launches += 1
            if uses:
                self.queue_uses(stream, launched, uses_of(uses), ("launch", self.launches, stream))
        return launched

    cdef uint64_t advance(self, uintptr_t stream, uint64_t target) except? 0:
        """Complete work on `stream` up to `target` items, finishing awaited work first; returns
        the items completed."""
        cdef StreamState* s = self.state(stream)
        cdef deque[Barrier]* barriers
        cdef Barrier b
        cdef uint64_t start = s.completed
        if target > s.launched:
            target = s.launched
        while s.completed < target:
            barriers = self.queue(stream)
            if barriers != NULL and barriers.front().position <= s.completed:
                b = barriers.front()
                self.finish(b.stream, b.target, b.event_seq)
                barriers = self.queue(stream)
                if barriers != NULL:
                    barriers.pop_front()
                    if barriers.empty():
                        self.barriers.erase(stream)    # no empty queues: destroy walks them
                s = self.state(stream)
                continue
            if barriers != NULL and barriers.front().position < target:
                s.completed = barriers.front().position
            else:
                s.completed = target
        return s.completed - start

    cdef deque[Barrier]* queue(self, uintptr_t stream) noexcept:
        """The waits queued on `stream` not yet passed, or NULL when there are none."""
        cdef unordered_map[uintptr_t, deque[Barrier]].iterator it = self.barriers.find(stream)
        if it == self.barriers.end() or deref(it).second.empty():
            return NULL
        return &deref(it).second

    # A wait queued right after a stream's last work item has the same position as an event
    # recorded there; `seq` tells whether the wait came before the record (and so holds the event
    # back, as cudaStreamWaitEvent orders every later command) or after it. Following only
    # earlier waits also keeps these walks finite.

    cdef bint reached(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1:
        """True when the work queued on `stream` up to `target` items, and the waits queued
        there before `before_seq`, have completed."""
        if self.state(stream).completed < target:
            return False
        cdef deque[Barrier]* barriers = self.queue(stream)
        cdef Barrier b
        cdef size_t i = 0
        while barriers != NULL and i < barriers.size() and deref(barriers)[i].position <= target:
            b = deref(barriers)[i]
            if b.seq < before_seq and not self.reached(b.stream, b.target, b.event_seq):
                return False
            barriers = self.queue(stream)
            i += 1
        return True

    cdef int finish(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1:
        """Complete `stream` up to `target` items and the awaited work of the waits queued
        there before `before_seq`."""
        self.advance(stream, target)
        cdef deque[Barrier]* barriers = self.queue(stream)
        cdef Barrier b
        cdef size_t i = 0
        while barriers != NULL and i < barriers.size() and deref(barriers)[i].position <= target:
            b = deref(barriers)[i]
            if b.seq < before_seq:
                self.finish(b.stream, b.target, b.event_seq)
            barriers = self.queue(stream)
            i += 1
        return 0

    cdef int finish_stream(self, uintptr_t stream) except -1:
        """Complete everything queued on `stream` and what it waits for (cuStreamSynchronize)."""
        return self.finish(stream, self.state(stream).launched, self.seq + 1)

    cdef int finish_all(self) except -1:
        """Complete the work queued on every stream (synchronize, and the wait of segment_free)."""
        cdef vector[uintptr_t] streams
        cdef pair[uintptr_t, StreamState] p
        for p in self.streams:
            streams.push_back(p.first)
        for s in streams:
            self.advance(s, self.state(s).launched)
        return 0

    cdef int push_wait(self, uintptr_t stream, EventState* e) except -1:
        """Make work launched on `stream` from now on wait for the work before `e`'s record."""
        if not e.recorded or e.stream == stream:
            return 0
        self.seq += 1
        self.barriers[stream].push_back(
            Barrier(self.state(stream).launched, e.stream, e.target, self.seq, e.seq))
        return 0

    # ---------------------------------------------------------------- events

    cdef uintptr_t event_create(self, int device) except? 0:
        """A new event, not recorded, of device `device`; handles count up from 1."""
        cdef uintptr_t event = self.next_event
        self.events[event] = EventState(0, 0, False, 0, False, device)
        self.next_event += 1
        return event

    cdef EventState* event(self, uintptr_t event) except NULL:
        cdef unordered_map[uintptr_t, EventState].iterator it = self.events.find(event)
        if it == self.events.end():
            raise ValueError(f"SimDevice: unknown event handle {event}")
        return &deref(it).second

    cdef EventState* recordable(self, uintptr_t event, uintptr_t stream) except NULL:
        """The event, when it may be recorded on `stream` (an event and its stream must share a
        device), else CudaError INVALID_HANDLE."""
        cdef EventState* e = self.event(event)
        if e.device != self.stream_device(stream):
            raise CudaError("cuEventRecord", 400, "CUDA_ERROR_INVALID_HANDLE",
                            f"SimDevice: event {event} of device {e.device} cannot be recorded on "
                            f"stream {stream:#x} of device {self.stream_device(stream)} (an event "
                            "and its stream must share a context)")
        return e

    cdef int record(self, EventState* e, uintptr_t stream) except -1:
        """Record `e` on a stream not capturing: it completes with the work queued there now."""
        e.stream = stream
        e.target = self.state(stream).launched
        e.recorded = True
        self.seq += 1
        e.seq = self.seq
        return BACKEND_OK

    cdef int query(self, EventState* e) except -1:
        """1 when the work before `e`'s record (and the waits it had) completed, else 0."""
        if not e.recorded:
            return 1
        return 1 if self.reached(e.stream, e.target, e.seq) else 0

    # ---------------------------------------------------------------- the reuse sanitizer
    #
    # With check_reuse, each launch outside capture (and each graph launch) that names uses
    # queues (position, spans, op) on its stream's deque in `uses`: the spans are pending until
    # the stream has completed `position` items (the stream's queued total after that launch).
    # Positions grow along a deque, so completed uses are popped from its front, lazily: when
    # the stream queues another use, and at each check_handout.

    cdef int queue_uses(self, uintptr_t stream, uint64_t position, tuple uses,
                        tuple op) except -1:
        cdef uint64_t completed = self.state(stream).completed
        if position <= completed:           # (no work: nothing left to use the memory)
            return 0
        q = self.uses.get(stream)
        if q is None:
            q = self.uses[stream] = collections.deque()
        else:
            while q and q[0][0] <= completed:
                q.popleft()
        q.append((position, spans(uses), op))
        return 0

    cdef dict frontier(self, uintptr_t stream):
        """{stream X: items of X that complete before `stream`'s next work}, through the waits
        queued on `stream` so far and, transitively, the waits those awaited streams had queued
        before each awaited event was recorded (reached's rules)."""
        front = {}
        seen = {}           # stream -> [(target, before_seq)] walked already
        stack = [(stream, self.state(stream).launched, UINT64_MAX)]
        cdef deque[Barrier]* barriers
        cdef Barrier b
        cdef size_t i
        cdef uintptr_t y
        cdef uint64_t target, before
        while stack:
            y, target, before = stack.pop()
            walked = seen.get(y)
            if walked is None:
                walked = seen[y] = []
            elif any(t >= target and bs >= before for t, bs in walked):
                continue    # a walk of y as far or farther found all this one would
            walked.append((target, before))
            if front.get(y, 0) < target:
                front[y] = target
            barriers = self.queue(y)
            if barriers == NULL:
                continue
            for i in range(barriers.size()):
                b = deref(barriers)[i]
                if b.position > target:
                    break
                if b.seq < before:
                    stack.append((b.stream, b.target, b.event_seq))
        return front

    cdef int check_uses(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1:
        """The queued-work half of SimDevice.check_handout: ReuseError for a use of
        [ptr, ptr + nbytes) queued on another stream and not ordered before `stream`'s next
        work. Also prunes the completed uses."""
        cdef uintptr_t end = ptr + nbytes
        cdef uintptr_t x
        cdef uint64_t completed
        front = None
        if not self.uses:
            return 0
        for x in list(self.uses):
            q = self.uses[x]
            completed = self.state(x).completed
            while q and q[0][0] <= completed:
                q.popleft()
            if not q:
                del self.uses[x]
                continue
            if x == stream:
                continue
            for position, sp, op in q:
                for start, stop in sp:
                    if start < end and ptr < stop:
                        if front is None:
                            front = self.frontier(stream)
                        if front.get(x, 0) >= position:
                            break
                        self.reuse_error(ptr, nbytes, stream, x, position, start, stop, op)
        return 0

    cdef int reuse_error(self, uintptr_t ptr, size_t nbytes, uintptr_t stream, uintptr_t x,
                         uint64_t position, start, stop, tuple op) except -1:
        cdef StreamState* st = self.state(x)
        what = op_text(op)
        if x == op[2]:
            where = f"stream {x} has completed {st.completed} of its items and this use ends at item {position}"
        else:
            where = (f"stream {op[2]} was destroyed; its work runs on and has completed "
                     f"{st.completed} of its items, this use ending at item {position}")
        raise ReuseError(
            f"SimDevice reuse check: block {ptr:#x} (+{nbytes} bytes) handed out for stream "
            f"{stream} while {what} still uses [{start:#x}, {stop:#x}) ({where}), and no wait "
            f"of stream {stream} orders that work before stream {stream}'s next work",
            ptr=ptr, nbytes=nbytes, stream=stream, use_stream=op[2], operation=what)

    cdef int check_unmap(self, uintptr_t addr, size_t nbytes) except -1:
        """The reuse sanitizer's check of an unmap: ReuseError when queued work on any stream
        (its own included: the unmap is not stream-ordered) still uses [addr, addr + nbytes);
        on a GPU that work would fault."""
        cdef uintptr_t end = addr + nbytes
        for x, position, spans, what in self.pending_uses():
            for start, stop in spans:
                if start < end and addr < stop:
                    raise ReuseError(
                        f"SimDevice reuse check: [{addr:#x}, {end:#x}) unmapped while {what} still "
                        f"uses [{start:#x}, {stop:#x}) (stream {x} has completed "
                        f"{self.state(x).completed} of its items and this use ends at item {position})",
                        ptr=addr, nbytes=nbytes, stream=x, use_stream=x, operation=what)
        return 0

    cdef list pending_uses(self):
        """SimDevice.pending_uses: (stream, end item, [(start, end)], what queued it)."""
        out = []
        for x in list(self.uses):
            q = self.uses[x]
            while q and q[0][0] <= self.state(x).completed:
                q.popleft()
            if not q:
                del self.uses[x]
            for position, sp, op in q:
                out.append((x, position, list(sp), op_text(op)))
        return out
