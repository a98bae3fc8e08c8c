"""Module-level default allocators, one per device, behind pyalloc.malloc, pyalloc.free and friends.

The first call that needs device d creates its CachingAllocator. Which backend it gets follows
set_default_backend(): by default None, i.e. the GPU when a CUDA driver and GPU are there and the
simulated device otherwise (the choice is logged on the "pyalloc" logger and visible as
`get_allocator(d).backend.kind`). This differs from `CachingAllocator()`, whose backend defaults
to "sim": the default allocators serve real programs and framework hooks, an allocator made by
hand is a simulation unless given backend="cuda" or None.

The functions have the names and arguments of torch.cuda.memory's (memory_stats,
set_per_process_memory_fraction, memory_snapshot, mem_get_info, caching_allocator_alloc, ...,
and _record_memory_history, _snapshot and _dump_snapshot, the first and last of which pyalloc
also names record_memory_history and dump_snapshot), acting on these default allocators; so code
written against torch.cuda.memory reads pyalloc's figures by changing the module it calls.

device=None means the current device: for a CUDA default backend, the device whose context is
current on the calling thread (the device CuPy's or PyTorch's "current device" selects; 0 when no
context is current); for the simulated device, 0.

Sizes are bytes; pointers are ints; streams are int handles or stream objects (`__cuda_stream__`,
`.cuda_stream`, `.ptr`), converted by the core.
"""
import sys
import threading

from pyalloc import pools as _pools
from pyalloc import snapshot as _snapshots
from pyalloc.allocator import CachingAllocator
from pyalloc.errors import NoCudaDriverError, NotAllocatedError

_lock = threading.RLock()
_allocators = {}            # device ordinal -> CachingAllocator
_allocator_list = ()        # the same allocators, as a tuple, for pointer lookups without the lock
_backend_choice = None      # None (automatic), "sim", "cuda", or a callable(device) -> Backend
_history_for_new = None     # record_memory_history's arguments for default allocators made later
_U64 = 1 << 64


# ------------------------------------------------------------------------------ backend choice

def set_default_backend(backend=None):
    """Choose the backend of the default allocators made from now on.

    backend: None (the GPU when one is usable, else the simulated device; the default), "sim",
    "cuda", or a callable taking a device ordinal and returning a Backend (e.g.
    `lambda d: pyalloc.SimDevice(1 << 30, device=d)`).

    Existing default allocators are emptied (empty_cache) and dropped, so the next call makes new
    ones. Raises RuntimeError, changing nothing, while any of them still has live allocations
    (bytes handed out and not freed), ValueError for an unknown backend name.
    """
    global _backend_choice, _allocators, _allocator_list, _current_device
    if not (backend is None or backend in ("sim", "cuda") or
            (callable(backend) and not isinstance(backend, str))):
        raise ValueError(
            f"default backend must be None, 'sim', 'cuda' or a callable(device) -> Backend, got {backend!r}")
    with _lock:
        busy = {d: a.memory_allocated() for d, a in _allocators.items() if a.memory_allocated()}
        if busy:
            detail = ", ".join(f"device {d}: {n} bytes" for d, n in sorted(busy.items()))
            raise RuntimeError(
                f"cannot change the default backend while default allocators hold live allocations "
                f"({detail}); free them first")
        for a in _allocators.values():
            a.empty_cache()
            a.retired_default = True
        _allocators = {}
        _allocator_list = ()
        capi = sys.modules.get("pyalloc._capi")
        if capi is not None:
            capi.forget_allocators()        # the C entry points look the new ones up
        host = sys.modules.get("pyalloc.host")
        if host is not None:
            host._forget_default()          # the process-wide host allocator follows the backend
        _backend_choice = backend
        _current_device = _resolve_current_device


def get_default_backend():
    """The value last given to set_default_backend (None: automatic)."""
    return _backend_choice


def _resolve_current_device():
    # Decide once per backend choice how "the current device" is found, then rebind the global so
    # that later calls go straight to the answer.
    global _current_device
    choice = _backend_choice
    use_cuda = choice == "cuda"
    if choice is None:
        from pyalloc import cuda_backend
        use_cuda = cuda_backend.is_available()
    if use_cuda:
        from pyalloc import cuda_backend
        if cuda_backend.is_available():
            from pyalloc._cuda import current_device_or_zero as fn    # one C call, no Python frame
        else:
            fn = _device_zero       # "cuda" without a driver: creating the allocator will say why
    else:
        fn = _device_zero
    with _lock:
        if _backend_choice is choice:
            _current_device = fn
    return fn()


def _device_zero():
    return 0


_current_device = _resolve_current_device


def current_device():
    """The device ordinal that device=None stands for (see the module docstring)."""
    return _current_device()


# ------------------------------------------------------------------------------ allocators

def _check_device(device):
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be an int ordinal >= 0 or None, got {device!r}")


def _create(device):
    global _allocators, _allocator_list
    _check_device(device)
    with _lock:
        alloc = _allocators.get(device)
        if alloc is None:
            choice = _backend_choice
            backend = choice(device) if callable(choice) and not isinstance(choice, str) else choice
            alloc = CachingAllocator(device, backend=backend)
            if _history_for_new is not None:
                alloc.record_memory_history(**_history_for_new)
            # Copy-on-write, so that lookups without the lock always see a consistent map.
            allocators = dict(_allocators)
            allocators[device] = alloc
            _allocators = allocators
            _allocator_list = tuple(allocators[d] for d in sorted(allocators))
        return alloc


def get_allocator(device=None):
    """The default CachingAllocator of `device` (None: the current device), created on first use.

    Raises ValueError for a bad ordinal (for the GPU: outside the visible devices),
    NoCudaDriverError when the default backend is "cuda" and there is no GPU.
    """
    if device is None:
        device = _current_device()
    alloc = _allocators.get(device) if type(device) is int else None
    return alloc if alloc is not None else _create(device)


_pools.default_allocator_for = get_allocator      # MemPool(device) without an allocator


def check_gpu_backend(alloc, hook, framework):
    """Refuse, for the framework hook module `hook` (e.g. "pyalloc.cupy"), a default allocator
    that is not on the GPU: `framework` (e.g. "CuPy") needs real device memory. Returns `alloc`."""
    if alloc.backend.kind != "cuda":
        raise NoCudaDriverError(
            f"{hook}: the default allocator of device {alloc.device} uses the "
            f"{alloc.backend.kind!r} backend, not 'cuda'; {framework} needs GPU memory "
            "(pyalloc.set_default_backend(None) or 'cuda')")
    return alloc


def default_allocators():
    """The default allocators made so far, as a dict {device: CachingAllocator}."""
    return dict(_allocators)


# ------------------------------------------------------------------------------ malloc / free

def malloc(nbytes, stream=0, device=None):
    """Allocate `nbytes` bytes for use on `stream` on `device` (None: the current device).

    Returns the device pointer (an int; 0 for 0 bytes). Free it with pyalloc.free. Raises
    pyalloc.OutOfMemoryError when the device cannot provide the memory.
    """
    if device is None:
        device = _current_device()
    alloc = _allocators.get(device) if type(device) is int else None
    if alloc is None:
        alloc = _create(device)
    return alloc.malloc(nbytes, stream)


def _check_pointer(ptr):
    if type(ptr) is not int:
        if isinstance(ptr, bool) or not hasattr(ptr, "__index__"):
            raise TypeError(f"ptr must be an int device pointer, got {type(ptr).__name__} {ptr!r}")
        ptr = ptr.__index__()
    if not 0 <= ptr < _U64:
        raise ValueError(f"pointer {ptr} is not a device address (expected an int in [0, 2**64))")
    return ptr


def _search_order():
    # The current device's allocator first: the likely owner of a pointer.
    allocs = _allocator_list
    if len(allocs) > 1:
        first = _allocators.get(_current_device())
        if first is not None:
            allocs = (first,) + tuple(a for a in allocs if a is not first)
    return allocs


def _owner_call(ptr, method, *args):
    """Call allocator.method(ptr, *args) on the default allocator that owns ptr."""
    allocs = _search_order()
    for alloc in allocs:
        try:
            return getattr(alloc, method)(ptr, *args)
        except NotAllocatedError:
            pass            # not this allocator's: try the next one (AlreadyFreedError propagates)
    devices = ", ".join(str(a.device) for a in allocs) or "none made yet"
    raise NotAllocatedError(
        f"pointer {ptr:#x} was not allocated by pyalloc's default allocators (devices: {devices})", ptr)


def free(ptr, device=None):
    """Return memory from pyalloc.malloc. free(0) does nothing.

    device: the allocator to return it to; None looks the pointer up among the default
    allocators. Raises ValueError for a pointer they did not hand out or already freed.
    """
    if device is not None:
        _check_device(device)
        alloc = _allocators.get(device)
        if alloc is None:
            if ptr == 0:
                return
            raise ValueError(f"pointer {ptr!r} cannot be freed on device {device}: "
                             f"no default allocator exists for that device")
        return alloc.free(ptr)
    allocs = _allocator_list
    if len(allocs) == 1:
        return allocs[0].free(ptr)
    ptr = _check_pointer(ptr)
    if ptr == 0:
        return
    _owner_call(ptr, "free")


def _data_pointer(obj):
    """The device pointer of an int, a CuPy array or MemoryPointer, or a __cuda_array_interface__ object.

    For CuPy objects this is the start of the allocation (views share it), not the view's address.
    """
    if type(obj) is int:
        return obj
    if isinstance(obj, bool):
        raise TypeError(f"expected a device pointer or an array, got {obj!r}")
    mem = getattr(obj, "mem", None)                           # cupy.cuda.MemoryPointer
    if mem is None:
        mem = getattr(getattr(obj, "data", None), "mem", None)  # cupy.ndarray (.data is a MemoryPointer)
    if mem is not None and type(getattr(mem, "ptr", None)) is int:
        return mem.ptr
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        try:
            return int(iface["data"][0])
        except (TypeError, KeyError, IndexError, ValueError):
            raise TypeError(f"__cuda_array_interface__ of {type(obj).__name__} has no data pointer: "
                            f"{iface!r}") from None
    if hasattr(obj, "__index__"):
        return obj.__index__()
    raise TypeError(
        f"expected a device pointer (int), a CuPy array or MemoryPointer, or an object with "
        f"__cuda_array_interface__, got {type(obj).__name__}")


def _containing_block(ptr):
    """(allocator, block address) of the live allocation that contains `ptr`, or (None, None)."""
    for alloc in _search_order():
        for seg in alloc._segments():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                for blk in seg["blocks"]:
                    if blk["allocated"] and blk["address"] <= ptr < blk["address"] + blk["size"]:
                        return alloc, blk["address"]
                return None, None
    return None, None


def record_stream(obj, stream, last_use=False):
    """Declare that the memory of `obj` is also used on `stream`, so it is not reused before the
    work queued on `stream` up to its free has completed.

    last_use=True during a graph capture marks the work captured on `stream` so far as the last
    use there (see CachingAllocator.record_stream; effective with graph_capture_last_use_marks).

    obj: an int device pointer from pyalloc.malloc, a CuPy array or MemoryPointer over pyalloc
    memory, or anything with __cuda_array_interface__ (a pointer inside an allocation, as a view
    has, is accepted). stream: an int handle or a stream object (`__cuda_stream__`,
    `.cuda_stream`, `.ptr`). Using the allocation stream is a no-op, as is a null pointer.
    Raises ValueError when the memory is not from pyalloc's default allocators.
    """
    ptr = _check_pointer(_data_pointer(obj))
    allocs = _allocator_list
    if allocs:
        allocs[0].malloc(0, stream)    # validates the stream (TypeError/ValueError) and does nothing else
    if ptr == 0:
        return
    try:
        return _owner_call(ptr, "record_stream", stream, last_use)
    except NotAllocatedError:
        alloc, base = _containing_block(ptr)
        if alloc is None:
            raise
    alloc.record_stream(base, stream, last_use)


# ------------------------------------------------------------------------------ statistics

def memory_stats(device=None):
    """PyTorch's flat statistics dict of `device`'s default allocator (None: current device)."""
    return get_allocator(device).memory_stats()


def memory_allocated(device=None):
    """Bytes handed out and not freed on `device` (None: current device)."""
    return get_allocator(device).memory_allocated()


def memory_reserved(device=None):
    """Bytes in segments held from `device` (None: current device)."""
    return get_allocator(device).memory_reserved()


def max_memory_allocated(device=None):
    """Peak of memory_allocated(device) since creation or reset_peak_memory_stats(device)."""
    return get_allocator(device).max_memory_allocated()


def max_memory_reserved(device=None):
    """Peak of memory_reserved(device) since creation or reset_peak_memory_stats(device)."""
    return get_allocator(device).max_memory_reserved()


def reset_peak_memory_stats(device=None):
    """Set every peak statistic of `device`'s default allocator to its current value."""
    get_allocator(device).reset_peak_memory_stats()


def memory_summary(device=None, abbreviated=False):
    """PyTorch-style summary table of `device`'s default allocator (None: current device).

    abbreviated=True leaves out the large-pool and small-pool rows, as torch.cuda.memory_summary.
    """
    if not isinstance(abbreviated, bool):
        raise TypeError(f"abbreviated must be a bool, got {type(abbreviated).__name__} {abbreviated!r}")
    return get_allocator(device).memory_summary(abbreviated=abbreviated)


def empty_cache(device=None):
    """Release cached segments that hold no live block back to the device.

    device None: every default allocator made so far (as torch.cuda.empty_cache does).
    """
    if device is None:
        for alloc in _allocator_list:
            alloc.empty_cache()
        return
    _check_device(device)
    alloc = _allocators.get(device)
    if alloc is not None:
        alloc.empty_cache()


def reset_accumulated_memory_stats(device=None):
    """Reset the accumulated ("allocated", "freed") statistics and the event counters
    (num_alloc_retries, num_ooms, ...) of `device`'s default allocator (None: current device)."""
    get_allocator(device).reset_accumulated_memory_stats()


def memory_stats_as_nested_dict(device=None):
    """memory_stats(device) as nested dicts: stats["allocated_bytes"]["all"]["peak"], as
    torch.cuda.memory_stats_as_nested_dict."""
    nested = {}
    for key, value in memory_stats(device).items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def mem_get_info(device=None):
    """(free bytes, total bytes) of `device` (None: current device), from cuMemGetInfo on the GPU
    or the simulated device's own count; torch.cuda.mem_get_info."""
    return get_allocator(device).backend.mem_get_info()


def set_per_process_memory_fraction(fraction, device=None):
    """Cap what `device`'s default allocator (None: current device) may reserve at `fraction`
    (0.0 .. 1.0) of the device's total memory; 1.0 removes the cap.

    torch.cuda.set_per_process_memory_fraction; CachingAllocator.set_memory_fraction for one
    allocator. Raises TypeError for a fraction that is not a number, ValueError outside [0, 1].
    """
    get_allocator(device).set_memory_fraction(fraction)


def get_per_process_memory_fraction(device=None):
    """The fraction set_per_process_memory_fraction set on `device` (None: current device); 1.0
    when none (torch.cuda.get_per_process_memory_fraction)."""
    return get_allocator(device).get_memory_fraction()


def caching_allocator_alloc(size, device=None, stream=None):
    """Allocate `size` bytes on `device` (None: current device) for `stream` (None: the default
    stream, 0), as torch.cuda.caching_allocator_alloc; returns the device pointer (an int).
    Free it with caching_allocator_delete."""
    return malloc(size, 0 if stream is None else stream, device)


def caching_allocator_delete(mem_ptr):
    """Free memory from caching_allocator_alloc (or pyalloc.malloc), as
    torch.cuda.caching_allocator_delete; the owning default allocator is looked up."""
    free(mem_ptr)


# ------------------------------------------------------------------------------ history and snapshots

def record_memory_history(enabled="all", context="all", stacks="all",
                          max_entries=_snapshots.DEFAULT_MAX_ENTRIES, device=None, clear_history=False,
                          skip_actions=None):
    """Start, change or stop recording allocator events, as torch.cuda.memory._record_memory_history.

    device=None (PyTorch's only behaviour): every default allocator, those made so far and
    those made later; device=d: that device's default allocator only. The other arguments are
    CachingAllocator.record_memory_history's (max_entries defaults to 1,000,000, not PyTorch's
    sys.maxsize). Bad arguments raise TypeError/ValueError naming the value, before any
    allocator's history changes.
    """
    global _history_for_new
    _snapshots.check_history_args(enabled, context, stacks, max_entries, clear_history, skip_actions)
    args = dict(enabled=enabled, context=context, stacks=stacks, max_entries=max_entries,
                clear_history=clear_history, skip_actions=skip_actions)
    if device is not None:
        get_allocator(device).record_memory_history(**args)
        return
    with _lock:
        _history_for_new = None if enabled is None else args
        for alloc in _allocator_list:
            alloc.record_memory_history(**args)


def _snapshot_allocators():
    allocs = _allocator_list
    return allocs if allocs else (get_allocator(),)


def _snapshot(device=None):
    """The memory snapshot of the default allocators, in PyTorch's format (torch.cuda.memory._snapshot()).

    The name keeps torch's underscore because pyalloc.snapshot is the module of snapshot files
    (pyalloc.snapshot.load, dump).

    device=None: every default allocator made so far (the current device's if none is), each
    segment carrying its "device", device_traces[d] holding device d's trace, as PyTorch's
    snapshot covers every device; device=d: that device's allocator only. Taking a snapshot
    records a `snapshot` event in each recording allocator's trace, as in PyTorch.
    """
    if device is not None:
        return get_allocator(device).snapshot()
    allocs = _snapshot_allocators()
    parts = [(a.device, a.snapshot()) for a in allocs]
    traces = [[] for _ in range(max(d for d, _ in parts) + 1)]
    segments = []
    for d, part in parts:
        segments.extend(part["segments"])
        traces[d] = part["device_traces"][d]
    first = parts[0][1]
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": first["allocator_settings"],
            "external_annotations": first["external_annotations"]}


def dump_snapshot(filename="dump_snapshot.pickle"):
    """Write _snapshot() of every default allocator to `filename` as a pickle (gzip when the name
    ends in ".gz"), as torch.cuda.memory._dump_snapshot; pytorch.org/memory_viz reads it."""
    _snapshots.dump(_snapshot(), filename)


def memory_snapshot(mempool_id=None, include_traces=True):
    """The segments of _snapshot(), every device (torch.cuda.memory_snapshot()): those of private
    pool `mempool_id` (a pool id tuple, such as MemPool.id) only, when given.

    include_traces is accepted as torch's; the segment list is the same either way.
    """
    if not isinstance(include_traces, bool):
        raise TypeError(f"include_traces must be a bool, got {type(include_traces).__name__} {include_traces!r}")
    if mempool_id is not None:
        if not (isinstance(mempool_id, tuple) and len(mempool_id) == 2
                and all(type(x) is int for x in mempool_id)):
            raise TypeError(f"mempool_id must be a pool id (a tuple of two ints, such as "
                            f"MemPool.id), got {mempool_id!r}")
    segments = _snapshot()["segments"]
    if mempool_id is None:
        return segments
    return [seg for seg in segments if tuple(seg["segment_pool_id"]) == mempool_id]


# torch.cuda.memory's private names of the two above, so that code calling them runs unchanged.
_record_memory_history = record_memory_history
_dump_snapshot = dump_snapshot


# ------------------------------------------------------------------------------ pools and graphs

def use_mem_pool(pool, device=None):
    """Context manager: this thread's allocations on the pool's allocator go to `pool` inside the
    block (torch.cuda.use_mem_pool; see pyalloc.pools.use_mem_pool).

    Checks at the call, as CachingAllocator.use_mem_pool does: TypeError for something that is
    not a MemPool, ValueError for a released pool or a `device` other than the pool's.
    """
    if not isinstance(pool, _pools.MemPool):
        raise TypeError(f"use_mem_pool expects a pyalloc MemPool, got {type(pool).__name__} {pool!r}")
    if pool._released:
        raise ValueError(f"MemPool {pool.id} was released")
    if device is not None and device != pool.allocator.device:
        raise ValueError(f"MemPool {pool.id} belongs to device {pool.allocator.device}, not device {device}")
    return _pools.use_mem_pool(pool, device)


def graph(stream, pool=None, capture_error_mode="global", device=None):
    """A pyalloc.graphs.Graph on `device`'s default allocator (None: current device):
    `with pyalloc.graph(stream) as g:` captures the work queued on `stream` into a CUDA graph
    whose allocations come from a private pool (CachingAllocator.graph, torch.cuda.graph)."""
    return get_allocator(device).graph(stream, pool=pool, capture_error_mode=capture_error_mode)
