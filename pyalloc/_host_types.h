// Data of the caching host (pinned) allocator, _host.pyx: its blocks and statistics, and the
// parallel page touching of the register path. Separate from _types.h: the device core never
// sees host blocks, and the host allocator uses none of the device structures.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

namespace pyalloc_host {

// How a block's memory was obtained, which decides how it goes back (cuMemFreeHost, or
// cuMemHostUnregister then free, or not at all for a block carved from the reserve segment).
// UNREGISTERED: a registered block whose unregistering worked and whose free() then failed.
enum Origin : int { HOST_ALLOC = 0, REGISTERED = 1, RESERVED = 2, UNREGISTERED = 3 };

// One pinned block: a whole power-of-two allocation (the host allocator never splits).
struct HostBlock {
    uintptr_t ptr = 0;
    size_t size = 0;                    // bytes, a power of two
    bool allocated = false;             // handed out and not freed
    size_t event_count = 0;             // events recorded at its free and not yet seen completed
    int origin = HOST_ALLOC;
    // Its current use was captured into a CUDA graph: handed out while the allocating stream
    // captured (PyTorch's was_allocated_during_stream_capture_), or named by record_event for a
    // stream that was capturing. Such a block gets no event at its free (none can be recorded or
    // queried during a capture); with streams recorded it is kept, never reused.
    bool captured = false;
    uintptr_t stream = 0;               // the stream malloc was given (0: the legacy stream)
    uint32_t stack_id = 0;              // Python stack of its malloc, for the memory history
    std::vector<uintptr_t> streams;     // streams record_event named since it was handed out
};

// PyTorch's Stat: current value, its peak, and the totals of increases and decreases.
struct Stat {
    int64_t current = 0, peak = 0, allocated = 0, freed = 0;
    void increase(int64_t n) {
        current += n; allocated += n;
        if (current > peak) peak = current;
    }
    void decrease(int64_t n) { current -= n; freed += n; }
    void reset_accumulated() { allocated = 0; freed = 0; }
    void reset_peak() { peak = current; }
};

// PyTorch's DurationStat (microseconds): total, count, largest and smallest call.
struct DurationStat {
    int64_t total = 0, count = 0, max = 0, min = 0;
    void increase(int64_t us) {
        total += us; count += 1;
        if (us > max) max = us;
        if (min == 0 || us < min) min = us;
    }
    void reset_accumulated() { total = 0; count = 0; }
    void reset_peak() { max = 0; min = 0; }
};

constexpr int kBuckets = 64;            // free lists: one per power of two, index log2(size)

inline int size_index(size_t size) {    // ceil(log2(size)) for size >= 1
    return size <= 1 ? 0 : 64 - __builtin_clzll((unsigned long long)(size - 1));
}

inline size_t power_of_two_ceil(size_t n) {   // n in [1, 2**63]
    return n <= 1 ? 1 : (size_t)1 << size_index(n);
}

// Touch one byte of every 4 KiB page of [ptr, ptr + size) with `threads` threads, each its own
// contiguous share, so that the kernel maps the pages before cuMemHostRegister locks them (the
// driver's global lock is then held for less time). One thread when the range has fewer pages than
// threads, as PyTorch does.
inline void touch_pages(uintptr_t ptr, size_t size, int threads) {
    const size_t page = 4096;
    auto touch = [ptr, size, page](size_t i, size_t n) {
        uintptr_t start = ptr + size * i / n;
        uintptr_t end = (i == n - 1) ? ptr + size : start + size / n;
        for (uintptr_t p = (start + page - 1) & ~(uintptr_t)(page - 1); p < end; p += page)
            std::memset(reinterpret_cast<void*>(p), 0, 1);
    };
    if (threads <= 1 || size < page * (size_t)threads) {
        touch(0, 1);
        return;
    }
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int i = 0; i < threads; ++i) pool.emplace_back(touch, (size_t)i, (size_t)threads);
    for (auto& t : pool) t.join();
}

}  // namespace pyalloc_host

#include <chrono>

namespace pyalloc_host {

// An event recorded at a block's free, for a stream that used it: the block returns to its free
// list when every such event has completed.
struct PendingEvent {
    uintptr_t event;
    int device;                         // the device the event was made for (its pool)
    HostBlock* block;
};
typedef std::deque<PendingEvent> EventQueue;

inline void erase_at(EventQueue& q, size_t i) { q.erase(q.begin() + (std::ptrdiff_t)i); }

inline int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The memory history (HostAllocator.record_memory_history): one entry per event, in the device
// allocator's trace format (action, address, bytes, stream, microseconds since the epoch, stack).
enum HostAction : int32_t {
    H_ALLOC = 0, H_FREE_REQUESTED = 1, H_FREE_COMPLETED = 2, H_SEGMENT_ALLOC = 3, H_SEGMENT_FREE = 4
};

struct HostTraceEntry {
    int32_t action;
    uintptr_t addr;
    size_t size;
    uintptr_t stream;
    int64_t time_us;
    uint32_t stack_id;
};

// A bounded history: appends until `capacity` entries, then drops the oldest.
struct HostTrace {
    std::deque<HostTraceEntry> entries;
    size_t capacity = 0;
    uint32_t skip_mask = 0;             // bit 1 << action: not recorded
    void push(int32_t action, uintptr_t addr, size_t size, uintptr_t stream, uint32_t stack_id) {
        if (capacity == 0 || (skip_mask >> action) & 1u) return;
        HostTraceEntry e;
        e.action = action; e.addr = addr; e.size = size; e.stream = stream; e.stack_id = stack_id;
        e.time_us = std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::system_clock::now().time_since_epoch()).count();
        if (entries.size() >= capacity) entries.pop_front();
        entries.push_back(e);
    }
    void resize(size_t cap) {
        capacity = cap;
        while (entries.size() > cap) entries.pop_front();
    }
};

}  // namespace pyalloc_host
