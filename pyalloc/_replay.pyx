# cython: language_level=3
"""The replay loop of pyalloc.replay and `pyalloc tune`, and the one-pass trace scan before it.

Written in Cython because replay speed is what `pyalloc tune` is made of: the loop drives the
allocator through the C methods _core.pxd declares, with the allocator's lock held throughout.
"""
from libc.stdint cimport uintptr_t
from cpython.dict cimport PyDict_Next
from cpython.object cimport PyObject

from pyalloc._types cimport ActiveMap, Block
from pyalloc._backend cimport BACKEND_OOM
from pyalloc._core cimport DeviceCachingAllocator
from pyalloc._policy cimport kMaxRequest
from pyalloc._validate cimport exact_int_to_u64


# ------------------------------------------------------------------------------- trace scan

cdef tuple trace_key_objects(list entries):
    """The key strings ("action", "addr", "size", "stream") as the first entry's own objects:
    unpickled traces share one string object per key, and lookups with those very objects skip
    string comparisons."""
    k_action, k_addr, k_size, k_stream = "action", "addr", "size", "stream"
    if entries and type(entries[0]) is dict:
        for key in <dict>entries[0]:
            if key == "action": k_action = key
            elif key == "addr": k_addr = key
            elif key == "size": k_size = key
            elif key == "stream": k_stream = key
    return k_action, k_addr, k_size, k_stream


cdef inline bint leading_fields(dict d, object k_action, object k_addr, object k_size, object k_stream,
                                PyObject** out) noexcept:
    """Read action, addr, size, stream when they are d's first four keys, in that order (as in
    every trace PyTorch writes): four steps along the dict's entry table instead of four hashed
    lookups. Returns False for any other layout; the caller then looks the keys up."""
    cdef Py_ssize_t pos = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef PyObject* expected[4]
    expected[0] = <PyObject*>k_action
    expected[1] = <PyObject*>k_addr
    expected[2] = <PyObject*>k_size
    expected[3] = <PyObject*>k_stream
    for j in range(4):
        if not PyDict_Next(d, &pos, &key, &value) or key != expected[j]:
            return False
        out[j] = value
    return True


# What scan_trace does with an entry, by action.
cdef enum:
    SCAN_SKIP = 0            # oom, snapshot, anything else: not read by the replay
    SCAN_CHECK = 1           # alloc, free_requested, free_completed, segment_free, segment_unmap
    SCAN_SEGMENT_ALLOC = 2   # checked, and its (addr, size) collected
    SCAN_SEGMENT_MAP = 3     # checked, and its addr collected


cdef int scan_kind(object action) except -1:
    if action == "segment_alloc":
        return SCAN_SEGMENT_ALLOC
    if action == "segment_map":
        return SCAN_SEGMENT_MAP
    if (action == "alloc" or action == "free_requested" or action == "free_completed"
            or action == "segment_free" or action == "segment_unmap"):
        return SCAN_CHECK
    return SCAN_SKIP


cdef extern from "_pyint.h":
    # The same helper, on a borrowed pointer: the checks below then take no references.
    int borrowed_int_to_u64 "pyalloc::exact_int_to_u64"(PyObject* o, unsigned long long* out) noexcept
    bint PyLong_CheckExact(PyObject* o) noexcept


cdef inline bint trace_u64(PyObject* value) noexcept:
    """value is an exact int in [0, 2**64): the fast path of the field checks."""
    cdef unsigned long long x
    return PyLong_CheckExact(value) and borrowed_int_to_u64(value, &x) == 0


cdef inline bint trace_size(PyObject* value) noexcept:
    """value is an exact int in [0, 2**60) (kMaxRequest, the largest size the core handles)."""
    cdef unsigned long long x
    return (PyLong_CheckExact(value) and borrowed_int_to_u64(value, &x) == 0
            and x < <unsigned long long>kMaxRequest)


cdef int bad_trace_field(Py_ssize_t i, object action, str field, object value) except -1:
    """Accept an int subclass in range (returns 0), else raise the ValueError naming entry and field."""
    cdef unsigned long long x
    cdef bint size = field == "size"
    expected = "an int number of bytes in [0, 2**60)" if size else "an int in [0, 2**64)"
    if isinstance(value, int) and not isinstance(value, bool):
        if exact_int_to_u64(value, &x) == 0 and (not size or x < <unsigned long long>kMaxRequest):
            return 0
        raise ValueError(f"trace entry {i} ({action}): {field} {int(value)} is out of range, "
                         f"expected {expected}")
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    raise ValueError(f"trace entry {i} ({action}): {field} is {type(value).__name__} {text}, "
                     f"expected {expected}")


_NO_FIELD = object()              # d.get's default: tells a missing field from a None one


cdef int missing_trace_field(Py_ssize_t i, object action, str field) except -1:
    raise ValueError(f"trace entry {i} ({action}) has no {field!r}")


def scan_trace(list entries):
    """One pass over trace entries: ([(addr, size) of each segment_alloc], [addr of each segment_map]).

    The replay places new segments from the first list and expandable reservations from the second.
    The same pass checks what the replay reads: every entry is a dict with an "action"; alloc,
    free_requested, free_completed and segment_* entries have an int "addr" in [0, 2**64), an int
    "size" in [0, 2**60) and, when present, an int "stream" in [0, 2**64) (missing: stream 0, as
    the replay reads it). Anything else raises ValueError naming the entry index and the field.
    """
    cdef Py_ssize_t i, n = len(entries)
    cdef object entry
    cdef dict d
    cdef PyObject* fields[4]
    segment_allocs = []
    segment_maps = []
    k_action, k_addr, k_size, k_stream = trace_key_objects(entries)
    # Action names are shared string objects in unpickled traces: remember the kind of the first
    # eight name objects seen and recognise those by identity (they are kept alive by the list).
    cdef PyObject* names[8]
    cdef int kinds[8]
    cdef int known = 0, j, kind
    cdef bint leading
    for i in range(n):
        entry = entries[i]
        if type(entry) is not dict:
            raise ValueError(f"trace entry {i} is a {type(entry).__name__}, expected a dict")
        d = <dict>entry
        leading = leading_fields(d, k_action, k_addr, k_size, k_stream, fields)
        if leading:
            action = <object>fields[0]
        else:
            action = d.get(k_action)
            if action is None:
                raise ValueError(f"trace entry {i} has no 'action'")
        kind = -1
        for j in range(known):
            if <PyObject*>action == names[j]:
                kind = kinds[j]
                break
        if kind < 0:
            kind = scan_kind(action)
            if known < 8:
                names[known] = <PyObject*>action
                kinds[known] = kind
                known += 1
        if kind == SCAN_SKIP:
            continue
        if leading:
            # The common case: three borrowed values, no references taken unless one is bad.
            if not trace_u64(fields[1]):
                bad_trace_field(i, action, "addr", <object>fields[1])
            if not trace_size(fields[2]):
                bad_trace_field(i, action, "size", <object>fields[2])
            if not trace_u64(fields[3]):
                bad_trace_field(i, action, "stream", <object>fields[3])
            if kind == SCAN_SEGMENT_ALLOC:
                segment_allocs.append((<object>fields[1], <object>fields[2]))
            elif kind == SCAN_SEGMENT_MAP:
                segment_maps.append(<object>fields[1])
            continue
        v_addr = d.get(k_addr, _NO_FIELD)
        v_size = d.get(k_size, _NO_FIELD)
        v_stream = d.get(k_stream, 0)
        if v_addr is _NO_FIELD:
            missing_trace_field(i, action, "addr")
        if v_size is _NO_FIELD:
            missing_trace_field(i, action, "size")
        if not trace_u64(<PyObject*>v_addr):
            bad_trace_field(i, action, "addr", v_addr)
        if not trace_size(<PyObject*>v_size):
            bad_trace_field(i, action, "size", v_size)
        if not trace_u64(<PyObject*>v_stream):
            bad_trace_field(i, action, "stream", v_stream)
        if kind == SCAN_SEGMENT_ALLOC:
            segment_allocs.append((v_addr, v_size))
        elif kind == SCAN_SEGMENT_MAP:
            segment_maps.append(v_addr)
    return segment_allocs, segment_maps


def replay_entries(DeviceCachingAllocator allocator, list entries, object progress=None,
                   Py_ssize_t progress_every=65536):
    """Feed a recorded trace's events through `allocator`: the loop of pyalloc.replay.

    `entries` are PyTorch trace entry dicts (action, addr, size, stream). `alloc` calls malloc,
    `free_completed` frees what the matching alloc returned, and the first `segment_free` of
    a run acts as empty_cache() (that is what empty_cache leaves in a trace). An allocation
    that runs out of memory is counted and skipped, and so is its later free.
    `progress(done, total)` is called every `progress_every` events.

    Returns (allocations, address_matches, out_of_memory, unknown_frees): unknown_frees counts
    frees of addresses the trace never allocated, the mark of a ring buffer that wrapped.
    Written in Cython because replay speed is what `pyalloc tune` is made of.
    """
    cdef Py_ssize_t i, n = len(entries)
    cdef object entry
    cdef dict d
    cdef object action
    cdef PyObject* fields[4]                          # action, addr, size, stream (borrowed)
    cdef ActiveMap live                               # trace address -> our block
    cdef Block out_of_memory                          # marks an allocation that failed
    cdef uintptr_t addr, stream
    cdef size_t size
    cdef Block* b
    cdef int rc
    cdef Py_ssize_t allocations = 0, matches = 0, ooms = 0, unknown = 0
    cdef bint in_segment_free_run = False
    cdef bint is_segment_free
    if progress_every < 1:
        progress_every = 1
    # Unpickled traces share one string object per key and per action name. Looking keys up
    # with those very objects, and recognising actions by identity first, skips the string
    # comparisons that otherwise dominate the loop.
    k_action, k_addr, k_size, k_stream = trace_key_objects(entries)
    alloc_name, free_name, segment_free_name = "alloc", "free_completed", "segment_free"
    requested_name = "free_requested"
    # One lock for the whole replay: the allocator is the replay's own, and taking the lock
    # per event would cost more than many of the events.
    allocator.lock()
    try:
        for i in range(n):
            entry = entries[i]
            if type(entry) is not dict:
                raise TypeError(f"trace entry {i} is a {type(entry).__name__}, expected a dict")
            d = <dict>entry
            if leading_fields(d, k_action, k_addr, k_size, k_stream, fields):
                action = <object>fields[0]
                v_addr = <object>fields[1]
                v_size = <object>fields[2]
                v_stream = <object>fields[3]
            else:
                action = d[k_action]
                v_addr = d.get(k_addr, 0)
                v_size = d.get(k_size, 0)
                v_stream = d.get(k_stream, 0)
            if (action is not alloc_name and action is not free_name and action is not requested_name
                    and action is not segment_free_name):
                # First sighting of this string object: learn which action it names.
                if action == "alloc":
                    alloc_name = action
                elif action == "free_completed":
                    free_name = action
                elif action == "free_requested":
                    requested_name = action
                elif action == "segment_free":
                    segment_free_name = action
            if action is requested_name:
                in_segment_free_run = False
                continue
            if action is alloc_name:
                allocations += 1
                addr = v_addr
                size = v_size
                stream = v_stream
                if size == 0:
                    continue
                if allocator.malloc_locked(size, stream, 0, &b) == BACKEND_OOM:
                    ooms += 1
                    live.insert(addr, &out_of_memory)
                else:
                    live.insert(addr, b)
                    matches += b.ptr == addr
            elif action is free_name:
                addr = v_addr
                b = live.get(addr)
                if b == NULL:
                    unknown += 1
                else:
                    live.erase(addr)
                    if b != &out_of_memory:
                        allocator.free_locked(b, 0)
            is_segment_free = action is segment_free_name
            if is_segment_free and not in_segment_free_run:
                allocator.empty_cache_locked()
            in_segment_free_run = is_segment_free
            if progress is not None and i % progress_every == 0:
                progress(i, n)
    finally:
        allocator.unlock()
    if progress is not None:
        progress(n, n)
    return allocations, matches, ooms, unknown
