# cython: language_level=3
"""CudaDevice: the real-GPU backend, over cuda-python's Cython driver bindings (cydriver).

This is the only pyalloc module that cimports cydriver; `import pyalloc` never imports it, so a
machine without a driver (or without cuda-bindings) pays nothing until a CUDA backend is asked for
(pyalloc.cuda_backend imports this module lazily).

Contexts: each CudaDevice retains its device's primary context (the one the CUDA runtime, CuPy and
PyTorch use) and makes it current around the driver calls that act on "the current context"
(allocation, memory info, event creation and recording, synchronising stream 0), restoring the
caller's context afterwards, so that a CuPy or PyTorch "current device" is never changed by pyalloc.

Errors: every CUresult is checked; a failure raises pyalloc.CudaError(call, result, name,
description) (_cuda_calls, shared with CudaHost). Out of memory from cuMemAlloc is not an error
here: segment_alloc returns BACKEND_OOM so that the core can run its release-and-retry ladder.

Driver calls that can block (cuMemAlloc, cuMemFree, which synchronises the device, and the
synchronize calls) run with the GIL released; the core's own mutex keeps its state consistent.

Wrappers of driver calls are never `noexcept`: with no driver, cydriver raises from the first
call, and a noexcept function would print the exception ("Exception ignored") and return 0, which
reads as CUDA_SUCCESS.

Stream capture (CUDA graphs): capture_begin/capture_end/graph_launch/graph_destroy wrap
cuStreamBeginCapture, cuStreamEndCapture, cuGraphInstantiate (once per graph, on its first launch)
with cuGraphLaunch, and cuGraphExecDestroy with cuGraphDestroy; capture_info and node_dependencies
read the capture's state for the allocator (cuStreamGetCaptureInfo, cuGraphNodeGetDependencies).
The calls that get or give back device memory (segments, memory info and the virtual-memory calls)
switch this thread to relaxed capture mode around the driver call, as PyTorch's
cudaMallocMaybeCapturing does, so that a new segment can be allocated while a stream captures in
global mode without invalidating that capture.
"""
cimport cuda.bindings.cydriver as cydriver
from libc.stdint cimport uintptr_t
from libc.string cimport memset
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref

from pyalloc._backend cimport Backend, BACKEND_OK, BACKEND_OOM
from pyalloc._cuda_calls cimport (raise_error, check, check_in_context, check_relaxed, _MemoryCall,
                                  _Relaxed, _MemoryArgs, _Pages, _pages, _mem_alloc, _mem_free,
                                  _mem_get_info, _address_reserve, _address_free, _map_pages,
                                  _unmap_pages)
from pyalloc._cuda_calls import error_name
from pyalloc.errors import NoCudaDriverError


# ------------------------------------------------------------------------------ driver probe

cdef bint _initialized = False
cdef int _device_count = 0


def probe():
    """Initialise the driver once; returns (device_count, reason).

    device_count is 0 when there is no usable driver or GPU, and reason then says why (a string
    for error messages); on success reason is "". Repeated calls after a success return the cached
    count without a driver call. A missing libcuda raises inside cydriver (RuntimeError, or its
    subclass DynamicLibNotFoundError with newer cuda-bindings): that is caught and reported.
    """
    global _initialized, _device_count
    cdef cydriver.CUresult r
    cdef int count = 0
    if _initialized:
        return _device_count, ""
    try:
        with nogil:
            r = cydriver.cuInit(0)
    except (RuntimeError, OSError) as exc:
        return 0, f"the CUDA driver library could not be loaded ({type(exc).__name__}: {exc})"
    if r != cydriver.CUDA_SUCCESS:
        name, desc = error_name(<int>r)
        return 0, f"cuInit(0) failed with {name or 'CUresult'} {<int>r} ({desc or 'no description'})"
    r = cydriver.cuDeviceGetCount(&count)
    if r != cydriver.CUDA_SUCCESS:
        name, desc = error_name(<int>r)
        return 0, f"cuDeviceGetCount failed with {name or 'CUresult'} {<int>r} ({desc or 'no description'})"
    if count <= 0:
        return 0, "the CUDA driver reports no GPU (cuDeviceGetCount returned 0)"
    _initialized = True
    _device_count = count
    return count, ""


def driver_version():
    """The driver's CUDA version as an int (e.g. 13000 for 13.0). Needs a successful probe()."""
    cdef int version = 0
    check(cydriver.cuDriverGetVersion(&version), "cuDriverGetVersion")
    return version


cdef int current_ordinal(int none) except? -2:
    """Ordinal of the device whose context is current on this thread, or `none` when none is."""
    cdef cydriver.CUcontext ctx = NULL
    cdef cydriver.CUdevice dev = 0
    if not _initialized:
        return none
    check(cydriver.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent")
    if ctx == NULL:
        return none
    check(cydriver.cuCtxGetDevice(&dev), "cuCtxGetDevice")
    return <int>dev


def current_device():
    """Ordinal of the device whose context is current on this thread, or -1 when none is."""
    return current_ordinal(-1)


def current_device_or_zero():
    """current_device(), but 0 when no context is current: what device=None means to pyalloc."""
    return current_ordinal(0)


def pointer_device(uintptr_t ptr):
    """Ordinal of the device that owns device pointer `ptr` (cuPointerGetAttribute)."""
    cdef int ordinal = -1
    if not _initialized:
        raise NoCudaDriverError("the CUDA driver is not initialised (pyalloc.cuda_backend.is_available() first)")
    check(cydriver.cuPointerGetAttribute(&ordinal, cydriver.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                         <cydriver.CUdeviceptr>ptr), "cuPointerGetAttribute")
    return ordinal


# ------------------------------------------------------------------------------ the backend

cdef class CudaDevice(Backend):
    """CudaDevice(device=0)
--

    One GPU, through its primary context. Sizes are bytes; handles are ints.

    Args:
        device: device ordinal (0 .. device_count - 1).

    The driver must have been probed successfully first (pyalloc.cuda_backend.open_device does
    that and is the usual way to get one). close() releases the primary context; a CudaDevice that
    still holds segments refuses to close.
    """

    cdef cydriver.CUdevice _cudevice
    cdef cydriver.CUcontext _ctx
    cdef bint _retained
    cdef readonly Py_ssize_t live_segments     # segments allocated through this backend, not freed
    cdef readonly size_t live_bytes            # their bytes
    # Expandable segments: physical allocation handle of each mapped page, by page address.
    cdef unordered_map[uintptr_t, cydriver.CUmemGenericAllocationHandle] _page_handles
    # recycle_pages: physical allocations unmapped by vm_unmap_keep and not yet released.
    cdef unordered_set[uintptr_t] _kept_pages
    cdef readonly size_t mapped_bytes          # bytes currently mapped through vm_map
    cdef readonly Py_ssize_t live_reservations # address ranges reserved through vm_reserve, not freed
    cdef vector[int] _peers                    # devices that can access this one's memory
    cdef bint _peers_known
    # Executable graph of each graph launched through graph_launch (instantiated on its first
    # launch, destroyed with the graph by graph_destroy), by graph handle.
    cdef unordered_map[uintptr_t, cydriver.CUgraphExec] _graph_execs
    # Streams of other devices (record_stream with another GPU's stream): those devices' primary
    # contexts, retained on first use, and the events made in them, with their context.
    cdef unordered_map[int, cydriver.CUcontext] _other_contexts
    cdef unordered_map[uintptr_t, cydriver.CUcontext] _other_events

    def __init__(self, int device=0):
        cdef cydriver.CUdevice dev = 0
        cdef cydriver.CUcontext ctx = NULL
        cdef cydriver.CUresult r
        if not _initialized:
            count, reason = probe()
            if not count:
                raise NoCudaDriverError(f"cannot open CUDA device {device}: {reason}")
        if device < 0 or device >= _device_count:
            raise ValueError(f"device must be a CUDA ordinal in [0, {_device_count}), got {device}")
        check(cydriver.cuDeviceGet(&dev, device), "cuDeviceGet")
        with nogil:
            r = cydriver.cuDevicePrimaryCtxRetain(&ctx, dev)
        check(r, "cuDevicePrimaryCtxRetain")
        self.device = device
        self.kind = "cuda"
        self._cudevice = dev
        self._ctx = ctx
        self._retained = True

    def __dealloc__(self):
        # Release our reference to the primary context. It is refcounted: CuPy/PyTorch (through
        # the runtime) hold their own, so this never tears down a context someone else uses.
        # Errors (e.g. CUDA_ERROR_DEINITIALIZED at exit) have nowhere to go and are ignored.
        if self._retained:
            self._retained = False
            try:
                self._destroy_graph_execs()
            except BaseException:
                pass
            self._release_other_contexts()
            try:
                cydriver.cuDevicePrimaryCtxRelease(self._cudevice)
            except BaseException:
                pass

    cdef int _destroy_graph_execs(self) except -1:
        """Destroy the cached executable graphs (the graphs stay their owners')."""
        cdef cydriver.CUresult r, first = cydriver.CUDA_SUCCESS
        for entry in self._graph_execs:
            r = cydriver.cuGraphExecDestroy(entry.second)
            if first == cydriver.CUDA_SUCCESS:
                first = r
        self._graph_execs.clear()
        check(first, "cuGraphExecDestroy")
        return 0

    cdef void _release_other_contexts(self) noexcept:
        # Refcounted like our own (the runtime holds its own reference); nothing to report to.
        cdef cydriver.CUdevice dev = 0
        for entry in self._other_contexts:
            if cydriver.cuDeviceGet(&dev, entry.first) == cydriver.CUDA_SUCCESS:
                cydriver.cuDevicePrimaryCtxRelease(dev)
        self._other_contexts.clear()
        self._other_events.clear()

    def close(self):
        """Release the primary context. Raises RuntimeError while segments are still allocated."""
        if not self._retained:
            return
        if self.live_segments:
            raise RuntimeError(
                f"CudaDevice({self.device}) still holds {self.live_segments} segments "
                f"({self.live_bytes} bytes); free them (empty_cache) before close()")
        self._retained = False
        self._release_other_contexts()
        try:
            self._destroy_graph_execs()
        finally:
            check(cydriver.cuDevicePrimaryCtxRelease(self._cudevice), "cuDevicePrimaryCtxRelease")

    @property
    def closed(self):
        return not self._retained

    def __repr__(self):
        return (f"CudaDevice(device={self.device}, live_segments={self.live_segments}, "
                f"live_bytes={self.live_bytes}{', closed' if not self._retained else ''})")

    cdef inline int _check_open(self) except -1:
        if not self._retained:
            raise RuntimeError(f"CudaDevice({self.device}) is closed")
        return 0

    # The calls below follow one pattern: inside one nogil block, _enter makes our context current
    # (remembering the caller's), the call is made, and _leave puts the caller's context back; the
    # results are checked with the GIL held. Switching only when needed keeps the common case
    # (CuPy/PyTorch already on this device) at one thread-local read. The helpers keep cydriver's
    # exception value, so a missing driver still raises instead of reading as success.

    cdef cydriver.CUresult _enter(self, cydriver.CUcontext* prev) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
        cdef cydriver.CUresult r = cydriver.cuCtxGetCurrent(prev)
        if r == cydriver.CUDA_SUCCESS and prev[0] != self._ctx:
            r = cydriver.cuCtxSetCurrent(self._ctx)
        return r

    cdef cydriver.CUresult _leave(self, cydriver.CUcontext prev) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
        if prev != self._ctx:
            return cydriver.cuCtxSetCurrent(prev)
        return cydriver.CUDA_SUCCESS

    cdef int _relaxed_call(self, _MemoryCall call, void* args, _Relaxed* out, bint in_context) except -1:
        """call(args) without the GIL, with this thread in relaxed capture mode (see "relaxed
        capture mode" above) and, when in_context, our context current; *out receives each
        step's result. The caller's mode and context come back whatever the call does, a raised
        exception included (cydriver raises when libcuda lacks a function)."""
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUstreamCaptureMode mode = cydriver.CU_STREAM_CAPTURE_MODE_RELAXED
        out.enter = out.relax = out.call = out.restore = out.leave = cydriver.CUDA_SUCCESS
        with nogil:
            if in_context:
                out.enter = self._enter(&prev)
            if out.enter == cydriver.CUDA_SUCCESS:
                try:
                    out.relax = cydriver.cuThreadExchangeStreamCaptureMode(&mode)   # mode: the caller's
                    if out.relax == cydriver.CUDA_SUCCESS:
                        try:
                            out.call = call(args)
                        finally:
                            out.restore = cydriver.cuThreadExchangeStreamCaptureMode(&mode)
                finally:
                    if in_context:
                        out.leave = self._leave(prev)
        return 0

    # ---------------------------------------------------------------- segments

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        self._check_open()
        cdef _MemoryArgs args
        args.ptr = 0
        args.nbytes = nbytes
        cdef _Relaxed r
        self._relaxed_call(_mem_alloc, &args, &r, True)     # legal while a stream captures
        check(r.enter, "cuCtxSetCurrent")
        check(r.relax, "cuThreadExchangeStreamCaptureMode")
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        check(r.leave, "cuCtxSetCurrent")
        if r.call == cydriver.CUDA_ERROR_OUT_OF_MEMORY:
            return BACKEND_OOM
        check(r.call, "cuMemAlloc")
        self.live_segments += 1
        self.live_bytes += nbytes
        ptr[0] = <uintptr_t>args.ptr
        return BACKEND_OK

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        self._check_open()
        cdef _MemoryArgs args
        args.ptr = <cydriver.CUdeviceptr>ptr
        cdef _Relaxed r
        self._relaxed_call(_mem_free, &args, &r, True)
        check_relaxed(&r, "cuMemFree")
        self.live_segments -= 1
        self.live_bytes -= nbytes
        return BACKEND_OK

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        # Relaxed too: the core asks for memory info when it creates an expandable segment and
        # when it reports out of memory, both of which can happen during a capture.
        self._check_open()
        cdef _MemoryArgs args
        args.free_bytes = free_bytes
        args.total_bytes = total_bytes
        cdef _Relaxed r
        self._relaxed_call(_mem_get_info, &args, &r, True)
        check_relaxed(&r, "cuMemGetInfo")
        return BACKEND_OK

    def mem_get_info(self):
        """(free_bytes, total_bytes) of the device, from cuMemGetInfo."""
        cdef size_t free_bytes = 0, total_bytes = 0
        self.memory_info(&free_bytes, &total_bytes)
        return free_bytes, total_bytes

    # ---------------------------------------------------------------- events and streams

    cdef int event_create(self, uintptr_t* event) except -1:
        self._check_open()
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUevent ev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                # No timing: the allocator only asks "done yet?", and timing events cost more.
                r_call = cydriver.cuEventCreate(&ev, cydriver.CU_EVENT_DISABLE_TIMING)
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuEventCreate", r_leave)
        event[0] = <uintptr_t>ev
        return BACKEND_OK

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        # Our context must be current: stream handles 0/1/2 (legacy, per-thread) mean "the
        # current context's" default stream.
        self._check_open()
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        if not self._other_events.empty() and self._other_events.count(event):
            return self._record_in_other_context(event, stream, self._other_events[event])
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuEventRecord(<cydriver.CUevent>event, <cydriver.CUstream>stream)
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuEventRecord", r_leave)
        return BACKEND_OK

    cdef int _record_in_other_context(self, uintptr_t event, uintptr_t stream,
                                      cydriver.CUcontext ctx) except -1:
        """cuEventRecord of an event of another device's context, with that context current
        (as PyTorch records on the used stream's device)."""
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = cydriver.cuCtxGetCurrent(&prev)
            if r_enter == cydriver.CUDA_SUCCESS and prev != ctx:
                r_enter = cydriver.cuCtxSetCurrent(ctx)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuEventRecord(<cydriver.CUevent>event, <cydriver.CUstream>stream)
                if prev != ctx:
                    r_leave = cydriver.cuCtxSetCurrent(prev)
        check_in_context(r_enter, r_call, "cuEventRecord", r_leave)
        return BACKEND_OK

    cdef int stream_device(self, uintptr_t stream) except -2:
        # 0, 1, 2: the legacy and per-thread default streams, which mean the current context's
        # (ours, while we record): this device's.
        if stream <= 2:
            return self.device
        self._check_open()
        cdef cydriver.CUdevice dev = 0, other = 0
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuStreamGetDevice(<cydriver.CUstream>stream, &dev)
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuStreamGetDevice", r_leave)
        if dev == self._cudevice:
            return self.device
        for ordinal in range(_device_count):
            check(cydriver.cuDeviceGet(&other, ordinal), "cuDeviceGet")
            if other == dev:
                return ordinal
        raise ValueError(f"stream {stream:#x} belongs to a CUDA device pyalloc cannot see")

    cdef int event_create_on(self, int device, uintptr_t* event) except -1:
        if device == self.device:
            return self.event_create(event)
        self._check_open()
        cdef cydriver.CUdevice dev = 0
        cdef cydriver.CUcontext ctx = NULL, prev = NULL
        cdef cydriver.CUevent ev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        if not self._other_contexts.count(device):
            check(cydriver.cuDeviceGet(&dev, device), "cuDeviceGet")
            with nogil:
                r_call = cydriver.cuDevicePrimaryCtxRetain(&ctx, dev)
            check(r_call, "cuDevicePrimaryCtxRetain")
            self._other_contexts[device] = ctx
        ctx = self._other_contexts[device]
        with nogil:
            r_enter = cydriver.cuCtxGetCurrent(&prev)
            if r_enter == cydriver.CUDA_SUCCESS and prev != ctx:
                r_enter = cydriver.cuCtxSetCurrent(ctx)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuEventCreate(&ev, cydriver.CU_EVENT_DISABLE_TIMING)
                if prev != ctx:
                    r_leave = cydriver.cuCtxSetCurrent(prev)
        check_in_context(r_enter, r_call, "cuEventCreate", r_leave)
        event[0] = <uintptr_t>ev
        self._other_events[event[0]] = ctx
        return BACKEND_OK

    cdef int event_query(self, uintptr_t event) except -1:
        self._check_open()
        cdef cydriver.CUresult r = cydriver.cuEventQuery(<cydriver.CUevent>event)
        if r == cydriver.CUDA_SUCCESS:
            return 1
        if r == cydriver.CUDA_ERROR_NOT_READY:
            return 0
        raise_error("cuEventQuery", r)
        return -1

    cdef int event_synchronize(self, uintptr_t event) except -1:
        self._check_open()
        cdef cydriver.CUresult r
        with nogil:
            r = cydriver.cuEventSynchronize(<cydriver.CUevent>event)
        check(r, "cuEventSynchronize")
        return BACKEND_OK

    cdef int event_destroy(self, uintptr_t event) except -1:
        self._check_open()
        if not self._other_events.empty():
            self._other_events.erase(event)
        check(cydriver.cuEventDestroy(<cydriver.CUevent>event), "cuEventDestroy")
        return BACKEND_OK

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        self._check_open()
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuStreamSynchronize(<cydriver.CUstream>stream)
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuStreamSynchronize", r_leave)
        return BACKEND_OK

    cdef int device_synchronize(self) except -1:
        self.synchronize()
        return BACKEND_OK

    def synchronize(self):
        """Wait for all work on the device (cuCtxSynchronize on its primary context)."""
        self._check_open()
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuCtxSynchronize()
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuCtxSynchronize", r_leave)

    # Python-level access to the event calls, for tests and tools (the core uses the cdef ones).

    def record_event(self, stream=0):
        """Create an event and record it on `stream` (an int handle) now; returns its handle."""
        cdef uintptr_t ev = 0
        self.event_create(&ev)
        try:
            self.event_record(ev, <uintptr_t>stream)
        except BaseException:
            self.event_destroy(ev)
            raise
        return ev

    def event_done(self, uintptr_t event):
        """True when the work queued before the event's record has completed."""
        return self.event_query(event) == 1

    def destroy_event(self, uintptr_t event):
        """Destroy an event made by record_event."""
        self.event_destroy(event)

    def wait_event(self, uintptr_t event):
        """Block until the event has completed (cuEventSynchronize)."""
        self.event_synchronize(event)

    # ---------------------------------------------------------------- stream capture and graphs
    #
    # The allocator never records, queries or synchronizes events while one of its streams
    # captures; if anything else does, the driver's refusal comes back as a CudaError naming the
    # call and the result (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CUDA_ERROR_CAPTURED_EVENT,
    # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED ...), as for any other failed driver call.

    @property
    def instantiated_graphs(self):
        """How many graphs have an executable graph cached (launched, not yet destroyed)."""
        return self._graph_execs.size()

    cdef int capture_begin(self, uintptr_t stream, int mode) except -1:
        self._check_open()
        if mode < 0 or mode > 2:
            raise ValueError(f"capture mode must be 0 (global), 1 (thread_local) or 2 (relaxed), got {mode}")
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuStreamBeginCapture(<cydriver.CUstream>stream,
                                                       <cydriver.CUstreamCaptureMode>mode)
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuStreamBeginCapture", r_leave)
        return BACKEND_OK

    cdef int capture_end(self, uintptr_t stream, uintptr_t* graph) except -1:
        self._check_open()
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUgraph g = NULL
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuStreamEndCapture(<cydriver.CUstream>stream, &g)
                r_leave = self._leave(prev)
        check(r_enter, "cuCtxSetCurrent")
        if r_call != cydriver.CUDA_SUCCESS and g != NULL:
            # Not expected (an invalidated capture returns no graph), but never leak one.
            cydriver.cuGraphDestroy(g)
        check(r_call, "cuStreamEndCapture")
        if r_leave != cydriver.CUDA_SUCCESS:
            cydriver.cuGraphDestroy(g)
            check(r_leave, "cuCtxSetCurrent")
        graph[0] = <uintptr_t>g
        return BACKEND_OK

    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1:
        self._check_open()
        cdef cydriver.CUgraphExec exec_ = NULL
        cdef cydriver.CUgraphExec other = NULL
        cdef bint cached = False
        it = self._graph_execs.find(graph)
        if it != self._graph_execs.end():
            exec_ = deref(it).second
            cached = True
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_inst = cydriver.CUDA_SUCCESS, r_call = cydriver.CUDA_SUCCESS
        cdef cydriver.CUresult r_leave = cydriver.CUDA_SUCCESS
        if not cached:
            # Instantiate once, on the first launch (the expensive step: validation, and the
            # device-side work descriptors), with our context current.
            with nogil:
                r_enter = self._enter(&prev)
                if r_enter == cydriver.CUDA_SUCCESS:
                    r_inst = cydriver.cuGraphInstantiate(&exec_, <cydriver.CUgraph>graph, 0)
                    r_leave = self._leave(prev)
            check(r_enter, "cuCtxSetCurrent")
            if r_inst == cydriver.CUDA_SUCCESS and r_leave != cydriver.CUDA_SUCCESS:
                cydriver.cuGraphExecDestroy(exec_)
            check(r_inst, "cuGraphInstantiate")
            check(r_leave, "cuCtxSetCurrent")
            # Another thread may have instantiated the same graph while the GIL was released:
            # keep the first executable graph, destroy ours.
            it = self._graph_execs.find(graph)
            if it != self._graph_execs.end():
                other = deref(it).second
                check(cydriver.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
                exec_ = other
            else:
                self._graph_execs[graph] = exec_
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_call = cydriver.cuGraphLaunch(exec_, <cydriver.CUstream>stream)
                r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuGraphLaunch", r_leave)
        return BACKEND_OK

    cdef int graph_destroy(self, uintptr_t graph) except -1:
        self._check_open()
        cdef cydriver.CUgraphExec exec_ = NULL
        it = self._graph_execs.find(graph)
        if it != self._graph_execs.end():
            exec_ = deref(it).second
            self._graph_execs.erase(it)
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUresult r_enter, r_exec = cydriver.CUDA_SUCCESS, r_graph = cydriver.CUDA_SUCCESS
        cdef cydriver.CUresult r_leave = cydriver.CUDA_SUCCESS
        with nogil:
            r_enter = self._enter(&prev)
            if r_enter == cydriver.CUDA_SUCCESS:
                if exec_ != NULL:
                    r_exec = cydriver.cuGraphExecDestroy(exec_)
                r_graph = cydriver.cuGraphDestroy(<cydriver.CUgraph>graph)
                r_leave = self._leave(prev)
        check(r_enter, "cuCtxSetCurrent")
        check(r_exec, "cuGraphExecDestroy")
        check(r_graph, "cuGraphDestroy")
        check(r_leave, "cuCtxSetCurrent")
        return BACKEND_OK

    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1:
        # On the allocator's path for every allocation while a capture is underway, so: no
        # Python objects, no GIL release (the call does not block), and a context switch only
        # when the caller is on another device. Our context must be current for the stream
        # handles 0/1/2, which mean "the current context's" default stream.
        self._check_open()
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUstreamCaptureStatus status = cydriver.CU_STREAM_CAPTURE_STATUS_NONE
        cdef cydriver.cuuint64_t cid = 0
        cdef const cydriver.CUgraphNode* deps = NULL
        # Asked for although unused: without it the query fails (CUDA_ERROR_LOSSY_QUERY) when an
        # edge carries data, e.g. a programmatic-dependent-launch edge.
        cdef const cydriver.CUgraphEdgeData* edges = NULL
        cdef size_t n = 0, i
        cdef cydriver.CUresult r_enter, r_call = cydriver.CUDA_SUCCESS, r_leave = cydriver.CUDA_SUCCESS
        r_enter = self._enter(&prev)
        if r_enter == cydriver.CUDA_SUCCESS:
            r_call = cydriver.cuStreamGetCaptureInfo(<cydriver.CUstream>stream, &status, &cid, NULL,
                                                     &deps, &edges, &n)
            if r_call == cydriver.CUDA_SUCCESS and status == cydriver.CU_STREAM_CAPTURE_STATUS_ACTIVE:
                # Copied before _leave: the driver's array is valid until the next call on the stream.
                terminals[0].resize(n)
                for i in range(n):
                    terminals[0][i] = <uintptr_t>deps[i]
            r_leave = self._leave(prev)
        check_in_context(r_enter, r_call, "cuStreamGetCaptureInfo", r_leave)
        if status != cydriver.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            terminals[0].clear()
            return 0                            # not capturing, or the capture was invalidated
        capture_id[0] = <unsigned long long>cid
        return 1

    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        self._check_open()
        cdef size_t n = 0, i
        check(cydriver.cuGraphNodeGetDependencies(<cydriver.CUgraphNode>node, NULL, NULL, &n),
              "cuGraphNodeGetDependencies")
        cdef vector[cydriver.CUgraphNode] deps
        cdef vector[cydriver.CUgraphEdgeData] edges     # see capture_info: avoids LOSSY_QUERY
        if n:
            deps.resize(n)
            edges.resize(n)
            memset(edges.data(), 0, n * sizeof(cydriver.CUgraphEdgeData))
            check(cydriver.cuGraphNodeGetDependencies(<cydriver.CUgraphNode>node, deps.data(),
                                                      edges.data(), &n),
                  "cuGraphNodeGetDependencies")
            if n > deps.size():
                n = deps.size()
        parents[0].resize(n)
        for i in range(n):
            parents[0][i] = <uintptr_t>deps[i]
        return BACKEND_OK

    # ---------------------------------------------------------------- virtual memory

    cdef void _allocation_prop(self, cydriver.CUmemAllocationProp* prop) noexcept nogil:
        memset(prop, 0, sizeof(cydriver.CUmemAllocationProp))
        prop.type = cydriver.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device

    cdef int _find_peers(self) except -1:
        """The other devices that can access this device's memory (cuDeviceCanAccessPeer), once."""
        if self._peers_known:
            return 0
        cdef cydriver.CUdevice other = 0
        cdef int can = 0
        for d in range(_device_count):
            if d == self.device:
                continue
            check(cydriver.cuDeviceGet(&other, d), "cuDeviceGet")
            check(cydriver.cuDeviceCanAccessPeer(&can, other, self._cudevice), "cuDeviceCanAccessPeer")
            if can:
                self._peers.push_back(d)
        self._peers_known = True
        return 0

    def peers(self):
        """Devices given access to this device's expandable-segment memory."""
        self._find_peers()
        return list(self._peers)

    cdef int vm_granularity(self, size_t* nbytes) except -1:
        self._check_open()
        cdef cydriver.CUmemAllocationProp prop
        self._allocation_prop(&prop)
        check(cydriver.cuMemGetAllocationGranularity(nbytes, &prop, cydriver.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity")
        return BACKEND_OK

    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1:
        self._check_open()
        cdef _MemoryArgs args
        args.ptr = 0
        args.nbytes = nbytes
        cdef _Relaxed r
        self._relaxed_call(_address_reserve, &args, &r, False)
        check(r.relax, "cuThreadExchangeStreamCaptureMode")
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        if r.call == cydriver.CUDA_ERROR_OUT_OF_MEMORY:
            # Address space exhausted (each stream's expandable segment reserves about the
            # device's size): out of memory, for the ladder, which releases empty segments.
            return BACKEND_OOM
        check(r.call, "cuMemAddressReserve")
        base[0] = <uintptr_t>args.ptr
        self.live_reservations += 1
        return BACKEND_OK

    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1:
        self._check_open()
        cdef _MemoryArgs args
        args.ptr = <cydriver.CUdeviceptr>base
        args.nbytes = nbytes
        cdef _Relaxed r
        self._relaxed_call(_address_free, &args, &r, False)
        check(r.relax, "cuThreadExchangeStreamCaptureMode")
        check(r.call, "cuMemAddressFree")
        self.live_reservations -= 1                 # freed, even should the restore fail
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        return BACKEND_OK

    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        """Back [addr, addr + nbytes) with one physical allocation per `page` bytes, mapped and
        made readable and writable by this device. BACKEND_OOM (nothing left mapped) when the
        device runs out of memory part way."""
        self._check_open()
        # Pages count from the segment's base, which is only granularity-aligned: check sizes.
        if page == 0 or nbytes % page:
            raise ValueError(f"vm_map of {nbytes} bytes at {addr:#x} is not whole {page}-byte pages")
        cdef cydriver.CUmemAllocationProp prop
        self._allocation_prop(&prop)
        cdef vector[cydriver.CUmemAccessDesc] access
        self._access_list(&access)
        cdef size_t count = nbytes // page, i
        cdef vector[cydriver.CUmemGenericAllocationHandle] handles
        handles.resize(count)
        cdef _Pages pages = _pages(addr, nbytes, page, handles.data())
        pages.prop = &prop
        pages.access = access.data()
        pages.access_count = access.size()
        cdef _Relaxed r
        self._relaxed_call(_map_pages, &pages, &r, False)     # one exchange pair for all the pages
        check(r.relax, "cuThreadExchangeStreamCaptureMode")
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        if pages.r_create == cydriver.CUDA_ERROR_OUT_OF_MEMORY:
            return BACKEND_OOM
        check(pages.r_create, "cuMemCreate")
        check(pages.r_map, "cuMemMap")
        check(pages.r_access, "cuMemSetAccess")
        for i in range(count):
            self._page_handles[addr + i * page] = handles[i]
        self.mapped_bytes += nbytes
        return BACKEND_OK

    cdef int _access_list(self, vector[cydriver.CUmemAccessDesc]* access) except -1:
        """Read/write access for this device and for every peer that can reach it, so that copies
        and kernels on other GPUs work on expandable memory as they do on cuMemAlloc memory."""
        self._find_peers()
        access.resize(1 + self._peers.size())
        memset(access.data(), 0, access.size() * sizeof(cydriver.CUmemAccessDesc))
        cdef size_t k
        for k in range(access.size()):
            access[0][k].location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
            access[0][k].location.id = self.device if k == 0 else self._peers[k - 1]
            access[0][k].flags = cydriver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return 0

    cdef int vm_unmap_keep(self, uintptr_t addr, size_t page, size_t count, uintptr_t* handles) except -1:
        """Unmap `count` pages mapped by vm_map or vm_map_handles from addr (cuMemUnmap) and keep
        their physical allocations: handles[i] is the page that was at addr + i * page."""
        self._check_open()
        return self._unmap_range(addr, page, count, handles, True)

    cdef int _unmap_range(self, uintptr_t addr, size_t page, size_t count, uintptr_t* handles,
                          bint keep) except -1:
        """vm_unmap (keep false: the pages are released too) and vm_unmap_keep: handles[i]
        receives the page that was at addr + i * page."""
        cdef size_t i
        for i in range(count):
            if self._page_handles.count(addr + i * page) == 0:
                raise ValueError(f"vm_unmap: page {addr + i * page:#x} was not mapped by vm_map")
            handles[i] = <uintptr_t>self._page_handles[addr + i * page]
        cdef _Pages pages = _pages(addr, count * page, page,
                                   <cydriver.CUmemGenericAllocationHandle*>handles)
        pages.kept = keep
        cdef _Relaxed r
        self._relaxed_call(_unmap_pages, &pages, &r, False)
        check(r.relax, "cuThreadExchangeStreamCaptureMode")    # nothing was unmapped
        check(pages.r_unmap, "cuMemUnmap")
        # Unmapped: forgotten (or kept), even should a release or the restore fail below.
        for i in range(count):
            self._page_handles.erase(addr + i * page)
            if keep:
                self._kept_pages.insert(handles[i])
        self.mapped_bytes -= count * page
        check(pages.r_release, "cuMemRelease")
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        return BACKEND_OK

    cdef int vm_map_handles(self, uintptr_t addr, size_t page, size_t count,
                            const uintptr_t* handles) except -1:
        """Map pages kept by vm_unmap_keep at addr, addr + page, ... (cuMemMap, cuMemSetAccess);
        nothing is left mapped when a call fails."""
        self._check_open()
        cdef size_t i
        cdef vector[cydriver.CUmemGenericAllocationHandle] h
        for i in range(count):
            if self._kept_pages.count(handles[i]) == 0:
                raise ValueError(f"vm_map_handles: page handle {handles[i]:#x} is not kept unmapped")
            if self._page_handles.count(addr + i * page):
                raise ValueError(f"vm_map_handles: page {addr + i * page:#x} is mapped already")
            h.push_back(<cydriver.CUmemGenericAllocationHandle>handles[i])
        cdef vector[cydriver.CUmemAccessDesc] access
        self._access_list(&access)
        cdef _Pages pages = _pages(addr, count * page, page, h.data())
        pages.kept = True
        pages.access = access.data()
        pages.access_count = access.size()
        cdef _Relaxed r
        self._relaxed_call(_map_pages, &pages, &r, False)
        check(r.relax, "cuThreadExchangeStreamCaptureMode")
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        check(pages.r_map, "cuMemMap")
        check(pages.r_access, "cuMemSetAccess")
        for i in range(count):
            self._kept_pages.erase(handles[i])
            self._page_handles[addr + i * page] = h[i]
        self.mapped_bytes += count * page
        return BACKEND_OK

    cdef int vm_free_handles(self, size_t page, size_t count, const uintptr_t* handles) except -1:
        """Release pages kept by vm_unmap_keep (cuMemRelease); a page whose release failed stays
        kept."""
        self._check_open()
        cdef size_t i
        cdef vector[cydriver.CUmemGenericAllocationHandle] h
        for i in range(count):
            if self._kept_pages.count(handles[i]) == 0:
                raise ValueError(f"vm_free_handles: page handle {handles[i]:#x} is not kept unmapped")
            h.push_back(<cydriver.CUmemGenericAllocationHandle>handles[i])
        cdef _Pages pages = _pages(0, count * page, page, h.data())
        cdef _Relaxed r
        self._relaxed_call(_unmap_pages, &pages, &r, False)
        check(r.relax, "cuThreadExchangeStreamCaptureMode")
        for i in range(pages.released):     # those before a failure are gone
            self._kept_pages.erase(handles[i])
        check(pages.r_release, "cuMemRelease")
        check(r.restore, "cuThreadExchangeStreamCaptureMode")
        return BACKEND_OK

    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        """Unmap and release the pages of [addr, addr + nbytes), mapped earlier by vm_map."""
        self._check_open()
        # Pages count from the segment's base, which is only granularity-aligned: check sizes.
        if page == 0 or nbytes % page:
            raise ValueError(f"vm_unmap of {nbytes} bytes at {addr:#x} is not whole {page}-byte pages")
        cdef vector[uintptr_t] handles
        handles.resize(nbytes // page)
        self._unmap_range(addr, page, nbytes // page, handles.data(), False)
        return BACKEND_OK
