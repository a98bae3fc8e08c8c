"""Property tests: random allocation programs on a SimDevice keep the allocator's invariants.

A hypothesis state machine drives one CachingAllocator through malloc (small, mid, large and
oversize sizes on several streams), free, record_stream with work launched on the recorded
stream, stream progress, cross-stream waits and empty_cache, under a few configurations. After
every step it checks, from its own bookkeeping and the device's, that

* no two live allocations overlap;
* every live allocation lies inside a live device segment;
* the allocator's statistics equal a recount of its blocks (_check_invariants);
* a block freed with recorded streams is not handed out again before the work queued on those
  streams before the free has completed.
"""

import bisect

from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

CONFIGS = [
    "",
    "max_split_size_mb:20",
    "max_split_size_mb:128",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,2:4,64:8,>:1]",
    "max_split_size_mb:64,roundup_power2_divisions:[256:4,>:2]",
]

SMALL = st.integers(1, 1 * MiB)                   # small pool, 2 MiB segments
MID = st.integers(1 * MiB + 1, 10 * MiB)          # 20 MiB segments
LARGE = st.integers(10 * MiB, 64 * MiB)           # segments rounded to 2 MiB
OVERSIZE = st.integers(128 * MiB, 300 * MiB)      # oversize under max_split_size_mb:20/64/128
BOUNDARIES = st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB, 20 * MiB])
# Repeats weight the choice towards sizes that share segments, so that ranges get reused.
SIZES = st.one_of(SMALL, SMALL, SMALL, MID, MID, LARGE, OVERSIZE, BOUNDARIES)
NUM_STREAMS = 3     # the default stream and two created ones


class AllocatorMachine(RuleBasedStateMachine):

    @initialize(config=st.sampled_from(CONFIGS),
                total_memory=st.sampled_from([160 * MiB, 512 * MiB, 4 * GiB]))
    def make_allocator(self, config, total_memory):
        self.sim = SimDevice(total_memory)
        self.alloc = CachingAllocator(backend=self.sim, config=config)
        self.streams = [0] + [self.sim.create_stream() for _ in range(NUM_STREAMS - 1)]
        self.live = {}        # ptr -> (requested bytes, allocation stream, recorded streams)
        self.guarded = []     # (start, end, [(stream, launched at free)]) of frees with record_stream
        self.released = []    # guards whose work has completed: reuse is allowed (for statistics)

    # ------------------------------------------------------------------------- helpers

    def completed(self, stream):
        # launch(stream, 0) queues nothing and returns the stream's queued total.
        return self.sim.launch(stream, 0) - self.sim.pending(stream)

    def block_size(self, ptr):
        for seg in self.alloc._segments():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                for block in seg["blocks"]:
                    if block["address"] == ptr:
                        return block["size"]
        raise AssertionError(f"live pointer {ptr:#x} has no block")

    # ------------------------------------------------------------------------- rules

    @rule(size=SIZES, stream_index=st.integers(0, NUM_STREAMS - 1))
    def malloc(self, size, stream_index):
        stream = self.streams[stream_index]
        try:
            ptr = self.alloc.malloc(size, stream)
        except OutOfMemoryError as err:
            assert err.requested == size
            event("malloc: out of memory")
            return
        assert ptr % 512 == 0
        end = ptr + size
        # Reuse of a range freed with recorded streams: the work queued on each of them before
        # the free must have completed by now.
        if self.guarded:
            event("malloc: while a range freed with recorded streams waits for their work")
        if any(ptr < stop and start < end for start, stop, _ in self.released):
            event("malloc: reuses a range once its recorded streams' work completed")
        for start, stop, waits in self.guarded:
            if ptr < stop and start < end:
                for used_stream, launched in waits:
                    assert self.completed(used_stream) >= launched, (
                        f"{ptr:#x} reused while stream {used_stream} has done "
                        f"{self.completed(used_stream)} of the {launched} items before the free")
        self.live[ptr] = (size, stream, set())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.free_pointer(data.draw(st.sampled_from(sorted(self.live)), label="ptr"))

    def free_pointer(self, ptr):
        size, stream, recorded = self.live.pop(ptr)
        if recorded:
            waits = [(s, self.sim.launch(s, 0)) for s in sorted(recorded)]
            self.guarded.append((ptr, ptr + self.block_size(ptr), waits))
        self.alloc.free(ptr)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream_index=st.integers(0, NUM_STREAMS - 1),
          work=st.integers(1, 3))
    def record_stream_and_launch(self, data, stream_index, work):
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        stream = self.streams[stream_index]
        self.alloc.record_stream(ptr, stream)
        if stream != self.live[ptr][1]:       # the allocation stream itself is a no-op
            self.live[ptr][2].add(stream)
        self.sim.launch(stream, work)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), offset=st.integers(1, NUM_STREAMS - 1), work=st.integers(1, 3))
    def use_on_another_stream_then_free(self, data, offset, work):
        # The common record_stream pattern in one step: work on a second stream, then free.
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        alloc_stream = self.live[ptr][1]
        stream = self.streams[(self.streams.index(alloc_stream) + offset) % NUM_STREAMS]
        self.alloc.record_stream(ptr, stream)
        self.live[ptr][2].add(stream)
        self.sim.launch(stream, work)
        self.free_pointer(ptr)

    @rule(stream_index=st.integers(0, NUM_STREAMS - 1), count=st.integers(1, 4))
    def launch(self, stream_index, count):
        self.sim.launch(self.streams[stream_index], count)

    @rule(stream_index=st.integers(0, NUM_STREAMS - 1),
          count=st.one_of(st.none(), st.integers(1, 3)))
    def complete(self, stream_index, count):
        self.sim.complete(self.streams[stream_index], count)

    @rule(waiter=st.integers(0, NUM_STREAMS - 1), awaited=st.integers(0, NUM_STREAMS - 1))
    def wait(self, waiter, awaited):
        self.sim.wait_event(self.streams[waiter], self.sim.record_event(self.streams[awaited]))

    @rule()
    def empty_cache(self):
        self.alloc.empty_cache()

    @rule()
    def process_events(self):
        self.alloc.process_events()

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def live_allocations_do_not_overlap(self):
        if not hasattr(self, "live"):
            return
        spans = sorted((ptr, ptr + size) for ptr, (size, _, _) in self.live.items())
        for (a_start, a_end), (b_start, _) in zip(spans, spans[1:]):
            assert a_end <= b_start, f"[{a_start:#x}, {a_end:#x}) overlaps {b_start:#x}"

    @invariant()
    def live_allocations_lie_in_live_segments(self):
        if not hasattr(self, "live"):
            return
        segments = self.sim.segments()
        starts = [addr for addr, _ in segments]
        for ptr, (size, _, _) in self.live.items():
            i = bisect.bisect_right(starts, ptr) - 1
            assert i >= 0, f"{ptr:#x} lies below every segment"
            addr, seg_size = segments[i]
            assert ptr + size <= addr + seg_size, f"{ptr:#x} (+{size}) is outside every segment"

    @invariant()
    def stats_match_a_recount(self):
        if not hasattr(self, "live"):
            return
        self.alloc._check_invariants()
        stats = self.alloc.memory_stats()
        assert stats["allocation.all.current"] == len(self.live)
        assert stats["reserved_bytes.all.current"] == sum(s for _, s in self.sim.segments())
        assert stats["segment.all.current"] == len(self.sim.segments())
        assert stats["allocated_bytes.all.current"] <= stats["active_bytes.all.current"]

    @invariant()
    def forget_satisfied_guards(self):
        if not hasattr(self, "guarded"):
            return
        pending = [g for g in self.guarded
                   if any(self.completed(s) < launched for s, launched in g[2])]
        self.released = (self.released + [g for g in self.guarded if g not in pending])[-50:]
        self.guarded = pending


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])

TestAllocatorMachine = AllocatorMachine.TestCase
