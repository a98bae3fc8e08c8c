// pyalloc core data structures: Block, BlockPool, statistics and the history ring buffer.
//
// Only plain data, orderings and containers live here; every decision that uses them (best fit,
// split, merge, release, statistics updates) is written in _core.pyx. The structs are C++ because
// the ordered sets need comparators and node-pooling allocators, which Cython cannot declare.
//
// Vocabulary:
//   segment  one device allocation (a cuMemAlloc, or later one mapped range of an expandable segment)
//   block    a contiguous byte range of one segment; the blocks of a segment form a linked list
//   pool     the free blocks of one size class (small <= 1 MiB < large) of one owner (default or private)
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <set>
#include <unordered_map>
#include <vector>

namespace pyalloc {

struct BlockPool;

// Invariants (checked by DeviceCachingAllocator._check_invariants in tests):
//  * prev->ptr + prev->size == ptr and next->ptr == ptr + size; prev/next belong to the same segment.
//  * A block is in pool->blocks iff it is mapped, not allocated, event_count == 0 and
//    stream_uses is empty ("free"). Two free blocks are never neighbours (they would have merged).
//  * A block is in the allocator's active map iff it is allocated or still waits for events.
struct Block {
    uintptr_t stream = 0;          // allocation stream; a block is only reused on this stream
    size_t size = 0;               // bytes, a multiple of 512
    uintptr_t ptr = 0;             // device address
    size_t requested_size = 0;     // bytes the caller asked for (unrounded) while allocated
    BlockPool* pool = nullptr;     // owning pool
    Block* prev = nullptr;         // neighbour at lower address in the same segment
    Block* next = nullptr;         // neighbour at higher address in the same segment
    bool allocated = false;        // handed out and not yet freed by the caller
    bool mapped = true;            // false for unmapped address space of an expandable segment
    bool expandable = false;       // part of an expandable segment
    int event_count = 0;           // outstanding cross-stream events recorded at free
    int64_t gc_count_base = 0;     // pool->get_free_blocks_call_count when last inserted
    std::vector<uintptr_t> stream_uses;  // streams added by record_stream (never the alloc stream)
    uint32_t metadata_id = 0;      // user metadata current when allocated (0 = none)
    uint32_t context_id = 0;       // captured stack of the hand-out (0 = none)
    uint32_t segment_context_id = 0;  // stack of the segment allocation, on the head block

    bool is_split() const { return prev != nullptr || next != nullptr; }
};

// Best-fit order: (stream, size, address). lower_bound with a key block of the request's stream and
// rounded size finds the smallest block of that stream that fits, lowest address first on ties.
struct BlockBySize {
    bool operator()(const Block* a, const Block* b) const {
        if (a->stream != b->stream) return a->stream < b->stream;
        if (a->size != b->size) return a->size < b->size;
        return a->ptr < b->ptr;
    }
};

// Address order within a stream, for unmapped ranges of expandable segments.
struct BlockByAddress {
    bool operator()(const Block* a, const Block* b) const {
        if (a->stream != b->stream) return a->stream < b->stream;
        return a->ptr < b->ptr;
    }
};

// Ordered set of free blocks that recycles its tree nodes. A cache hit removes one block and
// inserts its shifted remainder; a free removes a merged neighbour and inserts the merged block.
// Reusing the extracted node for the next insertion (C++17 node handles) keeps both paths free of
// calls to operator new/delete, which otherwise dominate their cost.
template <typename Compare>
struct RecyclingSet {
    typedef std::set<Block*, Compare> Set;
    typedef typename Set::iterator iterator;
    Set items;
    std::vector<typename Set::node_type> spare_nodes;

    iterator begin() { return items.begin(); }
    iterator end() { return items.end(); }
    iterator lower_bound(Block* key) { return items.lower_bound(key); }
    iterator find(Block* key) { return items.find(key); }
    size_t size() const { return items.size(); }
    bool empty() const { return items.empty(); }
    bool contains(Block* b) const { return items.find(b) != items.end(); }

    void insert(Block* b) {
        if (spare_nodes.empty()) { items.insert(b); return; }
        typename Set::node_type node = std::move(spare_nodes.back());
        spare_nodes.pop_back();
        node.value() = b;
        items.insert(std::move(node));
    }
    // Removes the element at `it` and returns the iterator after it.
    iterator erase(iterator it) {
        iterator after = std::next(it);
        spare_nodes.push_back(items.extract(it));
        return after;
    }
    // Removes `b` (which must be present, compared by its current key).
    void erase(Block* b) {
        iterator it = items.find(b);
        if (it != items.end()) spare_nodes.push_back(items.extract(it));
    }
};

typedef RecyclingSet<BlockBySize> BlockSet;
typedef RecyclingSet<BlockByAddress> UnmappedSet;

// Pointer -> Block of every block handed out or waiting for events; node handles recycled as above.
struct ActiveMap {
    typedef std::unordered_map<uintptr_t, Block*> Map;
    typedef Map::iterator iterator;
    Map items;
    std::vector<Map::node_type> spare_nodes;

    iterator begin() { return items.begin(); }
    iterator end() { return items.end(); }
    iterator find(uintptr_t ptr) { return items.find(ptr); }
    size_t size() const { return items.size(); }

    void insert(uintptr_t ptr, Block* b) {
        if (spare_nodes.empty()) { items.emplace(ptr, b); return; }
        Map::node_type node = std::move(spare_nodes.back());
        spare_nodes.pop_back();
        node.key() = ptr;
        node.mapped() = b;
        items.insert(std::move(node));
    }
    void erase(uintptr_t ptr) {
        iterator it = items.find(ptr);
        if (it != items.end()) spare_nodes.push_back(items.extract(it));
    }
};

struct BlockPool {
    BlockSet blocks;                       // free mapped blocks
    UnmappedSet unmapped;                  // unmapped ranges of expandable segments
    bool is_small;                         // holds blocks of rounded size <= 1 MiB
    int64_t owner_id;                      // 0 for the default pools, else a private pool's id
    int64_t get_free_blocks_call_count = 0;  // the garbage collector's clock

    BlockPool(bool small, int64_t owner) : is_small(small), owner_id(owner) {}
};

// One statistic, PyTorch's shape: current value, its peak, and the cumulative increases/decreases.
struct Stat {
    int64_t current = 0;
    int64_t peak = 0;
    int64_t allocated = 0;
    int64_t freed = 0;

    void add(int64_t delta) {
        current += delta;
        if (current > peak) peak = current;
        if (delta > 0) allocated += delta; else freed -= delta;
    }
    void reset_peak() { peak = current; }
    void reset_accumulated() { allocated = 0; freed = 0; }
};

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

// Metadata current in this thread (an id into the core's table of strings; 0 = none).
inline thread_local uint32_t current_metadata_id = 0;

}  // namespace pyalloc
