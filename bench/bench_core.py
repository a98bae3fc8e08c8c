"""Hot-path benchmarks on the simulated device (no GPU needed).

Run:  python -m pytest bench/bench_core.py --benchmark-only --benchmark-group-by=group
Every timed function makes the same number of Python calls as its floor, so ratios to the floor
measured in the same run (printed by bench/report.py) are comparable across noisy machines.

Floors: `floor` is two calls of an extension method that does next to nothing (_lock_held reads
one word); `floor_signature` is two calls of C functions that do nothing with malloc's and free's
argument shapes (a dict's get: one positional argument each).

The pair and scaling tests also measure their ratio interleaved (bench/interleave.py: the pair and
the floor timed in alternation, median of the per-round ratios) and store it in extra_info
(pair_over_floor, cost_over_100_live), which drifts of the machine's speed between two
benchmarks do not move. bench/report.py prints both.
"""
import random

import pytest

import pyalloc
from interleave import interleaved, ratio, repeat

PAIR_SIZES = {"4KiB": 4096, "1MiB": 1 << 20}
LIVE_COUNTS = (100, 10_000, 100_000)


def make_allocator():
    return pyalloc.CachingAllocator(backend=pyalloc.SimDevice(), config="")


def floor_calls(allocator):
    """The floor: two calls of an extension method that does next to nothing (reads one word)."""
    noop = allocator._lock_held

    def two_calls():
        noop()
        noop()
    return two_calls


def record_ratio(benchmark, key, samples, numerator, denominator):
    median, q1, q3 = ratio(samples, numerator, denominator)
    benchmark.extra_info[key] = round(median, 3)
    benchmark.extra_info[key + "_iqr"] = f"{q1:.2f}-{q3:.2f}"


@pytest.mark.benchmark(group="pair")
def test_floor(benchmark):
    benchmark(floor_calls(make_allocator()))


@pytest.mark.benchmark(group="pair")
def test_floor_signature(benchmark):
    noop_malloc = noop_free = {}.get       # C calls of malloc's and free's shapes, doing nothing

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
    samples = interleaved({"pair": repeat(pair), "floor": repeat(floor_calls(a))})
    record_ratio(benchmark, "pair_over_floor", samples, "pair", "floor")
    assert a.backend.counters == calls_before


def populate(a, live, seed=0):
    """Hold `live` blocks: half allocated, half cached (free, unmergeable), sizes 512 B..1 MiB."""
    rng = random.Random(seed)
    ptrs = [a.malloc(rng.randrange(1, 1 << 20)) for _ in range(live)]
    for p in ptrs[::2]:
        a.free(p)
    return ptrs[1::2]


def four_pairs_on(live):
    """Four cache-hit pairs (4 KiB .. 900 KB) on an allocator holding `live` blocks."""
    a = make_allocator()
    keep = populate(a, live)
    malloc, free = a.malloc, a.free
    sizes = [4096, 65536, 300_000, 900_000]

    def four_pairs():
        for s in sizes:
            free(malloc(s))
    four_pairs.keep = keep              # the live blocks stay referenced with the closure
    return four_pairs


@pytest.mark.benchmark(group="scaling")
@pytest.mark.parametrize("live", LIVE_COUNTS)
def test_pair_with_live_blocks(benchmark, live):
    four_pairs = four_pairs_on(live)
    benchmark(four_pairs)
    assert len(four_pairs.keep) == live // 2
    if live != LIVE_COUNTS[0]:
        samples = interleaved({"live": repeat(four_pairs), "base": repeat(four_pairs_on(LIVE_COUNTS[0]))},
                              iterations=500)
        record_ratio(benchmark, f"cost_over_{LIVE_COUNTS[0]}_live", samples, "live", "base")
