# Cython declarations of _types.h, written once: every module that touches blocks, pools or the
# allocator's state cimports them from here.
from libc.stdint cimport uintptr_t, int64_t, uint32_t, int32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set

cdef extern from "_types.h" namespace "pyalloc" nogil:
    cdef cppclass BlockPool
    cdef cppclass PrivatePool

    cdef struct EpochMark:
        uintptr_t stream
        uintptr_t event
        uint64_t epoch

    cdef struct ExpandableSegment:
        uintptr_t base
        size_t size
        size_t page_size
        uintptr_t stream
        BlockPool* pool
        size_t mapped

    cdef cppclass Block:
        uintptr_t stream
        size_t size
        uintptr_t ptr
        size_t requested_size
        BlockPool* pool
        Block* prev
        Block* next
        bint allocated
        bint mapped
        bint expandable
        bint buffer_owned
        ExpandableSegment* segment
        int event_count
        int64_t gc_count_base
        vector[uintptr_t] stream_uses
        uint32_t metadata_id
        uint32_t context_id
        uint32_t segment_context_id
        void* py_address
        uintptr_t py_address_value
        bint gc_listed
        Block* gc_prev
        Block* gc_next
        uint64_t free_epoch
        unordered_set[uintptr_t]* use_index
        bint is_split()
        bint uses_stream(uintptr_t)
        void index_use(uintptr_t) except +
        void drop_use_index()
        bint new_use_indexed()

    cdef cppclass BlockSet:
        cppclass iterator:
            Block* operator*()
            iterator operator++()
            iterator operator--()
            bint operator==(iterator)
            bint operator!=(iterator)
        iterator begin()
        iterator end()
        iterator lower_bound(Block*)
        iterator lower_bound(uintptr_t stream, size_t size)
        void erase(Block*)
        iterator erase_at(iterator)
        void insert(Block*)
        void reposition_smaller(Block*)
        void reposition_larger(Block*)
        size_t size()
        bint empty()
        bint contains(Block*)

    cdef cppclass AllocatorLock:
        bint try_lock()
        void lock()
        void unlock()
        bint held()

    cdef cppclass UnmappedSet:
        cppclass iterator:
            Block* operator*()
            iterator operator++()
            iterator operator--()
            bint operator==(iterator)
            bint operator!=(iterator)
        iterator begin()
        iterator end()
        iterator lower_bound(Block*)
        iterator upper_bound(Block*)
        iterator find(Block*)
        size_t erase(Block*)
        pair[iterator, bint] insert(Block*)
        size_t size()

    cdef cppclass BlockPool:
        BlockSet blocks
        UnmappedSet unmapped
        bint is_small
        PrivatePool* owner
        int64_t get_free_blocks_call_count
        Block* gc_head
        int64_t gc_count
        int64_t gc_base_sum
        BlockPool(bint, PrivatePool*)
        void gc_add(Block*)
        void gc_remove(Block*)

    ctypedef pair[int64_t, int64_t] MempoolId

    void sort_best_fit(vector[Block*]&)

    cdef cppclass PrivatePool:
        MempoolId id
        int use_count
        int64_t device_allocations
        int64_t reserved_bytes
        bint no_split
        bint use_on_oom
        BlockPool large_blocks
        BlockPool small_blocks
        PrivatePool(MempoolId)

    cdef enum RouteFilterKind:
        ROUTE_THREAD
        ROUTE_CAPTURE

    cdef struct Route:
        MempoolId id
        int kind
        uint64_t value
        PrivatePool* pool
        uint64_t seq

    cdef cppclass ActiveMap:
        ActiveMap()
        Block* get(uintptr_t)
        void erase(uintptr_t)
        void insert(uintptr_t, Block*)
        size_t size()
        void values(vector[Block*]*)

    cdef struct TraceEntry:
        int32_t action
        uintptr_t addr
        size_t size
        uintptr_t stream
        int64_t time_us
        uint32_t metadata_id
        uint32_t context_id

    cdef cppclass TraceRing:
        size_t capacity
        uint64_t total
        void reset(size_t)
        void push(const TraceEntry&)
        const TraceEntry& at(size_t)
        vector[TraceEntry] entries

    # Statistics: C++ so that they can be forced inline (GCC kept stat_pool out of line, a call
    # per split and merge).
    cdef struct StatEntry:
        int64_t current
        int64_t peak
        int64_t allocated
    cdef struct StatRow:
        int64_t all_current
        int64_t all_peak
        StatEntry pool[2]
        int64_t base[2]
    cdef struct Stat:
        int64_t current
        int64_t peak
        int64_t allocated
        int64_t base
    void stat_add(Stat* s, int64_t delta)
    void stat_up(StatRow* row, int pool_slot, int64_t amount)
    void stat_down(StatRow* row, int pool_slot, int64_t amount)
    void stat_pool(StatRow* row, bint small_pool, int64_t delta)
    void stat_move(StatRow* row, int from_slot, int to_slot, int64_t amount)
    int64_t stat_current(const StatRow* row, int p)
    int64_t stat_peak(const StatRow* row, int p)
    int64_t stat_allocated(const StatRow* row, int p)
    int64_t stat_freed(const StatRow* row, int p)
    void stat_reset_peak(StatRow* row)
    void stat_reset_accumulated(StatRow* row)
    int64_t single_freed(const Stat* s)
    void single_reset_accumulated(Stat* s)

    cdef cppclass CaptureUses:
        vector[pair[uintptr_t, uint64_t]] captured_uses
        vector[uintptr_t] markers
        bint has_markers
        size_t next_marker
        uint64_t defer_id
        size_t deferred_index
        vector[pair[uintptr_t, vector[uintptr_t]]] last_use

    cdef cppclass DeferredEntry:          # std::pair<Block*, uint64_t>
        Block* first
        uint64_t second
        DeferredEntry()
        DeferredEntry(Block*, uint64_t)

    cdef cppclass StreamReuse:
        unordered_map[uintptr_t, vector[DeferredEntry]] waiting
        vector[DeferredEntry] ready
        bint visited(uint32_t)
        bint visit(uint32_t)
        void unvisit(uint32_t)

    cdef cppclass CaptureReuse:
        unordered_map[uintptr_t, StreamReuse] streams
        vector[uintptr_t] handles
        vector[uint32_t] parent_count
        uint32_t intern(uintptr_t) except +
        int64_t find(uintptr_t)
        bint expanded(uint32_t)
        void set_parents(uint32_t, vector[uintptr_t]&) except +
        uint32_t parent(uint32_t, uint32_t)
        bint is_waited_on(uint32_t)
        void set_waited_on(uint32_t)

    cdef cppclass Settings:
        size_t max_split_size
        size_t max_non_split_rounding_size
        size_t roundup_divisions[16]
        double gc_threshold
        bint expandable_segments
        bint recycle_pages
        bint release_lock_on_malloc
        bint graph_reuse
        bint graph_last_use
        uint32_t event_poll_streams
        bint graph_cross_stream_reuse
        size_t allowed_memory_maximum
        double memory_fraction

    cdef cppclass CoreState:
        Settings settings
        StatRow* stats
        Stat oversize_allocations
        Stat oversize_segments
        int64_t num_alloc_retries
        int64_t num_ooms
        int64_t num_sync_all_streams
        int64_t num_device_alloc
        int64_t num_device_free
        size_t stat_max_split_size
        size_t total_allocated_memory
        vector[Block*] spare_blocks
        vector[ExpandableSegment*] expandable_segments
        vector[uintptr_t] free_pages[2]
        int64_t page_remaps
        vector[ExpandableSegment*] emptied_segments
        uint64_t free_epoch
        uint64_t synced_epoch
        vector[EpochMark] epoch_marks
        vector[uintptr_t] spare_mark_events
        unordered_map[uintptr_t, uint64_t] completed_epoch
        unordered_set[uintptr_t] destroyed_streams
        TraceRing history
        bint history_on
        uint32_t skip_actions_mask
        uint32_t (*metadata_now)() noexcept nogil

    # Appends a trace entry (the caller checked history_on and the skip mask); out of line.
    void trace_record(CoreState* st, int32_t action, uintptr_t addr, size_t size, uintptr_t stream,
                      uint32_t context_id)
    uint64_t current_thread_key()


# Statistics, in PyTorch's names and order (the rows of CoreState.stats; each row has an all /
# small_pool / large_pool slot).
cdef enum:
    ST_ALLOCATION = 0
    ST_SEGMENT
    ST_ACTIVE
    ST_INACTIVE_SPLIT
    ST_ALLOCATED_BYTES
    ST_RESERVED_BYTES
    ST_ACTIVE_BYTES
    ST_INACTIVE_SPLIT_BYTES
    ST_REQUESTED_BYTES
    NUM_STATS

# Trace actions, in the order of PyTorch's TraceEntry::Action.
cdef enum:
    TR_ALLOC = 0
    TR_FREE_REQUESTED
    TR_FREE_COMPLETED
    TR_SEGMENT_ALLOC
    TR_SEGMENT_FREE
    TR_SEGMENT_MAP
    TR_SEGMENT_UNMAP
    TR_SNAPSHOT
    TR_OOM


# Branch hints (the macros of Cython's generated code): the cache-hit path marks its rare cases,
# so that the compiler lays the common case out as straight-line code in few cache lines.
cdef extern from *:
    bint likely(bint) nogil
    bint unlikely(bint) nogil
