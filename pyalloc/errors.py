"""Exceptions raised by pyalloc, and the byte formatting used in their messages."""


def format_bytes(nbytes):
    """Bytes as PyTorch prints them in OOM messages: two decimals, B / KiB / MiB / GiB."""
    nbytes = int(nbytes)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class OutOfMemoryError(MemoryError):
    """The device (or the configured memory fraction) cannot provide the requested memory.

    Attributes, in bytes (None where not known): requested (the caller's size), segment_size
    (what the allocator tried to get from the device), total, free (device figures when it
    failed), allocated (held by live allocations), reserved_unallocated (cached but not handed
    out), allowed (the memory-fraction cap, or None), and device (ordinal).
    """

    def __init__(self, message, *, requested=None, segment_size=None, device=None, total=None,
                 free=None, allocated=None, reserved_unallocated=None, allowed=None):
        super().__init__(message)
        self.requested = requested
        self.segment_size = segment_size
        self.device = device
        self.total = total
        self.free = free
        self.allocated = allocated
        self.reserved_unallocated = reserved_unallocated
        self.allowed = allowed


class CudaError(RuntimeError):
    """A CUDA driver call failed. Attributes: call (function name), result (CUresult int), name."""

    def __init__(self, call, result, name="", description=""):
        self.call = call
        self.result = int(result)
        self.name = name
        detail = f" ({description})" if description else ""
        super().__init__(f"{call} failed with {name or 'CUresult'} {self.result}{detail}")


class PointerError(ValueError):
    """A pointer given to free or record_stream is not a live allocation of the allocator.
    Attribute: ptr (the address, an int). A ValueError, as before these classes existed."""

    def __init__(self, message, ptr):
        super().__init__(message)
        self.ptr = ptr


class NotAllocatedError(PointerError):
    """The allocator never handed out `ptr` (or its segment is gone). Attribute allocation: the
    start of the live allocation `ptr` lies inside, or None."""

    def __init__(self, message, ptr, allocation=None):
        super().__init__(message, ptr)
        self.allocation = allocation


class AlreadyFreedError(PointerError):
    """`ptr` lies in memory this allocator handed out and that has been freed (a double free, or
    a use after free)."""


class OwnedByBufferError(PointerError):
    """`ptr` is the memory of a live pyalloc.Buffer, which alone frees it (close() or dropping
    it): a raw free would leave the Buffer to free whatever block sits at that address later."""


class NoCudaDriverError(RuntimeError):
    """The CUDA backend was asked for, but no driver or no GPU is available."""

    # Spelled out so that inspect.signature has one to show: a RuntimeError subclass without an
    # __init__ of its own has none (RuntimeError's is a C slot without a text signature).
    def __init__(self, message):
        super().__init__(message)


class ReuseError(RuntimeError):
    """The reuse sanitizer (SimDevice(check_reuse=True)) found a block handed out while work that
    may still use it is queued or captured and not ordered before the receiving stream's next
    work: the allocator would let two users touch the same memory at once.

    Attributes: ptr and nbytes (the block handed out, an address and a size in bytes), stream
    (the receiving stream's handle), use_stream (the stream of the pending use, or None for a
    captured use), operation (what queued the use, e.g. "launch #12 on stream 3")."""

    def __init__(self, message, *, ptr, nbytes, stream, use_stream, operation):
        super().__init__(message)
        self.ptr = ptr
        self.nbytes = nbytes
        self.stream = stream
        self.use_stream = use_stream
        self.operation = operation


# ------------------------------------------------------------------ frameworks' out-of-memory errors

# The figures an OutOfMemoryError carries (its keyword arguments), in bytes but for device.
OOM_FIGURES = ("requested", "segment_size", "device", "total", "free", "allocated",
               "reserved_unallocated", "allowed")


def oom_figures(exc):
    """The figures of `exc` as OutOfMemoryError's keyword arguments (None for any it lacks)."""
    return {name: getattr(exc, name, None) for name in OOM_FIGURES}


def _rebuild_framework_oom(get_class, message, figures):
    return get_class()(message, **figures)


def framework_out_of_memory_error(framework_error, module, name, doc, get_class, init_extra=None):
    """A class that is both OutOfMemoryError and `framework_error` (a framework's own
    out-of-memory exception), so that code catching either keeps working: the one recipe of
    pyalloc.cupy, pyalloc.torch and pyalloc.numba.

    The class is `module`.`name`, documented by `doc`. It takes (message, **figures) as
    OutOfMemoryError does and its str() is the message. Only MemoryError's __init__ runs, since
    neither base's fits the other's arguments (CuPy's takes (size, total, limit), Numba's
    CudaAPIError (code, msg) and prints "[code] msg"); init_extra(self, message), when given,
    then sets the framework's own attributes from the figures. Instances pickle with their
    figures through get_class, a module-level function returning the class: the class is made on
    first use (the framework's import comes late), so pickle cannot find it by name.
    from_error(exc) makes one from any OutOfMemoryError, with its message and figures.
    """
    def __init__(self, message, **figures):
        MemoryError.__init__(self, message)
        for figure in OOM_FIGURES:
            setattr(self, figure, figures.get(figure))
        if init_extra is not None:
            init_extra(self, message)

    def __reduce__(self):
        return (_rebuild_framework_oom, (get_class, str(self), oom_figures(self)))

    def from_error(cls, exc):
        return cls(str(exc), **oom_figures(exc))

    return type(name, (OutOfMemoryError, framework_error), {
        "__doc__": doc, "__module__": module, "__qualname__": name,
        "__init__": __init__, "__reduce__": __reduce__, "__str__": BaseException.__str__,
        "from_error": classmethod(from_error)})
