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
- Streams: the allocator keeps an allocation stream's object alive while blocks of its stream
  may be cached (and lets go of it once the program has dropped it and its work is done), so
  that the driver cannot give its handle, with those blocks, to a new stream while old work may
  use them. Keeping the object cannot stop `Stream.close()`: a stream closed while its work may
  still use blocks cached for it can pass that memory to the next new stream of its handle.
  Synchronize a stream (or call pyalloc.empty_cache()) before closing it explicitly.

cuda.core's import path changed over its versions: `cuda.core` (its MemoryResource there) is
used, else `cuda.core.experimental`. Importing this module does not import cuda.core; the class
attribute does (ImportError naming cuda-core when it is absent).
"""
import inspect
import threading

from pyalloc import _hooks, _streams
from pyalloc import defaults as _defaults

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
            # The allocation stream of each live block (deallocate records the block on its
            # deallocation stream only when that is another stream), the stream memo, and
            # cuda.core's Buffer.from_handle.
            self._state = _hooks.CoreResourceState(device_id, registry, self._from_handle,
                                                   takes_stream, _streams.LEGACY_IS_STREAM_ZERO)
            self._allocator()                     # fails now, not at the first allocate

        def _allocator(self):
            """This device's default allocator; refuses one that is not on the GPU."""
            return registry.check_gpu_backend(registry.get_allocator(self._device_id),
                                              "pyalloc.cuda_core", "cuda.core")

        def _stream_handle(self, stream, alloc):
            """The allocator's key for `stream` (not None): its handle, CU_STREAM_LEGACY folded
            into 0 (pyalloc._streams)."""
            handle = stream_handle(stream)
            if handle == fold_from:
                handle = _streams.fold_legacy(handle, alloc.backend)
            return handle

        def _handle_of(self, stream, alloc):
            """The allocator's key for the allocation stream `stream` (not None, no
            GraphBuilder), remembered for the next allocate (the memo: a program allocates on a
            few streams over and over, and working a handle out of a stream object costs more
            than the rest of a call; the memo holds one stream object).

            A stream object other than the default stream is kept alive by the allocator while
            it holds blocks of that stream (hold_stream): cuda.core destroys a Stream when it is
            closed or collected, and the driver gives its handle to the next new stream, which
            would otherwise be handed blocks the old stream's work may still use. The stream
            this call replaces in the memo is registered too, since allocations made through the
            memo skipped the registration."""
            handle = self._stream_handle(stream, alloc)
            state = self._state
            for obj, h in ((state.last_stream, state.last_handle), (stream, handle)):
                if h != 0 and obj is not None and type(obj) is not int:
                    alloc.hold_stream(h, obj)
            state.last_stream, state.last_handle = stream, handle
            return handle

        # Cython (pyalloc/_hooks.pyx): they run once per Buffer.
        allocate = _hooks.core_allocate
        deallocate = _hooks.core_deallocate

        @property
        def _streams(self):
            """{address: allocation stream handle} of the live blocks this resource handed out."""
            return self._state.streams

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
