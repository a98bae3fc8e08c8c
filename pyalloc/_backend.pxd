# The device interface the core calls. A backend owns where memory, events and streams come from;
# the core (_core.pyx) makes every decision and calls only these methods.
#
# Contract, for every implementation (SimDevice in _sim.pyx, CudaDevice in _cuda.pyx):
#  * Methods return 0 on success and raise a Python exception on a failure they cannot express
#    (except -1). Out of memory is not an exception: segment_alloc, vm_reserve (address space
#    exhausted) and vm_map return BACKEND_OOM,
#    so that the core can run its release-and-retry ladder before it reports OOM itself.
#  * Addresses, streams, events and graph nodes are opaque integers (uintptr_t handles). Stream 0
#    is the legacy default stream.
#  * The core calls a backend with its own lock held. A backend may release the GIL around a
#    blocking driver call; it must not call back into the allocator.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector

cdef enum:
    BACKEND_OK = 0
    BACKEND_OOM = 1

cdef class Backend:
    cdef readonly int device          # device ordinal this backend serves
    cdef readonly str kind            # "sim" or "cuda"
    # A reuse sanitizer (SimDevice(check_reuse=True)): when set at the allocator's construction, the
    # core calls check_handout for every block it hands out, and C callers take the ordinary path.
    cdef readonly bint checks_reuse
    cdef int unsupported(self, str what) except -1     # NotImplementedError (RuntimeError: the base)

    # Device memory segments (cudaMalloc / cudaFree).
    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1
    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1
    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1

    # Events (created without timing, reused by the core's event pool).
    cdef int event_create(self, uintptr_t* event) except -1
    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1
    cdef int event_query(self, uintptr_t event) except -1       # 1: completed, 0: pending
    cdef int event_synchronize(self, uintptr_t event) except -1
    cdef int event_destroy(self, uintptr_t event) except -1
    # Streams of other devices: the ordinal of the device `stream` belongs to (this backend's own for
    # the legacy and per-thread handles), and an event made in device `device`'s context, for
    # recording on its streams (cuEventRecord needs an event and a stream of one context).
    cdef int stream_device(self, uintptr_t stream) except -2
    cdef int event_create_on(self, int device, uintptr_t* event) except -1
    cdef int stream_synchronize(self, uintptr_t stream) except -1
    cdef int device_synchronize(self) except -1

    # Virtual memory, for expandable segments: reserve address space, map/unmap physical pages.
    # vm_map/vm_unmap cover whole pages of `page` bytes (a multiple of vm_granularity): each page
    # is one physical allocation, so that any page can later be unmapped on its own.
    cdef int vm_granularity(self, size_t* nbytes) except -1
    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1  # BACKEND_OOM: no address space
    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1
    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page) except -1     # BACKEND_OOM when no memory
    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page) except -1
    # Physical pages apart from address space (recycle_pages). A handle names one physical page of
    # `page` bytes (cuMemCreate's). vm_unmap_keep unmaps `count` pages from `addr` and keeps their
    # memory: handles[i] receives the page that was at addr + i * page. vm_map_handles maps such
    # pages at addr, addr + page, ... (never a page already mapped); vm_free_handles gives pages
    # mapped nowhere back to the device. Each call does all or, raising, nothing.
    cdef int vm_unmap_keep(self, uintptr_t addr, size_t page, size_t count, uintptr_t* handles) except -1
    cdef int vm_map_handles(self, uintptr_t addr, size_t page, size_t count,
                            const uintptr_t* handles) except -1
    cdef int vm_free_handles(self, size_t page, size_t count, const uintptr_t* handles) except -1

    # Stream capture, for CUDA graphs (cuStreamBeginCapture .. cuStreamEndCapture).
    # mode: CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL or CAPTURE_RELAXED (CUstreamCaptureMode's values).
    # While a stream captures, work queued on it (and on streams that join the capture by waiting
    # on an event recorded in it) becomes nodes of a graph instead of running; querying or
    # synchronizing an event or stream of the capture is an error, as in CUDA. Allocating or
    # freeing device memory (segment_alloc, vm_map, ...) stays legal: a CUDA backend switches the
    # calling thread to relaxed capture mode around those calls.
    cdef int capture_begin(self, uintptr_t stream, int mode) except -1
    # Ends the capture begun on `stream`; *graph receives a graph handle, which the caller owns
    # (graph_destroy). Raises (and ends the capture) when it is invalid, e.g. a stream that joined
    # the capture has work that was not joined back into `stream`.
    cdef int capture_end(self, uintptr_t stream, uintptr_t* graph) except -1
    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1   # replay as work on stream
    cdef int graph_destroy(self, uintptr_t graph) except -1
    # Returns 1 and fills the capture id and the stream's terminal nodes (the nodes new work on the
    # stream will depend on: cuStreamGetCaptureInfo's dependencies) when the stream is capturing
    # (status active), else 0 (not capturing, or the capture was invalidated).
    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1
    # The nodes a node of a capturing graph depends on (cuGraphNodeGetDependencies).
    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1

    # Streams: 1 when `stream` may be used (record_stream refuses a stream the backend knows is
    # destroyed), 0 when it is known to be destroyed. A backend that cannot tell answers 1.
    cdef int stream_alive(self, uintptr_t stream) except -1
    # The sanitizer's check (only called when checks_reuse): raise when the `nbytes` bytes at `ptr`,
    # handed out for work on `stream`, may still be used by queued or captured work that is not
    # ordered before that stream's next work.
    cdef int check_handout(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1


cdef enum:
    CAPTURE_GLOBAL = 0
    CAPTURE_THREAD_LOCAL = 1
    CAPTURE_RELAXED = 2
