"""Property test: no pinned host block is handed out while a copy that uses it is queued.

A hypothesis state machine drives a HostAllocator on SimDevice(check_reuse=True): malloc and free
of blocks of a few sizes, copies between a live block and the device queued on streams (each
followed by record_event(block, stream), as a correct program does), stream progress, device
synchronisation, empty_cache, a host or event call made to fail, and CUDA-graph capture: a
capture begun on a stream (mallocs then pass that stream, copies on it become graph nodes),
ended, and its graph replayed on a stream. The sanitizer checks every block handed out
(ReuseError: a queued copy, or a replay's, still uses it); a block a captured copy used is never
handed out again (the graph may replay at any time), and no capture is invalidated by the
allocator's event calls. After every step the machine checks that no two blocks overlap and
that the statistics count the blocks as they are. An operation whose call failed must leave the
blocks and statistics as they were.

PYALLOC_SANITIZER_EXAMPLES sets the number of examples, as for tests/test_reuse_machine.py.
"""
import os

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyalloc import CudaError, SimDevice
from pyalloc.host import HostAllocator

from units import KiB
SIZES = st.sampled_from([100, 4 * KiB, 4 * KiB, 6 * KiB, 64 * KiB])
CONFIGS = ["", "pinned_use_cuda_host_register:True,pinned_num_register_threads:4",
           "pinned_reserve_segment_size_mb:1"]
FAILING = [("host", "host_alloc"), ("host", "host_register"), ("host", "host_free"),
           ("host", "host_unregister"), ("device", "event_record"), ("device", "event_query"),
           ("device", "event_create")]
EXAMPLES = int(os.environ.get("PYALLOC_SANITIZER_EXAMPLES", "150"))


class HostReuseMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config):
        self.dev = SimDevice(check_reuse=True)
        self.h = HostAllocator(self.dev, config=config)
        self.streams = [0] + [self.dev.create_stream() for _ in range(2)]
        self.live = []                      # pointers handed out and not freed
        self.capturing = None               # the stream a capture runs on, or None
        self.graph_used = set()             # blocks a captured copy used: never handed out again
        self.graphs = []

    @rule(size=SIZES)
    def malloc(self, size):
        ptr = self.h.malloc(size, self.capturing)
        assert ptr not in self.graph_used
        self.live.append(ptr)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        self.h.free(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), s=st.integers(0, 2), units=st.integers(1, 3))
    def copy(self, i, s, units):
        ptr = self.live[i % len(self.live)]
        stream = self.streams[s] if self.capturing is None else self.capturing
        self.h.host.copy(stream, ptr, self.h.block_size(ptr), count=units)
        self.h.record_event(ptr, stream)
        if self.capturing is not None:
            self.graph_used.add(ptr)

    @precondition(lambda self: self.capturing is None)
    @rule(s=st.integers(1, 2))
    def begin_capture(self, s):
        self.capturing = self.streams[s]
        self.dev.begin_capture(self.capturing)

    @precondition(lambda self: self.capturing is not None)
    @rule()
    def end_capture(self):
        # Raises when an event call of the allocator invalidated the capture.
        self.graphs.append(self.dev.end_capture(self.capturing))
        self.capturing = None

    @precondition(lambda self: self.capturing is None and self.graphs)
    @rule(g=st.integers(0, 99), s=st.integers(0, 2))
    def replay(self, g, s):
        self.dev.launch_graph(self.graphs[g % len(self.graphs)], self.streams[s])

    @precondition(lambda self: self.capturing is None)
    @rule(s=st.integers(0, 2), units=st.integers(1, 3))
    def progress(self, s, units):
        self.dev.complete(self.streams[s], units)

    @precondition(lambda self: self.capturing is None)
    @rule()
    def synchronize(self):
        self.dev.synchronize()

    @precondition(lambda self: self.capturing is None)
    @rule()
    def empty_cache(self):
        self.h.empty_cache()

    @precondition(lambda self: self.capturing is None)
    @rule(which=st.sampled_from(FAILING), op=st.sampled_from(["malloc", "free", "empty_cache"]),
          size=SIZES, i=st.integers(0, 99))
    def failing_call(self, which, op, size, i):
        target = self.h.host if which[0] == "host" else self.dev
        # Completed events are collected first: an allocation collects them before it looks for
        # a block (as PyTorch's), which is not the failed call's doing.
        self.h.poll_events()
        before = (self.h.block_list(), self.h.stats())
        target.fail_next(which[1])
        try:
            if op == "malloc":
                self.live.append(self.h.malloc(size))
            elif op == "free" and self.live:
                ptr = self.live[i % len(self.live)]
                self.h.free(ptr)
                self.live.remove(ptr)
            elif op == "empty_cache":
                self.h.empty_cache()
        except CudaError:
            if op != "empty_cache":     # a failed empty_cache keeps what it had not freed yet
                assert (self.h.block_list(), self.h.stats()) == before
        finally:
            target.fail_next(which[1], 0)

    @invariant()
    def blocks_do_not_overlap(self):
        if not hasattr(self, "h"):
            return
        blocks = self.h.block_list()
        for (a, n, _), (b, _, _) in zip(blocks, blocks[1:]):
            assert a + n <= b

    @invariant()
    def statistics_count_the_blocks(self):
        if not hasattr(self, "h"):
            return
        blocks = self.h.block_list()
        s = self.h.stats()
        in_use = [n for _, n, state in blocks if state != "free"]
        assert (s["active_requests"]["current"], s["active_bytes"]["current"]) == (
            len(in_use), sum(in_use))
        assert (s["allocations"]["current"], s["allocated_bytes"]["current"]) == (
            len(blocks), sum(n for _, n, _ in blocks))
        assert sorted(self.live) == sorted(p for p, _, state in blocks if state == "allocated")


HostReuseMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=int(os.environ.get("PYALLOC_SANITIZER_STEPS", "50")),
    deadline=None)
test_no_host_block_is_reused_while_a_copy_uses_it = HostReuseMachine.TestCase
