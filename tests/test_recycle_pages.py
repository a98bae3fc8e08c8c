"""recycle_pages (pyalloc only, issue 30): physical pages recycled between expandable segments,
on the simulated device, which keeps physical pages apart from addresses."""
import pytest

from pyalloc import CachingAllocator, CudaError, OutOfMemoryError, ReuseError, SimDevice
from pyalloc.config import CudaAllocatorConfig

from units import MiB, GiB
PAGE = 2 * MiB
POLICY = "expandable_segments:True,recycle_pages:True"


def make(total=GiB, config=POLICY):
    sim = SimDevice(total)
    return CachingAllocator(backend=sim, config=config), sim


def hole_then_growth(a, sim):
    """A free 30 MiB block before a live one on the default stream, then a 20 MiB request on
    another stream: its new segment could take the hole's 15 whole pages. Returns the stream."""
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    s = sim.create_stream()
    a.malloc(20 * MiB, s)
    return s


# ------------------------------------------------------------------------------ the setting

def test_the_setting_is_off_by_default():
    assert CudaAllocatorConfig("expandable_segments:True").recycle_pages is False


def test_the_setting_parses_as_a_bool():
    assert CudaAllocatorConfig(POLICY).recycle_pages is True


def test_without_the_setting_free_pages_stay_mapped():
    a, sim = make(config="expandable_segments:True")
    hole_then_growth(a, sim)
    assert sim.counters["vm_unmap_keep"] == 0 and sim.used_memory == 40 * MiB + 20 * MiB  # 20 MiB pages


def test_without_the_setting_memory_stats_have_no_page_pool_keys():
    a, _ = make(config="expandable_segments:True")
    assert "page_pool_bytes" not in a.memory_stats()


def test_the_setting_does_nothing_without_expandable_segments():
    a, sim = make(config="recycle_pages:True")
    hole_then_growth(a, sim)
    assert sim.counters["vm_reserve"] == 0 and "page_pool_bytes" not in a.memory_stats()


# ------------------------------------------------------------------------------ the policy

def test_large_pool_pages_are_2mib():
    a, sim = make()
    a.malloc(21 * MiB)
    assert sim.mapped_memory == 22 * MiB


def test_a_growth_takes_whole_free_pages_instead_of_creating_memory():
    a, sim = make()
    hole_then_growth(a, sim)
    assert sim.used_memory == 34 * MiB


def test_the_growth_maps_pages_from_the_pool():
    a, sim = make()
    hole_then_growth(a, sim)
    assert a.memory_stats()["num_page_remaps"] == 10 and sim.counters["vm_map_handles"] == 1


def test_only_the_pages_the_growth_needs_are_unmapped():
    a, sim = make()
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    a.malloc(20 * MiB, sim.create_stream())
    assert sim.unmapped_pages == 0 and sim.is_mapped(hole, 10 * MiB)


def test_reserved_bytes_are_the_physical_pages():
    a, sim = make()
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    s = sim.create_stream()
    a.free(a.malloc(20 * MiB, s))
    a.malloc(30 * MiB)                   # the hole again: its pages come back from the 20 MiB block
    assert a.memory_reserved() == sim.used_memory == 34 * MiB


def pages_left_in_pool(total=12 * MiB):
    """An allocator whose page pool holds the 4 pages of a free 8 MiB block: a growth inside
    use_mem_pool took them, then ran out of memory (no flush while a route is active)."""
    a, sim = make(total=total)
    hole = a.malloc(8 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    with a.use_mem_pool(a.mem_pool()):
        with pytest.raises(OutOfMemoryError):
            a.malloc(60 * MiB)
    return a, sim


def test_page_pool_bytes_count_pages_mapped_nowhere():
    a, sim = pages_left_in_pool()
    assert a.memory_stats()["page_pool_bytes"] == sim.unmapped_pages * PAGE == 8 * MiB


def test_reserved_bytes_count_the_page_pool():
    a, sim = pages_left_in_pool()
    assert a.memory_reserved() == sim.used_memory == 12 * MiB


def test_a_map_takes_pages_from_the_pool_before_creating_memory():
    a, sim = pages_left_in_pool()
    maps = sim.counters["vm_map"]
    a.malloc(6 * MiB, sim.create_stream())
    assert sim.counters["vm_map"] == maps and sim.unmapped_pages == 1


def test_a_block_whose_pages_were_taken_is_mapped_again_when_reused():
    a, sim = make()
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    s = sim.create_stream()
    a.malloc(20 * MiB, s)
    assert a.malloc(30 * MiB) == hole and sim.is_mapped(hole, 30 * MiB)


def test_a_run_the_growth_maps_into_gives_no_pages():
    # The free tail of the segment is the start of the growth's own run: its pages stay.
    a, sim = make()
    a.malloc(4 * MiB)
    tail = a.malloc(4 * MiB)
    a.free(tail)
    assert a.malloc(10 * MiB) == tail and sim.counters["vm_unmap_keep"] == 0


def test_partial_pages_of_a_free_block_stay_mapped():
    a, sim = make()
    a.malloc(MiB + 512 * 1024)           # large pool: 2 MiB mapped, the block ends mid-page
    hole = a.malloc(5 * MiB)
    a.malloc(3 * MiB)
    a.free(hole)
    s = sim.create_stream()
    a.malloc(20 * MiB, s)
    assert sim.is_mapped(hole, PAGE - (hole % PAGE)) and not sim.is_mapped(hole - hole % PAGE + PAGE, PAGE)


def test_a_private_pools_free_pages_are_not_taken():
    a, sim = make()
    s = sim.create_stream()
    with a.graph(s) as g:
        a.free(a.malloc(30 * MiB, s))
    a.malloc(20 * MiB)
    assert sim.counters["vm_unmap_keep"] == 0 and a._pool_info(g.pool())["reserved_bytes"] == 30 * MiB


# ------------------------------------------------------- waiting for the work of the blocks it takes
#
# cuMemUnmap does not wait for the device (measured on the H200: ten 2 MiB pages unmap in
# 0.3 - 0.4 ms with a 100 ms kernel queued, which is still running afterwards), so work queued
# before a block's free must be over before its pages go. With SimDevice(check_reuse=True) an
# unmap of pages that queued work uses raises ReuseError.

def checked(config=POLICY, total=GiB):
    sim = SimDevice(total, check_reuse=True)
    return CachingAllocator(backend=sim, config=config), sim


# A device on which the pages of a 30 MiB hole must be taken for a 40 MiB growth: 30 + 4 + 40 MiB
# would not fit, 44 MiB does.
TIGHT = 64 * MiB


def freed_hole(a, sim, work=True):
    """A free 30 MiB block before a live 4 MiB one on the default stream, used by queued work
    before its free when `work`."""
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    if work:
        sim.launch(0, uses=[(hole, 30 * MiB)])
    a.free(hole)
    return hole


def test_sim_an_unmap_of_pages_queued_work_uses_is_a_reuse_error():
    sim = SimDevice(GiB, check_reuse=True)
    base = sim.reserve_address_space(4 * PAGE)
    sim.map_new_pages(base, PAGE)
    sim.launch(0, uses=[(base, 16)])
    with pytest.raises(ReuseError, match="unmapped while"):
        sim.unmap_keeping_pages(base, 1)


def test_sim_an_unmap_after_the_work_completed_is_no_error():
    sim = SimDevice(GiB, check_reuse=True)
    base = sim.reserve_address_space(4 * PAGE)
    sim.map_new_pages(base, PAGE)
    sim.launch(0, uses=[(base, 16)])
    sim.complete(0)
    assert len(sim.unmap_keeping_pages(base, 1)) == 1


def test_a_growth_creates_memory_rather_than_wait_for_queued_work_when_it_fits():
    a, sim = checked()
    freed_hole(a, sim)
    before = sim.counters["device_synchronize"]
    a.malloc(40 * MiB)
    assert (sim.counters["device_synchronize"], sim.pending(0)) == (before, 1)
    assert sim.used_memory == 74 * MiB and a.memory_stats()["num_page_remaps"] == 0


def test_a_growth_waits_for_queued_work_when_the_device_has_not_the_memory_to_create():
    a, sim = checked(total=TIGHT)
    freed_hole(a, sim)
    before = sim.counters["device_synchronize"]
    a.malloc(40 * MiB)
    assert sim.counters["device_synchronize"] == before + 1 and sim.used_memory == 44 * MiB


def test_a_growth_waits_for_queued_work_when_creating_would_pass_the_memory_fraction():
    a, sim = checked()
    a.set_memory_fraction(60 * MiB / GiB)
    freed_hole(a, sim)
    before = sim.counters["device_synchronize"]
    a.malloc(40 * MiB)
    assert sim.counters["device_synchronize"] == before + 1 and sim.used_memory == 44 * MiB


def test_a_growth_that_takes_pages_of_finished_work_does_not_wait():
    a, sim = checked(total=TIGHT)
    freed_hole(a, sim)
    sim.complete(0)
    before = sim.counters["device_synchronize"]
    a.malloc(40 * MiB)
    assert sim.counters["device_synchronize"] == before and sim.used_memory == 44 * MiB


def test_a_growth_takes_only_pages_of_finished_work_when_creating_the_rest_fits():
    # x1's stream is idle, x2's work is queued: the 40 MiB growth on the default stream takes
    # x1's 15 pages, creates the rest, and leaves x2's pages, which queued work still uses.
    a, sim = checked()
    s = sim.create_stream()
    x1 = a.malloc(30 * MiB, s)
    a.malloc(4 * MiB, s)
    x2 = a.malloc(10 * MiB)
    a.malloc(4 * MiB)
    sim.launch(0, uses=[(x2, 10 * MiB)])
    a.free(x1)
    a.free(x2)
    before = sim.counters["device_synchronize"]
    a.malloc(40 * MiB)
    assert (sim.counters["device_synchronize"], sim.pending(0)) == (before, 1)
    assert a.memory_stats()["num_page_remaps"] == 15


def two_holes_after_work(a, sim):
    """Free blocks of 30 and 10 MiB, each before a live 4 MiB one, used by queued work before
    their frees; returns their addresses."""
    x1 = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    x2 = a.malloc(10 * MiB)
    a.malloc(4 * MiB)
    sim.launch(0, uses=[(x1, 30 * MiB), (x2, 10 * MiB)])
    a.free(x1)
    a.free(x2)
    return x1, x2


def test_a_growth_takes_pages_freed_before_a_mark_the_device_passed_while_later_work_runs():
    # The first growth marks the stream, which is idle; work queued after it is still pending at
    # the second growth, which takes the pages left of a block freed before the mark, no wait.
    a, sim = checked(total=96 * MiB)
    x1, x2 = two_holes_after_work(a, sim)
    sim.complete(0)
    a.malloc(32 * MiB)                # 15 pages of x1 and one of x2
    sim.launch(0)
    before = sim.counters["device_synchronize"]
    a.malloc(34 * MiB)                # x2's other 4 pages, and 13 new ones
    assert (sim.counters["device_synchronize"], sim.pending(0)) == (before, 1)
    assert a.memory_stats()["num_page_remaps"] == 20


def test_after_a_wait_a_growth_takes_pages_freed_before_it_without_another():
    # 76 MiB: the first growth cannot create its 32 MiB beside the 48 MiB in use, and waits;
    # the second takes x2's last 4 pages and creates 26 MiB, which fits.
    a, sim = checked(total=76 * MiB)
    two_holes_after_work(a, sim)
    a.malloc(32 * MiB)                # waits: the work of both is queued
    sim.launch(0)
    before = sim.counters["device_synchronize"]
    a.malloc(34 * MiB)
    assert (sim.counters["device_synchronize"], sim.pending(0)) == (before, 1)


def test_a_growth_waits_for_blocks_freed_after_the_device_last_got_past_a_mark():
    a, sim = checked(total=80 * MiB)
    freed_hole(a, sim, work=False)
    sim.launch(0)                     # queued before the growth's mark: the mark is not reached
    b = a.malloc(8 * MiB)
    sim.launch(0, uses=[(b, 8 * MiB)])
    a.free(b)
    before = sim.counters["device_synchronize"]
    a.malloc(60 * MiB)                # needs the pages of both free blocks: 80 MiB is tight
    assert sim.counters["device_synchronize"] == before + 1


def test_nothing_is_unmapped_during_a_capture():
    a, sim = make()
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    s = sim.create_stream()
    with a.graph(s):
        a.malloc(20 * MiB, s)
    assert sim.counters["vm_unmap_keep"] == 0 and sim.counters["device_synchronize"] == 0


def small_page_from_a_large_hole():
    """A small-pool growth (4 KiB) that takes one page of a free 8 MiB large-pool block."""
    a, sim = make()
    hole = a.malloc(8 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    a.malloc(4096)
    return a, sim


def test_a_small_pool_growth_takes_a_large_pool_page():
    a, sim = small_page_from_a_large_hole()
    assert sim.used_memory == 12 * MiB and a.memory_stats()["num_page_remaps"] == 1


def test_a_page_that_changes_size_class_moves_between_the_rows():
    a, _ = small_page_from_a_large_hole()
    stats = a.memory_stats()
    assert (stats["reserved_bytes.small_pool.current"], stats["reserved_bytes.large_pool.current"]) == (
        2 * MiB, 10 * MiB)


def test_a_page_that_changes_size_class_is_neither_allocated_nor_freed():
    a, _ = small_page_from_a_large_hole()
    stats = a.memory_stats()
    assert (stats["reserved_bytes.all.allocated"], stats["reserved_bytes.all.freed"]) == (12 * MiB, 0)


# ------------------------------------------------------------------------------ releases and limits

def test_empty_cache_releases_the_page_pool():
    a, sim = pages_left_in_pool()
    a.empty_cache()
    assert a.memory_stats()["page_pool_bytes"] == 0 and sim.unmapped_pages == 0


def test_empty_cache_leaves_reserved_equal_to_the_device_memory_used():
    a, sim = pages_left_in_pool()
    a.empty_cache()
    assert a.memory_reserved() == sim.used_memory == 4 * MiB


def test_the_out_of_memory_ladder_releases_the_page_pool():
    a, sim = pages_left_in_pool()
    with pytest.raises(OutOfMemoryError):
        a.malloc(60 * MiB)                         # no route now: the ladder flushes
    assert a.memory_stats()["page_pool_bytes"] == 0 and sim.unmapped_pages == 0


def test_the_dry_run_counts_the_page_pool():
    a, sim = pages_left_in_pool()
    dry = a._dry_release_bytes(60 * MiB, 0)
    before = a.memory_stats()["reserved_bytes.all.freed"]
    with pytest.raises(OutOfMemoryError):
        a.malloc(60 * MiB)
    assert dry == a.memory_stats()["reserved_bytes.all.freed"] - before == 8 * MiB


def test_the_memory_fraction_counts_the_memory_created():
    # 34 MiB held, 40 MiB allowed: a 20 MiB growth that recycles 10 pages creates nothing, so it
    # needs no retry (counting its request, 54 MiB would be over the limit).
    a, sim = make(total=100 * MiB)
    a.set_memory_fraction(0.4)
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    a.malloc(20 * MiB, sim.create_stream())
    assert a.memory_stats()["num_alloc_retries"] == 0 and a.memory_reserved() == 34 * MiB


# ------------------------------------------------------------------------------ failures

def state(a, sim):
    """What a failed call must leave as it was: statistics, blocks and the device's pages."""
    blocks = sorted((b["address"], b["size"], b["allocated"]) for seg in a._segments()
                    for b in seg["blocks"])
    return a.memory_stats(), blocks, sim.used_memory, sim.mapped_memory, sim.unmapped_pages


@pytest.mark.parametrize("call", ["vm_unmap_keep", "vm_map_handles", "vm_reserve"])
def test_a_failed_call_of_a_growth_that_recycles_changes_nothing(call):
    a, sim = make()
    hole = a.malloc(30 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    s = sim.create_stream()
    before = state(a, sim)
    sim.fail_next(call)
    with pytest.raises(CudaError):
        a.malloc(20 * MiB, s)
    a._check_invariants()
    assert state(a, sim)[1:] == before[1:] and state(a, sim)[0]["reserved_bytes.all.current"] == 34 * MiB


def test_a_failed_create_after_pool_pages_were_mapped_puts_the_pages_back():
    a, sim = make()
    hole = a.malloc(8 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    before = state(a, sim)
    sim.fail_next("vm_map")
    with pytest.raises(CudaError):
        a.malloc(30 * MiB, sim.create_stream())  # the hole's 4 pages first, then new ones: fails
    a._check_invariants()
    assert state(a, sim)[1:] == before[1:]


def test_out_of_memory_after_pool_pages_were_mapped_keeps_reserved_physical():
    a, sim = make(total=40 * MiB)
    hole = a.malloc(8 * MiB)
    a.malloc(4 * MiB)
    a.free(hole)
    with pytest.raises(OutOfMemoryError):
        a.malloc(60 * MiB, sim.create_stream())
    a._check_invariants()
    assert a.memory_reserved() == sim.used_memory


def emptied_small_segment():
    """A small-pool segment whose one page a 3 MiB growth then takes, leaving the segment with
    nothing mapped: (allocator, sim)."""
    a, sim = make()
    a.free(a.malloc(4096))                 # a 2 MiB small-pool page, free
    a.malloc(3 * MiB)                      # takes it, and creates one more
    return a, sim


def test_a_growth_that_empties_a_segment_keeps_its_address_space_until_the_next_growth():
    # Releasing it within the growth could fail after the growth succeeded, when the malloc can
    # neither be undone nor fail without having changed the allocator (a property machine's find).
    a, sim = emptied_small_segment()
    assert (sim.counters["vm_reserve"], sim.counters["vm_release"]) == (2, 0)
    a.malloc(40 * MiB)
    assert sim.counters["vm_release"] == 1
    a._check_invariants()


def test_a_failing_address_release_does_not_fail_the_growth_that_emptied_the_segment():
    a, sim = make()
    a.free(a.malloc(4096))
    sim.fail_next("vm_release")
    p = a.malloc(3 * MiB)
    a._check_invariants()
    assert sim.counters["injected_failures"] == 0 and p in {b["address"] for seg in a._segments()
                                                           for b in seg["blocks"] if b["allocated"]}


def test_a_failing_address_release_fails_the_next_growth_before_it_changes_anything():
    a, sim = emptied_small_segment()
    before = state(a, sim)
    sim.fail_next("vm_release")
    with pytest.raises(CudaError):
        a.malloc(40 * MiB)
    a._check_invariants()
    assert state(a, sim) == before
    a.malloc(40 * MiB)                     # the release is tried again, and done
    assert sim.counters["vm_release"] == 2  # the failed call and the retry


def test_empty_cache_releases_an_emptied_segments_address_space():
    a, sim = emptied_small_segment()
    a.empty_cache()
    assert sim.counters["vm_release"] == 1
    a._check_invariants()


# ------------------------------------------------------------------------------ the device model

def device_with_pages(mapped=1, kept=1):
    """A SimDevice with a 4-page reservation whose first `mapped` pages were mapped, the first
    `kept` of them then unmapped keeping their memory: (sim, base, their handles)."""
    sim = SimDevice(GiB)
    base = sim.reserve_address_space(4 * PAGE)
    sim.map_new_pages(base, mapped * PAGE)
    return sim, base, sim.unmap_keeping_pages(base, kept)


def test_sim_unmap_keeping_pages_keeps_their_memory():
    sim, _, _ = device_with_pages(2, 2)
    assert (sim.used_memory, sim.mapped_memory, sim.unmapped_pages) == (2 * PAGE, 0, 2)


def test_sim_kept_pages_map_again_elsewhere():
    sim, base, handles = device_with_pages()
    sim.map_kept_pages(base + 3 * PAGE, handles)
    assert sim.is_mapped(base + 3 * PAGE, PAGE) and not sim.is_mapped(base, PAGE)


def test_sim_mapping_a_page_twice_is_an_error():
    sim, base, handles = device_with_pages()
    sim.map_kept_pages(base, handles)
    with pytest.raises(RuntimeError, match="mapped twice"):
        sim.map_kept_pages(base + PAGE, handles)


def test_sim_mapping_over_a_mapped_address_is_an_error():
    sim, base, handles = device_with_pages(2, 1)
    with pytest.raises(RuntimeError, match="mapped twice"):
        sim.map_kept_pages(base + PAGE, handles)


def test_sim_physical_memory_never_exceeds_the_device():
    sim = SimDevice(4 * MiB)
    base = sim.reserve_address_space(4 * PAGE)
    sim.map_new_pages(base, PAGE)
    sim.unmap_keeping_pages(base, 1)
    sim.map_new_pages(base + PAGE, PAGE)
    assert sim.map_new_pages(base + 2 * PAGE, PAGE) is False and sim.used_memory == 4 * MiB


def test_sim_releasing_a_mapped_page_is_an_error():
    sim, base, handles = device_with_pages()
    sim.map_kept_pages(base, handles)
    with pytest.raises(RuntimeError, match="still mapped"):
        sim.free_kept_pages(handles)


def test_sim_releasing_kept_pages_gives_their_memory_back():
    sim, _, handles = device_with_pages(2, 2)
    sim.free_kept_pages(handles)
    assert (sim.used_memory, sim.unmapped_pages) == (0, 0)


def test_sim_a_failed_unmap_keeps_the_pages_mapped():
    sim, base, _ = device_with_pages(2, 1)
    sim.fail_next("vm_unmap_keep")
    with pytest.raises(CudaError):
        sim.unmap_keeping_pages(base + PAGE, 1)
    assert sim.is_mapped(base + PAGE, PAGE)
