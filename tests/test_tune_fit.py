"""`tune` on a trace with a recorded OOM (the request per setting, the derived limit) and
`--fit` (the smallest device memory that runs the whole trace without an out-of-memory)."""
import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from pyalloc.__main__ import main
from pyalloc.replay import (allowed_bytes, classify_releases, fit_device_memory, recorded_oom,
                            replay)
from pyalloc import tune as tune_module
from pyalloc.tune import format_report, tune

from units import MiB
DATA = Path(__file__).resolve().parent / "data"
TIGHT = DATA / "oom" / "tight-fraction.pickle.gz"
ORACLE = DATA / "oom" / "oracle-default.pickle.gz"


def run_json(path):
    return json.loads((DATA / "oom" / f"{path}.json").read_text())


def runs_without_oom(snapshot, config, size, fraction=None):
    """A replay as fit_device_memory makes them: fresh placement, and the segment frees the
    trace's own run made as empty_cache() calls (classified on the limit its OOM implies)."""
    calls = classify_releases(snapshot, memory_fraction=fraction,
                              device_memory=recorded_oom(snapshot, memory_fraction=fraction).device_memory)
    return replay(snapshot, config=config, placement="fresh", device_memory=size,
                  memory_fraction=fraction, empty_cache_calls=calls).num_ooms == 0


@pytest.fixture(scope="module")
def tight():
    return pickle.load(gzip.open(TIGHT))


# -- fit_device_memory ---------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["", "expandable_segments:True", "max_split_size_mb:64"])
def test_fit_is_a_2_mib_multiple_that_runs_and_2_mib_less_does_not(tight, config):
    size = fit_device_memory(tight, config=config)
    assert size % (2 * MiB) == 0
    assert runs_without_oom(tight, config, size)
    assert not runs_without_oom(tight, config, size - 2 * MiB)


def test_fit_of_the_tight_trace_is_above_the_cap_it_ran_out_under(tight):
    # The run ran out of memory 25 times under its 192 MiB cap: the whole trace needs more.
    assert fit_device_memory(tight) > run_json("tight-fraction")["allowed"]


def test_fit_under_a_fraction_is_the_device_whose_limit_runs_it(tight):
    fraction = 0.5
    size = fit_device_memory(tight, memory_fraction=fraction)
    assert runs_without_oom(tight, "", size, fraction)
    assert not runs_without_oom(tight, "", size - 2 * MiB, fraction)
    plain = fit_device_memory(tight)
    assert abs(allowed_bytes(size, fraction) - plain) <= 2 * MiB


def test_fit_is_none_when_even_the_ceiling_runs_out(tight):
    assert fit_device_memory(tight, ceiling=64 * MiB) is None


def test_fit_of_a_real_training_trace():
    path = DATA / "gpt2_train-default.pickle.gz"
    snapshot = pickle.load(gzip.open(path))
    size = fit_device_memory(snapshot)
    fits = [replay(snapshot, placement="fresh", device_memory=n, empty_cache_calls=[]).num_ooms == 0
            for n in (size, size - 2 * MiB)]
    assert fits == [True, False]
    # It fits below its peak reserved: the ladder frees cached blocks where memory is short.
    assert replay(snapshot).peak_allocated <= size <= replay(snapshot).peak_reserved


# -- tune on a trace with a recorded OOM ---------------------------------------------------------------

def test_tune_without_device_memory_uses_the_limit_the_oom_implies(tight):
    result = tune(tight, grid=None, configs=["expandable_segments:True"], jobs=1, snapshot=tight)
    oom = recorded_oom(tight)
    assert result.device_memory_derived and result.device_memory == oom.device_memory
    assert result.baseline.result.num_ooms == run_json("tight-fraction")["num_ooms"]


def test_tune_with_device_memory_does_not_derive(tight):
    result = tune(tight, grid=None, configs=(), jobs=1, device_memory=80 << 30, snapshot=tight)
    assert not result.device_memory_derived and result.device_memory == 80 << 30
    assert result.recorded_oom is not None


def test_tune_rows_say_whether_the_recorded_request_fits_and_by_how_much(tight):
    result = tune(tight, grid="default", jobs=2, snapshot=tight)
    for row in result.rows:
        req = row.recorded_oom_request
        assert req.index == result.recorded_oom.index and req.fits is not None
        assert (req.margin >= 0) == req.fits


def test_tune_report_says_the_recorded_oom_first(tight):
    result = tune(tight, grid=None, configs=["max_split_size_mb:64"], jobs=1, snapshot=tight)
    report = format_report(result)
    assert report.startswith(f"RECORDED OUT OF MEMORY at event {result.recorded_oom.index:,}")
    assert "No --device-memory given: the OOM bounds the limit" in report
    assert "recorded OOM" in report


def test_tune_fit_adds_a_figure_per_setting(tight):
    result = tune(tight, grid=None, configs=["expandable_segments:True", "max_split_size_mb:64"],
                  jobs=2, snapshot=tight, fit=True)
    for row in result.rows:
        assert row.fit_memory == fit_device_memory(tight, config=row.config)
    data = result.as_dict()
    assert all(r["fit_memory"] for r in data["results"]) and data["fit"]


def test_tune_fit_under_a_fraction_reports_the_limit_in_json():
    snapshot = pickle.load(gzip.open(ORACLE))
    run = run_json("oracle-default")
    result = tune(snapshot, grid=None, configs=["expandable_segments:True"], jobs=1, fit=True,
                  device_memory=run["total_memory"], memory_fraction=run["fraction"], snapshot=snapshot)
    data = result.as_dict()
    for r in data["results"]:
        assert r["fit_allowed"] == int(run["fraction"] * float(r["fit_memory"]))
    assert "fits under" in format_report(result)


# -- the command line ------------------------------------------------------------------------------------

def test_cli_replay_says_the_recorded_oom_first(capsys):
    assert main(["replay", str(TIGHT)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("RECORDED OUT OF MEMORY at event ")
    assert "(the limit the recorded OOM implies)" in out
    assert "recorded OOM's request: out of memory again" in out


def test_cli_replay_with_the_runs_memory_gives_pytorchs_counts(capsys):
    run = run_json("tight-fraction")
    assert main(["replay", str(TIGHT), "--json", "--device-memory", str(run["total_memory"]),
                 "--memory-fraction", repr(run["fraction"])]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["num_ooms"], data["num_alloc_retries"]) == (run["num_ooms"], run["num_alloc_retries"])
    assert data["allowed_memory"] == run["allowed"] and not data["device_memory_derived"]
    assert data["recorded_oom"]["count"] == run["num_ooms"]


@pytest.mark.parametrize("bad", ["0", "1.5", "half", "-0.2"])
def test_cli_a_bad_memory_fraction_is_a_one_line_error(capsys, bad):
    assert main(["replay", str(TIGHT), "--memory-fraction", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory-fraction" in err and "(0, 1]" in err


def test_cli_tune_fit_json(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "pyalloc", "tune", str(TIGHT), "--fit", "--json",
                           "--config", "expandable_segments:True", "--jobs", "2"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["device_memory_derived"] and data["recorded_oom"]["count"] == 25
    assert all(r["fit_memory"] > 0 for r in data["results"])


def test_cli_replay_warns_when_the_gc_setting_has_no_fraction(capsys):
    path = DATA / "oom" / "gc-fraction.pickle.gz"
    assert main(["replay", str(path), "--placement", "fresh", "--json"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass that fraction as --memory-fraction" in err
    run = run_json("gc-fraction")
    assert main(["replay", str(path), "--json", "--device-memory", str(run["total_memory"]),
                 "--memory-fraction", repr(run["fraction"])]) == 0
    assert capsys.readouterr().err == ""


def test_tune_report_notes_a_gc_setting_without_fraction():
    snapshot = pickle.load(gzip.open(DATA / "oom" / "gc-fraction.pickle.gz"))
    result = tune(snapshot, grid=None, configs=(), jobs=1, snapshot=snapshot)
    assert "pass that fraction as --memory-fraction" in format_report(result)


# -- Ctrl-C (issue 27) ---------------------------------------------------------------------------------

def long_fit_trace(path, events=600_000):
    """A trace whose --fit bisections take seconds each: many allocations of up to 64 MiB, at
    most 300 live, freed in random order."""
    import random
    rng = random.Random(0)
    entries, live, addr = [], [], 1 << 40

    def event(action, a, size):
        entries.append({"action": action, "addr": a, "size": size, "stream": 0,
                        "time_us": len(entries), "compile_context": "N/A", "user_metadata": ""})

    while len(entries) < events:
        if live and (rng.random() < 0.5 or len(live) > 300):
            a, size = live.pop(rng.randrange(len(live)))
            event("free_requested", a, size)
            event("free_completed", a, size)
        else:
            size = rng.choice((rng.randrange(1, MiB), rng.randrange(MiB, 64 * MiB)))
            event("alloc", addr, size)
            live.append((addr, size))
            addr += 1 << 30
    # A plain pickle: gzip's default level took 5.3 of the fixture's 6.8 s (26 MB), and what the
    # test times is the run's exit, not the file's reading.
    with open(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [entries],
                     "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}, f)
    return path


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory):
    return long_fit_trace(tmp_path_factory.mktemp("long") / "long.pickle")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs POSIX process groups")
@pytest.mark.parametrize("whom", ["group", "main"])
def test_ctrl_c_stops_tune_fit_at_once_and_leaves_no_process(tmp_path, long_trace, whom):
    import signal
    # Enough rows that the run takes far longer than the wait below on a fast machine (with 3
    # rows a quiet CI machine finished the whole run within the old fixed 4 s wait).
    configs = [a for mb in (32, 48, 64, 96, 128, 192, 256, 384, 512, 768)
               for a in ("--config", f"max_split_size_mb:{mb}")]
    # The child gets SIGINT's default action: a suite started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt (the run finished, exit status 0, and the test failed).
    proc = subprocess.Popen([sys.executable, "-m", "pyalloc", "tune", str(long_trace), "--fit",
                             "--jobs", "2", *configs], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        interrupt_and_check(proc, whom)
    finally:
        if proc.poll() is None:          # a failed check leaves no run behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def interrupt_and_check(proc, whom):
    """Wait for tune's workers, send SIGINT (to the group, or the main process only), and check
    that the run stops at once, says so in one line, exits 130 and leaves no process."""
    import signal
    import time

    def workers():
        ps = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True)
        return len(ps.stdout.split()) - 1          # the session's processes but the main one
    deadline = time.monotonic() + 30
    while workers() < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.5)                      # the workers deep in their bisections
    assert proc.poll() is None, proc.stderr.read()
    sent = time.monotonic()
    if whom == "group":                  # what a terminal's Ctrl-C does
        os.killpg(proc.pid, signal.SIGINT)
    else:                                # only the main process
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    waited = time.monotonic() - sent
    assert proc.returncode == 130 and err.decode() == "pyalloc: interrupted\n"
    assert waited < 2.0, f"took {waited:.2f} s to exit"
    left = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True)
    assert left.stdout.split() == []


def test_tune_derives_the_same_device_whether_the_runs_fraction_is_in_its_setting_or_given(tight):
    # issue 25's fidelity defect, in tune: PyTorch applies per_process_memory_fraction at
    # construction as set_per_process_memory_fraction does.
    fraction = run_json("tight-fraction")["fraction"]
    given = tune(tight, grid=None, jobs=1, snapshot=tight, memory_fraction=fraction)
    in_setting = dict(tight, allocator_settings=dict(
        tight["allocator_settings"], PYTORCH_CUDA_ALLOC_CONF=f"per_process_memory_fraction:{fraction!r}"))
    found = tune(in_setting, grid=None, jobs=1, snapshot=in_setting)
    assert found.device_memory_derived and given.device_memory_derived
    assert found.device_memory == given.device_memory


def test_terminating_tunes_pool_waits_for_its_manager_thread(monkeypatch):
    # Else interpreter exit races the thread's closing of its wakeup pipe, and Ctrl-C printed
    # "Exception ignored ... Bad file descriptor" after "pyalloc: interrupted". The thread is
    # made slow to wind down, so that returning without waiting for it shows every time.
    import time
    from concurrent.futures import ProcessPoolExecutor, process
    wind_down = process._ExecutorManagerThread.join_executor_internals

    def slow_wind_down(self):
        time.sleep(0.5)
        wind_down(self)
    monkeypatch.setattr(process._ExecutorManagerThread, "join_executor_internals", slow_wind_down)
    pool = ProcessPoolExecutor(max_workers=2)
    futures = [pool.submit(time.sleep, 30) for _ in range(4)]
    while not any(f.running() for f in futures):
        time.sleep(0.01)
    manager = pool._executor_manager_thread
    tune_module._terminate(pool)
    assert not manager.is_alive()
