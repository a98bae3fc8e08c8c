"""Specification of the pinned host allocator's memory history (HostAllocator.record_memory_history
and snapshot()), on the simulated device: entries in the device allocator's trace format (action,
addr, size, stream, time_us, frames) and a snapshot in PyTorch's format that `pyalloc view` reads."""
import sys

import pytest

import pyalloc
from pyalloc.host import HostAllocator
from pyalloc.view import analyze

MIB = 1 << 20


@pytest.fixture
def dev():
    return pyalloc.SimDevice()


@pytest.fixture
def host(dev):
    h = HostAllocator(dev, config="")
    h.record_memory_history()
    return h


def trace(h):
    return h.snapshot()["device_traces"][h.device.device]


def actions(h):
    return [(e["action"], e["addr"], e["size"]) for e in trace(h)]


def test_a_new_block_records_segment_alloc_then_alloc_at_its_block_size(host):
    p = host.malloc(3000)
    assert actions(host) == [("segment_alloc", p, 4096), ("alloc", p, 4096)]


def test_a_free_without_streams_records_free_requested_then_free_completed(host):
    p = host.malloc(4096)
    host.free(p)
    assert actions(host)[2:] == [("free_requested", p, 4096), ("free_completed", p, 4096)]


def test_a_cache_hit_records_alloc_only(host):
    host.free(host.malloc(4096))
    p = host.malloc(4096)
    assert actions(host)[4:] == [("alloc", p, 4096)]


def test_a_free_behind_a_queued_copy_completes_when_its_event_does(dev, host):
    s = dev.create_stream()
    p = host.malloc(4096)
    host.host.copy(s, p, 4096)
    host.record_event(p, s)
    host.free(p)
    assert actions(host)[-1] == ("free_requested", p, 4096)
    dev.complete(s)
    host.poll_events()
    assert actions(host)[-1] == ("free_completed", p, 4096)


def test_empty_cache_records_segment_free(host):
    p = host.malloc(MIB)
    host.free(p)
    host.empty_cache()
    assert actions(host)[-1] == ("segment_free", p, MIB)


def test_entries_carry_the_stream_malloc_was_given(dev, host):
    s = dev.create_stream()
    host.malloc(4096, s)
    assert trace(host)[-1]["stream"] == s


def test_entry_times_are_microseconds_since_the_epoch_in_order(host):
    host.free(host.malloc(4096))
    times = [e["time_us"] for e in trace(host)]
    assert times == sorted(times) and times[0] > 1_500_000_000_000_000


def test_nothing_is_recorded_before_record_memory_history(dev):
    h = HostAllocator(dev, config="")
    h.free(h.malloc(4096))
    h.record_memory_history()
    assert trace(h) == []


def test_enabled_none_stops_recording_and_clears_the_history(host):
    host.free(host.malloc(4096))
    host.record_memory_history(enabled=None)
    host.malloc(4096)
    assert trace(host) == []


def test_max_entries_keeps_the_newest(host):
    host.record_memory_history(max_entries=2, clear_history=True)
    p = host.malloc(4096)
    host.free(p)
    assert actions(host) == [("free_requested", p, 4096), ("free_completed", p, 4096)]


def test_skip_actions_leaves_those_actions_out(host):
    host.record_memory_history(skip_actions=["segment_alloc"], clear_history=True)
    p = host.malloc(4096)
    assert actions(host) == [("alloc", p, 4096)]


def test_a_bad_max_entries_is_refused_naming_the_value(host):
    with pytest.raises(ValueError, match="got 0"):
        host.record_memory_history(max_entries=0)


def test_alloc_entries_carry_the_python_stack_of_the_malloc(host):
    def allocate_here():
        return host.malloc(4096)
    allocate_here()
    assert trace(host)[-1]["frames"][0]["name"] == "allocate_here"


def test_with_context_none_entries_have_no_frames(dev):
    h = HostAllocator(dev, config="")
    h.record_memory_history(context=None)
    h.malloc(4096)
    assert "frames" not in trace(h)[-1]


def test_the_snapshot_has_one_segment_per_block_with_its_state(dev, host):
    s = dev.create_stream()
    a, b, c = host.malloc(4096), host.malloc(4096), host.malloc(8192)
    host.free(b)
    host.host.copy(s, c, 8192)
    host.record_event(c, s)
    host.free(c)
    states = {seg["address"]: (seg["total_size"], seg["blocks"][0]["state"])
              for seg in host.snapshot()["segments"]}
    assert states == {a: (4096, "active_allocated"), b: (4096, "inactive"),
                      c: (8192, "active_pending_free")}


def test_pyalloc_view_reads_the_host_snapshot(host):
    p = host.malloc(MIB)
    host.free(p)
    host.malloc(4096)
    view = analyze(host.snapshot(), block_sizes=False)
    assert (view.events, view.peaks["reserved"][0]) == (6, MIB + 4096)



def test_torchs_memory_viz_reads_the_host_history(host):
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    host.free(host.malloc(4096))
    host.empty_cache()
    text = memory_viz.trace(host.snapshot())
    assert (text.count("cudaMalloc("), text.count("cudaFree(")) == (1, 1)
