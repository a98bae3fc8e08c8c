# cython: language_level=3
"""SimDevice: a deterministic simulated CUDA device.

It is a real backend, not a test double: `pyalloc replay` and `pyalloc tune` run on it. It models

* device memory: a total capacity (bytes), live segments, out of memory when they would exceed it;
* addresses: deterministic first-fit in a 2 MiB aligned address range, or addresses the caller
  queued with `place_segments` (how a replay puts segments where PyTorch's driver put them);
* streams with pending work: `launch(stream)` queues a unit of work, `complete(stream)` finishes
  queued work in order, `synchronize()` finishes everything;
* stream lifetime as the driver has it: `destroy_stream(stream)` (cuStreamDestroy) returns at once
  and the work already queued there still runs to completion (events recorded before stay valid,
  `synchronize()` finishes that work), but the handle is dead: recording an event on it, launching
  or waiting on it is CUDA_ERROR_INVALID_HANDLE (where the real driver may crash instead), and the
  next `create_stream()` hands the same handle out again, for an unrelated stream;
* devices of streams and events: streams made by a SimDevice of ordinal d > 0 have handles in
  [d * 2**40, (d + 1) * 2**40), so any SimDevice can tell a stream of another device (smaller
  handles are its own); an event belongs to the device it was created for (`event_create_on`),
  and recording it on a stream of another device is CUDA_ERROR_INVALID_HANDLE, as cuEventRecord
  refuses an event and a stream of different contexts. (Work on another device's stream is what
  is launched on it through this SimDevice: each SimDevice keeps the stream states it is told of.)
* events that complete only when the work queued on their stream before the record completes;
* cross-stream waits: work launched on a stream after `wait_event` cannot complete before the event;
* virtual memory for expandable segments: address-space reservations (deterministic, or queued with
  `place_reservations`) whose 2 MiB pages are mapped to physical memory and unmapped on demand;
  mapped pages count against the same capacity as segments;
* stream capture (CUDA graphs) as an allocator sees it: see "Stream capture" below.

Every backend call is counted in `counters`, so tests can prove a cache hit makes none.

Stream capture follows what the CUDA 13 driver does (checked on an H200, driver 580; the cases are
in tests/test_sim_capture.py), errors raised as pyalloc.CudaError with the driver call, the CUresult
and a description naming the stream or event and the runtime's error name:

* `begin_capture(stream, mode)` starts capture id 1, 2, ... (per device) on a stream; stream 0 (the
  legacy stream) is refused (STREAM_CAPTURE_UNSUPPORTED), a stream already in a capture too
  (ILLEGAL_STATE, the capture carries on).
* While a stream captures, `launch(stream, count, uses)` queues no work: it adds ONE kernel node
  after the stream's terminals (cuStreamGetCaptureInfo's dependencies), which become {the node},
  and returns the node. `count` is the units of work the node is when the graph is launched;
  `uses` (device pointers the kernel touches) is stored on the node. Outside capture `uses` is
  ignored.
* An event recorded in a capturing stream holds the stream's terminals (a capture event). A stream
  that waits on it joins the capture (not capturing) or adds its nodes to its terminals (same
  capture; no pruning, as CUDA). A wait on a capture event of another capture is
  STREAM_CAPTURE_MERGE and invalidates both; a capturing stream's wait on an ordinary event is
  STREAM_CAPTURE_ISOLATION and invalidates, unless `external=True` (cudaEventWaitExternal), which
  adds an event-wait node.
* `end_capture(origin)` returns a graph when every joined stream's terminals are the origin's
  terminals or their ancestors, else STREAM_CAPTURE_UNJOINED; either way the capture ends for all
  its streams. On a joined stream it is STREAM_CAPTURE_UNMATCHED and invalidates the capture; from
  another thread (mode not relaxed) STREAM_CAPTURE_WRONG_THREAD, ending it.
* Querying or synchronizing a capture event (CAPTURED_EVENT), synchronizing a stream of a capture
  or the device (STREAM_CAPTURE_UNSUPPORTED) raise and invalidate the capture in every mode. The
  "potentially unsafe" calls, querying or synchronizing an ordinary event or a stream outside the
  capture, raise and invalidate as cudaStreamCaptureMode says: prohibited to the thread that began
  a global or thread-local capture and, in global mode, to every other thread while a global
  capture is underway (a thread's own mode: `exchange_capture_mode`). An invalidated capture
  refuses further work (STREAM_CAPTURE_INVALIDATED) until end_capture, which raises that too.
  After a capture ends, its events are INVALID_VALUE to query, sync or wait on until re-recorded.
* Allocating and freeing (segments, vm_*) stay legal, as a CUDA backend makes them in relaxed mode;
  they are counted in counters["memory_calls_during_capture"] as well.
* `launch_graph(graph, stream)` queues the graph as work on the stream: each kernel node its
  `count` units (after the external events its wait nodes name), so an event recorded after it
  completes only when that work has; into a capturing stream it adds one child-graph node.
"""
from libc.stdint cimport uintptr_t, uint64_t, UINT64_MAX
from libcpp.map cimport map as cppmap
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec
from cpython.pythread cimport PyThread_get_thread_ident
from posix.unistd cimport usleep

cimport cython
from cpython.object cimport PyObject

from pyalloc._backend cimport (Backend, BACKEND_OK, BACKEND_OOM, CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL,
                               CAPTURE_RELAXED)
from pyalloc.errors import CudaError, ReuseError
import collections

cdef extern from "_placement.h" namespace "pyalloc":
    cdef cppclass GapIndex:
        void insert(uintptr_t start, size_t gap)
        void erase(uintptr_t start)
        void set_gap(uintptr_t start, size_t gap)
        bint lowest_fit_above(uintptr_t after, size_t n, uintptr_t* start, size_t* gap)
        bint highest_fit_below(uintptr_t before, size_t n, uintptr_t* start, size_t* gap)

cdef size_t MiB = 1 << 20
cdef size_t GiB = 1 << 30
cdef size_t TOP_DOWN_RANGE = <size_t>1 << 40    # top_down places segments below base_address + this
cdef size_t GRANULE = 2 * MiB      # mapping granularity of the simulated virtual memory
# Work still queued on a destroyed stream runs on under an internal handle from here up (no
# handle a caller uses), so that its events complete as that work does, whoever gets the handle.
cdef uintptr_t ORPHAN_STREAMS = <uintptr_t>1 << 63
# The internal handle of every destroyed stream whose work was all done (its StreamState says
# so for any target); orphans with work still queued get handles after it.
cdef uintptr_t DONE_STREAM = ORPHAN_STREAMS
# Streams of device d (d > 0) are numbered from d * DEVICE_STREAMS up; handles below
# DEVICE_STREAMS (0, the per-thread handles, small ints tests use) are every device's own.
cdef uintptr_t DEVICE_STREAMS = <uintptr_t>1 << 40


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
    bint captured          # last recorded in a capture: SimDevice._event_capture holds its nodes
    int device             # the device it was created for


# Stream capture. None of this is on a path that runs while no capture is underway: those paths
# test SimDevice._live (captures begun and not ended) or EventState.captured first.

_MODE_NAMES = ("global", "thread_local", "relaxed")      # by CAPTURE_* value

# CUresult value, driver name and runtime name of the errors a capture can raise.
_ERRORS = {
    "invalid_value": (1, "CUDA_ERROR_INVALID_VALUE", "cudaErrorInvalidValue"),
    "illegal_state": (401, "CUDA_ERROR_ILLEGAL_STATE", "cudaErrorIllegalState"),
    "unsupported": (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "cudaErrorStreamCaptureUnsupported"),
    "invalidated": (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "cudaErrorStreamCaptureInvalidated"),
    "merge": (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "cudaErrorStreamCaptureMerge"),
    "unmatched": (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "cudaErrorStreamCaptureUnmatched"),
    "unjoined": (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "cudaErrorStreamCaptureUnjoined"),
    "isolation": (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "cudaErrorStreamCaptureIsolation"),
    "captured_event": (907, "CUDA_ERROR_CAPTURED_EVENT", "cudaErrorCapturedEvent"),
    "wrong_thread": (908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "cudaErrorStreamCaptureWrongThread"),
}


cdef object _capture_error(str call, str error, str detail):
    result, name, runtime_name = _ERRORS[error]
    return CudaError(call, result, name, f"SimDevice: {detail} ({runtime_name})")


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


cdef tuple _uses_of(object uses):
    return tuple([_use(u) for u in uses])


cdef list _spans(tuple uses):
    """[start, end) byte ranges of normalized uses."""
    return [(u[0], u[0] + u[1]) if type(u) is tuple else (u, u + 1) for u in uses]


cdef str _op_text(tuple op):
    """What queued a use, for ReuseError: ("launch", n, stream) or ("graph", handle, stream)."""
    if op[0] == "launch":
        return f"launch #{op[1]} on stream {op[2]}"
    return f"graph {op[1]} launched on stream {op[2]}"


# ---------------------------------------------------------------- injected driver failures

# The backend operations fail_next can make fail, with the driver call each stands for (the
# name the CudaError carries, and tests/fake_libcuda.c's fake_fail_next takes).
_DRIVER_CALLS = {
    "segment_alloc": "cuMemAlloc", "segment_free": "cuMemFree", "memory_info": "cuMemGetInfo",
    "event_create": "cuEventCreate", "event_record": "cuEventRecord",
    "event_query": "cuEventQuery", "event_synchronize": "cuEventSynchronize",
    "event_destroy": "cuEventDestroy", "stream_synchronize": "cuStreamSynchronize",
    "device_synchronize": "cuCtxSynchronize", "vm_reserve": "cuMemAddressReserve",
    "vm_release": "cuMemAddressFree", "vm_map": "cuMemCreate", "vm_unmap": "cuMemUnmap",
    "capture_begin": "cuStreamBeginCapture", "capture_end": "cuStreamEndCapture",
    "capture_info": "cuStreamGetCaptureInfo", "node_dependencies": "cuGraphNodeGetDependencies",
    "graph_launch": "cuGraphLaunch", "graph_destroy": "cuGraphDestroy",
}
_OPERATION_OF = {driver: op for op, driver in _DRIVER_CALLS.items()}
_RESULT_NAMES = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
                 400: "CUDA_ERROR_INVALID_HANDLE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
                 999: "CUDA_ERROR_UNKNOWN"}
_RESULT_NAMES.update({code: name for code, name, _ in _ERRORS.values()})


# ---------------------------------------------------------------- address ranges of live devices

# As CUDA's unified addressing gives every device of a process its own addresses, each live
# SimDevice made without base_address takes a slot k: segments from DEFAULT_BASE + k TiB, and
# reservations from DEFAULT_RESERVATION_BASE + k TiB (from HIGH_RESERVATION_BASE for the slots
# whose range would reach DEFAULT_BASE). So the first live device keeps the addresses it always
# had, and no two live devices share one while each keeps its segments and its reservations
# within 1 TiB. The lowest free slot is taken at construction and given back when the device is
# deallocated (a device that a stored traceback keeps alive, as hypothesis does for failing
# examples, keeps its slot). A device made with base_address takes no slot: its segments are
# where it was told, its reservations slot 0's, as before.
DEFAULT_BASE = 0x7f0000000000
DEFAULT_RESERVATION_BASE = 0x200000000000
HIGH_RESERVATION_BASE = 1 << 61
ADDRESS_SLOT = 1 << 40
LOW_SLOTS = (DEFAULT_BASE - DEFAULT_RESERVATION_BASE) // ADDRESS_SLOT
MAX_SLOTS = 1 << 20          # slot segments stay below HIGH_RESERVATION_BASE
_taken_slots = set()


def _take_slot():
    cdef Py_ssize_t k = 0
    while k in _taken_slots:
        k += 1
    if k >= MAX_SLOTS:
        raise RuntimeError(f"SimDevice: all {MAX_SLOTS} address ranges of simulated devices are "
                           "taken by live SimDevices; pass base_address to place this one's segments")
    _taken_slots.add(k)
    return k


def _slot_reservation_base(k):
    if k < LOW_SLOTS:
        return DEFAULT_RESERVATION_BASE + k * ADDRESS_SLOT
    return HIGH_RESERVATION_BASE + (k - LOW_SLOTS) * ADDRESS_SLOT


class _Capture:
    """One capture sequence: its streams' terminals (origin first, then in joining order) and its
    nodes in the order they were added."""
    __slots__ = ("id", "origin", "mode", "thread", "status", "reason", "terminals", "nodes", "ended")

    def __init__(self, capture_id, origin, mode, thread):
        self.id = capture_id
        self.origin = origin
        self.mode = mode
        self.thread = thread
        self.status = "active"          # or "invalidated"
        self.reason = ""                # what invalidated it
        self.terminals = {origin: []}   # stream -> list of nodes
        self.nodes = []
        self.ended = False


class _Node:
    """A node of a capture or graph: "kernel" (launch), "wait" (external event wait) or "graph"
    (a graph launched into a capturing stream)."""
    __slots__ = ("parents", "uses", "count", "kind", "events", "op")

    def __init__(self, parents, uses, count, kind, events=(), op=None):
        self.parents = parents          # tuple of node handles
        self.uses = uses                # tuple of uses: an address (1 byte) or (address, nbytes)
        self.count = count              # units of work when the graph is launched
        self.kind = kind
        self.events = events            # external events awaited ("wait", and "graph" holding waits)
        self.op = op                    # with check_reuse: the operation that added it (_op_text)


class _Graph:
    __slots__ = ("capture_id", "nodes", "work")

    def __init__(self, capture_id, nodes):
        self.capture_id = capture_id
        self.nodes = nodes              # node handles, in capture order
        self.work = 0


# no_gc_clear: an allocator collected together with its Buffers and this backend may still free
# through it (events for blocks used on other streams), so the collector must not take its tables
# away; clear_sim_device below drops only the hook, the one reference a user can add to it.
@cython.no_gc_clear
cdef class SimDevice(Backend):
    """A simulated device. Sizes are bytes; handles (streams, events, addresses) are ints.

    Args:
        total_memory: device capacity in bytes (default 80 GiB).
        device: device ordinal reported to the allocator (default 0).
        base_address: lowest address handed out for segments. Default: 0x7f0000000000 for the
            first live SimDevice made without one, 1 TiB higher for each other live one (and
            reservations for expandable segments 1 TiB apart from 0x200000000000 likewise), so
            that live simulated devices never hand out the same address, as under CUDA's unified
            addressing. Given, it is kept as it is (reservations then start at 0x200000000000).
        alignment: alignment of segment addresses in bytes (default 2 MiB, like cudaMalloc).
        top_down: where a new segment goes when no address is queued for it (place_segments).
            False (default): the lowest free address from base_address up. True: the highest free
            address below base_address + 1 TiB, as the CUDA driver tends to hand them out. Best
            fit breaks ties between equal free blocks by address, so this choice changes which
            blocks get split: with top_down, replays of the H200 traces in tests/data under
            settings other than the recorded one reproduce PyTorch's peaks for those settings
            (first fit missed one by 2.9%).
        check_reuse: the reuse sanitizer (default False: off, at no cost). When True, every
            use a kernel queues (`launch(..., uses=...)`, `launch_graph`) or a capture holds is
            recorded, and the allocator, which then calls check_handout for every block it hands
            out, gets ReuseError where a block may still be used by work not ordered before the
            receiving stream's next work (see check_handout).

    Freeing a segment completes the work queued on every stream first, as cudaFree waits for the
    device before it returns memory (an address it hands out again is then safe to use).

    Attributes: counters (calls per backend operation); segment_alloc_hook, a callable(nbytes)
    run at the start of every segment allocation (None by default), where a test can look at the
    allocator in the middle of one (e.g. what other threads can do while the "driver" allocates);
    latency_us (microseconds, default 0: off), a delay that segment_alloc, segment_free,
    event_record and event_query spend asleep with the GIL released, as a driver call would, so
    that tests can make threads contend the allocator's lock while one is inside the backend.
    fail_next(call) makes backend operations raise CudaError as a failing driver call would.
    """

    cdef readonly size_t total_memory
    cdef readonly size_t used_memory
    cdef readonly uintptr_t base_address
    cdef readonly bint top_down
    cdef readonly size_t alignment
    cdef cppmap[uintptr_t, size_t] _segments          # live segments: address -> bytes
    cdef GapIndex _gaps                                # the same segments, by the room below each
    cdef bint _overlapping                             # some live segments overlap (see _first_fit)
    cdef dict _placements                              # bytes -> deque of queued addresses
    cdef Py_ssize_t _pending_placements
    cdef unordered_map[uintptr_t, StreamState] _streams
    cdef unordered_map[uintptr_t, deque[Barrier]] _barriers
    cdef unordered_map[uintptr_t, EventState] _events
    cdef cppmap[uintptr_t, size_t] _reservations        # reserved address ranges: base -> bytes
    cdef unordered_set[uintptr_t] _mapped_pages         # granule addresses currently mapped
    cdef dict _reservation_placements                  # bytes -> list of queued base addresses
    cdef readonly uintptr_t reservation_base
    cdef uintptr_t _next_stream
    cdef uintptr_t _first_stream                       # the first handle create_stream gives out
    cdef unordered_set[uintptr_t] _destroyed_streams    # handles destroyed and not handed out again
    cdef vector[uintptr_t] _reusable_streams           # the same, most recently destroyed last
    cdef uintptr_t _next_orphan                        # internal handles of destroyed streams' work
    cdef uintptr_t _next_event
    cdef uint64_t _seq                                 # orders event records and waits
    cdef public dict counters
    cdef public object segment_alloc_hook              # callable(nbytes) or None, see the class doc
    cdef public unsigned int latency_us                # driver-call delay, see the class doc
    # Stream capture (see the module doc).
    cdef int _live                                     # captures begun and not ended
    cdef dict _capture_of                              # stream -> _Capture, for streams of live captures
    cdef dict _live_captures                           # capture id -> _Capture
    cdef dict _event_capture                           # captured event -> (_Capture, terminals tuple)
    cdef dict _nodes                                   # node handle -> _Node (live captures and graphs)
    cdef dict _graphs                                  # graph handle -> _Graph
    cdef dict _thread_modes                            # thread ident -> CAPTURE_* (absent: global)
    cdef uint64_t _next_capture
    cdef uintptr_t _next_node
    cdef uintptr_t _next_graph
    # The reuse sanitizer (check_reuse; see check_handout). Untouched when it is off.
    cdef dict _uses                                    # stream -> deque of (position, spans, op)
    cdef uint64_t _launches                            # launch calls so far (names them)
    # Injected failures (fail_next): operation -> [calls to let through, calls to fail, CUresult].
    cdef dict _failures
    cdef int _armed                                    # len(_failures): one test on each call
    cdef int _slot                                     # address slot (see _take_slot), or -1

    def __cinit__(self, *args, **kwargs):
        self._slot = -1

    def __dealloc__(self):
        if self._slot >= 0:
            try:
                _taken_slots.discard(self._slot)
            except Exception:       # (module globals gone at interpreter exit)
                pass

    def __init__(self, size_t total_memory=80 * GiB, *, int device=0, base_address=None,
                 size_t alignment=2 * MiB, bint top_down=False, bint check_reuse=False):
        if total_memory == 0:
            raise ValueError("total_memory must be a positive number of bytes, got 0")
        if alignment == 0 or (alignment & (alignment - 1)) != 0:
            raise ValueError(f"alignment must be a power of two in bytes, got {alignment}")
        if base_address is not None and not 0 <= base_address < 2 ** 64:
            raise ValueError(f"base_address must be an address in [0, 2**64), got {base_address!r}")
        self.device = device
        self.kind = "sim"
        self.total_memory = total_memory
        self.used_memory = 0
        if base_address is None:
            if self._slot < 0:      # (__init__ run twice keeps its slot)
                self._slot = _take_slot()
            self.base_address = DEFAULT_BASE + self._slot * ADDRESS_SLOT
            self.reservation_base = _slot_reservation_base(self._slot)
        else:
            self.base_address = base_address
            self.reservation_base = DEFAULT_RESERVATION_BASE
        self.alignment = alignment
        self.top_down = top_down
        self.checks_reuse = check_reuse
        self._uses = {}
        self._launches = 0
        self._failures = {}
        self._armed = 0
        self._placements = {}
        self._reservation_placements = {}
        self._pending_placements = 0
        self._next_stream = 1 + <uintptr_t>device * DEVICE_STREAMS if 0 < device < 4096 else 1
        self._first_stream = self._next_stream
        self._next_orphan = DONE_STREAM + 1
        self._streams[DONE_STREAM] = StreamState(UINT64_MAX, UINT64_MAX)
        self._next_event = 1
        self.counters = dict.fromkeys(
            ("segment_alloc", "segment_free", "memory_info", "event_create", "event_record",
             "event_query", "event_synchronize", "event_destroy", "stream_synchronize",
             "device_synchronize", "vm_reserve", "vm_release", "vm_map", "vm_unmap",
             "capture_begin", "capture_end", "capture_info", "node_dependencies", "graph_launch",
             "graph_destroy", "memory_calls_during_capture", "check_handout",
             "injected_failures"), 0)
        self._live = 0
        self._capture_of = {}
        self._live_captures = {}
        self._event_capture = {}
        self._nodes = {}
        self._graphs = {}
        self._thread_modes = {}
        self._next_capture = 1
        self._next_node = 1
        self._next_graph = 1

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
            self._placements.setdefault(size, collections.deque()).append(addr)
        self._pending_placements += len(items)

    @property
    def address_slot(self):
        """The address range this device took (slot k: segments from 0x7f0000000000 + k TiB),
        or None when it was made with base_address."""
        return None if self._slot < 0 else self._slot

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

    # Placement. The addresses are those of a walk over the live segments (_first_fit_walk,
    # _top_fit_walk, which define them), found in O(log n) through _gaps: the gap below a segment
    # is the room between its predecessor's end, aligned up, and its start, and a request of n
    # bytes fits below a segment exactly when that gap is at least n. That reading holds while
    # the live segments are disjoint; a queued placement below base_address can make first fit
    # overlap it, and until the device is empty again placement walks, as it always did.

    cdef inline size_t _gap_below(self, cppmap[uintptr_t, size_t].iterator it):
        """The gap below the segment at `it` (SIZE_MAX for the lowest segment)."""
        if it == self._segments.begin():
            return <size_t>-1
        cdef cppmap[uintptr_t, size_t].iterator prev = it
        dec(prev)
        cdef uintptr_t floor = self._align_up(deref(prev).first + deref(prev).second)
        return deref(it).first - floor if deref(it).first > floor else 0

    cdef inline uintptr_t _align_up(self, uintptr_t addr):
        return (addr + self.alignment - 1) & ~(self.alignment - 1)

    cdef bint _indexed(self, size_t nbytes):
        """Whether _gaps answers a placement of nbytes: disjoint segments, and addresses small
        enough that no sum in the walk wraps around 2**64."""
        if self._overlapping or nbytes == 0 or nbytes > (<size_t>1 << 62):
            return False
        if self.alignment > (<size_t>1 << 61) or self.base_address > (<uintptr_t>1 << 62):
            return False
        if self._segments.empty():
            return True
        cdef cppmap[uintptr_t, size_t].iterator last = self._segments.end()
        dec(last)
        return deref(last).first + deref(last).second <= (<uintptr_t>1 << 62)

    cdef int _add_segment(self, uintptr_t addr, size_t nbytes) except -1:
        self._segments[addr] = nbytes
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.find(addr)
        cdef cppmap[uintptr_t, size_t].iterator prev = it, nxt = it
        inc(nxt)
        if it != self._segments.begin():
            dec(prev)
            if deref(prev).first + deref(prev).second > addr:
                self._overlapping = True
        if nxt != self._segments.end() and addr + nbytes > deref(nxt).first:
            self._overlapping = True
        self._gaps.insert(addr, self._gap_below(it))
        if nxt != self._segments.end():
            self._gaps.set_gap(deref(nxt).first, self._gap_below(nxt))
        return 0

    cdef int _remove_segment(self, cppmap[uintptr_t, size_t].iterator it) except -1:
        cdef cppmap[uintptr_t, size_t].iterator nxt = it
        inc(nxt)
        self._gaps.erase(deref(it).first)
        self._segments.erase(it)
        if nxt != self._segments.end():
            self._gaps.set_gap(deref(nxt).first, self._gap_below(nxt))
        if self._segments.empty():
            self._overlapping = False
        return 0

    cdef uintptr_t _first_fit(self, size_t nbytes):
        # The lowest free aligned address from base_address up (segments below it are ignored).
        if not self._indexed(nbytes):
            return self._first_fit_walk(nbytes)
        cdef uintptr_t base = self.base_address
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.lower_bound(base)
        if it == self._segments.end() or deref(it).first >= base + nbytes:
            return base
        cdef uintptr_t start
        cdef size_t gap
        if self._gaps.lowest_fit_above(deref(it).first, nbytes, &start, &gap):
            return start - gap
        it = self._segments.end()
        dec(it)
        return self._align_up(deref(it).first + deref(it).second)

    cdef uintptr_t _first_fit_walk(self, size_t nbytes):
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
        if nbytes > TOP_DOWN_RANGE:
            return self._first_fit(nbytes)
        if not self._indexed(nbytes):
            return self._top_fit_walk(nbytes)
        cdef uintptr_t top = self.base_address + TOP_DOWN_RANGE
        cdef uintptr_t addr = (top - nbytes) & ~(self.alignment - 1)
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.lower_bound(top)
        cdef uintptr_t start
        cdef size_t gap
        if it != self._segments.begin():
            dec(it)
            if deref(it).first + deref(it).second > addr:
                # The room under `top` is taken: the highest gap below a segment that fits.
                if not self._gaps.highest_fit_below(top, nbytes, &start, &gap):
                    return self._first_fit(nbytes)
                if start < self.base_address + nbytes:
                    return self._first_fit(nbytes)
                addr = (start - nbytes) & ~(self.alignment - 1)
        if addr < self.base_address:
            return self._first_fit(nbytes)
        return addr

    cdef uintptr_t _top_fit_walk(self, size_t nbytes):
        cdef uintptr_t top = self.base_address + TOP_DOWN_RANGE
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
                    return self._first_fit_walk(nbytes)
                addr = (start - nbytes) & ~(self.alignment - 1)
        if addr < self.base_address:
            return self._first_fit_walk(nbytes)
        return addr

    cdef void _driver_latency(self) noexcept:
        if self.latency_us:
            with nogil:
                usleep(self.latency_us)

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        self._driver_latency()
        self.counters["segment_alloc"] += 1
        if self._armed:
            self._inject("segment_alloc")
        if self._live:
            self.counters["memory_calls_during_capture"] += 1
        if self.segment_alloc_hook is not None:
            self.segment_alloc_hook(nbytes)
        if nbytes > self.total_memory - self.used_memory:
            return BACKEND_OOM
        cdef uintptr_t addr
        queue = self._placements.get(nbytes)
        if queue:
            addr = queue.popleft()
            self._pending_placements -= 1
            if self._overlaps(addr, nbytes):
                raise RuntimeError(
                    f"SimDevice: placed segment {addr:#x} (+{nbytes} bytes) overlaps a live segment; "
                    "the placement queue does not match this allocation sequence")
        elif self.top_down:
            addr = self._top_fit(nbytes)
        else:
            addr = self._first_fit(nbytes)
        self._add_segment(addr, nbytes)
        self.used_memory += nbytes
        ptr[0] = addr
        return BACKEND_OK

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        self._driver_latency()
        self.counters["segment_free"] += 1
        if self._armed:
            self._inject("segment_free")
        if self._live:
            self.counters["memory_calls_during_capture"] += 1
        cdef cppmap[uintptr_t, size_t].iterator it = self._segments.find(ptr)
        if it == self._segments.end() or deref(it).second != nbytes:
            raise RuntimeError(f"SimDevice: free of {ptr:#x} ({nbytes} bytes), which is not a live segment")
        self._remove_segment(it)
        self.used_memory -= nbytes
        # cudaFree waits for the device before it gives the memory back: work queued on any
        # stream, which may still use the segment, completes first (PyTorch relies on it).
        self._finish_all_work()
        return BACKEND_OK

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        self.counters["memory_info"] += 1
        if self._armed:
            self._inject("memory_info")
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
        if self._armed:
            self._inject("vm_reserve")
        if self._live:
            self.counters["memory_calls_during_capture"] += 1
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
        if self._armed:
            self._inject("vm_release")
        if self._live:
            self.counters["memory_calls_during_capture"] += 1
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
        if self._armed:
            self._inject("vm_map")
        if self._live:
            self.counters["memory_calls_during_capture"] += 1
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
        if self._armed:
            self._inject("vm_unmap")
        if self._live:
            self.counters["memory_calls_during_capture"] += 1
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
        """A new stream handle (a positive int; 0 is the default stream). As the driver does, the
        handle of the most recently destroyed stream is handed out again first."""
        cdef uintptr_t s
        if not self._reusable_streams.empty():
            s = self._reusable_streams.back()
            self._reusable_streams.pop_back()
            self._destroyed_streams.erase(s)
        else:
            s = self._next_stream
            self._next_stream += 1
        self._streams[s] = StreamState(0, 0)
        return s

    def destroy_stream(self, uintptr_t stream):
        """Destroy `stream` (cuStreamDestroy): returns at once; the work queued on it still
        completes (on synchronize(), or when an event recorded before is synchronized), but the
        handle is dead until create_stream() hands it out again. CudaError INVALID_HANDLE for
        stream 0, a destroyed stream or one in a capture (the driver refuses those too)."""
        self._check_stream_alive(stream, "cuStreamDestroy")
        if stream == 0 or stream >= ORPHAN_STREAMS or (self._live and stream in self._capture_of):
            raise CudaError("cuStreamDestroy", 400, "CUDA_ERROR_INVALID_HANDLE",
                            f"SimDevice: stream {stream} cannot be destroyed (the legacy stream, or "
                            "a stream in a capture)")
        cdef StreamState state = self._streams[stream]
        self._streams.erase(stream)
        cdef uintptr_t orphan = DONE_STREAM
        if state.completed < state.launched or self._queue(stream) != NULL:
            # Work (or waits) still queued: it lives on under an internal handle.
            orphan = self._next_orphan
            self._next_orphan += 1
            self._streams[orphan] = state
            if self._queue(stream) != NULL:
                self._barriers[orphan] = self._barriers[stream]
        # Else everything queued on it is done: its events and the waits on it follow
        # DONE_STREAM, whose work is all complete for good (no state kept per stream).
        self._barriers.erase(stream)
        if self._uses:
            # Its pending uses are those of the orphaned work (none when all of it is done).
            q = self._uses.pop(stream, None)
            if q is not None and orphan != DONE_STREAM:
                self._uses[orphan] = q
        # Events recorded on it and waits on it elsewhere now follow the orphaned work.
        cdef pair[uintptr_t, EventState] ev
        for ev in self._events:
            if ev.second.stream == stream:
                self._events[ev.first].stream = orphan
        cdef pair[uintptr_t, deque[Barrier]] queue
        cdef size_t i
        for queue in self._barriers:
            for i in range(queue.second.size()):
                if queue.second[i].stream == stream:
                    self._barriers[queue.first][i].stream = orphan
        self._destroyed_streams.insert(stream)
        self._reusable_streams.push_back(stream)

    def is_destroyed(self, uintptr_t stream):
        """True when `stream` was destroyed and its handle not handed out again."""
        return self._destroyed_streams.count(stream) != 0

    cdef inline int _check_stream_alive(self, uintptr_t stream, str call) except -1:
        if not self._destroyed_streams.empty() and self._destroyed_streams.count(stream):
            raise CudaError(call, 400, "CUDA_ERROR_INVALID_HANDLE",
                            f"SimDevice: stream {stream} was destroyed (cuStreamDestroy); a "
                            "driver may crash on such a handle")
        if stream > 2 and stream < ORPHAN_STREAMS and not (self._first_stream <= stream < self._next_stream):
            self._check_stream_known(stream, call)
        return 0

    cdef int _check_stream_known(self, uintptr_t stream, str call) except -1:
        """CudaError INVALID_HANDLE for a handle of this device that create_stream never gave
        out (0, 1 and 2, the legacy and per-thread handles, are always valid; streams of other
        devices are theirs to know)."""
        cdef uintptr_t first = self._first_stream
        if first <= stream < self._next_stream or self.stream_device(stream) != self.device:
            return 0
        made = (f"create_stream gave out {first}..{self._next_stream - 1}"
                if self._next_stream > first else "create_stream gave out none yet")
        raise CudaError(call, 400, "CUDA_ERROR_INVALID_HANDLE",
                        f"SimDevice: stream {stream} was never created on device {self.device} "
                        f"({made}; 0, 1 and 2 are the legacy and per-thread default streams); a "
                        "driver may crash on such a handle")

    cdef StreamState* _stream(self, uintptr_t stream):
        # operator[] default-constructs: every int is a usable stream handle.
        return &self._streams[stream]

    def launch(self, uintptr_t stream=0, uint64_t count=1, uses=()):
        """Queue `count` units of work on `stream`; returns the stream's queued total.

        While `stream` captures, queues nothing: adds one kernel node after the stream's terminals
        (worth `count` units of work when the graph is launched, touching the device pointers in
        `uses`) and returns the node's handle. A use is an address (an int: 1 byte) or
        (address, nbytes). Outside capture `uses` matters only with check_reuse: the uses are
        pending until this work completes.
        """
        self._check_stream_alive(stream, "cuLaunchKernel")
        if self._live and stream in self._capture_of:
            return self._capture_launch(stream, count, uses)
        cdef StreamState* s = self._stream(stream)
        s.launched += count
        cdef uint64_t launched = s.launched
        if self.checks_reuse:
            self._launches += 1
            if uses:
                self._queue_uses(stream, launched, _uses_of(uses), ("launch", self._launches, stream))
        return launched

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
            barriers = self._queue(stream)
            if barriers != NULL and barriers.front().position <= s.completed:
                b = barriers.front()
                self._finish(b.stream, b.target, b.event_seq)
                barriers = self._queue(stream)
                if barriers != NULL:
                    barriers.pop_front()
                    if barriers.empty():
                        self._barriers.erase(stream)    # no empty queues: destroy_stream walks them
                s = self._stream(stream)
                continue
            if barriers != NULL and barriers.front().position < target:
                s.completed = barriers.front().position
            else:
                s.completed = target
        return s.completed - start

    cdef inline deque[Barrier]* _queue(self, uintptr_t stream) noexcept:
        """The waits queued on `stream` not yet passed, or NULL when there are none."""
        cdef unordered_map[uintptr_t, deque[Barrier]].iterator it = self._barriers.find(stream)
        if it == self._barriers.end() or deref(it).second.empty():
            return NULL
        return &deref(it).second

    # A wait queued right after a stream's last work item has the same position as an event
    # recorded there; `seq` tells whether the wait came before the record (and so holds the event
    # back, as cudaStreamWaitEvent orders every later command) or after it. Following only
    # earlier waits also keeps these walks finite.

    cdef bint _reached(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1:
        """True when the work queued on `stream` up to `target` items, and the waits queued
        there before `before_seq`, have completed."""
        if self._stream(stream).completed < target:
            return False
        cdef deque[Barrier]* barriers = self._queue(stream)
        cdef Barrier b
        cdef size_t i = 0
        while barriers != NULL and i < barriers.size() and deref(barriers)[i].position <= target:
            b = deref(barriers)[i]
            if b.seq < before_seq and not self._reached(b.stream, b.target, b.event_seq):
                return False
            barriers = self._queue(stream)
            i += 1
        return True

    cdef int _finish(self, uintptr_t stream, uint64_t target, uint64_t before_seq) except -1:
        """Complete `stream` up to `target` items and the awaited work of the waits queued
        there before `before_seq`."""
        self._advance(stream, target)
        cdef deque[Barrier]* barriers = self._queue(stream)
        cdef Barrier b
        cdef size_t i = 0
        while barriers != NULL and i < barriers.size() and deref(barriers)[i].position <= target:
            b = deref(barriers)[i]
            if b.seq < before_seq:
                self._finish(b.stream, b.target, b.event_seq)
            barriers = self._queue(stream)
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
        """Finish all queued work on every stream (cudaDeviceSynchronize).

        Raises CudaError while a capture is underway, and invalidates every such capture."""
        if self._live:
            self._device_sync_in_capture()
        self._finish_all_work()

    cdef int _finish_all_work(self) except -1:
        """Complete the work queued on every stream (synchronize, and the wait of segment_free)."""
        cdef vector[uintptr_t] streams
        cdef pair[uintptr_t, StreamState] p
        for p in self._streams:
            streams.push_back(p.first)
        for s in streams:
            self._advance(s, self._stream(s).launched)
        return 0

    cdef int device_synchronize(self) except -1:
        self.counters["device_synchronize"] += 1
        if self._armed:
            self._inject("device_synchronize")
        self.synchronize()
        return BACKEND_OK

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        self.counters["stream_synchronize"] += 1
        if self._armed:
            self._inject("stream_synchronize")
        self._check_stream_alive(stream, "cuStreamSynchronize")
        if self._live:
            self._stream_sync_in_capture(stream)
        self._finish(stream, self._stream(stream).launched, self._seq + 1)
        return BACKEND_OK

    # ---------------------------------------------------------------- events

    cdef int event_create(self, uintptr_t* event) except -1:
        self.counters["event_create"] += 1
        if self._armed:
            self._inject("event_create")
        event[0] = self._next_event
        self._events[self._next_event] = EventState(0, 0, False, 0, False, self.device)
        self._next_event += 1
        return BACKEND_OK

    cdef int event_create_on(self, int device, uintptr_t* event) except -1:
        self.event_create(event)
        self._events[event[0]].device = device
        return BACKEND_OK

    cdef int stream_device(self, uintptr_t stream) except -2:
        if stream < DEVICE_STREAMS or stream >= ORPHAN_STREAMS:
            return self.device
        return <int>(stream // DEVICE_STREAMS)

    def device_of_stream(self, uintptr_t stream):
        """The ordinal of the device `stream` belongs to (see the module doc)."""
        return self.stream_device(stream)

    def device_of_event(self, uintptr_t event):
        """The ordinal of the device `event` was created for."""
        return self._event(event).device

    cdef EventState* _event(self, uintptr_t event) except NULL:
        cdef unordered_map[uintptr_t, EventState].iterator it = self._events.find(event)
        if it == self._events.end():
            raise ValueError(f"SimDevice: unknown event handle {event}")
        return &deref(it).second

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        self._driver_latency()
        self.counters["event_record"] += 1
        if self._armed:
            self._inject("event_record")
        self._check_stream_alive(stream, "cuEventRecord")
        cdef EventState* e = self._event(event)
        if e.device != self.stream_device(stream):
            raise CudaError("cuEventRecord", 400, "CUDA_ERROR_INVALID_HANDLE",
                            f"SimDevice: event {event} of device {e.device} cannot be recorded on "
                            f"stream {stream:#x} of device {self.stream_device(stream)} (an event "
                            "and its stream must share a context)")
        if self._live and stream in self._capture_of:
            return self._capture_record(event, e, stream)
        if e.captured:
            e.captured = False
            del self._event_capture[event]
        e.stream = stream
        e.target = self._stream(stream).launched
        e.recorded = True
        self._seq += 1
        e.seq = self._seq
        return BACKEND_OK

    cdef int event_query(self, uintptr_t event) except -1:
        self._driver_latency()
        self.counters["event_query"] += 1
        if self._armed:
            self._inject("event_query")
        cdef EventState* e = self._event(event)
        if e.captured or self._live:
            self._event_use_in_capture(event, e.captured, "cuEventQuery", "query")
        if not e.recorded:
            return 1
        return 1 if self._reached(e.stream, e.target, e.seq) else 0

    cdef int event_synchronize(self, uintptr_t event) except -1:
        self.counters["event_synchronize"] += 1
        if self._armed:
            self._inject("event_synchronize")
        cdef EventState* e = self._event(event)
        if e.captured or self._live:
            self._event_use_in_capture(event, e.captured, "cuEventSynchronize", "synchronize")
        if e.recorded:
            self._finish(e.stream, e.target, e.seq)
        return BACKEND_OK

    cdef int event_destroy(self, uintptr_t event) except -1:
        self.counters["event_destroy"] += 1
        if self._armed:
            self._inject("event_destroy")
        if self._event(event).captured:
            del self._event_capture[event]
        self._events.erase(event)
        return BACKEND_OK

    def create_event(self):
        """A new event, not recorded (cudaEventCreate); returns its handle."""
        cdef uintptr_t ev
        self.event_create(&ev)
        return ev

    def destroy_event(self, uintptr_t event):
        """Destroy an event (cudaEventDestroy)."""
        self.event_destroy(event)

    def record_event(self, uintptr_t stream=0, event=None):
        """Record an event on `stream` now (cudaEventRecord): `event` when given, else a new one;
        returns its handle."""
        cdef uintptr_t ev
        if event is None:
            self.event_create(&ev)
        else:
            ev = event
        self.event_record(ev, stream)
        return ev

    def synchronize_event(self, uintptr_t event):
        """Wait for an event (cudaEventSynchronize): completes the work it waits for."""
        self.event_synchronize(event)

    def synchronize_stream(self, uintptr_t stream=0):
        """Complete the work queued on `stream` and what it waits for (cudaStreamSynchronize)."""
        self.stream_synchronize(stream)

    def event_done(self, uintptr_t event):
        """True when the work queued before the event's record has completed."""
        return self.event_query(event) == 1

    def wait_event(self, uintptr_t stream, uintptr_t event, bint external=False):
        """Make work launched on `stream` from now on wait for `event` (cudaStreamWaitEvent).

        In capture: a capture event joins `stream` to its capture or adds its nodes to the
        stream's terminals; an ordinary event is an isolation error, unless `external`
        (cudaEventWaitExternal), which adds an event-wait node. Outside capture `external` is
        ignored."""
        self._check_stream_alive(stream, "cuStreamWaitEvent")
        cdef EventState* e = self._event(event)
        if e.captured or (self._live and stream in self._capture_of):
            self._capture_wait(stream, event, e, external)
            return
        self._push_wait(stream, e)

    cdef int _push_wait(self, uintptr_t stream, EventState* e) except -1:
        if not e.recorded or e.stream == stream:
            return 0
        self._seq += 1
        self._barriers[stream].push_back(
            Barrier(self._stream(stream).launched, e.stream, e.target, self._seq, e.seq))
        return 0

    # ---------------------------------------------------------------- the reuse sanitizer
    #
    # With check_reuse, each launch outside capture (and each graph launch) that names uses
    # queues (position, spans, op) on its stream's deque in _uses: the spans are pending until
    # the stream has completed `position` items (the stream's queued total after that launch).
    # Positions grow along a deque, so completed uses are popped from its front, lazily: when
    # the stream queues another use, and at each check_handout.

    cdef int _queue_uses(self, uintptr_t stream, uint64_t position, tuple uses,
                         tuple op) except -1:
        cdef uint64_t completed = self._stream(stream).completed
        if position <= completed:           # (no work: nothing left to use the memory)
            return 0
        q = self._uses.get(stream)
        if q is None:
            q = self._uses[stream] = collections.deque()
        else:
            while q and q[0][0] <= completed:
                q.popleft()
        q.append((position, _spans(uses), op))
        return 0

    cdef dict _frontier(self, uintptr_t stream):
        """{stream X: items of X that complete before `stream`'s next work}, through the waits
        queued on `stream` so far and, transitively, the waits those awaited streams had queued
        before each awaited event was recorded (_reached's rules)."""
        front = {}
        seen = {}           # stream -> [(target, before_seq)] walked already
        stack = [(stream, self._stream(stream).launched, UINT64_MAX)]
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
            barriers = self._queue(y)
            if barriers == NULL:
                continue
            for i in range(barriers.size()):
                b = deref(barriers)[i]
                if b.position > target:
                    break
                if b.seq < before:
                    stack.append((b.stream, b.target, b.event_seq))
        return front

    cdef int check_handout(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1:
        """Raise ReuseError when [ptr, ptr + nbytes) may still be used by work that is not
        ordered before `stream`'s next work: a queued use on another stream X at position P that
        X has not completed and that no wait of `stream` reaches (directly or through other
        streams' waits, with a target >= P); or a kernel node of an active capture, unless
        `stream` is in that capture and the node precedes its terminals. (Work queued on
        `stream` itself runs first, in order. A capture that was invalidated never runs.)"""
        self.counters["check_handout"] += 1
        if stream > 2 and stream < ORPHAN_STREAMS and not (self._first_stream <= stream < self._next_stream):
            self._check_stream_known(stream, "malloc")
        cdef uintptr_t end = ptr + nbytes
        cdef uintptr_t x
        cdef uint64_t completed
        front = None
        if self._uses:
            for x in list(self._uses):
                q = self._uses[x]
                completed = self._stream(x).completed
                while q and q[0][0] <= completed:
                    q.popleft()
                if not q:
                    del self._uses[x]
                    continue
                if x == stream:
                    continue
                for position, spans, op in q:
                    for start, stop in spans:
                        if start < end and ptr < stop:
                            if front is None:
                                front = self._frontier(stream)
                            if front.get(x, 0) >= position:
                                break
                            self._reuse_error(ptr, nbytes, stream, x, position, start, stop, op)
        if self._live:
            self._check_captured_uses(ptr, nbytes, stream)
        return 0

    cdef int _reuse_error(self, uintptr_t ptr, size_t nbytes, uintptr_t stream, uintptr_t x,
                          uint64_t position, start, stop, tuple op) except -1:
        cdef StreamState* st = self._stream(x)
        what = _op_text(op)
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

    cdef int _check_captured_uses(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1:
        cdef uintptr_t end = ptr + nbytes
        mine = self._capture_of.get(stream)
        reach = None
        for cap in self._live_captures.values():
            if cap.status != "active":
                continue
            for n in cap.nodes:
                nd = self._nodes[n]
                if not nd.uses:
                    continue
                for start, stop in _spans(nd.uses):
                    if not (start < end and ptr < stop):
                        continue
                    if cap is mine:
                        if reach is None:
                            reach = self._ancestor_set(cap.terminals[stream])
                            reach.update(cap.terminals[stream])
                        if n in reach:
                            break
                        why = (f"it does not precede stream {stream}'s terminals "
                               f"{sorted(cap.terminals[stream])}")
                    else:
                        why = (f"stream {stream} is not in that capture" if mine is None else
                               f"stream {stream} is in capture {mine.id}, another one")
                    what = (_op_text(nd.op) + f", captured as {nd.kind} node {n}" if nd.op
                            else f"{nd.kind} node {n}")
                    raise ReuseError(
                        f"SimDevice reuse check: block {ptr:#x} (+{nbytes} bytes) handed out for "
                        f"stream {stream} while {what} of capture {cap.id} (begun on stream "
                        f"{cap.origin}) uses [{start:#x}, {stop:#x}), and {why}: every launch of "
                        "the graph would use that memory",
                        ptr=ptr, nbytes=nbytes, stream=stream, use_stream=None,
                        operation=f"{what} of capture {cap.id}")
        return 0

    def pending_uses(self):
        """The uses the sanitizer holds (check_reuse): a list of (stream, end item, [(start,
        end)], what queued it), completed ones pruned first. Empty when check_reuse is off."""
        out = []
        for x in list(self._uses):
            q = self._uses[x]
            while q and q[0][0] <= self._stream(x).completed:
                q.popleft()
            if not q:
                del self._uses[x]
            for position, spans, op in q:
                out.append((x, position, list(spans), _op_text(op)))
        return out

    def check_reuse(self, uintptr_t ptr, size_t nbytes, uintptr_t stream=0):
        """Run the sanitizer's check of a block of `nbytes` bytes at `ptr` handed out for
        `stream` (what the allocator does for each block it hands out): None, or ReuseError."""
        self.check_handout(ptr, nbytes, stream)

    cdef int stream_alive(self, uintptr_t stream) except -1:
        """0 for a destroyed stream, 1 for a live one; CudaError INVALID_HANDLE for a handle of
        this device that create_stream never gave out."""
        if not self._destroyed_streams.empty() and self._destroyed_streams.count(stream):
            return 0
        if stream > 2 and stream < ORPHAN_STREAMS and not (self._first_stream <= stream < self._next_stream):
            self._check_stream_known(stream, "cuStreamQuery")
        return 1

    # ---------------------------------------------------------------- injected failures

    def fail_next(self, call, int count=1, *, int skip=0, int result=999):
        """Make backend operation `call` fail as a driver call does: after `skip` calls that
        succeed, the next `count` calls raise CudaError (`result`: the CUresult, default 999,
        CUDA_ERROR_UNKNOWN) before doing anything, so state is as if they were never made.
        `call` is the operation's name in `counters` ("segment_alloc", "event_record", ...) or
        its driver call ("cuMemAlloc", as tests/fake_libcuda.c's fake_fail_next takes). count 0
        disarms. Each failure adds 1 to counters["injected_failures"] (and the call's own
        counter counts it, as a call made)."""
        op = call if call in _DRIVER_CALLS else _OPERATION_OF.get(call)
        if op is None:
            raise ValueError(f"SimDevice.fail_next: unknown call {call!r}; one of "
                             f"{', '.join(sorted(_DRIVER_CALLS))} or their driver calls")
        if count < 0 or skip < 0:
            raise ValueError(f"SimDevice.fail_next: count and skip must be >= 0, got {count}, {skip}")
        if count == 0:
            self._failures.pop(op, None)
        else:
            self._failures[op] = [skip, count, result]
        self._armed = len(self._failures)

    def armed_failures(self):
        """{operation: (calls let through first, calls that will fail)} still armed."""
        return {op: (f[0], f[1]) for op, f in self._failures.items()}

    cdef int _inject(self, str op) except -1:
        f = self._failures.get(op)
        if f is None:
            return 0
        if f[0] > 0:
            f[0] -= 1
            return 0
        f[1] -= 1
        if f[1] == 0:
            del self._failures[op]
            self._armed = len(self._failures)
        self.counters["injected_failures"] += 1
        call = _DRIVER_CALLS[op]
        raise CudaError(call, f[2], _RESULT_NAMES.get(f[2], ""),
                        f"SimDevice: injected failure of {op} (fail_next)")


    # ---------------------------------------------------------------- stream capture

    cdef unsigned long _me(self):
        return <unsigned long>PyThread_get_thread_ident()

    cdef int capture_begin(self, uintptr_t stream, int mode) except -1:
        self.counters["capture_begin"] += 1
        if self._armed:
            self._inject("capture_begin")
        self._check_stream_alive(stream, "cuStreamBeginCapture")
        if mode < CAPTURE_GLOBAL or mode > CAPTURE_RELAXED:
            raise ValueError(f"SimDevice: capture mode must be CAPTURE_GLOBAL (0), CAPTURE_THREAD_LOCAL "
                             f"(1) or CAPTURE_RELAXED (2), got {mode}")
        if stream == 0:
            raise _capture_error("cuStreamBeginCapture", "unsupported",
                                 "stream 0 (the legacy default stream) cannot be captured; "
                                 "capture a stream from create_stream()")
        cap = self._capture_of.get(stream)
        if cap is not None:
            raise _capture_error("cuStreamBeginCapture", "illegal_state",
                                 f"stream {stream} is already in capture {cap.id} (begun on stream "
                                 f"{cap.origin}, {cap.status}); capture {cap.id} carries on")
        cap = _Capture(self._next_capture, stream, mode, self._me())
        self._next_capture += 1
        self._capture_of[stream] = cap
        self._live_captures[cap.id] = cap
        self._live += 1
        return BACKEND_OK

    cdef int _end(self, cap, bint keep_nodes) except -1:
        """Take every stream of `cap` out of capture; its nodes go to a graph or away."""
        for st in cap.terminals:
            del self._capture_of[st]
        del self._live_captures[cap.id]
        self._live -= 1
        cap.ended = True
        if not keep_nodes:
            for n in cap.nodes:
                del self._nodes[n]
        return 0

    cdef int _invalidate(self, cap, str reason) except -1:
        if cap.status == "active":
            cap.status = "invalidated"
            cap.reason = reason
        return 0

    cdef int _check_active(self, cap, str call, uintptr_t stream) except -1:
        if cap.status != "active":
            raise _capture_error(call, "invalidated",
                                 f"stream {stream} is in capture {cap.id}, which was invalidated "
                                 f"({cap.reason}); end_capture on stream {cap.origin} ends it")
        return 0

    cdef int capture_end(self, uintptr_t stream, uintptr_t* graph) except -1:
        self.counters["capture_end"] += 1
        if self._armed:
            self._inject("capture_end")
        cap = self._capture_of.get(stream) if self._live else None
        if cap is None:
            raise _capture_error("cuStreamEndCapture", "illegal_state",
                                 f"stream {stream} is not capturing: no capture to end")
        if stream != cap.origin:
            self._invalidate(cap, f"end_capture on stream {stream}, which joined it")
            raise _capture_error("cuStreamEndCapture", "unmatched",
                                 f"stream {stream} joined capture {cap.id}, which began on stream "
                                 f"{cap.origin}: end it there; capture {cap.id} is invalidated")
        if cap.mode != CAPTURE_RELAXED and self._me() != cap.thread:
            self._end(cap, False)
            raise _capture_error("cuStreamEndCapture", "wrong_thread",
                                 f"capture {cap.id} on stream {stream} began in "
                                 f"{_MODE_NAMES[cap.mode]} mode on another thread, which must end "
                                 f"it; the capture ended, with no graph")
        if cap.status != "active":
            self._end(cap, False)
            raise _capture_error("cuStreamEndCapture", "invalidated",
                                 f"capture {cap.id} on stream {stream} was invalidated ({cap.reason}); "
                                 f"it ended, with no graph")
        origin_terminals = cap.terminals[stream]
        reached = self._ancestor_set(origin_terminals)
        reached.update(origin_terminals)
        unjoined = []
        for st, terminals in cap.terminals.items():
            left = [n for n in terminals if n not in reached]
            if st != stream and left:
                unjoined.append(f"stream {st} (node{'s' if len(left) > 1 else ''} "
                                f"{', '.join([str(n) for n in left])})")
        if unjoined:
            self._end(cap, False)
            raise _capture_error("cuStreamEndCapture", "unjoined",
                                 f"capture {cap.id} began on stream {stream}, and the work of "
                                 f"{'; '.join(unjoined)} was not joined back into stream {stream} "
                                 f"(record an event after it and wait on that in stream {stream}); "
                                 f"the capture ended, with no graph")
        cdef uintptr_t g = self._next_graph
        self._next_graph += 1
        gr = _Graph(cap.id, cap.nodes)
        for n in cap.nodes:
            gr.work += self._nodes[n].count
        self._graphs[g] = gr
        self._end(cap, True)
        graph[0] = g
        return BACKEND_OK

    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1:
        self.counters["capture_info"] += 1
        if self._armed:
            self._inject("capture_info")
        # Destroyed handles only: the allocator asks about every malloc's stream while a route
        # is active, and callers (tests/test_cuda_cpu.py's CuPy streams) allocate on handles
        # SimDevice never made; it refuses those where they queue work, record or wait.
        if not self._destroyed_streams.empty() and self._destroyed_streams.count(stream):
            self._check_stream_alive(stream, "cuStreamGetCaptureInfo")
        if not self._live:
            return 0
        cap = self._capture_of.get(stream)
        if cap is None or cap.status != "active":
            return 0
        capture_id[0] = cap.id
        terminals.clear()
        for n in cap.terminals[stream]:
            terminals.push_back(n)
        return 1

    cdef object _node(self, node):
        nd = self._nodes.get(node)
        if nd is None:
            raise ValueError(f"SimDevice: unknown graph node {node} (its capture failed, or its graph "
                             "was destroyed)")
        return nd

    cdef object _graph(self, uintptr_t graph):
        gr = self._graphs.get(graph)
        if gr is None:
            raise ValueError(f"SimDevice: unknown graph handle {graph}")
        return gr

    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        self.counters["node_dependencies"] += 1
        if self._armed:
            self._inject("node_dependencies")
        nd = self._node(node)
        parents.clear()
        for p in nd.parents:
            parents.push_back(p)
        return BACKEND_OK

    cdef object _add_node(self, cap, uintptr_t stream, tuple uses, uint64_t count, str kind,
                          tuple events):
        cdef uintptr_t node = self._next_node
        self._next_node += 1
        self._nodes[node] = _Node(tuple(cap.terminals[stream]), uses, count, kind, events)
        cap.terminals[stream] = [node]
        cap.nodes.append(node)
        return node

    cdef object _capture_launch(self, uintptr_t stream, uint64_t count, uses):
        cap = self._capture_of[stream]
        self._check_active(cap, "cuLaunchKernel", stream)
        node = self._add_node(cap, stream, _uses_of(uses), count, "kernel", ())
        if self.checks_reuse:
            self._launches += 1
            self._nodes[node].op = ("launch", self._launches, stream)
        return node

    cdef int _capture_record(self, uintptr_t event, EventState* e, uintptr_t stream) except -1:
        cap = self._capture_of[stream]
        self._check_active(cap, "cuEventRecord", stream)
        e.captured = True
        self._event_capture[event] = (cap, tuple(cap.terminals[stream]))
        return BACKEND_OK

    cdef int _capture_wait(self, uintptr_t stream, uintptr_t event, EventState* e,
                           bint external) except -1:
        cap = self._capture_of.get(stream) if self._live else None
        if e.captured:
            ecap, nodes = self._event_capture[event]
            if ecap.ended:
                raise _capture_error("cuStreamWaitEvent", "invalid_value",
                                     f"event {event} was recorded in capture {ecap.id}, which has "
                                     f"ended; record it again before stream {stream} waits on it")
            if cap is None:
                if stream == 0:
                    self._invalidate(ecap, f"stream 0 waited on event {event}")
                    raise _capture_error("cuStreamWaitEvent", "unsupported",
                                         f"stream 0 (the legacy default stream) cannot join capture "
                                         f"{ecap.id} by waiting on event {event}; capture {ecap.id} "
                                         "is invalidated")
                if ecap.status != "active":
                    raise _capture_error("cuStreamWaitEvent", "invalidated",
                                         f"event {event} belongs to capture {ecap.id}, which was "
                                         f"invalidated ({ecap.reason}); stream {stream} cannot join it")
                self._capture_of[stream] = ecap
                ecap.terminals[stream] = list(nodes)
                return 0
            if cap is not ecap:
                reason = (f"stream {stream} of capture {cap.id} waited on event {event} of "
                          f"capture {ecap.id}")
                self._invalidate(cap, reason)
                self._invalidate(ecap, reason)
                raise _capture_error("cuStreamWaitEvent", "merge",
                                     f"{reason}: a wait cannot merge two captures; both are invalidated")
            self._check_active(cap, "cuStreamWaitEvent", stream)
            terminals = cap.terminals[stream]
            for n in nodes:
                if n not in terminals:
                    terminals.append(n)
            return 0
        self._check_active(cap, "cuStreamWaitEvent", stream)
        if external:
            self._add_node(cap, stream, (), 0, "wait", (event,))
        elif e.recorded:
            reason = f"stream {stream} waited on event {event}, which was not recorded in the capture"
            self._invalidate(cap, reason)
            raise _capture_error("cuStreamWaitEvent", "isolation",
                                 f"{reason} (pass external=True for cudaEventWaitExternal); capture "
                                 f"{cap.id} is invalidated")
        return 0

    cdef int _event_use_in_capture(self, uintptr_t event, bint captured, str call,
                                   str verb) except -1:
        """Raise for a query or synchronize of `event` that CUDA refuses now; only called while
        a capture is underway or the event is a capture event."""
        if captured:
            cap, nodes = self._event_capture[event]
            if cap.ended:
                raise _capture_error(call, "invalid_value",
                                     f"event {event} was recorded in capture {cap.id}, which has "
                                     f"ended: it stands for no work; record it again before you "
                                     f"{verb} it")
            self._invalidate(cap, f"{verb} of event {event}, recorded in the capture")
            raise _capture_error(call, "captured_event",
                                 f"cannot {verb} event {event}: it was recorded in capture "
                                 f"{cap.id} (begun on stream {cap.origin}), whose work does not "
                                 f"run; capture {cap.id} is invalidated")
        self._unsafe_call(call, f"{verb} of event {event}")
        return 0

    cdef int _stream_sync_in_capture(self, uintptr_t stream) except -1:
        cap = self._capture_of.get(stream)
        if cap is not None:
            self._invalidate(cap, f"synchronize of stream {stream}, in the capture")
            raise _capture_error("cuStreamSynchronize", "unsupported",
                                 f"cannot synchronize stream {stream}: it is in capture {cap.id} "
                                 f"(begun on stream {cap.origin}); capture {cap.id} is invalidated")
        self._unsafe_call("cuStreamSynchronize", f"synchronize of stream {stream}")
        return 0

    cdef int _device_sync_in_capture(self) except -1:
        caps = list(self._live_captures.values())
        for cap in caps:
            self._invalidate(cap, "device synchronize")
        raise _capture_error("cuCtxSynchronize", "unsupported",
                             "cannot synchronize the device while "
                             + ", ".join([f"capture {c.id} (stream {c.origin})" for c in caps])
                             + " is underway; invalidated")

    cdef int _unsafe_call(self, str call, str what) except -1:
        """cudaStreamCaptureMode's rule for a potentially unsafe call by this thread: refused (and
        the captures that refuse it invalidated) when this thread began a capture that is not
        relaxed, or, in global mode, another thread began a global capture."""
        cdef unsigned long me = self._me()
        cdef int mode = self._thread_modes.get(me, CAPTURE_GLOBAL) if self._thread_modes else CAPTURE_GLOBAL
        if mode == CAPTURE_RELAXED:
            return 0
        blocking = [c for c in self._live_captures.values()
                    if (c.thread == me and c.mode != CAPTURE_RELAXED)
                    or (mode == CAPTURE_GLOBAL and c.thread != me and c.mode == CAPTURE_GLOBAL)]
        if not blocking:
            return 0
        for c in blocking:
            self._invalidate(c, what)
        raise _capture_error(call, "unsupported",
                             f"{what} is not permitted while "
                             + ", ".join([f"capture {c.id} ({_MODE_NAMES[c.mode]} mode, stream "
                                          f"{c.origin}, {'this' if c.thread == me else 'another'} "
                                          "thread)" for c in blocking])
                             + " is underway; invalidated")

    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1:
        self.counters["graph_launch"] += 1
        if self._armed:
            self._inject("graph_launch")
        self._check_stream_alive(stream, "cuGraphLaunch")
        gr = self._graph(graph)
        events = []
        uses = {}
        for n in gr.nodes:
            nd = self._nodes[n]
            events.extend(nd.events)
            for u in nd.uses:
                uses[u] = None
        if self._live and stream in self._capture_of:
            cap = self._capture_of[stream]
            self._check_active(cap, "cuGraphLaunch", stream)
            node = self._add_node(cap, stream, tuple(uses), gr.work, "graph", tuple(events))
            if self.checks_reuse:
                self._nodes[node].op = ("graph", graph, stream)
            return BACKEND_OK
        cdef unordered_map[uintptr_t, EventState].iterator it
        for ev in events:
            it = self._events.find(ev)
            if it != self._events.end() and not deref(it).second.captured:
                self._push_wait(stream, &deref(it).second)
        self._stream(stream).launched += gr.work
        if self.checks_reuse and uses:
            # Every node's uses are pending until the graph's work is done: only an event
            # recorded after the launch orders anything after them.
            self._queue_uses(stream, self._stream(stream).launched, tuple(uses),
                             ("graph", graph, stream))
        return BACKEND_OK

    cdef int graph_destroy(self, uintptr_t graph) except -1:
        self.counters["graph_destroy"] += 1
        if self._armed:
            self._inject("graph_destroy")
        gr = self._graph(graph)
        for n in gr.nodes:
            del self._nodes[n]
        del self._graphs[graph]
        return BACKEND_OK

    cdef set _ancestor_set(self, nodes):
        seen = set()
        stack = []
        for n in nodes:
            stack.extend(self._node(n).parents)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(self._node(n).parents)
        return seen

    # Python access for tests and tools.

    def capture_status(self, uintptr_t stream):
        """"none", "active" or "invalidated" (cuStreamGetCaptureInfo's status of `stream`)."""
        cap = self._capture_of.get(stream) if self._live else None
        return "none" if cap is None else cap.status

    def exchange_capture_mode(self, mode):
        """Set the calling thread's capture mode, "global" (every thread's default),
        "thread_local" or "relaxed" (cudaThreadExchangeStreamCaptureMode); returns the previous
        one. It decides which potentially unsafe calls this thread may make during a capture."""
        if mode not in _MODE_NAMES:
            raise ValueError(f"capture mode must be one of {', '.join(_MODE_NAMES)}, got {mode!r}")
        cdef unsigned long me = self._me()
        previous = self._thread_modes.get(me, CAPTURE_GLOBAL)
        if mode == "global":
            self._thread_modes.pop(me, None)
        else:
            self._thread_modes[me] = _MODE_NAMES.index(mode)
        return _MODE_NAMES[previous]

    def graph_nodes(self, uintptr_t graph):
        """The nodes of a graph from end_capture, in capture order: a list of
        (node, [parent nodes], [device pointers it uses])."""
        return [(n, list(self._nodes[n].parents), list(self._nodes[n].uses))
                for n in self._graph(graph).nodes]

    def ancestors(self, nodes):
        """The set of nodes that any of `nodes` depends on, directly or through other nodes
        (`nodes` themselves only where one depends on another)."""
        return self._ancestor_set(list(nodes))

    def is_ancestor(self, node, of_nodes):
        """True when a node of `of_nodes` depends on `node`, directly or not: `node`'s work is
        ordered before theirs in every launch of the graph."""
        self._node(node)
        return node in self._ancestor_set(list(of_nodes))


# The collector's tp_clear for SimDevice (see the note above the class).

cdef extern from *:
    """
    static void pyalloc_set_tp_clear(PyObject* type, inquiry clear) {
        ((PyTypeObject*)type)->tp_clear = clear;
    }
    """
    ctypedef int (*tp_clear_fn "inquiry")(PyObject*) noexcept
    void pyalloc_set_tp_clear(PyObject* type, tp_clear_fn clear)


cdef int clear_sim_device(PyObject* o) noexcept:
    (<SimDevice><object>o).segment_alloc_hook = None
    return 0


pyalloc_set_tp_clear(<PyObject*>SimDevice, clear_sim_device)
