# Argument validation: sizes, device pointers and streams from Python. Each check is an inline
# fast path for exact ints in range (inlined into the caller's hot path) and an out-of-line rest in
# _validate.pyx (other types, errors), so the hot path carries none of the error code.
from libc.stdint cimport uintptr_t

from pyalloc._policy cimport kMaxRequest

cdef extern from "_pyint.h" namespace "pyalloc":
    int exact_int_to_u64(object o, unsigned long long* out)

cdef uintptr_t stream_handle_other(object stream) except? <uintptr_t>-1
cdef uintptr_t device_pointer_other(object ptr) except? 0
cdef size_t request_size_other(object nbytes) except? 0
cdef object as_index(object value, str expected)


cdef inline uintptr_t stream_handle(object stream) except? <uintptr_t>-1:
    """The integer handle of a stream: None (0, the default stream), an int in [0, 2**64), or an
    object with `__cuda_stream__` (cuda.core's protocol, returning (version, handle)),
    `.cuda_stream` (PyTorch), `.ptr` (CuPy) or `.handle` (Numba); the whole rule is in
    _validate.pyx, above stream_handle_other.
    (except? -1, not 0: the default stream's 0 is the common value, and would cost an error check.)
    """
    cdef unsigned long long value
    if type(stream) is int and exact_int_to_u64(stream, &value) == 0:
        return <uintptr_t>value
    return stream_handle_other(stream)


cdef inline uintptr_t device_pointer(object ptr) except? 0:
    """Validate a device pointer: an int in [0, 2**64)."""
    cdef unsigned long long value
    if type(ptr) is int and exact_int_to_u64(ptr, &value) == 0:
        return <uintptr_t>value
    return device_pointer_other(ptr)


cdef inline size_t request_size(object nbytes) except? 0:
    """Validate a requested size in bytes: an int in [0, 2**60)."""
    cdef unsigned long long value
    if type(nbytes) is int and exact_int_to_u64(nbytes, &value) == 0 and value < kMaxRequest:
        return <size_t>value
    return request_size_other(nbytes)
