"""Helpers shared by the private-pool and graph tests (a module, not a conftest: imported by name)."""
from pyalloc import CachingAllocator, SimDevice

import backends
from units import GiB


def make(config="", total_memory=80 * GiB, check_reuse=False):
    """The running test's device and a CachingAllocator on it with an explicit config (no
    environment): tests/backends.py's make() (a SimDevice of `total_memory` bytes, or on a [cuda]
    run the GPU), or a SimDevice with the reuse sanitizer when `check_reuse` (@sim_only tests)."""
    if not check_reuse:
        return backends.make(config, total_memory)
    assert backends._backend == "sim", "a test of the reuse sanitizer is @sim_only"
    sim = SimDevice(total_memory, check_reuse=True)
    return sim, CachingAllocator(backend=sim, config=config)


def pool_of(alloc, ptr):
    """The pool id of the segment of `alloc` that holds `ptr`."""
    for seg in alloc._segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["pool_id"]
    raise AssertionError(f"{ptr:#x} is in no segment of device {alloc.device}")
