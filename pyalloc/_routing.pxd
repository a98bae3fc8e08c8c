# Private pools and routing (_routing.pyx), over the device state.
from libc.stdint cimport uintptr_t

from pyalloc._types cimport BlockPool, MempoolId, PrivatePool, Route
from pyalloc._device cimport DeviceState

cdef PrivatePool* routed_pool(DeviceState* a, uintptr_t stream) except? NULL
cdef PrivatePool* create_or_incref_pool(DeviceState* a, MempoolId pid) except NULL
cdef size_t pool_free_bytes(BlockPool* pool) noexcept
cdef size_t private_cached(DeviceState* a) noexcept
cdef size_t private_reserved(DeviceState* a) noexcept
cdef int begin_route(DeviceState* a, Route route) except -1
cdef int end_route(DeviceState* a, MempoolId pid) except -1
