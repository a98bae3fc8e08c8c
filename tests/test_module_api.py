"""The module level has torch.cuda.memory's API over the default allocators (pyalloc/defaults.py).

Each test runs on simulated default allocators (sim_defaults below: 64 MiB devices) and
checks one function against what the allocator itself reports, under torch.cuda.memory's name.
"""
import gc
import gzip
import inspect
import pickle

import pytest

import pyalloc
from pyalloc import defaults

from units import MiB


@pytest.fixture
def sim_defaults():
    """The default allocators on 64 MiB simulated devices, each device at its own addresses (as on
    a GPU, a pointer names its device), for the test; the automatic choice again afterwards.
    Yields device 0's."""
    pyalloc.set_default_backend(
        lambda d: pyalloc.SimDevice(64 * MiB, device=d, base_address=0x7F0000000000 + d * (1 << 40)))
    yield defaults.get_allocator(0)
    gc.collect()
    pyalloc.set_default_backend(None)


@pytest.fixture
def history_off():
    """Module-level history is process-wide (it also reaches allocators made later): off after."""
    yield
    pyalloc.record_memory_history(None)


# ------------------------------------------------------------------------------ names

# torch.cuda.memory's functions (torch 2.13's __all__ plus the three underscore ones its docs
# teach) and their parameters, which pyalloc's must accept in the same order.
TORCH_SIGNATURES = {
    "caching_allocator_alloc": ["size", "device", "stream"],
    "caching_allocator_delete": ["mem_ptr"],
    "set_per_process_memory_fraction": ["fraction", "device"],
    "get_per_process_memory_fraction": ["device"],
    "empty_cache": [],
    "memory_stats": ["device"],
    "memory_stats_as_nested_dict": ["device"],
    "reset_accumulated_memory_stats": ["device"],
    "reset_peak_memory_stats": ["device"],
    "memory_allocated": ["device"],
    "max_memory_allocated": ["device"],
    "memory_reserved": ["device"],
    "max_memory_reserved": ["device"],
    "memory_snapshot": ["mempool_id", "include_traces"],
    "memory_summary": ["device", "abbreviated"],
    "mem_get_info": ["device"],
    "use_mem_pool": ["pool", "device"],
    "_record_memory_history": ["enabled", "context", "stacks", "max_entries", "device"],
    "_snapshot": ["device"],
    "_dump_snapshot": ["filename"],
}


@pytest.mark.parametrize("name", sorted(TORCH_SIGNATURES))
def test_module_level_has_torch_cuda_memorys_function_with_its_leading_parameters(name):
    params = list(inspect.signature(getattr(pyalloc, name)).parameters)
    expected = TORCH_SIGNATURES[name]
    # empty_cache takes an optional device in pyalloc (torch's empties every device: so does
    # pyalloc's without one); others may add parameters after torch's.
    assert params[:len(expected)] == expected


# ------------------------------------------------------------------------------ statistics

def test_set_per_process_memory_fraction_caps_the_current_devices_default_allocator(sim_defaults):
    pyalloc.set_per_process_memory_fraction(0.25)
    assert sim_defaults.get_memory_fraction() == 0.25
    with pytest.raises(pyalloc.OutOfMemoryError):
        pyalloc.malloc(20 * MiB)            # more than a quarter of the 64 MiB device


def test_get_per_process_memory_fraction_reads_what_was_set(sim_defaults):
    assert pyalloc.get_per_process_memory_fraction() == 1.0
    pyalloc.set_per_process_memory_fraction(0.5, device=0)
    assert pyalloc.get_per_process_memory_fraction(0) == 0.5


def test_set_per_process_memory_fraction_outside_0_1_names_the_value(sim_defaults):
    with pytest.raises(ValueError, match=r"1\.5.*0~1"):
        pyalloc.set_per_process_memory_fraction(1.5)


def test_reset_accumulated_memory_stats_zeroes_the_totals(sim_defaults):
    pyalloc.free(pyalloc.malloc(MiB))
    assert pyalloc.memory_stats()["allocation.all.allocated"] == 1
    pyalloc.reset_accumulated_memory_stats()
    assert pyalloc.memory_stats()["allocation.all.allocated"] == 0


def test_memory_stats_as_nested_dict_nests_the_flat_keys(sim_defaults):
    ptr = pyalloc.malloc(MiB)
    nested = pyalloc.memory_stats_as_nested_dict()
    flat = pyalloc.memory_stats()
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] == MiB
    assert nested["num_device_alloc"] == flat["num_device_alloc"]
    pyalloc.free(ptr)


def test_mem_get_info_is_the_devices_free_and_total_bytes(sim_defaults):
    free_before, total = pyalloc.mem_get_info()
    assert total == 64 * MiB and free_before == total
    ptr = pyalloc.malloc(MiB)               # a 2 MiB segment
    assert pyalloc.mem_get_info() == (total - pyalloc.memory_reserved(), total)
    pyalloc.free(ptr)


def test_memory_summary_abbreviated_leaves_out_the_pool_rows(sim_defaults):
    full = pyalloc.memory_summary()
    short = pyalloc.memory_summary(abbreviated=True)
    assert "from large pool" in full and "from large pool" not in short
    assert "Allocated memory" in short


def test_memory_summary_abbreviated_must_be_a_bool(sim_defaults):
    with pytest.raises(TypeError, match="abbreviated must be a bool, got str 'yes'"):
        pyalloc.memory_summary(abbreviated="yes")


def test_caching_allocator_alloc_and_delete_pair_on_the_default_allocator(sim_defaults):
    ptr = pyalloc.caching_allocator_alloc(4096)
    assert sim_defaults.memory_allocated() == 4096 and ptr != 0
    pyalloc.caching_allocator_delete(ptr)
    assert sim_defaults.memory_allocated() == 0


def test_caching_allocator_alloc_takes_the_stream_it_is_given(sim_defaults):
    s = sim_defaults.backend.create_stream()
    ptr = pyalloc.caching_allocator_alloc(4096, device=0, stream=s)
    (seg,) = pyalloc.memory_snapshot()
    assert seg["stream"] == s
    pyalloc.caching_allocator_delete(ptr)


# ------------------------------------------------------------------------------ history and snapshots

def test_record_memory_history_records_the_default_allocators_events(sim_defaults, history_off):
    pyalloc.record_memory_history()
    pyalloc.free(pyalloc.malloc(MiB))
    actions = [e["action"] for e in pyalloc._snapshot()["device_traces"][0]]
    assert actions[:3] == ["segment_alloc", "alloc", "free_requested"]


def test_record_memory_history_reaches_default_allocators_made_later(sim_defaults, history_off):
    pyalloc.record_memory_history(context=None)
    later = pyalloc.get_allocator(1)        # made after the call
    assert later.history_settings is not None and later.history_settings.context is None


def test_record_memory_history_none_stops_every_default_allocator_and_later_ones(sim_defaults, history_off):
    pyalloc.record_memory_history()
    pyalloc.record_memory_history(None)
    assert sim_defaults.history_settings is None
    assert pyalloc.get_allocator(1).history_settings is None


def test_record_memory_history_with_a_device_records_that_device_only(sim_defaults, history_off):
    pyalloc.record_memory_history(device=1)
    assert pyalloc.get_allocator(1).history_settings is not None
    assert sim_defaults.history_settings is None


def test_record_memory_history_bad_argument_changes_no_allocator(sim_defaults, history_off):
    with pytest.raises(ValueError, match="'everything'"):
        pyalloc.record_memory_history(enabled="everything")
    assert sim_defaults.history_settings is None
    assert pyalloc.get_allocator(1).history_settings is None


def test_torchs_private_history_name_is_the_same_function():
    assert pyalloc._record_memory_history is pyalloc.record_memory_history
    assert pyalloc._dump_snapshot is pyalloc.dump_snapshot


def test_snapshot_covers_every_default_allocator_by_device(sim_defaults, history_off):
    pyalloc.record_memory_history()
    p0 = pyalloc.malloc(MiB, device=0)
    p1 = pyalloc.malloc(MiB, device=1)
    snap = pyalloc._snapshot()
    assert sorted(seg["device"] for seg in snap["segments"]) == [0, 1]
    assert len(snap["device_traces"]) == 2
    assert [e["addr"] for e in snap["device_traces"][1] if e["action"] == "alloc"] == [p1]
    pyalloc.free(p0)
    pyalloc.free(p1)


def test_snapshot_of_one_device_is_that_allocators_own(sim_defaults):
    ptr = pyalloc.malloc(MiB, device=1)
    assert [s["device"] for s in pyalloc._snapshot(device=1)["segments"]] == [1]
    pyalloc.free(ptr)


def test_dump_snapshot_writes_the_snapshot_pickle(sim_defaults, tmp_path):
    ptr = pyalloc.malloc(MiB)
    pyalloc.dump_snapshot(str(tmp_path / "mem.pickle.gz"))
    with gzip.open(tmp_path / "mem.pickle.gz") as f:
        data = pickle.load(f)
    assert [s["total_size"] for s in data["segments"]] == [2 * MiB]
    pyalloc.free(ptr)


def test_memory_snapshot_is_the_segment_list(sim_defaults):
    ptr = pyalloc.malloc(MiB)
    segs = pyalloc.memory_snapshot()
    assert [b["address"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated"] == [ptr]
    pyalloc.free(ptr)


def test_memory_snapshot_of_a_pool_has_only_that_pools_segments(sim_defaults):
    pool = pyalloc.MemPool()
    outside = pyalloc.malloc(MiB)
    with pyalloc.use_mem_pool(pool):
        inside = pyalloc.malloc(MiB)
    segs = pyalloc.memory_snapshot(mempool_id=pool.id)
    assert [b["address"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated"] == [inside]
    pyalloc.free(inside)
    pyalloc.free(outside)
    pool.release()


def test_memory_snapshot_bad_pool_id_names_the_value(sim_defaults):
    with pytest.raises(TypeError, match=r"mempool_id must be a pool id .* got 7"):
        pyalloc.memory_snapshot(mempool_id=7)


# ------------------------------------------------------------------------------ pools and graphs

def test_use_mem_pool_of_a_non_pool_is_a_type_error_at_module_level(sim_defaults):
    with pytest.raises(TypeError, match="expects a pyalloc MemPool, got int 42"):
        pyalloc.use_mem_pool(42)            # at the call, not only on entering the block


def test_use_mem_pool_of_a_non_pool_is_a_type_error_on_an_allocator():
    a = pyalloc.CachingAllocator(backend="sim")
    with pytest.raises(TypeError, match="expects a pyalloc MemPool, got int 42"):
        a.use_mem_pool(42)


def test_use_mem_pool_of_a_released_pool_is_refused_at_the_call(sim_defaults):
    pool = pyalloc.MemPool()
    pool.release()
    with pytest.raises(ValueError, match="was released"):
        pyalloc.use_mem_pool(pool)


def test_use_mem_pool_with_another_device_is_refused_at_the_call(sim_defaults):
    pool = pyalloc.MemPool(device=0)
    with pytest.raises(ValueError, match="belongs to device 0, not device 1"):
        pyalloc.use_mem_pool(pool, device=1)
    pool.release()


def test_graph_captures_on_the_current_devices_default_allocator(sim_defaults):
    s = sim_defaults.backend.create_stream()
    with pyalloc.graph(s) as g:
        x = pyalloc.malloc(MiB, stream=s)
        sim_defaults.backend.launch(s, uses=(x,))
        pyalloc.free(x)
    assert g.allocator is sim_defaults
    assert sim_defaults.private_pool_bytes()[0] > 0       # the capture's memory: its own pool
    g.reset()


# ------------------------------------------------------------------------------ default backends

def test_caching_allocator_defaults_to_the_simulated_device_even_where_a_gpu_is_usable(monkeypatch):
    from pyalloc import cuda_backend
    opened = []
    monkeypatch.setattr(cuda_backend, "is_available", lambda: True)
    monkeypatch.setattr(cuda_backend, "open_device", lambda d: opened.append(d))
    assert pyalloc.CachingAllocator().backend.kind == "sim"
    assert opened == []


def test_default_allocators_use_the_gpu_where_one_is_usable(monkeypatch):
    from pyalloc import cuda_backend
    stand_in = pyalloc.SimDevice(64 * MiB)          # what open_device returns here
    monkeypatch.setattr(cuda_backend, "is_available", lambda: True)
    monkeypatch.setattr(cuda_backend, "open_device", lambda d: stand_in)
    pyalloc.set_default_backend(None)
    try:
        assert pyalloc.get_allocator(0).backend is stand_in
    finally:
        pyalloc.set_default_backend(None)
    assert defaults.default_allocators() == {}
