# SimDevice's stream capture (_sim_capture.pyx): captures, their nodes, graphs, and the
# capture-mode rules for calls made while a capture is underway.
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.vector cimport vector

from pyalloc._sim_streams cimport Streams, EventState

cdef class Captures:
    cdef Streams streams                       # the same device's streams and events
    cdef readonly int live                     # captures begun and not ended
    cdef dict capture_of                       # stream -> _Capture, for streams of live captures
    cdef dict live_captures                    # capture id -> _Capture
    cdef dict event_capture                    # captured event -> (_Capture, terminals tuple)
    cdef dict nodes                            # node handle -> _Node (live captures and graphs)
    cdef dict graphs                           # graph handle -> _Graph
    cdef dict thread_modes                     # thread ident -> CAPTURE_* (absent: global)
    cdef uint64_t next_capture
    cdef uintptr_t next_node
    cdef uintptr_t next_graph

    cdef bint in_capture(self, uintptr_t stream) except -1
    # Backend's capture calls.
    cdef int begin(self, uintptr_t stream, int mode) except -1
    cdef int end(self, uintptr_t stream, uintptr_t* graph) except -1
    cdef int info(self, uintptr_t stream, unsigned long long* capture_id,
                  vector[uintptr_t]* terminals) except -1
    cdef int dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1
    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1
    cdef int graph_destroy(self, uintptr_t graph) except -1
    # Stream and event operations on a capturing stream or a capture event.
    cdef object launch(self, uintptr_t stream, uint64_t count, object uses)
    cdef int record(self, uintptr_t event, EventState* e, uintptr_t stream) except -1
    cdef int forget_event(self, uintptr_t event, EventState* e) except -1
    cdef int wait(self, uintptr_t stream, uintptr_t event, EventState* e, bint external) except -1
    # Calls CUDA refuses while a capture is underway (only called then, or for capture events).
    cdef int event_use(self, uintptr_t event, bint captured, str call, str verb) except -1
    cdef int stream_sync(self, uintptr_t stream) except -1
    cdef int device_sync(self) except -1
    cdef int unsafe_call(self, str call, str what) except -1
    # The reuse sanitizer's check of the kernel nodes of live captures.
    cdef int check_uses(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1
    # Nodes and graphs.
    cdef set ancestor_set(self, nodes)
    cdef object node(self, node)
    cdef object graph(self, uintptr_t graph)

    cdef int _finish(self, cap, bint keep_nodes) except -1
    cdef int _invalidate(self, cap, str reason) except -1
    cdef int _check_active(self, cap, str call, uintptr_t stream) except -1
    cdef int _check_joined(self, cap, uintptr_t stream) except -1
    cdef object _add_node(self, cap, uintptr_t stream, tuple uses, uint64_t count, str kind,
                          tuple events)
    cdef int _join(self, uintptr_t stream, uintptr_t event, cap) except -1
