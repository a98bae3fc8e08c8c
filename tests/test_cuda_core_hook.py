"""Specification of pyalloc.cuda_core, a cuda.core MemoryResource over pyalloc, without a GPU: the
resource's interface as cuda.core defines it, and deallocate's stream ordering over the simulated
device (a subclass that accepts the simulated default allocator; the real one refuses it).

Building a cuda.core Buffer needs a CUDA context (it records a deallocation stream), so Buffers
themselves are tested on the GPU (tests/test_frameworks_gpu.py).
"""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

import pyalloc
from pyalloc import defaults
from pyalloc import cuda_core as pcc

try:
    core = pcc.import_cuda_core()
except ImportError as exc:
    pytest.skip(f"needs cuda.core (pip install cuda-core): {exc}", allow_module_level=True)

from units import MiB


class SimResource(pcc.PyallocMemoryResource):
    """The resource over the simulated default allocator, handing out plain (ptr, size, stream)
    records instead of cuda.core Buffers (which need a CUDA context)."""

    def _allocator(self):
        return defaults.get_allocator(self._device_id)

    @staticmethod
    def _from_handle(ptr, size, mr=None, stream=None):
        return (ptr, size, stream)


@pytest.fixture
def mr(sim_defaults):
    return SimResource(0)


def test_without_cuda_core_the_module_imports_and_the_class_raises_a_clear_import_error(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["cuda.core"] = None          # as if cuda-core were not installed
        sys.modules["cuda.core.experimental"] = None
        import pyalloc.cuda_core as pcc
        try:
            pcc.PyallocMemoryResource
        except ImportError as exc:
            print("ImportError:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError: pyalloc.cuda_core needs cuda.core (pip install cuda-core)")


def test_the_resource_is_a_cuda_core_memory_resource():
    assert issubclass(pcc.PyallocMemoryResource, core.MemoryResource)


def test_the_resource_gives_device_memory_of_its_device(mr):
    assert (mr.is_device_accessible, mr.is_host_accessible, mr.is_managed, mr.device_id) == \
        (True, False, False, 0)


def test_device_none_is_the_current_device(sim_defaults):
    assert SimResource().device_id == defaults.current_device() == 0


def test_a_bad_device_is_refused(sim_defaults):
    with pytest.raises(ValueError, match="device must be an int ordinal >= 0"):
        SimResource(-1)


def test_the_resource_refuses_a_default_allocator_on_the_simulated_device(sim_defaults):
    with pytest.raises(pyalloc.NoCudaDriverError, match="'sim' backend"):
        pcc.PyallocMemoryResource(0)


def test_allocate_makes_a_block_of_the_default_allocator_for_the_stream(mr, sim_defaults):
    s = sim_defaults.backend.create_stream()
    ptr, size, stream = mr.allocate(4096, stream=s)
    assert (size, stream) == (4096, s)
    assert [(seg["stream"], [b["address"] for b in seg["blocks"] if b["allocated"]])
            for seg in sim_defaults._segments()] == [(s, [ptr])]
    mr.deallocate(ptr, size, stream=s)


def test_allocate_takes_the_stream_positionally_as_older_cuda_core_calls_it(mr, sim_defaults):
    s = sim_defaults.backend.create_stream()
    ptr, size, _ = mr.allocate(4096, s)
    assert sim_defaults._segments()[0]["stream"] == s
    mr.deallocate(ptr, size, s)


def test_deallocate_returns_the_block(mr, sim_defaults):
    ptr, size, _ = mr.allocate(4096)
    mr.deallocate(ptr, size, stream=None)
    assert sim_defaults.memory_allocated() == 0


def test_a_buffer_cuda_core_refuses_gives_its_block_back(sim_defaults):
    class Refusing(SimResource):
        @staticmethod
        def _from_handle(ptr, size, mr=None, stream=None):
            raise RuntimeError("no CUDA context is current")

    with pytest.raises(RuntimeError, match="no CUDA context"):
        Refusing(0).allocate(4096)
    assert sim_defaults.memory_allocated() == 0


def test_deallocate_of_a_pointer_it_did_not_hand_out_is_refused(mr, sim_defaults):
    ptr = sim_defaults.malloc(4096)
    with pytest.raises(ValueError, match="is not a live allocation"):
        mr.deallocate(ptr, 4096, stream=None)
    assert sim_defaults.memory_allocated() == 4096
    sim_defaults.free(ptr)


def test_deallocate_on_the_allocation_stream_makes_the_block_reusable_at_once(mr, sim_defaults):
    sim = sim_defaults.backend
    s = sim.create_stream()
    ptr, size, _ = mr.allocate(MiB, stream=s)
    sim.launch(s, uses=(ptr,))                 # pending work on the allocation stream
    mr.deallocate(ptr, size, stream=s)
    again, _, _ = mr.allocate(MiB, stream=s)   # stream order makes the reuse safe
    assert again == ptr
    mr.deallocate(again, size, stream=s)


def test_deallocate_on_another_stream_waits_for_that_streams_work(mr, sim_defaults):
    sim = sim_defaults.backend
    s1, s2 = sim.create_stream(), sim.create_stream()
    ptr, size, _ = mr.allocate(MiB, stream=s1)
    sim.launch(s2, uses=(ptr,))                # s2 still uses the block when it is freed on s2
    mr.deallocate(ptr, size, stream=s2)
    busy, _, _ = mr.allocate(MiB, stream=s1)
    assert busy != ptr
    sim.complete(s2)
    after, _, _ = mr.allocate(MiB, stream=s1)
    assert after == ptr
    mr.deallocate(busy, size, stream=s1)
    mr.deallocate(after, size, stream=s1)


def test_a_graph_builder_is_refused_with_a_pointer_to_graph_pools(mr, sim_defaults):
    class GraphBuilder:
        def __cuda_stream__(self):
            return (0, 7)

    with pytest.raises(NotImplementedError, match="GraphBuilder"):
        mr.allocate(4096, stream=GraphBuilder())
    assert sim_defaults.memory_allocated() == 0


def test_out_of_memory_raises_pyalloc_out_of_memory_error_and_changes_nothing(mr, sim_defaults):
    with pytest.raises(pyalloc.OutOfMemoryError):
        mr.allocate(128 * MiB)
    assert sim_defaults.memory_allocated() == 0 and mr._streams == {}


class FakeStream:
    """A stream object as cuda.core's Stream presents itself (__cuda_stream__), over a handle of
    the simulated device; weakly referable, as cuda.core's Stream is."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def test_the_allocator_keeps_a_stream_object_alive_while_it_caches_blocks_of_it(mr, sim_defaults):
    import weakref
    sim = sim_defaults.backend
    s, t = FakeStream(sim.create_stream()), FakeStream(sim.create_stream())
    ptr, size, _ = mr.allocate(MiB, stream=s)
    mr.deallocate(ptr, size, stream=s)          # cached on s's handle
    ptr, size, _ = mr.allocate(MiB, stream=t)   # the resource's memo now holds t, not s
    gone = weakref.ref(s)
    del s
    gc.collect()
    assert gone() is not None                   # its handle must not pass to a new stream yet
    mr.deallocate(ptr, size, stream=t)
    pyalloc.empty_cache()
    gc.collect()
    assert gone() is None


def test_allocations_through_the_memo_after_empty_cache_keep_their_stream_too(mr, sim_defaults):
    import weakref
    sim = sim_defaults.backend
    s, t = FakeStream(sim.create_stream()), FakeStream(sim.create_stream())
    ptr, size, _ = mr.allocate(MiB, stream=s)
    mr.deallocate(ptr, size, stream=s)
    pyalloc.empty_cache()                       # the allocator lets go of s (no block of it left)
    ptr, size, _ = mr.allocate(MiB, stream=s)   # s again: served through the memo
    mr.deallocate(ptr, size, stream=s)
    other, osize, _ = mr.allocate(MiB, stream=t)
    gone = weakref.ref(s)
    del s
    gc.collect()
    assert gone() is not None
    mr.deallocate(other, osize, stream=t)


def test_a_new_object_for_the_allocation_stream_at_deallocate_is_that_stream(mr, sim_defaults):
    # cuda.core 1.2 hands deallocate another Stream object for the Buffer's stream than the one
    # allocate was given (what the H200 figures imply; see pyalloc/_hooks.pyx, freed_on).
    sim = sim_defaults.backend
    s = FakeStream(sim.create_stream())
    ptr, size, _ = mr.allocate(MiB, stream=s)
    sim.launch(s.handle, uses=(ptr,))
    mr.deallocate(ptr, size, stream=FakeStream(s.handle))
    again, _, _ = mr.allocate(MiB, stream=s)       # stream order, no event: reused at once
    assert again == ptr
    assert mr._state.last_stream is s              # the memo still holds the allocation stream
    mr.deallocate(again, size, stream=FakeStream(s.handle))


def test_deallocate_reads_a_streams_protocol_answer_and_refuses_a_bad_one(mr, sim_defaults):
    class Bad:
        def __cuda_stream__(self):
            return "not a tuple"

    ptr, size, _ = mr.allocate(MiB)
    with pytest.raises(TypeError, match="__cuda_stream__"):
        mr.deallocate(ptr, size, stream=Bad())
    assert sim_defaults.memory_allocated() == MiB      # refused: nothing freed
    mr.deallocate(ptr, size, stream=None)


class SlotStream:
    """A stream object without an instance dict, as cuda.core's Stream (a Cython class): the
    resource reads its deallocation streams through the type's __cuda_stream__."""
    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def test_deallocation_streams_of_one_type_keep_their_own_handles(mr, sim_defaults):
    sim = sim_defaults.backend
    s1, s2, s3 = (sim.create_stream() for _ in range(3))
    for freed_on in (s2, s3, s2):                 # the second and third read the type's method
        ptr, size, _ = mr.allocate(MiB, stream=s1)
        sim.launch(freed_on, uses=(ptr,))
        mr.deallocate(ptr, size, stream=SlotStream(freed_on))
        busy, _, _ = mr.allocate(MiB, stream=s1)
        assert busy != ptr                        # waits for the work of the stream it names
        sim.complete(freed_on)
        mr.deallocate(busy, size, stream=SlotStream(s1))
    ptr, size, _ = mr.allocate(MiB, stream=s1)    # another type after: read through its own
    sim.launch(s3, uses=(ptr,))
    mr.deallocate(ptr, size, stream=FakeStream(s3))
    busy, _, _ = mr.allocate(MiB, stream=s1)
    assert busy != ptr
    sim.complete(s3)
    mr.deallocate(busy, size, stream=None)
    assert sim_defaults.memory_allocated() == 0 and mr._streams == {}


def test_a_zero_byte_allocate_leaves_no_live_entry(mr, sim_defaults):
    assert mr.allocate(0)[0] == 0
    mr.deallocate(0, 0, stream=None)
    assert mr._streams == {}
