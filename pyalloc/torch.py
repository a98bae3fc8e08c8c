"""PyTorch on pyalloc: torch's CUDA tensors allocated by pyalloc's default allocators.

    import pyalloc.torch
    pyalloc.torch.install()          # before the first CUDA allocation (e.g. first in the program)

or, scoped, without replacing PyTorch's allocator:

    pool = torch.cuda.MemPool(pyalloc.torch.allocator().allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(...)         # PyTorch's caching allocator, its segments from pyalloc

Both go through torch.cuda.memory.CUDAPluggableAllocator and the library libpyalloc_torch.so
that is installed with pyalloc (its alloc/free symbols call pyalloc's C entry points, pyalloc._capi,
which serve a cache hit without the GIL from any thread). The memory comes from the same default
allocator per device (pyalloc.get_allocator(device)) that pyalloc.cupy uses, so one cache serves
every framework in the process.

What PyTorch's pluggable path does not carry: torch.cuda.memory_stats / memory_allocated /
memory_snapshot fail or say nothing about this memory; read pyalloc's own (pyalloc.memory_stats(),
pyalloc.memory_summary(), history and snapshots of pyalloc.get_allocator(device)). record_stream
and empty_cache are connected through the pluggable allocator's hooks where torch has them;
pyalloc.torch.record_stream(tensor, stream) works in either case. An out-of-memory error is
raised as pyalloc.torch.OutOfMemoryError, a subclass of both torch.OutOfMemoryError and
pyalloc.OutOfMemoryError (a MemoryError).

This module imports torch only when one of its functions needs it.
"""
import ctypes
import os
import threading

from pyalloc import defaults
from pyalloc.errors import NotAllocatedError, OutOfMemoryError, framework_out_of_memory_error

LIBRARY_NAME = "libpyalloc_torch.so"
ALLOC_SYMBOL = "pyalloc_torch_malloc"
FREE_SYMBOL = "pyalloc_torch_free"

_lock = threading.Lock()
_library = None             # the ctypes.CDLL, bound to pyalloc's C table
_pluggable = None           # the one CUDAPluggableAllocator (torch keeps its function pointers)
_installed = False
_oom_class = None


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError("pyalloc.torch needs PyTorch (pip install torch)") from exc
    return torch


def library_path():
    """Path of libpyalloc_torch.so: next to pyalloc's extension modules (the package directory
    when installed, the build directory in an editable install)."""
    from pyalloc import _capi
    return os.path.join(os.path.dirname(os.path.abspath(_capi.__file__)), LIBRARY_NAME)


def library():
    """The allocator library (ctypes.CDLL), loaded and bound to pyalloc's C table on first use.

    Binding also makes out-of-memory errors raised to C callers torch's kind (see
    out_of_memory_error) once torch can be imported. Needs no GPU.
    """
    global _library
    with _lock:
        if _library is None:
            from pyalloc import _capi
            path = library_path()
            if not os.path.exists(path):
                raise RuntimeError(f"pyalloc.torch: {path} is missing; reinstall pyalloc")
            lib = ctypes.CDLL(path)
            lib.pyalloc_torch_bind.argtypes = (ctypes.c_void_p,)
            lib.pyalloc_torch_bind.restype = ctypes.c_int
            if lib.pyalloc_torch_bind(_capi.table_address()) != 0:
                raise RuntimeError(f"pyalloc.torch: {path} does not match this pyalloc's C table "
                                   f"(version {_capi.VERSION}); reinstall pyalloc")
            _library = lib
        return _library


def symbol_address(name):
    """Address (int) of one of the library's exported functions."""
    return ctypes.cast(getattr(library(), name), ctypes.c_void_p).value


def out_of_memory_error():
    """The class raised on out of memory in a torch allocation: a subclass of both
    torch.OutOfMemoryError and pyalloc.OutOfMemoryError (created on first use; imports torch)."""
    global _oom_class
    if _oom_class is None:
        _oom_class = framework_out_of_memory_error(
            _import_torch().OutOfMemoryError, __name__, "TorchOutOfMemoryError",
            "Out of memory in a PyTorch allocation served by pyalloc (figures in bytes, as in "
            "pyalloc.OutOfMemoryError).", out_of_memory_error)
    return _oom_class


def _as_torch_error(exc):
    # pyalloc._capi keeps this instead of a plain pyalloc.OutOfMemoryError for C callers.
    if isinstance(exc, OutOfMemoryError) and not isinstance(exc, out_of_memory_error()):
        return out_of_memory_error().from_error(exc)
    return exc


def allocator():
    """The torch.cuda.memory.CUDAPluggableAllocator over pyalloc (one per process), for install()
    or scoped use: torch.cuda.MemPool(pyalloc.torch.allocator().allocator()) (PyTorch's caching
    allocator then takes that pool's segments from pyalloc).

    Imports torch; creating it initialises no CUDA state.
    """
    global _pluggable
    torch = _import_torch()
    lib = library()
    with _lock:
        if _pluggable is None:
            from pyalloc import _capi
            _check_default_backend()
            _capi.set_exception_translator(_as_torch_error)
            lib.pyalloc_torch_carry_python_errors.argtypes = (ctypes.c_int,)
            lib.pyalloc_torch_carry_python_errors(int(python_error_layout_known(torch.__version__)))
            pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), ALLOC_SYMBOL, FREE_SYMBOL)
            hooks = pluggable.allocator()
            # tensor.record_stream and torch.cuda.empty_cache reach pyalloc where torch exposes
            # the setters (without them torch silently drops both: peers.md 3.2).
            if hasattr(hooks, "set_record_stream_fn"):
                hooks.set_record_stream_fn(_address(lib, "pyalloc_torch_record_stream"))
            if hasattr(hooks, "set_reset_fn"):
                hooks.set_reset_fn(_address(lib, "pyalloc_torch_empty_cache"))
            _pluggable = pluggable
        return _pluggable


def python_error_layout_known(version):
    """Whether torch `version` (a string such as "2.11.0+cu130") is one whose python_error class
    (torch/csrc/Exceptions.h: std::exception, then PyObject* type, value, traceback, then the
    message) the library's out-of-memory path was checked against: torch 2.x (on the GPU machine,
    2.11). For others a failed allocation raises a RuntimeError with pyalloc's message instead of
    torch.OutOfMemoryError."""
    major = str(version).split(".", 1)[0]
    return major == "2"


def _address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _check_default_backend():
    if defaults.get_default_backend() == "sim":
        raise RuntimeError("pyalloc.torch: the default backend is the simulated device; PyTorch "
                           "needs GPU memory (pyalloc.set_default_backend(None) or 'cuda')")
    for device, alloc in defaults.default_allocators().items():
        if alloc.backend.kind != "cuda":
            raise RuntimeError(f"pyalloc.torch: the default allocator of device {device} uses the "
                               f"{alloc.backend.kind!r} backend; PyTorch needs GPU memory")


def install():
    """Make pyalloc PyTorch's CUDA allocator for the whole process.

    Call it before the first CUDA allocation: PyTorch refuses to swap an allocator it has
    initialised (torch.cuda.memory.change_current_allocator raises its RuntimeError "Can't swap
    an already initialized allocator", and nothing changes). Calling it again does nothing.
    """
    global _installed
    torch = _import_torch()
    if _installed:
        return
    pluggable = allocator()
    torch.cuda.memory.change_current_allocator(pluggable)
    _installed = True


def is_installed():
    """Whether install() made pyalloc PyTorch's allocator in this process."""
    return _installed


def record_stream(tensor, stream):
    """Declare that `tensor`'s memory is also used on `stream` (a torch.cuda.Stream or a handle),
    so pyalloc does not reuse it before the work queued there up to its free has completed.

    For pyalloc memory (install() or a MemPool over allocator()) this is pyalloc's record_stream;
    for memory of PyTorch's own allocator, tensor.record_stream(stream).
    """
    handle = getattr(stream, "cuda_stream", stream)
    base = tensor.untyped_storage().data_ptr()
    if base == 0:
        return
    try:
        defaults.record_stream(base, handle)
    except NotAllocatedError:
        # Not a block of pyalloc's (PyTorch's own allocator, or a MemPool's segment that
        # PyTorch's caching allocator splits): PyTorch's record_stream applies. A pointer that
        # pyalloc did hand out and that is already freed raises AlreadyFreedError, as it should.
        tensor.record_stream(stream)
