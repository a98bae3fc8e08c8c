# Buffer (_buffer.pyx): device memory owned by a Python object.
from libc.stdint cimport uintptr_t

from pyalloc._core cimport DeviceCachingAllocator


cdef class Buffer:
    cdef readonly uintptr_t ptr
    cdef readonly size_t size
    cdef readonly uintptr_t stream
    cdef readonly DeviceCachingAllocator allocator
