"""Module-level default allocators, one per device, behind pyalloc.malloc, pyalloc.free and friends.

The first call that needs device d creates its CachingAllocator. Which backend it gets follows
set_default_backend(): by default None, i.e. the GPU when a CUDA driver and GPU are there and the
simulated device otherwise (the choice is logged on the "pyalloc" logger and visible as
`get_allocator(d).backend.kind`).

device=None means the current device: for a CUDA default backend, the device whose context is
current on the calling thread (the device CuPy's or PyTorch's "current device" selects; 0 when no
context is current); for the simulated device, 0.

Sizes are bytes; pointers are ints; streams are int handles or stream objects (`__cuda_stream__`,
`.cuda_stream`, `.ptr`), converted by the core.
"""
import sys
import threading

from pyalloc.allocator import CachingAllocator
from pyalloc.errors import NoCudaDriverError, NotAllocatedError

_lock = threading.RLock()
_allocators = {}            # device ordinal -> CachingAllocator
_allocator_list = ()        # the same allocators, as a tuple, for pointer lookups without the lock
_backend_choice = None      # None (automatic), "sim", "cuda", or a callable(device) -> Backend
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
        _allocators = {}
        _allocator_list = ()
        capi = sys.modules.get("pyalloc._capi")
        if capi is not None:
            capi.forget_allocators()        # the C entry points look the new ones up
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


def memory_summary(device=None):
    """PyTorch-style summary table of `device`'s default allocator (None: current device)."""
    return get_allocator(device).memory_summary()


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
