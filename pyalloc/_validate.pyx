# cython: language_level=3
"""Argument validation: the out-of-line halves of the checks in _validate.pxd.

Each raises TypeError or ValueError naming the value and what was expected (OutOfMemoryError for
a size of 1 EiB or more, as PyTorch), and touches no allocator state.
"""
from cpython.number cimport PyNumber_Index

from pyalloc._policy cimport kMaxRequest
from pyalloc.errors import OutOfMemoryError


# What a stream is, the one rule for every caller (the core's methods through stream_handle, the
# framework hooks through stream_handle_of):
#   - None: 0, the default stream;
#   - an object carrying a handle, looked for in this order: __cuda_stream__() returning
#     (version, handle) (cuda.core, Numba >= 0.21), .cuda_stream (PyTorch), .ptr (CuPy), .handle
#     (Numba: a cuda.bindings CUstream, or a ctypes pointer in Numba's old ctypes binding);
#   - a handle, given itself or carried: an int in [0, 2**64), or an object standing for one: an
#     integer through __index__ (numpy integers, cuda.bindings' enums and CUstream), a ctypes
#     c_void_p (its .value; None, the null pointer, is 0), or anything else with __int__
#     (cuda-python handles that predate __index__). Bools and floats are refused: True is no
#     stream, and int(1.5) would silently name another stream.
# A bad value raises TypeError (ValueError for an int out of range) naming it and where it came from.
cdef str STREAM_EXPECTED = ("expected a stream (None, an int handle in [0, 2**64), or an object with "
                            "__cuda_stream__, .cuda_stream, .ptr or .handle)")


cdef uintptr_t stream_handle_other(object stream) except? <uintptr_t>-1:
    if stream is None:
        return 0
    if hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__()
        if not (isinstance(proto, tuple) and len(proto) == 2):
            raise TypeError(f"{type(stream).__name__}.__cuda_stream__() returned {proto!r}, "
                            f"expected a (version, handle) tuple (stream {stream!r})")
        return handle_value(proto[1], stream, ".__cuda_stream__()[1]")
    for attribute in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attribute):
            return handle_value(getattr(stream, attribute), stream, "." + attribute)
    return handle_value(stream, None, None)


cdef uintptr_t handle_value(object value, object owner, str where) except? <uintptr_t>-1:
    """`value` as a stream handle (see the rule above); `owner` and `where` name what carried it
    (None: the stream argument itself), for the error messages."""
    cdef unsigned long long out
    handle = None
    if isinstance(value, (bool, float)):
        pass
    elif isinstance(value, int) or hasattr(value, "__index__"):
        try:
            handle = PyNumber_Index(value)      # an exact int, or TypeError (__index__ gave no int)
        except TypeError:
            pass
    elif isinstance(value, c_void_p()):
        handle = value.value or 0
    elif hasattr(value, "__int__"):
        handle = int(value)
    if type(handle) is not int:
        if owner is None:
            raise TypeError(f"{STREAM_EXPECTED}, got {type(value).__name__} {value!r}")
        raise TypeError(f"expected a stream handle (an int in [0, 2**64)) in "
                        f"{type(owner).__name__}{where} of {owner!r}, got {type(value).__name__} {value!r}")
    if exact_int_to_u64(handle, &out) != 0:
        source = "" if owner is None else f" (in {type(owner).__name__}{where} of {owner!r})"
        raise ValueError(f"stream handle must be an int in [0, 2**64), got {handle}{source}")
    return <uintptr_t>out


cdef object c_void_p():
    # ctypes is imported only once a ctypes handle could be about (not by `import pyalloc`).
    from ctypes import c_void_p
    return c_void_p


def stream_handle_of(stream):
    """The int handle of `stream` (None: 0, the default stream), by the rule above: for Python
    callers (the framework hooks), as the allocator's methods read their stream arguments."""
    return stream_handle(stream)


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
