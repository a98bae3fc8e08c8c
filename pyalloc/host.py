"""Pinned host memory: a caching allocator with PyTorch's CachingHostAllocator rules, and the
process-wide one behind pyalloc.host_memory_stats() and pyalloc.empty_host_cache().

>>> import pyalloc
>>> from pyalloc.host import HostAllocator
>>> h = HostAllocator(pyalloc.SimDevice())        # on the simulated device
>>> ptr = h.malloc(3000)                          # a 4096-byte pinned block
>>> h.block_size(ptr), h.stats()["num_host_alloc"], h.host_memory_stats()["active_bytes.current"]
(4096, 1, 4096)
>>> h.free(ptr)

The rules are those of pyalloc/_host.pyx (powers of two, a free list per size, record_event,
the CUDA-graph capture rule, empty_cache of idle blocks only); statistics have PyTorch 2.13's
torch.cuda.host_memory_stats() keys; record_memory_history and snapshot() give a memory history
in the device allocator's format. The settings pinned_use_cuda_host_register,
pinned_num_register_threads, pinned_reserve_segment_size_mb and pinned_use_background_threads
act as in PyTorch (docs/api.md, "Pinned host memory"). Sizes are bytes; pointers are ints.
"""
import threading
from collections import OrderedDict

from pyalloc import config as _config
from pyalloc import snapshot as _snapshot
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

    Methods: malloc(nbytes, stream=None) -> ptr, free(ptr), record_event(ptr, stream),
    empty_cache(), stats(), host_memory_stats() (flat, torch.cuda.host_memory_stats's keys),
    reset_peak_stats(), reset_accumulated_stats(), record_memory_history(...), snapshot(),
    close().
    """

    def __init__(self, device="sim", *, config=None, host=None):
        backend = _device_backend(device)
        settings = _config.current_settings() if config is None else _config.resolve_config(config)
        self.settings = settings
        self._history = None
        self._stacks = None
        super().__init__(
            backend, host if host is not None else host_backend_for(backend),
            use_host_register=settings.pinned_use_cuda_host_register,
            num_register_threads=settings.pinned_num_register_threads,
            reserve_segment_size=settings.pinned_reserve_segment_size_mb * _MiB,
            use_background_threads=settings.pinned_use_background_threads)

    def __repr__(self):
        s = self.stats()
        return (f"HostAllocator({self.host.kind}, blocks={s['allocations']['current']}, "
                f"allocated_bytes={s['allocated_bytes']['current']}, "
                f"active_bytes={s['active_bytes']['current']})")

    def host_memory_stats(self):
        """stats() flattened as torch.cuda.host_memory_stats() does: "allocation.current",
        "host_alloc_time.avg", ..., "num_host_alloc", in sorted order (an OrderedDict)."""
        return _flatten(self.stats())

    # ------------------------------------------------------------------ memory history

    def record_memory_history(self, enabled="all", context="all", stacks="python",
                              max_entries=_snapshot.DEFAULT_MAX_ENTRIES, clear_history=False,
                              skip_actions=None):
        """Start, change or stop recording this host allocator's events, with the arguments and
        rules of CachingAllocator.record_memory_history (torch.cuda.memory._record_memory_history).

        Entries, in the device allocator's trace format: "alloc" (a block handed out; addr,
        block bytes, malloc's stream), "free_requested" (free called), "free_completed" (the
        block is reusable: at once, or when its events completed), "segment_alloc" (a block
        made: from the driver or carved from the reserve segment) and "segment_free" (given
        back by empty_cache). PyTorch's host allocator keeps no history; this is pyalloc's.
        Raises TypeError/ValueError naming a bad value (history is then left as it was).
        """
        history, capacity, _ = _snapshot.check_history_args(
            enabled, context, stacks, max_entries, clear_history, skip_actions)
        if history is None:
            self._set_history(0, 0, True, None, False, False)
            self._history = None
            return
        mask = 0
        for name in history.skip_actions:
            if name in _HOST_ACTIONS:
                mask |= 1 << _HOST_ACTIONS.index(name)
        if history.context is not None and self._stacks is None:
            self._stacks = _snapshot.StackTable()
        recorder = self._stacks.record if self._stacks is not None else None
        self._set_history(capacity, mask, clear_history, recorder,
                          history.context is not None, history.context == "all")
        self._history = history

    @property
    def history_settings(self):
        """The HistorySettings record_memory_history switched on, or None while history is off."""
        return self._history

    def snapshot(self):
        """A snapshot dict in PyTorch's format (torch.cuda.memory._snapshot()) of the pinned
        blocks: each block is a segment of its own holding one block (the host allocator never
        splits; "host": True marks them), and device_traces[d] (d: the device backend's ordinal)
        holds the memory history, oldest first. `pyalloc view` and PyTorch's _memory_viz read it.
        """
        return _host_snapshot(self)


_HOST_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")
_BLOCK_STATES = {"allocated": "active_allocated", "pending": "active_pending_free",
                 "captured": "active_pending_free", "free": "inactive"}


def _host_snapshot(h):
    level = h._history.context if h._history is not None else None
    stacks_on_entries = level in ("alloc", "all")

    def frames(stack_id):
        return h._stacks.frames(stack_id) if stack_id and h._stacks is not None else []

    trace = []
    for action, addr, size, stream, time_us, stack_id in h._history_entries():
        entry = {"action": action, "addr": addr, "size": size, "stream": stream,
                 "time_us": time_us, "compile_context": "N/A", "user_metadata": ""}
        # As the device allocator's: frames with context >= "alloc"; free entries carry the
        # block's allocation stack whenever one was kept.
        if stack_id and (stacks_on_entries or action.startswith("free")):
            entry["frames"] = frames(stack_id)
        trace.append(entry)
    segments = []
    for addr, size, state, stream, stack_id in h._block_records():
        block_state = _BLOCK_STATES[state]
        active = 0 if block_state == "inactive" else size
        segments.append({
            "device": h.device.device, "address": addr, "total_size": size,
            "allocated_size": size if state == "allocated" else 0, "active_size": active,
            "requested_size": active, "stream": stream, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "host": True,
            "frames": frames(stack_id),
            "blocks": [{"address": addr, "size": size, "requested_size": size if active else 0,
                        "state": block_state, "frames": frames(stack_id), "user_metadata": ""}],
        })
    device_traces = [[] for _ in range(h.device.device)]
    device_traces.append(trace)
    return {"segments": segments, "device_traces": device_traces,
            "allocator_settings": h.settings.to_snapshot_dict(), "external_annotations": []}


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
