"""Specification of pyalloc.numba, Numba's EMM plugin, without a GPU: the plugin's interface as
Numba checks it, and its memory over the simulated device (a plugin subclass that accepts the
simulated default allocator; the real one refuses it, see test_initialize_refuses_...).

Numba's MemoryPointer, AutoFreePointer and OwnedPointer are plain Python objects, so allocation,
views, reference counting, deferral, reset and out of memory run here exactly as on a GPU; only
kernels need one (tests/test_frameworks_gpu.py).
"""
import gc
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import pyalloc
from pyalloc import defaults

numba_driver = pytest.importorskip("numba.cuda.cudadrv.driver",
                                   reason="needs numba and numba-cuda (pip install numba numba-cuda)")
import pyalloc.numba as pn   # noqa: E402

MiB = 1 << 20


class FakeDevice:
    id = 0


class FakeContext:
    """What the plugin reads of Numba's Context: .device.id (and it must be weak-referenceable)."""
    device = FakeDevice()


class SimManager(pn.PyallocMemoryManager):
    """The plugin over the simulated default allocator (the real one accepts only the GPU)."""

    def _allocator(self):
        return defaults.get_allocator(self._device)


@pytest.fixture
def manager(sim_defaults):
    context = FakeContext()
    m = SimManager(context=context)
    m.initialize()
    m._keep_context = context     # the plugin holds only a weak proxy, as Numba's managers do
    return m


def live_blocks(alloc):
    return {b["address"]: b["size"] for s in alloc._segments() for b in s["blocks"] if b["allocated"]}


def run_python(code, tmp_path, env=None):
    """Run `code` in a fresh interpreter outside the checkout; return its stdout (asserting rc 0)."""
    full_env = dict(os.environ, **(env or {}))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=full_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# ------------------------------------------------------------------------------ the interface

def test_without_numba_the_module_imports_and_the_class_raises_a_clear_import_error(tmp_path):
    out = run_python("""
        import sys
        sys.modules["numba"] = None          # as if Numba were not installed
        import pyalloc.numba as pn
        try:
            pn.PyallocMemoryManager
        except ImportError as exc:
            print("ImportError:", exc)
    """, tmp_path)
    assert out.startswith("ImportError: pyalloc.numba needs Numba's CUDA target") and "numba-cuda" in out


def test_the_manager_is_a_host_only_emm_plugin_with_numbas_ipc_mixin():
    assert issubclass(pn.PyallocMemoryManager, numba_driver.HostOnlyCUDAMemoryManager)
    assert issubclass(pn.PyallocMemoryManager, numba_driver.GetIpcHandleMixin)


def test_interface_version_is_1():
    assert pn.PyallocMemoryManager(context=None).interface_version == 1


def test_set_memory_manager_accepts_the_plugin(monkeypatch):
    monkeypatch.setattr(numba_driver, "_memory_manager", None)
    numba_driver.set_memory_manager(pn.PyallocMemoryManager)
    assert numba_driver._memory_manager is pn.PyallocMemoryManager


def test_the_module_attribute_numba_reads_is_the_plugin():
    assert pn._numba_memory_manager is pn.PyallocMemoryManager


def test_the_environment_variable_makes_numba_choose_the_plugin(tmp_path):
    out = run_python("""
        from numba.cuda.cudadrv import driver
        driver._ensure_memory_manager()      # what Numba runs when it creates a context
        print(driver._memory_manager.__module__, driver._memory_manager.__name__)
    """, tmp_path, env={"NUMBA_CUDA_MEMORY_MANAGER": "pyalloc.numba"})
    assert out == "pyalloc.numba PyallocMemoryManager"


def test_install_makes_the_plugin_numbas_memory_manager(monkeypatch):
    monkeypatch.setattr(numba_driver, "_memory_manager", None)
    assert not pn.is_installed()
    pn.install()
    assert pn.is_installed() and numba_driver._memory_manager is pn.PyallocMemoryManager


def test_install_after_numba_made_a_context_is_refused_and_changes_nothing(monkeypatch):
    class NumbasOwn:
        pass

    class Dev:
        id = 0
        primary_context = type("Ctx", (), {"memory_manager": NumbasOwn()})()

    monkeypatch.setattr(numba_driver, "_memory_manager", None)
    monkeypatch.setattr(numba_driver.driver, "devices", {0: Dev()})
    with pytest.raises(RuntimeError, match="before Numba's first use of the GPU"):
        pn.install()
    assert numba_driver._memory_manager is None


def test_initialize_refuses_a_default_allocator_on_the_simulated_device(sim_defaults):
    context = FakeContext()
    with pytest.raises(pyalloc.NoCudaDriverError, match="'sim' backend"):
        pn.PyallocMemoryManager(context=context).initialize()


# ------------------------------------------------------------------------------ memory

def test_memalloc_returns_a_block_of_the_default_allocator(manager, sim_defaults):
    mem = manager.memalloc(4096)
    assert live_blocks(sim_defaults) == {mem.device_pointer_value: 4096}
    assert mem.size == 4096


def test_the_pointer_is_of_numbas_binding_type(manager):
    mem = manager.memalloc(4096)
    pointer_type, _ = pn._numba_bindings(numba_driver)
    assert isinstance(mem.device_pointer, pointer_type)
    assert int(mem.device_pointer) == mem.device_pointer_value


def test_memory_is_freed_when_the_last_reference_goes(manager, sim_defaults):
    mem = manager.memalloc(4096)
    del mem
    gc.collect()
    assert sim_defaults.memory_allocated() == 0


def test_a_view_keeps_the_memory_alive_after_its_base_is_dropped(manager, sim_defaults):
    mem = manager.memalloc(4096)
    view = mem.view(1024)
    del mem
    gc.collect()
    assert sim_defaults.memory_allocated() == 4096
    del view
    gc.collect()
    assert sim_defaults.memory_allocated() == 0


def test_zero_bytes_gives_a_null_pointer_that_owns_nothing(manager, sim_defaults):
    mem = manager.memalloc(0)
    assert mem.device_pointer_value is None and mem.size == 0
    assert sim_defaults.memory_allocated() == 0


def test_memory_is_allocated_for_numbas_default_stream(manager, sim_defaults):
    held = manager.memalloc(4096)
    assert held.size == 4096
    assert [s["stream"] for s in sim_defaults._segments()] == [0]


def test_allocation_stream_sets_the_stream_inside_the_block_only(manager, sim_defaults):
    s = sim_defaults.backend.create_stream()
    with pn.allocation_stream(s):
        inside = manager.memalloc(3 * MiB)
    outside = manager.memalloc(5 * MiB)
    streams = {seg["address"]: seg["stream"] for seg in sim_defaults._segments()}
    assert streams[inside.device_pointer_value] == s
    assert streams[outside.device_pointer_value] == 0


def test_allocation_stream_takes_a_numba_stream_object(manager, sim_defaults):
    s = sim_defaults.backend.create_stream()
    numba_stream = numba_driver.Stream(numba_driver.binding.CUstream(s))
    with pn.allocation_stream(numba_stream) as handle:
        assert handle == s


def test_defer_cleanup_holds_frees_until_the_outermost_block_ends(manager, sim_defaults):
    with manager.defer_cleanup():
        with manager.defer_cleanup():
            mem = manager.memalloc(4096)
            del mem
            gc.collect()
        assert sim_defaults.memory_allocated() == 4096
    assert sim_defaults.memory_allocated() == 0


def test_reset_frees_every_allocation_and_empties_the_cache(manager, sim_defaults):
    kept = [manager.memalloc(MiB), manager.memalloc(3 * MiB)]
    manager.reset()
    assert sim_defaults.memory_allocated() == 0 and sim_defaults.memory_reserved() == 0
    assert len(kept) == 2     # Numba's semantics: reset frees memory that arrays still reference


def test_memory_info_counts_pyalloc_cached_memory_as_free(manager, sim_defaults):
    held = manager.memalloc(MiB)      # a 2 MiB segment with 1 MiB of it cached
    device_free, total = sim_defaults.backend.mem_get_info()
    info = manager.get_memory_info()
    assert info.total == total == 64 * MiB
    assert info.free == device_free + MiB
    del held


def test_ipc_handle_of_a_block_in_an_expandable_segment_is_not_implemented(sim_defaults):
    expandable = pyalloc.CachingAllocator(0, backend="sim", config="expandable_segments:True")

    class ExpandableManager(SimManager):
        def _allocator(self):
            return expandable

    context = FakeContext()
    m = ExpandableManager(context=context)
    ptr = expandable.malloc(4096)
    mem = numba_driver.MemoryPointer(None, numba_driver.binding.CUdeviceptr(ptr), 4096)
    with pytest.raises(NotImplementedError, match="expandable segment"):
        m.get_ipc_handle(mem)
    expandable.free(ptr)


# ------------------------------------------------------------------------------ out of memory

def test_out_of_memory_raises_a_pyalloc_and_a_numba_error(manager):
    with pytest.raises(pyalloc.OutOfMemoryError) as info:
        manager.memalloc(128 * MiB)
    exc = info.value
    assert isinstance(exc, numba_driver.CudaAPIError)
    assert exc.code == pn._numba_bindings(numba_driver)[1]
    assert exc.requested == 128 * MiB and "out of memory" in str(exc)


def test_the_out_of_memory_error_pickles_with_its_figures(manager):
    with pytest.raises(pyalloc.OutOfMemoryError) as info:
        manager.memalloc(128 * MiB)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is type(info.value) and copy.requested == 128 * MiB and str(copy) == str(info.value)


def test_out_of_memory_leaves_the_allocator_as_it_was(manager, sim_defaults):
    held = manager.memalloc(8 * MiB)
    before = sim_defaults.memory_stats()["allocated_bytes.all.current"]
    with pytest.raises(pyalloc.OutOfMemoryError):
        manager.memalloc(128 * MiB)
    assert sim_defaults.memory_stats()["allocated_bytes.all.current"] == before
    del held


def test_out_of_memory_collects_cycles_and_retries(manager, sim_defaults):
    class Holder:
        pass

    gc.disable()
    try:
        cycle = Holder()
        cycle.me = cycle
        cycle.mem = manager.memalloc(40 * MiB)
        del cycle                     # unreachable, but alive until a collection
        second = manager.memalloc(40 * MiB)
    finally:
        gc.enable()
    assert sim_defaults.memory_allocated() == 40 * MiB
    del second


# ------------------------------------------------------------------ pinned host memory

class SimHostManager(SimManager):
    """The plugin with a host allocator on the simulated device (the real one wants the GPU)."""

    def __init__(self, *args, host, **kwargs):
        super().__init__(*args, **kwargs)
        self._host = host

    def _host_allocator(self):
        return self._host


@pytest.fixture
def host_manager(sim_defaults):
    from pyalloc.host import HostAllocator
    context = FakeContext()
    m = SimHostManager(context=context, host=HostAllocator(sim_defaults.backend, config=""))
    m.initialize()
    m._keep_context = context
    return m


def test_memhostalloc_gives_a_block_of_the_host_allocator(host_manager):
    mem = host_manager.memhostalloc(3000)
    assert host_manager._host.block_size(mem.host_pointer) == 4096


def test_memhostalloc_memory_goes_back_to_the_cache_when_numba_drops_it(host_manager):
    mem = host_manager.memhostalloc(3000)
    del mem
    gc.collect()
    assert host_manager._host.free_list_sizes() == {4096: 1}


def test_memhostalloc_of_zero_bytes_is_a_null_pointer(host_manager):
    assert host_manager.memhostalloc(0).host_pointer == 0


def test_the_real_plugin_refuses_a_host_allocator_off_the_gpu(manager, monkeypatch):
    import pyalloc.host as host_module
    from pyalloc.host import HostAllocator
    monkeypatch.setattr(host_module, "_default", HostAllocator(pyalloc.SimDevice(), config=""))
    with pytest.raises(pyalloc.NoCudaDriverError, match="host allocator"):
        pn.PyallocMemoryManager._host_allocator(manager)
