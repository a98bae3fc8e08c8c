"""Pinned host memory: a caching allocator with PyTorch's CachingHostAllocator rules, and the
process-wide one behind pyalloc.host_memory_stats() and pyalloc.empty_host_cache().

>>> import pyalloc
>>> from pyalloc.host import HostAllocator
>>> h = HostAllocator(pyalloc.SimDevice())        # on the simulated device
>>> ptr = h.malloc(3000)                          # a 4096-byte pinned block
>>> h.block_size(ptr), h.stats()["num_host_alloc"]
(4096, 1)
>>> h.free(ptr)

The rules are those of pyalloc/_host.pyx (powers of two, a free list per size, record_event,
empty_cache of idle blocks only); the settings pinned_use_cuda_host_register,
pinned_num_register_threads, pinned_reserve_segment_size_mb and pinned_use_background_threads
act as in PyTorch (docs/api.md, "Pinned host memory"). Sizes are bytes; pointers are ints.
"""
import threading
from collections import OrderedDict

from pyalloc import config as _config
from pyalloc._backend import Backend
from pyalloc._host import HostCachingAllocator

_MiB = 1 << 20


def host_backend_for(device):
    """The HostBackend over device Backend `device`: a SimHost for a SimDevice, a CudaHost (its
    primary context's cuMemHostAlloc and friends) for a CudaDevice."""
    if device.kind == "sim":
        from pyalloc._sim_host import SimHost
        return SimHost(device)
    if device.kind == "cuda":
        from pyalloc._cuda_host import CudaHost
        return CudaHost(device)
    raise ValueError(f"no host memory backend for a {device.kind!r} device backend ({device!r})")


def _device_backend(device):
    if isinstance(device, Backend):
        return device
    backend = getattr(device, "backend", None)       # a CachingAllocator
    if isinstance(backend, Backend):
        return backend
    if device in ("sim", "cuda", None):
        from pyalloc.allocator import make_backend
        return make_backend(device, 0)
    raise TypeError(f"device must be a Backend (SimDevice, CudaDevice), a CachingAllocator, "
                    f"'sim', 'cuda' or None, got {device!r}")


class HostAllocator(HostCachingAllocator):
    """The caching allocator of pinned host memory for the streams of one device backend.

    Args:
        device: a device Backend (SimDevice or CudaDevice), a CachingAllocator (its backend), or
            "sim" / "cuda" / None (a new backend of device 0, as CachingAllocator's backend
            argument); the device whose streams and events the blocks use.
        config: settings in PyTorch's format or a CudaAllocatorConfig; its pinned_* keys apply.
            None (default): the process-wide settings at construction (PYALLOC_CONF /
            PYTORCH_CUDA_ALLOC_CONF, pyalloc.set_allocator_settings).
        host: the HostBackend to use (default: host_backend_for(device)).

    Methods: malloc(nbytes) -> ptr, free(ptr), record_event(ptr, stream), empty_cache(), stats(),
    host_memory_stats() (flat, torch.cuda.host_memory_stats's keys), reset_peak_stats(),
    reset_accumulated_stats(), close().
    """

    def __init__(self, device="sim", *, config=None, host=None):
        backend = _device_backend(device)
        settings = _config.current_settings() if config is None else _config.resolve_config(config)
        super().__init__(
            backend, host if host is not None else host_backend_for(backend),
            use_host_register=settings.pinned_use_cuda_host_register,
            num_register_threads=settings.pinned_num_register_threads,
            reserve_segment_size=settings.pinned_reserve_segment_size_mb * _MiB,
            use_background_threads=settings.pinned_use_background_threads)

    def __repr__(self):
        s = self.stats()
        return (f"HostAllocator({self.host.kind}, blocks={s['segment']['current']}, "
                f"reserved_bytes={s['reserved_bytes']['current']}, "
                f"allocated_bytes={s['allocated_bytes']['current']})")

    def host_memory_stats(self):
        """stats() flattened as torch.cuda.host_memory_stats() does: "allocation.current",
        "host_alloc_time.avg", ..., "num_host_alloc", in sorted order (an OrderedDict)."""
        return _flatten(self.stats())


def _flatten(nested):
    out = []

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out.append((prefix, obj))

    walk("", nested)
    return OrderedDict(sorted(out))


# ------------------------------------------------------------------ the process-wide allocator

_lock = threading.Lock()
_default = None


def get_host_allocator():
    """The process-wide HostAllocator, made on first use over the default allocator of the
    current device (pyalloc.get_allocator(): the GPU when there is one), as PyTorch has one host
    allocator per process."""
    global _default
    with _lock:
        if _default is None:
            from pyalloc.defaults import get_allocator
            _default = HostAllocator(get_allocator())
        return _default


def _forget_default():
    """pyalloc.set_default_backend's step for the host: the process-wide host allocator, made
    over the previous default backend, is emptied and dropped when no block of it is in use (the
    next use makes one over the new backend); one with blocks in use stays."""
    global _default
    with _lock:
        if _default is None or any(state != "free" for _, _, state in _default.block_list()):
            return
        _default.close()
        _default = None


def host_memory_stats():
    """torch.cuda.host_memory_stats() for pyalloc's process-wide host allocator (a flat,
    sorted dict; {} before it is first used, as torch's before CUDA is initialised)."""
    return OrderedDict() if _default is None else _default.host_memory_stats()


def host_memory_stats_as_nested_dict():
    """host_memory_stats() as a nested dict ({} before first use)."""
    return {} if _default is None else _default.stats()


def empty_host_cache():
    """Free the idle cached pinned blocks of the process-wide host allocator (torch's
    torch._C._host_emptyCache); blocks in use or waiting for events stay."""
    if _default is not None:
        _default.empty_cache()


def reset_peak_host_memory_stats():
    """torch.cuda.reset_peak_host_memory_stats() for the process-wide host allocator."""
    if _default is not None:
        _default.reset_peak_stats()


def reset_accumulated_host_memory_stats():
    """torch.cuda.reset_accumulated_host_memory_stats() for the process-wide host allocator."""
    if _default is not None:
        _default.reset_accumulated_stats()
