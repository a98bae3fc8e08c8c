"""CuPy on pyalloc: one line moves every CuPy device allocation onto pyalloc's default allocators.

    import pyalloc.cupy
    pyalloc.cupy.install()            # process-wide, until pyalloc.cupy.uninstall()
    with pyalloc.cupy.using():        # or only inside a block, on this thread
        ...

Each CuPy allocation is made by the default allocator of CuPy's current device, for CuPy's
current stream (both read at allocation: at free time "current" may belong to another thread). It
is returned to CuPy as MemoryPointer(UnownedMemory(ptr, block size, owner, device_id), 0): the owner is a
pyalloc Buffer, so the memory goes back to pyalloc when CuPy drops the last array or view using it,
and the device id is always passed so CuPy never has to look the pointer up.

CuPy cannot say that an array is used on another stream; pyalloc.record_stream(array, stream)
can, and then the memory is not reused before that stream's work up to the free has completed.

Out of memory: after one gc.collect() and retry (arrays in reference cycles hold memory until
collected, and CuPy's own pool does the same), the error raised is both a pyalloc.OutOfMemoryError
and a cupy.cuda.memory.OutOfMemoryError, so code catching either keeps working.

Not seen by pyalloc-backed allocations: CuPy's memory hooks (cupy.cuda.MemoryHook) and its pool
statistics (cupy.get_default_memory_pool()); use pyalloc.memory_stats() instead. With CuPy's
per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) every thread's default stream
has the same handle, so memory freed by one thread may be reused by another thread's default
stream without ordering; give threads their own streams in that mode.

Importing this module does not import CuPy; install()/using() do.
"""
import contextlib
import gc
import threading

from pyalloc import defaults as _defaults
from pyalloc._buffer import Buffer
from pyalloc._hooks import FrameworkMalloc
from pyalloc.errors import NoCudaDriverError, OutOfMemoryError, framework_out_of_memory_error

__all__ = ["install", "uninstall", "using", "is_installed", "allocator", "out_of_memory_error"]

_lock = threading.Lock()
_installed = None          # (our allocator function, CuPy's allocator before install) while installed
_pinned_installed = None   # our pinned memory allocator function while install(pinned=True) holds
_oom_class = None


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"pyalloc.cupy needs CuPy (pip install cupy-cuda13x): {exc}") from exc
    return cupy


# ------------------------------------------------------------------------------ errors

def _cupy_figures(err, message):
    # CuPy's own figures, read by code written for its error: the request, what the pool holds,
    # and the limit (0: none).
    err._size = err.requested or 0
    err._total = (err.allocated or 0) + (err.reserved_unallocated or 0)
    err._limit = err.allowed or 0


def out_of_memory_error():
    """The exception class raised on out of memory: a subclass of both pyalloc.OutOfMemoryError
    and cupy.cuda.memory.OutOfMemoryError (created on first use, so this module imports without CuPy).
    """
    global _oom_class
    if _oom_class is None:
        _oom_class = framework_out_of_memory_error(
            _import_cupy().cuda.memory.OutOfMemoryError, __name__, "CupyOutOfMemoryError",
            "Out of memory in a CuPy allocation served by pyalloc. Figures in bytes, as in "
            "pyalloc.OutOfMemoryError; CuPy's _size/_total/_limit are set from them.",
            out_of_memory_error, _cupy_figures)
    return _oom_class


# ------------------------------------------------------------------------------ the allocator

def _check_backend(alloc):
    """CuPy needs real device memory: refuse a default allocator on the simulated device."""
    return _defaults.check_gpu_backend(alloc, "pyalloc.cupy", "CuPy")


def allocator(device=None, fallback=None, detect_capture="route"):
    """A CuPy allocator function (nbytes -> cupy.cuda.MemoryPointer) over pyalloc.

    device: None serves every device; an ordinal serves only allocations made while that device
    is CuPy's current one, and passes the others to `fallback` (CuPy's allocator of your choice;
    required then). Use it with cupy.cuda.set_allocator or cupy.cuda.using_allocator, or let
    install()/using() do that.

    detect_capture: what to do about CuPy code that calls Stream.begin_capture() itself (memory
    allocated in such a capture would otherwise go back to the shared cache and be handed to
    arrays made after it, which the graph's replays then overwrite). Before each allocation on a
    non-default stream pyalloc asks the driver whether the stream captures a graph it does not
    route: "route" (default) routes that capture into a new private pool, kept for the life of
    the allocator, since nothing tells when the graph dies (pyalloc.cupy.graph frees its pool
    with the graph); "error" refuses the allocation with a RuntimeError naming
    pyalloc.cupy.graph; "off" skips the check and its driver query.
    """
    cupy = _import_cupy()
    if device is not None:
        _defaults._check_device(device)
        if fallback is None:
            raise ValueError(f"allocator(device={device}) needs a fallback allocator for the other devices")
    get_device_id = cupy.cuda.device.get_device_id
    get_current_stream = cupy.cuda.get_current_stream
    UnownedMemory = cupy.cuda.memory.UnownedMemory
    MemoryPointer = cupy.cuda.memory.MemoryPointer
    defaults = _defaults

    def new_allocator(dev):
        alloc = defaults.get_allocator(dev)
        _check_backend(alloc)
        return alloc

    def malloc_after_oom(alloc, nbytes, stream):
        gc.collect()
        try:
            return Buffer(alloc, nbytes, stream)
        except OutOfMemoryError as exc:
            raise out_of_memory_error().from_error(exc) from None

    # The hot path (FrameworkMalloc, in Cython): CuPy's current device and stream, one core
    # malloc, CuPy's two wrapper objects.
    return FrameworkMalloc(get_device_id, get_current_stream, defaults, new_allocator,
                           UnownedMemory, MemoryPointer, malloc_after_oom, device, fallback,
                           c_entry_points=_c_entry_points(cupy), detect_capture=detect_capture)


def _c_entry_points(cupy):
    """CuPy's C functions behind get_device_id() and a device's current stream pointer, as the
    capsules its Cython modules export (__pyx_capi__), or None where this CuPy has none.

    CuPy's own pool calls these two directly; through Python, get_current_stream() also builds or
    looks up a Stream object on every allocation. FrameworkMalloc checks the capsules' signatures
    and uses the Python functions when they differ, so another CuPy version only costs speed.
    """
    try:
        import cupy_backends.cuda.stream as stream_module
        return (cupy.cuda.device.__pyx_capi__["get_device_id"],
                stream_module.__pyx_capi__["get_stream_ptr"])
    except (ImportError, AttributeError, KeyError):
        return None


def _check_default_backend():
    choice = _defaults.get_default_backend()
    if isinstance(choice, str) and choice != "cuda":
        raise NoCudaDriverError(
            f"pyalloc.cupy: the default backend is {choice!r}; CuPy needs the GPU "
            "(pyalloc.set_default_backend(None) or 'cuda')")
    if choice is None or choice == "cuda":
        from pyalloc import cuda_backend
        if not cuda_backend.is_available():
            raise NoCudaDriverError(f"pyalloc.cupy needs a GPU: {cuda_backend.unavailable_reason()}")


def install(device=None, detect_capture="route", pinned=False):
    """Make pyalloc CuPy's allocator for the whole process (cupy.cuda.set_allocator).

    device: None routes every device through pyalloc; an ordinal routes only that device and
    leaves the others to the allocator CuPy had before. Installing again replaces the previous
    install (keeping the allocator from before the first one for uninstall).
    detect_capture: see allocator().
    pinned: also make pyalloc's process-wide host allocator CuPy's pinned memory allocator
    (cupy.cuda.set_pinned_memory_allocator: cupyx.empty_pinned, cupy.cuda.alloc_pinned_memory);
    default False, CuPy's PinnedMemoryPool stays.
    Raises NoCudaDriverError when there is no GPU (or the default backend is not the GPU).
    """
    global _installed, _pinned_installed
    cupy = _import_cupy()
    _check_default_backend()
    with _lock:
        previous = _installed[1] if _installed is not None else cupy.cuda.get_allocator()
        fn = allocator(device, previous if device is not None else None, detect_capture=detect_capture)
        if pinned:
            pinned_fn = pinned_allocator()
            cupy.cuda.set_pinned_memory_allocator(pinned_fn)
            _pinned_installed = pinned_fn
        cupy.cuda.set_allocator(fn)
        _installed = (fn, previous)


class PinnedBlock:
    """A block of pyalloc's host allocator as CuPy's PinnedMemoryPointer holds its memory (.ptr,
    .size in bytes): the block goes back to the allocator when CuPy drops the last reference."""
    __slots__ = ("ptr", "size", "_host")

    def __init__(self, host, size):
        self._host = host
        self.size = size
        self.ptr = host.malloc(size)

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            self._host.free(ptr)


def pinned_allocator(host=None):
    """A function(size) -> cupy.cuda.PinnedMemoryPointer over pyalloc's host allocator `host`
    (default: the process-wide one, pyalloc.host.get_host_allocator()), for
    cupy.cuda.set_pinned_memory_allocator."""
    cupy = _import_cupy()
    if host is None:
        from pyalloc.host import get_host_allocator
        host = get_host_allocator()
    pointer = cupy.cuda.PinnedMemoryPointer

    def alloc_pinned(size):
        return pointer(PinnedBlock(host, size), 0)
    return alloc_pinned


def uninstall():
    """Give CuPy back the allocator it had before install(). Returns True if pyalloc was installed.

    Memory already handed out stays valid and returns to pyalloc when CuPy drops it. If something
    replaced pyalloc as CuPy's allocator after install(), that replacement is left in place.
    """
    global _installed, _pinned_installed
    cupy = _import_cupy()
    with _lock:
        if _installed is None:
            return False
        fn, previous = _installed
        _installed = None
        if _pinned_installed is not None:
            # CuPy offers no getter: its own pool comes back (what it had before install).
            cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
            _pinned_installed = None
        if cupy.cuda.get_allocator() is fn:
            cupy.cuda.set_allocator(previous)
        return True


def is_installed():
    """True between install() and uninstall()."""
    return _installed is not None


@contextlib.contextmanager
def using(device=None, detect_capture="route"):
    """Within the block, this thread's CuPy allocations go through pyalloc
    (cupy.cuda.using_allocator: thread-local, nestable; the previous allocator comes back after).

    device: as for install(). Yields the allocator function.
    """
    cupy = _import_cupy()
    _check_default_backend()
    fn = allocator(device, cupy.cuda.get_allocator() if device is not None else None,
                   detect_capture=detect_capture)
    with cupy.cuda.using_allocator(fn):
        yield fn


def use_mem_pool(pool):
    """Context manager: CuPy allocations made by this thread inside the block go to `pool`, a
    pyalloc.MemPool of one of pyalloc's default allocators (the ones CuPy uses once install()ed).

    RuntimeError when pyalloc is not CuPy's allocator (install() or using() first).
    """
    from pyalloc import defaults, pools
    if not _is_cupys_allocator(_import_cupy()):
        raise RuntimeError("pyalloc is not CuPy's allocator: call pyalloc.cupy.install() (or use "
                           "pyalloc.cupy.using()) before pyalloc.cupy.use_mem_pool")
    if not isinstance(pool, pools.MemPool) or defaults.default_allocators().get(pool.allocator.device) is not pool.allocator:
        raise ValueError(f"{pool!r} is not a MemPool of pyalloc's default allocators "
                         "(make it with pyalloc.MemPool(device))")
    return pools.use_mem_pool(pool)


class _CupyCapture:
    """Capture through CuPy's own Stream.begin_capture / end_capture (the graph is CuPy's Graph),
    with the capture stream made CuPy's current stream for the duration."""

    def __init__(self, cupy, stream):
        self.cupy = cupy
        self.stream = stream

    def begin(self, mode):
        runtime = self.cupy.cuda.runtime
        modes = {"global": "streamCaptureModeGlobal", "thread_local": "streamCaptureModeThreadLocal",
                 "relaxed": "streamCaptureModeRelaxed"}
        self.stream.__enter__()
        try:
            self.stream.begin_capture(mode=getattr(runtime, modes[mode]))
        except BaseException:
            self.stream.__exit__(None, None, None)
            raise

    def end(self):
        try:
            return self.stream.end_capture()
        finally:
            self.stream.__exit__(None, None, None)

    def launch(self, graph, stream):
        graph.launch(self.cupy.cuda.ExternalStream(stream) if stream != self.stream.ptr else self.stream)

    def destroy(self, graph):
        pass          # CuPy's Graph destroys its CUDA graph when it is collected


def graph(stream=None, pool=None, capture_error_mode="global"):
    """Capture CuPy work into a CUDA graph whose memory comes from a private pool of pyalloc's
    default allocator for CuPy's current device (pyalloc.graphs.Graph; as torch.cuda.graph).

        with pyalloc.cupy.graph() as g:      # a new non-blocking stream, made current inside
            y = x * 2                         # allocations in the capture go to g's pool
        g.launch()                            # replay; g.graph is CuPy's Graph

    Arrays made after the capture never share memory with the graph's, so replays cannot
    overwrite them. Keep `g` alive while the graph is replayed: it holds the pool. `pool` shares
    another graph's pool (g.pool(), graph_pool_handle() or a MemPool). Needs install() first.
    """
    from pyalloc import defaults
    from pyalloc.graphs import Graph
    cupy = _import_cupy()
    if not _is_cupys_allocator(cupy):
        raise RuntimeError("pyalloc is not CuPy's allocator: call pyalloc.cupy.install() (or use "
                           "pyalloc.cupy.using()) before pyalloc.cupy.graph")
    if stream is None:
        stream = cupy.cuda.Stream(non_blocking=True)
    alloc = defaults.get_allocator(cupy.cuda.Device().id)
    return Graph(alloc, stream.ptr, pool=pool, capture_error_mode=capture_error_mode,
                 capture=_CupyCapture(cupy, stream))


def _is_cupys_allocator(cupy):
    """Whether CuPy's allocator for this thread now is one of pyalloc's."""
    return isinstance(cupy.cuda.get_allocator(), FrameworkMalloc)
