# cython: language_level=3
"""SimDevice's address space: what a simulated device's memory and addresses are.

It owns the capacity and the bytes in use (segments and mapped pages together), the live segments
and their placement (queued addresses from place_segments, else deterministic first fit from
base_address up or, top_down, the highest fit below base_address + 1 TiB, found through a gap
index), the virtual memory reservations for expandable segments with their mapped 2 MiB pages,
the physical pages behind them (created by a map, kept apart from addresses by unmap_keep and
mapped again by map_pages: used_memory counts them wherever they are), and the address slot
that keeps live devices' addresses apart. Sizes and addresses are bytes.

SimDevice (_sim.pyx) counts, injects failures and checks capture before it calls in here; the
errors raised here are the ones SimDevice has always raised, word for word.
"""
from libc.stdint cimport uintptr_t
from libcpp.map cimport map as cppmap
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec
cimport cython

from pyalloc._backend cimport BACKEND_OK, BACKEND_OOM
import collections

cdef size_t MiB = 1 << 20
cdef size_t TOP_DOWN_RANGE = <size_t>1 << 40    # top_down places segments below base_address + this
cdef size_t GRANULE = 2 * MiB      # mapping granularity of the simulated virtual memory


# ---------------------------------------------------------------- address ranges of live devices

# As CUDA's unified addressing gives every device of a process its own addresses, each live
# SimDevice made without base_address takes a slot k: segments from DEFAULT_BASE + k TiB, and
# reservations from DEFAULT_RESERVATION_BASE + k TiB (from HIGH_RESERVATION_BASE for the slots
# whose range would reach DEFAULT_BASE). So the first live device keeps the addresses it always
# had, and no two live devices share one while each keeps its segments and its reservations
# within 1 TiB. The lowest free slot is taken at construction and given back when the device's
# AddressSpace is deallocated, with the device (a device that a stored traceback keeps alive, as
# hypothesis does for failing examples, keeps its slot). A device made with base_address takes no
# slot: its segments are where it was told, its reservations slot 0's, as before.
DEFAULT_BASE = 0x7f0000000000
DEFAULT_RESERVATION_BASE = 0x200000000000
HIGH_RESERVATION_BASE = 1 << 61
ADDRESS_SLOT = 1 << 40
LOW_SLOTS = (DEFAULT_BASE - DEFAULT_RESERVATION_BASE) // ADDRESS_SLOT
MAX_SLOTS = 1 << 20          # slot segments stay below HIGH_RESERVATION_BASE
_taken_slots = set()


def _take_slot():
    cdef Py_ssize_t k = 0
    while k in _taken_slots:
        k += 1
    if k >= MAX_SLOTS:
        raise RuntimeError(f"SimDevice: all {MAX_SLOTS} address ranges of simulated devices are "
                           "taken by live SimDevices; pass base_address to place this one's segments")
    _taken_slots.add(k)
    return k


def _slot_reservation_base(k):
    if k < LOW_SLOTS:
        return DEFAULT_RESERVATION_BASE + k * ADDRESS_SLOT
    return HIGH_RESERVATION_BASE + (k - LOW_SLOTS) * ADDRESS_SLOT


# no_gc_clear: SimDevice's tables must outlive a collection that takes its allocator (see the note
# above SimDevice); this object is one of them.
@cython.no_gc_clear
@cython.final
cdef class AddressSpace:
    """The segments, reservations and mapped pages of one SimDevice (arguments as SimDevice's,
    already checked there). `previous`: the AddressSpace this one replaces (SimDevice.__init__
    run again), whose address slot it takes over rather than taking a new one."""

    def __cinit__(self, *args, **kwargs):
        self.slot = -1

    def __dealloc__(self):
        if self.slot >= 0:
            try:
                _taken_slots.discard(self.slot)
            except Exception:       # (module globals gone at interpreter exit)
                pass

    def __init__(self, size_t total_memory, base_address, size_t alignment, bint top_down,
                 AddressSpace previous=None):
        self.total_memory = total_memory
        self.used_memory = 0
        if base_address is None:
            if previous is not None and previous.slot >= 0:
                self.slot = previous.slot
                previous.slot = -1
            else:
                self.slot = _take_slot()
            self.base_address = DEFAULT_BASE + self.slot * ADDRESS_SLOT
            self.reservation_base = _slot_reservation_base(self.slot)
        else:
            self.base_address = base_address
            self.reservation_base = DEFAULT_RESERVATION_BASE
        self.alignment = alignment
        self.top_down = top_down
        self.placements = {}
        self.reservation_placements = {}
        self.pending_placements = 0

    # ---------------------------------------------------------------- segments

    def place_segments(self, placements):
        """SimDevice.place_segments: queue (address, size_bytes) pairs for future segments."""
        items = [(int(a), int(s)) for a, s in placements]
        for addr, size in items:
            if addr <= 0 or size <= 0:
                raise ValueError(f"placement ({addr:#x}, {size}) needs a positive address and size")
        for addr, size in items:
            self.placements.setdefault(size, collections.deque()).append(addr)
        self.pending_placements += len(items)

    def segments(self):
        """Live segments as a sorted list of (address, size_bytes)."""
        return [(p.first, p.second) for p in self.segs]

    cdef int alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        """Place and add a segment of nbytes: *ptr its address, or BACKEND_OOM (nothing done)."""
        if nbytes > self.total_memory - self.used_memory:
            return BACKEND_OOM
        cdef uintptr_t addr
        queue = self.placements.get(nbytes)
        if queue:
            addr = queue.popleft()
            self.pending_placements -= 1
            if self._overlaps(addr, nbytes):
                raise RuntimeError(
                    f"SimDevice: placed segment {addr:#x} (+{nbytes} bytes) overlaps a live segment; "
                    "the placement queue does not match this allocation sequence")
        elif self.top_down:
            addr = self._top_fit(nbytes)
        else:
            addr = self._first_fit(nbytes)
        self._add_segment(addr, nbytes)
        self.used_memory += nbytes
        ptr[0] = addr
        return BACKEND_OK

    cdef int free(self, uintptr_t ptr, size_t nbytes) except -1:
        """Remove the live segment of nbytes at ptr (the caller completes the queued work)."""
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.find(ptr)
        if it == self.segs.end() or deref(it).second != nbytes:
            raise RuntimeError(f"SimDevice: free of {ptr:#x} ({nbytes} bytes), which is not a live segment")
        self._remove_segment(it)
        self.used_memory -= nbytes
        return BACKEND_OK

    # ---------------------------------------------------------------- placement

    cdef bint _overlaps(self, uintptr_t addr, size_t nbytes):
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.upper_bound(addr)
        if it != self.segs.end() and deref(it).first < addr + nbytes:
            return True
        if it != self.segs.begin():
            dec(it)
            if deref(it).first + deref(it).second > addr:
                return True
        return False

    # Placement. The addresses are those of a walk over the live segments (_first_fit_walk,
    # _top_fit_walk, which define them), found in O(log n) through gaps: the gap below a segment
    # is the room between its predecessor's end, aligned up, and its start, and a request of n
    # bytes fits below a segment exactly when that gap is at least n. That reading holds while
    # the live segments are disjoint; a queued placement below base_address can make first fit
    # overlap it, and until the device is empty again placement walks, as it always did.

    cdef size_t _gap_below(self, cppmap[uintptr_t, size_t].iterator it):
        """The gap below the segment at `it` (SIZE_MAX for the lowest segment)."""
        if it == self.segs.begin():
            return <size_t>-1
        cdef cppmap[uintptr_t, size_t].iterator prev = it
        dec(prev)
        cdef uintptr_t floor = self._align_up(deref(prev).first + deref(prev).second)
        return deref(it).first - floor if deref(it).first > floor else 0

    cdef uintptr_t _align_up(self, uintptr_t addr):
        return (addr + self.alignment - 1) & ~(self.alignment - 1)

    cdef bint _indexed(self, size_t nbytes):
        """Whether _gaps answers a placement of nbytes: disjoint segments, and addresses small
        enough that no sum in the walk wraps around 2**64."""
        if self.overlapping or nbytes == 0 or nbytes > (<size_t>1 << 62):
            return False
        if self.alignment > (<size_t>1 << 61) or self.base_address > (<uintptr_t>1 << 62):
            return False
        if self.segs.empty():
            return True
        cdef cppmap[uintptr_t, size_t].iterator last = self.segs.end()
        dec(last)
        return deref(last).first + deref(last).second <= (<uintptr_t>1 << 62)

    cdef int _add_segment(self, uintptr_t addr, size_t nbytes) except -1:
        self.segs[addr] = nbytes
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.find(addr)
        cdef cppmap[uintptr_t, size_t].iterator prev = it, nxt = it
        inc(nxt)
        if it != self.segs.begin():
            dec(prev)
            if deref(prev).first + deref(prev).second > addr:
                self.overlapping = True
        if nxt != self.segs.end() and addr + nbytes > deref(nxt).first:
            self.overlapping = True
        self.gaps.insert(addr, self._gap_below(it))
        if nxt != self.segs.end():
            self.gaps.set_gap(deref(nxt).first, self._gap_below(nxt))
        return 0

    cdef int _remove_segment(self, cppmap[uintptr_t, size_t].iterator it) except -1:
        cdef cppmap[uintptr_t, size_t].iterator nxt = it
        inc(nxt)
        self.gaps.erase(deref(it).first)
        self.segs.erase(it)
        if nxt != self.segs.end():
            self.gaps.set_gap(deref(nxt).first, self._gap_below(nxt))
        if self.segs.empty():
            self.overlapping = False
        return 0

    cdef uintptr_t _first_fit(self, size_t nbytes):
        # The lowest free aligned address from base_address up (segments below it are ignored).
        if not self._indexed(nbytes):
            return self._first_fit_walk(nbytes)
        cdef uintptr_t base = self.base_address
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.lower_bound(base)
        if it == self.segs.end() or deref(it).first >= base + nbytes:
            return base
        cdef uintptr_t start
        cdef size_t gap
        if self.gaps.lowest_fit_above(deref(it).first, nbytes, &start, &gap):
            return start - gap
        it = self.segs.end()
        dec(it)
        return self._align_up(deref(it).first + deref(it).second)

    cdef uintptr_t _first_fit_walk(self, size_t nbytes):
        cdef uintptr_t cursor = self.base_address
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.lower_bound(cursor)
        while it != self.segs.end():
            if deref(it).first >= cursor + nbytes:
                break
            if deref(it).first + deref(it).second > cursor:
                cursor = deref(it).first + deref(it).second
                cursor = (cursor + self.alignment - 1) & ~(self.alignment - 1)
            inc(it)
        return cursor

    cdef uintptr_t _top_fit(self, size_t nbytes):
        # Highest aligned address below base + 1 TiB where nbytes fit; first fit if none does.
        if nbytes > TOP_DOWN_RANGE:
            return self._first_fit(nbytes)
        if not self._indexed(nbytes):
            return self._top_fit_walk(nbytes)
        cdef uintptr_t top = self.base_address + TOP_DOWN_RANGE
        cdef uintptr_t addr = (top - nbytes) & ~(self.alignment - 1)
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.lower_bound(top)
        cdef uintptr_t start
        cdef size_t gap
        if it != self.segs.begin():
            dec(it)
            if deref(it).first + deref(it).second > addr:
                # The room under `top` is taken: the highest gap below a segment that fits.
                if not self.gaps.highest_fit_below(top, nbytes, &start, &gap):
                    return self._first_fit(nbytes)
                if start < self.base_address + nbytes:
                    return self._first_fit(nbytes)
                addr = (start - nbytes) & ~(self.alignment - 1)
        if addr < self.base_address:
            return self._first_fit(nbytes)
        return addr

    cdef uintptr_t _top_fit_walk(self, size_t nbytes):
        cdef uintptr_t top = self.base_address + TOP_DOWN_RANGE
        cdef uintptr_t addr = (top - nbytes) & ~(self.alignment - 1)
        cdef cppmap[uintptr_t, size_t].iterator it = self.segs.lower_bound(top)
        cdef uintptr_t start, end
        while it != self.segs.begin():
            dec(it)
            start = deref(it).first
            end = start + deref(it).second
            if end <= addr:
                break
            if start < addr + nbytes:          # overlaps: go below this segment
                if start < self.base_address + nbytes:
                    return self._first_fit_walk(nbytes)
                addr = (start - nbytes) & ~(self.alignment - 1)
        if addr < self.base_address:
            return self._first_fit_walk(nbytes)
        return addr

    # ---------------------------------------------------------------- virtual memory

    def place_reservations(self, placements):
        """SimDevice.place_reservations: queue (address, size_bytes) pairs for reservations."""
        items = [(int(a), int(s)) for a, s in placements]
        for addr, size in items:
            if addr <= 0 or size <= 0 or addr % GRANULE:
                raise ValueError(f"reservation ({addr:#x}, {size}) needs a positive, 2 MiB aligned address and size")
        for addr, size in items:
            self.reservation_placements.setdefault(size, []).append(addr)

    @property
    def mapped_memory(self):
        """Bytes of physical memory mapped into reservations."""
        return self.mapped_pages.size() * GRANULE

    @property
    def unmapped_pages(self):
        """Physical pages (2 MiB each) that exist but are mapped nowhere."""
        return self.pages.size() - self.mapped_pages.size()

    def is_mapped(self, uintptr_t addr, size_t nbytes):
        """True when every 2 MiB page touching [addr, addr + nbytes) is mapped."""
        cdef uintptr_t page = addr & ~(GRANULE - 1)
        while page < addr + nbytes:
            if not self.mapped_pages.count(page):
                return False
            page += GRANULE
        return True

    cdef bint handout_mapped(self, uintptr_t addr, size_t nbytes):
        """False when [addr, addr + nbytes) lies in a reservation and a page of it is unmapped
        (memory of segments is always there)."""
        cdef cppmap[uintptr_t, size_t].iterator it = self.reservations.upper_bound(addr)
        if it == self.reservations.begin():
            return True
        dec(it)
        if addr >= deref(it).first + deref(it).second:
            return True
        return self.is_mapped(addr, nbytes)

    def reservation_list(self):
        """Live reservations as a sorted list of (base address, size_bytes)."""
        return [(p.first, p.second) for p in self.reservations]

    cdef int reserve(self, size_t nbytes, uintptr_t* base) except -1:
        """Reserve nbytes (whole 2 MiB pages) of address space: *base its first address."""
        if nbytes == 0 or nbytes % GRANULE:
            raise ValueError(f"SimDevice: reservation of {nbytes} bytes is not a multiple of 2 MiB")
        cdef uintptr_t addr
        cdef cppmap[uintptr_t, size_t].iterator it
        queue = self.reservation_placements.get(nbytes)
        if queue:
            addr = queue.pop(0)
        else:
            # First fit above reservation_base, past every live reservation.
            addr = self.reservation_base
            it = self.reservations.begin()
            while it != self.reservations.end():
                if deref(it).first < addr + nbytes and deref(it).first + deref(it).second > addr:
                    addr = deref(it).first + deref(it).second
                inc(it)
        self.reservations[addr] = nbytes
        base[0] = addr
        return BACKEND_OK

    cdef int release(self, uintptr_t base, size_t nbytes) except -1:
        """Give back the reservation of nbytes at base; none of its pages may be mapped."""
        cdef cppmap[uintptr_t, size_t].iterator it = self.reservations.find(base)
        if it == self.reservations.end() or deref(it).second != nbytes:
            raise RuntimeError(f"SimDevice: release of {base:#x} ({nbytes} bytes), which is not a reservation")
        cdef uintptr_t page = base
        while page < base + nbytes:
            if self.mapped_pages.count(page):
                raise RuntimeError(f"SimDevice: release of reservation {base:#x} with page {page:#x} still mapped")
            page += GRANULE
        self.reservations.erase(it)
        return BACKEND_OK

    cdef int _check_range(self, uintptr_t addr, size_t nbytes, str what) except -1:
        if nbytes == 0 or addr % GRANULE or nbytes % GRANULE:
            raise ValueError(f"SimDevice: {what} of {nbytes} bytes at {addr:#x} is not whole 2 MiB pages")
        cdef cppmap[uintptr_t, size_t].iterator it = self.reservations.upper_bound(addr)
        if it == self.reservations.begin():
            raise RuntimeError(f"SimDevice: {what} at {addr:#x} outside every reservation")
        dec(it)
        if addr + nbytes > deref(it).first + deref(it).second:
            raise RuntimeError(f"SimDevice: {what} at {addr:#x} (+{nbytes}) runs past its reservation")
        return 0

    cdef int map(self, uintptr_t addr, size_t nbytes) except -1:
        """Create physical pages for the unmapped pages of [addr, addr + nbytes) and map them, or
        BACKEND_OOM (nothing created) when the device has not the memory."""
        self._check_range(addr, nbytes, "map")
        if nbytes > self.total_memory - self.used_memory:
            return BACKEND_OOM
        self._check_unmapped(addr, nbytes // GRANULE)
        cdef uintptr_t page = addr
        while page < addr + nbytes:
            self.next_page += 1
            self.pages[self.next_page] = page
            self.mapped_pages[page] = self.next_page
            page += GRANULE
        self.used_memory += nbytes
        return BACKEND_OK

    cdef int unmap(self, uintptr_t addr, size_t nbytes) except -1:
        """Unmap the mapped pages of [addr, addr + nbytes) and give their memory back."""
        self._check_range(addr, nbytes, "unmap")
        self._check_mapped(addr, nbytes // GRANULE)
        cdef uintptr_t page = addr
        while page < addr + nbytes:
            self.pages.erase(self.mapped_pages[page])
            self.mapped_pages.erase(page)
            page += GRANULE
        self.used_memory -= nbytes
        return BACKEND_OK

    cdef int unmap_keep(self, uintptr_t addr, size_t count, uintptr_t* handles) except -1:
        """Unmap `count` mapped pages from addr, keeping their memory: handles[i] the page that
        was at addr + i * 2 MiB."""
        self._check_range(addr, count * GRANULE, "unmap")
        self._check_mapped(addr, count)
        cdef size_t i
        cdef uintptr_t page
        for i in range(count):
            page = addr + i * GRANULE
            handles[i] = self.mapped_pages[page]
            self.pages[handles[i]] = 0
            self.mapped_pages.erase(page)
        return BACKEND_OK

    cdef int map_pages(self, uintptr_t addr, size_t count, const uintptr_t* handles) except -1:
        """Map existing physical pages mapped nowhere at addr, addr + 2 MiB, ..."""
        self._check_range(addr, count * GRANULE, "map")
        self._check_unmapped(addr, count)
        self._check_kept(count, handles, True)
        cdef size_t i, j
        for i in range(count):
            for j in range(i):
                if handles[j] == handles[i]:
                    raise RuntimeError(f"SimDevice: physical page {handles[i]} mapped twice in one call")
        for i in range(count):
            self.pages[handles[i]] = addr + i * GRANULE
            self.mapped_pages[addr + i * GRANULE] = handles[i]
        return BACKEND_OK

    cdef int free_pages(self, size_t count, const uintptr_t* handles) except -1:
        """Give back physical pages mapped nowhere."""
        self._check_kept(count, handles, False)
        cdef size_t i
        for i in range(count):
            self.pages.erase(handles[i])
        self.used_memory -= count * GRANULE
        return BACKEND_OK

    cdef int _check_kept(self, size_t count, const uintptr_t* handles, bint to_map) except -1:
        """Raise unless every page of handles exists and is mapped nowhere (to_map: for a map,
        else for a release)."""
        cdef size_t i
        what = "map" if to_map else "release"
        for i in range(count):
            if not self.pages.count(handles[i]):
                raise RuntimeError(f"SimDevice: {what} of physical page {handles[i]}, which does not exist")
            if self.pages[handles[i]] != 0:
                raise RuntimeError(f"SimDevice: {what} of physical page {handles[i]}, still mapped at "
                                   f"{self.pages[handles[i]]:#x}" + (": mapped twice" if to_map else ""))
        return 0

    cdef int _check_unmapped(self, uintptr_t addr, size_t count) except -1:
        cdef size_t i
        for i in range(count):
            if self.mapped_pages.count(addr + i * GRANULE):
                raise RuntimeError(f"SimDevice: page {addr + i * GRANULE:#x} mapped twice")
        return 0

    cdef int _check_mapped(self, uintptr_t addr, size_t count) except -1:
        cdef size_t i
        for i in range(count):
            if not self.mapped_pages.count(addr + i * GRANULE):
                raise RuntimeError(f"SimDevice: unmap of page {addr + i * GRANULE:#x}, which is not mapped")
        return 0
