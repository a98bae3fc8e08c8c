"""pyalloc: PyTorch's CUDA caching allocator for any Python program.

Importing pyalloc loads no CUDA library: the driver is touched only when a "cuda" backend is made.
"""
from pyalloc.errors import (AlreadyFreedError, CudaError, NoCudaDriverError, NotAllocatedError,
                            OutOfMemoryError, PointerError)
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
               "(developer setup, see README.md) or run Python from another folder")
    else:
        msg = (f"pyalloc: the installed package at {here} lacks its compiled module {exc.name}: "
               "reinstall pyalloc (`pip install --force-reinstall .` from its source folder)")
    if getattr(sys, "argv", None) and sys.argv[0] == "-m":
        # `python -m pyalloc` (argv[0] is "-m" while the module is being located): one line on
        # stderr and exit status 1, not a traceback.
        return SystemExit(msg)
    return ImportError(msg, name=__name__)


try:
    from pyalloc._core import Buffer, get_memory_metadata, set_memory_metadata
    from pyalloc._sim import SimDevice
except ModuleNotFoundError as _exc:
    _err = _not_built(_exc)
    if _err is None:
        raise
    raise _err from None
from pyalloc.allocator import CachingAllocator
from pyalloc import replay   # the module, callable as its replay() (pyalloc/replay.py)
from pyalloc.pools import MemPool, graph_pool_handle, use_mem_pool
from pyalloc.defaults import (
    current_device, default_allocators, empty_cache, free, get_allocator, get_default_backend,
    malloc, max_memory_allocated, max_memory_reserved, memory_allocated, memory_reserved,
    memory_stats, memory_summary, record_stream, reset_peak_memory_stats, set_default_backend)

__version__ = "0.1.0"

__all__ = [
    "AlreadyFreedError", "Buffer", "CachingAllocator", "ConfigError", "CudaError", "MemPool",
    "NoCudaDriverError", "NotAllocatedError", "OutOfMemoryError", "PointerError", "SimDevice", "get_allocator_settings", "get_memory_metadata", "replay",
    "set_allocator_settings", "set_memory_metadata", "graph_pool_handle", "use_mem_pool",
    # default allocators, one per device (pyalloc/defaults.py)
    "current_device", "default_allocators", "empty_cache", "free", "get_allocator",
    "get_default_backend", "malloc", "max_memory_allocated", "max_memory_reserved",
    "memory_allocated", "memory_reserved", "memory_stats", "memory_summary", "record_stream",
    "reset_peak_memory_stats", "set_default_backend",
]
