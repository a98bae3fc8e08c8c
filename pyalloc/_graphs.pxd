# Cached reachability over a capturing graph (#162186): the test that decides whether a block freed
# during a capture may be reused there.
from libc.stdint cimport uintptr_t, uint64_t, int64_t, uint32_t
from libcpp.vector cimport vector

from pyalloc._backend cimport Backend
from pyalloc._types cimport CaptureReuse, StreamReuse

cdef int extend_ancestors(Backend backend, CaptureReuse* graph, StreamReuse* reuse,
                          vector[uintptr_t]& terminals, uint64_t* expanded,
                          vector[uintptr_t]* added) except -1
cdef bint is_visited(CaptureReuse* graph, StreamReuse* reuse, uintptr_t node) noexcept
cdef bint all_visited(CaptureReuse* graph, StreamReuse* reuse, vector[uintptr_t]& nodes) noexcept
cdef int add_unique(vector[uintptr_t]* nodes, vector[uintptr_t]& more) except -1
