"""Cost of memory history on the hot path: one malloc + free pair served from the cache.

Run: python -m pytest bench/test_bench_history.py --benchmark-only --benchmark-group-by=func
Compare each case with `floor` (an empty call into the extension) measured in the same run;
machines here are noisy, absolute times are not comparable between runs.
"""
import pytest

from pyalloc import CachingAllocator, SimDevice

NBYTES = 4096     # a small-pool block: the pair is a best-fit search, a split and a merge

CASES = {
    "off": None,
    "all-context-none": dict(enabled="all", context=None),
    "state-context-state": dict(enabled="state", context="state"),
    "all-context-alloc": dict(enabled="all", context="alloc"),
    "all-context-all": dict(enabled="all", context="all"),
}


def make_allocator(history):
    alloc = CachingAllocator(backend=SimDevice(), config="")
    if history is not None:
        alloc.record_memory_history(**history)
    alloc.free(alloc.malloc(NBYTES))      # the segment exists: every later pair is a cache hit
    return alloc


def test_floor(benchmark):
    alloc = make_allocator(None)
    benchmark(alloc._noop)


@pytest.mark.parametrize("case", list(CASES))
def test_malloc_free_pair(benchmark, case):
    alloc = make_allocator(CASES[case])
    malloc, free = alloc.malloc, alloc.free

    def pair():
        free(malloc(NBYTES))

    benchmark(pair)
    assert alloc.memory_allocated() == 0
