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
from cython.operator cimport dereference as deref, preincrement as inc

from pyalloc._types cimport BlockPool, BlockSet, MempoolId, PrivatePool, ROUTE_THREAD
from pyalloc._types cimport current_thread_key as thread_key_now
from pyalloc._device cimport DeviceState, backend_of, find_route
from pyalloc._types cimport Route, ROUTE_CAPTURE
from pyalloc._capture cimport end_capture_marks
from pyalloc._events cimport flush_deferred_blocks


cdef PrivatePool* routed_pool(DeviceState* a, uintptr_t stream) except? NULL:
    """The pool of the newest route whose filter accepts an allocation on `stream` by this
    thread, or NULL (the default pools)."""
    cdef size_t i = a.captures_underway.size()
    cdef uint64_t me = thread_key_now()
    cdef unsigned long long capture_id
    cdef vector[uintptr_t] terminals
    cdef int capturing = -1
    while i > 0:
        i -= 1
        if a.captures_underway[i].kind == ROUTE_THREAD:
            if a.captures_underway[i].value == me:
                return a.captures_underway[i].pool
        else:
            if capturing < 0:
                capturing = backend_of(a).capture_info(stream, &capture_id, &terminals)
            if capturing and capture_id == a.captures_underway[i].value:
                return a.captures_underway[i].pool
    return NULL


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
    a.captures_underway.push_back(route)
    if route.kind == ROUTE_CAPTURE:
        a.capture_routes += 1
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
    a.captures_underway.erase(a.captures_underway.begin() + i)
    if a.captures_underway.empty() and not a.deferred_blocks.empty():
        # No route is left: deferred blocks get their events now (PyTorch does this at the next
        # malloc), so the cache-hit path checks one counter, not two.
        flush_deferred_blocks(a)
    if route.kind == ROUTE_CAPTURE and not a.capture_uses.empty():
        end_capture_marks(a, route.value)
    return 0
