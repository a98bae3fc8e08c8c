"""Stand-ins for the parts of CuPy and PyTorch that bench/capture_gpu.py uses, over pyalloc's
simulated device, so that `capture_gpu.py --dry-run` runs the GPU runners' own code (streams,
events, `with stream:`, arrays freed by dropping their last reference, record_stream, the torch
worker subprocesses and their settings) on a machine without a GPU.

Only the calls capture_gpu.py makes exist, with the real signatures; anything else raises
AttributeError, which is the point: a call that is not here would not have been dry-run.

  fake_cupy(alloc)   a `cupy` namespace over `alloc` (pyalloc's default allocator on the sim);
                     `graph(alloc, s0)` stands for pyalloc.cupy.graph(stream=s0)
  fake_torch()       a `torch` namespace with its own CachingAllocator on a SimDevice, configured
                     from PYTORCH_CUDA_ALLOC_CONF as PyTorch's allocator is
"""
import contextlib
import os
import types


class _StreamStack:
    def __init__(self):
        self.stack = [0]

    @property
    def current(self):
        return self.stack[-1]


# ------------------------------------------------------------------------------ CuPy

def fake_cupy(alloc):
    sim = alloc.backend
    cur = _StreamStack()

    class Stream:
        def __init__(self, null=False, non_blocking=False, ptds=False):
            self.ptr = 0 if null else sim.create_stream()

        def __enter__(self):
            cur.stack.append(self.ptr)
            return self

        def __exit__(self, *exc):
            cur.stack.pop()

        def wait_event(self, event):
            sim.wait_event(self.ptr, event.ptr)

    class Event:
        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self.ptr = sim.create_event()

        def record(self, stream=None):
            sim.record_event(cur.current if stream is None else stream.ptr, self.ptr)

    class ndarray:
        def __init__(self, nbytes):
            self._ptr = alloc.malloc(nbytes, cur.current)
            self.nbytes = nbytes
            self.data = types.SimpleNamespace(ptr=self._ptr)

        @property
        def __cuda_array_interface__(self):
            return {"data": (self._ptr, False), "shape": (self.nbytes,), "typestr": "|u1",
                    "version": 3}

        def fill(self, value):
            sim.launch(cur.current, 1, (self._ptr,))

        def __del__(self):
            alloc.free(self._ptr)

    uint8 = "uint8"

    def empty(shape, dtype=float):
        assert dtype == uint8 and isinstance(shape, int)
        return ndarray(shape)

    class Device:
        def __init__(self, device=None):
            self.id = 0

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(Stream=Stream, Event=Event, Device=Device)
    return types.SimpleNamespace(cuda=cuda, empty=empty, uint8=uint8, __version__="fake",
                                 _current=cur)


def fake_cupy_graph(cupy, alloc):
    """pyalloc.cupy.graph(stream=s0): pyalloc's Graph capturing s0, s0 current inside."""
    @contextlib.contextmanager
    def graph(stream):
        with stream:
            with alloc.graph(stream.ptr) as g:
                yield g
    return graph


# ------------------------------------------------------------------------------ PyTorch

def fake_torch():
    from pyalloc import CachingAllocator, SimDevice
    sim = SimDevice()
    alloc = CachingAllocator(backend=sim, config=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    cur = _StreamStack()

    class Stream:
        def __init__(self, device=None, priority=0):
            self.cuda_stream = sim.create_stream()

        def wait_event(self, event):
            sim.wait_event(self.cuda_stream, event._h)

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self._h = sim.create_event()

        def record(self, stream=None):
            sim.record_event(cur.current if stream is None else stream.cuda_stream, self._h)

    @contextlib.contextmanager
    def stream(s):
        cur.stack.append(s.cuda_stream)
        try:
            yield
        finally:
            cur.stack.pop()

    uint8 = types.SimpleNamespace(itemsize=1)

    class Tensor:
        def __init__(self, n):
            self._ptr = alloc.malloc(n, cur.current)
            self._n = n

        def numel(self):
            return self._n

        def element_size(self):
            return 1

        def fill_(self, value):
            sim.launch(cur.current, 1, (self._ptr,))
            return self

        def record_stream(self, s):
            alloc.record_stream(self._ptr, s.cuda_stream)

        def __del__(self):
            alloc.free(self._ptr)

    def empty(n, dtype=None, device=None):
        assert dtype is uint8 and device == "cuda" and isinstance(n, int)
        return Tensor(n)

    class CUDAGraph:
        def __init__(self, keep_graph=False):
            self._g = None
            self.keep_graph = keep_graph

        def pool(self):
            return self._g.pool()

        def raw_cuda_graph(self):
            return self._g.graph          # a sim graph handle: count it with sim_graph_size

        def reset(self):
            if self._g is not None:
                self._g.reset()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        alloc.empty_cache()
        cur.stack.append(stream.cuda_stream)
        try:
            cuda_graph._g = alloc.graph(stream.cuda_stream, pool=pool,
                                        capture_error_mode=capture_error_mode)
            with cuda_graph._g:
                yield
        finally:
            cur.stack.pop()

    def sim_graph_size(raw):
        nodes = sim.graph_nodes(raw)
        return len(nodes), sum(len(p) for _, p, _ in nodes)

    memory = types.SimpleNamespace(_snapshot=lambda: {
        "segments": alloc.snapshot()["segments"],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}})
    cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event, stream=stream, graph=graph, CUDAGraph=CUDAGraph,
        is_available=lambda: True, synchronize=lambda: None, empty_cache=alloc.empty_cache,
        memory_reserved=alloc.memory_reserved, memory_allocated=alloc.memory_allocated,
        max_memory_reserved=alloc.max_memory_reserved, max_memory_allocated=alloc.max_memory_allocated,
        reset_peak_memory_stats=alloc.reset_peak_memory_stats, get_device_name=lambda: "SimDevice",
        memory=memory)
    return types.SimpleNamespace(cuda=cuda, empty=empty, uint8=uint8, __version__="fake",
                                 _sim_graph_size=sim_graph_size)
