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

Layout. SimDevice is the driver-call surface: each Backend method counts the call in `counters`,
runs an injected failure (fail_next), the latency and the hook, checks capture, then delegates to
the module that owns the concern (typed C calls through the .pxd files):

* _sim_memory.AddressSpace: segments and their placement, reservations and mapped pages, the
  address slots of live devices;
* _sim_streams.Streams: work queues, waits, events, stream lifetime, the sanitizer's use records;
* _sim_capture.Captures: captures, nodes, graphs and the capture-mode rules.
"""
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.vector cimport vector
from posix.unistd cimport usleep

cimport cython
from cpython.object cimport PyObject

from pyalloc._backend cimport Backend, BACKEND_OK
from pyalloc._sim_memory cimport AddressSpace
from pyalloc._sim_streams cimport Streams, StreamState, EventState
from pyalloc._sim_capture cimport Captures
from pyalloc._sim_capture import ERRORS as _ERRORS, MODE_NAMES as _MODE_NAMES
from pyalloc.errors import CudaError
from pyalloc._faults import InjectedFailures

cdef size_t MiB = 1 << 20
cdef size_t GiB = 1 << 30


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
    "vm_unmap_keep": "cuMemRetainAllocationHandle", "vm_map_handles": "cuMemMap",
    "vm_free_handles": "cuMemRelease",
    "capture_begin": "cuStreamBeginCapture", "capture_end": "cuStreamEndCapture",
    "capture_info": "cuStreamGetCaptureInfo", "node_dependencies": "cuGraphNodeGetDependencies",
    "graph_launch": "cuGraphLaunch", "graph_destroy": "cuGraphDestroy",
}
_RESULT_NAMES = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
                 400: "CUDA_ERROR_INVALID_HANDLE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
                 999: "CUDA_ERROR_UNKNOWN"}
_RESULT_NAMES.update({code: name for code, name, _ in _ERRORS.values()})


# no_gc_clear: an allocator collected together with its Buffers and this backend may still free
# through it (events for blocks used on other streams), so the collector must not take its tables
# away (nor those of its AddressSpace, Streams and Captures, no_gc_clear too); clear_sim_device
# below drops only the hook, the one reference a user can add to it.
@cython.no_gc_clear
cdef class SimDevice(Backend):
    """SimDevice(total_memory=85899345920, *, device=0, base_address=None, alignment=2097152,
                 top_down=False, check_reuse=False)
--

    A simulated device. Sizes are bytes; handles (streams, events, addresses) are ints.

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
        any_stream: every stream handle is a live stream of this device (default False: only 0,
            1, 2, the handles create_stream gave out and other devices' handles are; any other
            is refused with CudaError INVALID_HANDLE, as the driver would, and the allocator's
            slow path refuses it with ValueError). True for a replay, whose streams are the
            recorded run's handles.

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

    cdef AddressSpace _mem
    cdef Streams _st
    cdef Captures _cap
    cdef public dict counters
    cdef public object segment_alloc_hook              # callable(nbytes) or None, see the class doc
    cdef public unsigned int latency_us                # driver-call delay, see the class doc
    # Injected failures (fail_next): operation -> [calls to let through, calls to fail, CUresult].
    cdef object _failures                              # InjectedFailures (pyalloc._faults)
    cdef int _armed                                    # len(_failures): one test on each call

    def __init__(self, size_t total_memory=80 * GiB, *, int device=0, base_address=None,
                 size_t alignment=2 * MiB, bint top_down=False, bint check_reuse=False,
                 bint any_stream=False):
        if total_memory == 0:
            raise ValueError("total_memory must be a positive number of bytes, got 0")
        if alignment == 0 or (alignment & (alignment - 1)) != 0:
            raise ValueError(f"alignment must be a power of two in bytes, got {alignment}")
        if base_address is not None and not 0 <= base_address < 2 ** 64:
            raise ValueError(f"base_address must be an address in [0, 2**64), got {base_address!r}")
        self.device = device
        self.kind = "sim"
        # (__init__ run twice keeps its address slot: the new AddressSpace takes it over)
        self._mem = AddressSpace(total_memory, base_address, alignment, top_down, self._mem)
        self.checks_reuse = check_reuse
        self._st = Streams(device, check_reuse)
        self._st.any_handle = any_stream
        self._cap = Captures(self._st)
        self._failures = InjectedFailures("SimDevice", _DRIVER_CALLS, _RESULT_NAMES)
        self._armed = 0
        self.counters = dict.fromkeys(
            ("segment_alloc", "segment_free", "memory_info", "event_create", "event_record",
             "event_query", "event_synchronize", "event_destroy", "stream_synchronize",
             "device_synchronize", "vm_reserve", "vm_release", "vm_map", "vm_unmap",
             "vm_unmap_keep", "vm_map_handles", "vm_free_handles",
             "capture_begin", "capture_end", "capture_info", "node_dependencies", "graph_launch",
             "graph_destroy", "memory_calls_during_capture", "check_handout",
             "injected_failures"), 0)

    def __repr__(self):
        return (f"SimDevice(total_memory={self.total_memory}, device={self.device}, "
                f"used_memory={self.used_memory}, segments={self._mem.segs.size()})")

    # ---------------------------------------------------------------- the driver-call surface

    cdef inline int _enter(self, str op) except -1:
        """What every counted backend call does first: count it, then fail it if fail_next
        armed a failure for it."""
        self.counters[op] += 1
        if self._armed:
            self._inject(op)
        return 0

    cdef inline int _enter_memory(self, str op) except -1:
        """_enter for the allocating and freeing calls, which stay legal during a capture."""
        self._enter(op)
        if self._cap.live:
            self.counters["memory_calls_during_capture"] += 1
        return 0

    cdef void _driver_latency(self) noexcept:
        if self.latency_us:
            with nogil:
                usleep(self.latency_us)

    def fail_next(self, call, int count=1, *, int skip=0, int result=999):
        """Make backend operation `call` fail as a driver call does: after `skip` calls that
        succeed, the next `count` calls raise CudaError (`result`: the CUresult, default 999,
        CUDA_ERROR_UNKNOWN) before doing anything, so state is as if they were never made.
        `call` is the operation's name in `counters` ("segment_alloc", "event_record", ...) or
        its driver call ("cuMemAlloc", as tests/fake_libcuda.c's fake_fail_next takes). count 0
        disarms. Each failure adds 1 to counters["injected_failures"] (and the call's own
        counter counts it, as a call made)."""
        self._failures.arm(call, count, skip, result)
        self._armed = len(self._failures.armed)

    def armed_failures(self):
        """{operation: (calls let through first, calls that will fail)} still armed."""
        return {op: (f[0], f[1]) for op, f in self._failures.armed.items()}

    cdef int _inject(self, str op) except -1:
        error = self._failures.take(op)
        if error is None:
            return 0
        self._armed = len(self._failures.armed)
        self.counters["injected_failures"] += 1
        raise error

    # ---------------------------------------------------------------- memory (_sim_memory)

    @property
    def total_memory(self):
        """Device capacity, bytes."""
        return self._mem.total_memory

    @property
    def used_memory(self):
        """Bytes in live segments and mapped pages."""
        return self._mem.used_memory

    @property
    def base_address(self):
        """Lowest address placement hands out for segments."""
        return self._mem.base_address

    @property
    def reservation_base(self):
        """Lowest address of reservations placed by first fit."""
        return self._mem.reservation_base

    @property
    def alignment(self):
        """Alignment of segment addresses, bytes."""
        return self._mem.alignment

    @property
    def top_down(self):
        """Whether unqueued segments are placed top down (see the class doc)."""
        return self._mem.top_down

    def place_segments(self, placements):
        """Queue addresses for future segments: an iterable of (address, size_bytes).

        A later segment allocation of exactly `size_bytes` takes the oldest queued address of that
        size; sizes with nothing queued fall back to first-fit placement.
        """
        self._mem.place_segments(placements)

    @property
    def address_slot(self):
        """The address range this device took (slot k: segments from 0x7f0000000000 + k TiB),
        or None when it was made with base_address."""
        return None if self._mem.slot < 0 else self._mem.slot

    @property
    def pending_placements(self):
        """Number of queued segment addresses not used yet."""
        return self._mem.pending_placements

    def segments(self):
        """Live segments as a sorted list of (address, size_bytes)."""
        return self._mem.segments()

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        self._driver_latency()
        self._enter_memory("segment_alloc")
        if self.segment_alloc_hook is not None:
            self.segment_alloc_hook(nbytes)
        return self._mem.alloc(nbytes, ptr)

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        self._driver_latency()
        self._enter_memory("segment_free")
        self._mem.free(ptr, nbytes)
        # cudaFree waits for the device before it gives the memory back: work queued on any
        # stream, which may still use the segment, completes first (PyTorch relies on it).
        self._st.finish_all()
        return BACKEND_OK

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        self._enter("memory_info")
        free_bytes[0] = self._mem.total_memory - self._mem.used_memory
        total_bytes[0] = self._mem.total_memory
        return BACKEND_OK

    def mem_get_info(self):
        """(free_bytes, total_bytes), like cudaMemGetInfo."""
        return self._mem.total_memory - self._mem.used_memory, self._mem.total_memory

    def place_reservations(self, placements):
        """Queue base addresses for future address-space reservations: (address, size_bytes) pairs.

        A later reservation of exactly `size_bytes` takes the oldest queued address of that size
        (how a replay puts expandable segments where PyTorch's driver put them).
        """
        self._mem.place_reservations(placements)

    @property
    def mapped_memory(self):
        """Bytes of physical memory mapped into reservations."""
        return self._mem.mapped_memory

    def is_mapped(self, uintptr_t addr, size_t nbytes):
        """True when every 2 MiB page touching [addr, addr + nbytes) is mapped."""
        return self._mem.is_mapped(addr, nbytes)

    def reservations(self):
        """Live reservations as a sorted list of (base address, size_bytes)."""
        return self._mem.reservation_list()

    cdef int vm_granularity(self, size_t* nbytes) except -1:
        nbytes[0] = 2 * MiB
        return BACKEND_OK

    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1:
        self._enter_memory("vm_reserve")
        return self._mem.reserve(nbytes, base)

    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1:
        self._enter_memory("vm_release")
        return self._mem.release(base, nbytes)

    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page_size) except -1:
        self._enter_memory("vm_map")
        return self._mem.map(addr, nbytes)

    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page_size) except -1:
        self._enter_memory("vm_unmap")
        if self.checks_reuse:
            self._st.check_unmap(addr, nbytes)
        return self._mem.unmap(addr, nbytes)

    cdef int vm_unmap_keep(self, uintptr_t addr, size_t page, size_t count, uintptr_t* handles) except -1:
        self._enter_memory("vm_unmap_keep")
        self._check_page(page)
        if self.checks_reuse:
            self._st.check_unmap(addr, count * page)
        return self._mem.unmap_keep(addr, count, handles)

    cdef int vm_map_handles(self, uintptr_t addr, size_t page, size_t count,
                            const uintptr_t* handles) except -1:
        self._enter_memory("vm_map_handles")
        self._check_page(page)
        return self._mem.map_pages(addr, count, handles)

    cdef int vm_free_handles(self, size_t page, size_t count, const uintptr_t* handles) except -1:
        self._enter_memory("vm_free_handles")
        self._check_page(page)
        return self._mem.free_pages(count, handles)

    cdef int _check_page(self, size_t page) except -1:
        if page != 2 * MiB:
            raise ValueError(f"SimDevice: physical pages are 2 MiB ({2 * MiB} bytes), got {page}")
        return 0

    # The virtual memory calls from Python (counted, and failed by fail_next, as the core's are),
    # for tests of the device model itself. Sizes in bytes; physical pages by handle (an int).

    def reserve_address_space(self, size_t nbytes):
        """vm_reserve: the base address of a new reservation of nbytes (whole 2 MiB pages)."""
        cdef uintptr_t base = 0
        self.vm_reserve(nbytes, &base)
        return base

    def map_new_pages(self, uintptr_t addr, size_t nbytes):
        """vm_map: create and map the pages of [addr, addr + nbytes); False when out of memory."""
        return self.vm_map(addr, nbytes, 2 * MiB) == BACKEND_OK

    def unmap_keeping_pages(self, uintptr_t addr, size_t count):
        """vm_unmap_keep: unmap `count` pages from addr; returns their handles, in address order."""
        cdef vector[uintptr_t] handles
        handles.resize(count)
        self.vm_unmap_keep(addr, 2 * MiB, count, handles.data())
        return list(handles)

    def map_kept_pages(self, uintptr_t addr, handles):
        """vm_map_handles: map the pages `handles` (mapped nowhere) at addr, addr + 2 MiB, ..."""
        cdef vector[uintptr_t] h = [int(x) for x in handles]
        self.vm_map_handles(addr, 2 * MiB, h.size(), h.data())

    def free_kept_pages(self, handles):
        """vm_free_handles: give the pages `handles` (mapped nowhere) back."""
        cdef vector[uintptr_t] h = [int(x) for x in handles]
        self.vm_free_handles(2 * MiB, h.size(), h.data())

    @property
    def unmapped_pages(self):
        """Physical pages (2 MiB each) that exist but are mapped nowhere: memory used_memory counts
        that no address reaches."""
        return self._mem.unmapped_pages

    # ---------------------------------------------------------------- streams and work (_sim_streams)

    def create_stream(self):
        """A new stream handle (a positive int; 0 is the default stream). As the driver does, the
        handle of the most recently destroyed stream is handed out again first."""
        return self._st.create()

    def destroy_stream(self, uintptr_t stream):
        """Destroy `stream` (cuStreamDestroy): returns at once; the work queued on it still
        completes (on synchronize(), or when an event recorded before is synchronized), but the
        handle is dead until create_stream() hands it out again. CudaError INVALID_HANDLE for
        stream 0, a destroyed stream or one in a capture (the driver refuses those too)."""
        self._st.destroy(stream, self._cap.in_capture(stream))

    def is_destroyed(self, uintptr_t stream):
        """True when `stream` was destroyed and its handle not handed out again."""
        return self._st.destroyed.count(stream) != 0

    cdef int stream_alive(self, uintptr_t stream) except -1:
        """0 for a destroyed stream, 1 for a live one; CudaError INVALID_HANDLE for a handle of
        this device that create_stream never gave out."""
        return self._st.alive(stream)

    def launch(self, uintptr_t stream=0, uint64_t count=1, uses=()):
        """Queue `count` units of work on `stream`; returns the stream's queued total.

        While `stream` captures, queues nothing: adds one kernel node after the stream's terminals
        (worth `count` units of work when the graph is launched, touching the device pointers in
        `uses`) and returns the node's handle. A use is an address (an int: 1 byte) or
        (address, nbytes). Outside capture `uses` matters only with check_reuse: the uses are
        pending until this work completes.
        """
        self._st.check_alive(stream, "cuLaunchKernel")
        if self._cap.in_capture(stream):
            return self._cap.launch(stream, count, uses)
        return self._st.launch(stream, count, uses)

    def pending(self, uintptr_t stream=0):
        """Units of work queued on `stream` and not completed."""
        cdef StreamState* s = self._st.state(stream)
        return s.launched - s.completed

    def complete(self, uintptr_t stream=0, count=None):
        """Finish queued work on `stream` in order (all of it by default, else `count` items).

        Work that waits on another stream's event finishes that stream's awaited work first, as
        the GPU would. Returns the number of items of `stream` completed.
        """
        cdef StreamState* s = self._st.state(stream)
        cdef uint64_t target = s.launched if count is None else min(s.completed + <uint64_t>count, s.launched)
        return self._st.advance(stream, target)

    def synchronize(self):
        """Finish all queued work on every stream (cudaDeviceSynchronize).

        Raises CudaError while a capture is underway, and invalidates every such capture."""
        if self._cap.live:
            self._cap.device_sync()
        self._st.finish_all()

    cdef int device_synchronize(self) except -1:
        self._enter("device_synchronize")
        self.synchronize()
        return BACKEND_OK

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        self._enter("stream_synchronize")
        self._st.check_alive(stream, "cuStreamSynchronize")
        if self._cap.live:
            self._cap.stream_sync(stream)
        self._st.finish_stream(stream)
        return BACKEND_OK

    cdef int stream_device(self, uintptr_t stream) except -2:
        return self._st.stream_device(stream)

    def device_of_stream(self, uintptr_t stream):
        """The ordinal of the device `stream` belongs to (see the module doc)."""
        return self._st.stream_device(stream)

    # ---------------------------------------------------------------- events (_sim_streams)

    cdef int event_create(self, uintptr_t* event) except -1:
        self._enter("event_create")
        event[0] = self._st.event_create(self.device)
        return BACKEND_OK

    cdef int event_create_on(self, int device, uintptr_t* event) except -1:
        self.event_create(event)
        self._st.event(event[0]).device = device
        return BACKEND_OK

    def device_of_event(self, uintptr_t event):
        """The ordinal of the device `event` was created for."""
        return self._st.event(event).device

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        self._driver_latency()
        self._enter("event_record")
        self._st.check_alive(stream, "cuEventRecord")
        cdef EventState* e = self._st.recordable(event, stream)
        if self._cap.in_capture(stream):
            return self._cap.record(event, e, stream)
        if e.captured:
            self._cap.forget_event(event, e)
        return self._st.record(e, stream)

    cdef int event_query(self, uintptr_t event) except -1:
        self._driver_latency()
        self._enter("event_query")
        cdef EventState* e = self._st.event(event)
        if e.captured or self._cap.live:
            self._cap.event_use(event, e.captured, "cuEventQuery", "query")
        return self._st.query(e)

    cdef int event_synchronize(self, uintptr_t event) except -1:
        self._enter("event_synchronize")
        cdef EventState* e = self._st.event(event)
        if e.captured or self._cap.live:
            self._cap.event_use(event, e.captured, "cuEventSynchronize", "synchronize")
        if e.recorded:
            self._st.finish(e.stream, e.target, e.seq)
        return BACKEND_OK

    cdef int event_destroy(self, uintptr_t event) except -1:
        self._enter("event_destroy")
        cdef EventState* e = self._st.event(event)
        if e.captured:
            self._cap.forget_event(event, e)
        self._st.events.erase(event)
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
        self._st.check_alive(stream, "cuStreamWaitEvent")
        cdef EventState* e = self._st.event(event)
        if e.captured or self._cap.in_capture(stream):
            self._cap.wait(stream, event, e, external)
            return
        self._st.push_wait(stream, e)

    # ---------------------------------------------------------------- the reuse sanitizer

    cdef int check_handout(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1:
        """Raise ReuseError when [ptr, ptr + nbytes) may still be used by work that is not
        ordered before `stream`'s next work: a queued use on another stream X at position P that
        X has not completed and that no wait of `stream` reaches (directly or through other
        streams' waits, with a target >= P); or a kernel node of an active capture, unless
        `stream` is in that capture and the node precedes its terminals. (Work queued on
        `stream` itself runs first, in order. A capture that was invalidated never runs.)
        RuntimeError when a page of the block, in an expandable segment, is not mapped."""
        self.counters["check_handout"] += 1
        if not self._mem.handout_mapped(ptr, nbytes):
            raise RuntimeError(f"SimDevice: block {ptr:#x} (+{nbytes} bytes) handed out with a page "
                               "of its reservation unmapped")
        self._st.check_known(stream, "malloc")
        self._st.check_uses(ptr, nbytes, stream)
        if self._cap.live:
            self._cap.check_uses(ptr, nbytes, stream)
        return 0

    def pending_uses(self):
        """The uses the sanitizer holds (check_reuse): a list of (stream, end item, [(start,
        end)], what queued it), completed ones pruned first. Empty when check_reuse is off."""
        return self._st.pending_uses()

    def check_reuse(self, uintptr_t ptr, size_t nbytes, uintptr_t stream=0):
        """Run the sanitizer's check of a block of `nbytes` bytes at `ptr` handed out for
        `stream` (what the allocator does for each block it hands out): None, or ReuseError."""
        self.check_handout(ptr, nbytes, stream)

    # ---------------------------------------------------------------- stream capture (_sim_capture)

    cdef int capture_begin(self, uintptr_t stream, int mode) except -1:
        self._enter("capture_begin")
        self._st.check_alive(stream, "cuStreamBeginCapture")
        return self._cap.begin(stream, mode)

    cdef int capture_end(self, uintptr_t stream, uintptr_t* graph) except -1:
        self._enter("capture_end")
        return self._cap.end(stream, graph)

    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1:
        self._enter("capture_info")
        # Destroyed handles only: the allocator asks about every malloc's stream while a route
        # is active, and callers (tests/test_cuda_cpu.py's CuPy streams) allocate on handles
        # SimDevice never made; it refuses those where they queue work, record or wait.
        self._st.check_not_destroyed(stream, "cuStreamGetCaptureInfo")
        return self._cap.info(stream, capture_id, terminals)

    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        self._enter("node_dependencies")
        return self._cap.dependencies(node, parents)

    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1:
        self._enter("graph_launch")
        self._st.check_alive(stream, "cuGraphLaunch")
        return self._cap.graph_launch(graph, stream)

    cdef int graph_destroy(self, uintptr_t graph) except -1:
        self._enter("graph_destroy")
        return self._cap.graph_destroy(graph)

    # Python access for tests and tools.

    def capture_status(self, uintptr_t stream):
        """"none", "active" or "invalidated" (cuStreamGetCaptureInfo's status of `stream`)."""
        return self._cap.status(stream)

    def exchange_capture_mode(self, mode):
        """Set the calling thread's capture mode, "global" (every thread's default),
        "thread_local" or "relaxed" (cudaThreadExchangeStreamCaptureMode); returns the previous
        one. It decides which potentially unsafe calls this thread may make during a capture."""
        return self._cap.exchange_mode(mode)

    def graph_nodes(self, uintptr_t graph):
        """The nodes of a graph from end_capture, in capture order: a list of
        (node, [parent nodes], [device pointers it uses])."""
        return self._cap.graph_nodes(graph)

    def ancestors(self, nodes):
        """The set of nodes that any of `nodes` depends on, directly or through other nodes
        (`nodes` themselves only where one depends on another)."""
        return self._cap.ancestor_set(list(nodes))

    def is_ancestor(self, node, of_nodes):
        """True when a node of `of_nodes` depends on `node`, directly or not: `node`'s work is
        ordered before theirs in every launch of the graph."""
        self._cap.node(node)
        return node in self._cap.ancestor_set(list(of_nodes))


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
