"""Replay and tune speed on the simulated device (issue 7's targets: >= 3,000,000 events/s counting
everything after the pickle is loaded; tune of an ~800,000-event trace over the default grid in
under 10 s on a 2-core machine, pickle load excluded; issue 14's: replay >= 5,000,000 events/s on
the 846k-event trace, tune --fit over the default grid on a real trace in under 60 s).

Run:  python -m pytest bench/bench_replay.py --benchmark-only
The 846,496-event trace is the GPT-2 training trace of tests/data repeated 16 times.
"""
import gzip
import pickle
from pathlib import Path

import pytest

from pyalloc.replay import replay
from pyalloc.tune import tune

OOM_TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "oom"   # their README

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data"   # tests/data/README.md


@pytest.fixture(scope="module")
def gpt2():
    return pickle.load(gzip.open(TRACES / "gpt2_train-default.pickle.gz"))


@pytest.fixture(scope="module")
def big_trace(gpt2):
    return {"segments": [], "device_traces": [gpt2["device_traces"][0] * 16],
            "allocator_settings": gpt2["allocator_settings"]}


def test_replay_recorded_placement(benchmark, gpt2):
    result = benchmark.pedantic(replay, args=(gpt2,), rounds=5, iterations=1)
    benchmark.extra_info["events_per_second"] = result.events_per_second
    assert result.address_matches == result.allocations


def test_replay_800k_events_fresh_placement(benchmark, big_trace):
    result = benchmark.pedantic(replay, args=(big_trace,), kwargs={"placement": "fresh"},
                                rounds=3, iterations=1)
    benchmark.extra_info["events"] = result.events
    benchmark.extra_info["events_per_second"] = result.events_per_second
    assert result.events == 16 * 52906


def test_tune_800k_events_default_grid_two_jobs(benchmark, big_trace):
    result = benchmark.pedantic(tune, args=(big_trace,), kwargs={"jobs": 2}, rounds=1, iterations=1)
    benchmark.extra_info["settings"] = len(result.rows)
    assert result.rows and all(r.result is not None for r in result.rows if not r.skipped)


def test_tune_fit_default_grid_two_jobs(benchmark, gpt2):
    # --fit: per setting, a bisection over replays for the smallest device that runs the trace.
    result = benchmark.pedantic(tune, args=(gpt2,), kwargs={"jobs": 2, "fit": True}, rounds=1,
                                iterations=1)
    benchmark.extra_info["settings"] = len(result.rows)
    assert all(r.fit_memory for r in result.rows)


def test_replay_of_a_trace_with_survived_ooms(benchmark):
    trace = pickle.load(gzip.open(OOM_TRACES / "tight-fraction.pickle.gz"))
    result = benchmark.pedantic(replay, args=(trace,), kwargs={
        "device_memory": 150109880320, "memory_fraction": 0.0013411948072359905},
        rounds=5, iterations=1)
    benchmark.extra_info["events_per_second"] = result.events_per_second
    assert result.num_ooms == 25


def stream_per_allocation_trace(allocations=50_000, nbytes=1 << 20):
    """A trace whose every allocation is on a stream of its own (issue 15: 100k such events once
    took 60 s to replay, where 5M ordinary events took 0.7 s)."""
    entries = []
    for i in range(allocations):
        addr, stream = 0x7F0000000000 + i * (2 << 20), 1000 + i
        for action in ("alloc", "free_requested", "free_completed"):
            entries.append({"action": action, "addr": addr, "size": nbytes, "stream": stream,
                            "frames": []})
    return {"segments": [], "device_traces": [entries]}


def test_replay_of_a_stream_per_allocation(benchmark):
    trace = stream_per_allocation_trace()
    result = benchmark.pedantic(replay, args=(trace,), kwargs={"placement": "fresh"}, rounds=5,
                                iterations=1)
    benchmark.extra_info["events_per_second"] = result.events_per_second
    assert result.allocations == 50_000 and result.num_device_alloc == 50_000
