"""pyalloc: PyTorch's CUDA caching allocator for any Python program, and a simulated device to
replay and tune a PyTorch memory trace on any machine (`pyalloc tune trace.pickle.gz`).

An allocator on the simulated device (backend="cuda" for the GPU):

>>> import pyalloc
>>> a = pyalloc.CachingAllocator(backend="sim", config="expandable_segments:True")
>>> ptr = a.malloc(1 << 20)                   # a device pointer (int), for stream 0
>>> a.memory_allocated(), a.max_memory_reserved()
(1048576, 2097152)
>>> a.free(ptr)

The module level is torch.cuda.memory's API (memory_stats, memory_summary, empty_cache,
set_per_process_memory_fraction, record_memory_history, memory_snapshot, use_mem_pool, ...) over
one default allocator per device, on the GPU when there is one: pyalloc.malloc(nbytes),
pyalloc.free(ptr), pyalloc.get_allocator(device). Hooks route frameworks' memory here:
pyalloc.cupy.install(), pyalloc.torch.install(), pyalloc.numba.install(),
pyalloc.cuda_core.PyallocMemoryResource(). Replay and tuning: pyalloc.replay(trace) and
pyalloc.tune.tune(trace). Settings are PyTorch's strings (PYALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF).

Importing pyalloc loads no CUDA library: the driver is touched only when a "cuda" backend is made.
"""
from pyalloc.errors import (AlreadyFreedError, CudaError, NoCudaDriverError, NotAllocatedError,
                            OutOfMemoryError, OwnedByBufferError, PointerError, ReuseError)
from pyalloc.config import ConfigError, get_allocator_settings, set_allocator_settings


def _not_built(exc):
    """The error for a compiled module (pyalloc._core, ...) that cannot be found, or None.

    Run only when that import has failed, so a working import pays nothing for it. The usual cause:
    Python imports this folder from a source checkout (its parent is the current directory or on
    sys.path) after a plain `pip install .`, which built the extensions somewhere else.
    """
    import os
    import sys
    if not (exc.name or "").startswith(__name__ + "._"):
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, "_core.pyx")):
        msg = (f"pyalloc: imported from the source tree {here}, where its compiled modules are not "
               f"built (no {exc.name}): use the editable install `pip install --no-build-isolation -e .` "
               "(developer setup, see docs/setup.md) or run Python from another folder")
    else:
        msg = (f"pyalloc: the installed package at {here} lacks its compiled module {exc.name}: "
               "reinstall pyalloc (`pip install --force-reinstall .` from its source folder)")
    if getattr(sys, "argv", None) and sys.argv[0] == "-m":
        # `python -m pyalloc` (argv[0] is "-m" while the module is being located): one line on
        # stderr and exit status 1, not a traceback.
        return SystemExit(msg)
    return ImportError(msg, name=__name__)


try:
    # _metadata first: it imports pyalloc._core, the module a missing build is named by.
    from pyalloc._metadata import get_memory_metadata, set_memory_metadata
    from pyalloc._buffer import Buffer
    from pyalloc._sim import SimDevice
except ModuleNotFoundError as _exc:
    _err = _not_built(_exc)
    if _err is None:
        raise
    raise _err from None
from pyalloc.allocator import CachingAllocator
from pyalloc import replay   # the module, callable as its replay() (pyalloc/replay.py)
from pyalloc.pools import MemPool, graph_pool_handle
from pyalloc.defaults import (
    _dump_snapshot, _record_memory_history, _snapshot, caching_allocator_alloc,
    caching_allocator_delete, current_device, default_allocators, dump_snapshot, empty_cache, free,
    get_allocator, get_default_backend, get_per_process_memory_fraction, graph, malloc,
    max_memory_allocated, max_memory_reserved, mem_get_info, memory_allocated, memory_reserved,
    memory_snapshot, memory_stats, memory_stats_as_nested_dict, memory_summary,
    record_memory_history, record_stream, reset_accumulated_memory_stats, reset_peak_memory_stats,
    set_default_backend, set_per_process_memory_fraction, use_mem_pool)
from pyalloc.host import (
    empty_host_cache, host_memory_stats, host_memory_stats_as_nested_dict,
    reset_accumulated_host_memory_stats, reset_peak_host_memory_stats)

__version__ = "0.1.0"

__all__ = [
    "AlreadyFreedError", "Buffer", "CachingAllocator", "ConfigError", "CudaError", "MemPool",
    "NoCudaDriverError", "NotAllocatedError", "OutOfMemoryError", "OwnedByBufferError",
    "PointerError", "ReuseError", "SimDevice", "get_allocator_settings", "get_memory_metadata",
    "replay",
    "set_allocator_settings", "set_memory_metadata", "graph_pool_handle", "use_mem_pool",
    # default allocators, one per device (pyalloc/defaults.py), under torch.cuda.memory's names
    "caching_allocator_alloc", "caching_allocator_delete", "current_device", "default_allocators",
    "dump_snapshot", "empty_cache", "free", "get_allocator", "get_default_backend",
    "get_per_process_memory_fraction", "graph", "malloc", "max_memory_allocated",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_reserved", "memory_snapshot",
    "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "record_memory_history",
    "record_stream", "reset_accumulated_memory_stats", "reset_peak_memory_stats",
    "set_default_backend", "set_per_process_memory_fraction",
    # the process-wide pinned host memory allocator (pyalloc/host.py)
    "empty_host_cache", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats",
]

# Submodules imported on first use, so that `import pyalloc` then `pyalloc.tune.tune(...)` works
# without every import paying for them (the hooks import their framework only when called).
_LAZY_SUBMODULES = frozenset({"cuda_core", "cupy", "graphs", "host", "numba", "torch", "tune", "view"})


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY_SUBMODULES)
