"""Numba on pyalloc: an External Memory Management (EMM) plugin, so that Numba's device arrays come
from pyalloc's default allocators (the ones CuPy, PyTorch and cuda.core use through pyalloc's
other hooks).

    import pyalloc.numba
    pyalloc.numba.install()          # = numba.cuda.set_memory_manager(pyalloc.numba.PyallocMemoryManager)
    # or, without a code change:      NUMBA_CUDA_MEMORY_MANAGER=pyalloc.numba python app.py

Either must happen before Numba's first use of the GPU: Numba picks its memory manager when it
creates a device's context, and keeps it (install() raises RuntimeError when a context exists).

What the plugin does (EMM interface version 1; mapped and write-combined host memory and mempin,
which registers the caller's memory and has nothing to cache, stay with Numba's
HostOnlyCUDAMemoryManager base):

- memalloc(size): a block of the default allocator of the context's device, for Numba's default
  stream (handle 0) or the stream set by `with pyalloc.numba.allocation_stream(s):` on this thread.
  EMM v1 passes no stream to memalloc, so device_array(..., stream=s) alone allocates for stream 0.
  The memory is freed, back into pyalloc's cache and ordered on its allocation stream, when the
  last array or view over it is dropped (Numba's own reference counting, as for its own memory).
  Memory used on another stream: pyalloc.record_stream(array, stream) (any Numba device array),
  so that it is not reused before that stream's work up to the free has completed.
- memhostalloc(size) (cuda.pinned_array, cuda.pinned): a block of pyalloc's process-wide pinned
  host allocator (pyalloc.host: PyTorch's caching rules and statistics), back in its cache when
  Numba drops the memory; with mapped=True or wc=True, Numba's own cuMemHostAlloc.
- Out of memory: after flushing deferred frees and one gc.collect() and retry, an error that is
  both pyalloc.OutOfMemoryError and Numba's CudaAPIError with code CUDA_ERROR_OUT_OF_MEMORY.
- defer_cleanup(): frees inside the block (numba.cuda.defer_cleanup()) are held and done when the
  outermost block exits. Outside it frees are immediate: a free into pyalloc's cache is cheap and
  stream-ordered, where Numba's own cuMemFree synchronises the device and is therefore batched.
- reset() (Numba calls it when a context is reset, e.g. cuda.current_context().reset() or
  cuda.close()): frees every allocation made through this context, as Numba's own reset does (arrays
  still holding them must not be used afterwards), then empty_cache() of the device's allocator.
  cuda.close() goes on to reset the device's primary context (cuDevicePrimaryCtxReset), which
  destroys every allocation on the device, whatever framework made it.
- get_memory_info(): (free, total) with free = the device's free memory plus pyalloc's cached,
  unallocated bytes on it (memory a Numba allocation can get); total = the device's memory.
- get_ipc_handle(): Numba's own (GetIpcHandleMixin): the handle names the pyalloc segment, with
  the block's offset in it. NotImplementedError for blocks in expandable segments.

Importing this module does not import Numba; install() and the class attributes do (ImportError
naming numba-cuda when it is absent).
"""
import contextlib
import functools
import gc
import threading
import weakref

from pyalloc import _streams
from pyalloc import defaults as _defaults
from pyalloc._buffer import Buffer
from pyalloc.errors import NoCudaDriverError, OutOfMemoryError, framework_out_of_memory_error

__all__ = ["install", "is_installed", "allocation_stream", "PyallocMemoryManager",
           "NumbaOutOfMemoryError"]

_LAZY = ("PyallocMemoryManager", "NumbaOutOfMemoryError", "_numba_memory_manager")
_build_lock = threading.Lock()
_local = threading.local()          # .stream: the allocation stream set by allocation_stream()


def _import_numba_driver():
    try:
        from numba.cuda.cudadrv import driver
    except ImportError as exc:
        raise ImportError(f"pyalloc.numba needs Numba's CUDA target (pip install numba numba-cuda): "
                          f"{exc}") from exc
    return driver


def __getattr__(name):
    # The plugin class must subclass Numba's HostOnlyCUDAMemoryManager, so it is built on first
    # access (importing Numba then), not at import: `import pyalloc.numba` works without Numba.
    if name in _LAZY:
        with _build_lock:
            if name not in globals():
                globals().update(_build())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------ streams

@contextlib.contextmanager
def allocation_stream(stream):
    """Within the block, Numba device memory allocated by this thread is allocated for `stream`
    (a Numba stream, or any stream pyalloc accepts), so that its free is ordered on that stream.

    Nestable; the previous stream (by default Numba's default stream, handle 0) comes back after.
    """
    handle = _streams.stream_handle(stream)    # folded into 0 at allocation if it is the legacy stream
    previous = getattr(_local, "stream", 0)
    _local.stream = handle
    try:
        yield handle
    finally:
        _local.stream = previous


# ------------------------------------------------------------------------------ install

def install():
    """Make pyalloc Numba's memory manager (numba.cuda.set_memory_manager(PyallocMemoryManager)).

    Call before Numba's first use of the GPU. Raises RuntimeError, changing nothing, when Numba has
    already created a context with another memory manager (it keeps that one for the process);
    ImportError without Numba. Installing twice is harmless.
    """
    driver = _import_numba_driver()
    from numba import cuda
    manager = __getattr__("PyallocMemoryManager")
    for dev in list(getattr(driver.driver, "devices", {}).values()):
        ctx = getattr(dev, "primary_context", None)
        if ctx is not None and not isinstance(getattr(ctx, "memory_manager", None), manager):
            raise RuntimeError(
                f"Numba already created a CUDA context for device {dev.id} with its own memory "
                f"manager ({type(ctx.memory_manager).__name__}) and keeps it: call "
                "pyalloc.numba.install() (or set NUMBA_CUDA_MEMORY_MANAGER=pyalloc.numba) before "
                "Numba's first use of the GPU")
    cuda.set_memory_manager(manager)


def is_installed():
    """True when Numba's chosen memory manager is pyalloc's (after install(), or once Numba has
    read NUMBA_CUDA_MEMORY_MANAGER=pyalloc.numba when creating its first context)."""
    try:
        driver = _import_numba_driver()
    except ImportError:
        return False
    manager = globals().get("PyallocMemoryManager")
    return manager is not None and getattr(driver, "_memory_manager", None) is manager


# ------------------------------------------------------------------------------ the plugin

def _numba_bindings(driver):
    """(device pointer type, out-of-memory code) of the binding this Numba uses: cuda-python's
    CUdeviceptr and CUresult (every numba-cuda since 0.21, and older ones by default), or ctypes
    (older Numba with NUMBA_CUDA_USE_NVIDIA_BINDING=0)."""
    if getattr(driver, "USE_NV_BINDING", True):
        binding = driver.binding
        return binding.CUdeviceptr, binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    from numba.cuda.cudadrv import drvapi, enums
    return drvapi.cu_device_ptr, enums.CUDA_ERROR_OUT_OF_MEMORY


def _oom_class():
    """NumbaOutOfMemoryError (how its pickles find it: the class is made on first use)."""
    return __getattr__("NumbaOutOfMemoryError")


class _ManagerMethods:
    """The EMM plugin's methods but memalloc and the frees behind it (see _manager_class): they
    reach Numba only through the plugin class's `_driver` (numba.cuda.cudadrv.driver) and
    `_size_not_set` (its _SizeNotSet), so they are defined once, here, without importing Numba.
    The plugin class puts this first among its bases, so that `super()` here reaches Numba's
    HostOnlyCUDAMemoryManager."""

    # -------------------------------------------------------------- allocator

    def _allocator(self):
        """The default allocator of this context's device; refuses one that is not on the GPU."""
        return _defaults.check_gpu_backend(_defaults.get_allocator(self._device),
                                           "pyalloc.numba", "Numba")

    def initialize(self):
        alloc = self._allocator()
        # As Numba's own manager does: its pending host deallocations flush at a share of
        # the device's memory, which is unknown until now.
        if self.deallocations.memory_capacity == self._size_not_set:
            self.deallocations.memory_capacity = alloc.backend.mem_get_info()[1]

    @contextlib.contextmanager
    def defer_cleanup(self):
        # Host allocations are deferred by the base class; device frees here.
        with super().defer_cleanup():
            with self._lock:
                self._deferring += 1
            try:
                yield
            finally:
                with self._lock:
                    self._deferring -= 1
                    held = self._take_deferred() if self._deferring == 0 else []
                _close_all(held)

    def _take_deferred(self):
        held, self._deferred = self._deferred, []
        return held

    def reset(self):
        # Dropping the strong references frees every allocation of this context through its
        # finalizer (the base class's reset), as Numba's own manager does.
        super().reset()
        with self._lock:
            held = self._take_deferred() if self._deferring == 0 else []
        _close_all(held)
        alloc = _defaults._allocators.get(self._device)
        if alloc is not None:
            alloc.empty_cache()

    # -------------------------------------------------------------- pinned host memory

    def _host_allocator(self):
        """pyalloc's process-wide host allocator; refuses one that is not on the GPU."""
        from pyalloc.host import get_host_allocator
        host = get_host_allocator()
        if host.device.kind != "cuda":
            raise NoCudaDriverError(
                f"pyalloc.numba: the host allocator uses the {host.device.kind!r} backend, "
                "not 'cuda'; Numba needs pinned memory of the GPU's driver")
        return host

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        # Mapped and write-combined memory need cuMemHostAlloc flags that pyalloc's cached
        # blocks do not have: those stay Numba's. `portable` needs nothing: under unified
        # addressing every context can use pinned memory whatever its flags.
        if mapped or wc:
            return super().memhostalloc(size, mapped=mapped, portable=portable, wc=wc)
        host = self._host_allocator()
        ptr = host.malloc(size)
        return self._driver.PinnedMemory(self._context_ref, ptr, size,
                                         finalizer=functools.partial(host.free, ptr) if ptr else None)

    # -------------------------------------------------------------- queries

    def get_memory_info(self):
        alloc = self._allocator()
        free, total = alloc.backend.mem_get_info()
        cached = alloc.memory_reserved() - alloc.memory_allocated()
        return self._driver.MemoryInfo(free=free + cached, total=total)

    def get_ipc_handle(self, memory):
        alloc = self._allocator()
        ptr = _pointer_value(memory)
        for seg in alloc._segments():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                if seg["is_expandable"]:
                    raise NotImplementedError(
                        f"pyalloc.numba: no IPC handle for {ptr:#x}, a block of an expandable "
                        "segment (cuIpcGetMemHandle cannot export mapped virtual memory); "
                        "allocate it without expandable_segments:True")
                break
        return super().get_ipc_handle(memory)

    @property
    def interface_version(self):
        return 1


def _oom_error_class(driver, oom_code):
    """NumbaOutOfMemoryError: a pyalloc.OutOfMemoryError that is also Numba's CudaAPIError with
    code `oom_code` (CUDA_ERROR_OUT_OF_MEMORY of the binding Numba uses)."""
    def numba_figures(err, message):
        # CudaAPIError's own attributes, read by code written for Numba's error.
        err.code = oom_code
        err.msg = message

    return framework_out_of_memory_error(
        driver.CudaAPIError, __name__, "NumbaOutOfMemoryError",
        "Out of memory in a Numba allocation served by pyalloc: a pyalloc.OutOfMemoryError (figures "
        "in bytes) and a Numba CudaAPIError whose .code is CUDA_ERROR_OUT_OF_MEMORY, so code "
        "catching either keeps working.", _oom_class, numba_figures)


def _manager_class(driver, device_pointer, NumbaOutOfMemoryError):
    """PyallocMemoryManager over Numba's `driver` module. memalloc and the frees it sets up are
    defined here, over local names (Numba's pointer classes, dict's own __setitem__), because
    they run on every Numba allocation; the other methods are _ManagerMethods'."""
    AutoFreePointer = driver.AutoFreePointer
    MemoryPointer = driver.MemoryPointer
    registry = _defaults
    dict_setitem = dict.__setitem__

    class PyallocMemoryManager(_ManagerMethods, driver.GetIpcHandleMixin,
                               driver.HostOnlyCUDAMemoryManager):
        """Numba EMM plugin (interface version 1) over pyalloc's default allocators; see the
        module docstring. Numba makes one per context (and one with context=None to check the
        interface version)."""

        _driver = driver
        _size_not_set = getattr(driver, "_SizeNotSet", 0)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ctx = self.context
            self._device = None if ctx is None else int(ctx.device.id)
            self._context_ref = None if ctx is None else weakref.proxy(ctx)
            self._lock = threading.Lock()
            self._deferring = 0           # depth of defer_cleanup() blocks now open
            self._deferred = []           # Buffers whose free waits for the outermost block's end

        def memalloc(self, size):
            alloc = registry._allocators.get(self._device)
            if alloc is None:
                alloc = self._allocator()
            stream = getattr(_local, "stream", 0)
            if stream == _streams.CU_STREAM_LEGACY:
                stream = _streams.fold_legacy(stream, alloc.backend)
            try:
                buf = Buffer(alloc, size, stream)
            except OutOfMemoryError:
                buf = self._allocate_after_oom(alloc, size, stream)
            ptr = buf.ptr
            if ptr == 0:
                # 0 bytes: a null pointer that owns nothing (Numba's own arrays of size 0 do this).
                return MemoryPointer(self._context_ref, device_pointer(0), 0)
            mem = AutoFreePointer(self._context_ref, device_pointer(ptr), size,
                                  finalizer=functools.partial(self._release, ptr, buf))
            # Numba's ownership model: `allocations` holds the one strong reference, the arrays
            # hold counted references (own(), views), and the last one dropped frees the memory.
            # (dict's own __setitem__: UniqueDict's Python-level duplicate check costs ~0.2 us, and
            # pyalloc never hands out a live address twice.)
            dict_setitem(self.allocations, ptr, mem)
            return mem.own()

        def _allocate_after_oom(self, alloc, size, stream):
            # What Numba's own allocator does on out of memory (flush its pending frees, retry),
            # plus a collection, since arrays in reference cycles hold memory until collected.
            self.deallocations.clear()
            gc.collect()
            try:
                return Buffer(alloc, size, stream)
            except OutOfMemoryError as exc:
                raise NumbaOutOfMemoryError.from_error(exc) from None

        def _release(self, ptr, buf):
            """The finalizer of an allocation: its last reference is gone (or reset() dropped it)."""
            allocations = self.allocations
            if allocations:
                allocations.pop(ptr, None)
            if self._deferring:
                with self._lock:
                    if self._deferring:
                        self._deferred.append(buf)
                        return
            buf.close()

    PyallocMemoryManager.__module__ = __name__
    PyallocMemoryManager.__qualname__ = "PyallocMemoryManager"
    return PyallocMemoryManager


def _build():
    driver = _import_numba_driver()
    device_pointer, oom_code = _numba_bindings(driver)
    NumbaOutOfMemoryError = _oom_error_class(driver, oom_code)
    PyallocMemoryManager = _manager_class(driver, device_pointer, NumbaOutOfMemoryError)
    return {"PyallocMemoryManager": PyallocMemoryManager,
            "NumbaOutOfMemoryError": NumbaOutOfMemoryError,
            # NUMBA_CUDA_MEMORY_MANAGER=pyalloc.numba: Numba imports this module and reads this.
            "_numba_memory_manager": PyallocMemoryManager}


def _pointer_value(memory):
    """The device address of a Numba MemoryPointer or OwnedPointer, as an int."""
    value = getattr(memory, "device_pointer_value", None)
    if value is None:
        handle = memory.device_ctypes_pointer
        value = getattr(handle, "value", handle)
    return int(value or 0)


def _close_all(buffers):
    """Free every Buffer; the first error (if any) is raised after all were tried."""
    first = None
    for buf in buffers:
        try:
            buf.close()
        except Exception as exc:      # noqa: BLE001 - re-raised below, after the others are freed
            if first is None:
                first = exc
    if first is not None:
        raise first
