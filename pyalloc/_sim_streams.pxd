# SimDevice's streams and events (_sim_streams.pyx): work queues, cross-stream waits, events,
# stream lifetime with destroyed and orphaned handles, and the reuse sanitizer's use records.
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from libcpp.deque cimport deque


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
    bint captured          # last recorded in a capture: Captures.event_capture holds its nodes
    int device             # the device it was created for


# Kernel uses as launch takes them (an address: 1 byte, or (address, nbytes)), checked and
# normalized; their [start, end) byte ranges; and what queued them, in words, for ReuseError.
cdef tuple uses_of(object uses)
cdef list spans(tuple uses)
cdef str op_text(tuple op)


cdef class Streams:
    cdef int device                            # the owning SimDevice's ordinal
    cdef bint checks_reuse                     # SimDevice(check_reuse=True)
    cdef unordered_map[uintptr_t, StreamState] streams
    cdef unordered_map[uintptr_t, deque[Barrier]] barriers
    cdef unordered_map[uintptr_t, EventState] events
    cdef uintptr_t next_stream
    cdef uintptr_t first_stream                # the first handle create gives out
    cdef bint any_handle                       # SimDevice(any_stream=True): every handle is known
    cdef unordered_set[uintptr_t] destroyed    # handles destroyed and not handed out again
    cdef vector[uintptr_t] reusable            # the same, most recently destroyed last
    cdef uintptr_t next_orphan                 # internal handles of destroyed streams' work
    cdef uintptr_t next_event
    cdef uint64_t seq                          # orders event records and waits
    # The reuse sanitizer (check_reuse). Untouched when it is off.
    cdef dict uses                             # stream -> deque of (position, spans, op)
    cdef uint64_t launches                     # launch calls so far, captured ones too (names them)

    # Stream lifetime and handles.
    cdef uintptr_t create(self)
    cdef int destroy(self, uintptr_t stream, bint in_capture) except -1
    cdef int check_alive(self, uintptr_t stream, str call) except -1
    cdef int check_not_destroyed(self, uintptr_t stream, str call) except -1
    cdef int check_known(self, uintptr_t stream, str call) except -1
    cdef int alive(self, uintptr_t stream) except -1
    cdef int stream_device(self, uintptr_t stream) noexcept

    # Work and waits.
    cdef StreamState* state(self, uintptr_t stream)
    cdef uint64_t launch(self, uintptr_t stream, uint64_t count, object uses) except? 0
    cdef uint64_t advance(self, uintptr_t stream, uint64_t target) except? 0
    cdef deque[Barrier]* queue(self, uintptr_t stream) noexcept
    cdef bint reached(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1
    cdef int finish(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1
    cdef int finish_stream(self, uintptr_t stream) except -1
    cdef int finish_all(self) except -1
    cdef int push_wait(self, uintptr_t stream, EventState* e) except -1

    # Events.
    cdef uintptr_t event_create(self, int device) except? 0
    cdef EventState* event(self, uintptr_t event) except NULL
    cdef EventState* recordable(self, uintptr_t event, uintptr_t stream) except NULL
    cdef int record(self, EventState* e, uintptr_t stream) except -1
    cdef int query(self, EventState* e) except -1

    # The reuse sanitizer's use records.
    cdef int queue_uses(self, uintptr_t stream, uint64_t position, tuple uses, tuple op) except -1
    cdef dict frontier(self, uintptr_t stream)
    cdef int check_uses(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1
    cdef int reuse_error(self, uintptr_t ptr, size_t nbytes, uintptr_t stream, uintptr_t x,
                         uint64_t position, start, stop, tuple op) except -1
    cdef int check_unmap(self, uintptr_t addr, size_t nbytes) except -1
    cdef list pending_uses(self)
