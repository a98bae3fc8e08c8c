"""cuda.core on pyalloc: a cuda.core MemoryResource whose Buffers are blocks of pyalloc's default
allocators (the ones CuPy, Numba and PyTorch use through pyalloc's other hooks).

    from cuda.core import Device
    import pyalloc.cuda_core
    dev = Device(0); dev.set_current(); s = dev.create_stream()
    mr = pyalloc.cuda_core.PyallocMemoryResource(0)      # device_id=None: the current device
    buf = mr.allocate(1 << 20, stream=s)                  # a cuda.core Buffer over pyalloc memory
    buf.close()                                           # or drop it: back into pyalloc's cache

- allocate(size, stream=None): a block of the device's default allocator for `stream` (a
  cuda.core Stream, or another object cuda.core accepts as one; None: cuda.core's default stream,
  which needs a current context), wrapped as Buffer.from_handle(ptr, size, mr=self), with `stream`
  as the Buffer's deallocation stream where this cuda.core records one (cuda.core 0.5 and later).
  When cuda.core refuses the Buffer, the block goes back and the error propagates. A GraphBuilder
  is refused (NotImplementedError): memory handed out inside a capture must stay reserved for the
  graph's replays; capture with pyalloc's graph pools.
- deallocate(ptr, size, stream=None): cuda.core calls it when the Buffer is closed or collected.
  The block goes back to pyalloc's cache, ordered on its allocation stream; when `stream` is
  another stream (Buffer.close(stream) or set_deallocation_stream), the block is also recorded on
  that stream (pyalloc's record_stream), so that it is not reused before that stream's work up to
  the free has completed, which is what a free "on stream" promises.
- is_device_accessible True, is_host_accessible False, is_managed False, device_id the ordinal.
- Out of memory: pyalloc.OutOfMemoryError (a MemoryError), with its figures.

cuda.core's import path changed over its versions: `cuda.core` (its MemoryResource there) is
used, else `cuda.core.experimental`. Importing this module does not import cuda.core; the class
attribute does (ImportError naming cuda-core when it is absent).
"""
import inspect
import threading

from pyalloc import _streams
from pyalloc import defaults as _defaults
from pyalloc.errors import NoCudaDriverError

__all__ = ["PyallocMemoryResource", "import_cuda_core"]

_build_lock = threading.Lock()


def import_cuda_core():
    """The cuda.core module that has MemoryResource and Buffer: `cuda.core` (0.5 and later) or
    `cuda.core.experimental` (earlier). ImportError when neither imports."""
    errors = []
    for name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = __import__(name, fromlist=["MemoryResource"])
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(module, "MemoryResource") and hasattr(module, "Buffer"):
            return module
        errors.append(f"{name} has no MemoryResource")
    raise ImportError("pyalloc.cuda_core needs cuda.core (pip install cuda-core): " + "; ".join(errors))


def __getattr__(name):
    # The resource must subclass cuda.core's MemoryResource, so it is built on first access.
    if name == "PyallocMemoryResource":
        with _build_lock:
            if name not in globals():
                globals()[name] = _build()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _from_handle_takes_stream(core):
    """Whether Buffer.from_handle records a deallocation stream (a keyword-only `stream`)."""
    try:
        return "stream" in inspect.signature(core.Buffer.from_handle).parameters
    except (TypeError, ValueError):
        return not core.__name__.endswith(".experimental")


def _build():
    core = import_cuda_core()
    from_handle = core.Buffer.from_handle
    takes_stream = _from_handle_takes_stream(core)
    stream_handle = _streams.stream_handle
    fold_from = _streams.CU_STREAM_LEGACY
    registry = _defaults

    class PyallocMemoryResource(core.MemoryResource):
        """A cuda.core MemoryResource over the pyalloc default allocator of one device; see the
        module docstring. device_id: an ordinal, None for the current device."""

        _from_handle = staticmethod(from_handle)     # cuda.core's Buffer.from_handle

        def __init__(self, device_id=None):
            if device_id is None:
                device_id = registry.current_device()
            registry._check_device(device_id)
            self._device_id = device_id
            # Allocation stream of each live block, by address: deallocate records the block on
            # its deallocation stream only when that is another stream.
            self._streams = {}
            self._allocator()                     # fails now, not at the first allocate

        def _allocator(self):
            """This device's default allocator; refuses one that is not on the GPU."""
            alloc = registry.get_allocator(self._device_id)
            if alloc.backend.kind != "cuda":
                raise NoCudaDriverError(
                    f"pyalloc.cuda_core: the default allocator of device {alloc.device} uses the "
                    f"{alloc.backend.kind!r} backend, not 'cuda'; cuda.core needs GPU memory "
                    "(pyalloc.set_default_backend(None) or 'cuda')")
            return alloc

        def allocate(self, size, stream=None):
            """A Buffer of `size` bytes for `stream` (see the module docstring)."""
            if type(stream).__name__ == "GraphBuilder":
                raise NotImplementedError(
                    "pyalloc.cuda_core does not allocate for a GraphBuilder (memory handed out in a "
                    "capture must stay reserved for the graph's replays): capture with pyalloc's "
                    "graph pools (CachingAllocator.graph) or use cuda.core's GraphMemoryResource")
            handle = stream_handle(stream)
            alloc = registry._allocators.get(self._device_id)
            if alloc is None:
                alloc = self._allocator()
            if handle == fold_from:
                handle = _streams.fold_legacy(handle, alloc.backend)
            ptr = alloc.malloc(size, handle)
            self._streams[ptr] = handle
            try:
                if takes_stream and stream is not None:
                    return self._from_handle(ptr, size, mr=self, stream=stream)
                return self._from_handle(ptr, size, mr=self)
            except BaseException:
                # No Buffer owns the block: give it back, so that a refused call changes nothing
                # (unless cuda.core already did, through deallocate, while failing).
                if self._streams.pop(ptr, None) is not None:
                    alloc.free(ptr)
                raise

        def deallocate(self, ptr, size, stream=None):
            """Return a Buffer's block to pyalloc (see the module docstring)."""
            ptr = int(ptr)
            if ptr == 0:
                return
            alloc = registry._allocators.get(self._device_id)
            if alloc is None:
                alloc = self._allocator()
            allocated_on = self._streams.get(ptr)
            if allocated_on is None:
                raise ValueError(f"pointer {ptr:#x} ({size} bytes) is not a live allocation of "
                                 f"{self!r}: allocated elsewhere or already freed")
            if stream is not None:
                freed_on = stream_handle(stream)
                if freed_on == fold_from:
                    freed_on = _streams.fold_legacy(freed_on, alloc.backend)
                if freed_on != allocated_on:
                    alloc.record_stream(ptr, freed_on)
            del self._streams[ptr]
            alloc.free(ptr)

        @property
        def is_device_accessible(self):
            return True

        @property
        def is_host_accessible(self):
            return False

        @property
        def is_managed(self):
            return False

        @property
        def device_id(self):
            return self._device_id

        def __repr__(self):
            return f"PyallocMemoryResource(device_id={self._device_id})"

    PyallocMemoryResource.__module__ = __name__
    PyallocMemoryResource.__qualname__ = "PyallocMemoryResource"
    return PyallocMemoryResource
