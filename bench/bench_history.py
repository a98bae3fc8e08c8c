"""Cost of memory history on the hot path: one malloc + free pair served from the cache.

Run:  python -m pytest bench/bench_history.py --benchmark-only --benchmark-group-by=group
Compare every case with the floors measured in the same run (bench/bench_core.py explains them);
absolute times on shared machines are not comparable between runs. bench/history.md has figures.

Cases: history off; enabled="all", context=None (the event trace only: three ring-buffer entries
per pair); enabled="state"/context="state" and the "alloc"/"all" contexts, which capture the
Python stack on malloc (and on free with "all").
"""
import pytest

import pyalloc

NBYTES = 4096     # small-pool block: the pair is a best-fit search, a split and a merge

CASES = {
    "off": None,
    "all-context-none": dict(enabled="all", context=None),
    "state-context-state": dict(enabled="state", context="state"),
    "all-context-alloc": dict(enabled="all", context="alloc"),
    "all-context-all": dict(enabled="all", context="all"),
}


def make_allocator(history):
    a = pyalloc.CachingAllocator(backend=pyalloc.SimDevice(), config="")
    if history is not None:
        a.record_memory_history(**history)
    a.free(a.malloc(NBYTES))      # warm: the segment is cached, every timed pair is a cache hit
    return a


@pytest.mark.benchmark(group="history")
def test_floor(benchmark):
    noop = make_allocator(None)._lock_held

    def two_calls():
        noop()
        noop()
    benchmark(two_calls)


@pytest.mark.benchmark(group="history")
def test_floor_signature(benchmark):
    noop_malloc = noop_free = {}.get       # C calls of malloc's and free's shapes, doing nothing

    def two_calls():
        noop_free(noop_malloc(NBYTES))
    benchmark(two_calls)


@pytest.mark.benchmark(group="history")
@pytest.mark.parametrize("case", list(CASES))
def test_malloc_free_pair_history(benchmark, case):
    a = make_allocator(CASES[case])
    malloc, free = a.malloc, a.free

    def pair():
        free(malloc(NBYTES))
    benchmark(pair)
    assert a.memory_allocated() == 0
