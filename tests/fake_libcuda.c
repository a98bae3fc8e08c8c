/* A fake libcuda.so.1 for testing pyalloc's CUDA backend on machines without a GPU.
 *
 * cuda-bindings finds every driver function through cuGetProcAddress_v2, so exporting that (plus
 * cuDriverGetVersion) is enough for it to load this library in place of the real driver when it
 * is first on LD_LIBRARY_PATH. It models just what CudaDevice uses:
 *   - FAKE_CUDA_DEVICES devices (default 2), FAKE_CUDA_MEMORY bytes each (default 1 GiB);
 *   - primary contexts with a refcount, a per-thread current context;
 *   - cuMemAlloc handing out addresses (never dereferenced) from a per-device range, failing with
 *     CUDA_ERROR_OUT_OF_MEMORY beyond the capacity, and CUDA_ERROR_INVALID_CONTEXT without a
 *     current context, as the real driver does;
 *   - streams as opaque handles with work that the test launches and completes
 *     (fake_launch / fake_complete), and events that complete when their stream's work does;
 *   - fault injection: fake_fail_next(name, code) makes the next call of `name` return `code`
 *     (fake_fail_after(name, skip, code): the call after the next `skip` ones), and
 *     FAKE_CUDA_HIDE=name leaves one function out of cuGetProcAddress_v2's answers;
 *   - stream capture: cuStreamBeginCapture/EndCapture with a process-wide capture id counter;
 *     while a stream captures, fake_launch adds nodes to its graph instead of queueing work, each
 *     new node depending on the stream's terminal nodes (fake_capture_node adds a node after
 *     them or a new root beside them); cuStreamGetCaptureInfo reports the terminals,
 *     cuGraphNodeGetDependencies a node's parents; cuGraphInstantiateWithFlags/cuGraphLaunch
 *     replay a graph as work on a stream; bad graph, node and executable handles are errors;
 *     an event recorded in a capture forks it: a stream that waits on it joins the capture after
 *     the event's nodes (or, in it already, adds them to its terminals), and cuStreamEndCapture
 *     on the stream that began it is CUDA_ERROR_STREAM_CAPTURE_UNJOINED unless every joined
 *     stream's terminals precede the origin's (joined back), ..._UNMATCHED on a joined stream;
 *     a capturing stream's wait on an event recorded outside it is ..._ISOLATION, a wait that
 *     would merge two captures ..._MERGE; a captured cuMemsetD8Async is a node;
 *   - virtual memory (expandable segments): address reservations, physical allocations counted
 *     against the device's capacity, maps and unmaps (no memory behind any of them);
 *   - capture modes as the driver documents them (cuThreadExchangeStreamCaptureMode): a thread in
 *     global mode may not make "potentially unsafe" calls while any thread captures in global
 *     mode, nor any thread while it captures itself in a non-relaxed mode; such calls (here the
 *     memory calls, cuEventQuery, cuEventSynchronize) fail with
 *     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the conflicting captures; querying or
 *     synchronizing an event recorded in a capture fails with CUDA_ERROR_CAPTURED_EVENT;
 *   - a log of the memory calls with this thread's capture mode at each, and of the mode
 *     exchanges (fake_log, fake_log_reset), for checking that calls are relaxed and restored;
 *   - what the conformance suite's CudaTestDevice (tests/backends.py) drives a GPU with:
 *     cuStreamCreate/cuStreamDestroy (a destroyed stream's handle is handed out again, as the
 *     driver does), mapped host memory (cuMemHostAlloc, cuMemHostGetDevicePointer: the same
 *     address, cuMemFreeHost), cuStreamWaitValue32 (a unit of work that completes once the host
 *     word reaches the value: polled when an event is queried), cuStreamWaitEvent (ordering not
 *     modelled outside capture), and cuMemRetainAllocationHandle over the mapped ranges. The
 *     synchronizing calls complete a stream's work without waiting for its words, as the suite's
 *     watchdog would. A destroyed stream's queued work and its events outlive the stream: a new
 *     stream that gets the handle again has none of that work;
 *   - enough for cuda.core's Device, Stream and Buffer over pyalloc's resource (tests/test_cuda_
 *     core_fake_driver.py, bench/cuda_core_resource_cpu.py): stream priorities, not modelled.
 * Test-only entry points (fake_*) are called through ctypes.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    SUCCESS = 0, ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_NOT_INITIALIZED = 3,
    ERR_INVALID_DEVICE = 101, ERR_INVALID_CONTEXT = 201, ERR_INVALID_HANDLE = 400,
    ERR_ILLEGAL_STATE = 401, ERR_NOT_FOUND = 500, ERR_NOT_READY = 600,
    ERR_CAPTURE_UNSUPPORTED = 900, ERR_CAPTURE_INVALIDATED = 901, ERR_CAPTURE_MERGE = 902,
    ERR_CAPTURE_UNMATCHED = 903, ERR_CAPTURE_UNJOINED = 904, ERR_CAPTURE_ISOLATION = 905,
    ERR_CAPTURE_IMPLICIT = 906,
    ERR_CAPTURED_EVENT = 907, ERR_CAPTURE_WRONG_THREAD = 908
};

enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
enum { CAPTURE_NONE = 0, CAPTURE_ACTIVE = 1, CAPTURE_INVALIDATED = 2 };

#define MAX_DEVICES 8
#define MAX_SEGMENTS 4096
#define MAX_STREAMS 512
#define DEVICE_RANGE 0x10000000000ULL
#define VA_BASE 0x700000000000ULL
#define MAX_NODES 256
#define MAX_DEPS 16
#define MAX_PHYS 4096

struct ctx { int device; int refcount; };
struct segment { CUdeviceptr ptr; size_t size; int device; int live; };
struct graph;
struct node { struct graph *graph; size_t n_deps; struct node *deps[MAX_DEPS]; };
struct graph { unsigned long long capture_id; size_t n_nodes; long launches;
               struct node nodes[MAX_NODES]; };
struct exec { struct graph *graph; };
#define MAX_WAITS 1024
struct wait { unsigned long long unit; const volatile unsigned *word; unsigned value; };
/* A stream's record: `used` once made, `dead` once destroyed (kept while its queued work runs:
 * its events still follow it), handed to a new stream only when its work is over; `gen` counts
 * the streams a record has held, so an event of a former holder reads as complete. */
struct stream {
    int used, dead; unsigned gen;
    uintptr_t handle; unsigned long long launched, completed;
    size_t n_waits; struct wait waits[MAX_WAITS];   /* cuStreamWaitValue32 units not yet done */
    int device;                        /* fake_set_stream_device's, else -1: the current context's */
    int capture;                       /* CAPTURE_NONE / ACTIVE / INVALIDATED */
    int capture_mode; const void *capture_thread; unsigned long long capture_id;
    int origin;                        /* began the capture (else joined it by an event wait) */
    struct graph *graph; size_t n_terminals; struct node *terminals[MAX_DEPS];
};
/* An event recorded in a capture holds the capture's id and the stream's terminals at the
 * record: a stream that waits on it joins the capture after those nodes. */
struct event { unsigned magic; int sidx; unsigned gen; unsigned long long target; int recorded;
               unsigned flags; int captured; int device; unsigned long long capture_id;
               size_t n_nodes; struct node *nodes[MAX_DEPS]; };
struct phys { unsigned long long handle; size_t size; int device; int live; int refs; };
struct mapping { CUdeviceptr ptr; size_t size; unsigned long long handle; int live; };

static int initialized, n_devices = 2;
static size_t capacity = (size_t)1 << 30;
static struct ctx contexts[MAX_DEVICES];
static size_t used[MAX_DEVICES];
static CUdeviceptr next_addr[MAX_DEVICES];
static struct segment segments[MAX_SEGMENTS];
static struct stream streams[MAX_STREAMS];
static int n_streams;
static __thread struct ctx *current;
static char fail_name[64];
static int fail_code, fail_skip;
static unsigned last_event_flags;
static long calls_alloc, calls_free, calls_event_create, calls_event_record, calls_ctx_set;
static long calls_exchange, calls_capture_info, calls_deps_count, calls_deps_fill, calls_instantiate,
            calls_launch, calls_exec_destroy, calls_graph_destroy, graphs_live, execs_live;
static unsigned long long capture_counter, last_instantiate_flags;
static __thread int thread_mode;                   /* MODE_GLOBAL, as in the driver */
static __thread char thread_key;                   /* its address names the thread */
static struct phys phys[MAX_PHYS];
static struct mapping mappings[MAX_PHYS];
#define STREAM_HANDLE_BASE 0x5000
static uintptr_t next_stream_handle = STREAM_HANDLE_BASE, free_handles[MAX_STREAMS];
static int n_free_handles;
static unsigned long long next_phys = 1;
static CUdeviceptr next_va = VA_BASE;
static long reserved_live, mapped_live;
static char log_buf[8192];
static size_t log_len;
/* Live graphs and executable graphs, so that a bad handle is an error, not a crash. */
#define MAX_GRAPHS 256
static struct graph *graphs[MAX_GRAPHS];
static struct exec *execs[MAX_GRAPHS];

static int track(void **table, void *p) {
    for (int i = 0; i < MAX_GRAPHS; i++)
        if (!table[i]) { table[i] = p; return 1; }
    return 0;
}
static int tracked(void **table, const void *p) {
    if (!p) return 0;
    for (int i = 0; i < MAX_GRAPHS; i++)
        if (table[i] == p) return 1;
    return 0;
}
static void untrack(void **table, const void *p) {
    for (int i = 0; i < MAX_GRAPHS; i++)
        if (table[i] == p) table[i] = NULL;
}
static int valid_node(const struct node *n) {
    for (int i = 0; i < MAX_GRAPHS; i++) {
        struct graph *g = graphs[i];
        if (g && n >= g->nodes && n < g->nodes + g->n_nodes) return 1;
    }
    return 0;
}

static long calls_host_alloc, calls_host_free, calls_host_register, calls_host_unregister;
static long calls_ctx_synchronize;

static int should_fail(const char *name) {
    if (fail_code && strcmp(fail_name, name) == 0) {
        if (fail_skip > 0) { fail_skip--; return 0; }
        int c = fail_code;
        fail_code = 0;
        return c;
    }
    return 0;
}

static void log_entry(const char *entry) {
    size_t n = strlen(entry);
    if (log_len + n + 2 >= sizeof log_buf) return;
    if (log_len) log_buf[log_len++] = ' ';
    memcpy(log_buf + log_len, entry, n + 1);
    log_len += n;
}

/* A record for a new stream: a never-used one, or a destroyed stream's whose work is over;
 * NULL when every record holds a stream or a destroyed stream's unfinished work. */
static struct stream *new_stream_record(uintptr_t h) {
    struct stream *s = NULL;
    for (int i = 0; i < n_streams && !s; i++)
        if (!streams[i].used || (streams[i].dead && streams[i].completed >= streams[i].launched &&
                                 streams[i].n_waits == 0))
            s = &streams[i];
    if (!s && n_streams < MAX_STREAMS) s = &streams[n_streams++];
    if (!s) return NULL;
    unsigned gen = s->gen + 1;
    memset(s, 0, sizeof *s);
    s->used = 1;
    s->gen = gen;
    s->handle = h;
    s->device = -1;
    return s;
}

static struct stream *get_stream(uintptr_t h) {
    for (int i = 0; i < n_streams; i++)
        if (streams[i].used && !streams[i].dead && streams[i].handle == h) return &streams[i];
    struct stream *s = new_stream_record(h);
    return s ? s : &streams[MAX_STREAMS - 1];    /* full: the callers take a record regardless */
}

/* Every stream in capture `id` (the one that began it and those that joined it). */
#define FOR_CAPTURE(s, id) \
    for (struct stream *s = streams; s < streams + n_streams; s++) \
        if (s->used && s->capture != CAPTURE_NONE && s->capture_id == (id))

static void invalidate_capture(unsigned long long id) {
    FOR_CAPTURE(s, id) s->capture = CAPTURE_INVALIDATED;
}

/* The capture is over (ended or failed): no stream of it captures any more. */
static void leave_capture(unsigned long long id) {
    FOR_CAPTURE(s, id) { s->capture = CAPTURE_NONE; s->n_terminals = 0; s->graph = NULL; s->origin = 0; }
}

/* Complete the stream's units up to the first cuStreamWaitValue32 whose word is still short, if
 * every unit before it is a wait (a fake_launch unit completes only by fake_complete or a sync). */
static void advance_waits(struct stream *s) {
    size_t done = 0;
    while (done < s->n_waits && s->waits[done].unit == s->completed + 1 &&
           *s->waits[done].word >= s->waits[done].value) {
        s->completed++;
        done++;
    }
    while (done < s->n_waits && s->waits[done].unit <= s->completed) done++;  /* synchronized */
    if (done) {
        memmove(s->waits, s->waits + done, (s->n_waits - done) * sizeof s->waits[0]);
        s->n_waits -= done;
    }
}

/* A "potentially unsafe" call (logged as name@mode): when a capture forbids it, it fails and the
 * captures that forbid it are invalidated (the rules of cuThreadExchangeStreamCaptureMode's
 * documentation). */
static int unsafe_call(const char *name) {
    char entry[64];
    snprintf(entry, sizeof entry, "%s@%d", name, thread_mode);
    log_entry(entry);
    if (thread_mode == MODE_RELAXED) return 0;
    int refused = 0;
    for (int i = 0; i < n_streams; i++) {
        struct stream *s = &streams[i];
        if (!s->used || s->capture != CAPTURE_ACTIVE || s->capture_mode == MODE_RELAXED) continue;
        int mine = s->capture_thread == &thread_key;
        if (mine || (s->capture_mode == MODE_GLOBAL && thread_mode == MODE_GLOBAL)) {
            invalidate_capture(s->capture_id);
            refused = 1;
        }
    }
    return refused ? ERR_CAPTURE_UNSUPPORTED : 0;
}

static int any_capture(void) {
    for (int i = 0; i < n_streams; i++)
        if (streams[i].used && streams[i].capture != CAPTURE_NONE) return 1;
    return 0;
}

/* A node on a capturing stream: after its terminals (join) or beside them (a new root). */
static struct node *capture_node(struct stream *s, int join) {
    struct graph *g = s->graph;
    if (g->n_nodes == MAX_NODES) return NULL;
    struct node *n = &g->nodes[g->n_nodes++];
    n->graph = g;
    if (join) {
        n->n_deps = s->n_terminals;
        memcpy(n->deps, s->terminals, s->n_terminals * sizeof n->deps[0]);
        s->n_terminals = 0;
    }
    if (s->n_terminals < MAX_DEPS) s->terminals[s->n_terminals++] = n;
    return n;
}

CUresult cuDriverGetVersion(int *v) { *v = 13000; return SUCCESS; }

CUresult cuInit(unsigned flags) {
    (void)flags;
    const char *d = getenv("FAKE_CUDA_DEVICES");
    const char *m = getenv("FAKE_CUDA_MEMORY");
    if (d) n_devices = atoi(d);
    if (m) capacity = (size_t)strtoull(m, NULL, 10);
    if (n_devices <= 0) return 100; /* CUDA_ERROR_NO_DEVICE */
    if (n_devices > MAX_DEVICES) n_devices = MAX_DEVICES;
    if (!initialized) {
        for (int i = 0; i < MAX_DEVICES; i++) {
            contexts[i].device = i;
            next_addr[i] = DEVICE_RANGE * (CUdeviceptr)(i + 1);
        }
    }
    initialized = 1;
    return SUCCESS;
}

CUresult cuDeviceGetCount(int *n) { if (!initialized) return ERR_NOT_INITIALIZED; *n = n_devices; return SUCCESS; }

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= n_devices) return ERR_INVALID_DEVICE;
    *dev = ordinal;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(struct ctx **pctx, CUdevice dev) {
    if (dev < 0 || dev >= n_devices) return ERR_INVALID_DEVICE;
    contexts[dev].refcount++;
    *pctx = &contexts[dev];
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    if (dev < 0 || dev >= n_devices || contexts[dev].refcount <= 0) return ERR_INVALID_CONTEXT;
    contexts[dev].refcount--;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(struct ctx **pctx) { *pctx = current; return SUCCESS; }
CUresult cuCtxSetCurrent(struct ctx *c) { calls_ctx_set++; current = c; return SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *dev) {
    if (!current) return ERR_INVALID_CONTEXT;
    *dev = current->device;
    return SUCCESS;
}

CUresult cuMemAlloc(CUdeviceptr *p, size_t n) {
    int f = should_fail("cuMemAlloc");
    if (!f) f = unsafe_call("cuMemAlloc");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    if (n == 0) return ERR_INVALID_VALUE;
    int d = current->device;
    if (used[d] + n > capacity) return ERR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_SEGMENTS; i++) {
        if (!segments[i].live) {
            segments[i].live = 1;
            segments[i].ptr = next_addr[d];
            segments[i].size = n;
            segments[i].device = d;
            next_addr[d] += (n + 0x1FFFFF) & ~(CUdeviceptr)0x1FFFFF;
            used[d] += n;
            *p = segments[i].ptr;
            calls_alloc++;
            return SUCCESS;
        }
    }
    return ERR_OUT_OF_MEMORY;
}

CUresult cuMemFree(CUdeviceptr p) {
    int f = should_fail("cuMemFree");
    if (!f) f = unsafe_call("cuMemFree");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    for (int i = 0; i < MAX_SEGMENTS; i++) {
        if (segments[i].live && segments[i].ptr == p) {
            segments[i].live = 0;
            used[segments[i].device] -= segments[i].size;
            calls_free++;
            return SUCCESS;
        }
    }
    return ERR_INVALID_VALUE;
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) {
    int f = unsafe_call("cuMemGetInfo");     /* modelled as unsafe, to be on the safe side */
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    *free_bytes = capacity - used[current->device];
    *total = capacity;
    return SUCCESS;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr p) {
    (void)attribute;
    for (int i = 0; i < MAX_SEGMENTS; i++) {
        if (segments[i].live && segments[i].ptr <= p && p < segments[i].ptr + segments[i].size) {
            *(int *)data = segments[i].device;
            return SUCCESS;
        }
    }
    return ERR_INVALID_VALUE;
}

#define EVENT_MAGIC 0xE7E7E7E7u

CUresult cuEventCreate(struct event **ev, unsigned flags) {
    int f = should_fail("cuEventCreate");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    struct event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    e->flags = flags;
    e->device = current->device;
    last_event_flags = flags;
    *ev = e;
    calls_event_create++;
    return SUCCESS;
}

CUresult cuEventRecord(struct event *e, uintptr_t stream) {
    int f = should_fail("cuEventRecord");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    struct stream *s = get_stream(stream);
    /* The real driver refuses an event and a stream of different contexts. */
    if (stream > 2 && (s->device >= 0 ? s->device : current->device) != e->device) return ERR_INVALID_HANDLE;
    e->sidx = (int)(s - streams);
    e->gen = s->gen;
    e->target = s->launched;
    e->recorded = 1;
    e->captured = s->capture == CAPTURE_ACTIVE;  /* a fork/join point of the capture, no work */
    if (e->captured) {
        e->capture_id = s->capture_id;
        e->n_nodes = s->n_terminals;
        memcpy(e->nodes, s->terminals, s->n_terminals * sizeof e->nodes[0]);
    }
    calls_event_record++;
    return SUCCESS;
}

CUresult cuEventQuery(struct event *e) {
    int f = should_fail("cuEventQuery");
    if (f) return f;
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    if (e->captured) return ERR_CAPTURED_EVENT;
    if ((f = unsafe_call("cuEventQuery"))) return f;
    if (!e->recorded) return SUCCESS;
    struct stream *s = &streams[e->sidx];
    if (s->gen != e->gen) return SUCCESS;        /* its stream's record was reused: work over */
    advance_waits(s);
    return s->completed >= e->target ? SUCCESS : ERR_NOT_READY;
}

CUresult cuEventSynchronize(struct event *e) {
    int f;
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    if (e->captured) return ERR_CAPTURED_EVENT;
    if ((f = unsafe_call("cuEventSynchronize"))) return f;
    if (e->recorded && streams[e->sidx].gen == e->gen) {
        struct stream *s = &streams[e->sidx];
        if (s->completed < e->target) s->completed = e->target;
        advance_waits(s);
    }
    return SUCCESS;
}

CUresult cuEventDestroy(struct event *e) {
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return SUCCESS;
}

CUresult cuStreamGetDevice(uintptr_t stream, CUdevice *dev) {
    struct stream *s = get_stream(stream);
    if (s->device >= 0) { *dev = s->device; return SUCCESS; }
    if (!current) return ERR_INVALID_CONTEXT;
    *dev = current->device;
    return SUCCESS;
}

CUresult cuStreamSynchronize(uintptr_t stream) {
    if (!current) return ERR_INVALID_CONTEXT;
    struct stream *s = get_stream(stream);
    if (s->capture != CAPTURE_NONE) {             /* illegal on a capturing stream */
        invalidate_capture(s->capture_id);
        return ERR_CAPTURE_UNSUPPORTED;
    }
    s->completed = s->launched;
    advance_waits(s);
    return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    if (!current) return ERR_INVALID_CONTEXT;
    calls_ctx_synchronize++;
    for (int i = 0; i < n_streams; i++) {             /* destroyed streams' work too */
        if (!streams[i].used) continue;
        streams[i].completed = streams[i].launched;
        advance_waits(&streams[i]);
    }
    return SUCCESS;
}

/* ------------------------------------------------------------------ virtual memory */

CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop; (void)option;
    *g = 2u << 20;
    return SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    (void)dev; (void)peer;
    *can = 0;
    return SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    (void)align; (void)addr; (void)flags;
    int f = should_fail("cuMemAddressReserve");
    if (!f) f = unsafe_call("cuMemAddressReserve");
    if (f) return f;
    *p = next_va;
    next_va += (size + 0x1FFFFF) & ~(CUdeviceptr)0x1FFFFF;
    reserved_live++;
    return SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    (void)p; (void)size;
    int f = unsafe_call("cuMemAddressFree");
    if (f) return f;
    reserved_live--;
    return SUCCESS;
}

/* prop: a CUmemAllocationProp, whose location.id (the device) is its fourth int. */
CUresult cuMemCreate(unsigned long long *handle, size_t size, const int *prop, unsigned long long flags) {
    (void)flags;
    int f = should_fail("cuMemCreate");
    if (!f) f = unsafe_call("cuMemCreate");
    if (f) return f;
    int d = prop[3];
    if (d < 0 || d >= n_devices) return ERR_INVALID_DEVICE;
    if (used[d] + size > capacity) return ERR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_PHYS; i++) {
        if (!phys[i].live) {
            phys[i] = (struct phys){next_phys++, size, d, 1, 1};
            used[d] += size;
            *handle = phys[i].handle;
            return SUCCESS;
        }
    }
    return ERR_OUT_OF_MEMORY;
}

CUresult cuMemRelease(unsigned long long handle) {
    int f = unsafe_call("cuMemRelease");
    if (f) return f;
    for (int i = 0; i < MAX_PHYS; i++) {
        if (phys[i].live && phys[i].handle == handle) {
            if (--phys[i].refs > 0) return SUCCESS;     /* cuMemRetainAllocationHandle's */
            phys[i].live = 0;
            used[phys[i].device] -= phys[i].size;
            return SUCCESS;
        }
    }
    return ERR_INVALID_VALUE;
}

CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long handle,
                  unsigned long long flags) {
    (void)offset; (void)flags;
    int f = unsafe_call("cuMemMap");
    if (f) return f;
    for (int i = 0; i < MAX_PHYS; i++) {
        if (!mappings[i].live) {
            mappings[i] = (struct mapping){p, size, handle, 1};
            break;
        }
    }
    mapped_live += (long)size;
    return SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    int f = unsafe_call("cuMemUnmap");
    if (f) return f;
    for (int i = 0; i < MAX_PHYS; i++)
        if (mappings[i].live && p <= mappings[i].ptr && mappings[i].ptr < p + size)
            mappings[i].live = 0;
    mapped_live -= (long)size;
    return SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const void *desc, size_t count) {
    (void)p; (void)size; (void)desc; (void)count;
    return unsafe_call("cuMemSetAccess");
}

/* ------------------------------------------------------------------ stream capture, graphs */

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    int f = should_fail("cuThreadExchangeStreamCaptureMode");
    if (f) return f;
    if (!mode || *mode < MODE_GLOBAL || *mode > MODE_RELAXED) return ERR_INVALID_VALUE;
    int previous = thread_mode;
    char entry[64];
    snprintf(entry, sizeof entry, "exchange:%d->%d", previous, *mode);
    log_entry(entry);
    thread_mode = *mode;
    *mode = previous;
    calls_exchange++;
    return SUCCESS;
}

/* Stream handles 0 and 1 (CU_STREAM_LEGACY): the legacy stream, which cannot capture. */
static int is_legacy(uintptr_t stream) { return stream == 0 || stream == 1; }

CUresult cuStreamBeginCapture(uintptr_t stream, int mode) {
    int f = should_fail("cuStreamBeginCapture");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) return ERR_INVALID_VALUE;
    if (is_legacy(stream)) return ERR_CAPTURE_UNSUPPORTED;
    struct stream *s = get_stream(stream);
    if (s->capture != CAPTURE_NONE) return ERR_ILLEGAL_STATE;
    struct graph *g = calloc(1, sizeof *g);
    if (!track((void **)graphs, g)) { free(g); return ERR_OUT_OF_MEMORY; }
    g->capture_id = ++capture_counter;
    graphs_live++;
    s->capture = CAPTURE_ACTIVE;
    s->capture_mode = mode;
    s->capture_thread = &thread_key;
    s->capture_id = g->capture_id;
    s->origin = 1;
    s->graph = g;
    s->n_terminals = 0;
    return SUCCESS;
}

/* The origin's terminals and their ancestors cover every joined stream's terminals: each fork
 * was joined back (else cuStreamEndCapture is CUDA_ERROR_STREAM_CAPTURE_UNJOINED). */
static int all_joined(const struct stream *origin) {
    char reached[MAX_NODES] = {0};
    struct node *stack[MAX_NODES];
    size_t top = 0;
    const struct graph *g = origin->graph;
    for (size_t i = 0; i < origin->n_terminals; i++) stack[top++] = origin->terminals[i];
    while (top) {
        struct node *n = stack[--top];
        size_t k = (size_t)(n - g->nodes);
        if (reached[k]) continue;
        reached[k] = 1;
        for (size_t d = 0; d < n->n_deps; d++) stack[top++] = n->deps[d];
    }
    FOR_CAPTURE(t, origin->capture_id)
        for (size_t i = 0; i < t->n_terminals; i++)
            if (!reached[t->terminals[i] - g->nodes]) return 0;
    return 1;
}

CUresult cuStreamEndCapture(uintptr_t stream, struct graph **graph) {
    int f = should_fail("cuStreamEndCapture");
    if (f) return f;
    if (!graph) return ERR_INVALID_VALUE;
    struct stream *s = get_stream(stream);
    if (s->capture == CAPTURE_NONE) return ERR_ILLEGAL_STATE;
    if (!s->origin) {                             /* it joined the capture: end it where it began */
        invalidate_capture(s->capture_id);
        return ERR_CAPTURE_UNMATCHED;
    }
    if (s->capture_mode != MODE_RELAXED && s->capture_thread != &thread_key)
        return ERR_CAPTURE_WRONG_THREAD;
    struct graph *g = s->graph;
    CUresult result = s->capture == CAPTURE_INVALIDATED ? ERR_CAPTURE_INVALIDATED : SUCCESS;
    if (result == SUCCESS && !all_joined(s)) result = ERR_CAPTURE_UNJOINED;
    leave_capture(s->capture_id);
    if (result != SUCCESS) {                      /* the capture ends, with no graph */
        untrack((void **)graphs, g);
        free(g);
        graphs_live--;
        *graph = NULL;
        return result;
    }
    *graph = g;
    return SUCCESS;
}

CUresult cuStreamIsCapturing(uintptr_t stream, int *status) {
    if (is_legacy(stream) && any_capture()) return ERR_CAPTURE_IMPLICIT;
    *status = get_stream(stream)->capture;
    return SUCCESS;
}

static const unsigned char zero_edges[MAX_DEPS * 8];

CUresult cuStreamGetCaptureInfo(uintptr_t stream, int *status, unsigned long long *id,
                                struct graph **graph, struct node *const **deps,
                                const void **edges, size_t *n) {
    int f = should_fail("cuStreamGetCaptureInfo");
    if (f) return f;
    calls_capture_info++;
    if (!status || (edges && !deps)) return ERR_INVALID_VALUE;
    if (is_legacy(stream) && any_capture()) return ERR_CAPTURE_IMPLICIT;
    struct stream *s = get_stream(stream);
    *status = s->capture;
    if (s->capture == CAPTURE_ACTIVE) {
        if (id) *id = s->capture_id;
        if (graph) *graph = s->graph;
        if (deps) *deps = s->terminals;
        if (edges) *edges = zero_edges;
        if (n) *n = s->n_terminals;
    }
    return SUCCESS;
}

CUresult cuGraphNodeGetDependencies(struct node *node, struct node **deps, void *edges, size_t *n) {
    int f = should_fail("cuGraphNodeGetDependencies");
    if (f) return f;
    if (!valid_node(node) || !n || (edges && !deps)) return ERR_INVALID_VALUE;
    if (!deps) {
        calls_deps_count++;
        *n = node->n_deps;
        return SUCCESS;
    }
    calls_deps_fill++;
    size_t i;
    for (i = 0; i < *n && i < node->n_deps; i++) deps[i] = node->deps[i];
    for (size_t j = i; j < *n; j++) deps[j] = NULL;
    if (edges) memset(edges, 0, *n * 8);
    *n = i;
    return SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(struct exec **exec, struct graph *graph, unsigned long long flags) {
    int f = should_fail("cuGraphInstantiateWithFlags");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    if (!tracked((void **)graphs, graph)) return ERR_INVALID_VALUE;
    struct exec *x = calloc(1, sizeof *x);
    if (!track((void **)execs, x)) { free(x); return ERR_OUT_OF_MEMORY; }
    x->graph = graph;
    *exec = x;
    last_instantiate_flags = flags;
    calls_instantiate++;
    execs_live++;
    return SUCCESS;
}

/* Replay: the graph's nodes become work on `stream` (one unit each, at least one). */
CUresult cuGraphLaunch(struct exec *x, uintptr_t stream) {
    int f = should_fail("cuGraphLaunch");
    if (f) return f;
    if (!tracked((void **)execs, x)) return ERR_INVALID_VALUE;
    if (is_legacy(stream) && !current) return ERR_INVALID_CONTEXT;
    struct stream *s = get_stream(stream);
    if (s->capture == CAPTURE_ACTIVE) {
        capture_node(s, 1);                       /* a child-graph node of that capture */
    } else {
        s->launched += x->graph->n_nodes ? x->graph->n_nodes : 1;
    }
    x->graph->launches++;
    calls_launch++;
    return SUCCESS;
}

CUresult cuGraphExecDestroy(struct exec *x) {
    int f = should_fail("cuGraphExecDestroy");
    if (f) return f;
    if (!tracked((void **)execs, x)) return ERR_INVALID_VALUE;
    untrack((void **)execs, x);
    free(x);
    calls_exec_destroy++;
    execs_live--;
    return SUCCESS;
}

CUresult cuGraphDestroy(struct graph *g) {
    int f = should_fail("cuGraphDestroy");
    if (f) return f;
    if (!tracked((void **)graphs, g)) return ERR_INVALID_VALUE;
    untrack((void **)graphs, g);
    free(g);
    calls_graph_destroy++;
    graphs_live--;
    return SUCCESS;
}

static const struct { int code; const char *name, *desc; } errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would have resulted in a merge of two independent capture sequences"},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not initiated in this stream"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capture sequence contains a fork that was not joined to the primary stream"},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
};

CUresult cuGetErrorName(int code, const char **s) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == code) { *s = errors[i].name; return SUCCESS; }
    *s = NULL;
    return ERR_INVALID_VALUE;
}

CUresult cuGetErrorString(int code, const char **s) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == code) { *s = errors[i].desc; return SUCCESS; }
    *s = NULL;
    return ERR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ test controls (ctypes) */

/* Work on `stream`: `count` units, or, while it captures, `count` nodes each after the last. */
void fake_launch(uintptr_t stream, unsigned long long count) {
    struct stream *s = get_stream(stream);
    if (s->capture == CAPTURE_ACTIVE) {
        while (count--) capture_node(s, 1);
        return;
    }
    s->launched += count;
}
/* A node on capturing `stream`: after its terminals (join=1), or a new root beside them (join=0,
 * as work joined from another stream would be). Returns the node's handle (0: not capturing). */
uintptr_t fake_capture_node(uintptr_t stream, int join) {
    struct stream *s = get_stream(stream);
    if (s->capture != CAPTURE_ACTIVE) return 0;
    return (uintptr_t)capture_node(s, join);
}
int fake_capture_status(uintptr_t stream) { return get_stream(stream)->capture; }
int fake_capture_mode(uintptr_t stream) { return get_stream(stream)->capture_mode; }
unsigned long long fake_launched(uintptr_t stream) { return get_stream(stream)->launched; }
long fake_graph_launches(uintptr_t graph) { return ((struct graph *)graph)->launches; }
long fake_graph_nodes(uintptr_t graph) { return (long)((struct graph *)graph)->n_nodes; }
int fake_thread_mode(void) { return thread_mode; }
void fake_set_thread_mode(int mode) { thread_mode = mode; }
const char *fake_log(void) { return log_buf; }
void fake_log_reset(void) { log_len = 0; log_buf[0] = 0; }
void fake_fail_after(const char *name, int skip, int code) {
    strncpy(fail_name, name, sizeof fail_name - 1);
    fail_code = code;
    fail_skip = skip;
}
void fake_set_stream_device(uintptr_t stream, int dev) { get_stream(stream)->device = dev; }
int fake_event_device(uintptr_t event) { return ((struct event *)event)->device; }
void fake_complete(uintptr_t stream) {
    struct stream *s = get_stream(stream);
    s->completed = s->launched;
    advance_waits(s);
}
void fake_fail_next(const char *name, int code) {
    strncpy(fail_name, name, sizeof fail_name - 1);
    fail_code = code;
    fail_skip = 0;
}
long fake_count(const char *what) {
    if (!strcmp(what, "alloc")) return calls_alloc;
    if (!strcmp(what, "free")) return calls_free;
    if (!strcmp(what, "event_create")) return calls_event_create;
    if (!strcmp(what, "event_record")) return calls_event_record;
    if (!strcmp(what, "ctx_set")) return calls_ctx_set;
    if (!strcmp(what, "event_flags")) return (long)last_event_flags;
    if (!strcmp(what, "exchange")) return calls_exchange;
    if (!strcmp(what, "capture_info")) return calls_capture_info;
    if (!strcmp(what, "deps_count")) return calls_deps_count;
    if (!strcmp(what, "deps_fill")) return calls_deps_fill;
    if (!strcmp(what, "instantiate")) return calls_instantiate;
    if (!strcmp(what, "instantiate_flags")) return (long)last_instantiate_flags;
    if (!strcmp(what, "launch")) return calls_launch;
    if (!strcmp(what, "exec_destroy")) return calls_exec_destroy;
    if (!strcmp(what, "graph_destroy")) return calls_graph_destroy;
    if (!strcmp(what, "graphs_live")) return graphs_live;
    if (!strcmp(what, "execs_live")) return execs_live;
    if (!strcmp(what, "reserved_live")) return reserved_live;
    if (!strcmp(what, "mapped_live")) return mapped_live;
    if (!strcmp(what, "host_alloc")) return calls_host_alloc;
    if (!strcmp(what, "host_free")) return calls_host_free;
    if (!strcmp(what, "ctx_synchronize")) return calls_ctx_synchronize;
    if (!strcmp(what, "host_register")) return calls_host_register;
    if (!strcmp(what, "host_unregister")) return calls_host_unregister;
    return -1;
}
int fake_refcount(int dev) { return (dev >= 0 && dev < MAX_DEVICES) ? contexts[dev].refcount : -1; }
size_t fake_used(int dev) { return (dev >= 0 && dev < MAX_DEVICES) ? used[dev] : 0; }
/* Make the primary context of `dev` current on this thread (-1: none), as cudaSetDevice would. */
void fake_set_current(int dev) { current = (dev >= 0 && dev < MAX_DEVICES) ? &contexts[dev] : NULL; }

/* ------------------------------------------------------------------ what CudaTestDevice uses */

CUresult cuStreamCreate(uintptr_t *stream, unsigned flags) {
    (void)flags;
    if (!current) return ERR_INVALID_CONTEXT;
    uintptr_t h = n_free_handles ? free_handles[n_free_handles - 1] : next_stream_handle;
    struct stream *s = new_stream_record(h);
    if (!s) return ERR_OUT_OF_MEMORY;
    if (n_free_handles) n_free_handles--; else next_stream_handle++;
    s->device = current->device;
    *stream = h;
    return SUCCESS;
}

/* The queued work of a destroyed stream still runs: its record stays (dead) for its events
 * until that work is over and a new stream takes the record; the handle is handed out again. */
CUresult cuStreamDestroy(uintptr_t stream) {
    for (int i = 0; i < n_streams; i++) {
        struct stream *s = &streams[i];
        if (s->used && !s->dead && s->handle == stream && stream >= STREAM_HANDLE_BASE) {
            s->dead = 1;
            if (n_free_handles < MAX_STREAMS) free_handles[n_free_handles++] = stream;
            return SUCCESS;
        }
    }
    return ERR_INVALID_HANDLE;
}

/* Pinned host memory for the host allocator (pyalloc/_cuda_host.pyx) too: calls counted and
 * failable (fake_fail_next), registrations of pageable ranges kept (a range registered twice is
 * CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, one never registered ..._NOT_REGISTERED). */
#define MAX_REGISTERED 256
static struct { void *p; size_t size; } registered[MAX_REGISTERED];

CUresult cuMemHostAlloc(void **p, size_t size, unsigned flags) {
    (void)flags;
    int f = should_fail("cuMemHostAlloc");
    if (f) return f;
    *p = calloc(1, size ? size : 1);
    if (*p) calls_host_alloc++;
    return *p ? SUCCESS : ERR_OUT_OF_MEMORY;
}

CUresult cuMemHostRegister(void *p, size_t size, unsigned flags) {
    (void)flags;
    int f = should_fail("cuMemHostRegister");
    if (f) return f;
    if (!p || !size) return ERR_INVALID_VALUE;
    int slot = -1;
    for (int i = 0; i < MAX_REGISTERED; i++) {
        if (registered[i].p == p) return 712;       /* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
        if (!registered[i].p && slot < 0) slot = i;
    }
    if (slot < 0) return ERR_OUT_OF_MEMORY;
    registered[slot].p = p;
    registered[slot].size = size;
    calls_host_register++;
    return SUCCESS;
}

CUresult cuMemHostUnregister(void *p) {
    int f = should_fail("cuMemHostUnregister");
    if (f) return f;
    for (int i = 0; i < MAX_REGISTERED; i++) {
        if (registered[i].p == p) {
            registered[i].p = NULL;
            calls_host_unregister++;
            return SUCCESS;
        }
    }
    return 713;                                     /* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
}

CUresult cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned flags) {
    (void)flags;
    *d = (CUdeviceptr)(uintptr_t)p;        /* one address space: the host word itself */
    return SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    int f = should_fail("cuMemFreeHost");
    if (f) return f;
    free(p);
    calls_host_free++;
    return SUCCESS;
}

CUresult cuStreamWaitValue32(uintptr_t stream, CUdeviceptr addr, unsigned value, unsigned flags) {
    (void)flags;                          /* CU_STREAM_WAIT_VALUE_GEQ is the only one modelled */
    struct stream *s = get_stream(stream);
    if (s->n_waits == MAX_WAITS) return ERR_OUT_OF_MEMORY;
    s->launched++;
    s->waits[s->n_waits++] = (struct wait){s->launched, (const volatile unsigned *)(uintptr_t)addr, value};
    return SUCCESS;
}

/* Outside capture the ordering is not modelled. A wait on an event recorded in a capture joins
 * the capture (a stream not capturing: its terminals become the event's nodes) or adds the
 * event's nodes to the stream's terminals (a stream of that capture); the errors are the
 * driver's: a capture that ended (CUDA_ERROR_INVALID_VALUE), the legacy stream joining (it is
 * refused and invalidates the capture), one invalidated, two captures merged; and a capturing
 * stream waiting on an event recorded outside its capture is an isolation error. */
CUresult cuStreamWaitEvent(uintptr_t stream, struct event *e, unsigned flags) {
    (void)flags;
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    struct stream *s = get_stream(stream);
    if (!e->captured) {
        if (s->capture == CAPTURE_ACTIVE && e->recorded) {
            invalidate_capture(s->capture_id);
            return ERR_CAPTURE_ISOLATION;
        }
        return SUCCESS;
    }
    struct stream *origin = NULL;
    FOR_CAPTURE(t, e->capture_id) if (t->origin) origin = t;
    if (!origin) return ERR_INVALID_VALUE;
    if (s->capture == CAPTURE_NONE) {
        if (is_legacy(stream)) { invalidate_capture(e->capture_id); return ERR_CAPTURE_UNSUPPORTED; }
        if (origin->capture == CAPTURE_INVALIDATED) return ERR_CAPTURE_INVALIDATED;
        s->capture = CAPTURE_ACTIVE;
        s->capture_mode = origin->capture_mode;
        s->capture_thread = origin->capture_thread;
        s->capture_id = origin->capture_id;
        s->graph = origin->graph;
        s->origin = 0;
        s->n_terminals = e->n_nodes;
        memcpy(s->terminals, e->nodes, e->n_nodes * sizeof s->terminals[0]);
        return SUCCESS;
    }
    if (s->capture_id != e->capture_id) {
        invalidate_capture(s->capture_id);
        invalidate_capture(e->capture_id);
        return ERR_CAPTURE_MERGE;
    }
    for (size_t i = 0; i < e->n_nodes; i++) {
        int known = 0;
        for (size_t j = 0; j < s->n_terminals; j++) known |= s->terminals[j] == e->nodes[i];
        if (!known && s->n_terminals < MAX_DEPS) s->terminals[s->n_terminals++] = e->nodes[i];
    }
    return SUCCESS;
}

/* A memset: while the stream captures, a node after its terminals; outside capture it is not
 * modelled as work (the fake keeps no memory behind its addresses). */
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, uintptr_t stream) {
    (void)dst; (void)value; (void)n;
    int f = should_fail("cuMemsetD8Async");
    if (f) return f;
    if (!current) return ERR_INVALID_CONTEXT;
    struct stream *s = get_stream(stream);
    if (s->capture == CAPTURE_INVALIDATED) return ERR_CAPTURE_INVALIDATED;
    if (s->capture == CAPTURE_ACTIVE && !capture_node(s, 1)) return ERR_OUT_OF_MEMORY;
    return SUCCESS;
}

CUresult cuMemRetainAllocationHandle(unsigned long long *handle, void *addr) {
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    for (int i = 0; i < MAX_PHYS; i++) {
        if (mappings[i].live && mappings[i].ptr <= a && a < mappings[i].ptr + mappings[i].size) {
            for (int j = 0; j < MAX_PHYS; j++) {
                if (phys[j].live && phys[j].handle == mappings[i].handle) {
                    phys[j].refs++;
                    *handle = phys[j].handle;
                    return SUCCESS;
                }
            }
        }
    }
    return ERR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ what cuda.core's Stream uses */

/* Device.create_stream asks for the priority range, then makes the stream with a priority (not
 * modelled: the fake has one queue per stream whatever its priority). */
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    if (!current) return ERR_INVALID_CONTEXT;
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return SUCCESS;
}

CUresult cuStreamCreateWithPriority(uintptr_t *stream, unsigned flags, int priority) {
    (void)priority;
    return cuStreamCreate(stream, flags);
}

/* ------------------------------------------------------------------ symbol lookup */

static const struct { const char *name; void *fn; } table[] = {
#define F(n) {#n, (void *)n}
    F(cuDriverGetVersion), F(cuInit), F(cuDeviceGetCount), F(cuDeviceGet),
    F(cuDevicePrimaryCtxRetain), F(cuDevicePrimaryCtxRelease), F(cuCtxGetCurrent),
    F(cuCtxSetCurrent), F(cuCtxGetDevice), F(cuMemAlloc), F(cuMemFree), F(cuMemGetInfo),
    F(cuPointerGetAttribute), F(cuEventCreate), F(cuEventRecord), F(cuEventQuery),
    F(cuEventSynchronize), F(cuEventDestroy), F(cuStreamSynchronize), F(cuStreamGetDevice), F(cuCtxSynchronize),
    F(cuGetErrorName), F(cuGetErrorString),
    F(cuMemGetAllocationGranularity), F(cuDeviceCanAccessPeer), F(cuMemAddressReserve),
    F(cuMemAddressFree), F(cuMemCreate), F(cuMemRelease), F(cuMemMap), F(cuMemUnmap),
    F(cuMemSetAccess), F(cuThreadExchangeStreamCaptureMode), F(cuStreamBeginCapture),
    F(cuStreamEndCapture), F(cuStreamIsCapturing), F(cuStreamGetCaptureInfo),
    F(cuGraphNodeGetDependencies), F(cuGraphInstantiateWithFlags), F(cuGraphLaunch),
    F(cuGraphExecDestroy), F(cuGraphDestroy),
    F(cuStreamCreate), F(cuStreamDestroy), F(cuMemHostAlloc), F(cuMemHostGetDevicePointer),
    F(cuMemFreeHost), F(cuMemHostRegister), F(cuMemHostUnregister), F(cuStreamWaitValue32), F(cuStreamWaitEvent), F(cuMemsetD8Async), F(cuMemRetainAllocationHandle),
    F(cuCtxGetStreamPriorityRange), F(cuStreamCreateWithPriority),
#undef F
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status) {
    (void)version; (void)flags;
    /* Versioned names (cuMemAlloc_v2, cuEventDestroy_v2, ...) map to the unversioned ones here. */
    char base[128];
    strncpy(base, symbol, sizeof base - 1);
    base[sizeof base - 1] = 0;
    char *v = strstr(base, "_v");
    if (v && v[2] >= '0' && v[2] <= '9') *v = 0;
    /* FAKE_CUDA_HIDE names one function this driver lacks: cuda-bindings then raises when it is
       called, for the tests of what pyalloc restores when a driver call raises. */
    const char *hide = getenv("FAKE_CUDA_HIDE");
    int hidden = hide && !strcmp(hide, base);
    for (size_t i = 0; !hidden && i < sizeof table / sizeof table[0]; i++) {
        if (!strcmp(table[i].name, base)) {
            *pfn = table[i].fn;
            if (status) *status = 0;
            return SUCCESS;
        }
    }
    *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return ERR_NOT_FOUND;
}
