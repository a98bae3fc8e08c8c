# cython: language_level=3
"""Argument validation: the out-of-line halves of the checks in _validate.pxd.

Each raises TypeError or ValueError naming the value and what was expected (OutOfMemoryError for
a size of 1 EiB or more, as PyTorch), and touches no allocator state.
"""
from cpython.number cimport PyNumber_Index

from pyalloc._policy cimport kMaxRequest
from pyalloc.errors import OutOfMemoryError


cdef uintptr_t stream_handle_other(object stream) except? <uintptr_t>-1:
    if type(stream) is int:
        raise ValueError(f"stream handle must be an int in [0, 2**64), got {stream}")
    if stream is None:
        return 0
    handle = None
    if hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__()
        if isinstance(proto, tuple) and len(proto) == 2:
            handle = proto[1]
    elif hasattr(stream, "cuda_stream"):
        handle = stream.cuda_stream
    elif hasattr(stream, "ptr") and not isinstance(stream, (bool, float)):
        handle = stream.ptr
    elif isinstance(stream, int) and not isinstance(stream, bool):
        handle = int(stream)
    if type(handle) is not int or handle < 0:
        raise TypeError(
            f"expected a stream (an int handle >= 0, or an object with __cuda_stream__, .cuda_stream "
            f"or .ptr), got {stream!r}")
    return stream_handle(handle)


cdef object as_index(object value, str expected):
    """value as an exact int (through __index__, as operator.index; bools refused), or
    TypeError: "{expected}, got ...".

    The result is checked as operator.index checks it: callers read the int's digits directly
    (exact_int_to_u64), so an __index__ that returned a str or a float must not get through."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    try:
        return PyNumber_Index(value)        # an exact int; TypeError for a non-int result
    except TypeError as err:
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}: {err}") from None


cdef uintptr_t device_pointer_other(object ptr) except? 0:
    cdef unsigned long long value
    ptr = as_index(ptr, "ptr must be an int device pointer")
    if exact_int_to_u64(ptr, &value) != 0:
        raise ValueError(f"pointer {ptr} is not a device address (expected an int in [0, 2**64))")
    return <uintptr_t>value


cdef size_t request_size_other(object nbytes) except? 0:
    cdef unsigned long long value
    nbytes = as_index(nbytes, "size must be an int number of bytes")
    if exact_int_to_u64(nbytes, &value) == 0 and value < kMaxRequest:
        return <size_t>value
    if nbytes < 0:
        raise ValueError(f"size must be >= 0 bytes, got {nbytes}")
    raise OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate more than 1EB memory (requested {nbytes} bytes).",
        requested=int(nbytes))
