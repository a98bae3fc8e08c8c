# Cached reachability over a capturing graph (#162186): the test that decides whether a block freed
# during a capture may be reused there.
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.vector cimport vector
from libcpp.unordered_set cimport unordered_set

from pyalloc._backend cimport Backend

cdef int extend_ancestors(Backend backend, unordered_set[uintptr_t]* visited,
                          vector[uintptr_t]& terminals, uint64_t* expanded,
                          vector[uintptr_t]* added) except -1
cdef bint all_visited(unordered_set[uintptr_t]* visited, vector[uintptr_t]& nodes) noexcept
cdef int add_unique(vector[uintptr_t]* nodes, vector[uintptr_t]& more) except -1
