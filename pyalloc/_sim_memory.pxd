# SimDevice's address space (_sim_memory.pyx): device memory segments and where they are placed,
# virtual memory reservations and their mapped pages, and the address slot of a live device.
from libc.stdint cimport uintptr_t
from libcpp.map cimport map as cppmap
from libcpp.unordered_map cimport unordered_map

cdef extern from "_placement.h" namespace "pyalloc":
    cdef cppclass GapIndex:
        void insert(uintptr_t start, size_t gap)
        void erase(uintptr_t start)
        void set_gap(uintptr_t start, size_t gap)
        bint lowest_fit_above(uintptr_t after, size_t n, uintptr_t* start, size_t* gap)
        bint highest_fit_below(uintptr_t before, size_t n, uintptr_t* start, size_t* gap)

cdef class AddressSpace:
    cdef readonly size_t total_memory          # capacity, bytes
    cdef readonly size_t used_memory           # bytes in segments and mapped pages
    cdef readonly uintptr_t base_address       # lowest segment address placement hands out
    cdef readonly uintptr_t reservation_base   # lowest reservation address (first fit)
    cdef readonly size_t alignment             # segment address alignment, bytes
    cdef readonly bint top_down
    cdef int slot                              # address slot (see take_slot), or -1
    cdef cppmap[uintptr_t, size_t] segs        # live segments: address -> bytes
    cdef GapIndex gaps                         # the same segments, by the room below each
    cdef bint overlapping                      # some live segments overlap (see first_fit)
    cdef dict placements                       # bytes -> deque of queued addresses
    cdef Py_ssize_t pending_placements
    cdef cppmap[uintptr_t, size_t] reservations     # reserved address ranges: base -> bytes
    cdef unordered_map[uintptr_t, uintptr_t] mapped_pages   # granule address -> its physical page
    cdef unordered_map[uintptr_t, uintptr_t] pages  # physical page (handle) -> where mapped, 0: nowhere
    cdef uintptr_t next_page                        # the next handle create_pages hands out
    cdef dict reservation_placements                # bytes -> list of queued base addresses

    cdef int alloc(self, size_t nbytes, uintptr_t* ptr) except -1     # BACKEND_OOM when full
    cdef int free(self, uintptr_t ptr, size_t nbytes) except -1
    cdef int reserve(self, size_t nbytes, uintptr_t* base) except -1
    cdef int release(self, uintptr_t base, size_t nbytes) except -1
    cdef int map(self, uintptr_t addr, size_t nbytes) except -1       # BACKEND_OOM when full
    cdef int unmap(self, uintptr_t addr, size_t nbytes) except -1
    cdef int unmap_keep(self, uintptr_t addr, size_t count, uintptr_t* handles) except -1
    cdef int map_pages(self, uintptr_t addr, size_t count, const uintptr_t* handles) except -1
    cdef int free_pages(self, size_t count, const uintptr_t* handles) except -1
    cdef bint handout_mapped(self, uintptr_t addr, size_t nbytes)

    cdef bint _overlaps(self, uintptr_t addr, size_t nbytes)
    cdef size_t _gap_below(self, cppmap[uintptr_t, size_t].iterator it)
    cdef uintptr_t _align_up(self, uintptr_t addr)
    cdef bint _indexed(self, size_t nbytes)
    cdef int _add_segment(self, uintptr_t addr, size_t nbytes) except -1
    cdef int _remove_segment(self, cppmap[uintptr_t, size_t].iterator it) except -1
    cdef uintptr_t _first_fit(self, size_t nbytes)
    cdef uintptr_t _first_fit_walk(self, size_t nbytes)
    cdef uintptr_t _top_fit(self, size_t nbytes)
    cdef uintptr_t _top_fit_walk(self, size_t nbytes)
    cdef int _check_kept(self, size_t count, const uintptr_t* handles, bint to_map) except -1
    cdef int _check_unmapped(self, uintptr_t addr, size_t count) except -1
    cdef int _check_mapped(self, uintptr_t addr, size_t count) except -1
    cdef int _check_range(self, uintptr_t addr, size_t nbytes, str what) except -1
