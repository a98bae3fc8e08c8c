"""Specification of pyalloc.trace.Trace: one trace, read once, that replay, tune and view share.

Each command used to re-derive the trace's facts in every helper (a plain `pyalloc tune` of the
example built 38 allocators for its 19 replays, half of them only to ask whether a setting was
supported; `pyalloc replay` built 3 for one). These tests count what a command builds and reads:
allocators (CachingAllocator.__init__), replays (the replay loop, pyalloc.replay.replay_entries)
and checks of the trace (pyalloc.trace.scan_trace).
"""
from pathlib import Path

import pytest

import pyalloc.replay as replay_module
from pyalloc import __main__ as cli
from pyalloc import trace as trace_module
from pyalloc import tune as tune_module
from pyalloc.allocator import CachingAllocator
from pyalloc.replay import classify_releases, recorded_oom, replay
from pyalloc.snapshot import SnapshotError, load
from pyalloc.trace import Trace, as_trace

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "small_train.pickle.gz"          # no oom entries, no releases
OOM_TRACE = REPO / "tests" / "data" / "oom" / "oracle-default.pickle.gz"   # both
EXPANDABLE = REPO / "tests" / "data" / "resnet_train-expandable.pickle.gz"


@pytest.fixture
def counts(monkeypatch):
    """{"allocators", "replays", "scans"}: how many of each the code under test made."""
    seen = {"allocators": 0, "replays": 0, "scans": 0}
    init, loop, scan = CachingAllocator.__init__, replay_module.replay_entries, trace_module.scan_trace

    def counted_init(self, *args, **kwargs):
        seen["allocators"] += 1
        init(self, *args, **kwargs)

    def counted_loop(*args, **kwargs):
        seen["replays"] += 1
        return loop(*args, **kwargs)

    def counted_scan(*args, **kwargs):
        seen["scans"] += 1
        return scan(*args, **kwargs)

    monkeypatch.setattr(CachingAllocator, "__init__", counted_init)
    monkeypatch.setattr(replay_module, "replay_entries", counted_loop)
    monkeypatch.setattr(trace_module, "scan_trace", counted_scan)
    return seen


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    capsys.readouterr()
    assert rc == 0
    return rc


# -- what a command builds -----------------------------------------------------------------------

def test_tune_of_the_example_builds_one_allocator_per_replay(capsys, counts):
    # The baseline at the trace's addresses, the own setting fresh, and the 18 settings of the
    # default grid: 20 replays, one allocator each (38 before the Trace, with 17 settings).
    run(capsys, "tune", EXAMPLE, "--jobs", "1", "--json")
    assert counts["replays"] == len(tune_module.grid_settings("default")) + 2 == 20
    assert counts["allocators"] == counts["replays"]


def test_replay_of_the_example_builds_one_allocator(capsys, counts):
    run(capsys, "replay", EXAMPLE, "--json")
    assert counts["allocators"] == counts["replays"] == 1


def test_tune_checks_the_trace_once(capsys, counts):
    run(capsys, "tune", EXAMPLE, "--jobs", "1", "--json", "--config", "max_split_size_mb:64")
    assert counts["scans"] == 1


def test_replay_of_a_trace_with_a_recorded_oom_measures_it_once(capsys, counts):
    # One replay measures the OOM (at the trace's addresses, literally), one is the replay asked for.
    run(capsys, "replay", OOM_TRACE, "--json")
    assert counts["allocators"] == counts["replays"] == 2


def test_tune_html_replays_each_curve_without_checking_again(capsys, counts, tmp_path):
    run(capsys, "tune", EXAMPLE, "--jobs", "1", "--json", "--config", "max_split_size_mb:64",
        "--html", tmp_path / "t.html")
    assert counts["scans"] == 1


# -- what a Trace keeps ----------------------------------------------------------------------------

def test_recorded_oom_is_measured_once_per_trace(counts):
    trace = Trace.load(OOM_TRACE)
    first = recorded_oom(trace)
    assert recorded_oom(trace) is first
    assert counts["replays"] == 1


def test_recorded_oom_is_measured_per_memory_fraction(counts):
    trace = Trace.load(OOM_TRACE)
    recorded_oom(trace)
    recorded_oom(trace, memory_fraction=0.5)
    assert counts["replays"] == 2


def test_release_classification_is_made_once_per_device_size(counts):
    trace = Trace.load(OOM_TRACE)
    for _ in range(2):
        replay(trace, config="max_split_size_mb:64", placement="fresh")
    assert counts["replays"] == 1 + 2       # the classification (own setting), then the two replays


def test_release_classification_gives_each_caller_its_own_list():
    trace = Trace.load(OOM_TRACE)
    calls = classify_releases(trace)
    assert calls                                 # the trace has empty_cache() calls to lose
    calls.clear()
    assert classify_releases(trace)


def test_a_trace_checks_its_entries_once(counts):
    trace = Trace.load(EXAMPLE)
    for placement in ("recorded", "fresh"):
        replay(trace, placement=placement)
    assert counts["scans"] == 1


def test_an_unchecked_trace_is_checked_when_a_replay_places_its_segments(counts):
    trace = Trace.load(EXAMPLE, check=False)
    assert counts["scans"] == 0
    replay(trace, placement="recorded", check=False)
    assert counts["scans"] == 1


def test_a_corrupt_entry_is_reported_when_the_trace_is_made():
    snapshot = load(EXAMPLE)
    snapshot["device_traces"][0][5] = {"action": "alloc", "addr": "x", "size": 1}
    with pytest.raises(SnapshotError, match="device 0 trace entry 5 .*addr"):
        Trace(snapshot)


def test_a_trace_of_another_device_is_refused():
    with pytest.raises(ValueError, match="device 0's, but device=1"):
        as_trace(Trace.load(EXAMPLE), device=1)


def test_a_slim_trace_replays_expandable_segments_as_the_full_one():
    # A tune worker gets the slim trace: the final segments' placement fields are all it keeps.
    trace = Trace.load(EXPANDABLE)
    full, slim = (replay(t, placement="recorded").as_dict() for t in (trace, trace.slim()))
    for key in ("seconds", "events_per_second"):
        del full[key], slim[key]
    assert slim == full and full["address_matches"] == full["allocations"]


def test_a_slim_trace_holds_no_blocks():
    slim = Trace.load(EXPANDABLE).slim()
    assert slim.snapshot["segments"] and all("blocks" not in s for s in slim.snapshot["segments"])
