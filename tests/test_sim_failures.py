"""Injected driver failures on the simulated device (SimDevice.fail_next), as
tests/fake_libcuda.c's fake_fail_next does for the CUDA backend: a failing call raises CudaError
before it changes anything."""
import pytest

from pyalloc import CachingAllocator, CudaError, SimDevice

from units import MiB


def test_the_next_call_raises_cuda_error_with_the_driver_call_and_result():
    sim = SimDevice()
    sim.fail_next("event_record", result=400)
    with pytest.raises(CudaError) as info:
        sim.record_event(0)
    assert (info.value.call, info.value.result, info.value.name) == (
        "cuEventRecord", 400, "CUDA_ERROR_INVALID_HANDLE")


def test_the_call_after_the_failures_succeeds():
    sim = SimDevice()
    sim.fail_next("event_create")
    with pytest.raises(CudaError):
        sim.create_event()
    sim.create_event()
    assert sim.armed_failures() == {}


def test_count_calls_fail_in_a_row():
    sim = SimDevice()
    sim.fail_next("event_create", count=3)
    for _ in range(3):
        with pytest.raises(CudaError):
            sim.create_event()
    sim.create_event()


def test_skip_lets_calls_through_first():
    sim = SimDevice()
    sim.fail_next("event_create", skip=2)
    sim.create_event()
    sim.create_event()
    with pytest.raises(CudaError):
        sim.create_event()


def test_a_driver_call_name_selects_its_operation():
    sim = SimDevice()
    sim.fail_next("cuMemAlloc")
    assert sim.armed_failures() == {"segment_alloc": (0, 1)}


def test_failures_are_counted():
    sim = SimDevice()
    sim.fail_next("event_create", count=2)
    for _ in range(2):
        with pytest.raises(CudaError):
            sim.create_event()
    assert sim.counters["injected_failures"] == 2
    assert sim.counters["event_create"] == 2            # calls made, failed ones included


def test_count_zero_disarms():
    sim = SimDevice()
    sim.fail_next("event_create")
    sim.fail_next("event_create", count=0)
    sim.create_event()


def test_an_unknown_call_is_refused():
    with pytest.raises(ValueError, match="cuLaunchKernelX"):
        SimDevice().fail_next("cuLaunchKernelX")


def test_a_failed_call_changes_nothing():
    sim = SimDevice()
    s = sim.create_stream()
    event = sim.record_event(s)
    sim.launch(s)
    sim.fail_next("event_record")
    with pytest.raises(CudaError):
        sim.record_event(s, event)
    assert sim.event_done(event)                        # still the record before the launch


def test_an_allocator_whose_segment_allocation_fails_is_unchanged():
    sim = SimDevice()
    a = CachingAllocator(backend=sim, config="")
    before = a.memory_stats()
    sim.fail_next("segment_alloc")
    with pytest.raises(CudaError):
        a.malloc(3 * MiB)
    a._check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert a.memory_reserved() == 0 and sim.used_memory == 0
