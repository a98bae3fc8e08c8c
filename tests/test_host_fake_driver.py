"""The CUDA host backend (pyalloc/_cuda_host.pyx: cuMemHostAlloc, cuMemHostRegister, ...) under the
caching host allocator, against the fake driver (tests/fake_libcuda.c), without a GPU. The
scenarios in host_fake_checks.py run once in a child interpreter; each test checks one result."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fake_driver import child_env

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(fake_libcuda):
    env = child_env(fake_libcuda, 1, 64 << 20)
    env.pop("PYALLOC_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    out = subprocess.run([sys.executable, str(HERE / "host_fake_checks.py"), str(fake_libcuda)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=str(HERE))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def value(results, name):
    r = results[name]
    assert "error" not in r, r.get("traceback", r.get("error"))
    return r["value"]


def test_default_path_allocates_with_cumemhostalloc_and_a_hit_calls_nothing(results):
    v = value(results, "default_path_uses_cumemhostalloc_once_per_block")
    assert v == {"same": True, "host_alloc": 1, "host_free": 1, "host_register": 0,
                 "host_unregister": 0}


def test_register_path_registers_malloced_pages_and_unregisters_at_empty_cache(results):
    v = value(results, "register_path_uses_malloc_and_cumemhostregister")
    assert v == {"host_alloc": 0, "host_free": 0, "host_register": 1, "host_unregister": 1}


def test_a_failed_cumemhostalloc_raises_cuda_error_and_leaves_the_stats(results):
    v = value(results, "failed_cumemhostalloc_raises_and_changes_nothing")
    assert v == {"raised": ["cuMemHostAlloc", 2], "unchanged": True}


def test_a_failed_cumemhostregister_raises_and_leaves_the_stats(results):
    v = value(results, "failed_cumemhostregister_frees_the_pages_and_changes_nothing")
    assert v == {"raised": ["cuMemHostRegister", 2], "unchanged": True, "registered": 0}


def test_a_block_with_a_recorded_stream_is_reused_only_after_the_driver_event(results):
    v = value(results, "a_recorded_block_waits_for_the_driver_event")
    assert v == {"second_is_other": True, "after_completion": True}
