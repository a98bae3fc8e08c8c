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
 *   - fault injection: fake_fail_next(name, code) makes the next call of `name` return `code`.
 * Test-only entry points (fake_*) are called through ctypes.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    SUCCESS = 0, ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_NOT_INITIALIZED = 3,
    ERR_INVALID_DEVICE = 101, ERR_INVALID_CONTEXT = 201, ERR_INVALID_HANDLE = 400,
    ERR_NOT_FOUND = 500, ERR_NOT_READY = 600
};

#define MAX_DEVICES 8
#define MAX_SEGMENTS 4096
#define MAX_STREAMS 64
#define DEVICE_RANGE 0x10000000000ULL

struct ctx { int device; int refcount; };
struct segment { CUdeviceptr ptr; size_t size; int device; int live; };
struct stream { uintptr_t handle; unsigned long long launched, completed; };
struct event { unsigned magic; uintptr_t stream; unsigned long long target; int recorded; unsigned flags; };

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
static int fail_code;
static unsigned last_event_flags;
static long calls_alloc, calls_free, calls_event_create, calls_event_record, calls_ctx_set;

static int should_fail(const char *name) {
    if (fail_code && strcmp(fail_name, name) == 0) {
        int c = fail_code;
        fail_code = 0;
        return c;
    }
    return 0;
}

static struct stream *get_stream(uintptr_t h) {
    for (int i = 0; i < n_streams; i++)
        if (streams[i].handle == h) return &streams[i];
    if (n_streams == MAX_STREAMS) return &streams[MAX_STREAMS - 1];
    streams[n_streams].handle = h;
    return &streams[n_streams++];
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
    e->stream = stream;
    e->target = s->launched;
    e->recorded = 1;
    calls_event_record++;
    return SUCCESS;
}

CUresult cuEventQuery(struct event *e) {
    int f = should_fail("cuEventQuery");
    if (f) return f;
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    if (!e->recorded) return SUCCESS;
    return get_stream(e->stream)->completed >= e->target ? SUCCESS : ERR_NOT_READY;
}

CUresult cuEventSynchronize(struct event *e) {
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    if (e->recorded) {
        struct stream *s = get_stream(e->stream);
        if (s->completed < e->target) s->completed = e->target;
    }
    return SUCCESS;
}

CUresult cuEventDestroy(struct event *e) {
    if (!e || e->magic != EVENT_MAGIC) return ERR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return SUCCESS;
}

CUresult cuStreamSynchronize(uintptr_t stream) {
    if (!current) return ERR_INVALID_CONTEXT;
    struct stream *s = get_stream(stream);
    s->completed = s->launched;
    return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    if (!current) return ERR_INVALID_CONTEXT;
    for (int i = 0; i < n_streams; i++) streams[i].completed = streams[i].launched;
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
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
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

void fake_launch(uintptr_t stream, unsigned long long count) { get_stream(stream)->launched += count; }
void fake_complete(uintptr_t stream) { struct stream *s = get_stream(stream); s->completed = s->launched; }
void fake_fail_next(const char *name, int code) {
    strncpy(fail_name, name, sizeof fail_name - 1);
    fail_code = code;
}
long fake_count(const char *what) {
    if (!strcmp(what, "alloc")) return calls_alloc;
    if (!strcmp(what, "free")) return calls_free;
    if (!strcmp(what, "event_create")) return calls_event_create;
    if (!strcmp(what, "event_record")) return calls_event_record;
    if (!strcmp(what, "ctx_set")) return calls_ctx_set;
    if (!strcmp(what, "event_flags")) return (long)last_event_flags;
    return -1;
}
int fake_refcount(int dev) { return (dev >= 0 && dev < MAX_DEVICES) ? contexts[dev].refcount : -1; }
size_t fake_used(int dev) { return (dev >= 0 && dev < MAX_DEVICES) ? used[dev] : 0; }
/* Make the primary context of `dev` current on this thread (-1: none), as cudaSetDevice would. */
void fake_set_current(int dev) { current = (dev >= 0 && dev < MAX_DEVICES) ? &contexts[dev] : NULL; }

/* ------------------------------------------------------------------ symbol lookup */

static const struct { const char *name; void *fn; } table[] = {
#define F(n) {#n, (void *)n}
    F(cuDriverGetVersion), F(cuInit), F(cuDeviceGetCount), F(cuDeviceGet),
    F(cuDevicePrimaryCtxRetain), F(cuDevicePrimaryCtxRelease), F(cuCtxGetCurrent),
    F(cuCtxSetCurrent), F(cuCtxGetDevice), F(cuMemAlloc), F(cuMemFree), F(cuMemGetInfo),
    F(cuPointerGetAttribute), F(cuEventCreate), F(cuEventRecord), F(cuEventQuery),
    F(cuEventSynchronize), F(cuEventDestroy), F(cuStreamSynchronize), F(cuCtxSynchronize),
    F(cuGetErrorName), F(cuGetErrorString),
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
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
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
