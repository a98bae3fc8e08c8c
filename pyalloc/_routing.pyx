# cython: language_level=3
"""Private pools and routing: which pool an allocation goes to (the newest route whose filter
accepts it: "this thread" for use_mem_pool, "this stream is in capture c" for graph capture),
the pools' creation and use counts, and the bytes they hold.

Private pools (MemPool, CUDA graphs) have ids (0, n) or (n, 0), a use count and their own small
and large pools (PyTorch's PrivatePool and captures_underway).
"""
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
from libcpp.map cimport map as cppmap
from libcpp.unordered_map cimport unordered_map
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport BlockPool, BlockSet, MempoolId, PrivatePool, ROUTE_THREAD
from pyalloc._types cimport current_thread_key as thread_key_now
from pyalloc._device cimport DeviceState, backend_of, find_route
from pyalloc._types cimport Route, ROUTE_CAPTURE
from pyalloc._capture cimport end_capture_marks
from pyalloc._events cimport flush_deferred_blocks


cdef PrivatePool* routed_pool(DeviceState* a, uintptr_t stream) except? NULL:
    """The pool of the newest route whose filter accepts an allocation on `stream` by this
    thread, or NULL (the default pools).

    This thread's newest route (thread_routes), unless a capture route newer than it accepts
    the stream's capture: the capture routes newer than it are tried newest first, and the
    stream's capture is asked for (once) only when there is one. Other threads' routes are not
    read, so the cost does not grow with how many are open."""
    cdef uint64_t me = thread_key_now()
    cdef uint64_t mine = 0                  # seq of this thread's newest route; 0: none
    cdef PrivatePool* pool = NULL
    cdef unsigned long long capture_id
    cdef vector[uintptr_t] terminals
    cdef int capturing = -1
    cdef unordered_map[uint64_t, vector[Route]].iterator own = a.thread_routes.find(me)
    if own != a.thread_routes.end():
        mine = deref(own).second.back().seq
        pool = deref(own).second.back().pool
    cdef cppmap[uint64_t, Route].reverse_iterator it = a.capture_routes_by_seq.rbegin()
    while it != a.capture_routes_by_seq.rend() and deref(it).first > mine:
        if capturing < 0:
            capturing = backend_of(a).capture_info(stream, &capture_id, &terminals)
        if capturing and capture_id == deref(it).second.value:
            return deref(it).second.pool
        inc(it)
    return pool


cdef void forget_thread_route(DeviceState* a, Route route) noexcept:
    """Take thread route `route` (ended) out of thread_routes."""
    cdef unordered_map[uint64_t, vector[Route]].iterator own = a.thread_routes.find(route.value)
    if own == a.thread_routes.end():
        return
    cdef size_t i
    for i in range(deref(own).second.size()):
        if deref(own).second[i].seq == route.seq:
            deref(own).second.erase(deref(own).second.begin() + i)
            break
    if deref(own).second.empty():
        a.thread_routes.erase(own)


cdef PrivatePool* create_or_incref_pool(DeviceState* a, MempoolId pid) except NULL:
    it = a.graph_pools.find(pid)
    cdef PrivatePool* pool
    if it == a.graph_pools.end():
        pool = new PrivatePool(pid)
        a.graph_pools[pid] = pool
        return pool
    pool = deref(it).second
    if pool.use_count <= 0:
        # PyTorch asserts here; a freeable pool is brought back to life instead, which is what
        # a second MemPool with the id of a released one would expect.
        pool.use_count = 0
    pool.use_count += 1
    return pool


cdef size_t pool_free_bytes(BlockPool* pool) noexcept:
    cdef size_t total = 0
    cdef BlockSet.iterator it = pool.blocks.begin()
    while it != pool.blocks.end():
        total += deref(it).size
        inc(it)
    return total


cdef size_t private_cached(DeviceState* a) noexcept:
    """Bytes in cached free blocks of private pools (PyTorch's "allocated in private pools")."""
    cdef size_t total = 0
    cdef pair[MempoolId, PrivatePool*] entry
    for entry in a.graph_pools:
        total += pool_free_bytes(&entry.second.small_blocks) + pool_free_bytes(&entry.second.large_blocks)
    return total


cdef size_t private_reserved(DeviceState* a) noexcept:
    cdef size_t total = 0
    cdef pair[MempoolId, PrivatePool*] entry
    for entry in a.graph_pools:
        total += entry.second.reserved_bytes
    return total


cdef int begin_route(DeviceState* a, Route route) except -1:
    """Route the allocations that pass `route`'s filter to its pool (created, or one more use);
    RuntimeError when the pool is routed already."""
    if find_route(a, route.id) >= 0:
        raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id "
                           f"{(route.id.first, route.id.second)}")
    route.pool = create_or_incref_pool(a, route.id)
    route.seq = a.last_route_seq + 1
    a.captures_underway.push_back(route)
    a.last_route_seq = route.seq
    if route.kind == ROUTE_CAPTURE:
        a.capture_routes_by_seq[route.seq] = route
        a.capture_routes += 1
    else:
        a.thread_routes[route.value].push_back(route)
    return 0


cdef int end_route(DeviceState* a, MempoolId pid) except -1:
    """Stop routing to `pid` (its use count stays); RuntimeError when it is not routed."""
    cdef Py_ssize_t i = find_route(a, pid)
    if i < 0:
        raise RuntimeError(f"endAllocatePool: not currently recording to mempool_id "
                           f"{(pid.first, pid.second)}")
    cdef Route route = a.captures_underway[i]
    if route.kind == ROUTE_CAPTURE:
        # The capture is over: its reachability cache goes; blocks still deferred wait for the
        # post-capture path (events once no route is active).
        a.reuse_contexts.erase(route.value)
        a.capture_routes -= 1
        a.capture_routes_by_seq.erase(route.seq)
    else:
        forget_thread_route(a, route)
    a.captures_underway.erase(a.captures_underway.begin() + i)
    if a.captures_underway.empty() and not a.deferred_blocks.empty():
        # No route is left: deferred blocks get their events now (PyTorch does this at the next
        # malloc), so the cache-hit path checks one counter, not two.
        flush_deferred_blocks(a)
    if route.kind == ROUTE_CAPTURE and not a.capture_uses.empty():
        end_capture_marks(a, route.value)
    return 0
