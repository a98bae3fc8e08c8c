"""Specification of SimDevice's stream capture (CUDA graphs), as an allocator sees it.

The expected behaviour is the CUDA 13 driver's, read off an H200 (driver 580, cuda-bindings 13.5)
with a script that made each call here through the runtime API (cudaMemsetAsync as the kernel):
statuses and dependency sets from cudaStreamGetCaptureInfo, errors as returned. Where CUDA was not
asked, the test says so.

SimDevice raises pyalloc.CudaError carrying the driver call, the CUresult and its name; the message
names the stream or event and the runtime's error name (cudaErrorStreamCapture...).
"""

import threading

import pytest

from pyalloc import CachingAllocator, CudaError, SimDevice

from units import MiB
MODES = ["global", "thread_local", "relaxed"]


def cuda_error(name, *words):
    """pytest.raises for a CudaError whose CUresult name ends with `name` (e.g. "UNJOINED") and
    whose message holds each of `words`."""
    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(CudaError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.name.endswith(name), str(err)
            for word in words:
                assert word in str(err), (word, str(err))
            return handled

    return Check()


def in_thread(fn):
    """Run fn() in another thread; its result, or the exception it raised."""
    out = []

    def body():
        try:
            out.append(fn())
        except BaseException as exc:   # noqa: BLE001 - handed back to the test
            out.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def sim():
    return SimDevice()


def fork_join(sim, join_back=True):
    """s1 begins, launch A, record e on s1, s2 waits e, launch B on s2, record e2 on s2, s1 waits
    e2 (when join_back). Returns (s1, s2, A, B)."""
    s1, s2 = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    a = sim.launch(s1)
    sim.wait_event(s2, sim.record_event(s1))
    b = sim.launch(s2)
    if join_back:
        sim.wait_event(s1, sim.record_event(s2))
    return s1, s2, a, b


# ------------------------------------------------------------------------------ begin and end

def test_begin_capture_makes_the_stream_active_with_no_terminals(sim):
    s = sim.create_stream()
    assert sim.capture_status(s) == "none" and sim.stream_capture_info(s) is None
    sim.begin_capture(s)
    assert sim.capture_status(s) == "active"
    assert sim.stream_capture_info(s) == (1, [])


@pytest.mark.parametrize("mode", MODES)
def test_begin_capture_accepts_every_mode(sim, mode):
    s = sim.create_stream()
    sim.begin_capture(s, mode)
    assert sim.capture_status(s) == "active"


def test_unknown_capture_mode_is_rejected(sim):
    with pytest.raises(ValueError, match="'loose'"):
        sim.begin_capture(sim.create_stream(), "loose")


def test_capture_ids_increase_with_each_capture(sim):
    s1, s2 = sim.create_stream(), sim.create_stream()
    ids = []
    for s in (s1, s2, s1):
        sim.begin_capture(s)
        ids.append(sim.stream_capture_info(s)[0])
        sim.end_capture(s)
    assert ids == [1, 2, 3]


def test_end_capture_returns_a_graph_and_ends_the_capture(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    node = sim.launch(s)
    graph = sim.end_capture(s)
    assert graph > 0
    assert sim.capture_status(s) == "none" and sim.stream_capture_info(s) is None
    assert sim.graph_nodes(graph) == [(node, [], [])]


def test_empty_capture_gives_an_empty_graph(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    assert sim.graph_nodes(sim.end_capture(s)) == []


def test_begin_on_the_legacy_stream_is_unsupported(sim):
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED", "cuStreamBeginCapture", "stream 0",
                    "cudaErrorStreamCaptureUnsupported"):
        sim.begin_capture(0)
    assert sim.capture_status(0) == "none"


def test_begin_on_a_capturing_stream_is_illegal_state_and_the_capture_carries_on(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    node = sim.launch(s)
    with cuda_error("ILLEGAL_STATE", f"stream {s}", "capture 1", "cudaErrorIllegalState"):
        sim.begin_capture(s)
    assert sim.stream_capture_info(s) == (1, [node])


def test_begin_on_a_joined_stream_is_illegal_state(sim):
    s1, s2, a, b = fork_join(sim)
    with cuda_error("ILLEGAL_STATE", f"stream {s2}", f"begun on stream {s1}"):
        sim.begin_capture(s2)
    assert sim.capture_status(s2) == "active"


def test_end_on_a_stream_that_is_not_capturing_is_illegal_state(sim):
    s = sim.create_stream()
    with cuda_error("ILLEGAL_STATE", "cuStreamEndCapture", f"stream {s} is not capturing"):
        sim.end_capture(s)


# ------------------------------------------------------------------------------ nodes and terminals

def test_launch_in_capture_adds_a_node_after_the_terminals(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    a = sim.launch(s)
    assert sim.stream_capture_info(s) == (1, [a])
    b = sim.launch(s)
    assert sim.stream_capture_info(s) == (1, [b])
    assert sim.node_parents(a) == [] and sim.node_parents(b) == [a]


def test_launch_in_capture_queues_no_work(sim):
    s = sim.create_stream()
    sim.launch(s, 2)
    sim.begin_capture(s)
    sim.launch(s, 5)
    assert sim.pending(s) == 2
    assert sim.complete(s) == 2       # work from before the capture still runs


def test_launch_in_capture_adds_one_node_whatever_the_count(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    node = sim.launch(s, 7)
    assert [n for n, _, _ in sim.graph_nodes(sim.end_capture(s))] == [node]


def test_launch_in_capture_stores_its_uses_on_the_node(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    a = sim.launch(s, uses=[0x1000, 0x2000])
    b = sim.launch(s)
    assert sim.graph_nodes(sim.end_capture(s)) == [(a, [], [0x1000, 0x2000]), (b, [a], [])]


def test_launch_outside_capture_ignores_uses(sim):
    s = sim.create_stream()
    assert sim.launch(s, 3, uses=[0x1000]) == 3
    assert sim.pending(s) == 3


def test_other_streams_launch_as_usual_during_a_capture(sim):
    s, other = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s)
    assert sim.launch(other, 2) == 2
    assert sim.capture_status(other) == "none"


# ------------------------------------------------------------------------------ fork and join

def test_waiting_on_a_capture_event_joins_the_stream_with_the_events_nodes(sim):
    s1, s2 = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    a = sim.launch(s1)
    e = sim.record_event(s1)
    sim.wait_event(s2, e)
    assert sim.capture_status(s2) == "active"
    assert sim.stream_capture_info(s2) == (1, [a])


def test_fork_join_terminals_are_reported_as_cuda_does(sim):
    s1, s2, a, b = fork_join(sim)
    assert sim.stream_capture_info(s2) == (1, [b])
    # The wait adds B to s1's terminals without dropping A, which B depends on (CUDA prunes nothing).
    assert sim.stream_capture_info(s1) == (1, [a, b])
    c = sim.launch(s1)
    assert sim.node_parents(c) == [a, b]


def test_fork_join_capture_ends_with_every_node(sim):
    s1, s2, a, b = fork_join(sim)
    graph = sim.end_capture(s1)
    assert sim.graph_nodes(graph) == [(a, [], []), (b, [a], [])]
    assert sim.capture_status(s1) == sim.capture_status(s2) == "none"


def test_end_without_joining_back_is_unjoined_and_ends_the_capture(sim):
    s1, s2, a, b = fork_join(sim, join_back=False)
    with cuda_error("STREAM_CAPTURE_UNJOINED", "cuStreamEndCapture", f"stream {s2} (node {b})",
                    f"joined back into stream {s1}", "cudaErrorStreamCaptureUnjoined"):
        sim.end_capture(s1)
    assert sim.capture_status(s1) == sim.capture_status(s2) == "none"
    with pytest.raises(ValueError, match="unknown graph node"):
        sim.node_parents(a)


def test_joined_stream_without_new_work_needs_no_join_back(sim):
    s1, s2 = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    a = sim.launch(s1)
    sim.wait_event(s2, sim.record_event(s1))
    b = sim.launch(s1)
    assert sim.graph_nodes(sim.end_capture(s1)) == [(a, [], []), (b, [a], [])]
    assert sim.capture_status(s2) == "none"


def test_work_forked_before_the_first_node_must_be_joined_back(sim):
    # The event holds no node; s2 joins with no terminals and its node is a root of the graph.
    s1, s2 = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    sim.wait_event(s2, sim.record_event(s1))
    assert sim.stream_capture_info(s2) == (1, [])
    b = sim.launch(s2)
    assert sim.node_parents(b) == []
    with cuda_error("STREAM_CAPTURE_UNJOINED", f"stream {s2} (node {b})"):
        sim.end_capture(s1)


def test_waits_on_several_capture_events_add_all_their_nodes(sim):
    s1, s2, s3 = sim.create_stream(), sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    e = sim.record_event(s1)
    sim.wait_event(s2, e)
    sim.wait_event(s3, e)
    b, c = sim.launch(s2), sim.launch(s3)
    sim.wait_event(s1, sim.record_event(s2))
    sim.wait_event(s1, sim.record_event(s3))
    assert sim.stream_capture_info(s1) == (1, [b, c])
    d = sim.launch(s1)
    assert sim.node_parents(d) == [b, c]
    sim.end_capture(s1)


def test_wait_on_an_event_of_the_streams_own_terminals_changes_nothing(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    a = sim.launch(s)
    sim.wait_event(s, sim.record_event(s))
    assert sim.stream_capture_info(s) == (1, [a])


def test_recording_an_existing_event_in_capture_makes_it_a_capture_event(sim):
    s1, s2 = sim.create_stream(), sim.create_stream()
    e = sim.record_event(s1)                # ordinary, before the capture
    sim.begin_capture(s1)
    a = sim.launch(s1)
    assert sim.record_event(s1, event=e) == e
    sim.wait_event(s2, e)
    assert sim.stream_capture_info(s2) == (1, [a])


def test_end_on_a_joined_stream_is_unmatched_and_invalidates_the_capture(sim):
    s1, s2, a, b = fork_join(sim)
    with cuda_error("STREAM_CAPTURE_UNMATCHED", f"stream {s2} joined capture 1",
                    f"began on stream {s1}", "cudaErrorStreamCaptureUnmatched"):
        sim.end_capture(s2)
    assert sim.capture_status(s1) == sim.capture_status(s2) == "invalidated"
    with cuda_error("STREAM_CAPTURE_INVALIDATED"):
        sim.end_capture(s1)
    assert sim.capture_status(s1) == sim.capture_status(s2) == "none"


# ------------------------------------------------------------------------------ isolation

def test_wait_on_another_captures_event_is_a_merge_error_and_invalidates_both(sim):
    # CUDA returns cudaErrorStreamCaptureMerge here (not ...Isolation) and invalidates both.
    s1, s3 = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    sim.launch(s1)
    e = sim.record_event(s1)
    sim.begin_capture(s3)
    sim.launch(s3)
    with cuda_error("STREAM_CAPTURE_MERGE", "cuStreamWaitEvent", f"stream {s3} of capture 2",
                    f"event {e} of capture 1", "cudaErrorStreamCaptureMerge"):
        sim.wait_event(s3, e)
    assert sim.capture_status(s1) == sim.capture_status(s3) == "invalidated"


def test_wait_in_capture_on_an_ordinary_event_is_an_isolation_error(sim):
    # CUDA refuses a dependency that crosses the capture's boundary (cudaErrorStreamCaptureIsolation)
    # and invalidates the capture, unless the wait is external (cudaEventWaitExternal).
    s1, other = sim.create_stream(), sim.create_stream()
    sim.launch(other)
    e = sim.record_event(other)
    sim.begin_capture(s1)
    with cuda_error("STREAM_CAPTURE_ISOLATION", f"stream {s1} waited on event {e}",
                    "cudaErrorStreamCaptureIsolation"):
        sim.wait_event(s1, e)
    assert sim.capture_status(s1) == "invalidated"


def test_non_capturing_stream_may_wait_on_an_ordinary_event_during_a_capture(sim):
    s1, s2, other = sim.create_stream(), sim.create_stream(), sim.create_stream()
    sim.launch(other)
    e = sim.record_event(other)
    sim.begin_capture(s1)
    sim.wait_event(s2, e)
    assert sim.capture_status(s2) == "none" and sim.capture_status(s1) == "active"


def test_external_wait_in_capture_adds_an_event_wait_node(sim):
    s1, other = sim.create_stream(), sim.create_stream()
    e = sim.record_event(other)
    sim.begin_capture(s1)
    a = sim.launch(s1)
    sim.wait_event(s1, e, external=True)
    (_, [w]) = sim.stream_capture_info(s1)
    assert w != a and sim.node_parents(w) == [a]
    b = sim.launch(s1)
    assert sim.node_parents(b) == [w]
    sim.end_capture(s1)


def test_wait_in_capture_on_a_never_recorded_event_is_a_no_op(sim):
    # Not checked against CUDA in capture (outside capture such a wait is a no-op there).
    s = sim.create_stream()
    sim.begin_capture(s)
    a = sim.launch(s)
    sim.wait_event(s, sim.create_event())
    assert sim.stream_capture_info(s) == (1, [a])


def test_legacy_stream_cannot_join_a_capture(sim):
    # Not checked against CUDA: stream 0 cannot be captured, so it cannot join one either.
    s = sim.create_stream()
    sim.begin_capture(s)
    e = sim.record_event(s)
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED", "stream 0", f"event {e}"):
        sim.wait_event(0, e)
    assert sim.capture_status(0) == "none" and sim.capture_status(s) == "invalidated"


# ------------------------------------------------------------------------------ illegal calls

def capture_with_event(sim, mode):
    """A stream capturing in `mode` with one node, and an event recorded after it."""
    s = sim.create_stream()
    sim.begin_capture(s, mode)
    sim.launch(s)
    return s, sim.record_event(s)


@pytest.mark.parametrize("mode", MODES)
def test_querying_a_capture_event_raises_and_invalidates_in_every_mode(sim, mode):
    s, e = capture_with_event(sim, mode)
    with cuda_error("CAPTURED_EVENT", "cuEventQuery", f"event {e}", "capture 1",
                    "cudaErrorCapturedEvent"):
        sim.event_done(e)
    assert sim.capture_status(s) == "invalidated"
    assert sim.stream_capture_info(s) is None


@pytest.mark.parametrize("mode", MODES)
def test_synchronizing_a_capture_event_raises_and_invalidates_in_every_mode(sim, mode):
    s, e = capture_with_event(sim, mode)
    with cuda_error("CAPTURED_EVENT", "cuEventSynchronize", f"event {e}"):
        sim.synchronize_event(e)
    assert sim.capture_status(s) == "invalidated"


@pytest.mark.parametrize("mode", MODES)
def test_synchronizing_a_capturing_stream_raises_and_invalidates_in_every_mode(sim, mode):
    s, _ = capture_with_event(sim, mode)
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED", "cuStreamSynchronize", f"stream {s}",
                    "cudaErrorStreamCaptureUnsupported"):
        sim.synchronize_stream(s)
    assert sim.capture_status(s) == "invalidated"


def test_synchronizing_a_joined_stream_invalidates_the_whole_capture(sim):
    s1, s2, a, b = fork_join(sim)
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED", f"stream {s2}"):
        sim.synchronize_stream(s2)
    assert sim.capture_status(s1) == sim.capture_status(s2) == "invalidated"


@pytest.mark.parametrize("mode", MODES)
def test_device_synchronize_in_capture_raises_and_invalidates_in_every_mode(sim, mode):
    s, _ = capture_with_event(sim, mode)
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED", "cuCtxSynchronize", "capture 1"):
        sim.synchronize()
    assert sim.capture_status(s) == "invalidated"


def ordinary_event(sim):
    other = sim.create_stream()
    sim.launch(other)
    return other, sim.record_event(other)


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_querying_an_ordinary_event_in_a_strict_capture_raises_and_invalidates(sim, mode):
    other, e = ordinary_event(sim)
    s, _ = capture_with_event(sim, mode)
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED", "cuEventQuery", f"query of event {e}",
                    f"capture 1 ({mode} mode, stream {s}, this thread)"):
        sim.event_done(e)
    assert sim.capture_status(s) == "invalidated"


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_synchronizing_an_ordinary_event_or_other_stream_in_a_strict_capture_raises(sim, mode):
    other, e = ordinary_event(sim)
    for call in (lambda: sim.synchronize_event(e), lambda: sim.synchronize_stream(other)):
        s, _ = capture_with_event(sim, mode)
        with cuda_error("STREAM_CAPTURE_UNSUPPORTED"):
            call()
        assert sim.capture_status(s) == "invalidated"
        with cuda_error("STREAM_CAPTURE_INVALIDATED"):
            sim.end_capture(s)


def test_ordinary_events_and_other_streams_may_be_queried_and_synced_in_a_relaxed_capture(sim):
    other, e = ordinary_event(sim)
    s, _ = capture_with_event(sim, "relaxed")
    assert sim.event_done(e) is False
    sim.synchronize_event(e)
    assert sim.event_done(e) is True
    sim.launch(other)
    sim.synchronize_stream(other)
    assert sim.pending(other) == 0
    assert sim.capture_status(s) == "active"
    sim.end_capture(s)


def test_another_thread_is_refused_unsafe_calls_during_a_global_capture(sim):
    other, e = ordinary_event(sim)
    s, _ = capture_with_event(sim, "global")
    err = in_thread(lambda: sim.event_done(e))
    assert isinstance(err, CudaError) and err.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert "another thread" in str(err)
    assert sim.capture_status(s) == "invalidated"


@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_another_thread_may_make_unsafe_calls_during_a_thread_local_or_relaxed_capture(sim, mode):
    other, e = ordinary_event(sim)
    s, _ = capture_with_event(sim, mode)
    assert in_thread(lambda: sim.event_done(e)) is False
    assert in_thread(lambda: sim.synchronize_stream(other)) is None
    assert sim.capture_status(s) == "active"


@pytest.mark.parametrize("mode", MODES)
def test_another_thread_may_not_query_a_capture_event_in_any_mode(sim, mode):
    s, e = capture_with_event(sim, mode)
    err = in_thread(lambda: sim.event_done(e))
    assert isinstance(err, CudaError) and err.name == "CUDA_ERROR_CAPTURED_EVENT"
    assert sim.capture_status(s) == "invalidated"


def test_relaxed_thread_mode_allows_unsafe_calls_during_a_global_capture(sim):
    other, e = ordinary_event(sim)
    s, _ = capture_with_event(sim, "global")
    assert sim.exchange_capture_mode("relaxed") == "global"
    try:
        assert sim.event_done(e) is False
    finally:
        assert sim.exchange_capture_mode("global") == "relaxed"
    assert sim.capture_status(s) == "active"
    with cuda_error("STREAM_CAPTURE_UNSUPPORTED"):
        sim.event_done(e)


def test_thread_local_thread_mode_ignores_other_threads_global_captures(sim):
    other, e = ordinary_event(sim)
    s, _ = capture_with_event(sim, "global")

    def query():
        sim.exchange_capture_mode("thread_local")
        return sim.event_done(e)

    assert in_thread(query) is False
    assert sim.capture_status(s) == "active"


def test_invalidated_capture_reports_no_capture_info(sim):
    s, e = capture_with_event(sim, "global")
    with pytest.raises(CudaError):
        sim.event_done(e)
    assert sim.stream_capture_info(s) is None
    assert sim.capture_status(s) == "invalidated"


def test_invalidated_capture_refuses_launch_record_and_wait(sim):
    s, e = capture_with_event(sim, "global")
    with pytest.raises(CudaError):
        sim.synchronize_stream(s)
    with cuda_error("STREAM_CAPTURE_INVALIDATED", "cuLaunchKernel", f"stream {s}",
                    f"synchronize of stream {s}"):
        sim.launch(s)
    with cuda_error("STREAM_CAPTURE_INVALIDATED", "cuEventRecord"):
        sim.record_event(s)
    with cuda_error("STREAM_CAPTURE_INVALIDATED", "cuStreamWaitEvent"):
        sim.wait_event(sim.create_stream(), e)


def test_end_of_an_invalidated_capture_raises_invalidated_and_ends_it(sim):
    s, e = capture_with_event(sim, "global")
    with pytest.raises(CudaError):
        sim.event_done(e)
    with cuda_error("STREAM_CAPTURE_INVALIDATED", "cuStreamEndCapture", "capture 1",
                    f"query of event {e}", "cudaErrorStreamCaptureInvalidated"):
        sim.end_capture(s)
    assert sim.capture_status(s) == "none"
    sim.begin_capture(s)                     # the stream can capture again
    assert sim.stream_capture_info(s) == (2, [])


def test_capture_event_is_invalid_after_its_capture_ends_until_recorded_again(sim):
    s, e = capture_with_event(sim, "global")
    sim.end_capture(s)
    for call in (lambda: sim.event_done(e), lambda: sim.synchronize_event(e),
                 lambda: sim.wait_event(sim.create_stream(), e)):
        with cuda_error("INVALID_VALUE", f"event {e}", "capture 1", "has ended"):
            call()
    sim.record_event(s, event=e)
    assert sim.event_done(e) is True


def test_capture_event_may_be_destroyed_during_the_capture(sim):
    s, e = capture_with_event(sim, "global")
    sim.destroy_event(e)
    assert sim.capture_status(s) == "active"
    sim.end_capture(s)


def test_end_from_another_thread_is_wrong_thread_and_ends_the_capture(sim):
    s, _ = capture_with_event(sim, "global")
    err = in_thread(lambda: sim.end_capture(s))
    assert isinstance(err, CudaError) and err.name == "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"
    assert f"stream {s}" in str(err) and "global mode" in str(err)
    assert sim.capture_status(s) == "none"


def test_end_from_another_thread_is_allowed_in_relaxed_mode(sim):
    s, _ = capture_with_event(sim, "relaxed")
    graph = in_thread(lambda: sim.end_capture(s))
    assert len(sim.graph_nodes(graph)) == 1


def test_memory_calls_stay_legal_during_a_global_capture_and_are_counted(sim):
    alloc = CachingAllocator(backend=sim)
    expandable = CachingAllocator(backend=sim, config="expandable_segments:True")
    s, _ = capture_with_event(sim, "global")
    p = alloc.malloc(MiB, s)
    q = expandable.malloc(MiB, s)
    alloc.free(p)
    alloc.empty_cache()
    assert sim.counters["segment_alloc"] == sim.counters["segment_free"] == 1
    assert sim.counters["vm_reserve"] == sim.counters["vm_map"] == 1
    assert sim.counters["memory_calls_during_capture"] == 4
    assert sim.capture_status(s) == "active"
    sim.end_capture(s)
    expandable.free(q)
    alloc.malloc(MiB)
    assert sim.counters["memory_calls_during_capture"] == 4


# ------------------------------------------------------------------------------ node parents

def test_node_parents_walks_the_capture_and_the_graph(sim):
    s1, s2, a, b = fork_join(sim)
    c = sim.launch(s1)
    assert sim.node_parents(b) == [a] and sim.node_parents(c) == [a, b]
    sim.end_capture(s1)
    assert sim.node_parents(c) == [a, b]


def test_node_parents_of_an_unknown_node_raises(sim):
    with pytest.raises(ValueError, match="unknown graph node 99"):
        sim.node_parents(99)


def test_ancestors_and_is_ancestor_follow_parents_transitively(sim):
    s1, s2, a, b = fork_join(sim)
    c = sim.launch(s1)
    d = sim.launch(s2)            # after b, not joined with c
    assert sim.ancestors([c]) == {a, b}
    assert sim.ancestors([c, d]) == {a, b}
    assert sim.is_ancestor(a, [c]) and sim.is_ancestor(b, [d])
    assert not sim.is_ancestor(c, [d]) and not sim.is_ancestor(d, [c])
    assert not sim.is_ancestor(c, [c])


def test_uses_and_ancestry_tell_safe_reuse_from_unsafe(sim):
    # Block p is used by A on s1. Reused by a kernel on s2 that waited for A: safe; by one on a
    # stream that joined before A ran: unsafe (nothing orders A before it).
    p = 0x7F0000000000
    s1, s2, s3 = sim.create_stream(), sim.create_stream(), sim.create_stream()
    sim.begin_capture(s1)
    sim.wait_event(s3, sim.record_event(s1))      # s3 forks before A
    a = sim.launch(s1, uses=[p])
    sim.wait_event(s2, sim.record_event(s1))      # s2 forks after A
    safe = sim.launch(s2, uses=[p])
    unsafe = sim.launch(s3, uses=[p])
    for s in (s2, s3):
        sim.wait_event(s1, sim.record_event(s))
    nodes = sim.graph_nodes(sim.end_capture(s1))
    users = [n for n, _, uses in nodes if p in uses]
    assert users == [a, safe, unsafe]
    assert sim.is_ancestor(a, [safe]) and not sim.is_ancestor(a, [unsafe])


# ------------------------------------------------------------------------------ graph launch

def captured_graph(sim, counts=(1,)):
    s = sim.create_stream()
    sim.begin_capture(s)
    for c in counts:
        sim.launch(s, c)
    return sim.end_capture(s)


def test_graph_launch_queues_each_kernel_nodes_work(sim):
    graph = captured_graph(sim, counts=(2, 3))
    s = sim.create_stream()
    sim.launch_graph(graph, s)
    assert sim.pending(s) == 5
    sim.launch_graph(graph, s)
    assert sim.pending(s) == 10


def test_event_after_graph_launch_completes_only_when_the_replay_completes(sim):
    graph = captured_graph(sim, counts=(2,))
    s = sim.create_stream()
    sim.launch_graph(graph, s)
    e = sim.record_event(s)
    sim.complete(s, 1)
    assert not sim.event_done(e)
    sim.complete(s)
    assert sim.event_done(e)


def test_graph_launch_waits_for_its_external_events(sim):
    other = sim.create_stream()
    sim.launch(other)
    ext = sim.record_event(other)
    s1 = sim.create_stream()
    sim.begin_capture(s1)
    sim.wait_event(s1, ext, external=True)
    sim.launch(s1)
    graph = sim.end_capture(s1)
    s = sim.create_stream()
    sim.launch_graph(graph, s)
    e = sim.record_event(s)
    sim.synchronize_event(e)                      # finishes the awaited work on `other` first
    assert sim.pending(other) == 0 and sim.pending(s) == 0


def test_graph_launched_into_a_capture_becomes_one_node(sim):
    s0 = sim.create_stream()
    sim.begin_capture(s0)
    sim.launch(s0, 2, uses=[0x1000])
    sim.launch(s0, 3, uses=[0x2000, 0x1000])
    inner = sim.end_capture(s0)
    s = sim.create_stream()
    sim.begin_capture(s)
    a = sim.launch(s)
    sim.launch_graph(inner, s)
    (_, [child]) = sim.stream_capture_info(s)
    assert sim.node_parents(child) == [a]
    outer = sim.end_capture(s)
    assert sim.graph_nodes(outer)[-1] == (child, [a], [0x1000, 0x2000])
    target = sim.create_stream()
    sim.launch_graph(outer, target)
    assert sim.pending(target) == 6


def test_graph_launch_needs_no_capture_of_the_stream_and_is_legal_during_one(sim):
    graph = captured_graph(sim)
    s, _ = capture_with_event(sim, "global")
    other = sim.create_stream()
    sim.launch_graph(graph, other)
    assert sim.pending(other) == 1 and sim.capture_status(s) == "active"


def test_destroyed_graph_is_gone(sim):
    graph = captured_graph(sim)
    (node, _, _), = sim.graph_nodes(graph)
    sim.destroy_graph(graph)
    with pytest.raises(ValueError, match=f"unknown graph handle {graph}"):
        sim.launch_graph(graph, sim.create_stream())
    with pytest.raises(ValueError, match="unknown graph node"):
        sim.node_parents(node)
    with pytest.raises(ValueError, match=f"unknown graph handle {graph}"):
        sim.destroy_graph(graph)


# ------------------------------------------------------------------------------ counters and the rest

def test_capture_calls_are_counted(sim):
    s = sim.create_stream()
    sim.begin_capture(s)
    node = sim.launch(s)
    sim.stream_capture_info(s)
    sim.node_parents(node)
    graph = sim.end_capture(s)
    sim.launch_graph(graph, s)
    sim.destroy_graph(graph)
    with pytest.raises(CudaError):
        sim.end_capture(s)
    c = sim.counters
    assert (c["capture_begin"], c["capture_end"], c["capture_info"], c["node_dependencies"],
            c["graph_launch"], c["graph_destroy"]) == (1, 2, 1, 1, 1, 1)


def test_device_works_as_before_once_a_capture_ends(sim):
    s, other = sim.create_stream(), sim.create_stream()
    sim.begin_capture(s)
    sim.launch(s)
    sim.end_capture(s)
    assert sim.launch(s) == 1
    e = sim.record_event(s)
    sim.wait_event(other, e)
    sim.launch(other)
    assert not sim.event_done(e)
    sim.synchronize()
    assert sim.event_done(e) and sim.pending(other) == 0
