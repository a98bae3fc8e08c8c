# cython: language_level=3
"""CudaHost: pinned host memory from the CUDA driver, for the caching host allocator
(pyalloc/_host.pyx), over a CudaDevice whose streams and events the blocks use.

cuMemHostAlloc / cuMemFreeHost (the default path), or posix_memalign'd pages touched by threads and
then cuMemHostRegister / cuMemHostUnregister (pinned_use_cuda_host_register). Each driver call is
made in the device's primary context (retained here; the caller's context comes back) with this
thread in relaxed capture mode, as PyTorch's CUDAStreamCaptureModeGuard makes its cudaHostAlloc
and cudaHostRegister: allocating pinned memory while another stream captures must not invalidate
that capture. Blocking calls run without the GIL. Importing this module loads cuda.bindings'
driver bindings; pyalloc.host imports it only for a CUDA device.
"""
cimport cuda.bindings.cydriver as cydriver
from pyalloc._cuda_calls cimport check
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free as c_free
from posix.stdlib cimport posix_memalign

from pyalloc._backend cimport Backend
from pyalloc._host_backend cimport HostBackend

cdef extern from "_host_types.h" namespace "pyalloc_host" nogil:
    void touch_pages_c "pyalloc_host::touch_pages"(uintptr_t ptr, size_t size, int threads)

cdef enum:
    OP_ALLOC = 0
    OP_FREE = 1
    OP_REGISTER = 2
    OP_UNREGISTER = 3

cdef tuple CALLS = ("cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister", "cuMemHostUnregister")


cdef class CudaHost(HostBackend):
    """Pinned host memory of the process, allocated in `device`'s primary context (a CudaDevice).
    Sizes are bytes; addresses ints. close() releases the context reference."""
    cdef cydriver.CUcontext _ctx
    cdef cydriver.CUdevice _cudevice
    cdef bint _retained

    def __init__(self, Backend device not None):
        cdef cydriver.CUresult r
        cdef cydriver.CUcontext ctx = NULL
        cdef cydriver.CUdevice dev = 0
        if device.kind != "cuda":
            raise ValueError(f"CudaHost needs a CudaDevice, got a {device.kind!r} backend ({device!r})")
        HostBackend.__init__(self, device)
        self.kind = "cuda"
        check(cydriver.cuDeviceGet(&dev, device.device), "cuDeviceGet")
        with nogil:
            r = cydriver.cuDevicePrimaryCtxRetain(&ctx, dev)
        check(r, "cuDevicePrimaryCtxRetain")
        self._ctx = ctx
        self._cudevice = dev
        self._retained = True

    def __dealloc__(self):
        if self._retained:
            cydriver.cuDevicePrimaryCtxRelease(self._cudevice)

    def close(self):
        """Release the primary context reference (the memory stays the allocator's to free)."""
        if self._retained:
            self._retained = False
            check(cydriver.cuDevicePrimaryCtxRelease(self._cudevice), "cuDevicePrimaryCtxRelease")

    cdef int _call(self, int op, void** p, size_t size) except -1:
        """One driver call `op` in our context and relaxed capture mode, the GIL released; the
        caller's context and mode come back; results checked in the order made."""
        cdef cydriver.CUcontext prev = NULL
        cdef cydriver.CUstreamCaptureMode mode = cydriver.CU_STREAM_CAPTURE_MODE_RELAXED
        cdef cydriver.CUresult r_enter, r_relax = cydriver.CUDA_SUCCESS
        cdef cydriver.CUresult r_call = cydriver.CUDA_SUCCESS, r_restore = cydriver.CUDA_SUCCESS
        cdef cydriver.CUresult r_leave = cydriver.CUDA_SUCCESS
        if not self._retained:
            raise RuntimeError("CudaHost: closed")
        with nogil:
            r_enter = cydriver.cuCtxGetCurrent(&prev)
            if r_enter == cydriver.CUDA_SUCCESS and prev != self._ctx:
                r_enter = cydriver.cuCtxSetCurrent(self._ctx)
            if r_enter == cydriver.CUDA_SUCCESS:
                r_relax = cydriver.cuThreadExchangeStreamCaptureMode(&mode)
                if r_relax == cydriver.CUDA_SUCCESS:
                    if op == OP_ALLOC:
                        r_call = cydriver.cuMemHostAlloc(p, size, 0)
                    elif op == OP_FREE:
                        r_call = cydriver.cuMemFreeHost(p[0])
                    elif op == OP_REGISTER:
                        r_call = cydriver.cuMemHostRegister(p[0], size, 0)
                    else:
                        r_call = cydriver.cuMemHostUnregister(p[0])
                    r_restore = cydriver.cuThreadExchangeStreamCaptureMode(&mode)
                if prev != self._ctx:
                    r_leave = cydriver.cuCtxSetCurrent(prev)
        check(r_enter, "cuCtxSetCurrent")
        check(r_relax, "cuThreadExchangeStreamCaptureMode")
        if r_call != cydriver.CUDA_SUCCESS and op == OP_ALLOC:
            p[0] = NULL
        check(r_call, CALLS[op])
        check(r_restore, "cuThreadExchangeStreamCaptureMode")
        check(r_leave, "cuCtxSetCurrent")
        return 0

    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        cdef void* p = NULL
        self._call(OP_ALLOC, &p, nbytes)
        ptr[0] = <uintptr_t>p
        return 0

    cdef int host_free(self, uintptr_t ptr, size_t nbytes) except -1:
        cdef void* p = <void*>ptr
        return self._call(OP_FREE, &p, nbytes)

    cdef int host_malloc(self, size_t nbytes, uintptr_t* ptr) except -1:
        cdef void* p = NULL
        cdef int r
        with nogil:
            r = posix_memalign(&p, 4096, nbytes)
        if r != 0:
            raise MemoryError(f"CudaHost: posix_memalign of {nbytes} bytes failed (errno {r})")
        ptr[0] = <uintptr_t>p
        return 0

    cdef int host_mfree(self, uintptr_t ptr, size_t nbytes) except -1:
        c_free(<void*>ptr)
        return 0

    cdef int touch_pages(self, uintptr_t ptr, size_t nbytes, int threads) except -1:
        with nogil:
            touch_pages_c(ptr, nbytes, threads)
        return 0

    cdef int host_register(self, uintptr_t ptr, size_t nbytes) except -1:
        cdef void* p = <void*>ptr
        return self._call(OP_REGISTER, &p, nbytes)

    cdef int host_unregister(self, uintptr_t ptr, size_t nbytes) except -1:
        cdef void* p = <void*>ptr
        return self._call(OP_UNREGISTER, &p, nbytes)
