# cython: language_level=3
"""Reachability in a capturing graph, for reuse of blocks freed during CUDA-graph capture.

A block freed during a capture while other streams used it gets free markers: the terminal nodes
of each stream that used it, at the free. Work captured later on a stream S is ordered after the
block's last use when every marker is an ancestor of (or is) one of S's terminals; the block can
then be handed out again on S without any event (PyTorch #162186, "graph_capture_record_stream_reuse").

The ancestor set of a stream's terminals only grows during a capture, so it is cached per
(capture, stream) and extended by a reverse walk that stops at nodes already in it: each node is
expanded (its parents asked of the backend) at most once per stream and capture.
"""
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.vector cimport vector
from libcpp.unordered_set cimport unordered_set

from pyalloc._backend cimport Backend


cdef int extend_ancestors(Backend backend, unordered_set[uintptr_t]* visited,
                          vector[uintptr_t]& terminals, uint64_t* expanded,
                          vector[uintptr_t]* added) except -1:
    """Add `terminals` and all their ancestors to `visited`; *expanded counts the nodes whose
    parents were asked for (the walk's cost); `added` (or NULL) receives the nodes new to it."""
    cdef vector[uintptr_t] stack
    cdef vector[uintptr_t] parents
    cdef uintptr_t node
    for node in terminals:
        if visited.insert(node).second:
            stack.push_back(node)
    while not stack.empty():
        node = stack.back()
        stack.pop_back()
        if added != NULL:
            added.push_back(node)
        parents.clear()
        backend.node_dependencies(node, &parents)
        expanded[0] += 1
        for node in parents:
            if visited.insert(node).second:
                stack.push_back(node)
    return 0


cdef bint all_visited(unordered_set[uintptr_t]* visited, vector[uintptr_t]& nodes) noexcept:
    cdef uintptr_t node
    for node in nodes:
        if visited.count(node) == 0:
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
