/* pyalloc's C entry points, for shared libraries and C threads (PyTorch's pluggable allocator).
 *
 * The table lives in the capsule `pyalloc._capi.table` (PyCapsule name PYALLOC_CAPI_CAPSULE);
 * pyalloc._capi.table_address() gives the same pointer as an int, for ctypes. Every function
 * serves the default allocator of `device` (pyalloc.get_allocator(device)), the one CuPy's,
 * Numba's and PyTorch's hooks share.
 *
 * Threads: malloc, free and record_stream may be called from any thread, with or without the
 * GIL. A cache hit takes only the allocator's C lock; anything else (a new segment, out of memory,
 * events to poll, history stacks, private-pool routes, an error) takes the GIL with
 * PyGILState_Ensure, never while holding the C lock, and runs the ordinary Python-level path.
 *
 * Errors: the functions return 0 on success or one of the PYALLOC_E* codes. The calling thread's
 * last error (the Python exception that the ordinary path raised) is kept per thread until its
 * next failure: error_message() reads its text without the GIL; take_error() hands the exception
 * over (for re-raising it in Python); raise_error(), with the GIL held, sets it as the current
 * Python exception.
 *
 * Sizes are bytes; pointers and stream handles are the device's (CUdeviceptr, CUstream) as
 * uintptr_t; stream 0 is the legacy default stream.
 */
#ifndef PYALLOC_CAPI_H
#define PYALLOC_CAPI_H

#include <stddef.h>
#include <stdint.h>

#define PYALLOC_CAPI_CAPSULE "pyalloc._capi.table"
#define PYALLOC_CAPI_VERSION 1

enum {
    PYALLOC_OK = 0,
    PYALLOC_EOOM = 1,        /* out of memory: a pyalloc.OutOfMemoryError (a MemoryError) */
    PYALLOC_EVALUE = 2,      /* bad argument: unknown pointer, double free, bad device or stream */
    PYALLOC_EOTHER = 3       /* any other exception (e.g. a CUDA driver error) */
};

typedef struct pyalloc_capi {
    uint32_t version;        /* PYALLOC_CAPI_VERSION */
    uint32_t size;           /* sizeof(pyalloc_capi), so later versions can only append */
    /* Allocate `size` bytes for use on `stream`; *out receives the pointer (0 for 0 bytes). */
    int (*malloc)(int device, size_t size, uintptr_t stream, uintptr_t* out);
    /* Return memory from malloc to the cache (ptr 0 does nothing). */
    int (*free)(int device, uintptr_t ptr);
    /* Declare that the memory at ptr is also used on `stream` (pyalloc's record_stream).
     * device -1: whichever default allocator owns ptr (looked up with the GIL). */
    int (*record_stream)(int device, uintptr_t ptr, uintptr_t stream);
    /* The calling thread's last error code and message ("" when none); no GIL needed. The
     * message stays valid until this thread's next failing call. */
    int (*error_code)(void);
    const char* (*error_message)(void);
    /* Hands over the thread's last exception as new references (PyObject*: type, value,
     * traceback; all NULL when none) and forgets it. Takes the GIL itself. */
    void (*take_error)(void** type, void** value, void** traceback);
    /* Drops references from take_error; takes the GIL itself. */
    void (*release_error)(void* type, void* value, void* traceback);
    /* With the GIL held: sets the thread's last exception as the current Python exception
     * (a RuntimeError when none is kept) and returns -1. */
    int (*raise_error)(void);
    /* Release cached segments of `device`'s default allocator (-1: of every default allocator)
     * back to the device, as pyalloc.empty_cache(device). Takes the GIL. */
    int (*empty_cache)(int device);
} pyalloc_capi;

#endif
