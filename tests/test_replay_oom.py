"""Out of memory in replays: oom entries attempted at their place, the policy's segment frees told
from empty_cache() calls, the memory fraction, the recorded OOM and the limit it implies.

Three kinds of trace:
* tests/data/oom: PyTorch's own, recorded on the H200 (tests/data/oom/README.md), each with
  what torch.cuda.memory_stats() said at the end: replayed under the run's own setting, device
  memory and fraction, every figure and address must be PyTorch's.
* traces pyalloc records itself on a SimDevice (record): pyalloc makes PyTorch's decisions, so a
  replay of them must give back the recorder's own figures; small programs make the ambiguous
  cases of the empty_cache / policy rule on purpose.
* hand-made dicts in PyTorch's snapshot format, for single oom entries.
"""
import gzip
import json
import pickle
from pathlib import Path

import pytest

from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice
from pyalloc.replay import (allowed_bytes, classify_releases, device_for_allowed, recorded_oom,
                            replay, segment_size_for, traced_reservations)
from pyalloc.snapshot import SnapshotError
from pyalloc.tune import tune

from units import MiB, GiB
OOM_DATA = Path(__file__).resolve().parent / "data" / "oom"
FIGURES = ("peak_reserved", "peak_allocated", "peak_requested", "num_device_alloc",
           "num_alloc_retries", "num_ooms")


def recorded_runs():
    """The NAME.json of every H200 trace in tests/data/oom (the oracle's summary left out)."""
    return sorted(p.stem for p in OOM_DATA.glob("*.json") if p.stem != "oracle")


def load_run(name):
    return (pickle.load(gzip.open(OOM_DATA / f"{name}.pickle.gz")),
            json.loads((OOM_DATA / f"{name}.json").read_text()))


def replay_as_recorded(snapshot, run, **kwargs):
    return replay(snapshot, config=run["conf"], device_memory=run["total_memory"],
                  memory_fraction=run["fraction"], **kwargs)


# -- PyTorch's traces, replayed exactly ------------------------------------------------------------

def test_oom_trace_folder_holds_every_case():
    names = recorded_runs()
    for needed in ("streams", "expandable-empty-cache", "gc-fraction", "tight-fraction",
                   "oracle-default"):
        assert needed in names, f"tests/data/oom/{needed}.json is missing"


@pytest.fixture(scope="module", params=recorded_runs())
def recorded_replay(request):
    snapshot, run = load_run(request.param)
    return run, replay_as_recorded(snapshot, run)


@pytest.mark.parametrize("figure", FIGURES)
def test_replay_of_an_h200_oom_trace_gives_pytorchs_figure(recorded_replay, figure):
    run, result = recorded_replay
    assert getattr(result, figure) == run[figure], run["name"]


def test_replay_of_an_h200_oom_trace_puts_every_allocation_at_pytorchs_address(recorded_replay):
    run, result = recorded_replay
    assert result.allocations == run["actions"]["alloc"]
    assert result.address_matches == result.allocations, run["name"]


def test_empty_cache_under_expandable_segments_replays_as_many_calls_as_the_run_made():
    snapshot, run = load_run("expandable-empty-cache")
    result = replay_as_recorded(snapshot, run)
    assert result.empty_cache_calls == run["empty_cache_calls"] == 11
    assert result.final_reserved == run["final_reserved"]


def test_gc_frees_under_a_fraction_are_the_policys_not_empty_cache_calls():
    snapshot, run = load_run("gc-fraction")
    assert run["actions"]["segment_free"] > 0
    result = replay_as_recorded(snapshot, run)
    assert result.empty_cache_calls == 0
    assert result.final_reserved == run["final_reserved"]


def test_without_its_fraction_the_gc_trace_frees_nothing_by_itself():
    # garbage_collection_threshold acts only under a fraction: with none, its frees cannot be
    # the policy's, so they are replayed as empty_cache() calls (which free more than the GC
    # did, so the recorded addresses no longer fit: fresh placement).
    snapshot, run = load_run("gc-fraction")
    result = replay(snapshot, config=run["conf"], device_memory=run["total_memory"], placement="fresh")
    assert result.empty_cache_calls > 0


def test_tight_fraction_trace_counts_every_oom_and_retry_and_no_oom_request_fits():
    snapshot, run = load_run("tight-fraction")
    result = replay_as_recorded(snapshot, run)
    assert len(result.oom_requests) == run["actions"]["oom"] == run["num_ooms"] == 25
    assert result.oom_requests_fitting == 0
    assert result.failed_allocations == 0           # every alloc entry was served, as in PyTorch
    assert all(r.margin < 0 for r in result.oom_requests)


def test_tight_fraction_oom_requests_fit_on_a_roomy_device_and_are_freed_at_once():
    # (Fresh placement: a request that fits takes a new segment the run never had.)
    snapshot, run = load_run("tight-fraction")
    result = replay(snapshot, config=run["conf"], device_memory=run["total_memory"], placement="fresh")
    assert result.num_ooms == 0
    assert result.oom_requests_fitting == 25
    assert all(r.fits and r.margin > 0 for r in result.oom_requests)


# -- the recorded OOM and the limit it implies ------------------------------------------------------

@pytest.mark.parametrize("name", ["tight-fraction", "oracle-default"])
def test_recorded_oom_bounds_the_limit_from_above_and_the_run_from_below(name):
    snapshot, run = load_run(name)
    oom = recorded_oom(snapshot)
    assert oom.count == run["num_ooms"]
    assert run["allowed"] <= oom.limit            # the real cap is within the bound
    assert oom.peak_reserved <= run["allowed"] and oom.consistent
    assert oom.device_memory == oom.limit          # no fraction: the device is the limit


def test_recorded_oom_figures_are_those_of_pytorchs_message():
    # PyTorch's message: "Tried to allocate 90.00 MiB ... 691.59 MiB is allocated by PyTorch, and
    # 86.41 MiB is reserved by PyTorch but unallocated."
    snapshot, run = load_run("oracle-default")
    oom = recorded_oom(snapshot)
    assert oom.segment_size == 90 * MiB
    assert "Tried to allocate 90.00 MiB" in run["error"]
    assert f"{oom.allocated / MiB:.2f} MiB is allocated by PyTorch" in run["error"]
    assert f"{oom.cached_free / MiB:.2f} MiB is reserved by PyTorch but unallocated" in run["error"]
    assert oom.index == next(i for i, e in enumerate(snapshot["device_traces"][0])
                             if e["action"] == "oom")


def test_replay_on_the_derived_limit_reproduces_every_recorded_oom():
    snapshot, run = load_run("tight-fraction")
    oom = recorded_oom(snapshot)
    result = replay(snapshot, device_memory=oom.device_memory)
    assert result.num_ooms == run["num_ooms"]
    assert result.address_matches == result.allocations


def test_recorded_oom_under_a_fraction_gives_the_device_of_that_fraction():
    snapshot, run = load_run("tight-fraction")
    oom = recorded_oom(snapshot, memory_fraction=run["fraction"])
    step = int(1 / run["fraction"]) + 1              # device bytes per byte of limit, and one
    assert allowed_bytes(oom.device_memory, run["fraction"]) <= oom.limit
    assert allowed_bytes(oom.device_memory + step, run["fraction"]) > oom.limit
    result = replay(snapshot, device_memory=oom.device_memory, memory_fraction=run["fraction"])
    assert (result.num_ooms, result.address_matches) == (run["num_ooms"], result.allocations)


def test_recorded_oom_is_none_for_a_trace_without_oom_entries():
    snapshot, _ = load_run("streams")
    assert recorded_oom(snapshot) is None


def test_device_for_allowed_is_the_largest_device_whose_fraction_stays_within():
    for fraction in (0.5, 0.0059306, 0.99):
        size = device_for_allowed(10**9, fraction)
        assert allowed_bytes(size, fraction) <= 10**9 < allowed_bytes(size + 1, fraction) + 1
    assert device_for_allowed(10**9, None) == 10**9


# -- the oracle: one workload capped under several settings ------------------------------------------

@pytest.fixture(scope="module")
def oracle():
    summary = json.loads((OOM_DATA / "oracle.json").read_text())
    snapshot, run = load_run("oracle-default")
    configs = [r["conf"] for r in summary["runs"] if r["conf"]]
    result = tune(snapshot, grid=None, configs=configs, jobs=1, device_memory=run["total_memory"],
                  memory_fraction=run["fraction"], fit=True, snapshot=snapshot)
    return summary, run, result


def test_oracle_reproduces_the_oom_under_the_traces_own_setting(oracle):
    _, run, result = oracle
    assert result.baseline.result.num_ooms == run["num_ooms"] == 1
    assert result.baseline.recorded_oom_request.fits is False
    assert result.own_fresh.result.num_ooms >= 1


def test_oracle_predicts_no_oom_for_every_setting_that_completed_under_the_cap(oracle):
    summary, _, result = oracle
    completed = {r["conf"] for r in summary["runs"] if r["outcome"] == "completed"}
    assert completed, "the oracle has no setting that completed"
    rows = {r.config: r for r in result.rows}
    for conf in completed:
        assert rows[conf].result.num_ooms == 0, conf
        assert rows[conf].recorded_oom_request.fits, conf


def test_oracle_predicts_an_oom_for_every_setting_that_ran_out_under_the_cap(oracle):
    summary, _, result = oracle
    rows = {r.config: r for r in result.rows}
    for run in summary["runs"]:
        if run["outcome"] == "oom":
            assert rows[run["conf"]].result.num_ooms >= 1, run["conf"]


def test_oracle_recommends_a_setting_that_completed(oracle):
    summary, _, result = oracle
    completed = {r["conf"] for r in summary["runs"] if r["outcome"] == "completed"}
    assert result.best_avoids_oom and result.best.config in completed


def test_oracle_fit_puts_completed_settings_within_the_cap_and_the_others_above_it(oracle):
    summary, run, result = oracle
    outcome = {r["conf"]: r["outcome"] for r in summary["runs"]}
    for row in result.rows:
        limit = allowed_bytes(row.fit_memory, run["fraction"])
        if outcome[row.config] == "completed":
            assert limit <= run["allowed"], row.config
        else:
            assert limit > run["allowed"], row.config


@pytest.mark.parametrize("name", [n for n in recorded_runs() if n.startswith("oracle-")])
def test_each_oracle_snapshot_reproduces_its_own_oom_under_its_own_setting(name):
    snapshot, run = load_run(name)
    result = tune(snapshot, grid=None, configs=(), jobs=1, device_memory=run["total_memory"],
                  memory_fraction=run["fraction"], snapshot=snapshot)
    assert result.baseline.result.num_ooms == run["num_ooms"] == 1
    assert result.recorded_oom is not None and result.recorded_oom.count == 1


# -- hand-made traces: one oom entry ----------------------------------------------------------------

def trace_dict(entries, conf=""):
    return {"segments": [], "device_traces": [entries],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": conf}}


A = 0x7F0000000000


def one_oom_trace():
    """A 20 MiB segment with a 5 MiB block live, then a 30 MiB request that failed."""
    return trace_dict([
        {"action": "segment_alloc", "addr": A, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": A, "size": 5 * MiB, "stream": 0},
        {"action": "oom", "device_free": 5 * MiB, "size": 30 * MiB, "stream": 0},
        {"action": "free_requested", "addr": A, "size": 5 * MiB, "stream": 0},
        {"action": "free_completed", "addr": A, "size": 5 * MiB, "stream": 0},
    ])


def test_an_oom_request_that_does_not_fit_counts_an_oom_and_the_retry_before_it():
    result = replay(one_oom_trace(), device_memory=40 * MiB)
    assert (result.num_ooms, result.num_alloc_retries) == (1, 1)
    (req,) = result.oom_requests
    assert (req.index, req.size, req.stream, req.device_free, req.fits) == (2, 30 * MiB, 0, 5 * MiB, False)
    assert req.margin == (40 - 20 - 30) * MiB       # 20 MiB could be had, 30 MiB were asked
    assert (req.reserved, req.allocated, req.cached_free) == (20 * MiB, 5 * MiB, 15 * MiB)


def test_an_oom_request_that_fits_is_counted_fitting_with_its_spare_and_freed_at_once():
    result = replay(one_oom_trace(), device_memory=64 * MiB)
    assert result.num_ooms == 0
    (req,) = result.oom_requests
    assert req.fits and req.margin == (64 - 20 - 30) * MiB
    assert result.final_reserved == 50 * MiB       # its segment stays cached
    assert result.peak_allocated == 35 * MiB       # 5 MiB + the 30 MiB request, together


def test_oom_requests_are_only_measured_when_not_attempted():
    result = replay(one_oom_trace(), device_memory=64 * MiB, attempt_ooms=False)
    (req,) = result.oom_requests
    assert req.fits is None and result.num_device_alloc == 1


def test_recorded_oom_of_a_hand_made_trace_takes_the_lesser_bound():
    # reserved 20 MiB + a 30 MiB segment - 1, or reserved + 5 MiB free on the device: the latter.
    oom = recorded_oom(one_oom_trace())
    assert oom.limit == 25 * MiB and oom.segment_size == 30 * MiB
    assert replay(one_oom_trace(), device_memory=oom.device_memory).num_ooms == 1


def test_a_corrupt_oom_entry_is_a_snapshot_error_naming_index_and_field():
    snapshot = one_oom_trace()
    snapshot["device_traces"][0][2]["size"] = "big"
    with pytest.raises(SnapshotError, match=r"trace entry 2 \(oom\): size is str 'big'"):
        replay(snapshot)


def test_a_wrapped_trace_with_oom_entries_is_still_detected():
    snapshot = one_oom_trace()
    del snapshot["device_traces"][0][:2]           # the ring buffer dropped the oldest entries
    assert replay(snapshot, placement="fresh").wrapped


def test_segment_size_for_is_pytorchs_allocation_size():
    assert [segment_size_for(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 1)] \
        == [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]


# -- traces pyalloc records: the empty_cache / policy rule -------------------------------------------

def record(program, config="", total=GiB, fraction=None):
    """Run program(allocator) on a SimDevice with history on: (snapshot, memory_stats)."""
    alloc = CachingAllocator(0, backend=SimDevice(total, top_down=True), config=config)
    if fraction is not None:
        alloc.set_memory_fraction(fraction)
    alloc.record_memory_history(enabled="all", context=None, max_entries=10**6)
    program(alloc)
    stats = alloc.memory_stats()
    snapshot = alloc.snapshot()
    snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": config}
    return snapshot, stats


def assert_replays_exactly(snapshot, stats, **kwargs):
    result = replay(snapshot, **kwargs)
    got = {k: getattr(result, k) for k in ("peak_reserved", "peak_allocated", "num_device_alloc",
                                           "num_alloc_retries", "num_ooms")}
    want = {k: stats[s] for k, s in (("peak_reserved", "reserved_bytes.all.peak"),
                                     ("peak_allocated", "allocated_bytes.all.peak"),
                                     ("num_device_alloc", "num_device_alloc"),
                                     ("num_alloc_retries", "num_alloc_retries"),
                                     ("num_ooms", "num_ooms"))}
    assert got == want
    assert result.address_matches == result.allocations
    assert result.final_reserved == stats["reserved_bytes.all.current"]
    return result


def aged_cache(alloc):
    """Four cached unsplit large segments of different GC ages: 100, 100, 100 and 30 MiB,
    freed oldest first with cache-hitting mallocs (which advance the GC clock) in between."""
    a, b, c, d = (alloc.malloc(n * MiB) for n in (100, 100, 100, 30))
    alloc.free(d)
    alloc.free(a)
    for _ in range(5):
        alloc.free(alloc.malloc(30 * MiB))
    alloc.free(b)
    for _ in range(5):
        alloc.free(alloc.malloc(30 * MiB))
    alloc.free(c)


GC = dict(config="garbage_collection_threshold:0.5", total=GiB, fraction=0.5)   # GC above 256 MiB


def test_garbage_collection_frees_inside_a_malloc_are_replayed_by_the_policy():
    def program(alloc):
        aged_cache(alloc)
        alloc.malloc(150 * MiB)          # no cached block fits: GC frees the oldest, then a segment
    snapshot, stats = record(program, **GC)
    frees = [e for e in snapshot["device_traces"][0] if e["action"] == "segment_free"]
    assert 0 < len(frees) < 4                        # the GC freed some, not all
    result = assert_replays_exactly(snapshot, stats, device_memory=GiB, memory_fraction=0.5)
    assert result.empty_cache_calls == 0


def test_empty_cache_right_before_a_malloc_that_collects_is_a_call_when_it_frees_more():
    # The GC of the next malloc would free only the oldest segments; the window frees all four,
    # more than the policy can explain: an empty_cache() call.
    def program(alloc):
        aged_cache(alloc)
        alloc.empty_cache()
        alloc.malloc(150 * MiB)
    snapshot, stats = record(program, **GC)
    result = assert_replays_exactly(snapshot, stats, device_memory=GiB, memory_fraction=0.5)
    assert result.empty_cache_calls == 1


def test_empty_cache_followed_by_a_free_is_a_call():
    def program(alloc):
        keep = alloc.malloc(50 * MiB)
        alloc.free(alloc.malloc(100 * MiB))
        alloc.empty_cache()
        alloc.free(keep)
    snapshot, stats = record(program)
    assert assert_replays_exactly(snapshot, stats, device_memory=GiB).empty_cache_calls == 1


def test_empty_cache_before_a_malloc_the_cache_could_serve_is_a_call():
    # The policy never releases for a request a cached block serves, so the frees are a call.
    def program(alloc):
        small = alloc.malloc(4096)
        alloc.free(alloc.malloc(100 * MiB))
        alloc.free(small)
        alloc.empty_cache()              # frees both segments
        alloc.malloc(4096)               # a new small segment after all
    snapshot, stats = record(program)
    assert assert_replays_exactly(snapshot, stats, device_memory=GiB).empty_cache_calls == 1


def test_empty_cache_at_the_end_of_a_trace_is_a_call():
    def program(alloc):
        alloc.free(alloc.malloc(100 * MiB))
        alloc.empty_cache()
    snapshot, stats = record(program)
    result = assert_replays_exactly(snapshot, stats, device_memory=GiB)
    assert result.empty_cache_calls == 1 and result.final_reserved == 0


def test_the_flush_before_a_retry_is_the_policys():
    # 600 MiB device: 300 MiB cached, a 400 MiB request: the flush frees it, the retry succeeds.
    def program(alloc):
        keep = alloc.malloc(100 * MiB)
        alloc.free(alloc.malloc(300 * MiB))
        alloc.malloc(400 * MiB)
        alloc.free(keep)
    snapshot, stats = record(program, total=600 * MiB)
    assert stats["num_alloc_retries"] == 1
    result = assert_replays_exactly(snapshot, stats, device_memory=600 * MiB)
    assert result.empty_cache_calls == 0


def test_empty_cache_right_before_a_malloc_that_would_flush_counts_as_the_flush():
    # The ambiguous case: the trace of "empty_cache(); malloc" is the trace of a malloc whose
    # flush freed those segments and whose retry succeeded. The replay takes the policy's
    # reading: its figures are the run's, but for one allocation retry more.
    def program(alloc):
        keep = alloc.malloc(100 * MiB)
        alloc.free(alloc.malloc(300 * MiB))
        alloc.empty_cache()
        alloc.malloc(400 * MiB)
        alloc.free(keep)
    snapshot, stats = record(program, total=600 * MiB)
    assert stats["num_alloc_retries"] == 0
    result = replay(snapshot, device_memory=600 * MiB)
    assert result.empty_cache_calls == 0
    assert result.num_alloc_retries == 1
    assert (result.peak_reserved, result.num_device_alloc, result.address_matches) == (
        stats["reserved_bytes.all.peak"], stats["num_device_alloc"], result.allocations)


def test_the_max_split_size_release_inside_a_malloc_is_the_policys():
    # Two cached oversize segments (>= 64 MiB) that cannot serve a 120 MiB request (150 MiB is
    # 30 MiB too big, over max_non_split_rounding); on a 400 MiB device the release of oversize
    # blocks frees the 150 MiB one, then a new segment is made.
    def program(alloc):
        keep = alloc.malloc(100 * MiB)
        a, b = alloc.malloc(150 * MiB), alloc.malloc(80 * MiB)
        alloc.free(a)
        alloc.free(b)
        alloc.malloc(120 * MiB)
        alloc.free(keep)
    snapshot, stats = record(program, config="max_split_size_mb:64", total=400 * MiB)
    frees = [e for e in snapshot["device_traces"][0] if e["action"] == "segment_free"]
    assert len(frees) == 1
    result = assert_replays_exactly(snapshot, stats, device_memory=400 * MiB)
    assert result.empty_cache_calls == 0


def test_expandable_empty_cache_unmaps_are_replayed_as_calls():
    def program(alloc):
        for _ in range(3):
            blocks = [alloc.malloc(n * MiB) for n in (30, 50, 5)]
            for p in blocks:
                alloc.free(p)
            alloc.empty_cache()
    snapshot, stats = record(program, config="expandable_segments:True")
    unmaps = [e for e in snapshot["device_traces"][0] if e["action"] == "segment_unmap"]
    assert unmaps
    result = assert_replays_exactly(snapshot, stats, device_memory=GiB)
    assert result.empty_cache_calls == 3 and result.final_reserved == 0


def test_survived_ooms_replay_with_their_counts():
    def program(alloc):
        live = [alloc.malloc(60 * MiB) for _ in range(5)]
        for _ in range(3):
            with pytest.raises(OutOfMemoryError):
                alloc.malloc(200 * MiB)
        alloc.free(live.pop())
        alloc.free(live.pop())
        alloc.malloc(110 * MiB)
    snapshot, stats = record(program, total=GiB, fraction=0.4)
    assert stats["num_ooms"] == 3
    result = assert_replays_exactly(snapshot, stats, device_memory=GiB, memory_fraction=0.4)
    assert [r.fits for r in result.oom_requests] == [False, False, False]


def test_a_given_classification_replays_calls_only_where_it_says():
    def program(alloc):
        alloc.free(alloc.malloc(100 * MiB))
        alloc.empty_cache()
        alloc.free(alloc.malloc(100 * MiB))
    snapshot, _ = record(program)
    calls = classify_releases(snapshot, device_memory=GiB)
    assert len(calls) == 1
    assert replay(snapshot, empty_cache_calls=calls).final_reserved == 100 * MiB
    none = replay(snapshot, empty_cache_calls=[])
    assert (none.empty_cache_calls, none.num_device_alloc) == (0, 1)   # the cached block served


def test_another_setting_uses_the_own_settings_classification():
    def program(alloc):
        aged_cache(alloc)
        alloc.malloc(150 * MiB)
    snapshot, _ = record(program, **GC)
    # Under max_split_size_mb the GC is off; the trace's GC frees are still not calls.
    result = replay(snapshot, config="max_split_size_mb:256", placement="fresh",
                    device_memory=GiB, memory_fraction=0.5)
    assert result.empty_cache_calls == 0


# -- the memory fraction ------------------------------------------------------------------------------

def test_memory_fraction_caps_the_replay_at_floor_of_fraction_times_device():
    result = replay(one_oom_trace(), device_memory=1000 * MiB, memory_fraction=0.045)
    assert result.allowed_memory == int(0.045 * 1000 * MiB) and result.memory_fraction == 0.045
    assert result.num_ooms == 1      # 45 MiB allowed: 20 MiB held + a 30 MiB segment is too much


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (1.5, ValueError), ("0.5", TypeError),
                                        (True, TypeError)])
def test_a_bad_memory_fraction_is_refused_naming_it(bad, error):
    with pytest.raises(error, match="memory_fraction"):
        replay(one_oom_trace(), memory_fraction=bad)


# -- expandable reservations from the trace ----------------------------------------------------------

def test_traced_reservations_start_anew_after_a_segment_is_all_unmapped():
    page = 20 * MiB
    base = 0x200000000000
    entries = [
        {"action": "segment_map", "addr": base, "size": 2 * MiB, "stream": 0},        # small
        {"action": "segment_map", "addr": base + GiB, "size": page, "stream": 0},     # large
        {"action": "segment_map", "addr": base + GiB + page, "size": page, "stream": 0},
        {"action": "segment_unmap", "addr": base + GiB, "size": 2 * page, "stream": 0},
        {"action": "segment_map", "addr": base + 2 * GiB, "size": page, "stream": 0},  # anew
    ]
    bases = [b for b, _ in traced_reservations(entries, 8 * GiB)]
    assert bases == [base, base + GiB, base + 2 * GiB]


def test_a_completion_the_flush_waited_for_is_replayed_before_the_malloc():
    # Known limit: a block freed with a stream use (record_stream) completes when the flush
    # synchronizes, mid-ladder; its free_completed entry comes before the flush's segment frees,
    # and the replay frees it when it reads it, before the malloc. Here that block (250 MiB)
    # could serve the 200 MiB request, so the replay's malloc takes no flush and no retry: every
    # figure is the run's but for num_alloc_retries, one less. (Process_events completions at a
    # malloc's start look the same in a trace and must be freed before it.)
    sim = SimDevice(400 * MiB, top_down=True)
    alloc = CachingAllocator(0, backend=sim, config="")
    alloc.record_memory_history(enabled="all", context=None)
    side = sim.create_stream()
    keep = alloc.malloc(100 * MiB)
    x = alloc.malloc(250 * MiB)
    alloc.record_stream(x, side)
    sim.launch(side, 1)
    alloc.free(x)                    # waits for an event on `side`
    alloc.malloc(200 * MiB)          # 350 + 200 MiB > 400: the flush waits, frees x, retries
    stats = alloc.memory_stats()
    snapshot = alloc.snapshot()
    snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    assert stats["num_alloc_retries"] == 1 and keep
    result = replay(snapshot, device_memory=400 * MiB)
    assert result.num_alloc_retries == 0
    assert (result.peak_reserved, result.num_device_alloc, result.address_matches) == (
        stats["reserved_bytes.all.peak"], stats["num_device_alloc"], result.allocations)


# -- a fraction in the setting string is the run's fraction (issue 25, fidelity defect) -------------

def with_fraction_in_setting(run):
    """The run's setting with its memory fraction written into it as per_process_memory_fraction."""
    return f"{run['conf']},per_process_memory_fraction:{run['fraction']!r}"


@pytest.mark.parametrize("figure", FIGURES)
def test_fraction_in_the_setting_replays_the_gc_trace_as_memory_fraction_does(figure):
    # PyTorch applies per_process_memory_fraction at construction exactly as
    # set_per_process_memory_fraction: the segment frees are still the GC's, not empty_cache calls.
    snapshot, run = load_run("gc-fraction")
    result = replay(snapshot, config=with_fraction_in_setting(run), device_memory=run["total_memory"],
                    placement="recorded")
    assert getattr(result, figure) == run[figure]


def test_fraction_in_the_setting_puts_every_gc_trace_allocation_at_pytorchs_address():
    snapshot, run = load_run("gc-fraction")
    result = replay(snapshot, config=with_fraction_in_setting(run), device_memory=run["total_memory"],
                    placement="recorded")
    assert result.empty_cache_calls == 0
    assert result.address_matches == result.allocations == run["actions"]["alloc"]


def test_fit_with_the_fraction_in_the_setting_equals_fit_with_memory_fraction():
    from pyalloc.replay import fit_device_memory
    snapshot, run = load_run("gc-fraction")
    given = fit_device_memory(snapshot, config=run["conf"], memory_fraction=run["fraction"],
                              device_memory=run["total_memory"])
    in_setting = fit_device_memory(snapshot, config=with_fraction_in_setting(run),
                                   device_memory=run["total_memory"])
    assert in_setting == given
