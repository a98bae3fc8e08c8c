# cython: language_level=3
"""Framework entry points: the callbacks other frameworks' allocator hooks call.

FrameworkMalloc serves CuPy's set_allocator hook today. It is Cython because it runs once per
framework allocation; it reaches the allocator through the C methods _core.pxd declares.
"""
cimport cython
from libc.stdint cimport uintptr_t, intptr_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from cython.operator cimport dereference as deref
from cpython.pycapsule cimport PyCapsule_CheckExact, PyCapsule_GetName, PyCapsule_GetPointer

from pyalloc._types cimport Block
from pyalloc._backend cimport BACKEND_OOM
from pyalloc._core cimport DeviceCachingAllocator, address_object
from pyalloc._buffer cimport Buffer
from pyalloc._validate cimport stream_handle, request_size, device_pointer
from pyalloc.errors import CudaError, OutOfMemoryError

# What cuStreamGetCaptureInfo answers for a stream handle that was destroyed.
GONE_STREAM_ERRORS = ("CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_INVALID_VALUE",
                      "CUDA_ERROR_CONTEXT_IS_DESTROYED")
from pyalloc._core import new_mempool_id

# What FrameworkMalloc does on an allocation in a graph capture that no route covers.
DETECT_MODES = ("off", "route", "error")        # by the values below
cdef enum:
    DETECT_OFF = 0
    DETECT_ROUTE = 1
    DETECT_ERROR = 2


ctypedef int (*device_id_fn)(int) except? -1          # CuPy's cpdef get_device_id (skip_dispatch arg)
ctypedef intptr_t (*stream_ptr_fn)(int) except? -1    # CuPy's cdef get_stream_ptr(device_id)

# The exact signatures Cython writes into a module's __pyx_capi__ capsule names for the two
# functions above; a capsule with another name (another CuPy) is not used.
DEVICE_ID_SIGNATURE = "int (int __pyx_skip_dispatch)"
STREAM_PTR_SIGNATURE = "intptr_t (int)"


cdef class FrameworkMalloc:
    """The allocation callback a framework's allocator hook calls: nbytes -> the framework's
    memory-pointer object, allocated by the default allocator of the framework's current device
    on its current stream.

    pyalloc.cupy builds one from CuPy's functions and classes (this module imports no framework).
    It is Cython because it runs once per framework allocation (every cupy.empty), where a Python
    closure cost more than CuPy's own pool does.

    Args: device_id() -> int; current_stream() -> object with .ptr; registry: a module whose
    `_allocators` dict maps device -> allocator; create(device) -> allocator (first use);
    wrap_memory(ptr, nbytes, owner, device) and wrap_pointer(memory, offset): the framework's
    classes (nbytes: the block's size, the request rounded up as the allocator rounds it); after_oom(allocator, nbytes, stream) -> Buffer, called once malloc ran out of memory;
    device: serve only this ordinal (None: all) and pass others to fallback(nbytes).
    c_entry_points: optionally (device id capsule, stream pointer capsule), the framework's own C
    functions behind device_id() and current_stream().ptr, taken from its modules' __pyx_capi__
    (names DEVICE_ID_SIGNATURE and STREAM_PTR_SIGNATURE). CuPy's own pool calls these directly,
    where the Python functions cost a call each and build a Stream object; capsules with other
    signatures are ignored and the Python functions used (`uses_c_entry_points` says which).
    """
    cdef object _device_id, _current_stream, _create
    cdef dict _registry_vars
    cdef object _wrap_memory, _wrap_pointer, _after_oom, _fallback
    cdef readonly object pyalloc_device
    cdef device_id_fn _c_device_id
    cdef stream_ptr_fn _c_stream_ptr
    cdef int _detect_capture             # DETECT_OFF, DETECT_ROUTE or DETECT_ERROR
    cdef list _detected                  # [allocator, stream, capture id, pool id] of routed captures
    cdef readonly list detected_pools    # pool ids of the captures routed on detection (kept)

    def __init__(self, device_id, current_stream, registry, create, wrap_memory, wrap_pointer,
                 after_oom, device=None, fallback=None, c_entry_points=None, detect_capture="off"):
        self._device_id = device_id
        self._current_stream = current_stream
        self._registry_vars = vars(registry)
        self._create = create
        self._wrap_memory = wrap_memory
        self._wrap_pointer = wrap_pointer
        self._after_oom = after_oom
        self.pyalloc_device = device
        self._fallback = fallback
        if detect_capture not in DETECT_MODES:
            raise ValueError(f"detect_capture must be one of {', '.join(map(repr, DETECT_MODES))}, "
                             f"got {detect_capture!r}")
        self._detect_capture = DETECT_MODES.index(detect_capture)
        self._detected = []
        self.detected_pools = []
        self._c_device_id = NULL
        self._c_stream_ptr = NULL
        if c_entry_points is not None:
            device_capsule, stream_capsule = c_entry_points
            if (capsule_named(device_capsule, DEVICE_ID_SIGNATURE)
                    and capsule_named(stream_capsule, STREAM_PTR_SIGNATURE)):
                self._c_device_id = <device_id_fn>PyCapsule_GetPointer(
                    device_capsule, PyCapsule_GetName(device_capsule))
                self._c_stream_ptr = <stream_ptr_fn>PyCapsule_GetPointer(
                    stream_capsule, PyCapsule_GetName(stream_capsule))

    cdef int _check_capture(self, DeviceCachingAllocator alloc, uintptr_t stream) except -1:
        """A capture pyalloc does not route (CuPy's Stream.begin_capture() called directly): route
        it into a new private pool that is kept for the life of the allocator (nothing tells when
        the graph dies, and its replays use that memory), or refuse. One driver query
        (cuStreamGetCaptureInfo) per allocation off the legacy stream; while routes made here
        exist, also one per such route to notice the end of its capture."""
        cdef unsigned long long capture_id = 0
        cdef vector[uintptr_t] terminals
        if self._detected:
            self._end_finished_captures()
        if stream == 0 or not alloc.backend.capture_info(stream, &capture_id, &terminals):
            return 0
        if alloc.routes_capture(capture_id):
            return 0
        if self._detect_capture == DETECT_ERROR:
            raise RuntimeError(
                f"stream {stream:#x} is capturing a CUDA graph that pyalloc does not know of (CuPy's "
                "Stream.begin_capture() called directly): memory allocated in it would be reused by "
                "arrays made after the capture and overwritten by the graph's replays. Capture with "
                "`with pyalloc.cupy.graph(stream) as g:` instead.")
        pool_id = new_mempool_id(False)
        alloc.begin_allocate_to_pool(pool_id, ("capture", capture_id))
        self._detected.append((alloc, stream, capture_id, pool_id))
        self.detected_pools.append((alloc.backend.device, pool_id))
        return 0

    cdef int _end_finished_captures(self) except -1:
        cdef unsigned long long capture_id = 0
        cdef vector[uintptr_t] terminals
        cdef DeviceCachingAllocator alloc
        still = []
        cdef int capturing
        for entry in self._detected:
            alloc = entry[0]
            terminals.clear()
            try:
                capturing = alloc.backend.capture_info(entry[1], &capture_id, &terminals)
            except CudaError as exc:
                # CuPy destroys a stream when its object dies (CuPy's own graph tests do so
                # right after a failed capture): a stream that is gone captures nothing.
                if exc.name not in GONE_STREAM_ERRORS:
                    raise
                capturing = 0
            if capturing and capture_id == entry[2]:
                still.append(entry)
            else:
                # Its capture is over: stop routing. The pool keeps its use (never released).
                alloc.end_allocate_to_pool(entry[3])
        self._detected = still
        return 0

    cdef inline int _keep_stream(self, DeviceCachingAllocator alloc, uintptr_t stream) except -1:
        """The framework destroys a stream when its object dies and the driver recycles the handle:
        the allocator keeps the current stream's object alive while it holds blocks of that stream
        (DeviceCachingAllocator.keep_allocation_stream). One lookup under the allocator's lock per
        allocation off the default stream; the stream object is fetched once per stream."""
        alloc.lock()
        cdef bint kept = alloc.d.allocation_streams_kept.count(stream) != 0
        alloc.unlock()
        if kept:
            return 0
        current = self._current_stream()
        if stream_handle(current.ptr) == stream:
            alloc.keep_allocation_stream(stream, current)
        return 0

    @property
    def uses_c_entry_points(self):
        """True when the device and stream are read through the framework's C functions."""
        return self._c_device_id != NULL

    def current_device_and_stream(self):
        """(device ordinal, stream handle) that an allocation made now would use."""
        if self._c_device_id != NULL:
            dev = self._c_device_id(0)
            return dev, <uintptr_t>self._c_stream_ptr(dev)
        return self._device_id(), stream_handle(self._current_stream().ptr)

    def __call__(self, nbytes):
        cdef size_t size = request_size(nbytes)
        cdef int dev_c = 0
        cdef uintptr_t stream
        if self._c_device_id != NULL:
            dev_c = self._c_device_id(0)
            dev = dev_c
        else:
            dev = self._device_id()
        if self.pyalloc_device is not None and dev != self.pyalloc_device:
            return self._fallback(nbytes)
        # The registry module's dict, not an attribute lookup: ~5x cheaper, and the module rebinds
        # _allocators (copy-on-write) but never its own __dict__.
        alloc = (<dict>self._registry_vars["_allocators"]).get(dev)
        if alloc is None:
            alloc = self._create(dev)
        if self._c_stream_ptr != NULL:
            stream = <uintptr_t>self._c_stream_ptr(dev_c)
        else:
            stream = stream_handle(self._current_stream().ptr)
        if self._detect_capture and (stream != 0 or self._detected):
            self._check_capture(<DeviceCachingAllocator?>alloc, stream)
        if stream != 0:
            self._keep_stream(<DeviceCachingAllocator?>alloc, stream)
        cdef Buffer buf = Buffer.__new__(Buffer)
        buf.allocator = <DeviceCachingAllocator?>alloc
        buf.size = size
        buf.stream = stream
        cdef Block* b
        if buf.allocator.try_allocate_block(size, stream, &b) == BACKEND_OOM:
            try:
                buf.allocator.raise_oom(size)       # observers see it, as for any other malloc
            except OutOfMemoryError:
                buf = self._after_oom(alloc, nbytes, stream)
                return self._wrap_pointer(
                    self._wrap_memory(buf.ptr, buf.allocator.round_size(nbytes), buf, dev), 0)
        if b == NULL:           # 0 bytes: CuPy never asks, but keep Buffer's meaning of ptr 0
            buf.ptr = 0
            return self._wrap_pointer(self._wrap_memory(0, nbytes, buf, dev), 0)
        buf.ptr = b.ptr
        # The memory object's size is the block's (a multiple of 512 bytes), as CuPy's own pool
        # and PyTorch report it; CuPy code relies on it (CuPy's own test_percentile_memory_access).
        return self._wrap_pointer(self._wrap_memory(address_object(b), b.size, buf, dev), 0)


cdef inline bint capsule_named(object capsule, str name):
    return PyCapsule_CheckExact(capsule) and PyCapsule_GetName(capsule) == name.encode()


# ------------------------------------------------------------------------------- cuda.core

cdef class CoreResourceState:
    """What pyalloc.cuda_core's MemoryResource keeps, read by core_allocate and core_deallocate
    (the resource's allocate and deallocate, here because they run once per cuda.core Buffer,
    where the Python methods cost more than cuda.core's own DeviceMemoryResource does).

    device_id: the ordinal; registry: the module whose `_allocators` dict maps device ->
    allocator (pyalloc.defaults); from_handle: cuda.core's Buffer.from_handle; takes_stream:
    whether from_handle records a deallocation stream. `allocation_streams` maps each live
    block's address to the handle of its allocation stream (a C++ map: a Python dict's three
    operations a Buffer cost more); `last_stream`/`last_handle` are the memo of the stream of
    the previous call (the resource's _handle_of sets them)."""
    cdef readonly int device_id
    cdef unordered_map[uintptr_t, uintptr_t] allocation_streams
    cdef public object last_stream
    cdef public uintptr_t last_handle
    cdef dict _registry_vars
    cdef public object from_handle
    cdef bint _takes_stream
    cdef bint _legacy_is_zero
    cdef object _proto_type          # the type of the last deallocation stream read, and its
    cdef object _proto_method        # __cuda_stream__ (called unbound: no bound method to make)

    def __init__(self, int device_id, registry, from_handle, bint takes_stream,
                 bint legacy_is_stream_zero):
        self.device_id = device_id
        self._legacy_is_zero = legacy_is_stream_zero
        self.last_stream = None
        self.last_handle = 0
        self._registry_vars = vars(registry)
        self.from_handle = from_handle
        self._takes_stream = takes_stream
        self._proto_type = None
        self._proto_method = None

    @property
    def streams(self):
        """{address: allocation stream handle} of the live blocks handed out (a copy)."""
        return {address: handle for address, handle in self.allocation_streams}

    cdef inline DeviceCachingAllocator allocator(self, mr):
        alloc = (<dict>self._registry_vars["_allocators"]).get(self.device_id)
        if alloc is None:
            alloc = mr._allocator()
        return <DeviceCachingAllocator?>alloc

    cdef uintptr_t freed_on(self, mr, stream, alloc) except? 0:
        """The handle of a deallocation stream. cuda.core 1.2 hands deallocate another Stream
        object than the one allocate was given (inferred on the H200: with one memo for both,
        a Buffer cost 2.465x DeviceMemoryResource against 1.781x without a memo), so the
        allocate memo is not replaced here: the handle is read from __cuda_stream__ directly, with the
        legacy stream folded as pyalloc._streams does; other objects go to the resource's
        _stream_handle. (0 is a valid answer: Cython checks for an error then.)"""
        cdef uintptr_t handle
        if stream is self.last_stream:
            return self.last_handle
        if type(stream) is int:
            return <uintptr_t>stream
        if type(stream) is self._proto_type:
            proto = self._proto_method(stream)
        else:
            proto_of = getattr(stream, "__cuda_stream__", None)
            if proto_of is None:
                return mr._stream_handle(stream, alloc)
            proto = proto_of()
            if not hasattr(stream, "__dict__"):     # no instance can override the type's method
                method = getattr(type(stream), "__cuda_stream__", None)
                if method is not None:
                    self._proto_type, self._proto_method = type(stream), method
        if type(proto) is not tuple or len(<tuple>proto) != 2 or type((<tuple>proto)[1]) is not int:
            return mr._stream_handle(stream, alloc)     # its TypeError names what came back
        handle = <uintptr_t>(<tuple>proto)[1]
        if handle == 1 and self._legacy_is_zero and alloc.backend.kind == "cuda":
            return 0
        return handle


@cython.binding(True)              # a method of the resource class (the module builds without binding)
def core_allocate(mr, size, stream=None):
    """A Buffer of `size` bytes for `stream` (see pyalloc.cuda_core)."""
    cdef CoreResourceState st = mr._state
    cdef uintptr_t handle
    cdef size_t nbytes = request_size(size)
    cdef DeviceCachingAllocator alloc = st.allocator(mr)
    cdef Block* b
    if stream is None:
        handle = 0
    elif stream is st.last_stream:
        handle = st.last_handle
    else:
        if type(stream).__name__ == "GraphBuilder":
            raise NotImplementedError(
                "pyalloc.cuda_core does not allocate for a GraphBuilder (memory handed out in a "
                "capture must stay reserved for the graph's replays): capture with pyalloc's "
                "graph pools (CachingAllocator.graph) or use cuda.core's GraphMemoryResource")
        handle = mr._handle_of(stream, alloc)
    # The allocator's C methods, not malloc/free: a Python method call each was a fifth of
    # what this resource added to cuda.core's own cost of a Buffer.
    if alloc.try_allocate_block(nbytes, handle, &b) == BACKEND_OOM:
        alloc.raise_oom(nbytes)
    if b == NULL:
        ptr = 0                  # 0 bytes: nothing to give back (deallocate ignores 0)
    else:
        ptr = address_object(b)
        st.allocation_streams[b.ptr] = handle
    try:
        if stream is not None and st._takes_stream:
            return st.from_handle(ptr, size, mr=mr, stream=stream)
        return st.from_handle(ptr, size, mr=mr)
    except BaseException:
        # No Buffer owns the block: give it back, so that a refused call changes nothing
        # (unless cuda.core already did, through deallocate, while failing).
        if st.allocation_streams.erase(<uintptr_t>ptr):
            alloc.free_pointer(<uintptr_t>ptr)
        raise


@cython.binding(True)
def core_deallocate(mr, ptr, size, stream=None):
    """Return a Buffer's block to pyalloc (see pyalloc.cuda_core)."""
    cdef CoreResourceState st = mr._state
    cdef uintptr_t freed_on
    if type(ptr) is not int:
        ptr = int(ptr)
    cdef uintptr_t p = device_pointer(ptr)
    if p == 0:
        return
    cdef unordered_map[uintptr_t, uintptr_t].iterator it = st.allocation_streams.find(p)
    if it == st.allocation_streams.end():
        raise ValueError(f"pointer {ptr:#x} ({size} bytes) is not a live allocation of "
                         f"{mr!r}: allocated elsewhere or already freed")
    cdef uintptr_t allocated_on = deref(it).second
    cdef DeviceCachingAllocator alloc = st.allocator(mr)
    if stream is not None:
        freed_on = st.freed_on(mr, stream, alloc)
        if freed_on != allocated_on:
            alloc.record_stream(ptr, freed_on)
    # By key, not by `it`: freed_on and record_stream run Python (a collection there may free
    # or make other Buffers, and an insertion that rehashes the map invalidates iterators).
    st.allocation_streams.erase(p)
    alloc.free_pointer(p)
