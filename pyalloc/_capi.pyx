# cython: language_level=3
"""C entry points: malloc, free and record_stream for C callers on any thread (pyalloc_capi.h).

PyTorch calls its allocator from the thread that runs the operator, from autograd's threads and
from data-loader threads, some holding the GIL and most not. The table's malloc, free and
record_stream are the fast half in pyalloc._core (entry_malloc and its siblings), which serves a
cache hit of a device's default allocator (pyalloc.get_allocator(device)) under its C lock alone.
This module is the slow half: anything else takes the GIL (PyGILState_Ensure, never while holding
the C lock: the lock's holder may need the GIL to finish) and runs the allocator's ordinary
Python-level methods, so new segments, out of memory, events, history and routes behave exactly
as for Python callers. Errors come back as codes; the exception itself is kept per thread for
Python to raise afterwards.

The table is published as the capsule `table` (name PYALLOC_CAPI_CAPSULE) and, for ctypes, as
table_address().
"""
from libc.stdint cimport uintptr_t, uint32_t
from libc.string cimport strncpy
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XINCREF, Py_XDECREF
from cpython.pycapsule cimport PyCapsule_New

from pyalloc._core cimport (entry_malloc, entry_free, entry_record_stream, set_entry_slow_paths,
                            entry_slot, set_entry_slot, PYALLOC_ENTRY_DEVICES)
from pyalloc.errors import OutOfMemoryError
from pyalloc import defaults as _defaults

cdef extern from "pyalloc_capi.h":
    ctypedef struct pyalloc_capi:
        uint32_t version
        uint32_t size
        int (*malloc)(int, size_t, uintptr_t, uintptr_t*) noexcept nogil
        int (*free)(int, uintptr_t) noexcept nogil
        int (*record_stream)(int, uintptr_t, uintptr_t) noexcept nogil
        int (*error_code)() noexcept nogil
        const char* (*error_message)() noexcept nogil
        void (*take_error)(void**, void**, void**) noexcept nogil
        void (*release_error)(void*, void*, void*) noexcept nogil
        int (*raise_error)() noexcept
        int (*empty_cache)(int) noexcept nogil
    const char* PYALLOC_CAPI_CAPSULE
    int PYALLOC_CAPI_VERSION
    int PYALLOC_OK, PYALLOC_EOOM, PYALLOC_EVALUE, PYALLOC_EOTHER

from cpython.exc cimport PyErr_Restore, PyErr_SetObject

# Each thread's last error.
cdef extern from *:
    """
    struct pyalloc_thread_error {
        int code = 0;
        PyObject* type = nullptr;        // owned references (touched with the GIL only)
        PyObject* value = nullptr;
        PyObject* traceback = nullptr;
        char message[1024] = {0};
    };
    static thread_local pyalloc_thread_error pyalloc_last_error;
    static inline pyalloc_thread_error* pyalloc_error_here() { return &pyalloc_last_error; }
    """
    ctypedef struct pyalloc_thread_error:
        int code
        PyObject* type
        PyObject* value
        PyObject* traceback
        char message[1024]
    pyalloc_thread_error* pyalloc_error_here() noexcept nogil


# Allocators the slots no longer point at (after set_default_backend): kept alive for good, since
# a C thread may still be inside a cache hit on one. They hold no live allocations (the change is
# refused while any do), so each costs its empty structures only.
cdef list _retired = []


# ------------------------------------------------------------------------------- slow paths (GIL)

# How many calls each entry point sent down the ordinary path (touched with the GIL only). A
# caller whose requests should be cache hits can check that they were (slow_path_calls()).
cdef Py_ssize_t slow_mallocs = 0, slow_frees = 0, slow_record_streams = 0


def slow_path_calls():
    """Calls of malloc, free and record_stream that the entry points could not serve without the
    GIL (a miss, an error, pending events, a route, history stacks) since the process began."""
    return {"malloc": slow_mallocs, "free": slow_frees, "record_stream": slow_record_streams}


cdef int malloc_slow(int device, size_t size, uintptr_t stream, uintptr_t* out) noexcept with gil:
    global slow_mallocs
    slow_mallocs += 1
    try:
        out[0] = allocator_for(device).malloc(size, stream)
        return PYALLOC_OK
    except BaseException as exc:
        return keep_error(exc)


cdef int free_slow(int device, uintptr_t ptr) noexcept with gil:
    global slow_frees
    slow_frees += 1
    try:
        allocator_for(device).free(ptr)
        return PYALLOC_OK
    except BaseException as exc:
        return keep_error(exc)


cdef int record_stream_slow(int device, uintptr_t ptr, uintptr_t stream) noexcept with gil:
    global slow_record_streams
    slow_record_streams += 1
    try:
        if device == -1:
            _defaults.record_stream(ptr, stream)
        else:
            allocator_for(device).record_stream(ptr, stream)
        return PYALLOC_OK
    except BaseException as exc:
        return keep_error(exc)


cdef int capi_empty_cache(int device) noexcept with gil:
    try:
        _defaults.empty_cache(None if device == -1 else device)
        return PYALLOC_OK
    except BaseException as exc:
        return keep_error(exc)


cdef object allocator_for(int device):
    """The default allocator of `device`, published in its slot for the cache-hit path."""
    if device < 0 or device >= PYALLOC_ENTRY_DEVICES:
        raise ValueError(f"device must be an ordinal in [0, {PYALLOC_ENTRY_DEVICES}), got {device}")
    alloc = _defaults.get_allocator(device)
    cdef PyObject* current = entry_slot(device)
    if current != <PyObject*>alloc:
        if current != NULL:
            _retired.append(<object>current)
            Py_XDECREF(current)             # the slot's reference; _retired holds one now
        Py_INCREF(alloc)
        set_entry_slot(device, <PyObject*>alloc)
    return alloc


def forget_allocators():
    """Empty the slots, so that the next call of each device looks its allocator up again.

    pyalloc.set_default_backend calls this when it drops the default allocators. The old ones are
    kept alive (a C thread may still be in a cache hit on one)."""
    cdef int d
    cdef PyObject* current
    for d in range(PYALLOC_ENTRY_DEVICES):
        current = entry_slot(d)
        if current != NULL:
            set_entry_slot(d, NULL)
            _retired.append(<object>current)
            Py_XDECREF(current)


def published_allocator(int device):
    """The allocator the entry points use for `device` now, or None before its first call."""
    if device < 0 or device >= PYALLOC_ENTRY_DEVICES:
        raise ValueError(f"device must be an ordinal in [0, {PYALLOC_ENTRY_DEVICES}), got {device}")
    cdef PyObject* current = entry_slot(device)
    return None if current == NULL else <object>current


# ------------------------------------------------------------------------------- per-thread errors

cdef void clear_error(pyalloc_thread_error* e) noexcept:
    cdef PyObject* t = e.type
    cdef PyObject* v = e.value
    cdef PyObject* tb = e.traceback
    e.type = e.value = e.traceback = NULL
    e.code = PYALLOC_OK
    e.message[0] = 0
    Py_XDECREF(t)
    Py_XDECREF(v)
    Py_XDECREF(tb)


cdef object _translator = None


def set_exception_translator(translator):
    """translator(exception) -> exception, applied to every exception kept for C callers (None:
    keep them as raised). pyalloc.torch sets one that makes out-of-memory errors torch's kind."""
    global _translator
    if translator is not None and not callable(translator):
        raise TypeError(f"translator must be callable or None, got {translator!r}")
    _translator = translator


cdef int keep_error(BaseException exc) noexcept:
    """Keep `exc` as this thread's last error (GIL held); returns its code."""
    cdef pyalloc_thread_error* e = pyalloc_error_here()
    cdef int code
    if _translator is not None:
        try:
            exc = _translator(exc)
        except BaseException as failure:
            exc.__context__ = failure      # keep the original, and say why it was not translated
    if isinstance(exc, MemoryError):
        code = PYALLOC_EOOM
    elif isinstance(exc, (ValueError, TypeError)):
        code = PYALLOC_EVALUE
    else:
        code = PYALLOC_EOTHER
    try:
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    except BaseException:
        text = type(exc).__name__.encode("utf-8", "replace")
    clear_error(e)
    e.code = code
    strncpy(e.message, text, sizeof(e.message) - 1)
    e.message[sizeof(e.message) - 1] = 0
    exc_type = type(exc)
    tb = exc.__traceback__
    e.type = <PyObject*>exc_type
    e.value = <PyObject*>exc
    e.traceback = <PyObject*>tb if tb is not None else NULL
    Py_XINCREF(e.type)
    Py_XINCREF(e.value)
    Py_XINCREF(e.traceback)
    return code


cdef int capi_error_code() noexcept nogil:
    return pyalloc_error_here().code


cdef const char* capi_error_message() noexcept nogil:
    return pyalloc_error_here().message


cdef void capi_take_error(void** type, void** value, void** traceback) noexcept with gil:
    cdef pyalloc_thread_error* e = pyalloc_error_here()
    type[0] = e.type
    value[0] = e.value
    traceback[0] = e.traceback
    e.type = e.value = e.traceback = NULL      # references handed over


cdef void capi_release_error(void* type, void* value, void* traceback) noexcept with gil:
    Py_XDECREF(<PyObject*>type)
    Py_XDECREF(<PyObject*>value)
    Py_XDECREF(<PyObject*>traceback)


cdef int capi_raise_error() noexcept:
    cdef pyalloc_thread_error* e = pyalloc_error_here()
    if e.type == NULL:
        message = e.message.decode("utf-8", "replace") if e.message[0] else "no error kept"
        PyErr_SetObject(RuntimeError, f"pyalloc C entry point: {message}")
        return -1
    PyErr_Restore(e.type, e.value, e.traceback)    # steals the thread's references
    e.type = e.value = e.traceback = NULL
    return -1


def last_error():
    """(code, message, exception or None) of the calling thread's last failed entry-point call.

    code: 0 none, 1 out of memory, 2 bad argument, 3 other. The exception stays kept."""
    cdef pyalloc_thread_error* e = pyalloc_error_here()
    exc = <object>e.value if e.value != NULL else None
    return e.code, e.message.decode("utf-8", "replace"), exc


def raise_last_error():
    """Raise the calling thread's last entry-point exception (for C callers' Python wrappers)."""
    capi_raise_error()
    raise_current()


cdef int raise_current() except -1:
    return -1       # Cython raises the exception capi_raise_error set


def clear_last_error():
    """Forget the calling thread's last entry-point error."""
    clear_error(pyalloc_error_here())


# ------------------------------------------------------------------------------- the table

cdef pyalloc_capi TABLE
TABLE.version = PYALLOC_CAPI_VERSION
TABLE.size = sizeof(pyalloc_capi)
TABLE.malloc = entry_malloc
TABLE.free = entry_free
TABLE.record_stream = entry_record_stream
TABLE.error_code = capi_error_code
TABLE.error_message = capi_error_message
TABLE.take_error = capi_take_error
TABLE.release_error = capi_release_error
TABLE.raise_error = capi_raise_error
TABLE.empty_cache = capi_empty_cache

set_entry_slow_paths(malloc_slow, free_slow, record_stream_slow)
table = PyCapsule_New(&TABLE, PYALLOC_CAPI_CAPSULE, NULL)
CAPSULE_NAME = PYALLOC_CAPI_CAPSULE.decode()
VERSION = PYALLOC_CAPI_VERSION
ERROR_CODES = {"ok": PYALLOC_OK, "out_of_memory": PYALLOC_EOOM, "bad_argument": PYALLOC_EVALUE,
               "other": PYALLOC_EOTHER}


def table_address():
    """The address of the C function table (a pyalloc_capi*, see pyalloc_capi.h), for ctypes."""
    return <uintptr_t>&TABLE


def entry_point_addresses():
    """{name: address} of the table's functions, for ctypes callers and tests."""
    return {"malloc": <uintptr_t>TABLE.malloc, "free": <uintptr_t>TABLE.free,
            "record_stream": <uintptr_t>TABLE.record_stream,
            "error_code": <uintptr_t>TABLE.error_code, "error_message": <uintptr_t>TABLE.error_message,
            "take_error": <uintptr_t>TABLE.take_error, "release_error": <uintptr_t>TABLE.release_error,
            "empty_cache": <uintptr_t>TABLE.empty_cache}
