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


def scan_trace(list entries):
    """One pass over trace entries: ([(addr, size) of each segment_alloc], [addr of each segment_map]).

    The replay places new segments from the first list and expandable reservations from the second.
    """
    cdef Py_ssize_t i, n = len(entries)
    cdef dict d
    cdef PyObject* fields[4]
    segment_allocs = []
    segment_maps = []
    k_action, k_addr, k_size, k_stream = trace_key_objects(entries)
    # Action names are shared string objects in unpickled traces: remember up to eight that are
    # neither of the two we look for, and skip those by identity.
    cdef PyObject* other_names[8]
    cdef int known_others = 0, j
    cdef bint skip
    for i in range(n):
        d = entries[i]
        if leading_fields(d, k_action, k_addr, k_size, k_stream, fields):
            action = <object>fields[0]
        else:
            action = d[k_action]
        skip = False
        for j in range(known_others):
            if <PyObject*>action == other_names[j]:
                skip = True
                break
        if skip:
            continue
        if action == "segment_alloc":
            segment_allocs.append((d[k_addr], d[k_size]))
        elif action == "segment_map":
            segment_maps.append(d[k_addr])
        elif known_others < 8:
            other_names[known_others] = <PyObject*>action   # kept alive by the entries list
            known_others += 1
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
