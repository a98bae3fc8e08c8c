"""The release ladder's dry run (what replay uses to tell the allocator's own segment frees from
empty_cache calls) releases, in its count, exactly what the real ladder then releases."""
from hypothesis import HealthCheck, given, settings, strategies as st

from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice

MiB = 1 << 20

SETTINGS = [
    "",
    "max_split_size_mb:20",
    "max_split_size_mb:40,garbage_collection_threshold:0.5",
    "garbage_collection_threshold:0.6",
    "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:20",
    "expandable_segments:True,garbage_collection_threshold:0.5",
]

SIZES = st.one_of(st.integers(1, 1 * MiB), st.integers(1 * MiB, 12 * MiB), st.integers(12 * MiB, 60 * MiB))
OPS = st.lists(st.tuples(st.sampled_from(["malloc", "malloc", "free", "empty"]), SIZES,
                         st.integers(0, 1 << 30)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(SETTINGS), total_mib=st.sampled_from([96, 160, 256]),
       fraction=st.sampled_from([None, 0.8]), ops=OPS)
def test_dry_run_releases_what_the_ladder_releases(config, total_mib, fraction, ops):
    sim = SimDevice(total_mib * MiB)
    alloc = CachingAllocator(backend=sim, config=config)
    if fraction is not None:
        alloc.set_memory_fraction(fraction)
    live = []
    for op, size, pick in ops:
        if op == "free" and live:
            alloc.free(live.pop(pick % len(live)))
        elif op == "empty":
            alloc.empty_cache()
        elif op == "malloc":
            dry = alloc._dry_release_bytes(size)
            before = alloc.memory_stats()["reserved_bytes.all.freed"]
            try:
                live.append(alloc.malloc(size))
            except OutOfMemoryError:
                pass
            real = alloc.memory_stats()["reserved_bytes.all.freed"] - before
            assert dry == real, (op, size, dry, real)
