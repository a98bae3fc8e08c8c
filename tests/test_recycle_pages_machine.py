"""Property test: recycle_pages never unmaps pages that queued work still uses.

A hypothesis state machine over one allocator under expandable_segments:True,recycle_pages:True
on SimDevice(check_reuse=True): programs allocate blocks of several 2 MiB pages on two streams,
queue work that uses them, free them, and let the device run behind by completing only part of
the queued work. A growth that takes the pages of a free block whose work is still queued raises
ReuseError in the device (its unmap check) or in the hand-out check; the machine fails on it.
After every step: the allocator's invariants, and reserved bytes equal to the device memory held.
"""
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pyalloc import CachingAllocator, SimDevice

from budget import examples
from units import MiB

POLICY = "expandable_segments:True,recycle_pages:True"
SIZES = st.sampled_from([MiB, 3 * MiB, 5 * MiB, 9 * MiB, 17 * MiB, 33 * MiB])


class RecyclePagesMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sim = SimDevice(2 << 30, check_reuse=True)
        self.a = CachingAllocator(backend=self.sim, config=POLICY)
        self.streams = [0, self.sim.create_stream()]
        self.live = []                 # (ptr, size, stream)

    @rule(size=SIZES, si=st.integers(0, 1), use=st.booleans())
    def malloc(self, size, si, use):
        stream = self.streams[si]
        ptr = self.a.malloc(size, stream)
        self.live.append((ptr, size, stream))
        if use:
            self.sim.launch(stream, 1, uses=[(ptr, size)])

    @rule(data=st.data(), use_first=st.booleans())
    def free(self, data, use_first):
        if not self.live:
            return
        ptr, size, stream = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        if use_first:
            self.sim.launch(stream, 1, uses=[(ptr, size)])
        self.a.free(ptr)

    @rule(si=st.integers(0, 1), count=st.integers(1, 3))
    def launch(self, si, count):
        self.sim.launch(self.streams[si], count)

    @rule(si=st.integers(0, 1), count=st.one_of(st.none(), st.integers(1, 4)))
    def complete(self, si, count):
        self.sim.complete(self.streams[si], count)

    @rule()
    def empty_cache(self):
        self.a.empty_cache()

    @invariant()
    def consistent(self):
        self.a._check_invariants()
        assert self.a.memory_stats()["reserved_bytes.all.current"] == self.sim.used_memory


TestRecyclePagesMachine = RecyclePagesMachine.TestCase
TestRecyclePagesMachine.settings = settings(
    max_examples=examples(quick=150, thorough=600), stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
