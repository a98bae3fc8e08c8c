"""Property test: the reuse sanitizer (SimDevice(check_reuse=True)) never fires on programs that use
the allocator correctly from two threads, with private-pool scopes, graph captures in every mode,
record_stream on side streams with real kernels using the blocks, process_events, and driver calls
made to fail.

A hypothesis state machine drives one CachingAllocator from two real worker threads (each rule's
body runs on one of them, synchronously, so thread keys and per-thread capture modes are real):
malloc and free; kernels that use a live block on its stream or, after record_stream, on another
(queued for real, or captured when the stream is in a capture); joins between streams that CUDA
allows (an event recorded in one stream waited on in another, never a capture-isolation or merge
error); use_mem_pool scopes (MemPool API); captures with private pools (allocator.graph, global,
thread_local or relaxed mode) that other streams join and are joined back before they end; graph
replays and resets; stream progress; process_events and empty_cache; and an allocator operation
(malloc, free, record_stream, process_events, empty_cache) during which a driver call fails
(SimDevice.fail_next). Kernels only use live blocks, and a graph is replayed only while every
block it used that is not its own pool's is still the allocation it used.

The sanitizer checks every block the allocator hands out: ReuseError means a block was handed out
while a queued or captured kernel that is not ordered before the receiving stream's next work still
uses it. The machine also fails on any CudaError that no injected failure explains (the program
makes no call CUDA refuses, so one comes from the allocator), and after every step checks the
allocator's invariants (_check_invariants), that no two live allocations overlap, that the
statistics count the live ones and that reserved bytes are the device memory the allocator holds,
within the device's capacity. The settings include recycle_pages, under which the device also
refuses a page mapped twice and a block handed out with a page of its expandable segment
unmapped. An operation whose driver call failed must leave the allocations and statistics as
they were.

PYALLOC_SANITIZER_EXAMPLES sets the number of examples (tools/soak_sanitizer.py runs more).
"""
import os
import queue
import threading

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyalloc import CachingAllocator, CudaError, OutOfMemoryError, SimDevice

from units import KiB, MiB
REUSE = "graph_capture_record_stream_reuse:True"
CONFIGS = ["", REUSE, REUSE + ",graph_capture_cross_stream_reuse:True",
           REUSE + ",graph_capture_last_use_marks:True", "expandable_segments:True",
           "max_split_size_mb:20", "expandable_segments:True,recycle_pages:True"]
# Few sizes, mostly small: freed blocks come back often, which is where reuse goes wrong.
SIZES = st.sampled_from([4 * KiB] * 4 + [512 * KiB, 3 * MiB, 12 * MiB])
WORKERS = 2
NUM_STREAMS = 4           # stream 0 and three created ones
MODES = ("global", "thread_local", "relaxed")
# Driver calls the allocator makes that may fail under it (capture begin/end are the program's).
FAILING_CALLS = ("segment_alloc", "segment_free", "event_create", "event_record", "event_query",
                 "event_destroy", "capture_info", "node_dependencies", "vm_reserve", "vm_map",
                 "vm_unmap", "vm_release", "vm_unmap_keep", "vm_map_handles", "vm_free_handles")
FAILING_OPS = ("malloc", "free", "record_stream", "process_events", "empty_cache")
EXAMPLES = int(os.environ.get("PYALLOC_SANITIZER_EXAMPLES", "150"))


class Worker:
    """A thread that runs the functions given to call() one at a time; call() waits for the
    result (or re-raises the exception) in the calling thread."""

    def __init__(self, name):
        self.jobs = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as err:          # handed to the caller
                box.append((False, err))
            done.set()

    def call(self, fn):
        box, done = [], threading.Event()
        self.jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value


# The same two threads serve every example (their thread keys differ from the main thread's).
_WORKERS = [Worker(f"reuse-machine-{i}") for i in range(WORKERS)]


class Block:
    __slots__ = ("size", "stream", "serial", "capture")

    def __init__(self, size, stream, serial, capture):
        self.size, self.stream, self.serial, self.capture = size, stream, serial, capture


class Capture:
    """A capture a worker runs: its Graph, the capture id, the blocks allocated in it (serials)
    and the blocks of others its kernels used (serials)."""

    def __init__(self, graph, capture_id, mode):
        self.graph, self.id, self.mode = graph, capture_id, mode
        self.own, self.foreign = set(), set()


class ReuseMachine(RuleBasedStateMachine):

    @initialize(config=st.sampled_from(CONFIGS))
    def make(self, config):
        self.sim = SimDevice(1 << 30, check_reuse=True)
        self.alloc = CachingAllocator(backend=self.sim, config=config)
        self.streams = [0] + [self.sim.create_stream() for _ in range(NUM_STREAMS - 1)]
        self.live = {}                  # ptr -> Block
        self.serial = 0
        self.captures = {}              # worker -> Capture
        self.graphs = []                # (Graph, serials of foreign blocks it uses)
        self.scopes = {}                # worker -> (MemPool, entered context manager)
        self.kept_pools = []            # MemPools of ended scopes, not released yet

    def teardown(self):
        # Cleanup only: a failure here must not hide the one the example is reported for.
        if not hasattr(self, "sim"):
            return
        for call in list(self.sim.armed_failures()):
            self.sim.fail_next(call, 0)
        for w in list(self.captures):
            try:
                self.end_capture_of(w)
            except Exception:
                pass
        for w in list(self.scopes):
            try:
                self.end_scope_of(w)
            except Exception:
                pass
        for pool in self.kept_pools:
            try:
                pool.release()
            except Exception:
                pass
        for g, _ in self.graphs:
            try:
                g.reset()
            except Exception:
                pass

    # ------------------------------------------------------------------------- helpers

    def on(self, w, fn):
        return _WORKERS[w].call(fn)

    def capture_of(self, stream):
        """The id of the live capture `stream` is in, or None."""
        info = self.sim.stream_capture_info(stream)
        return None if info is None else info[0]

    def capture_by_id(self, capture_id):
        return next((c for c in self.captures.values() if c.id == capture_id), None)

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.live)), label="ptr")

    def join(self, into, frm):
        self.sim.wait_event(into, self.sim.record_event(frm))

    def can_join(self, into, frm):
        """Whether CUDA lets `into` wait on an event recorded now in `frm`."""
        if into == frm or into == 0:
            return False
        c_into, c_frm = self.capture_of(into), self.capture_of(frm)
        if c_frm is None:
            return c_into is None           # a capturing stream waiting on real work: isolation
        return c_into is None or c_into == c_frm

    def allocation_state(self):
        stats = self.alloc.memory_stats()
        keys = ("allocation.all.current", "allocated_bytes.all.current", "active.all.current",
                "active_bytes.all.current", "reserved_bytes.all.current", "segment.all.current")
        blocks = sorted((b["address"], b["size"], b["allocated"]) for s in self.alloc._segments()
                        for b in s["blocks"])
        return {k: stats[k] for k in keys}, blocks

    # ------------------------------------------------------------------------- memory

    def do_malloc(self, w, size, stream):
        return self.note_malloc(self.on(w, lambda: self.alloc.malloc(size, stream)), size, stream)

    def note_malloc(self, ptr, size, stream):
        assert ptr not in self.live, f"{ptr:#x} handed out twice"
        self.serial += 1
        in_capture = self.capture_of(stream)
        block = Block(size, stream, self.serial, in_capture)
        if in_capture is not None:
            owner = self.capture_by_id(in_capture)
            if owner is not None:
                owner.own.add(self.serial)
        self.live[ptr] = block
        return ptr

    @rule(w=st.integers(0, WORKERS - 1), size=SIZES, si=st.integers(0, NUM_STREAMS - 1))
    def malloc(self, w, size, si):
        try:
            self.do_malloc(w, size, self.streams[si])
        except OutOfMemoryError:
            pass

    @precondition(lambda self: self.live)
    @rule(w=st.integers(0, WORKERS - 1), data=st.data())
    def free(self, w, data):
        ptr = self.pick(data)
        self.on(w, lambda: self.alloc.free(ptr))
        del self.live[ptr]

    @precondition(lambda self: self.live)
    @rule(w=st.integers(0, WORKERS - 1), data=st.data(), si=st.integers(0, NUM_STREAMS - 1),
          work=st.integers(1, 3))
    def use(self, w, data, si, work):
        """A kernel on a stream using a live block (record_stream first on another stream)."""
        ptr = self.pick(data)
        block = self.live[ptr]
        stream = self.streams[si]

        def body():
            if stream != block.stream:
                self.alloc.record_stream(ptr, stream)
            self.sim.launch(stream, work, uses=[(ptr, block.size)])
        self.on(w, body)
        cap = self.capture_of(stream)
        if cap is not None:
            owner = self.capture_by_id(cap)
            if owner is not None and block.serial not in owner.own:
                owner.foreign.add(block.serial)

    @precondition(lambda self: self.live)
    @rule(w=st.integers(0, WORKERS - 1), data=st.data(), offset=st.integers(1, NUM_STREAMS - 1),
          work=st.integers(1, 3))
    def use_on_another_stream_then_free(self, w, data, offset, work):
        ptr = self.pick(data)
        block = self.live[ptr]
        stream = self.streams[(self.streams.index(block.stream) + offset) % NUM_STREAMS]
        self.use(w, _Fixed(ptr), self.streams.index(stream), work)
        self.on(w, lambda: self.alloc.free(ptr))
        del self.live[ptr]

    # ------------------------------------------------------------------------- work

    @rule(si=st.integers(0, NUM_STREAMS - 1), count=st.integers(1, 3))
    def launch(self, si, count):
        self.sim.launch(self.streams[si], count)

    @rule(si=st.integers(0, NUM_STREAMS - 1), count=st.one_of(st.none(), st.integers(1, 3)))
    def complete(self, si, count):
        self.sim.complete(self.streams[si], count)

    @rule(into=st.integers(0, NUM_STREAMS - 1), frm=st.integers(0, NUM_STREAMS - 1))
    def join_streams(self, into, frm):
        into, frm = self.streams[into], self.streams[frm]
        if self.can_join(into, frm):
            self.join(into, frm)

    @rule(w=st.integers(0, WORKERS - 1))
    def process_events(self, w):
        self.on(w, self.alloc.process_events)

    @rule(w=st.integers(0, WORKERS - 1))
    def empty_cache(self, w):
        self.on(w, self.alloc.empty_cache)

    # ------------------------------------------------------------------------- scopes

    @rule(w=st.integers(0, WORKERS - 1))
    def begin_scope(self, w):
        if w in self.scopes:
            return
        pool = self.alloc.mem_pool()
        scope = self.alloc.use_mem_pool(pool)
        self.on(w, scope.__enter__)
        self.scopes[w] = (pool, scope)

    def end_scope_of(self, w, release=True):
        pool, scope = self.scopes.pop(w)
        self.on(w, lambda: scope.__exit__(None, None, None))
        if release:
            self.on(w, pool.release)
        else:
            self.kept_pools.append(pool)

    @precondition(lambda self: self.scopes)
    @rule(data=st.data(), release=st.booleans())
    def end_scope(self, data, release):
        """The scope ends; its MemPool is released now, or kept (a program that holds on to its
        pool object: releasing it frees segments, which finishes all queued work)."""
        self.end_scope_of(data.draw(st.sampled_from(sorted(self.scopes)), label="worker"), release)

    @precondition(lambda self: self.kept_pools)
    @rule(w=st.integers(0, WORKERS - 1))
    def release_kept_pool(self, w):
        self.on(w, self.kept_pools.pop().release)

    # ------------------------------------------------------------------------- captures

    @rule(w=st.integers(0, WORKERS - 1), si=st.integers(1, NUM_STREAMS - 1),
          mode=st.sampled_from(MODES))
    def begin_capture(self, w, si, mode):
        stream = self.streams[si]
        if w in self.captures or self.capture_of(stream) is not None:
            return
        graph = self.alloc.graph(stream, capture_error_mode=mode)
        self.on(w, graph.__enter__)
        self.captures[w] = Capture(graph, self.capture_of(stream), mode)

    def end_capture_of(self, w):
        cap = self.captures.pop(w)
        origin = cap.graph.stream
        for st_ in self.streams:          # join every stream of the capture back into its origin
            if st_ != origin and self.capture_of(st_) == cap.id:
                self.join(origin, st_)
        self.on(w, lambda: cap.graph.__exit__(None, None, None))
        self.graphs.append((cap.graph, cap.foreign))

    @precondition(lambda self: self.captures)
    @rule(data=st.data())
    def end_capture(self, data):
        self.end_capture_of(data.draw(st.sampled_from(sorted(self.captures)), label="worker"))

    def replayable(self, foreign):
        serials = {b.serial for b in self.live.values()}
        return foreign <= serials

    @precondition(lambda self: self.graphs)
    @rule(w=st.integers(0, WORKERS - 1), data=st.data())
    def replay(self, w, data):
        graph, foreign = data.draw(st.sampled_from(self.graphs), label="graph")
        # (A graph whose borrowed blocks were freed would use freed memory: the program's bug.
        # Into a capturing stream it would become a node of that capture: not done here.)
        if self.replayable(foreign) and self.capture_of(graph.stream) is None:
            self.on(w, graph.replay)

    @precondition(lambda self: self.graphs)
    @rule(w=st.integers(0, WORKERS - 1), data=st.data())
    def reset_graph(self, w, data):
        i = data.draw(st.integers(0, len(self.graphs) - 1), label="graph")
        graph, _ = self.graphs.pop(i)
        self.on(w, graph.reset)

    # ------------------------------------------------------------------------- failing driver calls

    @rule(w=st.integers(0, WORKERS - 1), call=st.sampled_from(FAILING_CALLS),
          op=st.sampled_from(FAILING_OPS), size=SIZES, si=st.integers(0, NUM_STREAMS - 1),
          data=st.data())
    def operation_with_a_failing_call(self, w, call, op, size, si, data):
        stream = self.streams[si]
        ptr = self.pick(data) if self.live and op in ("free", "record_stream") else None
        if op in ("free", "record_stream") and ptr is None:
            return
        if op == "malloc":
            body = lambda: self.alloc.malloc(size, stream)
        elif op == "free":
            body = lambda: self.alloc.free(ptr)
        elif op == "record_stream":
            body = lambda: self.alloc.record_stream(ptr, stream)
        else:
            body = getattr(self.alloc, op)
        if op == "malloc":
            # A malloc first polls events, which may retire blocks whose work is done: that is
            # not the failed call's doing, so it is done before the state is taken.
            self.on(w, self.alloc.process_events)
        before = self.allocation_state()
        failures = self.sim.counters["injected_failures"]
        self.sim.fail_next(call)
        try:
            try:
                result = self.on(w, body)
            finally:
                self.sim.fail_next(call, 0)     # (the machine's own calls must not fail)
        except (CudaError, OutOfMemoryError) as err:
            if self.sim.counters["injected_failures"] == failures:
                if isinstance(err, OutOfMemoryError):
                    return          # out of memory on its own
                raise               # a CudaError that was not the injected failure
            self.alloc._check_invariants()
            after = self.allocation_state()
            if op in ("process_events", "empty_cache"):
                # (Work it finished before the failing call may stay done: only the live
                # allocations must be as they were.)
                assert after[0]["allocation.all.current"] == before[0]["allocation.all.current"]
                assert after[0]["allocated_bytes.all.current"] == before[0]["allocated_bytes.all.current"]
            else:
                assert after == before, (
                    f"{op} that failed in {call} ({err}) changed the allocator's state: "
                    f"{before} -> {after}")
            return
        if op == "malloc":
            self.note_malloc(result, size, stream)
        elif op == "free":
            del self.live[ptr]

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def allocator_is_consistent(self):
        if not hasattr(self, "live"):
            return
        self.alloc._check_invariants()
        spans = sorted((p, p + b.size) for p, b in self.live.items())
        for (_, a_end), (b_start, _) in zip(spans, spans[1:]):
            assert a_end <= b_start, f"live allocations overlap at {b_start:#x}"
        assert self.alloc.memory_stats()["allocation.all.current"] == len(self.live)
        # Reserved bytes are the device memory the allocator holds (recycle_pages' page pool
        # included), which the device never lets exceed its capacity.
        assert self.alloc.memory_reserved() == self.sim.used_memory <= self.sim.total_memory


class _Fixed:
    """A stand-in for hypothesis' data object that always draws `value` (for a rule called from
    another)."""

    def __init__(self, value):
        self.value = value

    def draw(self, strategy, label=None):
        return self.value


ReuseMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=int(os.environ.get("PYALLOC_SANITIZER_STEPS", "50")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow])

TestReuseMachine = ReuseMachine.TestCase
