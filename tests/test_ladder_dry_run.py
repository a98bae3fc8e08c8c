"""The release ladder's dry run (what replay uses to tell the allocator's own segment frees from
empty_cache calls) counts exactly what the real ladder then releases, under every setting,
expandable segments included."""
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice

from units import MiB

SETTINGS = [
    "",
    "max_split_size_mb:20",
    "max_split_size_mb:40,garbage_collection_threshold:0.5",
    "garbage_collection_threshold:0.6",
    "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:20",
    "expandable_segments:True,garbage_collection_threshold:0.5",
    "expandable_segments:True,max_split_size_mb:64,garbage_collection_threshold:0.7",
    "expandable_segments:True,recycle_pages:True",
    "expandable_segments:True,recycle_pages:True,garbage_collection_threshold:0.5",
]


def released_in_malloc(alloc, size, stream):
    """(bytes the dry run says the malloc's ladder releases, bytes it then released)."""
    dry = alloc._dry_release_bytes(size, stream)
    before = alloc.memory_stats()["reserved_bytes.all.freed"]
    ptr = None
    try:
        ptr = alloc.malloc(size, stream)
    except OutOfMemoryError:
        pass
    return dry, alloc.memory_stats()["reserved_bytes.all.freed"] - before, ptr


def run_program(config, total_mib, fraction, ops):
    """Run (op, size, pick) ops; returns the (size, dry, real) of every malloc that differed."""
    sim = SimDevice(total_mib * MiB)
    alloc = CachingAllocator(backend=sim, config=config)
    if fraction is not None:
        alloc.set_memory_fraction(fraction)
    streams = [0, sim.create_stream(), sim.create_stream()]
    live, wrong = [], []
    for op, size, pick in ops:
        if op == "free" and live:
            alloc.free(live.pop(pick % len(live)))
        elif op == "empty":
            alloc.empty_cache()
        elif op == "malloc":
            dry, real, ptr = released_in_malloc(alloc, size, streams[pick % 3])
            if ptr is not None:
                live.append(ptr)
            if dry != real:
                wrong.append((size, dry, real))
    return wrong


SIZES = st.one_of(st.integers(1, MiB), st.integers(MiB, 12 * MiB), st.integers(12 * MiB, 60 * MiB))
OPS = st.lists(st.tuples(st.sampled_from(["malloc", "malloc", "free", "empty"]), SIZES,
                         st.integers(0, 1 << 30)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(SETTINGS), total_mib=st.sampled_from([96, 160, 256]),
       fraction=st.sampled_from([None, 0.8]), ops=OPS)
def test_dry_run_releases_what_the_ladder_releases(config, total_mib, fraction, ops):
    assert run_program(config, total_mib, fraction, ops) == []


@pytest.mark.parametrize("config", SETTINGS)
def test_dry_run_is_exact_on_long_random_programs(config):
    """Long programs (sizes 256 B to 64 MiB skewed small, 45% frees): the expandable settings'
    dry run used to over-count there (it took the request's pages as the growth, where the
    segment's free tail already covered part of it)."""
    rng = random.Random(f"dry-run {config}")
    for _ in range(8):
        ops = []
        for _ in range(300):
            r = rng.random()
            op = "free" if r < 0.45 else "empty" if r < 0.48 else "malloc"
            ops.append((op, int(256 * (64 * MiB / 256) ** (rng.random() ** 2)), rng.randrange(1 << 30)))
        assert run_program(config, rng.choice([96, 160, 256, 512]), rng.choice([None, 0.5, 0.9]), ops) == []


def test_dry_run_counts_the_freeable_private_pools_the_flush_releases():
    """The full flush also releases the cached segments of private pools nothing uses any more:
    the dry run counts them (it once looked at the default pools only)."""
    from pyalloc._core import current_thread_key
    sim = SimDevice(64 * MiB)
    alloc = CachingAllocator(backend=sim, config="")
    pool = (0, 12345)
    alloc.begin_allocate_to_pool(pool, ("thread", current_thread_key()))      # the pool's one use
    in_pool = alloc.malloc(20 * MiB)
    alloc.end_allocate_to_pool(pool)
    alloc.free(in_pool)
    alloc.release_pool(pool)            # freeable: its cached 20 MiB segment goes at the next flush
    held = alloc.malloc(40 * MiB)       # the device has 4 MiB left
    dry, real, ptr = released_in_malloc(alloc, 20 * MiB, 0)
    assert (dry, real) == (20 * MiB, 20 * MiB) and ptr is not None and held
