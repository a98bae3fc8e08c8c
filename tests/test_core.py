"""Specification of the caching allocator core: PyTorch's native allocator rules, one per test.

A conformance suite: every test runs on SimDevice ([sim]) and, where a GPU is present, on the real
device ([cuda]; skipped with the reason elsewhere), through make(), which gives the test a device
with SimDevice's test API (tests/backends.py: on the GPU, streams whose work waits on host flags).
The few tests that need what only the simulator has (a device of a chosen size, counts of backend
calls, chosen segment addresses, a hook inside a segment allocation) say so with @sim_only(reason).
On the GPU every test's allocator is emptied afterwards and must hold nothing. Expected values come
from the rules of PyTorch's native allocator (c10/cuda/CUDACachingAllocator.cpp, late 2025), worked
out by hand: its blocks, segments and pools, rounding, best fit, splitting and merging, the
cross-stream events of record_stream, and empty_cache.
"""

import gc
import math

import pytest

from pyalloc import Buffer, CachingAllocator, OutOfMemoryError, SimDevice
from backends import backend, make, sim_only  # noqa: F401 (backend: the autouse fixture)

from units import KiB, MiB, GiB

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "small_pool", "large_pool")
FIELDS = ("current", "peak", "allocated", "freed")
SCALARS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
           "num_device_free", "max_split_size")
ALL_KEYS = sorted(
    [f"{s}.{p}.{f}" for s in STAT_NAMES for p in POOLS for f in FIELDS]
    + [f"{s}.{f}" for s in ("oversize_allocations", "oversize_segments") for f in FIELDS]
    + list(SCALARS))


def stat(alloc, key):
    return alloc.memory_stats()[key]


def segment_of(alloc, ptr):
    """The allocator's segment dict holding `ptr`."""
    for seg in alloc._segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"{ptr:#x} is in no segment")


def block_at(alloc, ptr):
    for block in segment_of(alloc, ptr)["blocks"]:
        if block["address"] == ptr:
            return block
    raise AssertionError(f"no block starts at {ptr:#x}")


def expected_stats(**nonzero):
    """Every memory_stats key at 0 (max_split_size -1, "unlimited"), then `nonzero` applied;
    keys are given with '__' for '.' (allocated_bytes__small_pool__current=1024)."""
    out = dict.fromkeys(ALL_KEYS, 0)
    out["max_split_size"] = -1
    for key, value in nonzero.items():
        key = key.replace("__", ".")
        assert key in out, key
        out[key] = value
    return out


def pool_stats(name, pool, current=0, peak=0, allocated=0, freed=0):
    """`name` in `pool` and in "all" (the other pool being untouched)."""
    out = {}
    for p in ("all", pool):
        for field, value in zip(FIELDS, (current, peak, allocated, freed)):
            out[f"{name}__{p}__{field}"] = value
    return out


class CudaStreamProtocol:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class TorchLikeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class CupyLikeStream:
    def __init__(self, handle):
        self.ptr = handle


# =============================================================================== rounding

@pytest.mark.parametrize("size", [1, 100, 511, 512])
def test_requests_below_512_bytes_round_to_512(size):
    sim, alloc = make()
    assert alloc.round_size(size) == 512
    alloc.malloc(size)
    assert stat(alloc, "allocated_bytes.all.current") == 512
    assert stat(alloc, "requested_bytes.all.current") == size


@pytest.mark.parametrize("size,rounded", [(513, 1024), (1000, 1024), (1024, 1024),
                                          (1 * MiB + 1, 1 * MiB + 512), (3 * MiB - 1, 3 * MiB)])
def test_requests_round_up_to_a_multiple_of_512(size, rounded):
    sim, alloc = make()
    assert alloc.round_size(size) == rounded
    alloc.malloc(size)
    assert stat(alloc, "allocated_bytes.all.current") == rounded


@sim_only("counts backend calls (SimDevice.counters)")
def test_zero_bytes_gives_null_pointer_and_no_allocation():
    sim, alloc = make()
    before = alloc.memory_stats()
    assert alloc.malloc(0) == 0
    alloc.free(0)
    assert alloc.memory_stats() == before
    assert sim.counters["segment_alloc"] == 0


@pytest.mark.parametrize("size,rounded", [
    (4100, 5120),                    # 4096..8192 in 4 steps of 1024
    (6000, 6144),
    (5 * MiB + 1, 6 * MiB),          # 4 MiB..8 MiB in 4 steps of 1 MiB
    (100 * MiB, 112 * MiB),          # 64 MiB..128 MiB in steps of 16 MiB
])
def test_roundup_power2_divisions_rounds_to_the_next_division(size, rounded):
    sim, alloc = make("roundup_power2_divisions:4")
    assert alloc.round_size(size) == rounded
    alloc.malloc(size)
    assert stat(alloc, "allocated_bytes.all.current") == rounded
    assert stat(alloc, "requested_bytes.all.current") == size


@pytest.mark.parametrize("size", [4096, 1 * MiB, 2 * MiB, 64 * MiB, 1 * GiB])
def test_roundup_power2_divisions_leaves_powers_of_two_unchanged(size):
    sim, alloc = make("roundup_power2_divisions:8")
    assert alloc.round_size(size) == size


def test_roundup_power2_divisions_applies_only_above_512_times_divisions():
    # PyTorch's round_size uses the divisions only when size > 512 * divisions, so 1200 B with 4
    # divisions (<= 2048) is rounded to 512 (1536), not to the division point 1280 that the
    # docs' worked example names. 4100 B (> 2048) does use them: 5120 rather than 4608.
    sim, alloc = make("roundup_power2_divisions:4")
    assert alloc.round_size(1200) == 1536
    assert alloc.round_size(2000) == 2048
    assert alloc.round_size(4100) == 5120


def test_roundup_power2_divisions_off_by_default():
    sim, alloc = make()
    assert alloc.round_size(4100) == 4608
    assert alloc.round_size(5 * MiB + 1) == 5 * MiB + 512


def test_roundup_power2_divisions_list_picks_bucket_by_size():
    # Buckets are [2^i MiB, 2^(i+1) MiB); bucket 0 also holds everything below 1 MiB.
    # [1:4,2:8,>:1]: bucket 0 -> 4 divisions, bucket 1 ([2, 4) MiB) -> 8, buckets 2.. -> 1 (off).
    sim, alloc = make("roundup_power2_divisions:[1:4,2:8,>:1]")
    assert alloc.round_size(4100) == 5120                          # bucket 0, 4 divisions
    assert alloc.round_size(2 * MiB - 1 * KiB) == 2 * MiB          # bucket 0: 1 MiB + 4 x 256 KiB
    assert alloc.round_size(2 * MiB + 1) == 2 * MiB + 256 * KiB    # bucket 1: steps of 256 KiB
    assert alloc.round_size(3 * MiB + 1) == 3 * MiB + 256 * KiB
    assert alloc.round_size(4 * MiB + 1) == 4 * MiB + 512          # bucket 2: 512 rounding
    assert alloc.round_size(40 * GiB + 1) == 40 * GiB + 512        # last bucket, off


def test_roundup_power2_divisions_list_first_entry_fills_lower_buckets():
    # [4:2,>:8]: buckets 0..1 take the first entry's 2 divisions, bucket 2 too, then 8 above.
    sim, alloc = make("roundup_power2_divisions:[4:2,>:8]")
    assert alloc.round_size(1 * MiB + 1) == 1 * MiB + 512 * KiB     # bucket 0, 2 divisions
    assert alloc.round_size(5 * MiB + 1) == 6 * MiB                 # bucket 2, 2 divisions
    assert alloc.round_size(9 * MiB + 1) == 10 * MiB                # bucket 3, 8 divisions


# =============================================================================== pools and segments

def test_one_mib_request_uses_the_small_pool():
    sim, alloc = make()
    alloc.malloc(1 * MiB)
    s = alloc.memory_stats()
    assert s["allocated_bytes.small_pool.current"] == 1 * MiB
    assert s["allocated_bytes.large_pool.current"] == 0
    assert sim.segments()[0][1] == 2 * MiB


def test_request_rounded_above_one_mib_uses_the_large_pool():
    sim, alloc = make()
    alloc.malloc(1 * MiB + 1)
    s = alloc.memory_stats()
    assert s["allocated_bytes.large_pool.current"] == 1 * MiB + 512
    assert s["allocated_bytes.small_pool.current"] == 0


@pytest.mark.parametrize("size,segment", [
    (1, 2 * MiB), (1 * MiB, 2 * MiB),                                    # small: 2 MiB
    (1 * MiB + 1, 20 * MiB), (5 * MiB, 20 * MiB), (10 * MiB - 512, 20 * MiB),   # < 10 MiB: 20 MiB
    (10 * MiB - 1, 10 * MiB),        # rounds to 10 MiB first, so it gets a 10 MiB segment
    (10 * MiB, 10 * MiB), (10 * MiB + 1, 12 * MiB), (11 * MiB, 12 * MiB),       # >= 10 MiB: 2 MiB
    (64 * MiB, 64 * MiB), (100 * MiB + 512, 102 * MiB),
])
def test_segment_size_for_request(size, segment):
    sim, alloc = make()
    alloc.malloc(size)
    assert sim.segments() == [(sim.segments()[0][0], segment)]
    pool = "small_pool" if size <= 1 * MiB else "large_pool"
    assert stat(alloc, f"reserved_bytes.{pool}.current") == segment
    assert stat(alloc, f"segment.{pool}.current") == 1
    assert stat(alloc, "num_device_alloc") == 1


def test_small_and_large_pools_never_share_segments():
    sim, alloc = make()
    p = alloc.malloc(3 * MiB)          # 20 MiB large segment with a 17 MiB free tail
    q = alloc.malloc(4 * KiB)          # small: gets its own 2 MiB segment
    assert segment_of(alloc, p)["address"] != segment_of(alloc, q)["address"]
    assert stat(alloc, "num_device_alloc") == 2


# =============================================================================== best fit

def test_best_fit_takes_the_smallest_block_that_fits():
    sim, alloc = make()
    ptrs = {size: alloc.malloc(size) for size in (12 * MiB, 16 * MiB, 14 * MiB)}
    for p in ptrs.values():
        alloc.free(p)
    assert alloc.malloc(13 * MiB) == ptrs[14 * MiB]
    assert stat(alloc, "num_device_alloc") == 3


def test_best_fit_prefers_an_exact_fit_over_a_larger_block():
    sim, alloc = make()
    big, exact = alloc.malloc(16 * MiB), alloc.malloc(12 * MiB)
    alloc.free(big)
    alloc.free(exact)
    assert alloc.malloc(12 * MiB) == exact


@sim_only("puts segments at chosen addresses (SimDevice.place_segments)")
def test_best_fit_breaks_ties_by_lowest_address():
    sim, alloc = make()
    high, low = 0x300000000, 0x200000000
    sim.place_segments([(high, 12 * MiB), (low, 12 * MiB)])
    a, b = alloc.malloc(12 * MiB), alloc.malloc(12 * MiB)
    assert (a, b) == (high, low)
    alloc.free(b)          # freed first and last: neither order decides
    alloc.free(a)
    assert alloc.malloc(12 * MiB) == low
    assert alloc.malloc(12 * MiB) == high


def test_freed_block_is_reused_on_the_same_stream():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(4096, s1)
    alloc.free(p)
    assert alloc.malloc(4096, s1) == p
    assert stat(alloc, "num_device_alloc") == 1


def test_no_cross_stream_reuse():
    sim, alloc = make()
    s1, s2 = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(3 * MiB, s1)
    alloc.free(p)
    q = alloc.malloc(3 * MiB, s2)
    assert segment_of(alloc, q)["address"] != segment_of(alloc, p)["address"]
    assert segment_of(alloc, q)["stream"] == s2
    assert stat(alloc, "num_device_alloc") == 2


def test_no_cross_stream_reuse_of_a_split_remainder():
    sim, alloc = make()
    s1 = sim.create_stream()
    alloc.malloc(4 * KiB, s1)          # its 2 MiB segment keeps a free tail on stream s1
    alloc.malloc(4 * KiB, 0)
    assert stat(alloc, "segment.small_pool.current") == 2


# =============================================================================== splitting

def test_small_pool_splits_off_a_remainder_of_512_bytes():
    sim, alloc = make()
    p = alloc.malloc(1 * MiB)                    # 2 MiB segment: 1 MiB remainder
    q = alloc.malloc(1 * MiB - 512)              # leaves exactly 512 bytes
    assert q == p + 1 * MiB
    assert block_at(alloc, q)["size"] == 1 * MiB - 512
    assert stat(alloc, "inactive_split_bytes.small_pool.current") == 512
    r = alloc.malloc(512)                        # takes the 512 byte remainder exactly
    assert r == q + 1 * MiB - 512
    assert stat(alloc, "num_device_alloc") == 1
    assert stat(alloc, "inactive_split.small_pool.current") == 0


def test_large_pool_splits_when_the_remainder_exceeds_one_mib():
    sim, alloc = make()
    p = alloc.malloc(19 * MiB - 512)             # 20 MiB segment: remainder 1 MiB + 512
    assert block_at(alloc, p)["size"] == 19 * MiB - 512
    assert stat(alloc, "inactive_split_bytes.large_pool.current") == 1 * MiB + 512
    assert stat(alloc, "allocated_bytes.large_pool.current") == 19 * MiB - 512


def test_large_pool_does_not_split_off_one_mib_or_less():
    sim, alloc = make()
    p = alloc.malloc(19 * MiB)                   # 20 MiB segment: remainder exactly 1 MiB
    assert block_at(alloc, p)["size"] == 20 * MiB
    assert stat(alloc, "allocated_bytes.large_pool.current") == 20 * MiB
    assert stat(alloc, "requested_bytes.large_pool.current") == 19 * MiB
    assert stat(alloc, "inactive_split.large_pool.current") == 0


def test_split_remainder_stays_cached_for_the_next_request():
    sim, alloc = make()
    p = alloc.malloc(3 * MiB)
    q = alloc.malloc(5 * MiB)
    assert q == p + 3 * MiB
    assert stat(alloc, "num_device_alloc") == 1
    assert stat(alloc, "inactive_split_bytes.large_pool.current") == 12 * MiB


def test_oversize_block_is_never_split():
    sim, alloc = make("max_split_size_mb:20")
    p = alloc.malloc(40 * MiB)
    alloc.free(p)
    q = alloc.malloc(25 * MiB)                   # 40 < 25 + 20: takes the 40 MiB block whole
    assert q == p
    assert block_at(alloc, q)["size"] == 40 * MiB
    assert stat(alloc, "allocated_bytes.all.current") == 40 * MiB
    assert stat(alloc, "inactive_split.all.current") == 0


# =============================================================================== merging

def three_blocks(alloc):
    """Three 512 KiB blocks at the start of one 2 MiB segment, and its 512 KiB free tail."""
    a, b, c = (alloc.malloc(512 * KiB) for _ in range(3))
    assert (b - a, c - b) == (512 * KiB, 512 * KiB)
    return a, b, c


def test_free_merges_with_the_free_next_block():
    sim, alloc = make()
    a, b, c = three_blocks(alloc)
    alloc.free(c)                                # merges with the free tail
    assert [blk["size"] for blk in segment_of(alloc, a)["blocks"]] == [512 * KiB, 512 * KiB, 1 * MiB]
    assert stat(alloc, "inactive_split.all.current") == 1


def test_free_merges_with_the_free_previous_block():
    sim, alloc = make()
    a, b, c = three_blocks(alloc)
    alloc.free(a)
    alloc.free(b)                                # merges backwards into a's block
    blocks = segment_of(alloc, a)["blocks"]
    assert [(blk["address"], blk["size"], blk["allocated"]) for blk in blocks[:2]] == [
        (a, 1 * MiB, False), (c, 512 * KiB, True)]
    assert stat(alloc, "inactive_split.all.current") == 2   # [a+b] and the tail


def test_free_merges_with_both_neighbours_into_one_segment_block():
    sim, alloc = make()
    a, b, c = three_blocks(alloc)
    alloc.free(a)
    alloc.free(c)
    assert stat(alloc, "inactive_split.all.current") == 2
    alloc.free(b)
    seg = segment_of(alloc, a)
    assert [(blk["address"], blk["size"]) for blk in seg["blocks"]] == [(a, 2 * MiB)]
    assert stat(alloc, "inactive_split.all.current") == 0
    assert stat(alloc, "inactive_split_bytes.all.current") == 0
    alloc.empty_cache()                          # a whole free segment: released
    assert sim.segments() == []


@sim_only("needs two segments placed next to each other (SimDevice's first-fit placement)")
def test_blocks_of_adjacent_segments_never_merge():
    sim, alloc = make()
    ptrs = [alloc.malloc(1 * MiB) for _ in range(3)]    # fills one 2 MiB segment, starts a second
    assert ptrs[2] == ptrs[0] + 2 * MiB                 # the segments are adjacent in memory
    for p in ptrs:
        alloc.free(p)
    assert [seg["total_size"] for seg in alloc._segments()] == [2 * MiB, 2 * MiB]
    alloc.empty_cache()
    assert stat(alloc, "num_device_free") == 2


# =============================================================================== max_split_size

def test_small_request_does_not_take_an_oversize_block():
    sim, alloc = make("max_split_size_mb:20")
    p = alloc.malloc(30 * MiB)
    alloc.free(p)
    q = alloc.malloc(12 * MiB)                   # < max_split_size: may not carve the 30 MiB block
    assert q != p
    assert stat(alloc, "num_device_alloc") == 2


def test_large_request_takes_oversize_block_when_excess_is_below_rounding_limit():
    sim, alloc = make("max_split_size_mb:20")
    p = alloc.malloc(50 * MiB)
    alloc.free(p)
    assert alloc.malloc(31 * MiB) == p           # 50 < 31 + 20
    assert stat(alloc, "num_device_alloc") == 1


def test_large_request_skips_oversize_block_when_excess_reaches_rounding_limit():
    sim, alloc = make("max_split_size_mb:20")
    p = alloc.malloc(50 * MiB)
    alloc.free(p)
    q = alloc.malloc(30 * MiB)                   # 50 >= 30 + 20: a new segment instead
    assert q != p
    assert stat(alloc, "num_device_alloc") == 2


def test_max_non_split_rounding_widens_oversize_reuse():
    sim, alloc = make("max_split_size_mb:20,max_non_split_rounding_mb:40")
    p = alloc.malloc(50 * MiB)
    alloc.free(p)
    assert alloc.malloc(30 * MiB) == p           # 50 < 30 + 40


def test_oversize_counters_follow_blocks_and_segments_at_or_above_max_split_size():
    sim, alloc = make("max_split_size_mb:20")
    p = alloc.malloc(40 * MiB)
    alloc.malloc(12 * MiB)                       # 12 MiB segment: not oversize
    s = alloc.memory_stats()
    assert (s["oversize_allocations.current"], s["oversize_segments.current"]) == (1, 1)
    alloc.free(p)
    s = alloc.memory_stats()
    assert (s["oversize_allocations.current"], s["oversize_allocations.freed"]) == (0, 1)
    assert s["oversize_segments.current"] == 1
    alloc.empty_cache()
    s = alloc.memory_stats()
    assert (s["oversize_segments.current"], s["oversize_segments.peak"],
            s["oversize_segments.freed"]) == (0, 1, 1)


def test_max_split_size_stat_reports_the_setting_in_bytes():
    assert stat(make("max_split_size_mb:128")[1], "max_split_size") == 128 * MiB
    assert stat(make()[1], "max_split_size") == -1


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_failed_allocation_releases_a_cached_oversize_block_first():
    sim, alloc = make("max_split_size_mb:20", total_memory=48 * MiB)
    p = alloc.malloc(40 * MiB)
    alloc.free(p)                                # cached, oversize
    alloc.malloc(12 * MiB)                       # may not use it; 40 + 12 > 48
    s = alloc.memory_stats()
    assert sim.segments() == [(sim.segments()[0][0], 12 * MiB)]
    assert s["num_device_free"] == 1
    # Released by the oversize step, before (and instead of) the full flush and its retry.
    assert s["num_alloc_retries"] == 0
    assert s["num_sync_all_streams"] == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_failed_allocation_releases_oversize_blocks_largest_first_until_enough():
    sim, alloc = make("max_split_size_mb:20", total_memory=80 * MiB)
    blocks = {size: alloc.malloc(size) for size in (22 * MiB, 24 * MiB, 26 * MiB)}
    for p in blocks.values():
        alloc.free(p)
    # 30 MiB: no cached block fits (26 < 30) and 72 + 30 > 80. The oversize step frees 26 MiB,
    # then 24 MiB (50 >= 30) and stops; the 22 MiB block stays cached.
    alloc.malloc(30 * MiB)
    assert sorted(size for _, size in sim.segments()) == [22 * MiB, 30 * MiB]
    assert stat(alloc, "num_alloc_retries") == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_oversize_release_only_touches_the_requesting_stream():
    sim, alloc = make("max_split_size_mb:20", total_memory=48 * MiB)
    s1 = sim.create_stream()
    p = alloc.malloc(40 * MiB, s1)
    alloc.free(p)
    alloc.malloc(12 * MiB)                       # stream 0: only the full flush frees s1's block
    assert stat(alloc, "num_alloc_retries") == 1
    assert stat(alloc, "num_sync_all_streams") == 1


# =============================================================================== OOM ladder

@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_full_flush_and_retry_is_counted():
    sim, alloc = make(total_memory=24 * MiB)
    s1 = sim.create_stream()
    p = alloc.malloc(12 * MiB, s1)
    alloc.free(p)                                # cached on s1
    q = alloc.malloc(14 * MiB)                   # 12 + 14 > 24: flush the cache, retry
    s = alloc.memory_stats()
    assert (s["num_alloc_retries"], s["num_sync_all_streams"], s["num_device_free"]) == (1, 1, 1)
    assert s["num_ooms"] == 0
    assert sim.segments() == [(q, 14 * MiB)]


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_full_flush_keeps_split_segments_with_live_blocks():
    sim, alloc = make(total_memory=24 * MiB)
    live = alloc.malloc(512)                     # its 2 MiB segment is split: kept
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(30 * MiB)
    assert segment_of(alloc, live)["total_size"] == 2 * MiB
    assert stat(alloc, "num_device_free") == 0


def oom_setup():
    sim, alloc = make(total_memory=24 * MiB)
    live = alloc.malloc(1000)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(30 * MiB)
    return sim, alloc, live, info.value


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_out_of_memory_error_carries_the_figures():
    sim, alloc, live, err = oom_setup()
    assert isinstance(err, MemoryError)
    assert err.requested == 30 * MiB
    assert err.segment_size == 30 * MiB
    assert err.total == 24 * MiB
    assert err.free == 22 * MiB
    assert err.allocated == 1024
    assert err.reserved_unallocated == 2 * MiB - 1024
    assert err.allowed is None
    assert err.device == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_out_of_memory_message_names_the_sizes():
    sim, alloc, live, err = oom_setup()
    msg = str(err)
    assert "Tried to allocate 30.00 MiB" in msg
    assert "total capacity of 24.00 MiB" in msg
    assert "22.00 MiB is free" in msg


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_out_of_memory_reports_the_segment_size_it_tried():
    sim, alloc = make(total_memory=16 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(3 * MiB)
    assert (info.value.requested, info.value.segment_size) == (3 * MiB, 20 * MiB)
    assert "Tried to allocate 20.00 MiB" in str(info.value)


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_out_of_memory_is_counted_and_changes_no_allocation():
    sim, alloc, live, err = oom_setup()
    s = alloc.memory_stats()
    assert s["num_ooms"] == 1
    assert s["allocation.all.current"] == 1
    assert s["reserved_bytes.all.current"] == 2 * MiB
    alloc._check_invariants()


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_allocator_stays_usable_after_out_of_memory():
    sim, alloc, live, err = oom_setup()
    alloc.free(live)
    p = alloc.malloc(5 * MiB)                    # 2 + 20 <= 24
    assert p != 0
    assert stat(alloc, "allocated_bytes.all.current") == 5 * MiB
    alloc.free(p)
    alloc._check_invariants()


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_oom_observers_are_called_with_device_size_total_and_free():
    sim, alloc = make(total_memory=24 * MiB)
    calls = []
    alloc.oom_observers.append(lambda *args: calls.append(args))
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(30 * MiB)
    assert calls == [(0, 30 * MiB, 24 * MiB, 24 * MiB)]


# =============================================================================== memory fraction

@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_memory_fraction_caps_reserved_memory():
    sim, alloc = make(total_memory=100 * MiB)
    alloc.set_memory_fraction(0.5)               # 50 MiB
    alloc.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(12 * MiB)                   # 40 + 12 > 50, although the device has 60 free
    assert info.value.allowed == 50 * MiB
    assert "50.00 MiB allowed" in str(info.value)
    assert sim.counters["segment_alloc"] == 1    # the cap fails before asking the device
    assert alloc.get_memory_fraction() == 0.5


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_memory_fraction_counts_cached_segments_and_flushes_them():
    sim, alloc = make(total_memory=100 * MiB)
    alloc.set_memory_fraction(0.5)
    s1 = sim.create_stream()
    alloc.free(alloc.malloc(40 * MiB, s1))       # cached, but still reserved
    alloc.malloc(12 * MiB)
    assert stat(alloc, "num_alloc_retries") == 1
    assert stat(alloc, "reserved_bytes.all.current") == 12 * MiB


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_memory_fraction_of_one_removes_the_cap():
    sim, alloc = make(total_memory=100 * MiB)
    alloc.set_memory_fraction(0.5)
    alloc.set_memory_fraction(1.0)
    alloc.malloc(80 * MiB)
    assert stat(alloc, "reserved_bytes.all.current") == 80 * MiB


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_memory_fraction_from_config():
    sim, alloc = make("per_process_memory_fraction:0.25", total_memory=100 * MiB)
    assert alloc.get_memory_fraction() == 0.25
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(26 * MiB)
    assert info.value.allowed == 25 * MiB


@pytest.mark.parametrize("bad", ["0.5", None, True, [0.5], 1 + 0j])
def test_memory_fraction_of_wrong_type_is_a_type_error(bad):
    sim, alloc = make()
    alloc.set_memory_fraction(0.5)
    with pytest.raises(TypeError) as info:
        alloc.set_memory_fraction(bad)
    assert repr(bad) in str(info.value)
    assert alloc.get_memory_fraction() == 0.5


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
@pytest.mark.parametrize("bad", [1.5, -0.1, 2, math.nan, math.inf])
def test_memory_fraction_out_of_range_is_a_value_error(bad):
    sim, alloc = make(total_memory=100 * MiB)
    alloc.set_memory_fraction(0.5)
    with pytest.raises(ValueError) as info:
        alloc.set_memory_fraction(bad)
    assert str(bad) in str(info.value)
    assert alloc.get_memory_fraction() == 0.5
    with pytest.raises(OutOfMemoryError):        # the cap in force is unchanged
        alloc.malloc(60 * MiB)


# =============================================================================== garbage collection

def gc_scenario(alloc, sim):
    """Three cached unsplit large segments of different ages, then a cache miss.

    The large pool's GC clock ticks once per best-fit search. S (12 MiB, stream s1) and A, B
    (30 MiB, stream 0) are made at ticks 1-3; S and A are freed at tick 3; S is reused and freed
    again at ticks 4 and 5; B is freed at tick 5. The miss at tick 6 sees ages S 1, A 3, B 1
    (average 5/3), with 72 MiB reserved.
    """
    s1, s2 = sim.create_stream(), sim.create_stream()
    S = alloc.malloc(12 * MiB, s1)
    A = alloc.malloc(30 * MiB)
    B = alloc.malloc(30 * MiB)
    alloc.free(S)
    alloc.free(A)
    for _ in range(2):
        assert alloc.malloc(12 * MiB, s1) == S
        alloc.free(S)
    alloc.free(B)
    alloc.malloc(14 * MiB, s2)
    return S, A, B


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_garbage_collection_releases_blocks_older_than_average_until_target():
    sim, alloc = make("garbage_collection_threshold:0.5", total_memory=200 * MiB)
    alloc.set_memory_fraction(0.5)               # allowed 100 MiB, GC above 50 MiB
    S, A, B = gc_scenario(alloc, sim)
    # 72 MiB > 50 MiB: reclaim >= 22 MiB. Only A (age 3) is at least the average; its 30 MiB
    # suffice, so S and B stay cached.
    segments = sim.segments()
    assert (A, 30 * MiB) not in segments        # (the new 14 MiB segment reuses A's range)
    assert (S, 12 * MiB) in segments and (B, 30 * MiB) in segments
    assert stat(alloc, "num_device_free") == 1
    assert stat(alloc, "num_alloc_retries") == 0 and stat(alloc, "num_sync_all_streams") == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_garbage_collection_releases_every_block_at_least_as_old_as_average():
    sim, alloc = make("garbage_collection_threshold:0.5", total_memory=200 * MiB)
    alloc.set_memory_fraction(0.5)               # GC above 50 MiB
    a, b = alloc.malloc(30 * MiB), alloc.malloc(30 * MiB)   # ticks 1, 2
    alloc.free(a)
    alloc.free(b)                                # both inserted at tick 2
    alloc.malloc(14 * MiB, sim.create_stream())  # tick 3: 60 MiB > 50 MiB, target 10 MiB
    # Both have age 1 = the average: both go, although one would reach the target (a pass
    # does not stop at the target).
    assert stat(alloc, "num_device_free") == 2
    assert [size for _, size in sim.segments()] == [14 * MiB]


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_garbage_collection_does_nothing_without_a_memory_fraction():
    sim, alloc = make("garbage_collection_threshold:0.5", total_memory=200 * MiB)
    gc_scenario(alloc, sim)
    assert stat(alloc, "num_device_free") == 0
    assert len(sim.segments()) == 4


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_garbage_collection_does_nothing_without_a_threshold():
    sim, alloc = make(total_memory=200 * MiB)
    alloc.set_memory_fraction(0.5)
    gc_scenario(alloc, sim)
    assert stat(alloc, "num_device_free") == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_garbage_collection_keeps_reserved_memory_below_the_threshold():
    sim, alloc = make("garbage_collection_threshold:0.9", total_memory=200 * MiB)
    alloc.set_memory_fraction(0.5)               # GC only above 90 MiB; the scenario peaks at 72
    gc_scenario(alloc, sim)
    assert stat(alloc, "num_device_free") == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_garbage_collection_skips_split_segments():
    sim, alloc = make("garbage_collection_threshold:0.1", total_memory=200 * MiB)
    alloc.set_memory_fraction(0.5)               # GC above 5 MiB
    s1 = sim.create_stream()
    keep = alloc.malloc(3 * MiB)                 # 20 MiB segment, split
    tail_owner = alloc.malloc(5 * MiB)
    alloc.free(tail_owner)                       # the segment stays split around `keep`
    alloc.malloc(12 * MiB, s1)                   # a miss: GC runs, nothing unsplit to free
    assert stat(alloc, "num_device_free") == 0
    assert segment_of(alloc, keep)["total_size"] == 20 * MiB


# =============================================================================== streams and events

def test_record_stream_delays_reuse_until_work_queued_before_free_completes():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(512)
    alloc.record_stream(p, s1)
    sim.launch(s1)                               # work on s1 that uses p
    alloc.free(p)
    q = alloc.malloc(512)
    assert q != p                                # p is still in use on s1
    sim.complete(s1)
    assert alloc.malloc(512) == p


def streams_with_pending_events(sim, alloc, count, done):
    """`count` streams, each with a 512-byte block waiting for its event (complete when `done`)."""
    streams = [sim.create_stream() for _ in range(count)]
    for s in streams:
        p = alloc.malloc(512)
        alloc.record_stream(p, s)
        sim.launch(s)
        alloc.free(p)
        if done:
            sim.complete(s)
    return streams


@sim_only("counts the simulated device's event queries")
def test_event_poll_streams_polls_that_many_streams_on_a_cache_hit():
    sim, alloc = make("event_poll_streams:2")
    streams_with_pending_events(sim, alloc, 5, done=False)
    before = sim.counters["event_query"]
    alloc.free(alloc.malloc(512))
    assert sim.counters["event_query"] - before == 2


@sim_only("completes simulated work")
def test_event_poll_streams_reaches_every_stream_in_turn():
    sim, alloc = make("event_poll_streams:2")
    streams_with_pending_events(sim, alloc, 5, done=True)
    for _ in range(3):                            # 3 x 2 >= 5 streams
        alloc.free(alloc.malloc(512))
    assert alloc._outstanding_events() == 0


@sim_only("completes simulated work")
def test_event_poll_streams_polls_every_stream_before_a_cache_miss():
    sim, alloc = make("event_poll_streams:1")
    streams_with_pending_events(sim, alloc, 3, done=False)
    s = sim.create_stream()
    big = alloc.malloc(30 * MiB)
    alloc.record_stream(big, s)
    sim.launch(s)
    alloc.free(big)
    sim.complete(s)
    segments = stat(alloc, "num_device_alloc")
    assert alloc.malloc(30 * MiB) == big          # not a new segment, whichever stream was next
    assert stat(alloc, "num_device_alloc") == segments


def test_record_stream_ignores_work_queued_after_the_free():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(512)
    alloc.record_stream(p, s1)
    sim.launch(s1)
    alloc.free(p)
    sim.launch(s1, 5)                            # later work on s1 does not use p
    sim.complete(s1, 1)
    assert alloc.malloc(512) == p


def test_record_stream_waits_for_every_recorded_stream():
    sim, alloc = make()
    s1, s2 = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(512)
    alloc.record_stream(p, s1)
    alloc.record_stream(p, s2)
    sim.launch(s1)
    sim.launch(s2)
    alloc.free(p)
    sim.complete(s1)
    assert alloc.malloc(512) != p
    sim.complete(s2)
    assert alloc.malloc(512) == p


def test_record_stream_block_counts_as_active_until_events_complete():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(1000)
    alloc.record_stream(p, s1)
    sim.launch(s1)
    alloc.free(p)
    s = alloc.memory_stats()
    # allocation/allocated_bytes drop when the free is requested; active/requested when it completes.
    assert (s["allocation.all.current"], s["allocated_bytes.all.current"]) == (0, 0)
    assert (s["active.all.current"], s["active_bytes.all.current"]) == (1, 1024)
    assert s["requested_bytes.all.current"] == 1000
    alloc._check_invariants()
    sim.complete(s1)
    alloc.process_events()
    s = alloc.memory_stats()
    assert (s["active.all.current"], s["requested_bytes.all.current"]) == (0, 0)
    alloc._check_invariants()


@sim_only("counts backend calls (SimDevice.counters)")
def test_record_stream_on_the_allocation_stream_is_a_no_op():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(512, s1)
    alloc.record_stream(p, s1)
    alloc.record_stream(p, CudaStreamProtocol(s1))
    sim.launch(s1)
    alloc.free(p)
    assert sim.counters["event_record"] == 0
    assert stat(alloc, "active.all.current") == 0
    assert alloc.malloc(512, s1) == p            # same-stream reuse needs no event


@sim_only("counts backend calls (SimDevice.counters)")
def test_record_stream_of_null_pointer_is_a_no_op():
    sim, alloc = make()
    alloc.record_stream(0, sim.create_stream())
    assert sim.counters["event_create"] == 0


@sim_only("counts backend calls (SimDevice.counters)")
def test_record_stream_events_are_reused():
    sim, alloc = make()
    s1 = sim.create_stream()
    for _ in range(3):
        p = alloc.malloc(512)
        alloc.record_stream(p, s1)
        sim.launch(s1)
        alloc.free(p)
        sim.complete(s1)
        alloc.process_events()
    assert sim.counters["event_create"] == 1
    assert sim.counters["event_record"] == 3


@sim_only("counts backend calls (SimDevice.counters)")
def test_record_stream_same_stream_twice_records_one_event():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(512)
    alloc.record_stream(p, s1)
    alloc.record_stream(p, s1)
    alloc.free(p)
    assert sim.counters["event_record"] == 1


def test_pending_events_are_polled_per_stream_in_order():
    sim, alloc = make()
    s1, s2 = sim.create_stream(), sim.create_stream()
    p, q = alloc.malloc(4096), alloc.malloc(4096)
    alloc.record_stream(p, s1)
    alloc.record_stream(q, s2)
    sim.launch(s1)
    sim.launch(s2)
    alloc.free(p)
    alloc.free(q)
    sim.complete(s2)                             # a slow s1 does not hold back s2's block
    alloc.process_events()
    assert block_at(alloc, q)["pending_free"] is False
    assert block_at(alloc, p)["pending_free"] is True


def test_double_free_while_events_are_pending_is_rejected():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(512)
    alloc.record_stream(p, s1)
    sim.launch(s1)
    alloc.free(p)
    before = alloc.memory_stats()
    with pytest.raises(ValueError, match=f"{p:#x}"):
        alloc.free(p)
    assert alloc.memory_stats() == before


# =============================================================================== empty_cache

def test_empty_cache_releases_whole_free_segments_only():
    sim, alloc = make()
    live = alloc.malloc(512)                     # split small segment with a live block
    big = alloc.malloc(12 * MiB)
    alloc.free(big)
    alloc.empty_cache()
    assert sim.segments() == [(segment_of(alloc, live)["address"], 2 * MiB)]
    s = alloc.memory_stats()
    assert (s["num_device_free"], s["reserved_bytes.all.current"]) == (1, 2 * MiB)


def test_empty_cache_keeps_the_free_parts_of_split_segments_cached():
    sim, alloc = make()
    p = alloc.malloc(3 * MiB)
    alloc.empty_cache()
    s = alloc.memory_stats()
    assert s["inactive_split_bytes.large_pool.current"] == 17 * MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert alloc.malloc(5 * MiB) == p + 3 * MiB


def test_empty_cache_waits_for_pending_events_and_releases_their_blocks():
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(3 * MiB)
    alloc.record_stream(p, s1)
    sim.launch(s1)
    alloc.free(p)
    alloc.empty_cache()
    assert sim.pending(s1) == 0                  # the event was synchronized
    assert sim.segments() == []
    assert stat(alloc, "num_sync_all_streams") == 1


def test_empty_cache_on_an_empty_allocator_changes_only_the_sync_count():
    sim, alloc = make()
    alloc.empty_cache()
    assert alloc.memory_stats() == expected_stats(num_sync_all_streams=1)


# =============================================================================== statistics

def test_memory_stats_has_every_pytorch_key():
    sim, alloc = make()
    assert list(alloc.memory_stats()) == ALL_KEYS
    assert len(ALL_KEYS) == 9 * 3 * 4 + 2 * 4 + 6


def test_memory_stats_of_a_new_allocator_are_zero():
    sim, alloc = make()
    assert alloc.memory_stats() == expected_stats()


def test_memory_stats_after_a_small_allocation():
    sim, alloc = make()
    alloc.malloc(1000)
    assert alloc.memory_stats() == expected_stats(
        **pool_stats("allocation", "small_pool", 1, 1, 1, 0),
        **pool_stats("allocated_bytes", "small_pool", 1024, 1024, 1024, 0),
        **pool_stats("active", "small_pool", 1, 1, 1, 0),
        **pool_stats("active_bytes", "small_pool", 1024, 1024, 1024, 0),
        **pool_stats("requested_bytes", "small_pool", 1000, 1000, 1000, 0),
        **pool_stats("segment", "small_pool", 1, 1, 1, 0),
        **pool_stats("reserved_bytes", "small_pool", 2 * MiB, 2 * MiB, 2 * MiB, 0),
        **pool_stats("inactive_split", "small_pool", 1, 1, 1, 0),
        **pool_stats("inactive_split_bytes", "small_pool", 2 * MiB - 1024, 2 * MiB - 1024,
                     2 * MiB - 1024, 0),
        num_device_alloc=1)


def test_memory_stats_after_a_small_allocation_is_freed():
    sim, alloc = make()
    alloc.free(alloc.malloc(1000))
    # The block merges back with the tail: one unsplit free block, still reserved.
    assert alloc.memory_stats() == expected_stats(
        **pool_stats("allocation", "small_pool", 0, 1, 1, 1),
        **pool_stats("allocated_bytes", "small_pool", 0, 1024, 1024, 1024),
        **pool_stats("active", "small_pool", 0, 1, 1, 1),
        **pool_stats("active_bytes", "small_pool", 0, 1024, 1024, 1024),
        **pool_stats("requested_bytes", "small_pool", 0, 1000, 1000, 1000),
        **pool_stats("segment", "small_pool", 1, 1, 1, 0),
        **pool_stats("reserved_bytes", "small_pool", 2 * MiB, 2 * MiB, 2 * MiB, 0),
        **pool_stats("inactive_split", "small_pool", 0, 1, 1, 1),
        **pool_stats("inactive_split_bytes", "small_pool", 0, 2 * MiB - 1024, 2 * MiB - 1024,
                     2 * MiB - 1024),
        num_device_alloc=1)


def test_memory_stats_after_empty_cache_releases_a_large_segment():
    sim, alloc = make()
    alloc.free(alloc.malloc(3 * MiB))
    alloc.empty_cache()
    assert alloc.memory_stats() == expected_stats(
        **pool_stats("allocation", "large_pool", 0, 1, 1, 1),
        **pool_stats("allocated_bytes", "large_pool", 0, 3 * MiB, 3 * MiB, 3 * MiB),
        **pool_stats("active", "large_pool", 0, 1, 1, 1),
        **pool_stats("active_bytes", "large_pool", 0, 3 * MiB, 3 * MiB, 3 * MiB),
        **pool_stats("requested_bytes", "large_pool", 0, 3 * MiB, 3 * MiB, 3 * MiB),
        **pool_stats("segment", "large_pool", 0, 1, 1, 1),
        **pool_stats("reserved_bytes", "large_pool", 0, 20 * MiB, 20 * MiB, 20 * MiB),
        **pool_stats("inactive_split", "large_pool", 0, 1, 1, 1),
        **pool_stats("inactive_split_bytes", "large_pool", 0, 17 * MiB, 17 * MiB, 17 * MiB),
        num_device_alloc=1, num_device_free=1, num_sync_all_streams=1)


def test_memory_stats_pools_add_up_to_all():
    sim, alloc = make()
    alloc.malloc(1000)
    alloc.malloc(3 * MiB)
    alloc.free(alloc.malloc(12 * MiB))
    s = alloc.memory_stats()
    for name in STAT_NAMES:
        for field in FIELDS[:1] + FIELDS[2:]:          # peaks need not add up
            assert s[f"{name}.all.{field}"] == (s[f"{name}.small_pool.{field}"]
                                                + s[f"{name}.large_pool.{field}"]), (name, field)


def test_memory_readers_match_the_stats():
    sim, alloc = make()
    p = alloc.malloc(3 * MiB)
    alloc.malloc(1000)
    alloc.free(p)
    s = alloc.memory_stats()
    assert alloc.memory_allocated() == s["allocated_bytes.all.current"] == 1024
    assert alloc.memory_reserved() == s["reserved_bytes.all.current"] == 22 * MiB
    assert alloc.max_memory_allocated() == s["allocated_bytes.all.peak"] == 3 * MiB + 1024
    assert alloc.max_memory_reserved() == s["reserved_bytes.all.peak"] == 22 * MiB


def test_reset_peak_memory_stats_sets_peaks_to_current():
    sim, alloc = make("max_split_size_mb:20")
    alloc.malloc(1000)
    alloc.free(alloc.malloc(40 * MiB))
    before = alloc.memory_stats()
    alloc.reset_peak_memory_stats()
    after = alloc.memory_stats()
    for key in ALL_KEYS:
        if key.endswith(".peak"):
            assert after[key] == before[key[:-len("peak")] + "current"], key
        else:
            assert after[key] == before[key], key
    assert alloc.max_memory_allocated() == 1024


@sim_only("needs a device of a chosen size (SimDevice's total_memory) for its out-of-memory figures")
def test_reset_accumulated_memory_stats_zeroes_totals_and_counters():
    sim, alloc = make(total_memory=24 * MiB)
    alloc.malloc(1000)
    alloc.free(alloc.malloc(3 * MiB))
    alloc.empty_cache()                          # a device free and a sync
    with pytest.raises(OutOfMemoryError):        # an OOM, a retry and another sync
        alloc.malloc(30 * MiB)
    before = alloc.memory_stats()
    assert all(before[key] > 0 for key in SCALARS[:-1])
    alloc.reset_accumulated_memory_stats()
    after = alloc.memory_stats()
    for key in ALL_KEYS:
        if key.endswith((".allocated", ".freed")) or key in SCALARS[:-1]:
            assert after[key] == 0, key
        else:
            assert after[key] == before[key], key


def test_accumulated_counts_restart_from_zero_after_reset_with_live_blocks():
    # Cumulative decreases are derived from the values at the reset: blocks live across the reset
    # count as freed afterwards, and "all" is the sum of the two pools.
    sim, alloc = make()
    small, large = alloc.malloc(1000), alloc.malloc(3 * MiB)
    alloc.reset_accumulated_memory_stats()
    alloc.free(small)
    alloc.free(large)
    alloc.malloc(2000)
    s = alloc.memory_stats()
    assert s["allocated_bytes.small_pool.freed"] == 1024
    assert s["allocated_bytes.large_pool.freed"] == 3 * MiB
    assert s["allocated_bytes.all.freed"] == 1024 + 3 * MiB
    assert s["allocated_bytes.small_pool.allocated"] == s["allocated_bytes.all.allocated"] == 2048
    assert (s["allocation.all.allocated"], s["allocation.all.freed"]) == (1, 2)
    assert s["allocated_bytes.all.current"] == 2048


def test_memory_summary_has_every_row():
    sim, alloc = make()
    alloc.malloc(1000)
    summary = alloc.memory_summary()
    for row in ("Allocated memory", "Active memory", "Requested memory", "GPU reserved memory",
                "Non-releasable memory", "Allocations", "Active allocs",
                "GPU reserved segments", "Non-releasable allocs", "Oversize allocations",
                "Oversize GPU segments"):
        assert row in summary, row
    assert summary.count("from large pool") == 9 and summary.count("from small pool") == 9


def test_memory_summary_shows_the_values():
    sim, alloc = make()
    alloc.malloc(1000)
    lines = alloc.memory_summary().splitlines()
    allocated = next(line for line in lines if "Allocated memory" in line)
    assert allocated.count("1.00 KiB") == 3 and "0 bytes" in allocated   # cur, peak, alloc; freed
    reserved = next(line for line in lines if "GPU reserved memory" in line)
    assert "2.00 MiB" in reserved
    requested = next(line for line in lines if "Requested memory" in line)
    assert "1000 bytes" in requested


def test_memory_summary_lines_all_have_one_width():
    sim, alloc = make()
    s1 = sim.create_stream()
    kept = [alloc.malloc(n, stream=st) for n in (1000, 3 * MiB, 700 * MiB) for st in (0, s1)]
    alloc.free(kept.pop())
    for summary in (CachingAllocator(backend=SimDevice(), config="").memory_summary(), alloc.memory_summary()):
        widths = {len(line) for line in summary.splitlines()}
        assert widths == {80}, widths


@sim_only("formats made-up statistics: no device involved")
def test_memory_summary_widens_its_columns_for_long_values_and_stays_one_width():
    # Totals of a long run outgrow 10 characters ("1023.99 MiB", "123456.00 GiB", 10**12 counts).
    from pyalloc.allocator import format_memory_summary
    stats = {k: 0 for k in CachingAllocator(backend=SimDevice()).memory_stats()}
    stats["allocated_bytes.all.allocated"] = 123456 * GiB
    stats["reserved_bytes.large_pool.peak"] = 1023 * MiB + 1000 * KiB
    stats["allocation.all.allocated"] = 10**12
    summary = format_memory_summary(stats, device=7)
    lines = summary.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert "123456.00 GiB" in summary and "1023.98 MiB" in summary and str(10**12) in summary
    assert "device ID 7" in lines[1]


# =============================================================================== Buffer

def test_allocate_returns_a_buffer_with_pointer_size_stream_device():
    sim, alloc = make()
    s1 = sim.create_stream()
    buf = alloc.allocate(1000, s1)
    assert isinstance(buf, Buffer)
    assert buf.ptr != 0 and buf.size == 1000 and buf.stream == s1 and buf.device == 0
    assert int(buf) == buf.ptr
    assert segment_of(alloc, buf.ptr)["stream"] == s1
    assert alloc.memory_allocated() == 1024


def test_buffer_close_frees_and_is_idempotent():
    sim, alloc = make()
    buf = alloc.allocate(1000)
    buf.close()
    assert buf.closed and buf.ptr == 0
    assert alloc.memory_allocated() == 0
    buf.close()
    assert stat(alloc, "allocation.all.freed") == 1


def test_buffer_with_block_frees_on_exit():
    sim, alloc = make()
    with alloc.allocate(4096) as buf:
        assert alloc.memory_allocated() == 4096
        ptr = buf.ptr
    assert alloc.memory_allocated() == 0
    assert alloc.malloc(4096) == ptr


def test_buffer_with_block_frees_on_exception():
    sim, alloc = make()
    with pytest.raises(RuntimeError):
        with alloc.allocate(4096):
            raise RuntimeError("boom")
    assert alloc.memory_allocated() == 0


def test_buffer_is_freed_when_dropped():
    sim, alloc = make()
    buf = alloc.allocate(4096)
    del buf
    assert alloc.memory_allocated() == 0


def test_buffer_in_a_reference_cycle_is_freed_by_garbage_collection():
    sim, alloc = make()
    holder = [alloc.allocate(4096)]
    holder.append(holder)
    del holder
    gc.collect()
    assert alloc.memory_allocated() == 0
    alloc._check_invariants()


def test_buffer_accepts_a_stream_object():
    sim, alloc = make()
    s1 = sim.create_stream()
    buf = alloc.allocate(1000, TorchLikeStream(s1))
    assert buf.stream == s1


def test_buffer_bad_size_allocates_nothing():
    sim, alloc = make()
    before = alloc.memory_stats()
    with pytest.raises(TypeError, match="1.5"):
        alloc.allocate(1.5)
    with pytest.raises(ValueError, match="-3"):
        alloc.allocate(-3)
    assert alloc.memory_stats() == before


# =============================================================================== hot path

@sim_only("counts backend calls (SimDevice.counters)")
@pytest.mark.parametrize("size", [4 * KiB, 1 * MiB, 3 * MiB, 12 * MiB])
def test_cache_hit_makes_no_backend_call(size):
    sim, alloc = make()
    alloc.free(alloc.malloc(size))
    counters = dict(sim.counters)
    for _ in range(3):
        alloc.free(alloc.malloc(size))
    assert sim.counters == counters


# =============================================================================== bad input

def assert_rejected(alloc, sim, call, exc, text):
    """`call()` raises `exc` whose message contains `text`; stats and segments are unchanged."""
    stats, segments = alloc.memory_stats(), sim.segments()
    with pytest.raises(exc) as info:
        call()
    assert text in str(info.value), (text, str(info.value))
    assert alloc.memory_stats() == stats
    assert sim.segments() == segments
    alloc._check_invariants()
    return info.value


@pytest.fixture
def busy():
    """An allocator with a live block, a cached block and a pending (recorded-stream) free."""
    sim, alloc = make()
    s1 = sim.create_stream()
    live = alloc.malloc(1000)
    alloc.free(alloc.malloc(3 * MiB))
    pending = alloc.malloc(4096)
    alloc.record_stream(pending, s1)
    sim.launch(s1)
    alloc.free(pending)
    return sim, alloc, live


@pytest.mark.parametrize("size,exc,text", [
    (-1, ValueError, "-1"),
    (-(2 ** 70), ValueError, str(-(2 ** 70))),
    (1.5, TypeError, "1.5"),
    (4096.0, TypeError, "4096.0"),
    (True, TypeError, "True"),
    (False, TypeError, "False"),
    ("100", TypeError, "'100'"),
    (None, TypeError, "None"),
    (2 ** 60, OutOfMemoryError, "1EB"),
    (2 ** 64, OutOfMemoryError, "1EB"),
    (2 ** 100, OutOfMemoryError, "1EB"),
])
def test_bad_size_is_rejected_with_state_unchanged(busy, size, exc, text):
    sim, alloc, live = busy
    err = assert_rejected(alloc, sim, lambda: alloc.malloc(size), exc, text)
    if exc is OutOfMemoryError:
        assert str(size) in str(err)
        assert err.requested == size


def test_size_just_below_one_exabyte_is_an_ordinary_out_of_memory(busy):
    sim, alloc, live = busy
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(2 ** 60 - 1)
    assert "1EB" not in str(info.value)
    assert stat(alloc, "num_ooms") == 1


def test_index_types_are_accepted_as_sizes():
    np = pytest.importorskip("numpy")
    sim, alloc = make()
    p = alloc.malloc(np.int64(1000))
    assert stat(alloc, "requested_bytes.all.current") == 1000
    alloc.free(np.uint64(p))
    assert alloc.memory_allocated() == 0


def test_unknown_pointer_free_is_rejected(busy):
    sim, alloc, live = busy
    assert_rejected(alloc, sim, lambda: alloc.free(0x1234), ValueError, "0x1234")


def test_interior_pointer_free_is_rejected(busy):
    sim, alloc, live = busy
    assert_rejected(alloc, sim, lambda: alloc.free(live + 512), ValueError, f"{live + 512:#x}")


def test_double_free_is_rejected(busy):
    sim, alloc, live = busy
    alloc.free(live)
    assert_rejected(alloc, sim, lambda: alloc.free(live), ValueError, f"{live:#x}")


@pytest.mark.parametrize("ptr,exc,text", [(-1, ValueError, "-1"), (2 ** 64, ValueError, str(2 ** 64)),
                                          ("0x10", TypeError, "'0x10'"), (1.0, TypeError, "1.0"),
                                          (True, TypeError, "True")])
def test_non_pointer_free_is_rejected(busy, ptr, exc, text):
    sim, alloc, live = busy
    assert_rejected(alloc, sim, lambda: alloc.free(ptr), exc, text)


class NotAStream:
    def __repr__(self):
        return "NotAStream()"


class BadProtocolStream:
    def __cuda_stream__(self):
        return "nope"

    def __repr__(self):
        return "BadProtocolStream()"


@pytest.mark.parametrize("stream,exc,text", [
    ("s1", TypeError, "'s1'"),
    (1.0, TypeError, "1.0"),
    (True, TypeError, "True"),
    (NotAStream(), TypeError, "NotAStream()"),
    (BadProtocolStream(), TypeError, "BadProtocolStream()"),
    (TorchLikeStream(-5), ValueError, "TorchLikeStream"),    # an int out of range, as -1 is
    (-1, ValueError, "-1"),
    (-(2 ** 70), ValueError, str(-(2 ** 70))),
    (2 ** 64, ValueError, str(2 ** 64)),
])
def test_bad_stream_is_rejected_by_malloc_with_state_unchanged(busy, stream, exc, text):
    sim, alloc, live = busy
    assert_rejected(alloc, sim, lambda: alloc.malloc(1000, stream), exc, text)


@sim_only("counts backend calls (SimDevice.counters)")
@pytest.mark.parametrize("stream,exc,text", [("s1", TypeError, "'s1'"), (-1, ValueError, "-1"),
                                             (NotAStream(), TypeError, "NotAStream()")])
def test_bad_stream_is_rejected_by_record_stream_with_state_unchanged(busy, stream, exc, text):
    sim, alloc, live = busy
    assert_rejected(alloc, sim, lambda: alloc.record_stream(live, stream), exc, text)
    alloc.free(live)
    assert sim.counters["event_record"] == 1       # only the fixture's own pending free


def test_record_stream_of_unknown_pointer_is_rejected(busy):
    sim, alloc, live = busy
    assert_rejected(alloc, sim, lambda: alloc.record_stream(0x1234, 1), ValueError, "0x1234")


@pytest.mark.parametrize("make_stream", [CudaStreamProtocol, TorchLikeStream, CupyLikeStream],
                         ids=["__cuda_stream__", "cuda_stream", "ptr"])
def test_stream_objects_are_accepted(make_stream):
    sim, alloc = make()
    s1 = sim.create_stream()
    p = alloc.malloc(4096, make_stream(s1))
    assert segment_of(alloc, p)["stream"] == s1
    alloc.record_stream(p, make_stream(sim.create_stream()))
    alloc.free(p)
    q = alloc.malloc(4096, s1)                     # the same stream as the int handle
    assert segment_of(alloc, q)["address"] == segment_of(alloc, p)["address"]


def test_none_stream_is_the_default_stream():
    sim, alloc = make()
    p = alloc.malloc(4096, None)
    assert segment_of(alloc, p)["stream"] == 0


def test_threads_sharing_one_allocator_leave_it_consistent():
    import random
    import threading
    _, a = make()
    errors = []

    def work(seed):
        try:
            rng = random.Random(seed)
            live = []
            for _ in range(3000):
                if live and rng.random() < 0.5:
                    a.free(live.pop(rng.randrange(len(live))))
                else:
                    live.append(a.malloc(rng.choice([512, 4096, 1 << 20, 3 << 20, 30 << 20])))
            for p in live:
                a.free(p)
        except Exception as exc:   # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    a._check_invariants()
    assert a.memory_allocated() == 0


@sim_only("counts references to addresses over 1,000 reuses: no device behaviour")
def test_reused_block_addresses_neither_leak_nor_lose_their_python_ints():
    import sys
    a = CachingAllocator(backend=SimDevice(), config="")
    p = a.malloc(4096)
    a.free(p)
    q = a.malloc(4096)
    assert q == p
    refs = sys.getrefcount(q)
    a.free(q)
    for _ in range(1000):
        a.free(a.malloc(4096))
    assert sys.getrefcount(q) == refs          # no reference gained per reuse
    del a
    gc.collect()
    assert sys.getrefcount(q) == refs - 1      # the allocator let go of the int it kept


# ------------------------------------------------------------------ release_lock_on_cudamalloc

def lock_state_during_segment_allocation(config):
    sim, alloc = make(config)
    seen = []
    sim.segment_alloc_hook = lambda nbytes: seen.append(alloc._lock_held())
    alloc.malloc(3 * MiB)
    return seen


@sim_only("looks inside a segment allocation (SimDevice.segment_alloc_hook)")
def test_the_lock_is_held_while_a_segment_is_allocated_by_default():
    assert lock_state_during_segment_allocation("") == [True]


@sim_only("looks inside a segment allocation (SimDevice.segment_alloc_hook)")
def test_release_lock_on_cudamalloc_frees_the_lock_while_a_segment_is_allocated():
    assert lock_state_during_segment_allocation("release_lock_on_cudamalloc:True") == [False]


@sim_only("runs a thread inside a segment allocation (SimDevice.segment_alloc_hook)")
def test_release_lock_on_cudamalloc_lets_another_thread_use_the_cache_meanwhile():
    import threading
    sim, alloc = make("release_lock_on_cudamalloc:True")
    alloc.free(alloc.malloc(4096))                  # a cached small segment for the other thread
    done = []

    def other_thread():
        done.append(alloc.malloc(4096))             # a cache hit: no segment allocation
        alloc.free(done[-1])

    def while_allocating(nbytes):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join(timeout=30)                          # would never finish if the lock were held
        done.append(not t.is_alive())
    sim.segment_alloc_hook = while_allocating
    big = alloc.malloc(30 * MiB)
    sim.segment_alloc_hook = None
    assert done[-1] is True and len(done) == 2
    alloc._check_invariants()
    assert alloc.memory_allocated() == 30 * MiB and stat(alloc, "num_device_alloc") == 2
    alloc.free(big)


@sim_only("looks inside a segment allocation (SimDevice.segment_alloc_hook)")
def test_release_lock_on_cudamalloc_follows_runtime_settings():
    import pyalloc
    sim = SimDevice()
    alloc = CachingAllocator(backend=sim)             # follows the process-wide settings
    seen = []
    sim.segment_alloc_hook = lambda nbytes: seen.append(alloc._lock_held())
    before = pyalloc.get_allocator_settings()
    try:
        pyalloc.set_allocator_settings("release_lock_on_cudamalloc:True")
        alloc.malloc(3 * MiB)
        pyalloc.set_allocator_settings("release_lock_on_cudamalloc:False")
        alloc.malloc(30 * MiB)
    finally:
        pyalloc.set_allocator_settings(before)
    assert seen == [False, True]


def test_a_double_free_says_already_freed_after_the_block_merged():
    _, alloc = make()
    p = alloc.malloc(512)
    q = alloc.malloc(512)
    alloc.free(p)
    alloc.free(q)                        # q merges into p's free range
    with pytest.raises(ValueError, match=f"pointer {q:#x} was already freed"):
        alloc.free(q)
    alloc._check_invariants()


def test_a_double_free_of_a_released_segment_says_not_allocated():
    _, alloc = make()
    p = alloc.malloc(512)
    alloc.free(p)
    alloc.empty_cache()                  # the memory is the device's again
    with pytest.raises(ValueError, match="not allocated by this allocator"):
        alloc.free(p)


def test_freeing_the_middle_of_an_allocation_names_its_start():
    _, alloc = make()
    p = alloc.malloc(4096)
    with pytest.raises(ValueError, match=f"inside the allocation at {p:#x}"):
        alloc.free(p + 512)
    alloc.free(p)


def test_module_level_double_free_says_already_freed():
    import pyalloc
    pyalloc.set_default_backend("sim")
    p = pyalloc.malloc(100)
    pyalloc.free(p)
    with pytest.raises(ValueError, match="already freed"):
        pyalloc.free(p)
