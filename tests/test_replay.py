"""Fidelity: replaying PyTorch's own traces reproduces PyTorch's figures and addresses.

tests/data holds allocator traces recorded with torch 2.11 on an H200 and, in
torch-peaks.jsonl, PyTorch's memory_stats() at the end of each run (tests/data/README.md). Replaying a trace through
pyalloc with the run's config must give the same peaks and device allocation count; with segments
placed at the trace's recorded addresses every allocation must land where PyTorch put it.
The traces are part of the repository; a missing file fails, nothing is skipped.
"""

import gzip
import json
import pickle
from pathlib import Path

import pytest

from pyalloc import replay
from pyalloc.config import ConfigError
from pyalloc.snapshot import SnapshotError

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "tests" / "data"
TAGS = ("default", "split128", "pow2div4")   # the non-expandable configurations


def torch_peaks():
    """{(workload, tag): PyTorch's figures} from torch-peaks.jsonl ({} if it is missing)."""
    path = TRACES / "torch-peaks.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(row["workload"], row["tag"]): row for row in rows}


def trace_files():
    return sorted(p for tag in TAGS for p in TRACES.glob(f"*-{tag}.pickle.gz"))


def workload_and_tag(path):
    workload, _, tag = path.name[:-len(".pickle.gz")].rpartition("-")
    return workload, tag


TRACE_FILES = trace_files()
PEAKS = torch_peaks()


def test_trace_folder_holds_traces_and_peaks_for_every_config():
    assert TRACES.is_dir(), f"trace folder {TRACES} is missing (it is part of the repository)"
    assert PEAKS, f"{TRACES / 'torch-peaks.jsonl'} is missing or empty"
    for tag in TAGS:
        assert any(workload_and_tag(p)[1] == tag for p in TRACE_FILES), f"no '{tag}' trace"
    for path in TRACE_FILES:
        assert workload_and_tag(path) in PEAKS, f"no torch-peaks.jsonl line for {path.name}"


@pytest.fixture(scope="module", params=TRACE_FILES, ids=lambda p: p.name[:-len(".pickle.gz")])
def recorded(request):
    """(PyTorch's figures, the replay with recorded placement and the run's own config)."""
    expected = PEAKS[workload_and_tag(request.param)]
    return expected, replay(request.param, config=expected["conf"], placement="recorded")


def test_replay_reproduces_peak_reserved(recorded):
    expected, result = recorded
    assert result.peak_reserved == expected["peak_reserved"]


def test_replay_reproduces_peak_allocated(recorded):
    expected, result = recorded
    assert result.peak_allocated == expected["peak_allocated"]


def test_replay_reproduces_peak_requested(recorded):
    expected, result = recorded
    assert result.peak_requested == expected["peak_requested"]


def test_replay_reproduces_num_device_alloc(recorded):
    expected, result = recorded
    assert result.num_device_alloc == expected["num_device_alloc"]


def test_replay_reproduces_final_reserved_and_retries(recorded):
    expected, result = recorded
    assert result.final_reserved == expected["final_reserved"]
    assert result.num_alloc_retries == expected["num_alloc_retries"]
    assert result.num_ooms == 0


def test_replay_lands_every_allocation_at_pytorchs_address(recorded):
    expected, result = recorded
    assert result.allocations == expected["actions"]["alloc"]
    assert result.address_matches == result.allocations


def test_replay_reports_the_config_it_used(recorded):
    expected, result = recorded
    assert result.config == expected["conf"]
    assert result.placement == "recorded"
    assert result.wrapped is False


# Fresh placement (the simulated device places segments itself, top-down from base + 1 TiB as the
# driver tends to) need not give PyTorch's figures exactly: best fit breaks ties between equal
# blocks by address, so other addresses can mean other choices. Measured on these traces: every
# figure exact except gpt2_train-default's peak reserved, 0.028% low (first-fit placement, the
# earlier default, was off by up to 2.93% and by 2 of 148 device allocations). What placement
# cannot change is tested exactly; peak reserved within 0.1%, the rest exactly.

def shifted(snapshot, offset):
    """The snapshot with every address in its trace moved by `offset` bytes (order unchanged)."""
    moved = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"}
    out = dict(snapshot)
    out["device_traces"] = [[dict(e, addr=e["addr"] + offset) if e["action"] in moved else e
                             for e in trace] for trace in snapshot["device_traces"]]
    return out


def load_snapshot(path):
    return pickle.loads(gzip.decompress(path.read_bytes()))


@pytest.fixture(scope="module", params=TRACE_FILES, ids=lambda p: p.name[:-len(".pickle.gz")])
def fresh(request):
    """(PyTorch's figures, the replay with fresh placement and the run's own config)."""
    expected = PEAKS[workload_and_tag(request.param)]
    return expected, replay(request.param, config=expected["conf"], placement="fresh")


def test_fresh_placement_replays_every_allocation(fresh):
    expected, result = fresh
    assert result.placement == "fresh"
    assert result.allocations == expected["actions"]["alloc"]
    assert result.num_ooms == 0


def test_fresh_placement_gives_the_same_peak_requested(fresh):
    # Requested bytes follow the trace's sizes alone, whatever blocks serve them.
    expected, result = fresh
    assert result.peak_requested == expected["peak_requested"]


def test_fresh_placement_reproduces_pytorchs_peaks_closely(fresh):
    expected, result = fresh
    assert result.peak_reserved == pytest.approx(expected["peak_reserved"], rel=0.001)
    assert result.peak_allocated == expected["peak_allocated"]
    assert result.num_device_alloc == expected["num_device_alloc"]


@pytest.mark.parametrize("path", TRACE_FILES, ids=lambda p: p.name[:-len(".pickle.gz")])
def test_fresh_placement_is_deterministic(path):
    conf = PEAKS[workload_and_tag(path)]["conf"]
    first, second = (replay(path, config=conf, placement="fresh").as_dict() for _ in range(2))
    for result in (first, second):
        del result["seconds"], result["events_per_second"]
    assert first == second


@pytest.mark.parametrize("path", TRACE_FILES, ids=lambda p: p.name[:-len(".pickle.gz")])
def test_placement_in_the_same_address_order_gives_the_same_figures(path):
    # Only the order of addresses steers decisions: the recorded placement moved far down
    # (below every recorded address) reproduces PyTorch's figures and relative addresses.
    expected = PEAKS[workload_and_tag(path)]
    result = replay(shifted(load_snapshot(path), -(1 << 46)), config=expected["conf"])
    assert (result.peak_reserved, result.peak_allocated, result.num_device_alloc) == (
        expected["peak_reserved"], expected["peak_allocated"], expected["num_device_alloc"])
    assert result.address_matches == result.allocations


@pytest.mark.parametrize("path", TRACE_FILES[:1], ids=lambda p: p.name[:-len(".pickle.gz")])
def test_replay_defaults_to_the_traces_own_config(path):
    # config=None reads allocator_settings["PYTORCH_CUDA_ALLOC_CONF"] from the snapshot.
    expected = PEAKS[workload_and_tag(path)]
    result = replay(path)
    assert result.config == expected["conf"]
    assert result.peak_reserved == expected["peak_reserved"]


def test_replay_accepts_a_snapshot_dict():
    path = TRACE_FILES[0]
    expected = PEAKS[workload_and_tag(path)]
    result = replay(load_snapshot(path), config=expected["conf"])
    assert result.address_matches == result.allocations == expected["actions"]["alloc"]


def test_pyalloc_replay_is_the_module_of_that_name():
    # The package's attribute used to be the function, which hid the module: `import
    # pyalloc.replay as m` gave the function and pyalloc.replay.recorded_oom did not exist.
    import sys

    import pyalloc
    import pyalloc.replay as module
    assert module is sys.modules["pyalloc.replay"] is pyalloc.replay
    assert pyalloc.replay.recorded_oom is module.recorded_oom


def test_calling_pyalloc_replay_replays():
    # README: `pyalloc.replay(path_or_snapshot, config=None, ...)`.
    import pyalloc
    result = pyalloc.replay(small_snapshot(), placement="fresh")
    assert isinstance(result, pyalloc.replay.ReplayResult)
    assert (result.placement, result.peak_allocated) == ("fresh", 1024 + 4096)


# ------------------------------------------------------------------------------ bad input

def small_snapshot():
    """A hand-made snapshot: two allocations, one freed, in one 2 MiB segment."""
    base = 0x7F0000000000
    trace = [
        {"action": "segment_alloc", "addr": base, "size": 2 << 20, "stream": 0},
        {"action": "alloc", "addr": base, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": base + 1024, "size": 4096, "stream": 0},
        {"action": "free_requested", "addr": base, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": base, "size": 1000, "stream": 0},
    ]
    return {"segments": [], "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def test_replay_of_a_hand_made_snapshot():
    result = replay(small_snapshot())
    assert (result.allocations, result.address_matches) == (2, 2)
    assert result.peak_allocated == 1024 + 4096
    assert result.peak_requested == 1000 + 4096
    assert result.num_device_alloc == 1


@pytest.mark.parametrize("placement", ["bogus", "", None, "Recorded"])
def test_unknown_placement_is_rejected(placement):
    with pytest.raises(ValueError) as info:
        replay(small_snapshot(), placement=placement)
    assert repr(placement) in str(info.value)
    assert "recorded" in str(info.value) and "fresh" in str(info.value)


def test_non_snapshot_file_is_rejected(tmp_path):
    path = tmp_path / "notes.pickle"
    path.write_text("this is not a pickle\n")
    with pytest.raises(SnapshotError) as info:
        replay(path)
    assert str(path) in str(info.value)


def test_pickle_that_is_not_a_snapshot_is_rejected(tmp_path):
    path = tmp_path / "numbers.pickle"
    path.write_bytes(pickle.dumps({"numbers": [1, 2, 3]}))
    with pytest.raises(SnapshotError, match="not a memory snapshot"):
        replay(path)


def test_missing_file_is_rejected(tmp_path):
    path = tmp_path / "absent.pickle.gz"
    with pytest.raises(SnapshotError) as info:
        replay(path)
    assert str(path) in str(info.value)


def test_snapshot_without_traces_is_rejected(tmp_path):
    path = tmp_path / "state_only.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    with pytest.raises(SnapshotError, match="no allocator trace"):
        replay(path)


def test_snapshot_with_an_empty_trace_is_rejected():
    snapshot = {"segments": [], "device_traces": [[]]}
    with pytest.raises(SnapshotError, match="no allocator trace for device 0"):
        replay(snapshot)


def test_snapshot_without_the_requested_device_is_rejected():
    with pytest.raises(SnapshotError, match="device 1"):
        replay(small_snapshot(), device=1)


def test_bad_config_string_is_rejected():
    with pytest.raises(ConfigError):
        replay(small_snapshot(), config="max_split_size_mb:banana")
