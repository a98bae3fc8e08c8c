# The device allocator's declaration, for the modules that drive it from C: the replay loop
# (_replay.pyx) and the framework entry points (_hooks.pyx).
from libc.stdint cimport uintptr_t, uint32_t
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF

from pyalloc._types cimport Block
from pyalloc._device cimport DeviceState
from pyalloc._backend cimport Backend


cdef class DeviceCachingAllocator:
    # The state first: what a cache hit reads is at its start (see DeviceState in _device.h).
    cdef DeviceState d
    cdef readonly Backend backend                     # d.backend borrows this reference
    # Stream lifetime's Python half (the C half is in d): the stream objects record_stream was
    # given, kept alive while a use names them (handle -> object), and the allocation streams
    # given as objects (framework hooks, malloc(n, stream_obj)), kept alive while the allocator
    # holds blocks of theirs, so that their handle is not handed to a new stream while memory
    # cached for the old one may still be in use by its queued work (see keep_allocation_stream).
    cdef dict stream_pins
    cdef dict allocation_stream_objects
    cdef object pins_lock                             # orders changes of the two dicts above
    # memory history
    cdef public object context_recorder                # callable() -> context id, or None
    cdef public list oom_observers                     # callables(device, alloc_size, total, free)

    # For C callers (replay, framework hooks). *_locked: the caller holds the lock.
    cdef void lock(self) noexcept
    cdef void unlock(self) noexcept
    cdef int malloc_locked(self, size_t size, uintptr_t stream, uint32_t context_id,
                           Block** out) except -1
    cdef int free_locked(self, Block* b, uint32_t context_id) except -1
    cdef int empty_cache_locked(self) except -1
    cdef int try_allocate_block(self, size_t size, uintptr_t stream, Block** out) except -1
    cdef size_t policy_release_bytes(self, size_t size, uintptr_t stream) except? 0
    cdef int release_cached_segment(self, uintptr_t ptr, size_t size, uintptr_t stream) except -1
    cdef raise_oom(self, size_t requested)
    # For Buffer (_buffer.pyx): a block only its Buffer may free (it frees it with _hot.pxd's free).
    cdef Block* allocate_owned(self, size_t size, uintptr_t stream) except? NULL
    cdef int free_pointer(self, uintptr_t ptr) except -1
    cdef int keep_allocation_stream(self, uintptr_t stream, object stream_object) except -1
    cdef bint routes_capture(self, unsigned long long capture_id) noexcept


cdef inline object address_object(Block* b):
    """b's address as a Python int, for the caller that owns b (malloc's result).

    Blocks are handed out again and again at the same address: the int is kept on the block and
    returned again instead of allocating a new one each time. (The caller owns the block until
    free, so no other thread changes it meanwhile.)"""
    if b.py_address != NULL and b.py_address_value == b.ptr:
        return <object><PyObject*>b.py_address
    cdef object address = b.ptr          # a Python int (typed: Cython would infer a C int)
    Py_XDECREF(<PyObject*>b.py_address)
    Py_INCREF(address)
    b.py_address = <void*><PyObject*>address
    b.py_address_value = b.ptr
    return address


# The C entry points' fast half (pyalloc._capi's table points at these): a cache hit of device's
# default allocator, served under its C lock without the GIL from any thread; anything else is
# handed to the slow half that _capi registers with set_entry_slow_paths. entry_slot(device) is the
# allocator they serve (a borrowed pointer, NULL before _capi publishes one with set_entry_slot).
cdef extern from *:
    """
    #define PYALLOC_ENTRY_DEVICES 256
    """
    int PYALLOC_ENTRY_DEVICES           # device ordinals the entry points serve: [0, 256)

ctypedef int (*entry_malloc_fn)(int, size_t, uintptr_t, uintptr_t*) noexcept nogil
ctypedef int (*entry_free_fn)(int, uintptr_t) noexcept nogil
ctypedef int (*entry_record_stream_fn)(int, uintptr_t, uintptr_t) noexcept nogil

cdef int entry_malloc(int device, size_t size, uintptr_t stream, uintptr_t* out) noexcept nogil
cdef int entry_free(int device, uintptr_t ptr) noexcept nogil
cdef int entry_record_stream(int device, uintptr_t ptr, uintptr_t stream) noexcept nogil
cdef void set_entry_slow_paths(entry_malloc_fn malloc_slow, entry_free_fn free_slow,
                               entry_record_stream_fn record_stream_slow) noexcept
cdef PyObject* entry_slot(int device) noexcept nogil
cdef void set_entry_slot(int device, PyObject* allocator) noexcept nogil
