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
from pyalloc._policy cimport kMaxRequest, kSizeMax, round_size, segment_size_for
from pyalloc._types cimport ST_RESERVED_BYTES, ST_ALLOCATED_BYTES
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
    SCAN_SKIP = 0            # snapshot, anything else: not read by the replay
    SCAN_CHECK = 1           # alloc, free_requested, free_completed, segment_free, segment_unmap
    SCAN_SEGMENT_ALLOC = 2   # checked, and its (addr, size) collected
    SCAN_SEGMENT_MAP = 3     # checked, and its addr collected
    SCAN_OOM = 4             # oom: size and stream checked (device_free where present); no addr


# Action names are shared string objects in unpickled traces: the loops below remember the kind
# of the first eight name objects they see and recognise those by identity (the objects stay alive
# in the trace's dicts while a loop runs).
ctypedef struct ActionKinds:
    PyObject* names[8]
    int kinds[8]
    int known


cdef inline int known_kind(ActionKinds* c, object action) noexcept:
    """The kind learnt for this very object, or -1 when it has not been seen."""
    cdef int j
    for j in range(c.known):
        if <PyObject*>action == c.names[j]:
            return c.kinds[j]
    return -1


cdef inline int learn_kind(ActionKinds* c, object action, int kind) noexcept:
    """Remember `kind` for this object (while there is room); returns kind."""
    if c.known < 8:
        c.names[c.known] = <PyObject*>action
        c.kinds[c.known] = kind
        c.known += 1
    return kind


cdef int scan_kind(object action) except -1:
    if action == "segment_alloc":
        return SCAN_SEGMENT_ALLOC
    if action == "segment_map":
        return SCAN_SEGMENT_MAP
    if action == "oom":
        return SCAN_OOM
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


cdef int check_oom_entry(Py_ssize_t i, object action, dict d) except -1:
    """An oom entry carries the request (size, stream) and the device's free bytes (device_free;
    PyTorch's snapshot writer puts the addr field there): the replay attempts the request."""
    v_size = d.get("size", _NO_FIELD)
    if v_size is _NO_FIELD:
        missing_trace_field(i, action, "size")
    if not trace_size(<PyObject*>v_size):
        bad_trace_field(i, action, "size", v_size)
    v_stream = d.get("stream", 0)
    if not trace_u64(<PyObject*>v_stream):
        bad_trace_field(i, action, "stream", v_stream)
    v_free = d.get("device_free", 0)
    if not trace_u64(<PyObject*>v_free):
        bad_trace_field(i, action, "device_free", v_free)
    return 0


def scan_trace(list entries):
    """One pass over trace entries: ([(addr, size) of each segment_alloc], [addr of each segment_map]).

    The replay places new segments from the first list and expandable reservations from the second.
    The same pass checks what the replay reads: every entry is a dict with an "action"; alloc,
    free_requested, free_completed and segment_* entries have an int "addr" in [0, 2**64), an int
    "size" in [0, 2**60) and, when present, an int "stream" in [0, 2**64) (missing: stream 0, as
    the replay reads it); oom entries an int "size" and, when present, int "stream" and
    "device_free". Anything else raises ValueError naming the entry index and the field.
    """
    cdef Py_ssize_t i, n = len(entries)
    cdef object entry
    cdef dict d
    cdef PyObject* fields[4]
    segment_allocs = []
    segment_maps = []
    k_action, k_addr, k_size, k_stream = trace_key_objects(entries)
    cdef ActionKinds seen
    seen.known = 0
    cdef int kind
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
        kind = known_kind(&seen, action)
        if kind < 0:
            kind = learn_kind(&seen, action, scan_kind(action))
        if kind == SCAN_SKIP:
            continue
        if kind == SCAN_OOM:
            check_oom_entry(i, action, d)
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



# What the replay loop does with an entry, by action.
cdef enum:
    ACT_OTHER = 0            # segment_alloc, segment_map, snapshot, ...: nothing to replay
    ACT_ALLOC = 1
    ACT_FREE = 2             # free_completed
    ACT_REQUESTED = 3        # free_requested
    ACT_RELEASE = 4          # segment_free, segment_unmap
    ACT_OOM = 5


cdef int act_kind(object action) except -1:
    if action == "alloc":
        return ACT_ALLOC
    if action == "free_completed":
        return ACT_FREE
    if action == "free_requested":
        return ACT_REQUESTED
    if action == "segment_free" or action == "segment_unmap":
        return ACT_RELEASE
    if action == "oom":
        return ACT_OOM
    return ACT_OTHER


def release_window(list entries, Py_ssize_t start):
    """The release window that starts at entry `start` (a segment_free or segment_unmap):
    (end, request, window_bytes). It runs over segment_free, segment_unmap, free_completed,
    segment_alloc and segment_map entries, which is what PyTorch writes inside one malloc between
    its first release and the request's own entry (garbage collection, the max_split_size
    release, the flush with the events it waits for, the new segment). `request` is the index of
    the alloc or oom entry that ends it, or -1 when another entry (or the trace's end) does, at
    index `end`; window_bytes sums the sizes of its segment_free and segment_unmap entries, less
    what the window mapped before a later release (an expandable segment's growth that the
    failed malloc mapped and its flush then unmapped: memory the allocator held only inside it)."""
    cdef Py_ssize_t j, n = len(entries)
    cdef object total = 0, grown = 0, regrown = 0
    # Pages mapped just before the first release, with no request entry between, are the same
    # malloc's growth (an expandable segment grows page run by page run and can fail midway).
    j = start - 1
    while j >= 0:
        e = entries[j]
        action = e["action"]
        if action == "segment_map":
            grown += e["size"]
        elif action != "free_completed":
            break
        j -= 1
    for j in range(start, n):
        e = entries[j]
        action = e["action"]
        if action == "segment_free" or action == "segment_unmap":
            total += e["size"]
            regrown += grown
            grown = 0
        elif action == "alloc" or action == "oom":
            return j, j, max(total - regrown, 0)
        elif action == "segment_alloc" or action == "segment_map":
            grown += e["size"]
        elif action != "free_completed":
            return j, -1, max(total - regrown, 0)
    return n, -1, max(total - regrown, 0)


cdef inline size_t available_bytes(DeviceCachingAllocator a) except? 0:
    """Bytes a new segment could still take: the device's free memory, or less under a limit."""
    cdef size_t free_bytes = 0, total_bytes = 0
    a.backend.memory_info(&free_bytes, &total_bytes)
    cdef size_t limit = a.d.st.settings.allowed_memory_maximum
    cdef size_t held = a.d.st.total_allocated_memory
    if limit != kSizeMax:
        if held >= limit:
            return 0
        if limit - held < free_bytes:
            return limit - held
    return free_bytes


cdef struct Releases:
    Py_ssize_t unmatched               # literal releases: segment_free entries with no such segment
    Py_ssize_t window_end              # the classified release window runs up to here
    Py_ssize_t next_call               # empty_cache_at: the next entry replayed as empty_cache()
    Py_ssize_t call_pos
    Py_ssize_t n_calls


# Segment frees and unmaps (segment_free, segment_unmap) are either an empty_cache() call or
# releases that the allocator's own policy makes inside a malloc (garbage_collection_threshold,
# the max_split_size release, the out-of-memory flush). The replay's allocator makes the
# latter itself, so only the calls are replayed, as empty_cache(). Which are which:
#   * `empty_cache_at` given (a sorted list of entry indices): an empty_cache() call at each of
#     those entries, nothing at any other segment free or unmap (the classification of an
#     earlier replay, for replays of the same trace under other settings or device sizes).
#   * None: each release window (release_window) is classified when it starts. It is the
#     policy's when the request that ends it would make this allocator release device memory
#     (DeviceCachingAllocator.policy_release_bytes, a dry run of the ladder) and at least as
#     many bytes as the window frees; otherwise it is an empty_cache() call. A window that
#     ends in anything but a request (a free, a snapshot, the trace's end) is always a call.
#     So an empty_cache() right before a malloc that releases memory itself counts as the
#     policy's only when the policy would free as much as the window did; one that frees less
#     than the window is a call (the policy cannot explain it). One right before a malloc that
#     would flush reads as that flush (the traces are the same): one more allocation retry.
# free_completed entries are applied where they stand, including those of blocks whose events
# a flush waited for mid-ladder (their entries come before the flush's segment frees): such a
# block is free before the malloc in the replay, and when it could serve the request, the
# replay counts one flush and retry less than PyTorch did.
#   * `literal_releases` True (for measuring, not for counting): each segment_free releases that
#     very segment (a free unsplit cached block at that address; one that is not there is
#     counted in unmatched_releases), and each window of segment_unmap entries is one
#     empty_cache() (expandable segments' only policy release is the flush, which unmaps what
#     empty_cache does). The allocator's state then follows the trace's at every entry
#     whatever the limit, but the ladder's retries are not counted.
cdef int replay_release(DeviceCachingAllocator allocator, list entries, Py_ssize_t i, object action,
                        object v_addr, object v_size, object v_stream, bint literal_releases,
                        bint classify, Releases* rel, list calls) except -1:
    """A segment_free / segment_unmap entry `i` (see replay_entries: literal, classified, or at
    the given empty_cache_at entries). Lock held."""
    cdef size_t release
    if literal_releases:
        if action == "segment_free":
            if not allocator.release_cached_segment(v_addr, v_size, v_stream):
                rel.unmatched += 1
        elif i >= rel.window_end:
            rel.window_end = release_window(entries, i)[0]
            allocator.empty_cache_locked()
            calls.append(i)
    elif classify:
        if i >= rel.window_end:
            end, request, window_bytes = release_window(entries, i)
            rel.window_end = end
            release = 0
            if request >= 0:
                e = entries[request]
                release = allocator.policy_release_bytes(e["size"], e.get("stream", 0))
            if release == 0 or window_bytes > release:
                allocator.empty_cache_locked()
                calls.append(i)
    elif i == rel.next_call:
        allocator.empty_cache_locked()
        rel.call_pos += 1
        rel.next_call = calls[rel.call_pos] if rel.call_pos < rel.n_calls else -1
    return 0


cdef tuple replay_oom(DeviceCachingAllocator allocator, Py_ssize_t i, dict d, object v_size,
                      object v_stream, bint attempt_ooms):
    """An oom entry `i` (a request PyTorch could not serve: its rounded size and stream), attempted
    when `attempt_ooms`: one that runs out of memory again is counted as PyTorch counted it
    (num_ooms, and num_alloc_retries for the flush-and-retry before it); one that fits is freed
    at once, as the trace holds no free for it. False only measures it. Lock held.

    Returns its oom_requests tuple, (index, size, stream, device_free, reserved_bytes,
    allocated_bytes, fits, margin): reserved and allocated bytes after the attempt (after the
    ladder when it failed, before the request when it fitted or was not attempted), fits None
    when not attempted, margin the bytes a new segment could still have taken after serving it
    (fits) or, negative, the bytes its segment was short of (no fit)."""
    cdef size_t size = v_size, need
    cdef uintptr_t stream = v_stream
    cdef Block* b
    fits = None
    margin = 0
    reserved = allocator.d.st.stats[ST_RESERVED_BYTES].all_current
    allocated = allocator.d.st.stats[ST_ALLOCATED_BYTES].all_current
    if attempt_ooms and size > 0:
        if allocator.malloc_locked(size, stream, 0, &b) == BACKEND_OOM:
            fits = False
            need = segment_size_for(round_size(&allocator.d.st.settings, size))
            margin = <object>available_bytes(allocator) - <object>need
            reserved = allocator.d.st.stats[ST_RESERVED_BYTES].all_current
            allocated = allocator.d.st.stats[ST_ALLOCATED_BYTES].all_current
        else:
            fits = True
            margin = available_bytes(allocator)
            allocator.free_locked(b, 0)
    return (i, v_size, v_stream, d.get("device_free", 0), reserved, allocated, fits, margin)


def replay_entries(DeviceCachingAllocator allocator, list entries, object progress=None,
                   Py_ssize_t progress_every=65536, object empty_cache_at=None,
                   bint attempt_ooms=True, bint literal_releases=False):
    """Feed a recorded trace's events through `allocator`: the loop of pyalloc.replay.

    `entries` are PyTorch trace entry dicts (action, addr, size, stream). `alloc` calls malloc,
    `free_completed` frees what the matching alloc returned. An allocation that runs out of
    memory is counted and skipped, and so is its later free.

    `oom` entries are attempted at their place when `attempt_ooms` (see replay_oom).

    Segment frees and unmaps are replayed by replay_release (see the comment above it: literal,
    classified, or at `empty_cache_at`; `literal_releases` for measuring, not for counting).
    `progress(done, total)` is called every `progress_every` events.

    Returns (allocations, address_matches, out_of_memory, unknown_frees, empty_cache_calls,
    oom_requests, first_failed_alloc): out_of_memory counts alloc entries that failed;
    unknown_frees counts frees of addresses the trace never allocated, the mark of a ring buffer
    that wrapped; empty_cache_calls lists the entry indices replayed as empty_cache();
    oom_requests holds one tuple per oom entry (replay_oom);
    first_failed_alloc is the index of the first alloc entry that ran out of memory, or -1;
    unmatched_releases (literal_releases only) counts segment_free entries with no such segment.
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
    cdef Py_ssize_t allocations = 0, matches = 0, ooms = 0, unknown = 0, first_failed = -1
    cdef Releases rel                                 # where the release windows stand
    rel.unmatched = 0
    rel.window_end = -1
    rel.next_call = -1
    rel.call_pos = 0
    rel.n_calls = 0
    cdef bint classify = empty_cache_at is None
    cdef list calls
    cdef list oom_requests = []
    cdef ActionKinds seen                             # action name objects seen, and their kind
    seen.known = 0
    cdef int kind
    if progress_every < 1:
        progress_every = 1
    if classify:
        calls = []
    else:
        calls = list(empty_cache_at)
        rel.n_calls = len(calls)
        if rel.n_calls:
            rel.next_call = calls[0]
    # Unpickled traces share one string object per key and per action name. Looking keys up
    # with those very objects, and recognising actions by identity first, skips the string
    # comparisons that otherwise dominate the loop.
    k_action, k_addr, k_size, k_stream = trace_key_objects(entries)
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
            kind = known_kind(&seen, action)
            if kind < 0:
                # First sighting of this string object: learn which action it names.
                kind = learn_kind(&seen, action, act_kind(action))
            if kind == ACT_REQUESTED:
                continue
            if kind == ACT_ALLOC:
                allocations += 1
                addr = v_addr
                size = v_size
                stream = v_stream
                if size == 0:
                    continue
                if allocator.malloc_locked(size, stream, 0, &b) == BACKEND_OOM:
                    ooms += 1
                    if first_failed < 0:
                        first_failed = i
                    live.insert(addr, &out_of_memory)
                else:
                    live.insert(addr, b)
                    matches += b.ptr == addr
            elif kind == ACT_FREE:
                addr = v_addr
                b = live.get(addr)
                if b == NULL:
                    unknown += 1
                else:
                    live.erase(addr)
                    if b != &out_of_memory:
                        allocator.free_locked(b, 0)
            elif kind == ACT_RELEASE:
                replay_release(allocator, entries, i, action, v_addr, v_size, v_stream,
                               literal_releases, classify, &rel, calls)
            elif kind == ACT_OOM:
                oom_requests.append(replay_oom(allocator, i, d, v_size, v_stream, attempt_ooms))
            if progress is not None and i % progress_every == 0:
                progress(i, n)
    finally:
        allocator.unlock()
    if progress is not None:
        progress(n, n)
    return allocations, matches, ooms, unknown, calls, oom_requests, first_failed, rel.unmatched


def trace_flags(list entries):
    """(has_releases, has_ooms): whether the trace holds segment_free / segment_unmap entries and
    oom entries. One quick pass (action names recognised by identity, as in the replay loop), so
    that tune can skip classifying releases (none to classify) and looking for a recorded OOM."""
    cdef Py_ssize_t i, n = len(entries)
    cdef ActionKinds seen
    seen.known = 0
    cdef int kind
    cdef bint releases = False, ooms = False
    k_action = trace_key_objects(entries)[0]
    for i in range(n):
        entry = entries[i]
        action = (<dict>entry).get(k_action) if type(entry) is dict else None
        kind = known_kind(&seen, action)
        if kind < 0:
            kind = learn_kind(&seen, action, act_kind(action))
        if kind == ACT_RELEASE:
            releases = True
        elif kind == ACT_OOM:
            ooms = True
        if releases and ooms:
            break
    return releases, ooms
