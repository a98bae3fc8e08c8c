# The CUDA driver calls the GPU backends share (CudaDevice in _cuda.pyx, CudaHost in _cuda_host.pyx):
# CUresult checking, and the memory calls that CudaDevice._relaxed_call runs in relaxed capture
# mode (each a _MemoryCall over an argument block). Implemented in _cuda_calls.pyx.
cimport cuda.bindings.cydriver as cydriver
from libc.stdint cimport uintptr_t
from libc.string cimport memset


cdef int raise_error(str call, cydriver.CUresult result) except -1


cdef inline int check(cydriver.CUresult result, str call) except -1:
    if result != cydriver.CUDA_SUCCESS:
        raise_error(call, result)
    return 0


cdef inline int check_in_context(cydriver.CUresult r_enter, cydriver.CUresult r_call, str call,
                                 cydriver.CUresult r_leave) except -1:
    """The results of one call made with our context current (CudaDevice._enter, the call,
    _leave), checked in that order: the first failure is the error raised."""
    check(r_enter, "cuCtxSetCurrent")
    check(r_call, call)
    check(r_leave, "cuCtxSetCurrent")
    return 0


# ------------------------------------------------------------------- relaxed capture mode
#
# While a stream captures in global mode (the default, and what torch.cuda.graph uses), every
# thread is "prohibited from potentially unsafe API calls": cuMemAlloc, cuMemFree and friends fail
# with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture. Allocation is not part of
# the captured work (the allocator hands out memory at capture time and the graph reuses it at
# every replay), so, like PyTorch's cudaMallocMaybeCapturing, the memory calls below run with this
# thread switched to relaxed mode and then switched back:
#
#     mode = RELAXED; cuThreadExchangeStreamCaptureMode(&mode)   # mode now holds the caller's
#     ... cuMemAlloc ...
#     cuThreadExchangeStreamCaptureMode(&mode)                   # the caller's mode is back
#
# CudaDevice._relaxed_call is that pattern, written once: each memory call is a _MemoryCall (a
# function of one argument block, below) that it runs between the two exchanges, and the
# results of every step come back in a _Relaxed for the caller to check in its own order (which
# failure is raised first, and what it still records, differ: segment_alloc must report out of
# memory without raising, vm_release and vm_unmap record what the driver did release).
#
# Cost: two calls per driver memory call, on the slow path only (a cache hit never reaches the
# backend). cuThreadExchangeStreamCaptureMode swaps a thread-local value in the driver (no lock,
# no system call, no device work): tens of nanoseconds through cydriver's function pointer, against
# microseconds to milliseconds for cuMemAlloc/cuMemFree/cuMemMap themselves. The fake-driver tests
# count exactly two exchanges per segment allocation and none for a cache hit.
# Exchanging unconditionally is cheaper than asking first whether anything captures (that is a
# driver call too) and also covers captures begun by other threads, which we cannot see.

ctypedef cydriver.CUresult (*_MemoryCall)(void* args) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil

cdef struct _Relaxed:
    # The result of each step of CudaDevice._relaxed_call; CUDA_SUCCESS for a step not taken.
    cydriver.CUresult enter     # making our context current (when asked for)
    cydriver.CUresult relax     # the exchange into relaxed mode: nothing else ran if it failed
    cydriver.CUresult call      # the memory call
    cydriver.CUresult restore   # the exchange back to the caller's mode (made whenever relax worked)
    cydriver.CUresult leave     # the caller's context back (made whenever enter worked)


cdef inline int check_relaxed(_Relaxed* r, str call) except -1:
    """The steps of one relaxed call checked in the order they ran (context, mode, `call`, mode
    back, context back): for callers with nothing to record between them."""
    check(r.enter, "cuCtxSetCurrent")
    check(r.relax, "cuThreadExchangeStreamCaptureMode")
    check(r.call, call)
    check(r.restore, "cuThreadExchangeStreamCaptureMode")
    check(r.leave, "cuCtxSetCurrent")
    return 0


cdef struct _MemoryArgs:
    # The arguments of one single-call _MemoryCall.
    cydriver.CUdeviceptr ptr    # the address: given (free, address free) or received (alloc, reserve)
    size_t nbytes
    size_t* free_bytes          # cuMemGetInfo's answers
    size_t* total_bytes


cdef struct _Pages:
    # The pages of one vm_map or vm_unmap: `count` pages of `page` bytes from `addr`, one
    # physical allocation (handles[i]) each, and the result of each kind of call made on them.
    uintptr_t addr
    size_t nbytes
    size_t page
    size_t count
    cydriver.CUmemGenericAllocationHandle* handles
    cydriver.CUmemAllocationProp* prop      # vm_map: what to create
    cydriver.CUmemAccessDesc* access        # vm_map: who may read and write
    size_t access_count
    bint kept                               # vm_map_handles / vm_unmap_keep: the handles exist
    size_t released                         # pages released (the first `released` handles)
    cydriver.CUresult r_create, r_map, r_access, r_unmap, r_release


cdef inline _Pages _pages(uintptr_t addr, size_t nbytes, size_t page,
                          cydriver.CUmemGenericAllocationHandle* handles) noexcept:
    """A _Pages for [addr, addr + nbytes) in pages of `page` bytes, no call made yet."""
    cdef _Pages g
    memset(&g, 0, sizeof(g))                # CUDA_SUCCESS is 0: every result "not failed"
    g.addr, g.nbytes, g.page, g.count, g.handles = addr, nbytes, page, nbytes // page, handles
    return g


cdef cydriver.CUresult _mem_alloc(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
cdef cydriver.CUresult _mem_free(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
cdef cydriver.CUresult _mem_get_info(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
cdef cydriver.CUresult _address_reserve(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
cdef cydriver.CUresult _address_free(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
cdef cydriver.CUresult _map_pages(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
cdef cydriver.CUresult _unmap_pages(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil
