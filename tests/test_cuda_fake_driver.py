"""Specification of CudaDevice (pyalloc/_cuda.pyx) against a fake CUDA driver, without a GPU.

tests/fake_libcuda.c is compiled into a libcuda.so.1 that cuda-bindings loads in place of the real
driver (it only needs cuGetProcAddress_v2). The scenarios in fake_driver_checks.py run once, in a
child interpreter with that library first on LD_LIBRARY_PATH and 2 devices of 64 MiB each; each
test below checks one behaviour from their results.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
RANGE = 0x10000000000


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    libdir = tmp_path_factory.mktemp("fakecuda")
    lib = libdir / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(HERE / "fake_libcuda.c")],
                   check=True, capture_output=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               FAKE_CUDA_DEVICES="2", FAKE_CUDA_MEMORY=str(64 * MiB),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, str(HERE / "fake_driver_checks.py"), str(lib)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=str(HERE))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def value(results, name):
    r = results[name]
    assert "error" not in r, r.get("traceback", r.get("error"))
    return r["value"]


def test_probe_finds_the_fake_driver_and_its_devices(results):
    assert value(results, "probe") == [True, 2, ""]


def test_driver_version_is_read_from_the_driver(results):
    assert value(results, "driver_version") == 13000


def test_backend_none_picks_cuda_when_a_gpu_is_there_and_logs_it(results):
    kind, messages = value(results, "backend_none_picks_cuda_and_logs")
    assert kind == "cuda"
    assert len(messages) == 1 and "'cuda'" in messages[0]


def test_open_device_rejects_an_ordinal_beyond_the_devices(results):
    assert "[0, 2)" in value(results, "open_device_out_of_range")


def test_segments_come_from_cumemalloc_and_go_back_with_empty_cache(results):
    v = value(results, "malloc_free_and_empty_cache")
    assert v["device"] == 0
    assert v["driver_used_after_malloc"] == 2 * MiB          # one small-pool segment
    assert v["live_segments"] == 1
    assert v["driver_used_after_free"] == 2 * MiB            # cached, not returned
    assert v["driver_used_after_empty_cache"] == 0
    assert v["live_segments_after"] == 0


def test_the_callers_context_is_restored_after_a_driver_call(results):
    dev_ptr, after_malloc, dev_ptr2, after_none = value(results, "context_is_restored_after_a_call")
    assert dev_ptr == 0 and after_malloc == 1                # allocated on 0, caller stays on 1
    assert dev_ptr2 == 0 and after_none == -1                # no context before, none after


def test_memory_info_reports_the_devices_free_and_total(results):
    # A 5 MiB request gets a 20 MiB segment (1..10 MiB requests share 20 MiB segments).
    assert value(results, "memory_info_from_the_driver") == [64 * MiB - 20 * MiB, 64 * MiB]


def test_out_of_memory_raises_out_of_memory_error_with_driver_figures(results):
    v = value(results, "out_of_memory_raises_and_stays_usable")
    assert v["error"] == [100 * MiB, 64 * MiB, 64 * MiB]


def test_out_of_memory_leaves_the_allocator_usable(results):
    v = value(results, "out_of_memory_raises_and_stays_usable")
    assert v["num_ooms"] == 1
    assert v["allocated"] == MiB


def test_out_of_memory_from_the_driver_enters_the_release_and_retry_ladder(results):
    v = value(results, "out_of_memory_ladder_releases_cache_and_retries")
    assert v["retries"] == 1
    assert v["driver_used"] == 50 * MiB
    assert v["reserved"] == 50 * MiB


def test_memory_fraction_caps_at_a_fraction_of_the_driver_total(results):
    assert value(results, "memory_fraction_uses_the_driver_total") == 32 * MiB


def test_record_stream_defers_reuse_until_the_driver_event_completes(results):
    round1, round2, created, flags = value(results, "record_stream_defers_reuse_until_the_event_completes")
    assert round1 == [True, True] and round2 == [True, True]
    assert created == 1                                      # the event is pooled and reused
    assert flags == 2                                        # CU_EVENT_DISABLE_TIMING


def test_empty_cache_synchronizes_pending_events_before_releasing(results):
    assert value(results, "empty_cache_waits_for_pending_events") == [0, 0]


def test_driver_errors_raise_cuda_error_naming_call_and_result(results):
    v = value(results, "cuda_error_names_call_and_result")
    call, result, name, message, is_runtime_error = v["error"]
    assert (call, result, name) == ("cuMemAlloc", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert message == ("cuMemAlloc failed with CUDA_ERROR_ILLEGAL_ADDRESS 700 "
                       "(an illegal memory access was encountered)")
    assert is_runtime_error


def test_a_failed_cumemalloc_leaves_the_allocator_unchanged(results):
    v = value(results, "cuda_error_names_call_and_result")
    assert (v["allocated"], v["reserved"]) == (0, 0)


def test_a_failed_cumemfree_raises_cuda_error(results):
    assert value(results, "failed_segment_free_raises_cuda_error") == ["cuMemFree", "CUDA_ERROR_INVALID_VALUE"]


def test_a_failed_event_record_raises_cuda_error(results):
    raised, *_ = value(results, "failed_event_record_leaves_state_consistent")
    assert raised == "cuEventRecord"


def test_a_failed_event_record_leaves_the_allocator_consistent(results):
    _, consistent, _, _ = value(results, "failed_event_record_leaves_state_consistent")
    assert consistent is True


def test_a_failed_event_record_leaves_the_block_allocated_so_free_can_be_retried(results):
    _, _, still_allocated, allocated_after_retry = value(results, "failed_event_record_leaves_state_consistent")
    assert still_allocated is True
    assert allocated_after_retry == 0


def test_close_releases_the_primary_context_and_refuses_while_segments_live(results):
    before, retained, after, closed, refused, after_close = value(results, "close_releases_the_primary_context")
    assert retained == before + 1
    assert after == before
    assert closed is True
    assert "still holds 1 segments" in refused
    assert "is closed" in after_close


def test_default_allocators_use_the_current_contexts_device(results):
    dev_p1, cur, dev_p0, kinds, alloc0, alloc1 = value(results, "default_allocators_follow_the_current_context")
    assert (dev_p1, cur, dev_p0) == (1, 1, 0)
    assert kinds == ["cuda", "cuda"]
    assert (alloc0, alloc1) == (0, 0)


def test_default_allocator_rejects_a_device_that_is_not_visible(results):
    assert "[0, 2)" in value(results, "default_allocator_rejects_an_invisible_device")


def test_pointer_device_names_the_owning_device(results):
    assert value(results, "pointer_device_from_the_driver") == 1
