"""The measuring tools of bench/ that notes and the README cite keep working (CPU only)."""
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                    reason="the cold-cache harness uses x86-64 Linux (rdtscp, dlopen)")
@pytest.mark.skipif(not sysconfig.get_config_var("Py_ENABLE_SHARED"),
                    reason="the harness embeds a shared libpython, which this Python lacks")
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="the harness is compiled with a C compiler")
def test_cold_entry_pair_times_the_installed_build():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "cold_entry_pair.py"), "--rounds", "1",
                          "--pairs", "20", "--pollute-kib", "64", "."],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    match = re.search(r"^\.: cold pair ([\d.]+) ns .* / \.: 1\.000", out.stdout, re.M)
    assert match and 0 < float(match.group(1)) < 1e6, out.stdout


def test_torch_hook_figures_of_a_saved_run_separate_slow_children():
    # A saved H200 run (bench/results): native's children 2, 4, 5, 6, 8, 9 ran at about twice the
    # time of the others; the fast-children figures leave them out.
    saved = os.path.join(BENCH, "results", "torch_hook_h200_2026-12-01_a.json")
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_torch_hook.py"), "--from-json", saved],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    fast = re.search(r"fast children only .*native 3 of 9, pyalloc 7 of 9.*: native (\d+) ns, "
                     r"pyalloc (\d+) ns.* one-slot (\d+) ns", out.stdout)
    assert fast, out.stdout
    native, pyalloc, one_slot = map(int, fast.groups())
    assert (native, pyalloc, one_slot) == (1955, 1667, 1582)      # medians of the fast children


def test_bench_deferred_releases_every_deferred_block_at_the_join():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_deferred.py"), "--sizes", "50",
                          "200", "--pairs", "5"], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\s*([\d,]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+$", out.stdout, re.M)
    assert rows == ["50", "200"], out.stdout
