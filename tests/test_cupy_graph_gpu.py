"""CUDA graphs of CuPy work on pyalloc, on a real GPU: pyalloc.cupy.graph and captures that CuPy
code begins itself (Stream.begin_capture), checked by data.

The scene of issue 13: a graph is captured on stream s, its temporaries freed during the capture;
arrays made on s after the capture are filled with 7.0 and the graph is replayed. Without a
private pool the replays write into those arrays (pyalloc before graph support: 8,388,607 of
their elements; CuPy's own pool: 4,194,304).
"""
import pytest

import pyalloc

cp = pytest.importorskip("cupy", reason="needs CuPy")

from gpu_helpers import NEEDS_GPU   # noqa: E402

pytestmark = NEEDS_GPU

import pyalloc.cupy as pc   # noqa: E402

N = 1 << 22                 # float32 elements per array (16 MiB)


@pytest.fixture(autouse=True)
def clean_state():
    if pyalloc.get_default_backend() is not None:
        pyalloc.set_default_backend(None)
    yield
    pc.uninstall()
    cp.cuda.Device().synchronize()
    pyalloc.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()


def capture_body(x):
    """Work with temporaries that die inside the capture; returns the kept output."""
    t1 = x * 2.0
    t2 = t1 + 1.0
    t3 = t2 * 3.0
    out = t3 - 1.0
    del t1, t2, t3
    return out


def arrays_after(stream, count=4):
    with stream:
        arrays = [cp.full(N, 7.0, dtype=cp.float32) for _ in range(count)]
    stream.synchronize()
    return arrays


def overwritten(arrays):
    return sum(int((a != 7.0).sum()) for a in arrays)


def test_replays_of_a_pyalloc_graph_overwrite_no_array_made_after_it():
    pc.install()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(N, dtype=cp.float32)
    s.synchronize()
    with pc.graph(stream=s) as g:
        out = capture_body(x)
    arrays = arrays_after(s)
    for _ in range(3):
        g.launch()
    s.synchronize()
    assert overwritten(arrays) == 0
    assert bool((out == 8.0).all())                  # ((1*2)+1)*3-1


def test_a_capture_cupy_begins_itself_is_protected_too():
    pc.install()                                     # detect_capture="route"
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(N, dtype=cp.float32)
        s.synchronize()
        s.begin_capture()
        out = capture_body(x)
        graph = s.end_capture()
    arrays = arrays_after(s)
    for _ in range(3):
        graph.launch(s)
    s.synchronize()
    assert overwritten(arrays) == 0
    assert bool((out == 8.0).all())


def test_without_detection_a_capture_cupy_begins_itself_is_overwritten():
    # The control: the danger detect_capture removes is real on this GPU.
    pc.install(detect_capture="off")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(N, dtype=cp.float32)
        s.synchronize()
        s.begin_capture()
        capture_body(x)
        graph = s.end_capture()
    arrays = arrays_after(s)
    for _ in range(3):
        graph.launch(s)
    s.synchronize()
    assert overwritten(arrays) > 0


def test_detect_capture_error_refuses_cupys_own_capture():
    pc.install(detect_capture="error")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(N, dtype=cp.float32)
        s.synchronize()
        s.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="pyalloc.cupy.graph"):
                x * 2.0
        finally:
            s.end_capture()


def test_graph_replays_give_the_computed_result_each_time():
    pc.install()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.arange(N, dtype=cp.float32)
    s.synchronize()
    with pc.graph(stream=s) as g:
        with s:
            x += 1.0
    for _ in range(5):
        g.launch()
    s.synchronize()
    assert float(x[10]) == 10.0 + 5.0


def test_the_graphs_pool_is_freed_after_reset():
    pc.install()
    alloc = pyalloc.get_allocator(0)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(N, dtype=cp.float32)
    s.synchronize()
    with pc.graph(stream=s) as g:
        out = capture_body(x)
    assert alloc._pool_info(g.pool())["reserved_bytes"] > 0
    g.launch()
    s.synchronize()
    pool_id = g.pool()
    g.reset()
    del out
    alloc.empty_cache()
    assert alloc._pool_info(pool_id) is None


def test_two_graphs_share_a_pool():
    pc.install()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(N, dtype=cp.float32)
    s.synchronize()
    with pc.graph(stream=s) as g1:
        a = x * 2.0
    with pc.graph(stream=s, pool=g1.pool()) as g2:
        b = a + 1.0
    g1.launch()
    g2.launch()
    s.synchronize()
    assert g1.pool() == g2.pool() and bool((b == 3.0).all())


def test_allocations_on_a_joined_stream_are_in_the_graphs_pool():
    pc.install()
    alloc = pyalloc.get_allocator(0)
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)
    with s1:
        a = cp.ones(N, dtype=cp.float32)
    s1.synchronize()
    with pc.graph(stream=s1) as g:
        e1 = cp.cuda.Event()
        e1.record(s1)
        s2.wait_event(e1)
        with s2:
            b = a * 5.0
            e2 = cp.cuda.Event()
            e2.record(s2)
        s1.wait_event(e2)
    seg = [sg for sg in alloc._segments()
           if sg["address"] <= b.data.ptr < sg["address"] + sg["total_size"]][0]
    assert seg["pool_id"] == g.pool()
    g.launch()
    s1.synchronize()
    assert bool((b == 5.0).all())
