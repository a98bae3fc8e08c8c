"""Specification of CUDA-graph capture in the allocator (a.graph, private graph pools, deferred
frees, in-capture reuse with free markers).

The rules are PyTorch's (c10/cuda/CUDACachingAllocator.cpp, late 2025): private pools and the routing
of a capture's allocations to them, a pool keeping its high-water mark while a graph uses it, frees
deferred while a capture runs, graph_capture_record_stream_reuse (#158352's two-stream cases and
#162186's per-stream rule), and empty_cache. A kernel is `sim.launch(stream, uses=(ptr, ...))`: during a capture it
becomes a graph node that uses those blocks (on the GPU, a memset of each: tests/backends.py).
Every test runs on SimDevice and, where a GPU is present, on the GPU (tests/backends.py's harness,
as tests/test_core.py: [sim] and [cuda]); @sim_only marks, with the reason, those that need what
only the simulator has.
"""
import os

import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice
from backends import backend, sim_only  # noqa: F401 (backend: the autouse fixture)
from pool_helpers import make, pool_of

from units import KiB, MiB, GiB

REUSE = "graph_capture_record_stream_reuse:True"




def join(sim, into, frm):
    """`into` waits for the work queued on `frm` so far (an event recorded on frm)."""
    sim.wait_event(into, sim.record_event(frm))


def ancestors(sim, nodes):
    """`nodes` and every node they depend on."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(sim.node_parents(n))
    return seen


def terminals(sim, stream):
    info = sim.stream_capture_info(stream)
    return [] if info is None else info[1]


# ------------------------------------------------------------------------------- the private pool

def test_allocations_on_the_capture_stream_come_from_the_graphs_pool():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as g:
        ptr = alloc.malloc(4 * KiB, s)
    assert pool_of(alloc, ptr) == g.pool()
    assert g.pool()[0] > 0 and g.pool()[1] == 0         # a graph-created id (n, 0)


def test_memory_made_after_a_capture_is_never_the_graphs():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as g:
        tmp = alloc.malloc(4 * KiB, s)
        sim.launch(s, uses=(tmp,))
        alloc.free(tmp)                                   # freed during the capture
    after = [alloc.malloc(4 * KiB, s) for _ in range(4)]
    assert all(pool_of(alloc, p) == (0, 0) for p in after)
    assert tmp not in after
    g.replay()


def test_a_stream_that_joins_the_capture_allocates_from_the_pool():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s) as g:
        join(sim, side, s)
        ptr = alloc.malloc(4 * KiB, side)
        join(sim, s, side)
    assert pool_of(alloc, ptr) == g.pool()


def test_a_stream_outside_the_capture_allocates_from_the_default_pool():
    sim, alloc = make()
    s, other = sim.create_stream(), sim.create_stream()
    with alloc.graph(s):
        ptr = alloc.malloc(4 * KiB, other)
    assert pool_of(alloc, ptr) == (0, 0)


def test_a_block_freed_in_the_capture_is_reused_on_its_stream():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s):
        p = alloc.malloc(4 * KiB, s)
        sim.launch(s, uses=(p,))
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s) == p            # stream order makes it safe


def test_segments_allocated_during_capture_stay_in_the_pool_while_the_graph_lives():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as g:
        alloc.free(alloc.malloc(4 * KiB, s))
    alloc.empty_cache()
    assert alloc._pool_info(g.pool())["reserved_bytes"] == 2 * MiB


def test_reset_releases_the_pool():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as g:
        alloc.free(alloc.malloc(4 * KiB, s))
    g.reset()
    assert alloc.memory_reserved() == 0 and alloc._pool_info(g.pool()) is None


@sim_only("counts a replayed graph's nodes as pending work (SimDevice.pending); CudaTestDevice "
          "counts only the units it launched itself")
def test_replay_runs_the_graph_as_work_on_the_stream():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as g:
        sim.launch(s)
    before = sim.pending(s)
    g.replay()
    assert sim.pending(s) > before


def test_two_graphs_share_a_pool_and_its_cached_blocks():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as first:
        p = alloc.malloc(4 * KiB, s)
        alloc.free(p)
    with alloc.graph(s, pool=first.pool()) as second:
        assert alloc.malloc(4 * KiB, s) == p
    assert second.pool() == first.pool()
    assert alloc._pool_info(first.pool())["use_count"] == 2


def test_graph_pool_handle_shares_a_pool_between_captures():
    sim, alloc = make()
    s = sim.create_stream()
    handle = alloc.graph_pool_handle()
    with alloc.graph(s, pool=handle) as g1:
        alloc.malloc(4 * KiB, s)
    with alloc.graph(s, pool=handle) as g2:
        ptr = alloc.malloc(4 * KiB, s)
    assert g1.pool() == g2.pool() == handle and pool_of(alloc, ptr) == handle


def test_a_mempool_can_be_the_graphs_pool():
    sim, alloc = make()
    s = sim.create_stream()
    pool = alloc.mem_pool()
    with alloc.graph(s, pool=pool):
        ptr = alloc.malloc(4 * KiB, s)
    assert pool_of(alloc, ptr) == pool.id


# ------------------------------------------------------------------------------- errors and modes

def test_capturing_the_default_stream_is_refused():
    _, alloc = make()
    with pytest.raises(ValueError, match="non-default stream"):
        alloc.graph(0)


def test_an_unknown_capture_error_mode_is_refused():
    sim, alloc = make()
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        alloc.graph(sim.create_stream(), capture_error_mode="loose")


def test_a_malformed_pool_is_refused():
    sim, alloc = make()
    with pytest.raises(TypeError, match="pool must be"):
        alloc.graph(sim.create_stream(), pool=(1, 1))


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_every_capture_mode_routes_into_the_pool(mode):
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s, capture_error_mode=mode) as g:
        ptr = alloc.malloc(4 * KiB, s)
    assert pool_of(alloc, ptr) == g.pool()


def test_replay_before_capture_is_an_error():
    sim, alloc = make()
    g = alloc.graph(sim.create_stream())
    with pytest.raises(RuntimeError, match="replay needs a captured graph"):
        g.replay()


def test_a_graph_captures_once():
    sim, alloc = make()
    s = sim.create_stream()
    g = alloc.graph(s)
    with g:
        pass
    with pytest.raises(RuntimeError, match="already captured"):
        with g:
            pass


def test_an_exception_in_the_capture_ends_it_and_releases_the_pool():
    sim, alloc = make()
    s = sim.create_stream()
    g = alloc.graph(s)
    with pytest.raises(KeyError):
        with g:
            ptr = alloc.malloc(4 * KiB, s)
            raise KeyError("boom")
    assert sim.stream_capture_info(s) is None
    assert alloc._pool_info(g.pool())["use_count"] == 0
    alloc.free(ptr)
    alloc.empty_cache()
    assert alloc._pool_info(g.pool()) is None and alloc.memory_reserved() == 0


# ------------------------------------------------------------------------------- no device calls

@sim_only("counts backend calls (SimDevice.counters)")
def test_no_event_call_is_made_during_a_capture():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s):
        before = {k: sim.counters[k] for k in ("event_record", "event_query", "event_synchronize")}
        p = alloc.malloc(4 * KiB, s)
        alloc.record_stream(p, side)
        alloc.free(p)
        alloc.malloc(4 * KiB, s)
        alloc.empty_cache()
        after = {k: sim.counters[k] for k in before}
    assert after == before


@sim_only("counts backend calls (SimDevice.counters)")
def test_empty_cache_during_a_capture_frees_nothing():
    sim, alloc = make()
    alloc.free(alloc.malloc(4 * KiB))                    # a cached default segment
    s = sim.create_stream()
    with alloc.graph(s):
        alloc.free(alloc.malloc(4 * KiB, s))
        alloc.empty_cache()
        assert alloc.memory_reserved() == 4 * MiB
        assert sim.counters["segment_free"] == 0


@sim_only("needs a device of a chosen size (SimDevice's total_memory) and counts its segment frees")
def test_out_of_memory_during_a_capture_raises_without_freeing_and_keeps_the_capture():
    sim, alloc = make("max_split_size_mb:20", total_memory=40 * MiB)
    alloc.free(alloc.malloc(30 * MiB))                   # a cached oversize segment
    s = sim.create_stream()
    with alloc.graph(s):
        with pytest.raises(OutOfMemoryError):
            alloc.malloc(12 * MiB, s)
        assert sim.counters["segment_free"] == 0
    assert alloc.memory_stats()["num_alloc_retries"] == 0


def test_a_released_graph_pool_is_not_freed_during_another_capture():
    sim, alloc = make()
    s = sim.create_stream()
    with alloc.graph(s) as old:
        alloc.free(alloc.malloc(4 * KiB, s))
    old.reset()                 # freed now: no capture is running
    with alloc.graph(s) as g:
        alloc.free(alloc.malloc(4 * KiB, s))
    g_pool = g.pool()
    # Released during a capture: kept until the next empty_cache outside a capture.
    with alloc.graph(s):
        g.reset()
        assert alloc._pool_info(g_pool) is not None
    alloc.empty_cache()
    assert alloc._pool_info(g_pool) is None


# ------------------------------------------------------------------------------- deferred frees

def test_a_record_stream_free_in_a_capture_is_deferred_until_it_ends():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s) as g:         # (kept: a collected graph releases its pool)
        p = alloc.malloc(4 * KiB, s)
        join(sim, side, s)
        alloc.record_stream(p, side)
        sim.launch(side, uses=(p,))
        join(sim, s, side)
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s) != p             # reuse is off: deferred
        assert alloc.memory_stats()["active.all.current"] == 2
    # At its end, p's only other use was captured work: it needs no event and is free now.
    assert alloc.memory_stats()["active.all.current"] == 1


@sim_only("counts backend calls (SimDevice.counters)")
def test_after_the_capture_a_deferred_block_needs_no_event_for_captured_uses():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s) as g:
        p = alloc.malloc(4 * KiB, s)
        join(sim, side, s)
        alloc.record_stream(p, side)
        sim.launch(side, uses=(p,))
        join(sim, s, side)
        alloc.free(p)
        records = sim.counters["event_record"]
    assert sim.counters["event_record"] == records      # its only other use was captured
    with alloc.graph(s, pool=g.pool()):
        assert alloc.malloc(4 * KiB, s) == p


@sim_only("counts backend calls (SimDevice.counters)")
def test_a_pre_capture_stream_use_still_gets_its_event_after_the_capture():
    sim, alloc = make()
    s, side = sim.create_stream(), sim.create_stream()
    p = alloc.malloc(4 * KiB, s)
    alloc.record_stream(p, side)                         # before the capture: real work on side
    sim.launch(side)
    with alloc.graph(s) as g:         # (kept: a collected graph releases its pool)
        alloc.free(p)                                    # default-pool block, freed in capture
        records = sim.counters["event_record"]
    assert sim.counters["event_record"] == records + 1  # recorded when the capture's route ended


# ------------------------------------------------------------------------------- #158352's cases

def capture_two_streams(config):
    sim, alloc = make(config)
    s0, s1 = sim.create_stream(), sim.create_stream()
    return sim, alloc, s0, s1


def test_case0_a_use_on_another_stream_that_is_not_joined_is_never_reused():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))                        # s1 still reads p
        alloc.free(p)
        sim.launch(s0)
        assert alloc.malloc(4 * KiB, s0) != p            # unsafe: s0 is not after s1's read
        join(sim, s0, s1)                                # (joined only so the capture can end)


def test_case1_reused_once_the_use_is_joined_into_the_allocating_stream():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        join(sim, s0, s1)                                # s0 now follows s1's read
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s0) == p


def test_case1_without_the_reuse_flag_the_block_waits():
    sim, alloc, s0, s1 = capture_two_streams("")
    with alloc.graph(s0):
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        join(sim, s0, s1)
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s0) != p


def test_case2_a_use_joined_only_at_the_end_is_released_after_the_capture():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0) as g:
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        alloc.free(p)
        for _ in range(3):
            sim.launch(s0)
            assert alloc.malloc(4 * KiB, s0) != p        # never provably after s1's read
        join(sim, s0, s1)
    alloc.malloc(512)                                     # after the capture it is settled
    with alloc.graph(s0, pool=g.pool()):
        assert alloc.malloc(4 * KiB, s0) == p


def test_case3_a_block_is_reused_only_on_its_own_stream_by_pytorchs_rule():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        p = alloc.malloc(12 * MiB, s0)                    # a whole segment of its own
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        alloc.free(p)                                     # markers: s0's and s1's terminals
        sim.launch(s1)
        join(sim, s1, s0)                                 # s1 now follows both markers
        assert alloc.malloc(12 * MiB, s1) != p            # but p belongs to s0
        join(sim, s0, s1)


def test_case3_cross_stream_reuse_hands_the_segment_to_the_other_stream():
    sim, alloc, s0, s1 = capture_two_streams(REUSE + ",graph_capture_cross_stream_reuse:True")
    with alloc.graph(s0):
        p = alloc.malloc(12 * MiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        alloc.free(p)
        sim.launch(s1)
        join(sim, s1, s0)
        assert alloc.malloc(12 * MiB, s1) == p
        join(sim, s0, s1)
    alloc._check_invariants()


def test_cross_stream_reuse_never_moves_part_of_a_split_segment():
    sim, alloc, s0, s1 = capture_two_streams(REUSE + ",graph_capture_cross_stream_reuse:True")
    with alloc.graph(s0):
        keep = alloc.malloc(4 * KiB, s0)                  # shares p's 2 MiB segment
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        alloc.free(p)
        join(sim, s1, s0)
        assert alloc.malloc(4 * KiB, s1) != p
        join(sim, s0, s1)
    alloc._check_invariants()


def test_case4_work_after_the_join_delays_reuse_under_pytorchs_rule():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))                         # the last use of p on s1
        join(sim, s0, s1)
        sim.launch(s1)                                    # more work on s1, not on p
        alloc.free(p)                                     # s1's marker is that later work
        assert alloc.malloc(4 * KiB, s0) != p
        join(sim, s0, s1)


def test_case4_a_last_use_mark_lets_the_block_be_reused():
    sim, alloc, s0, s1 = capture_two_streams(REUSE + ",graph_capture_last_use_marks:True")
    with alloc.graph(s0):
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        alloc.record_stream(p, s1, last_use=True)        # s1 is done with p here
        join(sim, s0, s1)
        sim.launch(s1)
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s0) == p
        join(sim, s0, s1)


def test_last_use_marks_do_nothing_without_their_option():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        p = alloc.malloc(4 * KiB, s0)
        join(sim, s1, s0)
        alloc.record_stream(p, s1)
        sim.launch(s1, uses=(p,))
        alloc.record_stream(p, s1, last_use=True)
        join(sim, s0, s1)
        sim.launch(s1)
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s0) != p
        join(sim, s0, s1)


def test_a_stream_outside_the_capture_at_the_free_means_waiting_for_the_end():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    p = alloc.malloc(4 * KiB, s0)
    with alloc.graph(s0):
        alloc.record_stream(p, s1)                        # s1 never joins the capture
        alloc.free(p)
        assert alloc.malloc(4 * KiB, s0) != p


def test_the_reuse_walk_expands_each_node_once_per_stream():
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        for _ in range(20):
            p = alloc.malloc(4 * KiB, s0)
            join(sim, s1, s0)
            alloc.record_stream(p, s1)
            sim.launch(s1, uses=(p,))
            join(sim, s0, s1)
            alloc.free(p)
            sim.launch(s0)
        expanded = alloc._capture_stats()["nodes_expanded"]
        nodes = len(ancestors(sim, terminals(sim, s0)))
    assert 0 < expanded <= nodes


def test_the_reuse_walks_of_two_streams_ask_for_each_nodes_parents_once():
    """Both streams walk the same joined graph; its nodes' parents are asked for once in all."""
    sim, alloc, s0, s1 = capture_two_streams(REUSE)
    with alloc.graph(s0):
        join(sim, s1, s0)
        for _ in range(20):
            p0, p1 = alloc.malloc(4 * KiB, s0), alloc.malloc(4 * KiB, s1)
            alloc.record_stream(p0, s1)
            alloc.record_stream(p1, s0)
            sim.launch(s0, uses=(p0, p1))
            sim.launch(s1, uses=(p0, p1))
            join(sim, s0, s1)
            join(sim, s1, s0)
            alloc.free(p0)
            alloc.free(p1)
        expanded = alloc._capture_stats()["nodes_expanded"]
        nodes = len(ancestors(sim, terminals(sim, s0) + terminals(sim, s1)))
        join(sim, s0, s1)
    assert 0 < expanded <= nodes


# ------------------------------------------------------------------------------- the safety property

OPTIONS = ["", REUSE, REUSE + ",graph_capture_cross_stream_reuse:True",
           REUSE + ",graph_capture_last_use_marks:True"]


# Weighted: allocations, uses and frees dominate, so that "freed while another stream's use is
# not joined, then asked for again" comes up often (a broken reachability test fails in seconds).
OPS = ["alloc"] * 6 + ["use"] * 5 + ["free"] * 5 + ["join"] * 2 + ["mark", "alloc_big"]


@sim_only("runs the reuse sanitizer (SimDevice(check_reuse=True)) on every block handed out")
@settings(max_examples=int(os.environ.get("PYALLOC_SANITIZER_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(OPTIONS),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2), st.integers(0, 2),
                              st.integers(0, 50)),
                    min_size=4, max_size=80))
def test_no_block_is_handed_out_again_before_every_node_that_used_it_precedes_the_new_stream(config, ops):
    """Random 3-stream captures: each block handed out during the capture must not overlap memory
    freed earlier in it unless every node that used that memory is an ancestor of the receiving
    stream's terminals (the real safety condition, checked on the simulated graph, and by the
    reuse sanitizer on every block the allocator hands out)."""
    sim, alloc = make(config, check_reuse=True)
    streams = [sim.create_stream() for _ in range(3)]
    live = {}          # ptr -> (size, stream)
    used_by = {}       # ptr -> nodes that used it (of the current allocation)
    freed = []         # (ptr, size, nodes) of memory freed in the capture
    with alloc.graph(streams[0]):
        for s in streams[1:]:
            join(sim, s, streams[0])
        for op, a, b, pick in ops:
            sa, sb = streams[a], streams[b]
            if op in ("alloc", "alloc_big"):
                size = 4 * KiB if op == "alloc" else 12 * MiB
                ptr = alloc.malloc(size, sa)
                reach = ancestors(sim, terminals(sim, sa))
                for f_ptr, f_size, nodes in freed:
                    if f_ptr < ptr + size and ptr < f_ptr + f_size:
                        assert nodes <= reach, (
                            f"{ptr:#x} handed out on stream {sa} while nodes {sorted(nodes - reach)} "
                            f"that used {f_ptr:#x} do not precede it")
                live[ptr] = (size, sa)
                used_by[ptr] = set()
            elif not live:
                continue
            else:
                ptr = sorted(live)[pick % len(live)]
                size, home = live[ptr]
                if op == "use":
                    if sa != home:
                        alloc.record_stream(ptr, sa)
                    used_by[ptr].add(sim.launch(sa, uses=((ptr, size),)))
                elif op == "mark":
                    alloc.record_stream(ptr, sa, last_use=True)
                elif op == "free":
                    alloc.free(ptr)
                    freed.append((ptr, size, used_by.pop(ptr)))
                    del live[ptr]
            if op == "join":
                join(sim, sa, sb)
        for s in streams[1:]:
            join(sim, streams[0], s)
    alloc._check_invariants()


def test_cross_stream_reuse_moves_only_one_segment_and_only_when_the_stream_has_none():
    sim, alloc, s0, s1 = capture_two_streams(REUSE + ",graph_capture_cross_stream_reuse:True")
    with alloc.graph(s0):
        ptrs = [alloc.malloc(12 * MiB, s0) for _ in range(3)]
        join(sim, s1, s0)
        for p in ptrs:
            alloc.record_stream(p, s1)
        sim.launch(s1, uses=tuple(ptrs))
        for p in ptrs:
            alloc.free(p)
        join(sim, s0, s1)
        join(sim, s1, s0)
        moved = alloc.malloc(12 * MiB, s1)          # takes one of them
        again = [alloc.malloc(12 * MiB, s0) for _ in range(2)]
        join(sim, s0, s1)
    assert moved in ptrs and sorted(again + [moved]) == sorted(ptrs)   # s0 reused the other two
    assert alloc.max_memory_reserved() == 3 * 12 * MiB
    alloc._check_invariants()


def test_a_record_stream_after_a_last_use_mark_withdraws_the_mark():
    """A stream marked as done with a block (record_stream(..., last_use=True)) that is then
    declared to use it again (record_stream without last_use) and runs a kernel on it: the
    block's free marker for that stream is its terminals at the free, so the block is not handed
    to another stream before that kernel precedes it (found by the capture property above)."""
    sim, alloc = make(REUSE + ",graph_capture_last_use_marks:True")
    s0, s1 = sim.create_stream(), sim.create_stream()
    with alloc.graph(s0) as graph:
        join(sim, s1, s0)
        p = alloc.malloc(4 * KiB, s1)
        alloc.record_stream(p, s0, last_use=True)         # nothing on s0 uses it yet
        alloc.record_stream(p, s0)                        # ... but now it does
        kernel = sim.launch(s0, uses=(p,))
        sim.launch(s1)                                    # s1 moves on without waiting for s0
        alloc.free(p)
        q = alloc.malloc(4 * KiB, s1)
        assert q != p or kernel in ancestors(sim, terminals(sim, s1))
        join(sim, s0, s1)
    graph.reset()
