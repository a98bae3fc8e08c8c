"""pyalloc.cuda_core with cuda.core's own Device, Stream and Buffer, without a GPU: the scenarios of
cuda_core_fake_checks.py run once in a child interpreter over the fake driver (tests/fake_libcuda.c,
one device of 64 GiB); each test checks one behaviour from their results. The GPU run
(tests/test_frameworks_gpu.py) adds kernels and real memory."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fake_driver import child_env

HERE = Path(__file__).resolve().parent
from units import MiB

try:
    import pyalloc.cuda_core as pcc
    pcc.import_cuda_core()
except ImportError as exc:
    pytest.skip(f"needs cuda.core (pip install cuda-core): {exc}", allow_module_level=True)


@pytest.fixture(scope="module")
def results(fake_libcuda):
    env = child_env(fake_libcuda, 1, 64 << 30)
    env.pop("PYALLOC_CONF", None)
    out = subprocess.run([sys.executable, str(HERE / "cuda_core_fake_checks.py"), str(fake_libcuda)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=str(HERE))
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if "setup" in found:
        pytest.skip(f"this cuda.core needs a driver function tests/fake_libcuda.c lacks: "
                    f"{found['setup']}")
    return found


def value(results, name):
    r = results[name]
    assert "error" not in r, r.get("traceback", r.get("error"))
    return r["value"]


def test_a_buffer_is_a_block_of_the_default_allocator_given_back_at_close(results):
    known, size, allocated, on_stream, after, live = value(
        results, "buffer_is_a_block_of_the_default_allocator")
    assert (known, size, allocated, on_stream) == (True, MiB, MiB, True)
    assert (after, live) == (0, {})


def test_close_on_the_allocation_stream_reuses_the_block_at_once_without_an_event(results):
    assert value(results, "close_on_the_allocation_stream_makes_the_block_reusable_at_once") == \
        [True, 0]


def test_close_on_another_stream_waits_for_that_streams_work(results):
    assert value(results, "close_on_another_stream_waits_for_that_streams_work") == [True, True]


def test_a_collected_buffer_gives_its_block_back(results):
    assert value(results, "a_collected_buffer_gives_its_block_back") == [MiB, 0, {}]


def test_out_of_memory_is_pyalloc_out_of_memory_error_and_allocates_nothing(results):
    assert value(results, "out_of_memory_is_pyalloc_out_of_memory_error_and_changes_nothing") == \
        ["OutOfMemoryError", 0, {}]


def test_a_dropped_cuda_core_stream_is_kept_while_its_work_is_queued_then_let_go(results):
    # cuda.core's Stream holds no reference of its own that would keep the allocator from seeing
    # that only it holds the object (reap_dropped_streams counts references).
    assert value(results, "a_dropped_stream_is_kept_while_its_work_is_queued_then_let_go") == \
        [True, True]
