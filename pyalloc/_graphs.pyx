# cython: language_level=3
"""Reachability in a capturing graph, for reuse of blocks freed during CUDA-graph capture.

A block freed during a capture while other streams used it gets free markers: the terminal nodes
of each stream that used it, at the free. Work captured later on a stream S is ordered after the
block's last use when every marker is an ancestor of (or is) one of S's terminals; the block can
then be handed out again on S without any event (PyTorch #162186, "graph_capture_record_stream_reuse").

The ancestor set of a stream's terminals only grows during a capture, so it is cached per
(capture, stream) and extended by a reverse walk that stops at nodes already in it. The graph the
walks have seen is shared by the capture's streams (CaptureReuse): a node's parents are asked of
the backend once per capture, and a stream's walk over nodes another stream has already seen is
a loop over dense ids and bits, not backend calls and hash-set inserts.
"""
from libc.stdint cimport uintptr_t, uint32_t, uint64_t, int64_t
from libcpp.vector cimport vector

from pyalloc._backend cimport Backend
from pyalloc._types cimport CaptureReuse, StreamReuse


cdef int extend_ancestors(Backend backend, CaptureReuse* graph, StreamReuse* reuse,
                          vector[uintptr_t]& terminals, uint64_t* expanded,
                          vector[uintptr_t]* added) except -1:
    """Mark `terminals` and all their ancestors visited in `reuse`; *expanded counts the nodes
    whose parents were asked of the backend (the walk's cost in backend calls); `added` receives
    the newly visited nodes that some stream's blocks wait on as a marker (the only ones the caller
    looks up). All or nothing: when the backend fails, the walk's marks are taken back."""
    cdef vector[uint32_t] stack
    cdef vector[uint32_t] marked          # ids this walk marked, to take back on failure
    cdef vector[uintptr_t] parents
    cdef uintptr_t node
    cdef uint32_t id, parent, i, n
    try:
        for node in terminals:
            id = graph.intern(node)
            if reuse.visit(id):
                marked.push_back(id)
                stack.push_back(id)
        while not stack.empty():
            id = stack.back()
            stack.pop_back()
            if not graph.expanded(id):
                parents.clear()
                backend.node_dependencies(graph.handles[id], &parents)
                graph.set_parents(id, parents)
                expanded[0] += 1
            n = graph.parent_count[id]
            for i in range(n):
                parent = graph.parent(id, i)
                if reuse.visit(parent):
                    marked.push_back(parent)
                    stack.push_back(parent)
    except BaseException:
        for id in marked:
            reuse.unvisit(id)
        raise
    for id in marked:
        if graph.is_waited_on(id):
            added.push_back(graph.handles[id])
    return 0


cdef bint is_visited(CaptureReuse* graph, StreamReuse* reuse, uintptr_t node) noexcept:
    """Whether `node` is known to precede `reuse`'s stream's terminals."""
    cdef int64_t id = graph.find(node)
    return id >= 0 and reuse.visited(<uint32_t>id)


cdef bint all_visited(CaptureReuse* graph, StreamReuse* reuse, vector[uintptr_t]& nodes) noexcept:
    cdef uintptr_t node
    for node in nodes:
        if not is_visited(graph, reuse, node):
            return False
    return True


cdef int add_unique(vector[uintptr_t]* nodes, vector[uintptr_t]& more) except -1:
    """Append the nodes of `more` that `nodes` does not hold yet (marker lists are short)."""
    cdef uintptr_t node, have
    cdef bint seen
    for node in more:
        seen = False
        for have in nodes[0]:
            if have == node:
                seen = True
                break
        if not seen:
            nodes.push_back(node)
    return 0
