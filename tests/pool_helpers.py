"""Helpers shared by the private-pool and graph tests (a module, not a conftest: imported by name)."""
from pyalloc import CachingAllocator, SimDevice

from units import GiB


def make(config="", total_memory=80 * GiB, check_reuse=False):
    """A SimDevice (with the reuse sanitizer when `check_reuse`) and a CachingAllocator on it
    with an explicit config (no environment)."""
    sim = SimDevice(total_memory, check_reuse=check_reuse)
    return sim, CachingAllocator(backend=sim, config=config)


def pool_of(alloc, ptr):
    """The pool id of the segment of `alloc` that holds `ptr`."""
    for seg in alloc._segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["pool_id"]
    raise AssertionError(f"{ptr:#x} is in no segment of device {alloc.device}")
