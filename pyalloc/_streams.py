"""Stream handles of framework stream objects, as the int keys pyalloc's allocators use.

stream_handle() is the allocator's own rule (pyalloc/_validate.pyx), for the hooks for Numba and
cuda.core, which work out handles before they call the allocator: None, an int in [0, 2**64), or
an object with `__cuda_stream__`, `.cuda_stream`, `.ptr` or `.handle`, whose handle may also be an
object standing for an int (a cuda.bindings enum or CUstream, a ctypes pointer).

One more thing: the driver API's stream 0 is the legacy default stream unless cuda-python runs in
per-thread default stream mode (CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM set to a non-zero
value, read once at import here, as cuda.bindings reads it once), and cuda.core's default stream is
CU_STREAM_LEGACY (handle 1). Both name the same stream, so fold_legacy() turns handle 1 into 0 on
the GPU: otherwise memory freed by one framework on the legacy stream would sit in a cache that
another framework, allocating for "stream 0", never looks at. (On the simulated device 1 is an
ordinary stream.)
"""
import os

from pyalloc._validate import stream_handle_of as stream_handle

CU_STREAM_LEGACY = 1


def _per_thread_default():
    value = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "").strip()
    try:
        return int(value) != 0
    except ValueError:
        return value != ""


LEGACY_IS_STREAM_ZERO = not _per_thread_default()


def fold_legacy(handle, backend):
    """0 for CU_STREAM_LEGACY on a CUDA backend when stream 0 is the legacy stream (see the module
    docstring); any other handle, or any handle of the simulated device, unchanged."""
    if handle == CU_STREAM_LEGACY and LEGACY_IS_STREAM_ZERO and backend.kind == "cuda":
        return 0
    return handle
