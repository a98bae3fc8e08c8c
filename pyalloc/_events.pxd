# Cross-stream events and stream lifetime (_events.pyx), over the device state.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector

from pyalloc._types cimport Block
from pyalloc._device cimport DeviceState

ctypedef int (*mark_unused_fn)(DeviceState*, vector[uintptr_t]*, vector[char]*) except -1

cdef int insert_events(DeviceState* a, Block* b) except -1
cdef int destroy_events(DeviceState* a, bint outstanding) except -1
cdef int process_events(DeviceState* a) except -1
cdef int process_some_events(DeviceState* a, size_t streams) except -1
cdef int synchronize_and_free_events(DeviceState* a) except -1
cdef int flush_deferred_blocks(DeviceState* a) except -1
# The stream objects the allocator object keeps (its dicts, ordered by its pins_lock).
cdef int release_allocation_streams(DeviceState* a, object pins_lock, dict objects) except -1
cdef int reap_dropped_streams(DeviceState* a, object pins_lock, dict objects, dict pins) except -1
cdef int prune_stream_pins(DeviceState* a, object pins_lock, dict pins) except -1
cdef int pin_stream(DeviceState* a, object pins_lock, dict pins, uintptr_t s, object stream) except -1
cdef bint record_use(DeviceState* a, Block* b, uintptr_t s, bint last_use) except -1
cdef bint stream_is_alive(DeviceState* a, uintptr_t stream) except -1
cdef int keep_allocation_stream(DeviceState* a, object pins_lock, dict objects, dict pins,
                                uintptr_t stream, object stream_object) except -1
