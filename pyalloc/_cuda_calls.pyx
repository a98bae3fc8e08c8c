# cython: language_level=3
"""The CUDA driver calls shared by CudaDevice (_cuda.pyx) and CudaHost (_cuda_host.pyx): CUresult
errors as pyalloc.CudaError, and the memory calls run in relaxed capture mode (declared, with
why, in _cuda_calls.pxd). Imported only with a CUDA backend, as _cuda is."""
from pyalloc.errors import CudaError


def error_name(int result):
    """(name, description) of a CUresult, e.g. ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory")."""
    cdef const char* name = NULL
    cdef const char* desc = NULL
    cdef cydriver.CUresult r = <cydriver.CUresult>result
    if cydriver.cuGetErrorName(r, &name) != cydriver.CUDA_SUCCESS or name == NULL:
        name = NULL
    if cydriver.cuGetErrorString(r, &desc) != cydriver.CUDA_SUCCESS or desc == NULL:
        desc = NULL
    return ((name.decode("utf-8", "replace") if name != NULL else ""),
            (desc.decode("utf-8", "replace") if desc != NULL else ""))


cdef int raise_error(str call, cydriver.CUresult result) except -1:
    name, desc = error_name(<int>result)
    raise CudaError(call, <int>result, name, desc)


cdef cydriver.CUresult _mem_alloc(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    cdef _MemoryArgs* a = <_MemoryArgs*>p
    return cydriver.cuMemAlloc(&a.ptr, a.nbytes)


cdef cydriver.CUresult _mem_free(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    return cydriver.cuMemFree((<_MemoryArgs*>p).ptr)


cdef cydriver.CUresult _mem_get_info(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    cdef _MemoryArgs* a = <_MemoryArgs*>p
    return cydriver.cuMemGetInfo(a.free_bytes, a.total_bytes)


cdef cydriver.CUresult _address_reserve(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    cdef _MemoryArgs* a = <_MemoryArgs*>p
    return cydriver.cuMemAddressReserve(&a.ptr, a.nbytes, 0, 0, 0)


cdef cydriver.CUresult _address_free(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    cdef _MemoryArgs* a = <_MemoryArgs*>p
    return cydriver.cuMemAddressFree(a.ptr, a.nbytes)


cdef cydriver.CUresult _map_pages(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    """Create (unless g.kept: the handles exist), map and open the pages; on any failure undo
    this call's work, so that nothing is left half mapped. Returns the first failure (the r_*
    fields say which step)."""
    cdef _Pages* g = <_Pages*>p
    cdef size_t created = g.count if g.kept else 0, mapped = 0, i
    while created < g.count:
        g.r_create = cydriver.cuMemCreate(&g.handles[created], g.page, g.prop, 0)
        if g.r_create != cydriver.CUDA_SUCCESS:
            break
        created += 1
    if created == g.count:
        while mapped < g.count:
            g.r_map = cydriver.cuMemMap(<cydriver.CUdeviceptr>(g.addr + mapped * g.page), g.page, 0,
                                        g.handles[mapped], 0)
            if g.r_map != cydriver.CUDA_SUCCESS:
                break
            mapped += 1
    if mapped == g.count:
        g.r_access = cydriver.cuMemSetAccess(<cydriver.CUdeviceptr>g.addr, g.nbytes, g.access, g.access_count)
    if g.r_access != cydriver.CUDA_SUCCESS or mapped != g.count:
        for i in range(mapped):
            cydriver.cuMemUnmap(<cydriver.CUdeviceptr>(g.addr + i * g.page), g.page)
        for i in range(0 if g.kept else created):
            cydriver.cuMemRelease(g.handles[i])
    if g.r_create != cydriver.CUDA_SUCCESS:
        return g.r_create
    return g.r_map if g.r_map != cydriver.CUDA_SUCCESS else g.r_access


cdef cydriver.CUresult _unmap_pages(void* p) except ?cydriver.CUDA_ERROR_NOT_FOUND nogil:
    """Unmap the range (unless g.addr is 0: release only), then, unless g.kept, release each
    page's allocation (stopping at the first failure). Returns the first failure (the r_* fields
    say which step)."""
    cdef _Pages* g = <_Pages*>p
    cdef size_t i
    if g.addr:
        g.r_unmap = cydriver.cuMemUnmap(<cydriver.CUdeviceptr>g.addr, g.nbytes)
        if g.r_unmap != cydriver.CUDA_SUCCESS or g.kept:
            return g.r_unmap
    for i in range(g.count):
        g.r_release = cydriver.cuMemRelease(g.handles[i])
        if g.r_release != cydriver.CUDA_SUCCESS:
            break
        g.released += 1
    return g.r_release
