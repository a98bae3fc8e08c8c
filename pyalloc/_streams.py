"""Stream handles of framework stream objects, as the int keys pyalloc's allocators use.

The core accepts ints and objects with `__cuda_stream__`, `.cuda_stream` or `.ptr`; the hooks for
Numba and cuda.core meet stream objects whose protocol answers are not plain ints (Numba's default
stream answers with a cuda.bindings enum) or that carry only a `.handle` (a CUstream, or a ctypes
pointer in old Numba). stream_handle() turns each into its int handle.

One more thing: the driver API's stream 0 is the legacy default stream unless cuda-python runs in
per-thread default stream mode (CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM set to a non-zero
value, read once at import here, as cuda.bindings reads it once), and cuda.core's default stream is
CU_STREAM_LEGACY (handle 1). Both name the same stream, so fold_legacy() turns handle 1 into 0 on
the GPU: otherwise memory freed by one framework on the legacy stream would sit in a cache that
another framework, allocating for "stream 0", never looks at. (On the simulated device 1 is an
ordinary stream.)
"""
import os

CU_STREAM_LEGACY = 1


def _per_thread_default():
    value = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "").strip()
    try:
        return int(value) != 0
    except ValueError:
        return value != ""


LEGACY_IS_STREAM_ZERO = not _per_thread_default()


def stream_handle(stream):
    """The int handle of `stream` (None: 0, the default stream).

    Accepts an int, an object with `__cuda_stream__` (cuda.core, Numba >= 0.21), `.cuda_stream`
    (PyTorch), `.ptr` (CuPy) or `.handle` (a Numba stream: a CUstream, or a ctypes pointer in
    Numba's old ctypes binding). TypeError for anything else; the handle's range is checked by the
    allocator that receives it.
    """
    if stream is None:
        return 0
    if type(stream) is int:
        handle = stream
    elif isinstance(stream, bool):
        raise TypeError(f"expected a stream, got {stream!r}")
    elif hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__()
        if not (isinstance(proto, tuple) and len(proto) == 2):
            raise TypeError(f"{type(stream).__name__}.__cuda_stream__() returned {proto!r}, "
                            "expected a (version, handle) tuple")
        handle = int(proto[1])
    elif hasattr(stream, "cuda_stream"):
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "ptr"):
        handle = int(stream.ptr)
    elif hasattr(stream, "handle"):
        raw = stream.handle
        if isinstance(raw, int):
            handle = int(raw)
        elif hasattr(raw, "value"):
            handle = raw.value or 0   # a ctypes pointer (None for the null stream)
        else:
            handle = int(raw)         # a CUstream: int() gives its address
    elif isinstance(stream, int):
        handle = int(stream)
    else:
        raise TypeError(
            f"expected a stream (an int handle, or an object with __cuda_stream__, .cuda_stream, "
            f".ptr or .handle), got {type(stream).__name__} {stream!r}")
    return handle


def fold_legacy(handle, backend):
    """0 for CU_STREAM_LEGACY on a CUDA backend when stream 0 is the legacy stream (see the module
    docstring); any other handle, or any handle of the simulated device, unchanged."""
    if handle == CU_STREAM_LEGACY and LEGACY_IS_STREAM_ZERO and backend.kind == "cuda":
        return 0
    return handle
