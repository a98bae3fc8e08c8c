# Frees during a CUDA-graph capture (_capture.pyx), over the device state.
from libc.stdint cimport uintptr_t, uint64_t

from pyalloc._types cimport Block, BlockPool
from pyalloc._device cimport DeviceState

cdef int defer_free(DeviceState* a, Block* b) except -1
cdef int free_safe_blocks_in_capture(DeviceState* a, uintptr_t stream, BlockPool* pool,
                                     size_t size) except -1
cdef int mark_last_use(DeviceState* a, Block* b, uintptr_t stream) except -1
cdef void forget_last_use(DeviceState* a, Block* b, uintptr_t stream) noexcept
cdef int mark_captured_use(DeviceState* a, Block* b, uintptr_t stream) except -1
cdef int unmark_real_use(DeviceState* a, Block* b, uintptr_t stream) except -1
cdef void end_capture_marks(DeviceState* a, uint64_t capture_id) noexcept
cdef void forget_capture_uses(DeviceState* a, Block* b) noexcept
