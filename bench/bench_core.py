"""Hot-path benchmarks on the simulated device (no GPU needed).

Run:  python -m pytest bench/bench_core.py --benchmark-only --benchmark-group-by=group
Every timed function makes the same number of Python calls as its floor, so ratios to the floor
measured in the same run (printed by bench/report.py) are comparable across noisy machines.

Floors: `floor` is two calls of an empty method of the extension; `floor_signature` is two calls of
empty methods with malloc's and free's argument shapes.
"""
import random

import pytest

import pyalloc

PAIR_SIZES = {"4KiB": 4096, "1MiB": 1 << 20}
LIVE_COUNTS = (100, 10_000, 100_000)


def make_allocator():
    return pyalloc.CachingAllocator(backend=pyalloc.SimDevice(), config="")


@pytest.mark.benchmark(group="pair")
def test_floor(benchmark):
    noop = make_allocator()._noop

    def two_calls():
        noop()
        noop()
    benchmark(two_calls)


@pytest.mark.benchmark(group="pair")
def test_floor_signature(benchmark):
    a = make_allocator()
    noop_malloc, noop_free = a._noop_malloc, a._noop_free

    def two_calls():
        noop_free(noop_malloc(4096))
    benchmark(two_calls)


@pytest.mark.benchmark(group="pair")
@pytest.mark.parametrize("size", list(PAIR_SIZES), ids=list(PAIR_SIZES))
def test_malloc_free_pair(benchmark, size):
    a = make_allocator()
    nbytes = PAIR_SIZES[size]
    malloc, free = a.malloc, a.free
    free(malloc(nbytes))          # warm: the segment is cached, every timed pair is a cache hit
    calls_before = dict(a.backend.counters)

    def pair():
        free(malloc(nbytes))
    benchmark(pair)
    assert a.backend.counters == calls_before, "a cache hit must make no backend call"


def populate(a, live, seed=0):
    """Hold `live` blocks: half allocated, half cached (free, unmergeable), sizes 512 B..1 MiB."""
    rng = random.Random(seed)
    ptrs = [a.malloc(rng.randrange(1, 1 << 20)) for _ in range(live)]
    for p in ptrs[::2]:
        a.free(p)
    return ptrs[1::2]


@pytest.mark.benchmark(group="scaling")
@pytest.mark.parametrize("live", LIVE_COUNTS)
def test_pair_with_live_blocks(benchmark, live):
    a = make_allocator()
    keep = populate(a, live)
    malloc, free = a.malloc, a.free
    sizes = [4096, 65536, 300_000, 900_000]

    def four_pairs():
        for s in sizes:
            free(malloc(s))
    benchmark(four_pairs)
    assert len(keep) == live // 2
