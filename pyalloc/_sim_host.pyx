# cython: language_level=3
"""SimHost: the simulated device's host memory, for the caching host allocator (pyalloc/_host.pyx).

It models what the allocator sees of the CUDA driver's host-memory calls, deterministically:

* pinned allocations (cuMemHostAlloc / cuMemFreeHost) and pageable ones (malloc / free) in one
  host address range of 1 TiB per SimHost (from 0x500000000000, apart from every SimDevice's
  device and reservation ranges), first fit at 4 KiB alignment, against a capacity `total_memory`;
* registration of pageable memory (cuMemHostRegister / cuMemHostUnregister) with the driver's
  errors for a range registered twice or never (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, 712,
  and CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, 713);
* page touching with a number of threads (recorded in `touches`: the simulation has no pages);
* host<->device copies: copy(stream, host_ptr, nbytes) is work queued on a stream of the
  SimDevice that uses the host range, so an event recorded after it completes only when it has,
  and the SimDevice's reuse sanitizer (check_reuse=True) sees the use;
* cuMemFreeHost waits for the device (the driver synchronises before it unpins), so it completes
  all queued work, as SimDevice's segment_free does.

Every call is counted in `counters`; fail_next(call) makes one fail as a driver call would
(CudaError, state unchanged), as SimDevice.fail_next does for the device calls.
"""
from libc.stdint cimport uintptr_t
from libcpp.map cimport map as cppmap
from libcpp.unordered_set cimport unordered_set
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._backend cimport Backend
from pyalloc._host_backend cimport HostBackend
from pyalloc.errors import CudaError, ReuseError
from pyalloc._faults import InjectedFailures

cdef uintptr_t HOST_BASE = 0x500000000000
cdef uintptr_t HOST_RANGE = 1 << 40
cdef size_t HOST_ALIGN = 4096
cdef int HOST_SLOTS = 32
cdef int _next_slot = 0

# The operations fail_next can fail, with the call each stands for (the CudaError's call name).
_HOST_CALLS = {
    "host_alloc": "cuMemHostAlloc", "host_free": "cuMemFreeHost", "host_malloc": "malloc",
    "host_mfree": "free", "touch_pages": "touch_pages", "host_register": "cuMemHostRegister",
    "host_unregister": "cuMemHostUnregister",
}
_RESULT_NAMES = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
                 712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
                 713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", 999: "CUDA_ERROR_UNKNOWN"}


cdef class SimHost(HostBackend):
    """Host memory of a SimDevice (see the module doc). Sizes are bytes, addresses ints.

    Args:
        device: the SimDevice whose streams copies run on and whose events the allocator records.
        total_memory: host capacity in bytes for pinned and pageable memory together (default
            1 TiB, the size of the address range).

    Attributes: counters (calls per operation), touches (one (ptr, nbytes, threads) per
    touch_pages call, in order).
    """
    cdef cppmap[uintptr_t, size_t] live        # allocations: address -> bytes
    cdef unordered_set[uintptr_t] pinned       # the live allocations from host_alloc
    cdef cppmap[uintptr_t, size_t] registered  # registered ranges: address -> bytes
    cdef readonly uintptr_t base_address
    cdef readonly size_t total_memory
    cdef readonly size_t used_memory
    cdef public dict counters
    cdef public list touches
    cdef object _failures                      # InjectedFailures (pyalloc._faults)

    def __init__(self, Backend device not None, size_t total_memory=HOST_RANGE):
        global _next_slot
        if device.kind != "sim":
            raise ValueError(f"SimHost needs a SimDevice, got a {device.kind!r} backend ({device!r})")
        if total_memory == 0 or total_memory > HOST_RANGE:
            raise ValueError(f"total_memory must be in (0, 2**40] bytes, got {total_memory}")
        HostBackend.__init__(self, device)
        self.kind = "sim"
        self.base_address = HOST_BASE + (<uintptr_t>(_next_slot % HOST_SLOTS)) * HOST_RANGE
        _next_slot += 1
        self.total_memory = total_memory
        self.used_memory = 0
        self.counters = dict.fromkeys(_HOST_CALLS, 0)
        self.touches = []
        self._failures = InjectedFailures("SimHost", _HOST_CALLS, _RESULT_NAMES)

    def __repr__(self):
        return (f"SimHost(total_memory={self.total_memory}, used_memory={self.used_memory}, "
                f"allocations={self.live.size()}, registered={self.registered.size()})")

    # ------------------------------------------------------------------ injected failures

    def fail_next(self, call, int count=1, *, int skip=0, int result=999):
        """Make operation `call` ("host_alloc", ... or its call name, "cuMemHostAlloc", ...) fail:
        after `skip` calls that succeed, the next `count` raise CudaError(`result`, default 999)
        before doing anything. count 0 disarms."""
        self._failures.arm(call, count, skip, result)

    cdef int _enter(self, str op) except -1:
        self.counters[op] += 1
        error = self._failures.take(op) if self._failures.armed else None
        if error is not None:
            raise error
        return 0

    # ------------------------------------------------------------------ the address range

    cdef uintptr_t _first_fit(self, size_t nbytes):
        """The lowest 4 KiB-aligned address with nbytes free after it, or 0."""
        cdef uintptr_t addr = self.base_address
        cdef cppmap[uintptr_t, size_t].iterator it = self.live.begin()
        while it != self.live.end():
            if deref(it).first >= addr + nbytes:
                return addr
            addr = (deref(it).first + deref(it).second + HOST_ALIGN - 1) & ~(HOST_ALIGN - 1)
            inc(it)
        return addr if addr + nbytes <= self.base_address + HOST_RANGE else 0

    cdef int _take(self, size_t nbytes, uintptr_t* ptr, str call) except -1:
        cdef uintptr_t addr = 0
        if nbytes == 0:
            raise CudaError(call, 1, _RESULT_NAMES[1], "SimHost: 0 bytes")
        if nbytes <= self.total_memory - self.used_memory:
            addr = self._first_fit(nbytes)
        if addr == 0:
            if call == "malloc":
                raise MemoryError(f"SimHost: malloc({nbytes}) failed: {self.used_memory} of "
                                  f"{self.total_memory} bytes in use")
            raise CudaError(call, 2, _RESULT_NAMES[2],
                            f"SimHost: {nbytes} bytes requested, {self.used_memory} of "
                            f"{self.total_memory} in use")
        self.live[addr] = nbytes
        self.used_memory += nbytes
        ptr[0] = addr
        return 0

    cdef int _give_back(self, uintptr_t ptr, size_t nbytes, bint pinned, str call) except -1:
        cdef cppmap[uintptr_t, size_t].iterator it = self.live.find(ptr)
        if it == self.live.end() or (self.pinned.count(ptr) != 0) != pinned:
            raise CudaError(call, 1, _RESULT_NAMES[1],
                            f"SimHost: {ptr:#x} is not a live {'pinned' if pinned else 'pageable'} allocation")
        self.used_memory -= deref(it).second
        self.live.erase(it)
        self.pinned.erase(ptr)
        return 0

    # ------------------------------------------------------------------ HostBackend

    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        self._enter("host_alloc")
        self._take(nbytes, ptr, "cuMemHostAlloc")
        self.pinned.insert(ptr[0])
        return 0

    cdef int host_free(self, uintptr_t ptr, size_t nbytes) except -1:
        self._enter("host_free")
        self._give_back(ptr, nbytes, True, "cuMemFreeHost")
        self.device.device_synchronize()    # the driver waits for the device before it unpins
        return 0

    cdef int host_malloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        self._enter("host_malloc")
        return self._take(nbytes, ptr, "malloc")

    cdef int host_mfree(self, uintptr_t ptr, size_t nbytes) except -1:
        self._enter("host_mfree")
        return self._give_back(ptr, nbytes, False, "free")

    cdef int touch_pages(self, uintptr_t ptr, size_t nbytes, int threads) except -1:
        self._enter("touch_pages")
        self.touches.append((ptr, nbytes, threads))
        return 0

    cdef int host_register(self, uintptr_t ptr, size_t nbytes) except -1:
        self._enter("host_register")
        cdef cppmap[uintptr_t, size_t].iterator it = self.live.find(ptr)
        if it == self.live.end() or self.pinned.count(ptr) or deref(it).second < nbytes:
            raise CudaError("cuMemHostRegister", 1, _RESULT_NAMES[1],
                            f"SimHost: [{ptr:#x}, +{nbytes}) is not pageable memory of this host")
        if self.registered.count(ptr):
            raise CudaError("cuMemHostRegister", 712, _RESULT_NAMES[712],
                            f"SimHost: {ptr:#x} is registered already")
        self.registered[ptr] = nbytes
        return 0

    cdef int host_unregister(self, uintptr_t ptr, size_t nbytes) except -1:
        self._enter("host_unregister")
        if not self.registered.count(ptr):
            raise CudaError("cuMemHostUnregister", 713, _RESULT_NAMES[713],
                            f"SimHost: {ptr:#x} is not registered")
        self.registered.erase(ptr)
        return 0

    cdef int check_handout(self, uintptr_t ptr, size_t nbytes) except -1:
        if not self.device.checks_reuse:
            return 0
        for stream, position, spans, op in (<object>self.device).pending_uses():
            for start, end in spans:
                if start < ptr + nbytes and ptr < end:
                    raise ReuseError(
                        f"reuse sanitizer: host block [{ptr:#x}, {ptr + nbytes:#x}) handed out while "
                        f"{op} (a copy or kernel queued on stream {stream}) may still use "
                        f"[{start:#x}, {end:#x}): the host can write it at once",
                        ptr=ptr, nbytes=nbytes, stream=None, use_stream=stream, operation=op)
        return 0

    # ------------------------------------------------------------------ Python access

    def copy(self, stream, uintptr_t host_ptr, size_t nbytes, device_ptr=None, count=1):
        """Queue a copy of `nbytes` bytes between host memory at `host_ptr` and the device
        (`device_ptr`, optional) on `stream` of the SimDevice, as `count` units of work; returns
        the stream's queued total (SimDevice.launch's result)."""
        uses = [(host_ptr, nbytes)]
        if device_ptr is not None:
            uses.append((device_ptr, nbytes))
        return (<object>self.device).launch(stream, count, uses)

    def allocations(self):
        """Live allocations as a sorted list of (address, bytes, "pinned" or "pageable")."""
        return [(p.first, p.second, "pinned" if self.pinned.count(p.first) else "pageable")
                for p in self.live]

    def registrations(self):
        """Registered ranges as a sorted list of (address, bytes)."""
        return [(p.first, p.second) for p in self.registered]
