"""Specification of the command line: `pyalloc replay` and `pyalloc tune` (pyalloc/__main__.py,
pyalloc/tune.py).

Real traces: examples/ (shipped, recorded with tools/record_example_trace.py, PyTorch's figures in
the .json beside each) and tests/data (GPT-2 and ResNet-50 runs, PyTorch's figures in
torch-peaks.jsonl; see tests/data/README.md). Both are in the repository, so every test here
runs in a plain clone. The rest runs on small synthetic traces built here.
"""
import argparse
import gzip
import io
import json
import pickle
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pyalloc import __main__ as cli
from pyalloc import tune as tune_module
from pyalloc.allocator import CachingAllocator
from pyalloc.config import CudaAllocatorConfig
from pyalloc.errors import format_bytes
from pyalloc.replay import looks_wrapped, replay, settings_key
from pyalloc.snapshot import load
from pyalloc._sim import SimDevice

from units import MiB, GiB
REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "tests" / "data"          # in the repository: a missing file fails, nothing skips
PEAKS_FILE = TRACES / "torch-peaks.jsonl"
PEAKS = [json.loads(line) for line in PEAKS_FILE.read_text().splitlines() if line.strip()]
RESNET = TRACES / "resnet_train-default.pickle.gz"
EXAMPLES = REPO / "examples"
EXAMPLE = EXAMPLES / "small_train.pickle.gz"
EXAMPLE_RUNS = sorted(EXAMPLES.glob("small_train*.pickle.gz"))

JSON_KEYS = {"peak_reserved", "peak_allocated", "peak_requested", "num_device_alloc", "num_ooms",
             "allocations", "address_matches", "events", "events_per_second"}
TIMING_KEYS = {"seconds", "events_per_second"}


# -- helpers --------------------------------------------------------------------------------------------

def synthetic_snapshot(seed=0, steps=600, conf=""):
    """A snapshot dict whose trace mixes small, medium and large allocations, freed in random
    order, on stream 0 (sizes chosen so that max_split_size and rounding change the figures)."""
    rng = random.Random(seed)
    entries, live = [], []
    next_addr = 1 << 40

    def event(action, addr, size):
        entries.append({"action": action, "addr": addr, "size": size, "stream": 0,
                        "time_us": len(entries), "compile_context": "N/A", "user_metadata": ""})

    for _ in range(steps):
        if live and rng.random() < 0.45:
            addr, size = live.pop(rng.randrange(len(live)))
            event("free_requested", addr, size)
            event("free_completed", addr, size)
        else:
            size = rng.choice((rng.randrange(1, MiB), rng.randrange(MiB, 64 * MiB),
                               rng.randrange(64 * MiB, 300 * MiB)))
            event("alloc", next_addr, size)
            live.append((next_addr, size))
            next_addr += 1 << 30
    return {"segments": [], "device_traces": [entries],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": conf}}


def write_snapshot(path, snapshot):
    with gzip.open(path, "wb", compresslevel=1) as f:     # level 9 costs seconds per suite run
        pickle.dump(snapshot, f)
    return str(path)


@pytest.fixture
def trace_file(tmp_path):
    return write_snapshot(tmp_path / "synthetic.pickle.gz", synthetic_snapshot())


def run(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv):
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out), err


def assert_one_line_error(rc, out, err, *fragments):
    assert rc == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pyalloc: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


def without_timings(d):
    return {k: v for k, v in d.items() if k not in TIMING_KEYS}


def run_cli(cwd, *argv):
    """`python -m pyalloc ARGV` in a subprocess, run in `cwd` (outside the source tree, so that a
    checkout's pyalloc/ does not shadow the installed package)."""
    return subprocess.run([sys.executable, "-m", "pyalloc", *map(str, argv)], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def assert_one_line_failure(proc, status, *fragments):
    """Exit status `status`, nothing on stdout, and stderr one `pyalloc: error:` line, no traceback."""
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pyalloc: error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def expandable_snapshot(seed=0, steps=300):
    """A snapshot pyalloc recorded under expandable_segments:True: its trace maps pages into the
    two pools' reservations, whose bases are in the final `segments`."""
    rng = random.Random(seed)
    alloc = CachingAllocator(0, backend=SimDevice(8 * GiB), config="expandable_segments:True")
    alloc.record_memory_history(context=None)
    live = []
    for _ in range(steps):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(alloc.malloc(rng.choice((rng.randrange(1, MiB), rng.randrange(MiB, 64 * MiB)))))
    snap = alloc.snapshot()
    snap["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return snap


# -- replay ---------------------------------------------------------------------------------------------

def test_replay_json_has_the_documented_keys(capsys, trace_file):
    data, _ = run_json(capsys, "replay", trace_file)
    assert JSON_KEYS <= data.keys()
    entries = synthetic_snapshot()["device_traces"][0]
    assert data["events"] == len(entries)
    assert data["allocations"] == sum(e["action"] == "alloc" for e in entries)
    assert data["events_per_second"] > 0


def test_replay_json_figures_are_those_of_the_library_replay(capsys, trace_file):
    data, _ = run_json(capsys, "replay", trace_file, "--config", "max_split_size_mb:64")
    expected = replay(trace_file, config="max_split_size_mb:64", placement="fresh").as_dict()
    for key in ("peak_reserved", "peak_allocated", "peak_requested", "num_device_alloc",
                "num_ooms", "allocations", "events"):
        assert data[key] == expected[key], key


@pytest.mark.parametrize("peaks", PEAKS, ids=lambda p: f"{p['workload']}-{p['tag']}")
def test_replay_recorded_placement_reproduces_torch_peaks(capsys, peaks):
    data, _ = run_json(capsys, "replay", TRACES / f"{peaks['workload']}-{peaks['tag']}.pickle.gz")
    assert data["placement"] == "recorded"
    assert data["config"] == peaks["conf"]
    for key in ("peak_reserved", "peak_allocated", "peak_requested", "num_device_alloc"):
        assert data[key] == peaks[key], key
    assert data["events"] == peaks["events"]
    assert data["allocations"] == peaks["actions"]["alloc"]
    assert data["address_matches"] == data["allocations"]
    assert data["num_ooms"] == 0


def example_peaks(trace):
    return json.loads(Path(str(trace)[:-len(".pickle.gz")] + ".json").read_text())


def test_examples_are_shipped():
    assert EXAMPLE.exists() and len(EXAMPLE_RUNS) == 3


@pytest.mark.parametrize("trace", EXAMPLE_RUNS, ids=lambda p: p.name)
def test_replay_of_shipped_example_reproduces_its_torch_peaks(capsys, trace):
    peaks = example_peaks(trace)
    data, err = run_json(capsys, "replay", trace)
    assert err == ""
    assert data["config"] == peaks["conf"]
    for key in ("peak_reserved", "peak_allocated", "peak_requested", "num_device_alloc"):
        assert data[key] == peaks[key], key
    assert data["events"] == peaks["events"]
    assert data["address_matches"] == data["allocations"] == peaks["actions"]["alloc"]


def test_tune_of_the_example_predicts_the_runs_under_other_settings(capsys):
    # The three example runs did the same allocations under different settings; tuning the
    # default run must give, for each other setting, the figures PyTorch had under it.
    others = [example_peaks(t) for t in EXAMPLE_RUNS if t != EXAMPLE]
    args = sum((["--config", p["conf"]] for p in others), [])
    data, _ = run_json(capsys, "tune", EXAMPLE, *args, "--jobs", "2")
    rows = {r["config"]: r for r in data["results"]}
    for peaks in others:
        for key in ("peak_reserved", "num_device_alloc"):
            assert rows[peaks["conf"]][key] == peaks[key], (peaks["conf"], key)


@pytest.mark.parametrize("workload", ["resnet_train", "gpt2_train"])
def test_tune_of_a_shared_default_trace_predicts_the_runs_under_other_settings(capsys, workload):
    # Each workload was run under several settings with the same requests; fresh (top-down)
    # placement must reproduce PyTorch's peak reserved bytes for the non-default runs.
    others = [p for p in PEAKS if p["workload"] == workload and p["conf"]]
    args = sum((["--config", p["conf"]] for p in others), [])
    data, _ = run_json(capsys, "tune", TRACES / f"{workload}-default.pickle.gz", *args, "--jobs", "2")
    rows = {r["config"]: r for r in data["results"]}
    for peaks in others:
        assert rows[peaks["conf"]]["peak_reserved"] == peaks["peak_reserved"], peaks["conf"]
        assert rows[peaks["conf"]]["num_device_alloc"] == peaks["num_device_alloc"], peaks["conf"]


def test_sim_top_down_places_new_segments_from_the_top_of_its_range():
    sim = SimDevice(GiB, base_address=1 << 44, top_down=True)
    alloc = CachingAllocator(0, backend=sim, config="")
    top = (1 << 44) + (1 << 40)
    a = alloc.malloc(30 * MiB)
    b = alloc.malloc(40 * MiB)
    assert sim.segments() == [(top - 30 * MiB - 40 * MiB, 40 * MiB), (top - 30 * MiB, 30 * MiB)]
    assert (a, b) == (top - 30 * MiB, top - 70 * MiB)
    alloc.free(a)
    alloc.empty_cache()              # the gap at the top is free again: a fitting segment goes there
    c = alloc.malloc(22 * MiB)
    assert c == top - 22 * MiB
    alloc.free(b)
    alloc.free(c)


def test_sim_default_placement_is_still_first_fit_from_the_base():
    sim = SimDevice(GiB, base_address=1 << 44)
    alloc = CachingAllocator(0, backend=sim, config="")
    assert alloc.malloc(30 * MiB) == 1 << 44


def test_replay_text_output_shows_every_figure(capsys):
    data, _ = run_json(capsys, "replay", RESNET)
    rc, out, err = run(capsys, "replay", RESNET)
    assert rc == 0 and err == ""
    for label, key in (("peak reserved", "peak_reserved"), ("peak allocated", "peak_allocated"),
                       ("peak requested", "peak_requested")):
        assert f"{data[key]:,} bytes" in next(l for l in out.splitlines() if l.startswith(label))
    assert f"{data['peak_reserved'] / data['peak_requested']:.4f}" in out
    assert f"device allocations:     {data['num_device_alloc']:,}" in out
    assert "out-of-memory events:   0" in out
    assert f"{data['allocations']:,} of {data['allocations']:,} allocations (100.00%)" in out
    assert "events/s" in out


def test_replay_under_another_setting_defaults_to_fresh_placement(capsys, trace_file):
    data, _ = run_json(capsys, "replay", trace_file, "--config", "roundup_power2_divisions:4")
    assert data["placement"] == "fresh"
    data, _ = run_json(capsys, "replay", trace_file)
    assert data["placement"] == "recorded"


def test_replay_placement_option_overrides_the_default(capsys, trace_file):
    data, _ = run_json(capsys, "replay", trace_file, "--placement", "fresh")
    assert data["placement"] == "fresh"


def test_replay_counts_ooms_against_the_device_memory(capsys, tmp_path):
    # Ten 30 MiB allocations never freed: each needs its own 30 MiB segment, so a device of
    # 3 x 30 MiB + 1 byte holds three and refuses the other seven.
    entries = [{"action": "alloc", "addr": (i + 1) << 32, "size": 30 * MiB, "stream": 0}
               for i in range(10)]
    path = write_snapshot(tmp_path / "t.pickle.gz", {"segments": [], "device_traces": [entries]})
    data, _ = run_json(capsys, "replay", path, "--device-memory", str(90 * MiB + 1))
    assert data["num_ooms"] == 7
    assert data["peak_reserved"] == 90 * MiB
    assert data["device_memory"] == 90 * MiB + 1


def test_replay_device_memory_accepts_units(capsys, tmp_path):
    entries = [{"action": "alloc", "addr": (i + 1) << 32, "size": 30 * MiB, "stream": 0}
               for i in range(10)]
    path = write_snapshot(tmp_path / "t.pickle.gz", {"segments": [], "device_traces": [entries]})
    data, _ = run_json(capsys, "replay", path, "--device-memory", "100MiB")
    assert data["device_memory"] == 100 * MiB
    assert data["num_ooms"] == 7
    data, _ = run_json(capsys, "replay", path, "--device-memory", "0.2GB")
    assert data["device_memory"] == 200_000_000
    assert data["num_ooms"] == 10 - 200_000_000 // (30 * MiB) == 4


def test_python_dash_m_pyalloc_runs_replay(trace_file, tmp_path):
    # Run outside the source tree: with `-m`, the current directory comes first on sys.path and
    # a checkout's pyalloc/ (no compiled modules) would shadow the installed package.
    proc = subprocess.run([sys.executable, "-m", "pyalloc", "replay", trace_file, "--json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["peak_reserved"] == replay(trace_file).peak_reserved


def test_help_exits_zero(capsys):
    rc, out, _ = run(capsys, "replay", "--help")
    assert rc == 0
    assert "--device-memory" in out and "GiB" in out


@pytest.mark.parametrize("argv", [["--help"], ["replay", "--help"], ["tune", "--help"]],
                         ids=["pyalloc", "replay", "tune"])
def test_help_documents_the_exit_statuses(capsys, argv):
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    table = out[out.index("exit statuses:"):]
    for status in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {status}" in table, status


def test_version_prints_pyalloc_and_its_version(tmp_path):
    import importlib.metadata
    import pyalloc
    proc = run_cli(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"pyalloc {pyalloc.__version__}\n"
    assert pyalloc.__version__ == importlib.metadata.version("pyalloc")


def test_replay_text_shows_allocation_retries(capsys, tmp_path):
    # On a 100 MiB device a freed 60 MiB segment stays cached; the 70 MiB request then fails at
    # the device, the cache is freed and the request retried: one retry, no out-of-memory event.
    entries = [{"action": "alloc", "addr": 1 << 32, "size": 60 * MiB, "stream": 0},
               {"action": "free_requested", "addr": 1 << 32, "size": 60 * MiB, "stream": 0},
               {"action": "free_completed", "addr": 1 << 32, "size": 60 * MiB, "stream": 0},
               {"action": "alloc", "addr": 2 << 32, "size": 70 * MiB, "stream": 0}]
    path = write_snapshot(tmp_path / "t.pickle.gz", {"segments": [], "device_traces": [entries]})
    data, _ = run_json(capsys, "replay", path, "--device-memory", "100MiB")
    assert (data["num_alloc_retries"], data["num_ooms"]) == (1, 0)
    rc, out, _ = run(capsys, "replay", path, "--device-memory", "100MiB")
    line = next(l for l in out.splitlines() if l.startswith("allocation retries:"))
    assert line.split()[2] == "1"


def test_dump_writes_the_replays_own_history(capsys, trace_file, tmp_path):
    # A timeline of the replay (what trace_plot draws), not only its final state.
    target = tmp_path / "replay.pickle"
    data, _ = run_json(capsys, "replay", trace_file, "--dump", target)
    dumped = load(target)
    events = dumped["device_traces"][0]
    actions = [e["action"] for e in events]
    replayed = synthetic_snapshot()["device_traces"][0]
    assert actions.count("alloc") == data["allocations"] == sum(e["action"] == "alloc" for e in replayed)
    assert actions.count("free_completed") == sum(e["action"] == "free_completed" for e in replayed)
    assert actions.count("segment_alloc") == data["num_device_alloc"] > 0
    ours = [e["size"] for e in events if e["action"] == "alloc"]
    assert ours == [e["size"] for e in replayed if e["action"] == "alloc"]
    assert sum(seg["total_size"] for seg in dumped["segments"]) == data["final_reserved"]


def test_dump_is_drawn_by_memory_viz_trace_plot(tmp_path, trace_file):
    pytest.importorskip("torch")
    target = tmp_path / "replay.pickle"
    assert run_cli(tmp_path, "replay", trace_file, "--dump", target).returncode == 0
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(target),
                           "-o", str(tmp_path / "replay.html")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "replay.html").stat().st_size > 0


def test_dump_of_a_real_trace_holds_pytorchs_events(tmp_path):
    target = tmp_path / "replay.pickle"
    proc = run_cli(tmp_path, "replay", RESNET, "--dump", target)
    assert proc.returncode == 0, proc.stderr
    ours = [(e["action"], e["addr"], e["size"], e["stream"]) for e in load(target)["device_traces"][0]]
    theirs = [(e["action"], e["addr"], e["size"], e["stream"]) for e in load(RESNET)["device_traces"][0]]
    assert ours == theirs


# -- errors ---------------------------------------------------------------------------------------------

def test_missing_file_is_one_line_error(capsys, tmp_path):
    missing = tmp_path / "nope.pickle.gz"
    for command in ("replay", "tune"):
        assert_one_line_error(*run(capsys, command, missing), str(missing), "No such file")


def test_file_that_is_not_a_snapshot_is_one_line_error(capsys, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a pickle at all\n")
    assert_one_line_error(*run(capsys, "replay", text), "is not a memory snapshot")
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    assert_one_line_error(*run(capsys, "tune", other), "is a pickle but not a memory snapshot")


@pytest.mark.parametrize("traces", [[], [[]]], ids=["no-device-traces", "empty-trace"])
def test_snapshot_without_trace_is_one_line_error(capsys, tmp_path, traces):
    # enabled="state" keeps segments but no trace; no history at all gives an empty list.
    path = write_snapshot(tmp_path / "state.pickle.gz", {"segments": [], "device_traces": traces})
    for command in ("replay", "tune"):
        assert_one_line_error(*run(capsys, command, path), "no allocator trace", "enabled='all'")


def test_bad_config_is_one_line_error_with_the_parser_message(capsys, trace_file):
    rc, out, err = run(capsys, "replay", trace_file, "--config", "max_split_size_mb:10")
    assert_one_line_error(rc, out, err, "--config", "max_split_size_mb too small, must be >= 20",
                          "at character 18")
    rc, out, err = run(capsys, "tune", trace_file, "--config", "roundup_power2_divisions:3")
    assert_one_line_error(rc, out, err, "--config", "has to be a power of 2")


def test_unparsable_own_setting_is_one_line_error_that_suggests_config(capsys, tmp_path):
    path = write_snapshot(tmp_path / "t.pickle.gz", synthetic_snapshot(conf="backend:cudaMallocAsync"))
    assert_one_line_error(*run(capsys, "replay", path), "the trace's own setting",
                          "cudaMallocAsync", "--config")


@pytest.mark.parametrize("value", ["80XB", "abc", "-5", "0", "0GiB", "1.5", "1e9", "80 XiB", ""])
def test_bad_device_memory_is_rejected(capsys, trace_file, value):
    rc, out, err = run(capsys, "replay", trace_file, "--device-memory", value)
    assert rc == 2 and out == ""
    assert "--device-memory" in err and repr(value) in err
    assert "Traceback" not in err


def test_dump_writes_the_real_snapshot_or_says_it_is_not_available(capsys, trace_file, tmp_path):
    from pyalloc import snapshot
    target = tmp_path / "final.pickle"
    rc, out, err = run(capsys, "replay", trace_file, "--dump", target, "--json")
    if hasattr(snapshot, "dump") and hasattr(CachingAllocator, "snapshot"):
        assert rc == 0, err
        data = json.loads(out)
        segments = load(target)["segments"]
        assert sum(seg["total_size"] for seg in segments) == data["final_reserved"] > 0
    else:
        assert_one_line_error(rc, out, err, "--dump is not available yet")
        assert not target.exists()


def test_dump_hands_the_replayed_allocator_to_snapshot_dump(capsys, trace_file, tmp_path, monkeypatch):
    # The wiring alone, with stand-ins for the snapshot writer: dump(allocator.snapshot(), PATH)
    # once, after the last event.
    from pyalloc import snapshot
    written = []
    monkeypatch.setattr(snapshot, "dump", lambda snap, path: written.append((snap, path)), raising=False)
    monkeypatch.setattr(CachingAllocator, "snapshot",
                        lambda self: {"reserved": self.memory_reserved(), "stats": self.memory_stats()},
                        raising=False)
    target = str(tmp_path / "final.pickle")
    data, _ = run_json(capsys, "replay", trace_file, "--dump", target)
    assert len(written) == 1
    snap, path = written[0]
    assert path == target and data["dumped"] == target
    assert snap["reserved"] == data["final_reserved"]
    assert snap["stats"]["reserved_bytes.all.peak"] == data["peak_reserved"]


def test_dump_into_a_missing_folder_is_one_line_error(capsys, trace_file, tmp_path, monkeypatch):
    from pyalloc import snapshot
    monkeypatch.setattr(snapshot, "dump", lambda snap, path: None, raising=False)
    monkeypatch.setattr(CachingAllocator, "snapshot", lambda self: {}, raising=False)
    assert_one_line_error(*run(capsys, "replay", trace_file, "--dump", tmp_path / "no" / "x.pickle"),
                          "does not exist")


CORRUPT = [("size", "big"), ("size", -5), ("size", 2**64 - 100), ("size", 2**60), ("addr", -1),
           ("addr", 2**64), ("stream", "s"), ("stream", -1)]


def corrupt_trace(tmp_path, field, value, index=3):
    snapshot = synthetic_snapshot()
    entries = snapshot["device_traces"][0]
    entries[index] = dict(entries[index], **{field: value})
    return write_snapshot(tmp_path / "corrupt.pickle.gz", snapshot)


@pytest.mark.parametrize("field, value", CORRUPT, ids=[f"{f}={v}" for f, v in CORRUPT])
def test_replay_of_a_corrupt_entry_is_one_line_error_naming_index_and_field(tmp_path, field, value):
    path = corrupt_trace(tmp_path, field, value)
    assert_one_line_failure(run_cli(tmp_path, "replay", path), 2, path, "trace entry 3", f" {field} ")


def test_tune_of_a_corrupt_entry_is_one_line_error_naming_index_and_field(tmp_path):
    path = corrupt_trace(tmp_path, "size", "big")
    assert_one_line_failure(run_cli(tmp_path, "tune", path, "--jobs", "2"), 2,
                            "trace entry 3", "size is str 'big'")


@pytest.mark.parametrize("placement", ["recorded", "fresh"])
def test_library_replay_refuses_sizes_of_2_to_the_60_and_more(tmp_path, placement):
    from pyalloc.snapshot import SnapshotError
    snapshot = synthetic_snapshot()
    snapshot["device_traces"][0][0]["size"] = 2**64 - 100
    with pytest.raises(SnapshotError, match=r"trace entry 0 \(alloc\): size 18446744073709551516 is out of range"):
        replay(snapshot, placement=placement)


@pytest.mark.parametrize("entry, message", [
    ([1, 2], "trace entry 1 is a list, expected a dict"),
    ({"addr": 1, "size": 2}, "trace entry 1 has no 'action'"),
    ({"action": "alloc", "size": 2}, "trace entry 1 (alloc) has no 'addr'"),
    ({"action": "segment_alloc", "addr": 1}, "trace entry 1 (segment_alloc) has no 'size'"),
    ({"action": "free_completed", "addr": 1, "size": 2.0, "stream": 0},
     "trace entry 1 (free_completed): size is float 2.0, expected an int number of bytes in [0, 2**60)"),
    ({"action": "segment_map", "addr": 1, "size": True, "stream": 0}, "size is bool True"),
])
def test_scan_trace_names_the_entry_and_the_field(entry, message):
    from pyalloc._replay import scan_trace
    good = {"action": "alloc", "addr": 1, "size": 2, "stream": 0}
    with pytest.raises(ValueError) as info:
        scan_trace([good, entry])
    assert message in str(info.value)


def test_scan_trace_accepts_the_largest_valid_values_and_skips_other_actions():
    from pyalloc._replay import scan_trace
    top = 2**64 - 1
    entries = [{"action": "segment_alloc", "addr": top, "size": 2**60 - 1, "stream": top},
               {"action": "segment_map", "addr": 0, "size": 0},      # no stream: stream 0
               {"action": "oom", "device_free": top, "size": 2**60 - 1, "stream": top},
               {"action": "oom", "addr": "anything", "size": 512},   # addr is not an oom field
               {"action": "snapshot", "addr": 0, "size": 2**70}]     # not read by the replay
    assert scan_trace(entries) == ([(top, 2**60 - 1)], [0])


@pytest.mark.parametrize("entry, message", [
    ({"action": "oom", "device_free": 0, "stream": 0}, "trace entry 1 (oom) has no 'size'"),
    ({"action": "oom", "size": -1}, "trace entry 1 (oom): size -1 is out of range"),
    ({"action": "oom", "size": 512, "stream": "s"}, "trace entry 1 (oom): stream is str 's'"),
    ({"action": "oom", "size": 512, "device_free": 1.5}, "trace entry 1 (oom): device_free is float 1.5"),
])
def test_scan_trace_checks_the_fields_of_oom_entries_the_replay_reads(entry, message):
    from pyalloc._replay import scan_trace
    good = {"action": "alloc", "addr": 1, "size": 2, "stream": 0}
    with pytest.raises(ValueError) as info:
        scan_trace([good, entry])
    assert message in str(info.value)


def test_tune_exits_nonzero_when_every_setting_failed(capsys, trace_file, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")
    monkeypatch.setattr(tune_module, "replay", broken)
    rc, out, err = run(capsys, "tune", trace_file, "--config", "max_split_size_mb:64", "--jobs", "1")
    assert rc == 1
    assert "failed  max_split_size_mb:64: RuntimeError: simulated failure" in out
    assert err.splitlines() == ["pyalloc: error: no setting could be replayed (3 failed, 0 skipped)"]


def test_device_the_trace_lacks_is_one_line_error_naming_the_devices_it_holds(tmp_path, trace_file):
    for command in ("replay", "tune"):
        assert_one_line_failure(run_cli(tmp_path, command, trace_file, "--device", "1"), 2,
                                "no allocator trace for device 1", "traces for device 0",
                                "--device 0")


def test_pickled_list_is_not_a_snapshot(tmp_path):
    path = tmp_path / "list.pickle"
    path.write_bytes(pickle.dumps([1, 2]))
    proc = run_cli(tmp_path, "replay", path)
    assert_one_line_failure(proc, 2, "is a pickle but not a memory snapshot", "a list of int")
    assert "'segments' is not a list" not in proc.stderr


def test_usage_error_is_one_line(tmp_path, trace_file):
    assert_one_line_failure(run_cli(tmp_path, "replay", trace_file, "--bogus"), 2, "--bogus")
    assert_one_line_failure(run_cli(tmp_path, "frobnicate"), 2, "frobnicate")


# -- wrapped traces -------------------------------------------------------------------------------------

def test_wrapped_synthetic_trace_replays_with_a_warning(capsys, tmp_path):
    snapshot = synthetic_snapshot()
    entries = snapshot["device_traces"][0]
    snapshot["device_traces"] = [entries[len(entries) // 3:]]
    assert looks_wrapped(snapshot["device_traces"][0])
    path = write_snapshot(tmp_path / "wrapped.pickle.gz", snapshot)
    data, err = run_json(capsys, "replay", path)
    assert data["wrapped"] is True
    assert "pyalloc: warning:" in err and "recorded window" in err
    assert data["events"] == len(snapshot["device_traces"][0])


def test_complete_trace_gives_no_warning(capsys, trace_file):
    data, err = run_json(capsys, "replay", trace_file)
    assert data["wrapped"] is False
    assert err == ""


def test_truncated_real_trace_warns_and_replays_the_window(capsys, tmp_path):
    snapshot = load(RESNET)
    entries = snapshot["device_traces"][0]
    window = entries[len(entries) // 2:]
    snapshot["device_traces"] = [window]
    path = write_snapshot(tmp_path / "wrapped.pickle.gz", snapshot)
    data, err = run_json(capsys, "replay", path)
    assert "recorded window" in err
    assert data["events"] == len(window)
    assert data["allocations"] == sum(e["action"] == "alloc" for e in window)
    rc, out, err = run(capsys, "tune", path, "--config", "max_split_size_mb:128", "--jobs", "1")
    assert rc == 0 and "recorded window" in err


# -- progress -------------------------------------------------------------------------------------------

class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_is_drawn_on_a_terminal(trace_file, monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROGRESS_DELAY_S", 0.0)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["replay", trace_file]) == 0
    assert "replay" in terminal.getvalue() and "ev" in terminal.getvalue()
    assert "peak reserved" in capsys.readouterr().out


def test_no_progress_bar_when_stderr_is_not_a_terminal(trace_file, monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROGRESS_DELAY_S", 0.0)
    rc, _, err = run(capsys, "tune", trace_file, "--config", "max_split_size_mb:64", "--jobs", "1")
    assert rc == 0 and err == ""


# -- sizes ----------------------------------------------------------------------------------------------

@given(st.integers(1, 10**6), st.sampled_from(sorted(cli.SIZE_UNITS)), st.booleans())
@settings(max_examples=200, deadline=None)
def test_parse_size_scales_by_the_unit(n, unit, upper):
    text = f"{n}{unit.upper() if upper else unit}"
    assert cli.parse_size(text) == n * cli.SIZE_UNITS[unit]


def test_parse_size_binary_and_decimal_units_differ():
    assert cli.parse_size("80GiB") == 80 * 2**30
    assert cli.parse_size("40GB") == 40 * 10**9
    assert cli.parse_size("512MiB") == 512 * 2**20
    assert cli.parse_size("1.5GiB") == 3 * 2**29
    assert cli.parse_size("85899345920") == 80 * 2**30


def test_device_memory_without_a_unit_below_a_mib_is_an_error_that_suggests_a_unit(tmp_path, trace_file):
    proc = run_cli(tmp_path, "replay", trace_file, "--device-memory", "80")
    assert_one_line_failure(proc, 2, "--device-memory", "'80'", "80GiB")
    assert run_cli(tmp_path, "replay", trace_file, "--device-memory", str(MiB)).returncode == 0


def test_parse_size_takes_decimals_with_a_unit_rounded_down_to_a_byte():
    assert cli.parse_size("13.7GiB") == 137 * 2**30 // 10
    assert cli.parse_size("0.5KiB") == 512
    assert cli.parse_size("1.0000001KB") == 1000


def test_parse_size_reads_a_bare_k_m_g_t_as_powers_of_1024():
    for letter, unit in zip("kmgt", ("KiB", "MiB", "GiB", "TiB")):
        assert cli.parse_size(f"80{letter}") == cli.parse_size(f"80{letter.upper()}") == cli.parse_size(f"80{unit}")
    assert cli.parse_size("13.7G") == cli.parse_size("13.7GiB")


def test_help_says_how_sizes_are_read(capsys):
    rc, out, _ = run(capsys, "tune", "--help")
    text = " ".join(out.split())
    assert "80G means 80GiB" in text and "at least 1 MiB (1048576)" in text


def test_every_size_option_is_read_by_parse_size():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sized = [(name, action) for name, sub in subparsers.choices.items() for action in sub._actions
             if action.metavar == "SIZE"]
    assert {name for name, _ in sized} == {"replay", "tune", "view"}
    assert all(action.type is cli._size_arg for _, action in sized)


@pytest.mark.parametrize("text", ["", "GiB", "1.5", "0.0001KB", "80 Gb ps", "12XB", "-1GiB", "0", "inf",
                                  str(2**64)])
def test_parse_size_rejects_with_the_text_named(text):
    with pytest.raises(ValueError) as info:
        cli.parse_size(text)
    assert repr(text) in str(info.value)


# -- tune -----------------------------------------------------------------------------------------------

SMALL_GRID = ["max_split_size_mb:64", "max_split_size_mb:256", "roundup_power2_divisions:4",
              "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"]


def table_rows(out):
    """The first line of each row of tune's table."""
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("#"))
    rows = []
    for line in lines[head + 2:]:
        if set(line) == {"-"}:
            break
        if line[:1].isdigit():
            rows.append(line)
    return rows


def table_setting_lines(out):
    """Each row's setting as tune's table shows it, a list of its lines (stripped): from the
    setting column, or, where the table puts settings under the figures, from the lines below."""
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("#"))
    named = re.match(r"#\s+setting\b", lines[head])     # ("own setting" names another column)
    col = named.end() - len("setting") if named else -1
    settings = []
    for line in lines[head + 2:]:
        if set(line) == {"-"}:
            break
        if line.startswith("-"):          # the divider above the settings that ran out of memory
            continue
        if col < 0:                       # settings under each row's figures
            if line[:1].isdigit():
                settings.append([])
            else:
                settings[-1].append(line.strip())
        elif line[:col].strip():
            settings.append([line[col:].split()[0]])
        else:
            settings[-1].append(line[col:].strip())
    return settings


def table_settings(out):
    """The settings of tune's table, in order, each row's lines joined."""
    return ["".join(parts) for parts in table_setting_lines(out)]


def tune_json(capsys, path, *extra):
    args = ["tune", path]
    for c in SMALL_GRID:
        args += ["--config", c]
    return run_json(capsys, *args, *extra)


def test_tune_table_is_sorted_by_peak_reserved(capsys, trace_file):
    data, _ = tune_json(capsys, trace_file, "--jobs", "1")
    peaks = [r["peak_reserved"] for r in data["results"]]
    assert peaks == sorted(peaks)
    assert len(set(peaks)) > 1            # the grid really changes the figures
    rc, out, _ = run(capsys, "tune", trace_file, *sum((["--config", c] for c in SMALL_GRID), []),
                     "--jobs", "1")
    assert table_settings(out) == [r["config"] or "(defaults)" for r in data["results"]]


def test_tune_rows_are_the_fresh_replays_of_each_setting(capsys, trace_file):
    data, _ = tune_json(capsys, trace_file, "--jobs", "1")
    assert {r["config"] for r in data["results"]} == set(SMALL_GRID) | {""}
    for row in data["results"]:
        expected = replay(trace_file, config=row["config"], placement="fresh")
        assert row["placement"] == "fresh"
        assert row["peak_reserved"] == expected.peak_reserved
        assert row["num_device_alloc"] == expected.num_device_alloc


def test_tune_baseline_is_the_own_setting_at_recorded_addresses(capsys, trace_file):
    data, _ = tune_json(capsys, trace_file, "--jobs", "1")
    baseline = data["baseline"]
    assert baseline["own"] and baseline["placement"] == "recorded"
    assert baseline["peak_reserved"] == replay(trace_file).peak_reserved
    own_fresh = next(r for r in data["results"] if r["own"])
    assert data["placement_effect"] == own_fresh["peak_reserved"] - baseline["peak_reserved"]


def test_tune_savings_are_against_the_own_setting_replayed_fresh(capsys, trace_file):
    data, _ = tune_json(capsys, trace_file, "--jobs", "1")
    own = next(r for r in data["results"] if r["own"])
    assert own["saving"] == 0
    for row in data["results"]:
        assert row["saving"] == own["peak_reserved"] - row["peak_reserved"]
        assert row["saving_fraction"] == pytest.approx(row["saving"] / own["peak_reserved"])


def test_tune_best_line_parses_and_names_the_lowest_oom_free_row(capsys, trace_file):
    data, _ = tune_json(capsys, trace_file, "--jobs", "1")
    best = min((r for r in data["results"] if r["num_ooms"] == 0),
               key=lambda r: (r["peak_reserved"], r["num_device_alloc"]))
    assert data["best"] == best["config"]
    rc, out, _ = run(capsys, "tune", trace_file, *sum((["--config", c] for c in SMALL_GRID), []),
                     "--jobs", "1")
    last = out.rstrip("\n").splitlines()[-1]
    assert last == data["best_line"]
    name, _, value = last.partition("=")
    assert name == "PYTORCH_CUDA_ALLOC_CONF"
    (unquoted,) = shlex.split(value) or [""]
    parsed = CudaAllocatorConfig(unquoted)
    assert parsed == CudaAllocatorConfig(best["config"])


def test_tune_best_line_quotes_list_settings_for_the_shell(capsys, trace_file):
    # '>' and '[' are shell syntax: the line must survive being pasted into a shell.
    data, _ = run_json(capsys, "tune", trace_file, "--config", "roundup_power2_divisions:[256:1,>:8]",
                       "--jobs", "1", "--device-memory", "1TiB")
    rows = {r["config"]: r for r in data["results"]}
    assert "roundup_power2_divisions:[256:1,>:8]" in rows
    line = tune_module.TuneResult.best_line(
        tune_module.TuneResult("t", 0, 1, 0, 0, False, "", None,
                               best=tune_module.TuneRow("roundup_power2_divisions:[256:1,>:8]",
                                                        "fresh", own=False)))
    assert line == "PYTORCH_CUDA_ALLOC_CONF='roundup_power2_divisions:[256:1,>:8]'"
    assert shlex.split(line.partition("=")[2]) == ["roundup_power2_divisions:[256:1,>:8]"]


def test_tune_jobs_1_and_2_give_the_same_results(capsys, trace_file):
    one, _ = tune_json(capsys, trace_file, "--jobs", "1")
    two, _ = tune_json(capsys, trace_file, "--jobs", "2")
    strip = lambda d: ([without_timings(r) for r in d["results"]], without_timings(d["baseline"]),
                       d["best_line"], d["skipped"], d["failed"])
    assert strip(one) == strip(two)


def test_tune_jobs_2_replays_expandable_segments_at_the_trace_addresses(capsys, tmp_path):
    # Workers need the final segments' expandable bases to place the reservations there.
    path = write_snapshot(tmp_path / "exp.pickle.gz", expandable_snapshot())
    one, _ = run_json(capsys, "tune", path, "--config", "max_split_size_mb:64", "--jobs", "1")
    two, _ = run_json(capsys, "tune", path, "--config", "max_split_size_mb:64", "--jobs", "2")
    assert two["baseline"]["address_matches"] == two["baseline"]["allocations"] > 0
    assert without_timings(two["baseline"]) == without_timings(one["baseline"])
    assert [without_timings(r) for r in two["results"]] == [without_timings(r) for r in one["results"]]


@pytest.mark.parametrize("workload", ["resnet_train", "gpt2_train"])
def test_tune_jobs_2_gives_the_figures_of_jobs_1_on_an_expandable_trace(tmp_path, workload):
    path = TRACES / f"{workload}-expandable.pickle.gz"
    outs = []
    for jobs in ("1", "2"):
        proc = run_cli(tmp_path, "tune", path, "--config", "max_split_size_mb:128", "--jobs", jobs, "--json")
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout))
    one, two = outs
    assert two["baseline"]["address_matches"] == two["baseline"]["allocations"]
    assert without_timings(two["baseline"]) == without_timings(one["baseline"])
    assert [without_timings(r) for r in two["results"]] == [without_timings(r) for r in one["results"]]


def test_tune_gpt2_on_a_14GB_device_ranks_a_setting_that_fits_first(capsys):
    path = TRACES / "gpt2_train-default.pickle.gz"
    data, _ = run_json(capsys, "tune", path, "--device-memory", "14GB", "--jobs", "2")
    ooms = [r["num_ooms"] for r in data["results"]]
    assert ooms[0] == 0 and any(ooms)
    fits = [n == 0 for n in ooms]
    assert fits == sorted(fits, reverse=True)        # every row that fits above every one that not
    assert [n for n in ooms if n] == sorted(n for n in ooms if n)    # then fewest OOMs first
    rc, out, _ = run(capsys, "tune", path, "--device-memory", "14GB", "--jobs", "2")
    rows = table_rows(out)
    assert not rows[0].split()[0].endswith("!")
    assert [r.split()[0].endswith("!") for r in rows] == [n > 0 for n in ooms]
    assert all(len(l) <= 100 for l in out.splitlines())


def test_tune_skips_a_repeat_of_the_own_setting(capsys, trace_file):
    data, _ = run_json(capsys, "tune", trace_file, "--config", "", "--config", "max_split_size_mb:64",
                       "--config", "max_split_size_mb:64,", "--jobs", "1")
    assert [r["config"] for r in data["results"]].count("") == 1
    assert sum(r["config"].startswith("max_split_size_mb:64") for r in data["results"]) == 1


# A setting pyalloc parses is one it replays (every setting of the grid, expandable segments
# included): the only row tune skips is an own setting that does not parse here.
UNPARSABLE_OWN = "backend:cudaMallocAsync"


def test_tune_text_lists_a_skipped_own_setting_and_ends_with_the_best_line(capsys, tmp_path):
    path = write_snapshot(tmp_path / "t.pickle.gz", synthetic_snapshot(conf=UNPARSABLE_OWN))
    rc, out, _ = run(capsys, "tune", path, *sum((["--config", c] for c in SMALL_GRID), []),
                     "--jobs", "1")
    assert rc == 0
    assert f"skipped {UNPARSABLE_OWN}: the trace's own setting is not valid here: " in out
    assert out.rstrip("\n").splitlines()[-1].startswith("PYTORCH_CUDA_ALLOC_CONF=")


def test_tune_with_an_unparsable_own_setting_still_ranks_the_others(capsys, tmp_path):
    path = write_snapshot(tmp_path / "t.pickle.gz", synthetic_snapshot(conf=UNPARSABLE_OWN))
    data, _ = tune_json(capsys, path, "--jobs", "1")
    assert data["baseline"]["skipped"]
    assert data["baseline"]["error"].startswith("the trace's own setting is not valid here: ")
    assert {r["config"] for r in data["results"]} == set(SMALL_GRID)
    assert all(r["saving"] is None for r in data["results"])
    assert data["best"] in SMALL_GRID


def one_alloc_trace(tmp_path, size):
    entries = [{"action": "alloc", "addr": 1 << 40, "size": size, "stream": 0}]
    return write_snapshot(tmp_path / "one.pickle.gz", {"segments": [], "device_traces": [entries]})


def test_tune_ranks_settings_that_fit_above_those_that_run_out_of_memory(capsys, tmp_path):
    # One 65 MiB request: by default a 66 MiB segment (2 MiB rounding); with
    # roundup_power2_divisions:2 it rounds to 96 MiB, more than an 80 MiB device holds. That
    # failed setting reserves nothing, the lowest peak, but it ranks below the one that fits.
    path = one_alloc_trace(tmp_path, 65 * MiB)
    data, _ = run_json(capsys, "tune", path, "--config", "roundup_power2_divisions:2",
                       "--device-memory", "80MiB", "--jobs", "1")
    first, second = data["results"]
    assert (first["config"], first["num_ooms"], first["peak_reserved"]) == ("", 0, 66 * MiB)
    assert (second["config"], second["num_ooms"], second["peak_reserved"]) == ("roundup_power2_divisions:2", 1, 0)
    assert data["best"] == "" and data["best_avoids_oom"] is True
    rc, out, _ = run(capsys, "tune", path, "--config", "roundup_power2_divisions:2",
                     "--device-memory", "80MiB", "--jobs", "1")
    assert table_settings(out) == ["(defaults)", "roundup_power2_divisions:2"]


def test_tune_table_marks_out_of_memory_rows_and_says_so_under_the_table(capsys, tmp_path):
    path = one_alloc_trace(tmp_path, 65 * MiB)
    rc, out, _ = run(capsys, "tune", path, "--config", "roundup_power2_divisions:2",
                     "--device-memory", "80MiB", "--jobs", "1")
    assert rc == 0
    rows = table_rows(out)
    assert [r.split()[0] for r in rows] == ["1*", "2!"]          # own setting; out of memory
    lines = out.splitlines()
    divider = next(i for i, l in enumerate(lines) if "ran out of memory on the 80.00 MiB device" in l)
    assert lines.index(rows[0]) < divider < lines.index(rows[1])
    note = next(l for l in lines if l.startswith(" !  "))
    assert "OUT OF MEMORY: 1 of 2 settings ran out of memory on the 80.00 MiB device" in note
    assert lines.index(note) > lines.index(rows[1])


def test_tune_table_has_no_out_of_memory_marks_when_every_setting_fits(capsys, trace_file):
    rc, out, _ = run(capsys, "tune", trace_file, "--config", "max_split_size_mb:64", "--jobs", "1")
    assert rc == 0
    assert "!" not in "".join(r.split()[0] for r in table_rows(out))
    assert "OUT OF MEMORY" not in out and "ran out of memory" not in out


def test_tune_report_lines_fit_100_columns(capsys, tmp_path):
    # The wide grid has the longest names (garbage_collection_threshold:...,per_process_...).
    path = write_snapshot(tmp_path / "t.pickle.gz", synthetic_snapshot(steps=200))
    rc, out, _ = run(capsys, "tune", path, "--grid", "wide", "--jobs", "1", "--device-memory", "2GiB")
    assert rc == 0
    assert "ran out of memory" in out          # the divider and the note fit too
    lines = out.rstrip("\n").splitlines()
    too_long = [l for l in lines[:-1] if len(l) > 100]
    assert too_long == []
    assert lines[-1].startswith("PYTORCH_CUDA_ALLOC_CONF=")   # never wrapped: it is pasted whole
    data, _ = run_json(capsys, "tune", path, "--grid", "wide", "--jobs", "1", "--device-memory", "2GiB")
    assert table_settings(out) == [r["config"] or "(defaults)" for r in data["results"]]


def test_tune_table_column_names_say_what_they_are(capsys, trace_file):
    rc, out, _ = run(capsys, "tune", trace_file, "--config", "max_split_size_mb:64", "--jobs", "1")
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("#"))
    top, names = lines[head - 1], lines[head]
    for above, below in (("peak", "reserved"), ("reserved/", "requested"), ("device", "allocs"),
                         ("vs the trace's", "own setting")):
        end = names.index(below) + len(below)
        assert top[:end].rstrip().endswith(above), (above, below)
    assert "OOMs" in names and "/requested" not in top + names


def test_tune_says_more_or_less_instead_of_a_negative_saving(capsys, trace_file):
    data, _ = tune_json(capsys, trace_file, "--jobs", "1")
    assert any(r["saving"] < 0 for r in data["results"])      # some setting reserves more
    rc, out, _ = run(capsys, "tune", trace_file, *sum((["--config", c] for c in SMALL_GRID), []),
                     "--jobs", "1")
    assert re.search(r"(^|[\s(])-[0-9]", out) is None, out
    rank, worse = next((i, r) for i, r in enumerate(data["results"]) if r["saving"] < 0)
    row = table_rows(out)[rank]
    assert f"{format_bytes(-worse['saving'])} more ({-worse['saving_fraction']:.1%})" in row


def test_tune_says_so_when_every_setting_runs_out_of_memory(capsys, tmp_path):
    path = one_alloc_trace(tmp_path, 65 * MiB)
    rc, out, _ = run(capsys, "tune", path, "--config", "roundup_power2_divisions:2",
                     "--device-memory", "10MiB", "--jobs", "1")
    assert rc == 0
    assert "every setting ran out of memory on the 10.00 MiB device" in out
    assert out.rstrip("\n").splitlines()[-1].startswith("PYTORCH_CUDA_ALLOC_CONF=")


def test_tune_device_memory_sets_the_simulated_device(capsys, trace_file):
    data, _ = run_json(capsys, "tune", trace_file, "--config", "max_split_size_mb:64",
                       "--device-memory", "512MiB", "--jobs", "1")
    assert data["device_memory"] == 512 * MiB
    expected = replay(trace_file, config="max_split_size_mb:64", placement="fresh",
                      device_memory=512 * MiB)
    row = next(r for r in data["results"] if r["config"] == "max_split_size_mb:64")
    assert row["num_ooms"] == expected.num_ooms > 0


def test_tune_real_trace_over_small_grid_ranks_and_matches_torch_baseline(capsys):
    data, _ = run_json(capsys, "tune", RESNET, "--config", "max_split_size_mb:128",
                       "--config", "roundup_power2_divisions:16", "--jobs", "2")
    peaks = next(p for p in PEAKS if p["workload"] == "resnet_train" and p["tag"] == "default")
    assert data["baseline"]["peak_reserved"] == peaks["peak_reserved"]
    assert [r["peak_reserved"] for r in data["results"]] == sorted(r["peak_reserved"] for r in data["results"])


# -- the grid -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid", tune_module.GRIDS)
def test_grid_settings_all_parse_and_are_distinct(grid):
    settings_list = tune_module.grid_settings(grid)
    keys = [settings_key(CudaAllocatorConfig(s)) for s in settings_list]
    assert len(set(keys)) == len(keys)
    assert settings_key(CudaAllocatorConfig("")) not in keys


@pytest.mark.parametrize("grid", tune_module.GRIDS)
def test_grid_covers_every_setting_family(grid):
    parsed = [CudaAllocatorConfig(s) for s in tune_module.grid_settings(grid)]
    default = CudaAllocatorConfig()
    assert any(p.max_split_size != default.max_split_size for p in parsed)
    single = [p for p in parsed if len(set(p.roundup_power2_divisions)) == 1
              and p.roundup_power2_divisions[0] > 0]
    listed = [p for p in parsed if len(set(p.roundup_power2_divisions)) > 1]
    assert single and listed
    assert any(p.max_non_split_rounding_size != default.max_non_split_rounding_size
               and p.max_split_size != default.max_split_size for p in parsed)
    gc = [p for p in parsed if p.garbage_collection_threshold > 0]
    assert gc and all(p.per_process_memory_fraction < 1.0 for p in gc)
    assert any(p.expandable_segments for p in parsed)


def test_grid_rejects_unknown_names():
    with pytest.raises(ValueError, match="'huge'"):
        tune_module.grid_settings("huge")


def test_expandable_settings_are_skipped_exactly_when_the_allocator_refuses_them(trace_file):
    try:
        CachingAllocator(0, backend=SimDevice(GiB), config="expandable_segments:True")
        supported = True
    except NotImplementedError:
        supported = False
    result = tune_module.tune(trace_file, grid=None, configs=["expandable_segments:True"], jobs=1)
    skipped = [r.config for r in result.skipped]
    assert ("expandable_segments:True" in skipped) == (not supported)
    assert any(r.config == "expandable_segments:True" for r in result.rows) == supported


def test_tune_rejects_bad_arguments_before_any_work(trace_file):
    with pytest.raises(ValueError, match="jobs"):
        tune_module.tune(trace_file, jobs=0)
    with pytest.raises(TypeError, match="list"):
        tune_module.tune(trace_file, configs="max_split_size_mb:64")
    from pyalloc.config import ConfigError
    with pytest.raises(ConfigError, match="nonsense"):
        tune_module.tune(trace_file, grid=None, configs=["nonsense:1"])


# -- issue 25: a fraction in --config is the run's fraction -------------------------------------------

def test_replay_derives_the_same_device_from_an_oom_whether_the_fraction_is_in_config_or_an_option(capsys):
    path = TRACES / "oom" / "tight-fraction.pickle.gz"
    fraction = json.loads((TRACES / "oom" / "tight-fraction.json").read_text())["fraction"]
    option, _ = run_json(capsys, "replay", path, "--memory-fraction", repr(fraction))
    in_config, _ = run_json(capsys, "replay", path, "--config", f"per_process_memory_fraction:{fraction!r}")
    assert in_config["device_memory_derived"] and option["device_memory_derived"]
    assert in_config["device_memory"] == option["device_memory"]


# -- issue 27: the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["oracle-max-split-size-mb-64", "gc-fraction"])
def test_replay_without_options_falls_back_to_fresh_placement_where_the_addresses_do_not_fit(capsys, name):
    data, err = run_json(capsys, "replay", TRACES / "oom" / f"{name}.pickle.gz")
    assert data["placement"] == "fresh"
    assert [line for line in err.splitlines() if "addresses do not fit" in line] != []
    assert "replayed with fresh placement" in err


def test_replay_asked_for_recorded_placement_still_refuses_addresses_that_do_not_fit(capsys):
    path = TRACES / "oom" / "oracle-max-split-size-mb-64.pickle.gz"
    rc, _, err = run(capsys, "replay", path, "--placement", "recorded")     # stdout: the recorded OOM
    assert rc == 2 and err.count("\n") == 1 and "try --placement fresh" in err


ORACLE_DEFAULT = TRACES / "oom" / "oracle-default.pickle.gz"


def tune_text(capsys, monkeypatch, columns, *argv):
    """tune's text report with $COLUMNS set to `columns` (None: unset)."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    rc, out, err = run(capsys, "tune", *argv, "--jobs", "1")
    assert rc == 0, err
    return out


def test_tune_fit_report_on_an_oom_trace_fits_100_columns_without_columns_set(capsys, monkeypatch):
    out = tune_text(capsys, monkeypatch, None, ORACLE_DEFAULT, "--fit")
    lines = out.rstrip("\n").splitlines()
    assert [l for l in lines[:-1] if len(l) > 100] == []


def test_tune_report_uses_the_room_columns_gives_it(capsys, monkeypatch):
    out = tune_text(capsys, monkeypatch, 170, ORACLE_DEFAULT, "--fit")
    lines = out.rstrip("\n").splitlines()
    assert [l for l in lines[:-1] if len(l) > 170] == []
    assert all(len(parts) == 1 for parts in table_setting_lines(out))      # room for every setting


@pytest.mark.parametrize("columns", [None, 120, 170])
def test_tune_table_breaks_settings_only_after_commas(capsys, monkeypatch, columns):
    out = tune_text(capsys, monkeypatch, columns, ORACLE_DEFAULT, "--fit")
    for parts in table_setting_lines(out):
        pieces = re.split(r"(?<=,)", "".join(parts))
        assert all(p.endswith(",") for p in parts[:-1]), parts
        assert len(parts) <= len(pieces)


def test_tune_fit_ranks_out_of_memory_rows_by_the_device_they_need(capsys):
    data, _ = run_json(capsys, "tune", ORACLE_DEFAULT, "--fit", "--jobs", "1")
    needs = [r["fit_memory"] for r in data["results"] if r["num_ooms"]]
    assert len(set(needs)) > 1
    assert needs == sorted(needs, key=lambda n: float("inf") if n is None else n)


def test_tune_report_says_1_byte_and_1_event_in_the_singular(capsys, monkeypatch):
    out = tune_text(capsys, monkeypatch, None, ORACLE_DEFAULT, "--fit")
    assert "no -1 byte " in out and "-1 bytes" not in out
    assert "1 OUT-OF-MEMORY event" in out and "1 OUT-OF-MEMORY events" not in out


def test_unknown_option_after_a_command_points_at_that_commands_help(capsys, trace_file):
    assert_one_line_error(*run(capsys, "replay", trace_file, "--bogus"),
                          "unrecognized arguments: --bogus", "(see pyalloc replay --help)")


def test_device_memory_of_zero_is_refused_without_suggesting_a_zero_size(capsys, trace_file):
    rc, out, err = run(capsys, "replay", trace_file, "--device-memory", "0")
    assert_one_line_error(rc, out, err, "at least one byte")
    assert "0GiB" not in err


def test_unknown_config_key_names_the_nearest_key_in_a_short_line(capsys, trace_file):
    rc, out, err = run(capsys, "replay", trace_file, "--config", "garbage")
    assert_one_line_error(rc, out, err, "did you mean 'garbage_collection_threshold'?")
    assert len(err) < 200 and "pinned_" not in err


def test_dump_into_a_folder_says_it_is_a_folder_as_o_does(capsys, trace_file, tmp_path):
    assert_one_line_error(*run(capsys, "replay", trace_file, "--dump", tmp_path),
                          "is a folder; give a file name")


def test_replay_report_lines_fit_100_columns(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    rc, out, err = run(capsys, "replay", ORACLE_DEFAULT)
    assert rc == 0, err
    assert [l for l in out.splitlines() if len(l) > 100] == []


def test_replay_says_1_byte_short_in_the_singular(capsys):
    rc, out, _ = run(capsys, "replay", ORACLE_DEFAULT)
    assert "1 byte short" in out and "1 bytes" not in out


def test_view_summary_lines_fit_100_columns(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    rc, out, err = run(capsys, "view", ORACLE_DEFAULT)
    assert rc == 0, err
    assert [l for l in out.splitlines() if len(l) > 100] == []


@pytest.mark.parametrize("ms, text", [(0.64, "640 us"), (2.456, "2.46 ms"), (999.0, "999.00 ms"),
                                      (2844.0, "2.844 s")])
def test_view_times_are_in_us_below_1_ms_ms_below_1_s_and_s_above(ms, text):
    from pyalloc.view import format_ms
    assert format_ms(ms) == text
