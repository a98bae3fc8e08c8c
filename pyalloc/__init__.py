"""pyalloc: PyTorch's CUDA caching allocator for any Python program.

Importing pyalloc loads no CUDA library: the driver is touched only when a "cuda" backend is made.
"""
from pyalloc.errors import CudaError, NoCudaDriverError, OutOfMemoryError
from pyalloc.config import ConfigError, get_allocator_settings, set_allocator_settings
from pyalloc._core import Buffer, get_memory_metadata, set_memory_metadata
from pyalloc._sim import SimDevice
from pyalloc.allocator import CachingAllocator
from pyalloc.replay import replay
from pyalloc.pools import MemPool, graph_pool_handle, use_mem_pool
from pyalloc.defaults import (
    current_device, default_allocators, empty_cache, free, get_allocator, get_default_backend,
    malloc, max_memory_allocated, max_memory_reserved, memory_allocated, memory_reserved,
    memory_stats, memory_summary, record_stream, reset_peak_memory_stats, set_default_backend)

__version__ = "0.1.0"

__all__ = [
    "Buffer", "CachingAllocator", "ConfigError", "CudaError", "MemPool", "NoCudaDriverError",
    "OutOfMemoryError", "SimDevice", "get_allocator_settings", "get_memory_metadata", "replay",
    "set_allocator_settings", "set_memory_metadata", "graph_pool_handle", "use_mem_pool",
    # default allocators, one per device (pyalloc/defaults.py)
    "current_device", "default_allocators", "empty_cache", "free", "get_allocator",
    "get_default_backend", "malloc", "max_memory_allocated", "max_memory_reserved",
    "memory_allocated", "memory_reserved", "memory_stats", "memory_summary", "record_stream",
    "reset_peak_memory_stats", "set_default_backend",
]
