# cython: language_level=3
"""Buffer: device memory owned by a Python object (a DeviceCachingAllocator block that only its
Buffer may free)."""
from libc.stdint cimport uintptr_t
cimport cython

from libc.stdint cimport uint32_t

from pyalloc._types cimport Block
from pyalloc._validate cimport stream_handle, request_size
from pyalloc._device cimport lock_device, pyalloc_is_finalizing
from pyalloc._hot cimport lookup_allocated, allocator_free
from pyalloc._core cimport DeviceCachingAllocator


# Whether the cyclic collector is running (set by a gc.callbacks entry; collections at
# interpreter exit run no callbacks, and pyalloc_is_finalizing() covers those).
cdef bint gc_collecting = False


def _note_gc_phase(phase, info):
    global gc_collecting
    gc_collecting = phase == "start"


import gc as _gc
_gc.callbacks.append(_note_gc_phase)


cdef int free_buffer_block(DeviceCachingAllocator a, uintptr_t p, uint32_t context_id) except -1:
    """The Buffer that owns the block at `p` frees it. A failed free leaves the Buffer its owner."""
    cdef Block* b
    lock_device(&a.d)
    try:
        b = lookup_allocated(&a.d, p)
        b.buffer_owned = False
        try:
            allocator_free(&a.d, b, context_id)
        except BaseException:
            b.buffer_owned = True
            raise
    finally:
        a.d.mutex.unlock()
    return 0


# no_gc_clear: when a Buffer is freed as part of a garbage cycle, the collector must not clear
# its allocator reference first, or __dealloc__ could not return the memory (it would leak).
@cython.no_gc_clear
@cython.auto_pickle(False)  # a pickled or copied Buffer would be a second owner of its block
@cython.freelist(64)        # one per CuPy allocation: reuse the object memory
cdef class Buffer:
    """Buffer(allocator, nbytes, stream=0)
--

    Device memory owned by a Python object: freed by close(), `with` exit or garbage collection.

    Attributes: ptr (device address), size (bytes requested), stream (handle), device (ordinal).

    A Buffer is the one owner of its block: it cannot be copied or pickled (TypeError), and
    __init__ runs once (RuntimeError on a second call, which leaves the Buffer as it was).
    """
    # (attributes declared in _buffer.pxd)

    def __init__(self, DeviceCachingAllocator allocator not None, nbytes, stream=0):
        if self.allocator is not None:
            # Refused rather than freeing the first block: whoever holds its pointer (a CuPy
            # array, a kernel argument) would then use freed memory without being told.
            raise RuntimeError(
                f"Buffer.__init__ runs once: this Buffer already owns {self.size} bytes at "
                f"{self.ptr:#x}; make a new Buffer instead")
        cdef size_t size = request_size(nbytes)
        cdef uintptr_t handle = stream_handle(stream)
        if size != 0 and type(stream) is not int and handle != 0 and stream is not None:
            allocator.keep_allocation_stream(handle, stream)     # before: as malloc does
        cdef Block* b = allocator.allocate_owned(size, handle)
        self.allocator = allocator
        self.size = size
        self.stream = handle
        self.ptr = b.ptr if b != NULL else 0

    @property
    def device(self):
        """The ordinal of the device the memory is on."""
        if self.allocator is None:
            raise RuntimeError("this Buffer was never initialised (made by Buffer.__new__ without "
                               "__init__): it owns no memory and has no device")
        return self.allocator.backend.device

    @property
    def closed(self):
        return self.ptr == 0 and self.size != 0

    def close(self):
        """Free the memory now. Closing twice is harmless."""
        cdef uintptr_t p = self.ptr
        if p:
            self.ptr = 0
            try:
                free_buffer_block(self.allocator, p,
                                  self.allocator.context_recorder() if self.allocator.d.capture_free_stacks else 0)
            except BaseException:
                self.ptr = p               # not freed: the Buffer still owns the block
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __int__(self):
        return self.ptr

    def __reduce__(self):
        raise TypeError("a Buffer owns its device memory: it cannot be pickled or copied (the copy "
                        "would free the same block a second time)")

    def __copy__(self):
        self.__reduce__()

    def __deepcopy__(self, memo):
        self.__reduce__()

    def __repr__(self):
        if self.allocator is None:
            return "Buffer(uninitialised)"
        return (f"Buffer(ptr={self.ptr:#x}, size={self.size}, stream={self.stream}, "
                f"device={self.device})")

    def __dealloc__(self):
        # The free-call stack is not recorded while the cyclic collector runs or the interpreter
        # finalizes: the recorder is Python code that may itself be garbage the collector has
        # already cleared (calling a cleared function crashes CPython), and the stack would only
        # show where the collection happened to start. A recorder that fails otherwise costs the
        # stack, not the free.
        cdef uint32_t context_id = 0
        if self.ptr and self.allocator is not None:
            if self.allocator.d.capture_free_stacks and not gc_collecting and not pyalloc_is_finalizing():
                try:
                    context_id = self.allocator.context_recorder()
                except Exception:
                    context_id = 0
            free_buffer_block(self.allocator, self.ptr, context_id)
