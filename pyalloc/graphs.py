"""CUDA-graph capture with a private memory pool: `allocator.graph(stream)`, as torch.cuda.graph.

    with a.graph(stream) as g:        # capture on `stream` (not the default stream)
        ...work on stream...          # allocations of the capture's streams go to g's pool
    g.replay()                        # run the captured work again
    g.reset()                         # release the graph and its pool

While the capture runs, every allocation on a stream of that capture (the stream itself, and any
stream that joins it by waiting on an event recorded in it) is routed into the graph's private
pool, so memory the graph uses is never handed to allocations made after the capture: replays
can only overwrite the graph's own memory. Within the capture, freed blocks are reused in stream
order (a block freed on a stream goes back to that stream in the pool). A block that other
streams used (record_stream) is kept until the capture ends, or, with
graph_capture_record_stream_reuse:True, until the capture's graph proves those uses precede the
allocating stream's new work (PyTorch #162186). The pool keeps its memory as long as a graph or
pool handle uses it, as PyTorch's private pools do: each user counts once, and once none is left
the pool's cached memory goes back to the device at the next empty_cache or out-of-memory flush.

Differences from PyTorch: a capture that fails (an exception in the block, or a failed end of
capture) releases its pool instead of leaking it (PyTorch's #190348); nothing is freed to the
device while a capture runs (PyTorch may, #159594).
"""
from pyalloc._core import new_mempool_id
from pyalloc.pools import MemPool

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


class BackendCapture:
    """How a Graph captures and replays: through the allocator's backend (cuStreamBeginCapture
    and friends on a GPU, the simulated capture on a SimDevice). pyalloc.cupy has one that goes
    through CuPy's Stream.begin_capture instead, so that the graph is CuPy's own."""

    def __init__(self, backend, stream):
        self.backend = backend
        self.stream = stream

    def begin(self, mode):
        self.backend.begin_capture(self.stream, mode)

    def end(self):
        """End the capture; returns the graph (here: the backend's handle)."""
        return self.backend.end_capture(self.stream)

    def launch(self, graph, stream):
        self.backend.launch_graph(graph, stream)

    def destroy(self, graph):
        self.backend.destroy_graph(graph)


def _pool_id(pool):
    """A pool given as an id tuple, a Graph (its pool) or a MemPool."""
    if pool is None:
        return None
    if isinstance(pool, MemPool):
        return pool.id
    if isinstance(pool, Graph):
        return pool.pool()
    if (isinstance(pool, tuple) and len(pool) == 2 and all(type(x) is int and x >= 0 for x in pool)
            and (pool[0] == 0) != (pool[1] == 0)):
        return pool
    raise TypeError(f"pool must be a pool id from graph_pool_handle() or Graph.pool(), a MemPool "
                    f"or None, got {pool!r}")


class Graph:
    """A CUDA graph captured on one allocator's device, with its private memory pool.

    Args:
        allocator: the CachingAllocator whose allocations the capture routes.
        stream: the stream to capture (an int handle or stream object; not the default stream 0).
        pool: share another capture's pool (graph_pool_handle(), other_graph.pool() or a
            MemPool); None: a new pool with a graph-created id (n, 0).
        capture_error_mode: "global" (default), "thread_local" or "relaxed", as CUDA's.

    Use as a context manager; after it: replay(), pool(), reset().
    """

    def __init__(self, allocator, stream, pool=None, capture_error_mode="global", capture=None):
        from pyalloc._validate import stream_handle_of
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)}, "
                             f"got {capture_error_mode!r}")
        handle = stream_handle_of(stream)
        if handle == 0:
            raise ValueError("CUDA graphs must be captured on a non-default stream "
                             "(got the default stream 0)")
        self.allocator = allocator
        self.stream = handle
        self._capture = capture if capture is not None else BackendCapture(allocator.backend, handle)
        self.capture_error_mode = capture_error_mode
        self._pool_id = _pool_id(pool) or new_mempool_id(False)
        self._graph = None            # backend graph handle once captured
        self._state = "new"           # new -> capturing -> captured -> reset
        self._holds_pool = False

    def pool(self):
        """The id of the graph's private pool, to share it with another capture."""
        return self._pool_id

    @property
    def captured(self):
        return self._state == "captured"

    def __enter__(self):
        if self._state != "new":
            raise RuntimeError(f"this graph was already {self._state}; make a new Graph to capture again")
        self._capture.begin(self.capture_error_mode)
        try:
            info = self.allocator.backend.stream_capture_info(self.stream)
            if info is None:
                raise RuntimeError(f"stream {self.stream} is not capturing after begin_capture")
            self.allocator.begin_allocate_to_pool(self._pool_id, ("capture", info[0]))
        except BaseException:
            self._capture.destroy(self._capture.end())
            raise
        self._holds_pool = True
        self._state = "capturing"
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            graph = self._capture.end()
        except BaseException:
            self._finish(failed=True)
            if exc_type is None:
                raise
            return False          # the body's exception is the one to see
        if exc_type is not None:
            self._capture.destroy(graph)
            self._finish(failed=True)
            return False
        self._graph = graph
        self._finish(failed=False)
        return False

    def _finish(self, failed):
        self.allocator.end_allocate_to_pool(self._pool_id)
        if failed:
            self._state = "reset"
            self._release_pool()
        else:
            self._state = "captured"

    def _release_pool(self):
        if self._holds_pool:
            self._holds_pool = False
            self.allocator.release_pool(self._pool_id)
            self.allocator.empty_cache(self._pool_id)

    def replay(self, stream=None):
        """Launch the captured graph on `stream` (default: the capture stream)."""
        from pyalloc._validate import stream_handle_of
        if self._state != "captured":
            raise RuntimeError(f"replay needs a captured graph; this one is {self._state}")
        self._capture.launch(self._graph, self.stream if stream is None else stream_handle_of(stream))

    launch = replay       # CuPy's name for it

    @property
    def graph(self):
        """The captured graph (a backend handle, or CuPy's Graph for pyalloc.cupy.graph). Keep this
        Graph object alive as long as the graph is replayed: it holds the graph's memory pool."""
        return self._graph

    def reset(self):
        """Destroy the graph and drop its use of the pool (freed once nothing else uses it)."""
        if self._state == "capturing":
            raise RuntimeError("reset during capture: leave the `with` block first")
        if self._graph is not None:
            graph, self._graph = self._graph, None
            self._capture.destroy(graph)
        self._state = "reset"
        self._release_pool()

    def __del__(self):
        if getattr(self, "_state", "reset") == "captured":
            self.reset()

    def __repr__(self):
        return f"Graph(stream={self.stream}, pool={self._pool_id}, state={self._state!r})"
