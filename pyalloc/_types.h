// pyalloc core data structures: Block, BlockPool, PrivatePool, statistics, the history ring
// buffer and the per-allocator CoreState. Declared for Cython once, in _types.pxd.
//
// Only plain data, orderings, containers and the arithmetic of a statistic update live here; every
// decision that uses them is written in _policy.pxd (best fit, should-split, oversize), _blocks.pxd
// (split, merge), _state.pxd (which statistics and trace entries change when) and the modules over
// DeviceState (_ladder: release, the OOM ladder; _routing). The structs are C++ because the
// ordered sets need comparators and node-pooling allocators, and the statistics helpers a
// forced-inline attribute, which Cython cannot declare.
//
// Vocabulary:
//   segment  one device allocation (a cuMemAlloc, or later one mapped range of an expandable segment)
//   block    a contiguous byte range of one segment; the blocks of a segment form a linked list
//   pool     the free blocks of one size class (small <= 1 MiB < large) of one owner (default or private)
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <iterator>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <cstdint>
#include <vector>

namespace pyalloc {

// Code the cache-hit path calls only in rare cases (a lock taken by another thread, a table that
// must grow, history on, no spare object): kept out of line and away from the hot code, so that
// the hot path's instructions sit in few cache lines. Inside a framework's own work the hot path
// runs with cold instruction caches, where every line it spans is a fetch from L2 or beyond.
#define PYALLOC_COLD __attribute__((noinline, cold))
#define PYALLOC_UNLIKELY(x) __builtin_expect(!!(x), 0)

struct Block;
struct BlockPool;
struct PrivatePool;

// One expandable segment: a reservation of virtual address space whose pages are mapped to
// physical memory on demand. The core tracks which ranges are mapped as blocks (mapped = false for
// unmapped ranges); the backend keeps the physical handles.
struct ExpandableSegment {
    uintptr_t base;        // first address of the reservation
    size_t size;           // bytes of address space reserved, a multiple of page_size
    size_t page_size;      // bytes mapped at a time: 2 MiB (small pool) or 20 MiB (large pool);
                           // 2 MiB in both under recycle_pages
    uintptr_t stream;      // the one stream whose blocks live here
    BlockPool* pool;
    size_t mapped;         // bytes currently mapped (kept by the core's map/unmap)
};

// A free block's entry in its pool's best-fit set: the block's sort key, copied into the tree
// node, and the block. Searches compare within the node they visit instead of loading each Block:
// half the cache lines per tree level, which shows with 100,000 live blocks.
struct PoolEntry {
    uintptr_t stream;
    size_t size;
    uintptr_t ptr;
    Block* block;
};

// Stream uses a block holds from which it keeps them in a set too (Block::use_index).
static const size_t kUseIndexMin = 8;

// Best-fit order: (stream, size, address). lower_bound with the request's stream and rounded size
// finds the smallest block of that stream that fits, lowest address first on ties.
struct EntryBySize {
    bool operator()(const PoolEntry& a, const PoolEntry& b) const {
        if (a.stream != b.stream) return a.stream < b.stream;
        if (a.size != b.size) return a.size < b.size;
        return a.ptr < b.ptr;
    }
};

// Address order within a stream, for unmapped ranges of expandable segments.
struct BlockByAddress {
    bool operator()(const Block* a, const Block* b) const;
};

// Invariants (checked by DeviceCachingAllocator._check_invariants in tests):
//  * prev->ptr + prev->size == ptr and next->ptr == ptr + size; prev/next belong to the same segment.
//  * A block is in pool->blocks iff it is mapped, not allocated, event_count == 0 and
//    stream_uses is empty ("free"). Two free blocks are never neighbours (they would have merged).
//  * A block is in the allocator's active map iff it is allocated or still waits for events.
// Laid out for the cache-hit path, which touches a block's first 64 bytes (its key, list
// links, pool position and requested size) and a few words of the second line: aligned to a
// cache line so that a block spans two lines, not three or four.
struct alignas(64) Block {
    uintptr_t stream = 0;          // allocation stream; a block is only reused on this stream
    size_t size = 0;               // bytes, a multiple of 512
    uintptr_t ptr = 0;             // device address
    BlockPool* pool = nullptr;     // owning pool
    Block* prev = nullptr;         // neighbour at lower address in the same segment
    Block* next = nullptr;         // neighbour at higher address in the same segment
    std::set<PoolEntry, EntryBySize>::iterator pool_pos;  // entry in pool->blocks while free
    size_t requested_size = 0;     // bytes the caller asked for (unrounded) while allocated
    // second line
    bool allocated = false;        // handed out and not yet freed by the caller
    bool mapped = true;            // false for unmapped address space of an expandable segment
    bool expandable = false;       // part of an expandable segment
    bool buffer_owned = false;     // a pyalloc.Buffer owns it: only the Buffer may free it
    int event_count = 0;           // outstanding cross-stream events recorded at free
    uint32_t metadata_id = 0;      // user metadata current when allocated (0 = none)
    uint32_t context_id = 0;       // captured stack of the hand-out (0 = none)
    std::vector<uintptr_t> stream_uses;  // streams added by record_stream (never the alloc stream)
    int64_t gc_count_base = 0;     // pool->get_free_blocks_call_count when last inserted
    ExpandableSegment* segment = nullptr;  // that segment, when expandable
    uint32_t segment_context_id = 0;  // stack of the segment allocation, on the head block
    bool gc_listed = false;        // in its pool's garbage-collection candidates (BlockPool::gc_*)
    void* py_address = nullptr;    // a Python int owned by the core, equal to py_address_value:
    uintptr_t py_address_value = 0;  // malloc() returns it again while ptr still equals it
    Block* gc_prev = nullptr;      // neighbours in the pool's candidates, by gc_count_base
    Block* gc_next = nullptr;
    // CoreState::free_epoch when the block (or the last of the blocks merged into it) returned to
    // its pool: recycle_pages may unmap its pages without synchronizing the device once the work
    // queued on its stream before that is known to be over (0: never used, a fresh mapping).
    uint64_t free_epoch = 0;
    // stream_uses as a set, kept once the block has kUseIndexMin uses, so that asking whether it
    // uses a stream costs the same with 10,000 uses as with 8 (built by index_use, dropped with
    // drop_use_index wherever stream_uses is emptied).
    std::unordered_set<uintptr_t>* use_index = nullptr;

    ~Block() { delete use_index; }
    bool is_split() const { return prev != nullptr || next != nullptr; }
    bool uses_stream(uintptr_t stream) const {
        if (use_index != nullptr) return use_index->count(stream) != 0;
        for (uintptr_t used : stream_uses) if (used == stream) return true;
        return false;
    }
    // Room for the new use `stream` in the index, when the block keeps (or now starts) one:
    // std::bad_alloc leaves the index as it was (without `stream`), consistent with stream_uses.
    void index_use(uintptr_t stream) {
        if (use_index == nullptr) {
            if (stream_uses.size() + 1 < kUseIndexMin) return;
            std::unordered_set<uintptr_t>* index =
                new std::unordered_set<uintptr_t>(stream_uses.begin(), stream_uses.end());
            use_index = index;
        }
        use_index->insert(stream);
    }
    void drop_use_index() { delete use_index; use_index = nullptr; }
    // A new use would be indexed (index_use allocates for it).
    bool new_use_indexed() const { return stream_uses.size() + 1 >= kUseIndexMin; }
};


inline bool BlockByAddress::operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->ptr < b->ptr;
}

// The free blocks of a pool in best-fit order. Each block remembers its position (pool_pos), so
// removing or re-sorting a known block needs no search. Tree nodes are recycled: a cache hit
// re-sorts the shrunk remainder of the block it splits, and a free re-sorts the neighbour that
// absorbs the freed block, so neither path calls operator new or delete.
struct BlockSet {
    typedef std::set<PoolEntry, EntryBySize> Set;
    // Iterates the pool's blocks in best-fit order; *it is the Block.
    struct iterator {
        Set::iterator it;
        Block* operator*() const { return it->block; }
        iterator& operator++() { ++it; return *this; }
        iterator& operator--() { --it; return *this; }
        bool operator==(const iterator& other) const { return it == other.it; }
        bool operator!=(const iterator& other) const { return it != other.it; }
    };
    Set items;
    std::vector<Set::node_type> spare_nodes;

    static PoolEntry entry_of(Block* b) { return PoolEntry{b->stream, b->size, b->ptr, b}; }

    iterator begin() { return iterator{items.begin()}; }
    iterator end() { return iterator{items.end()}; }
    // The first block not ordered before `key`'s (stream, size, ptr).
    iterator lower_bound(Block* key) { return iterator{items.lower_bound(entry_of(key))}; }
    // The first block of `stream` with size >= `size` (or the first of a later stream, or end).
    iterator lower_bound(uintptr_t stream, size_t size) {
        return iterator{items.lower_bound(PoolEntry{stream, size, 0, nullptr})};
    }
    size_t size() const { return items.size(); }
    bool empty() const { return items.empty(); }
    // b is in the set under its current key (a stale entry, left by a key change without
    // reposition, is not found: the invariant check relies on this).
    bool contains(Block* b) const {
        Set::const_iterator it = items.find(entry_of(b));
        return it != items.end() && it->block == b;
    }

    void insert(Block* b) {
        if (PYALLOC_UNLIKELY(spare_nodes.empty())) { insert_new_node(b); return; }
        Set::node_type node = std::move(spare_nodes.back());
        spare_nodes.pop_back();
        node.value() = entry_of(b);
        b->pool_pos = items.insert(std::move(node)).position;
    }
    PYALLOC_COLD void insert_new_node(Block* b) { b->pool_pos = items.insert(entry_of(b)).first; }
    void erase(Block* b) { spare_nodes.push_back(items.extract(b->pool_pos)); }
    // Erases the block at `it` and returns the position after it (for loops that release blocks).
    iterator erase_at(iterator it) {
        iterator after{std::next(it.it)};
        erase(*it);
        return after;
    }
    // Restore the order after b's key changed, in the one direction it can have moved (the key
    // is (stream, size, address) and the stream never changes). When b still sorts after its
    // predecessor (resp. before its successor) nothing moves and only the entry's copy of the
    // key is updated: the common case for a remainder shrunk by a small split, or a free block
    // grown by a merge.
    void reposition_smaller(Block* b) {     // size decreased (a split's remainder)
        PoolEntry key = entry_of(b);
        Set::iterator it = b->pool_pos;
        if (it != items.begin() && !EntryBySize()(*std::prev(it), key)) { reinsert(b); return; }
        update_in_place(it, key);
    }
    void reposition_larger(Block* b) {      // size increased (a merge)
        PoolEntry key = entry_of(b);
        Set::iterator it = b->pool_pos;
        Set::iterator after = std::next(it);
        if (after != items.end() && !EntryBySize()(key, *after)) { reinsert(b); return; }
        update_in_place(it, key);
    }
    void reinsert(Block* b) {
        // extract() unlinks by position and makes no comparison, so the stale key is harmless.
        Set::node_type node = items.extract(b->pool_pos);
        node.value() = entry_of(b);
        b->pool_pos = items.insert(std::move(node)).position;
    }

  private:
    // The set's elements are const to keep callers from breaking the order; this key keeps it
    // (checked by the caller against the neighbours), and the element object itself is not const.
    static void update_in_place(Set::iterator it, const PoolEntry& key) {
        const_cast<PoolEntry&>(*it) = key;
    }
};

// Unmapped address ranges of expandable segments, by (stream, address).
typedef std::set<Block*, BlockByAddress> UnmappedSet;

// The allocator's lock: recursive, with an uncontended acquire/release of one atomic operation
// each (std::recursive_mutex costs two library calls). Waiters spin briefly, then sleep on a
// condition variable; the core calls lock() only after try_lock() failed, with the GIL released.
struct AllocatorLock {
    std::atomic<uintptr_t> owner{0};
    unsigned depth = 0;
    std::atomic<int> waiters{0};
    std::mutex sleep_mutex;
    std::condition_variable wake;

    // The calling thread's identity: its thread pointer (one register read on x86-64 and
    // AArch64 with GCC 11+) where pthread_self() is a call through the PLT; both are unique
    // among live threads.
    static uintptr_t self() {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && (defined(__x86_64__) || defined(__aarch64__))
        return (uintptr_t)__builtin_thread_pointer();
#else
        return (uintptr_t)pthread_self();
#endif
    }
    bool held() const { return owner.load(std::memory_order_relaxed) != 0; }   // by any thread
    bool try_lock() {
        uintptr_t me = self();
        if (PYALLOC_UNLIKELY(owner.load(std::memory_order_relaxed) == me)) { ++depth; return true; }
        uintptr_t expected = 0;
        if (owner.compare_exchange_strong(expected, me)) { depth = 1; return true; }
        return false;
    }
    PYALLOC_COLD void lock() {
        for (int i = 0; i < 100; ++i) {
            if (try_lock()) return;
            sched_yield();
        }
        std::unique_lock<std::mutex> guard(sleep_mutex);
        waiters.fetch_add(1);
        // Timed waits: unlock() may miss a waiter that registers just as the lock is released
        // (see there), so a sleeper retries at least every millisecond.
        while (!try_lock()) wake.wait_for(guard, std::chrono::milliseconds(1));
        waiters.fetch_sub(1);
    }
    void unlock() {
        if (PYALLOC_UNLIKELY(--depth != 0)) return;
        // A release store: on x86 a plain move, where a sequentially consistent store is a locked
        // exchange (~20 cycles, twice per malloc/free pair). The waiters load below may then be
        // ordered before the store and miss a waiter registering at that moment; that waiter
        // wakes on its own within 1 ms (lock() waits with a timeout).
        owner.store(0, std::memory_order_release);
        if (PYALLOC_UNLIKELY(waiters.load(std::memory_order_relaxed) != 0)) wake_waiters();
    }
    PYALLOC_COLD void wake_waiters() {
        std::lock_guard<std::mutex> guard(sleep_mutex);
        wake.notify_all();
    }
};

// Pointer -> Block of every block handed out or waiting for events: open addressing with linear
// probing over a power-of-two table. Lookups hash the pointer with one multiply instead of
// std::unordered_map's modulo by a prime, and insertions allocate nothing until the table grows.
struct ActiveMap {
    struct Slot { uintptr_t key; Block* value; };   // key 0 marks an empty slot
    std::vector<Slot> slots;
    size_t count = 0;
    size_t mask = 0;
    unsigned shift = 0;       // 64 - log2(slots.size())

    ActiveMap() { resize(64); }

    void resize(size_t n) {
        slots.assign(n, Slot{0, nullptr});
        mask = n - 1;
        shift = 64 - __builtin_ctzll(n);
    }
    size_t home(uintptr_t key) const {
        // Fibonacci hashing: the multiply spreads the pointer's bits, the top bits index the table.
        return (size_t)((key * 0x9E3779B97F4A7C15ull) >> shift);
    }
    Block* get(uintptr_t key) const {
        for (size_t i = home(key);; i = (i + 1) & mask) {
            if (slots[i].key == key) return slots[i].value;
            if (slots[i].key == 0) return nullptr;
        }
    }
    void insert(uintptr_t key, Block* value) {
        if (PYALLOC_UNLIKELY((count + 1) * 2 > slots.size())) grow();
        size_t i = home(key);
        while (slots[i].key != 0 && slots[i].key != key) i = (i + 1) & mask;
        if (slots[i].key == 0) ++count;
        slots[i] = Slot{key, value};
    }
    void erase(uintptr_t key) {
        size_t i = home(key);
        while (slots[i].key != key) {
            if (slots[i].key == 0) return;
            i = (i + 1) & mask;
        }
        // Backward-shift deletion: move later entries of the probe run into the hole, so lookups
        // never need tombstones.
        size_t hole = i;
        for (size_t j = (i + 1) & mask; slots[j].key != 0; j = (j + 1) & mask) {
            size_t h = home(slots[j].key);
            bool movable = (hole <= j) ? (h <= hole || h > j) : (h <= hole && h > j);
            if (movable) { slots[hole] = slots[j]; hole = j; }
        }
        slots[hole] = Slot{0, nullptr};
        --count;
    }
    size_t size() const { return count; }
    void values(std::vector<Block*>* out) const {
        for (const Slot& s : slots) if (s.key != 0) out->push_back(s.value);
    }
    PYALLOC_COLD void grow() {
        std::vector<Slot> old;
        old.swap(slots);
        resize(old.size() * 2);
        count = 0;
        for (const Slot& s : old) if (s.key != 0) insert(s.key, s.value);
    }
};

struct BlockPool {
    BlockSet blocks;                       // free mapped blocks
    UnmappedSet unmapped;                  // unmapped ranges of expandable segments, by (stream, address)
    bool is_small;                         // holds blocks of rounded size <= 1 MiB
    PrivatePool* owner;                    // nullptr for the default pools
    int64_t get_free_blocks_call_count = 0;  // the garbage collector's clock
    // The garbage collector's candidates: the free blocks of a large pool that are whole segments
    // (unsplit, not expandable), listed by gc_count_base, oldest first, with their count and the
    // sum of their gc_count_base. Their average age at clock c is c - sum / count, and the blocks
    // at least as old as any age are a prefix of the list, so a GC pass costs what it releases
    // instead of a walk of the whole pool.
    Block* gc_head = nullptr;
    Block* gc_tail = nullptr;
    int64_t gc_count = 0;
    int64_t gc_base_sum = 0;

    BlockPool(bool small, PrivatePool* owner_pool) : is_small(small), owner(owner_pool) {}

    // b has just entered the pool as a whole segment. Blocks enter with gc_count_base = the clock,
    // which never decreases, so the search from the tail stops at once.
    void gc_add(Block* b) {
        Block* before = gc_tail;
        while (before != nullptr && before->gc_count_base > b->gc_count_base) before = before->gc_prev;
        b->gc_prev = before;
        b->gc_next = before != nullptr ? before->gc_next : gc_head;
        if (b->gc_next != nullptr) b->gc_next->gc_prev = b; else gc_tail = b;
        if (before != nullptr) before->gc_next = b; else gc_head = b;
        b->gc_listed = true;
        ++gc_count;
        gc_base_sum += b->gc_count_base;
    }
    // b leaves the pool or stops being a whole segment (no-op when not listed).
    void gc_remove(Block* b) {
        if (!b->gc_listed) return;
        if (b->gc_prev != nullptr) b->gc_prev->gc_next = b->gc_next; else gc_head = b->gc_next;
        if (b->gc_next != nullptr) b->gc_next->gc_prev = b->gc_prev; else gc_tail = b->gc_prev;
        b->gc_prev = b->gc_next = nullptr;
        b->gc_listed = false;
        --gc_count;
        gc_base_sum -= b->gc_count_base;
    }
};

// Sort blocks into their pool's best-fit order (stream, size, address).
inline void sort_best_fit(std::vector<Block*>& blocks) {
    std::sort(blocks.begin(), blocks.end(), [](Block* x, Block* y) {
        return EntryBySize()(BlockSet::entry_of(x), BlockSet::entry_of(y));
    });
}

// A pool id, PyTorch's MempoolId_t: (0, 0) is the default pool, (0, n) a user-created pool
// (MemPool, graph_pool_handle), (n, 0) one a graph capture created for itself.
typedef std::pair<int64_t, int64_t> MempoolId;

// A private pool (a MemPool's or a CUDA graph's): its own small and large block pools, so its
// blocks are never handed to allocations outside it. Freed once nothing uses it (use_count 0,
// "freeable") and it holds no device memory (device_allocations 0).
struct PrivatePool {
    MempoolId id;
    int use_count = 1;               // MemPool objects, graphs and active routes holding it
    int64_t device_allocations = 0;  // segments and expandable reservations not yet given back
    int64_t reserved_bytes = 0;      // device memory its segments hold (mapped pages only)
    bool no_split = false;           // never split a block (MemPool(no_split=True))
    bool use_on_oom = false;         // its cached blocks may serve default-pool requests on OOM
    BlockPool large_blocks;
    BlockPool small_blocks;
    explicit PrivatePool(MempoolId pool_id)
        : id(pool_id), large_blocks(false, this), small_blocks(true, this) {}
};

// A routing entry (PyTorch's captures_underway): allocations that pass `filter` go to `pool`.
// Entries are scanned newest first, so the innermost route wins.
enum RouteFilterKind { ROUTE_THREAD = 0, ROUTE_CAPTURE = 1 };
struct Route {
    MempoolId id;
    int kind;          // RouteFilterKind
    uint64_t value;    // ROUTE_THREAD: the thread's key (current_thread_key); ROUTE_CAPTURE: capture id
    PrivatePool* pool;
    uint64_t seq;      // order of creation (1, 2, ...): the newest accepting route wins
};

// What the core remembers of a block used or freed while a capture is underway.
struct CaptureUses {
    // Stream uses that record_stream added while their stream was capturing in a routed capture,
    // with that capture's id: only captured work stands behind them, so the flush at that capture's
    // end drops them instead of recording events. They end with their capture (a later real use is
    // then safe), and a record_stream naming the stream outside a capture turns one real.
    std::vector<std::pair<uintptr_t, uint64_t>> captured_uses;
    std::vector<uintptr_t> markers;          // free markers: graph nodes every later use must follow
    bool has_markers = false;                // markers were recorded (else: wait for capture end)
    size_t next_marker = 0;                  // markers before it are known to precede the stream
    uint64_t defer_id = 0;                   // nonzero while deferred with markers (unique per free)
    size_t deferred_index = 0;               // its slot in the allocator's deferred_blocks
    // Last-use marks (record_stream(..., last_use=True)): a stream and its terminals at the mark.
    std::vector<std::pair<uintptr_t, std::vector<uintptr_t>>> last_use;
};

// A deferred block in a reuse index, with the defer_id it had when indexed: an entry whose block
// has since been released (or freed and deferred again) no longer matches and is skipped.
typedef std::pair<Block*, uint64_t> DeferredEntry;

// One stream's reuse state in one capture: the graph nodes known to precede its terminals
// (closed under parents; a bit per node of its capture's CaptureReuse, by dense id), and the
// blocks of that stream deferred with free markers, indexed by the first marker not known to
// precede yet. A malloc then does work for the nodes its walk newly finds and the blocks they
// make ready, not for every deferred block.
struct StreamReuse {
    std::vector<uint64_t> visited_bits;
    std::unordered_map<uintptr_t, std::vector<DeferredEntry>> waiting;   // marker node -> blocks
    std::vector<DeferredEntry> ready;        // every marker visited: free at the next malloc here

    bool visited(uint32_t id) const {
        return (id >> 6) < visited_bits.size() && (visited_bits[id >> 6] >> (id & 63)) & 1;
    }
    // Marks node `id` visited; true when it was not.
    bool visit(uint32_t id) {
        if ((id >> 6) >= visited_bits.size()) visited_bits.resize((id >> 6) + 1, 0);
        uint64_t bit = (uint64_t)1 << (id & 63);
        if (visited_bits[id >> 6] & bit) return false;
        visited_bits[id >> 6] |= bit;
        return true;
    }
    void unvisit(uint32_t id) { visited_bits[id >> 6] &= ~((uint64_t)1 << (id & 63)); }
};

static const uint32_t kNodeNotExpanded = UINT32_MAX;   // CaptureReuse.first_parent: not yet

// The reuse state of one capture. Its graph as far as the walks have seen it is shared by all its
// streams: each node gets a dense id, and its parents are asked of the backend once per capture
// (not once per stream), kept as ids, so a stream's walk over nodes another stream has seen is a
// loop over memory.
struct CaptureReuse {
    std::unordered_map<uintptr_t, StreamReuse> streams;
    std::unordered_map<uintptr_t, uint32_t> ids;   // node handle -> dense id
    std::vector<uintptr_t> handles;                // dense id -> node handle
    std::vector<uint32_t> first_parent;            // into parent_ids, or kNodeNotExpanded
    std::vector<uint32_t> parent_count;
    std::vector<uint32_t> parent_ids;
    std::vector<bool> waited_on;                   // some stream files a block under this marker

    uint32_t intern(uintptr_t node) {
        // find first: emplace would make (and free) a map node for every handle already known
        auto known = ids.find(node);
        if (known != ids.end()) return known->second;
        uint32_t id = (uint32_t)handles.size();
        try {
            handles.push_back(node);
            first_parent.push_back(kNodeNotExpanded);
            parent_count.push_back(0);
            waited_on.push_back(false);
            ids.emplace(node, id);
        } catch (...) {     // std::bad_alloc: as it was
            handles.resize(id);
            first_parent.resize(id);
            parent_count.resize(id);
            waited_on.resize(id);
            throw;
        }
        return id;
    }
    // The dense id of `node`, or -1 when no walk has seen it.
    int64_t find(uintptr_t node) const {
        auto found = ids.find(node);
        return found == ids.end() ? -1 : (int64_t)found->second;
    }
    bool expanded(uint32_t id) const { return first_parent[id] != kNodeNotExpanded; }
    // Record the parents of node `id` (handles, as the backend gave them).
    void set_parents(uint32_t id, const std::vector<uintptr_t>& parents) {
        uint32_t first = (uint32_t)parent_ids.size();
        for (uintptr_t p : parents) {
            uint32_t pid = intern(p);
            parent_ids.push_back(pid);
        }
        first_parent[id] = first;
        parent_count[id] = (uint32_t)parents.size();
    }
    uint32_t parent(uint32_t id, uint32_t i) const { return parent_ids[first_parent[id] + i]; }
    bool is_waited_on(uint32_t id) const { return waited_on[id]; }
    void set_waited_on(uint32_t id) { waited_on[id] = true; }
};

// The settings the policy reads (bytes unless noted), copied from a config object.
struct Settings {
    // The scalars first: the cache-hit path reads them and roundup_divisions[0..1] only.
    size_t max_split_size = SIZE_MAX;            // blocks >= this are "oversize"; SIZE_MAX: unlimited
    size_t max_non_split_rounding_size = 20971520;
    size_t allowed_memory_maximum = (size_t)-1;  // SIZE_MAX: no per-process limit (0 allows nothing)
    double gc_threshold = 0.0;                   // fraction of allowed_memory_maximum; 0: off
    bool expandable_segments = false;
    bool recycle_pages = false;                  // recycle_pages (pyalloc only, expandable segments)
    bool release_lock_on_malloc = false;         // release_lock_on_cudamalloc
    bool graph_reuse = false;                    // graph_capture_record_stream_reuse (#162186)
    bool graph_last_use = false;                 // graph_capture_last_use_marks (pyalloc only)
    bool graph_cross_stream_reuse = false;       // graph_capture_cross_stream_reuse (pyalloc only)
    double memory_fraction = 1.0;
    // event_poll_streams (pyalloc only): streams whose oldest events a cache-hit malloc polls,
    // in turn (a miss polls all first); 0: every stream on every malloc, as PyTorch.
    uint32_t event_poll_streams = 0;
    size_t roundup_divisions[16] = {0};          // roundup_power2_divisions per 1 MiB..32 GiB bucket
};

// Statistics, PyTorch's shape (current, peak, cumulative increase and decrease per statistic and
// pool size class), kept so that the hot path updates as little as possible (10 to 20 updates
// run per malloc/free pair):
//  * a decrease touches only `current`: the cumulative decrease is derived, freed = base +
//    allocated - current, where base is `current` at the last reset of the cumulative counts;
//  * every change goes to "all" and exactly one pool, so the "all" entry keeps only current and
//    peak: its cumulative counts are the sums of the pools';
//  * one statistic is one StatRow, whose hot part (all but the bases) is one aligned cache
//    line: an update touches one line.
// Forced inline: GCC otherwise keeps some out of line, a call per split or merge.
struct StatEntry {
    int64_t current;
    int64_t peak;
    int64_t allocated;   // cumulative increase since the last reset_accumulated
};

struct alignas(64) StatRow {
    int64_t all_current;
    int64_t all_peak;
    StatEntry pool[2];   // [small_pool, large_pool]
    int64_t base[2];     // pool[i].current at the last reset_accumulated (off the hot line)
};

// A statistic without pools (oversize allocations and segments).
struct Stat {
    int64_t current;
    int64_t peak;
    int64_t allocated;   // cumulative increase since the last reset_accumulated
    int64_t base;        // current at that reset
};

#define PYALLOC_INLINE inline __attribute__((always_inline))

// A single statistic (not a row) changed by delta.
PYALLOC_INLINE void stat_add(Stat* s, int64_t delta) {
    s->current += delta;
    if (delta > 0) {
        s->allocated += delta;
        if (s->current > s->peak) s->peak = s->current;
    }
}
// Row's "all" entry and entry pool_slot (1 small, 2 large) increased by amount >= 0.
PYALLOC_INLINE void stat_up(StatRow* row, int pool_slot, int64_t amount) {
    row->all_current += amount;
    if (row->all_current > row->all_peak) row->all_peak = row->all_current;
    StatEntry* s = &row->pool[pool_slot - 1];
    s->current += amount;
    s->allocated += amount;
    if (s->current > s->peak) s->peak = s->current;
}
// Row's "all" entry and entry pool_slot decreased by amount >= 0.
PYALLOC_INLINE void stat_down(StatRow* row, int pool_slot, int64_t amount) {
    row->all_current -= amount;
    row->pool[pool_slot - 1].current -= amount;
}
// Row's "all" entry and the entry of a pool's size class changed by delta (either sign).
PYALLOC_INLINE void stat_pool(StatRow* row, bool small_pool, int64_t delta) {
    if (delta >= 0) stat_up(row, small_pool ? 1 : 2, delta);
    else stat_down(row, small_pool ? 1 : 2, -delta);
}
// `amount` bytes of a row's entry from_slot counted in entry to_slot from now on (recycle_pages: a
// physical page changes size class): "all" and both entries' cumulative increase and decrease
// stay as they are (the bases move with the currents), since nothing was allocated or freed.
PYALLOC_INLINE void stat_move(StatRow* row, int from_slot, int to_slot, int64_t amount) {
    row->pool[from_slot - 1].current -= amount;
    row->base[from_slot - 1] -= amount;
    StatEntry* t = &row->pool[to_slot - 1];
    t->current += amount;
    row->base[to_slot - 1] += amount;
    if (t->current > t->peak) t->peak = t->current;
}
// Entry p of a row (0 all, 1 small_pool, 2 large_pool): current, peak, cumulative increase and
// decrease.
inline int64_t stat_current(const StatRow* row, int p) {
    return p == 0 ? row->all_current : row->pool[p - 1].current;
}
inline int64_t stat_peak(const StatRow* row, int p) {
    return p == 0 ? row->all_peak : row->pool[p - 1].peak;
}
inline int64_t stat_allocated(const StatRow* row, int p) {
    return p == 0 ? row->pool[0].allocated + row->pool[1].allocated : row->pool[p - 1].allocated;
}
inline int64_t stat_freed(const StatRow* row, int p) {
    if (p == 0) return stat_freed(row, 1) + stat_freed(row, 2);
    return row->base[p - 1] + row->pool[p - 1].allocated - row->pool[p - 1].current;
}
inline void stat_reset_peak(StatRow* row) {
    row->all_peak = row->all_current;
    for (int i = 0; i < 2; ++i) row->pool[i].peak = row->pool[i].current;
}
inline void stat_reset_accumulated(StatRow* row) {
    for (int i = 0; i < 2; ++i) { row->pool[i].allocated = 0; row->base[i] = row->pool[i].current; }
}
inline int64_t single_freed(const Stat* s) { return s->base + s->allocated - s->current; }
inline void single_reset_accumulated(Stat* s) { s->allocated = 0; s->base = s->current; }

// One allocator event for memory history (PyTorch's TraceEntry). Strings and stacks are kept
// by id in Python-side tables, so recording an entry allocates nothing.
struct TraceEntry {
    int32_t action;
    uintptr_t addr;
    size_t size;
    uintptr_t stream;
    int64_t time_us;
    uint32_t metadata_id;
    uint32_t context_id;
};

// A bounded ring buffer of TraceEntry: appends until full, then overwrites the oldest entry.
struct TraceRing {
    std::vector<TraceEntry> entries;
    size_t capacity = 0;
    size_t next = 0;          // slot of the next write once the buffer is full
    uint64_t total = 0;       // entries ever recorded (total > capacity means it wrapped)

    void reset(size_t cap) { entries.clear(); entries.reserve(cap < 4096 ? cap : 4096); capacity = cap; next = 0; total = 0; }
    void push(const TraceEntry& e) {
        if (capacity == 0) return;
        if (entries.size() < capacity) entries.push_back(e);
        else { entries[next] = e; next = (next + 1) % capacity; }
        ++total;
    }
    // i-th entry in chronological order.
    const TraceEntry& at(size_t i) const {
        return entries.size() < capacity ? entries[i] : entries[(next + i) % capacity];
    }
};

// recycle_pages: an event recorded on an allocation stream when a growth looked for pages to take
// (_expandable.pyx). Once it has completed, the work queued on `stream` before it is over, and
// with it every use of the blocks of that stream stamped with a free_epoch below `epoch`.
struct EpochMark {
    uintptr_t stream;
    uintptr_t event;
    uint64_t epoch;
};

// What one device allocator records and counts, apart from its pools and events: the state that
// the commit steps (_state.pxd) and the slow-path modules (expandable segments) update.
struct CoreState {
    // What the cache-hit path reads, together; then the statistics it updates.
    Settings settings;
    bool history_on = false;
    uint32_t skip_actions_mask = 0;
    uint32_t (*metadata_now)() = nullptr;      // this thread's metadata id; set by _core, its owner
    std::vector<Block*> spare_blocks;          // recycled Block objects
    // By statistic (ST_*), on the heap: the allocator object that holds this state is only
    // 16-byte aligned, and a row must start a cache line to be one.
    StatRow* stats = new StatRow[9]();
    Stat oversize_allocations = {};
    Stat oversize_segments = {};
    int64_t num_alloc_retries = 0;
    int64_t num_ooms = 0;
    int64_t num_sync_all_streams = 0;
    int64_t num_device_alloc = 0;
    int64_t num_device_free = 0;
    size_t stat_max_split_size = SIZE_MAX;     // as when constructed, like PyTorch
    size_t total_allocated_memory = 0;         // bytes in live segments, mapped pages and free_pages
    std::vector<ExpandableSegment*> expandable_segments;
    // recycle_pages: physical pages (backend handles of 2 MiB) mapped nowhere, by the size class
    // whose reserved bytes count them ([0] small_pool, [1] large_pool: where they were mapped);
    // and the pages mapped again from them since construction.
    std::vector<uintptr_t> free_pages[2];
    int64_t page_remaps = 0;
    // recycle_pages: segments a growth left with nothing mapped. Their address space is given
    // back by the next growth (before it changes anything) or the page pool's release, not by the
    // growth that emptied them: a failing cuMemAddressFree after the growth succeeded could then
    // neither be undone nor reported without changing what the malloc did.
    std::vector<ExpandableSegment*> emptied_segments;
    // recycle_pages: when a free block's pages may be unmapped without synchronizing the device
    // (Block::free_epoch). Blocks stamped below synced_epoch: the device was synchronized since;
    // below completed_epoch[their stream]: an EpochMark recorded on it after them has completed.
    uint64_t free_epoch = 1;
    uint64_t synced_epoch = 0;
    std::vector<EpochMark> epoch_marks;        // outstanding, oldest first
    std::vector<uintptr_t> spare_mark_events;  // created, idle events for the next marks
    std::unordered_map<uintptr_t, uint64_t> completed_epoch;
    // Handles of the streams reap_dropped_streams destroyed, until a stream object with the handle
    // is kept again: no mark may be recorded on them (an event recorded on a destroyed stream is
    // undefined behaviour), and the work of their blocks is over.
    std::unordered_set<uintptr_t> destroyed_streams;
    TraceRing history;

    CoreState() = default;
    CoreState(const CoreState&) = delete;
    CoreState& operator=(const CoreState&) = delete;
    ~CoreState() { delete[] stats; }
};

// Appends one trace entry to the history ring (the caller checked history_on and the action's
// skip bit): out of line, see PYALLOC_COLD. Times are wall-clock microseconds.
PYALLOC_COLD inline void trace_record(CoreState* st, int32_t action, uintptr_t addr, size_t size,
                                      uintptr_t stream, uint32_t context_id) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    TraceEntry e;
    e.action = action;
    e.addr = addr;
    e.size = size;
    e.stream = stream;
    e.time_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    e.metadata_id = st->metadata_now();
    e.context_id = context_id;
    st->history.push(e);
}

// The calling thread's key for ROUTE_THREAD filters (the lock's owner id: unique among live threads).
inline uint64_t current_thread_key() { return (uint64_t)AllocatorLock::self(); }

}  // namespace pyalloc
