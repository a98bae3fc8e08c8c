"""Smoke tests of the capture benchmark (bench/capture_program.py, bench_capture.py,
capture_gpu.py --dry-run): pytest bench/test_bench_capture.py  (a few seconds, no GPU)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import capture_program as cp   # noqa: E402
import bench_capture as bc     # noqa: E402


def test_programs_are_deterministic_and_well_formed():
    a, b = cp.grid(), cp.grid()
    assert [p.digest for p in a] == [p.digest for p in b]
    assert len({p.digest for p in a}) == 12
    for p in a:
        cp.check(p)
        c = p.counts
        assert c["allocs"] == c["frees"] + c["releases"]
        assert c["small_allocs"] and c["large_allocs"]
        assert c["cross_stream_frees"] > 0 and c["joins"] > 0
    assert cp.generate(seed=1).digest != cp.generate(seed=2).digest


def test_sim_quick_run_reuses_memory_and_keeps_invariants(capsys):
    rows = bc.main(["--quick", "--runs", "1"])
    assert "Peak reserved reduction" in capsys.readouterr().out
    for r in rows:
        s = r["settings"]
        assert s["on"]["peak_reserved"] < s["off"]["peak_reserved"]
        assert s["on+b"]["peak_reserved"] == s["on"]["peak_reserved"]   # see README: no gap to mark
        assert r["V"] == r["counts"]["allocs"] + r["counts"]["frees"]    # one kernel node each


@pytest.mark.parametrize("parts", ["sim,cupy", "torch"])
def test_gpu_script_dry_run_agrees_with_the_sim(parts):
    out = subprocess.run([sys.executable, os.path.join(HERE, "capture_gpu.py"), "--dry-run",
                          "--quick", "--parts", parts], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stdout and "check:" not in out.stdout, out.stdout
    assert " yes" in out.stdout
