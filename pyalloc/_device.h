// One device allocator's whole state apart from its Python objects: the default pools, the active
// map, events, routes, private pools, deferred frees, capture records, stream lifetime, the last
// out-of-memory figures and CoreState (settings, statistics, history). Declared for Cython once, in
// _device.pxd; DeviceCachingAllocator (_core.pyx) holds one, and every module of the core works on
// a DeviceState* (none of them needs the class).
#pragma once

#include <deque>
#include <map>
#include <Python.h>

#include "_types.h"

namespace pyalloc {

typedef std::pair<uintptr_t, Block*> EventEntry;            // (event, block waiting on it)
typedef std::deque<EventEntry> EventQueue;                  // one stream's events, oldest first
typedef std::unordered_map<uintptr_t, EventQueue> EventQueues;

// What one step of the release ladder does with a cached segment: the real ladder frees it; the dry
// run (replay's release classification) only counts it and remembers it as gone, so that the same
// ladder code answers "how many bytes would this malloc release" without changing anything.
struct ReleaseCount {
    size_t released = 0;                 // bytes the steps so far would have given back
    std::unordered_set<Block*> gone;     // blocks counted as released (still in their pools)
    int64_t clock_offset = 0;            // the large pool's GC clock as the real malloc sees it
    size_t reserved = 0;                 // reserved bytes before the ladder
    size_t free_bytes = 0;               // device free bytes before the ladder
    size_t physical = 0;                 // device bytes a new allocation must find free
};

// Laid out for the cache-hit path (the order of the fields is the object's layout): what a cache
// hit reads comes first and together, so that a malloc or free served from the cache touches few
// cache lines: the pools, the active map, the tests of needs_python (_hot.pxd), the lock's word,
// then the settings and statistics at the start of st. (Measured: bench/cold_entry_pair.py
// --callgrind counts the data cache lines of a pair.)
struct DeviceState {
    BlockPool* small_blocks = new BlockPool(true, nullptr);   // the default pools
    BlockPool* large_blocks = new BlockPool(false, nullptr);
    ActiveMap active_blocks;                  // ptr -> block handed out or awaiting events
    size_t outstanding_events = 0;
    std::vector<Route> captures_underway;     // newest last
    int capture_routes = 0;                   // routes of kind ROUTE_CAPTURE active
    // Flags as ints (Cython's bint), as they were in the allocator object: with them the lock and
    // the settings sit at the offsets the cache-hit path was measured with (D1 lines per pair,
    // bench/cold_entry_pair.py --callgrind, read 3 more with one-byte flags).
    int capture_alloc_stacks = 0;             // the snapshot layer records malloc stacks
    int capture_free_stacks = 0;              // ... and free stacks
    int reuse_checked = 0;                    // the backend's reuse sanitizer is on
    AllocatorLock mutex;
    CoreState st;                             // settings, statistics, history, spares
    PyObject* backend = nullptr;              // a Backend, borrowed: the allocator object owns it
    EventQueues stream_events;
    uintptr_t event_poll_next = 0;            // with event_poll_streams: the stream polled next
    std::vector<uintptr_t> event_pool;        // created, idle events for reuse
    std::unordered_map<int, std::vector<uintptr_t>> foreign_event_pools;  // the same, by other device
    std::unordered_map<uintptr_t, int> foreign_event_devices;            // event -> its other device
    // Stream lifetime: how many block stream uses (record_stream) name each stream handle (what
    // keeps a record_stream pin alive), the allocation streams kept alive while blocks of theirs
    // may be cached, and the dropped ones waiting for an event (handle -> event; 0: not tried).
    std::unordered_map<uintptr_t, size_t> stream_use_counts;
    std::unordered_set<uintptr_t> allocation_streams_kept;
    std::unordered_map<uintptr_t, uintptr_t> retiring_streams;
    size_t streams_since_reap = 0;            // new allocation streams since the last reap
    // Handles whose use count reached zero while a pin may name them (and each newly pinned
    // handle): the only pins a prune checks, so that a free costs the same however many pins
    // are alive (prune_stream_pins). has_pins: the allocator object holds a pin (lock held).
    std::vector<uintptr_t> pins_to_check;
    bool has_pins = false;
    // Segments (not expandable) held, by stream: every block belongs to a segment of its stream,
    // so a stream has a block while it counts one here or owns an expandable segment
    // (mark_streams_without_blocks). Updated where segments come and go, and where one changes
    // streams (cross-stream reuse in a capture).
    std::unordered_map<uintptr_t, size_t> segments_by_stream;
    // The routes indexed, so that routing an allocation reads this thread's routes and the
    // capture routes, not every thread's (routed_pool): by thread key (oldest first), and by seq.
    std::unordered_map<uint64_t, std::vector<Route>> thread_routes;
    std::map<uint64_t, Route> capture_routes_by_seq;
    uint64_t last_route_seq = 0;
    // Private pools (MemPools, graph pools), and what a capture leaves behind.
    std::map<MempoolId, PrivatePool*> graph_pools;
    std::vector<Block*> deferred_blocks;      // freed with stream uses while routing; NULL: released
    size_t deferred_released = 0;             // NULL slots in deferred_blocks
    size_t deferred_marked = 0;               // deferred blocks with free markers (reuse candidates)
    uint64_t last_defer_id = 0;               // CaptureUses.defer_id of the newest deferral
    std::unordered_map<Block*, CaptureUses> capture_uses;     // blocks used or freed in a capture
    std::unordered_map<uint64_t, CaptureReuse> reuse_contexts;  // by capture id (#162186 cache)
    uint64_t nodes_expanded = 0;              // graph nodes the reuse walks expanded
    // The last out-of-memory figures (bytes), read after the lock is dropped to build the message.
    size_t oom_alloc_size = 0, oom_free = 0, oom_total = 0, oom_private = 0;

    DeviceState() = default;
    DeviceState(const DeviceState&) = delete;
    DeviceState& operator=(const DeviceState&) = delete;
};

}  // namespace pyalloc
