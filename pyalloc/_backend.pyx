# cython: language_level=3
"""Base class of the device backends; see _backend.pxd for the contract."""


cdef class Backend:
    """Backend(device=0)
--

    Abstract device backend. Subclasses implement the methods declared in _backend.pxd.

    The base class itself is the backend of an allocator whose __init__ has not run (a subclass
    that skips super().__init__(), or cls.__new__(cls)): its calls raise RuntimeError, so the core
    never calls a backend method through None (a crash: Cython does not check for None there)."""

    def __init__(self, int device=0):
        self.device = device
        self.kind = "abstract"

    cdef int unsupported(self, str what) except -1:
        """The error of a method this backend does not implement."""
        if type(self) is Backend:
            raise RuntimeError(
                f"uninitialised backend: this allocator was never initialized, so it {what} "
                "(DeviceCachingAllocator.__init__ did not run: a subclass's __init__ must call "
                "super().__init__(), and an allocator made with __new__ alone has no device)")
        raise NotImplementedError(f"{type(self).__name__} {what}")

    cdef int segment_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        return self.unsupported("cannot allocate segments")

    cdef int segment_free(self, uintptr_t ptr, size_t nbytes) except -1:
        return self.unsupported("cannot free segments")

    cdef int memory_info(self, size_t* free_bytes, size_t* total_bytes) except -1:
        return self.unsupported("cannot report memory")

    cdef int event_create(self, uintptr_t* event) except -1:
        return self.unsupported("has no events")

    cdef int event_record(self, uintptr_t event, uintptr_t stream) except -1:
        return self.unsupported("has no events")

    cdef int event_query(self, uintptr_t event) except -1:
        return self.unsupported("has no events")

    cdef int event_synchronize(self, uintptr_t event) except -1:
        return self.unsupported("has no events")

    cdef int event_destroy(self, uintptr_t event) except -1:
        return self.unsupported("has no events")

    cdef int stream_device(self, uintptr_t stream) except -2:
        # A backend that knows of no other device: every stream is its own.
        return self.device

    cdef int event_create_on(self, int device, uintptr_t* event) except -1:
        if device == self.device:
            return self.event_create(event)
        return self.unsupported(f"cannot make events for device {device}")

    cdef int stream_synchronize(self, uintptr_t stream) except -1:
        return self.unsupported("has no streams")

    cdef int device_synchronize(self) except -1:
        return self.unsupported("cannot synchronize")

    cdef int vm_granularity(self, size_t* nbytes) except -1:
        return self.unsupported("has no virtual memory operations")

    cdef int vm_reserve(self, size_t nbytes, uintptr_t* base) except -1:
        return self.unsupported("has no virtual memory operations")

    cdef int vm_release(self, uintptr_t base, size_t nbytes) except -1:
        return self.unsupported("has no virtual memory operations")

    cdef int vm_map(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        return self.unsupported("has no virtual memory operations")

    cdef int vm_unmap(self, uintptr_t addr, size_t nbytes, size_t page) except -1:
        return self.unsupported("has no virtual memory operations")

    cdef int vm_unmap_keep(self, uintptr_t addr, size_t page, size_t count, uintptr_t* handles) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot keep physical pages apart from addresses")

    cdef int vm_map_handles(self, uintptr_t addr, size_t page, size_t count,
                            const uintptr_t* handles) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot keep physical pages apart from addresses")

    cdef int vm_free_handles(self, size_t page, size_t count, const uintptr_t* handles) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot keep physical pages apart from addresses")

    cdef int capture_begin(self, uintptr_t stream, int mode) except -1:
        return self.unsupported("cannot capture streams")

    cdef int capture_end(self, uintptr_t stream, uintptr_t* graph) except -1:
        return self.unsupported("cannot capture streams")

    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1:
        return self.unsupported("has no graphs")

    cdef int graph_destroy(self, uintptr_t graph) except -1:
        return self.unsupported("has no graphs")

    cdef int capture_info(self, uintptr_t stream, unsigned long long* capture_id,
                          vector[uintptr_t]* terminals) except -1:
        # A backend without capture support never reports a capturing stream.
        return 0

    cdef int node_dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        return self.unsupported("has no graph nodes")

    # Python access to the capture operations, for the allocator's graph API and for tests.

    def begin_capture(self, stream, mode="global"):
        """Start capturing `stream` (an int handle) into a graph; mode "global" (default),
        "thread_local" or "relaxed", as cudaStreamBeginCapture's."""
        if mode not in CAPTURE_MODES:
            raise ValueError(f"capture mode must be one of {', '.join(CAPTURE_MODES)}, got {mode!r}")
        self.capture_begin(stream, CAPTURE_MODES.index(mode))

    def end_capture(self, stream):
        """End the capture on `stream`; returns the graph's handle (an int)."""
        cdef uintptr_t graph = 0
        self.capture_end(stream, &graph)
        return graph

    def launch_graph(self, graph, stream=0):
        """Replay a captured graph as work on `stream`."""
        self.graph_launch(graph, stream)

    def destroy_graph(self, graph):
        """Release a graph handle from end_capture."""
        self.graph_destroy(graph)

    def stream_capture_info(self, stream):
        """(capture id, [terminal nodes]) while `stream` is capturing, else None."""
        cdef unsigned long long capture_id = 0
        cdef vector[uintptr_t] terminals
        if not self.capture_info(stream, &capture_id, &terminals):
            return None
        return capture_id, list(terminals)

    def node_parents(self, node):
        """The nodes a captured node depends on."""
        cdef vector[uintptr_t] parents
        self.node_dependencies(node, &parents)
        return list(parents)

    cdef int stream_alive(self, uintptr_t stream) except -1:
        return 1

    def is_stream_alive(self, stream):
        """stream_alive from Python: False when the backend knows `stream` (an int handle) was
        destroyed."""
        return self.stream_alive(stream) == 1

    cdef int check_handout(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1:
        return 0


CAPTURE_MODES = ("global", "thread_local", "relaxed")     # by CAPTURE_* value
