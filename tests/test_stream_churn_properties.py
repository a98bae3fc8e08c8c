"""Property test: programs that make streams, allocate on them, queue work, free, and drop the
streams (CuPy destroys a stream when its object dies) never get memory that queued work of a dead
stream may still use.

The allocator keeps an allocation stream's object alive while blocks of its stream may be cached,
and lets go of one the program dropped once its work is done (then the driver may hand its handle
to a new stream, which gets the blocks cached for it). A hypothesis state machine on SimDevice
(which destroys streams and reuses handles as the driver does) drives one allocator through
stream creation and dropping, malloc on live streams, frees (of blocks whose stream may be gone),
work queued and completed, record_stream, process_events and empty_cache, and checks that

* malloc never returns a live address;
* a block handed out on a stream handle lies in no range freed earlier, stream-ordered, on a
  stream of the same handle whose work queued before that free is still pending (the test records
  its own event after each unit of work on a stream to know);
* no stream object the program still holds is destroyed, and, after process_events has run twice
  with all work complete, every stream the program dropped is destroyed but those record_stream
  named for a block still live (none is kept for good);
* after everything is freed, the work completed and empty_cache, the device holds nothing;
* the reuse sanitizer (SimDevice(check_reuse=True)) finds no block handed out while a kernel
  that uses it (each launch uses the live blocks of its stream and those recorded for it) is
  not ordered before the receiving stream's next work.
"""
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyalloc import CachingAllocator, SimDevice

from budget import examples
from units import KiB, MiB
SIZES = st.sampled_from([4 * KiB, 512 * KiB, 1 * MiB, 3 * MiB, 12 * MiB])
MAX_STREAMS = 4


class Stream:
    """A stream object that destroys its stream when it dies, as cupy.cuda.Stream does;
    `serial` names it (ids of dead objects are reused)."""

    def __init__(self, sim, serial, destroyed):
        self.sim, self.ptr, self.serial, self._destroyed = sim, sim.create_stream(), serial, destroyed

    def __del__(self):
        self._destroyed.add(self.serial)
        self.sim.destroy_stream(self.ptr)


class StreamChurnMachine(RuleBasedStateMachine):

    @initialize()
    def make(self):
        self.sim = SimDevice(512 * MiB, check_reuse=True)
        self.alloc = CachingAllocator(backend=self.sim, config="")
        self.destroyed = set()      # serials of the Stream objects whose __del__ ran
        self.streams = []           # the Stream objects the program holds
        self.live = {}              # ptr -> (size, stream handle, serial of its Stream)
        self.uses = {}              # ptr -> serials of the streams record_stream named for it
        self.made = 0               # Stream objects made (serials 1..made)
        self.last_event = {}        # serial -> test event after that stream's latest work
        self.guards = []            # (start, end, handle, serial, event at the free)
        self.steps = 0              # since let_go_when_idle

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for ptr in list(self.live):
            self.alloc.free(ptr)
        self.sim.synchronize()

    # ------------------------------------------------------------------------- streams

    @precondition(lambda self: len(self.streams) < MAX_STREAMS)
    @rule()
    def new_stream(self):
        self.made += 1
        self.streams.append(Stream(self.sim, self.made, self.destroyed))

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def drop_stream(self, data):
        del self.streams[data.draw(st.integers(0, len(self.streams) - 1), label="stream")]

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), size=SIZES)
    def replace_stream(self, data, size):
        """The churn pattern in one step: drop a stream, make a new one, allocate on it."""
        self.drop_stream(data)
        self.new_stream()
        self.malloc_on(self.streams[-1], size)

    def pick(self, data):
        return self.streams[data.draw(st.integers(0, len(self.streams) - 1), label="stream")]

    # ------------------------------------------------------------------------- memory

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), size=SIZES)
    def malloc(self, data, size):
        self.malloc_on(self.pick(data), size)

    def malloc_on(self, s, size):
        ptr = self.alloc.malloc(size, s)
        assert ptr not in self.live, f"{ptr:#x} handed out twice"
        end = ptr + size
        for start, stop, handle, serial, event in self.guards:
            if ptr < stop and start < end and handle == s.ptr and serial != s.serial:
                assert self.sim.event_done(event), (
                    f"{ptr:#x} handed to stream {s.ptr} (a new stream) while the work of the dead "
                    f"stream of that handle, queued before its free, is pending")
        self.live[ptr] = (size, s.ptr, s.serial)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        size, handle, serial = self.live.pop(ptr)
        self.uses.pop(ptr, None)
        event = self.last_event.get(serial)
        if event is not None:
            self.guards.append((ptr, ptr + size, handle, serial, event))
        self.alloc.free(ptr)

    @precondition(lambda self: self.streams and self.live)
    @rule(data=st.data())
    def record_stream_on_another(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        s = self.pick(data)
        self.alloc.record_stream(ptr, s)
        if s.ptr != self.live[ptr][1]:
            self.uses.setdefault(ptr, set()).add(s.serial)

    # ------------------------------------------------------------------------- work

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), count=st.integers(1, 3))
    def launch(self, data, count):
        # The kernel uses every live block allocated on its stream or recorded for it.
        s = self.pick(data)
        uses = [(p, size) for p, (size, handle, serial) in self.live.items()
                if serial == s.serial or s.serial in self.uses.get(p, ())]
        self.sim.launch(s.ptr, count, uses=uses)
        self.last_event[s.serial] = self.sim.record_event(s.ptr)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def complete(self, data):
        self.sim.complete(self.pick(data).ptr)

    @rule()
    def process_events(self):
        self.alloc.process_events()

    @rule()
    def empty_cache(self):
        # A segment freed here waits for the device first (SimDevice models cudaFree's wait).
        self.alloc.empty_cache()

    # Now and then only: it completes all work, which would leave little pending to misuse.
    @precondition(lambda self: self.steps >= 8)
    @rule()
    def let_go_when_idle(self):
        """With all work done, two process_events let go of every dropped stream, but those that
        record_stream named for a block still live (the free will record an event there)."""
        self.sim.synchronize()
        self.alloc.process_events()
        self.alloc.process_events()
        held = {s.serial for s in self.streams}
        pinned = set().union(*self.uses.values()) - held
        alive = set(range(1, self.made + 1)) - self.destroyed - held
        assert alive == pinned, f"dropped streams {sorted(alive - pinned)} still alive"
        self.steps = 0

    @precondition(lambda self: not self.live and not self.streams)
    @rule()
    def drain(self):
        self.sim.synchronize()
        self.alloc.process_events()
        self.alloc.process_events()
        self.alloc.empty_cache()
        assert self.alloc.memory_reserved() == 0 and self.sim.used_memory == 0

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def held_streams_are_alive(self):
        if hasattr(self, "streams"):
            self.steps += 1
            for s in self.streams:
                assert s.serial not in self.destroyed and not self.sim.is_destroyed(s.ptr)

    @invariant()
    def live_allocations_do_not_overlap(self):
        if not hasattr(self, "live"):
            return
        spans = sorted((p, p + size) for p, (size, _, _) in self.live.items())
        for (_, a_end), (b_start, _) in zip(spans, spans[1:]):
            assert a_end <= b_start


StreamChurnMachine.TestCase.settings = settings(
    max_examples=examples(quick=200, thorough=800), stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])

TestStreamChurnMachine = StreamChurnMachine.TestCase
