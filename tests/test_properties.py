"""Property tests: random allocation programs on a SimDevice keep the allocator's invariants.

A hypothesis state machine drives one CachingAllocator through malloc (small, mid, large and
oversize sizes on several streams), free, record_stream with work launched on the recorded
stream, stream progress, cross-stream waits and empty_cache, and through private pools: creating
MemPools (use_on_oom, no_split), entering and leaving use_mem_pool scopes by hand so that they
nest across steps, allocating inside them, freeing anywhere, releasing pools and emptying one
pool's cache. It runs under drawn configurations (rounding, max_split_size, expandable segments,
garbage collection), on small and large simulated devices, with or without a memory fraction, so
that out-of-memory errors are a common outcome. After every step it checks, from its own
bookkeeping and the device's, that

* no two live allocations overlap, and each lies in live device memory (a segment, or mapped
  pages of an expandable one);
* each live allocation lies in a segment of the pool it was routed to: the innermost scope's
  pool, else the default pools (0, 0), else (fallback) a live use_on_oom pool;
* the public snapshot's segment_pool_id, and each MemPool.snapshot(), agree with that;
* the allocator's statistics equal a recount of its blocks (_check_invariants), and
  memory_reserved() equals both the snapshot's segment bytes and the device's, and stays under
  the memory fraction's cap (without expandable segments, which may map a page past it);
* each pool's use count is 1 (unless released) + 1 per scope routing to it;
* a no_split pool's segments are never split;
* a block freed with recorded streams is not handed out again before the work queued on those
  streams before the free has completed;
* the reuse sanitizer (SimDevice(check_reuse=True)) finds no block handed out while a kernel
  that uses it (record_stream's launches name the block they use) is not ordered before the
  receiving stream's next work.

and, for the step it just took, that

* malloc never returns a live address; an allocation outside every scope gets a private pool's
  block only from a live use_on_oom pool's cache (a block that was free there, the pool not
  grown), and only when the default pools could give it neither a cached block (none free of
  the rounded size on its stream, nor any bigger where no max_split_size or expandable rule
  could refuse it) nor new device memory (the cap or the device too tight for the segment or
  pages it needed);
* OutOfMemoryError leaves every allocation, scope and pool as it was;
* empty_cache (and an allocation) never takes memory from a pool still in use (use count > 0),
  save the max_split_size release of a routed allocation's own pool, and never, with a scope
  active, from the default pools (an allocation inside a scope may only lose default large-pool
  memory to garbage collection);
* entering a scope of a pool that is routed already raises RuntimeError, and of a released one
  ValueError, changing nothing;
* a released pool with no live blocks holds no memory once the cache is emptied with no scope
  active (and no whole free segment stays cached outside pools in use); after everything is
  freed and every pool released, the device holds nothing, no address space stays reserved and
  the allocator forgets every pool (also after an expandable OOM: see the tests at the end).
"""

import bisect
import os

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice

from backends import cuda_unavailable_reason
from budget import examples

from units import KiB, MiB, GiB

CONFIGS = [
    "",
    "max_split_size_mb:20",
    "max_split_size_mb:128",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,2:4,64:8,>:1]",
    "max_split_size_mb:64,roundup_power2_divisions:[256:4,>:2]",
    "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:20",
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:0.6,max_split_size_mb:20",
]
# A memory fraction caps reserved memory; garbage collection acts only under one.
FRACTIONS = [0.3, 0.5, 0.8]

SMALL = st.integers(1, 1 * MiB)                   # small pool, 2 MiB segments
MID = st.integers(1 * MiB + 1, 10 * MiB)          # 20 MiB segments
LARGE = st.integers(10 * MiB, 64 * MiB)           # segments rounded to 2 MiB
OVERSIZE = st.integers(128 * MiB, 300 * MiB)      # oversize under max_split_size_mb:20/64/128
BOUNDARIES = st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB, 20 * MiB])
# Repeats weight the choice towards sizes that share segments, so that ranges get reused.
SIZES = st.one_of(SMALL, SMALL, SMALL, MID, MID, LARGE, OVERSIZE, BOUNDARIES)
NUM_STREAMS = 3     # the default stream and two created ones
MAX_POOLS = 3
DEFAULT = (0, 0)


def segment_size_for(rounded):
    """Bytes of the segment a new allocation of `rounded` bytes gets (the core's rule)."""
    if rounded <= 1 * MiB:
        return 2 * MiB
    if rounded < 10 * MiB:
        return 20 * MiB
    return -(-rounded // (2 * MiB)) * (2 * MiB)


class AllocatorMachine(RuleBasedStateMachine):

    @initialize(config=st.sampled_from(CONFIGS),
                total_memory=st.sampled_from([96 * MiB, 160 * MiB, 512 * MiB, 4 * GiB]),
                data=st.data())
    def make_allocator(self, config, total_memory, data):
        self.sim, backend = self.make_device(total_memory)
        self.alloc = CachingAllocator(backend=backend, config=config)
        self.gc = "garbage_collection" in config
        self.expandable = "expandable" in config
        self.max_split = "max_split_size" in config
        fraction = data.draw(st.sampled_from(FRACTIONS) if self.gc
                             else st.one_of(st.none(), st.sampled_from(FRACTIONS)), label="fraction")
        event(f"config: {config or 'default'}" + (f", fraction {fraction}" if fraction else ""))
        self.limit = self.apply_fraction(fraction, total_memory)
        self.streams = [0] + [self.sim.create_stream() for _ in range(NUM_STREAMS - 1)]
        # ptr -> (requested bytes, allocation stream, recorded streams, pool id of its segment)
        self.live = {}
        self.guarded = []     # (start, end, [(stream, launched at free)]) of frees with record_stream
        self.released = []    # guards whose work has completed: reuse is allowed (for statistics)
        self.pools = []       # every MemPool made, released ones too
        self.released_pools = set()   # ids of pools given up with release()
        self.scopes = []      # (pool, entered use_mem_pool context manager), outermost first
        self.steps_since_drain = 0

    def make_device(self, total_memory):
        """(the device view the checks read, the allocator's backend): a SimDevice of
        `total_memory` bytes with the reuse sanitizer on, both."""
        sim = SimDevice(total_memory, check_reuse=True)
        return sim, sim

    def apply_fraction(self, fraction, total_memory):
        """Set the drawn memory fraction (None: none); returns the cap in bytes (0: none)."""
        if fraction is None:
            return 0
        self.alloc.set_memory_fraction(fraction)
        return int(fraction * total_memory)

    def teardown(self):
        # Leave open scopes innermost first, so that the pools' finalizers find them closed.
        # Cleanup only: a failure here must not hide the one the example is reported for.
        for pool, scope in reversed(getattr(self, "scopes", [])):
            try:
                scope.__exit__(None, None, None)
            except Exception:
                pass

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

    def route(self):
        """The pool id this thread's allocations go to now (None: the default pools)."""
        return self.scopes[-1][0].id if self.scopes else None

    def routed_ids(self):
        return {pool.id for pool, _ in self.scopes}

    def expected_use_count(self, pool):
        return (pool.id not in self.released_pools) + (pool.id in self.routed_ids())

    def live_pool_ids(self):
        """Pools still in use (use count > 0): their memory is theirs until released."""
        return {pool.id for pool in self.pools if self.expected_use_count(pool) > 0}

    def pools_with_live_blocks(self):
        return {pid for _, _, _, pid in self.live.values()}

    def reserved_by_pool(self, segments=None):
        """{(pool id, is_small): bytes of the snapshot's segments}."""
        out = {}
        for seg in self.alloc._segments() if segments is None else segments:
            key = (tuple(seg["pool_id"]), seg["is_small"])
            out[key] = out.get(key, 0) + seg["total_size"]
        return out

    def state(self):
        """What an out-of-memory error or a refused scope must leave as it was."""
        allocated = sorted((b["address"], b["size"]) for seg in self.alloc._segments()
                           for b in seg["blocks"] if b["allocated"])
        # Pools in use; a freeable one (use count 0) may go at any OOM flush.
        infos = {pool.id: self.alloc._pool_info(pool.id) for pool in self.pools
                 if self.expected_use_count(pool)}
        for info in infos.values():
            if info is not None:
                # An OOM may free cached segments (check_no_shrink says whose).
                del info["reserved_bytes"], info["device_allocations"]
        stats = self.alloc.memory_stats()
        return (allocated, infos, stats["allocation.all.current"],
                stats["allocated_bytes.all.current"], [p.id for p, _ in self.scopes])

    def check_no_shrink(self, before, after, allowed_pool=None, allow_default_large=False):
        """No pool in use lost memory, but `allowed_pool` (and, with `allow_default_large`, the
        default large pool); the default pools lose nothing while a scope is active."""
        protected = self.live_pool_ids()
        if self.scopes:
            protected.add(DEFAULT)
        for (pid, small), nbytes in before.items():
            if pid not in protected or pid == allowed_pool:
                continue
            if pid == DEFAULT and not small and allow_default_large:
                continue
            assert after.get((pid, small), 0) >= nbytes, (
                f"pool {pid} ({'small' if small else 'large'}) shrank from {nbytes} to "
                f"{after.get((pid, small), 0)} bytes while in use (scopes: "
                f"{[p.id for p, _ in self.scopes]})")

    def check_released_pools_empty(self):
        """With no scope active and the cache emptied, a released pool without live blocks holds
        no device memory (it is gone, or its entry holds 0 bytes)."""
        assert not self.scopes
        holding = self.pools_with_live_blocks()
        for pool in self.pools:
            if pool.id in self.released_pools and pool.id not in holding:
                info = self.alloc._pool_info(pool.id)
                assert info is None or info["reserved_bytes"] == 0, (
                    f"released pool {pool.id} without live blocks still holds {info} after "
                    "empty_cache")
                event("empty_cache: a released pool was emptied")

    def check_no_free_segments(self, segments):
        """After empty_cache with no scope: no whole free (non-expandable) segment stays cached
        in the default pools or in a freeable pool."""
        live_pools = self.live_pool_ids()
        for seg in segments:
            pid = tuple(seg["pool_id"])
            if pid in live_pools or seg["is_expandable"]:
                continue
            assert any(b["allocated"] for b in seg["blocks"]), (
                f"segment {seg['address']:#x} of pool {pid} holds no allocation after empty_cache: "
                f"{seg}")

    # ------------------------------------------------------------------------- rules: memory

    @rule(size=SIZES, stream_index=st.integers(0, NUM_STREAMS - 1))
    def malloc(self, size, stream_index):
        stream = self.streams[stream_index]
        route = self.route()
        segments_before = self.alloc._segments()
        reserved_before = self.reserved_by_pool(segments_before)
        state_before = self.state()
        ooms_before = self.alloc.memory_stats()["num_ooms"]
        try:
            ptr = self.alloc.malloc(size, stream)
        except OutOfMemoryError as err:
            assert err.requested == size
            event("malloc: out of memory" + (" inside a scope" if route else ""))
            assert self.state() == state_before, "OutOfMemoryError changed the allocator's state"
            assert self.alloc.memory_stats()["num_ooms"] == ooms_before + 1
            self.check_no_shrink(reserved_before, self.reserved_by_pool(),
                                 allowed_pool=route if self.max_split else None,
                                 allow_default_large=self.gc)
            return
        assert ptr % 512 == 0
        assert ptr not in self.live, f"{ptr:#x} handed out twice while live"
        end = ptr + size
        segments = self.alloc._segments()
        seg = next(s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"])
        pid = tuple(seg["pool_id"])
        if route is not None:
            event("malloc: inside a scope")
            assert pid == route, f"{ptr:#x} allocated inside a scope of {route} lies in pool {pid}"
        elif pid != DEFAULT:
            self.check_fallback(ptr, size, stream, pid, segments_before)
        reserved_after = self.reserved_by_pool(segments)
        if any(reserved_after.get(k, 0) < v for k, v in reserved_before.items()):
            event("malloc: succeeded after freeing cached segments" + (" (gc on)" if self.gc else ""))
        self.check_no_shrink(reserved_before, reserved_after,
                             allowed_pool=route if self.max_split else None,
                             allow_default_large=self.gc)
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
        self.live[ptr] = (size, stream, set(), pid)

    @precondition(lambda self: self.scopes)
    @rule(size=SIZES, stream_index=st.integers(0, NUM_STREAMS - 1))
    def malloc_in_scope(self, size, stream_index):
        # Weights the choice towards allocations routed to a pool.
        self.malloc(size, stream_index)

    @rule(stream_index=st.integers(0, NUM_STREAMS - 1))
    def fill_device(self, stream_index):
        """Allocate until out of memory, in ever smaller pieces, so that little is left."""
        for size in (64 * MiB, 20 * MiB, 2 * MiB):
            for _ in range(24):
                live = len(self.live)
                self.malloc(size, stream_index)
                if len(self.live) == live:
                    break

    def cache_in(self, pool, size, stream_index):
        """Enter `pool`'s scope, allocate, free and leave: a cached block of that pool."""
        scope = self.alloc.use_mem_pool(pool)
        scope.__enter__()
        self.scopes.append((pool, scope))
        live = set(self.live)
        self.malloc(size, stream_index)
        for ptr in set(self.live) - live:
            self.free_pointer(ptr)
        self.leave_scope()

    def enterable_pools(self, use_on_oom=False):
        return [p for p in self.pools if p.id not in self.released_pools
                and p.id not in self.routed_ids() and (p.use_on_oom or not use_on_oom)]

    @precondition(lambda self: self.enterable_pools())
    @rule(data=st.data(), size=SIZES, stream_index=st.integers(0, NUM_STREAMS - 1))
    def cache_in_pool(self, data, size, stream_index):
        self.cache_in(data.draw(st.sampled_from(self.enterable_pools()), label="pool"),
                      size, stream_index)

    def cached_pool_block(self):
        """(size, stream index) of a cached block of a live use_on_oom pool, or None."""
        oom_pools = {p.id for p in self.enterable_pools(use_on_oom=True)}
        for seg in self.alloc._segments():
            if tuple(seg["pool_id"]) in oom_pools:
                for b in seg["blocks"]:
                    if not b["allocated"] and not b["pending_free"]:
                        return b["size"], self.streams.index(seg["stream"])
        return None

    @precondition(lambda self: not self.scopes and self.enterable_pools(use_on_oom=True))
    @rule(data=st.data(), size=st.one_of(SMALL, MID, LARGE),
          stream_index=st.integers(0, NUM_STREAMS - 1), fill_first=st.booleans())
    def malloc_like_a_cached_pool_block(self, data, size, stream_index, fill_first):
        """Outside every scope, ask for the size and stream of a cached block of a use_on_oom
        pool (cached now if there is none), after filling the device when `fill_first`:
        use_on_oom's case."""
        if self.cached_pool_block() is None:
            self.cache_in(data.draw(st.sampled_from(self.enterable_pools(use_on_oom=True)),
                                    label="pool"), size, stream_index)
        found = self.cached_pool_block()
        if found is not None and fill_first:
            self.fill_device(found[1])
            found = self.cached_pool_block()
        if found is not None:
            self.malloc(*found)

    def check_fallback(self, ptr, size, stream, pid, segments_before):
        """An allocation outside every scope got a block of private pool `pid`: that must be
        PyTorch's use_on_oom fallback, a cached block of a live use_on_oom pool, taken only once
        the default pools had no fitting block and no new device memory could be had."""
        event("malloc: use_on_oom fallback")
        pool = next((p for p in self.pools if p.id == pid), None)
        assert pool is not None, f"{ptr:#x} lies in unknown pool {pid}"
        assert pool.use_on_oom, f"{ptr:#x} allocated outside any scope from pool {pid}, not use_on_oom"
        assert pid not in self.released_pools, f"{ptr:#x} came from released pool {pid}"
        rounded = self.alloc.round_size(size)
        small = rounded <= 1 * MiB
        # A cached block: its start was a free (or event-waiting) block of the pool before,
        # and the pool's memory did not grow.
        starts = {b["address"] for s in segments_before if tuple(s["pool_id"]) == pid
                  and s["stream"] == stream and s["is_small"] == small
                  for b in s["blocks"] if not b["allocated"]}
        assert ptr in starts, f"fallback {ptr:#x} is no cached block of pool {pid}"
        assert (self.reserved_by_pool(segments_before).get((pid, small), 0)
                == self.reserved_by_pool().get((pid, small), 0)), "fallback grew its pool"
        # The default pools had no free block of exactly the rounded size on this stream (one
        # always fits), nor, without max_split_size and expandable segments, any bigger one.
        for s in segments_before:
            if tuple(s["pool_id"]) != DEFAULT or s["stream"] != stream or s["is_small"] != small:
                continue
            for b in s["blocks"]:
                if b["allocated"] or b["pending_free"]:
                    continue
                assert b["size"] != rounded, (
                    f"fallback to {pid} while default block {b['address']:#x} fits exactly")
                if not self.max_split and not self.expandable:
                    assert b["size"] < rounded, (
                        f"fallback to {pid} while default block {b['address']:#x} "
                        f"({b['size']} bytes) fits {rounded}")
        # And no new device memory: the cap or the device was too tight for the segment (for
        # expandable segments: the pages) the request needed. Segments freed before the device
        # allocation was tried (garbage collection) are freed already: the figures after the
        # call are the ones the allocator saw.
        alloc_size = segment_size_for(rounded)
        need = alloc_size
        if self.expandable:
            page = 2 * MiB if small else 20 * MiB
            need = max(alloc_size, -(-rounded // page) * page)
        free_bytes, _ = self.sim.mem_get_info()
        capped = self.limit and self.alloc.memory_reserved() + alloc_size > self.limit
        assert capped or free_bytes < need, (
            f"fallback to {pid} for {size} bytes while the device has {free_bytes} free "
            f"(needs {need}) and the cap {self.limit} allows it")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.free_pointer(data.draw(st.sampled_from(sorted(self.live)), label="ptr"))

    def free_pointer(self, ptr):
        size, stream, recorded, pid = self.live.pop(ptr)
        if recorded:
            waits = [(s, self.sim.launch(s, 0)) for s in sorted(recorded)]
            self.guarded.append((ptr, ptr + self.block_size(ptr), waits))
        if pid != DEFAULT and pid != self.route():
            event("free: a private pool's block outside its scope")
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
        self.sim.launch(stream, work, uses=[(ptr, self.live[ptr][0])])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), offset=st.integers(1, NUM_STREAMS - 1), work=st.integers(1, 3))
    def use_on_another_stream_then_free(self, data, offset, work):
        # The common record_stream pattern in one step: work on a second stream, then free.
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        alloc_stream = self.live[ptr][1]
        stream = self.streams[(self.streams.index(alloc_stream) + offset) % NUM_STREAMS]
        self.alloc.record_stream(ptr, stream)
        self.live[ptr][2].add(stream)
        self.sim.launch(stream, work, uses=[(ptr, self.live[ptr][0])])
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
        before = self.reserved_by_pool()
        self.alloc.empty_cache()
        segments = self.alloc._segments()
        self.check_no_shrink(before, self.reserved_by_pool(segments))
        if self.scopes:
            event("empty_cache: inside a scope")
        else:
            self.check_released_pools_empty()
            self.check_no_free_segments(segments)

    @rule()
    def process_events(self):
        self.alloc.process_events()

    # ------------------------------------------------------------------------- rules: pools

    @precondition(lambda self: len(self.pools) < MAX_POOLS)
    @rule(use_on_oom=st.booleans(), no_split=st.booleans())
    def create_pool(self, use_on_oom, no_split):
        pool = self.alloc.mem_pool(use_on_oom=use_on_oom, no_split=no_split)
        assert pool.id[0] == 0 and pool.id[1] > 0
        assert all(pool.id != p.id for p in self.pools)
        self.pools.append(pool)

    @precondition(lambda self: self.pools)
    @rule(data=st.data())
    def enter_scope(self, data):
        pool = data.draw(st.sampled_from(self.pools), label="pool")
        before = self.state(), self.reserved_by_pool(), [p.id for p, _ in self.scopes]
        scope = self.alloc.use_mem_pool(pool)
        if pool.id in self.released_pools:
            expected = ValueError
        elif pool.id in self.routed_ids():
            expected = RuntimeError
        else:
            scope.__enter__()
            if self.scopes:
                event("enter_scope: nested in another pool's scope")
            self.scopes.append((pool, scope))
            return
        try:
            scope.__enter__()
        except expected:
            event(f"enter_scope: refused with {expected.__name__}")
        else:
            self.scopes.append((pool, scope))     # keep the model in step for teardown
            raise AssertionError(f"entering pool {pool.id} again did not raise {expected.__name__}")
        assert (self.state(), self.reserved_by_pool(), [p.id for p, _ in self.scopes]) == before, (
            "a refused scope changed the allocator's state")

    @precondition(lambda self: self.scopes)
    @rule()
    def leave_scope(self):
        pool, scope = self.scopes.pop()
        scope.__exit__(None, None, None)

    @precondition(lambda self: len(self.scopes) > 1)
    @rule(data=st.data())
    def leave_outer_scope(self, data):
        # Scopes driven by hand need not close in order; the inner routes stay in force.
        i = data.draw(st.integers(0, len(self.scopes) - 2), label="scope")
        pool, scope = self.scopes.pop(i)
        scope.__exit__(None, None, None)
        event("leave_scope: out of order")

    @precondition(lambda self: any(p.id not in self.released_pools for p in self.pools))
    @rule(data=st.data())
    def release_pool(self, data):
        pool = data.draw(st.sampled_from([p for p in self.pools if p.id not in self.released_pools]),
                         label="pool")
        before = self.reserved_by_pool()
        pool.release()
        self.released_pools.add(pool.id)
        self.check_no_shrink(before, self.reserved_by_pool())
        if pool.id in self.routed_ids():
            event("release_pool: inside its own scope")
        elif not self.scopes and pool.id not in self.pools_with_live_blocks():
            info = self.alloc._pool_info(pool.id)
            assert info is None or info["reserved_bytes"] == 0, (
                f"released pool {pool.id} without live blocks still holds {info}")

    @precondition(lambda self: self.pools)
    @rule(data=st.data())
    def empty_pool_cache(self, data):
        pool = data.draw(st.sampled_from(self.pools), label="pool")
        before = self.reserved_by_pool()
        self.alloc.empty_cache(pool.id)
        after = self.reserved_by_pool()
        self.check_no_shrink(before, after)
        for key, nbytes in before.items():
            if key[0] != pool.id:
                assert after.get(key, 0) == nbytes, f"empty_cache({pool.id}) changed pool {key}"
        if not self.scopes and pool.id in self.released_pools and pool.id not in self.pools_with_live_blocks():
            info = self.alloc._pool_info(pool.id)
            assert info is None or info["reserved_bytes"] == 0, (
                f"empty_cache({pool.id}) of a released pool without live blocks left {info}")

    # Hypothesis favours the first of its (sorted) rules, which this one is: without the
    # precondition it would reset the pools every few steps.
    @precondition(lambda self: self.steps_since_drain >= 20)
    @rule()
    def drain(self):
        """Leave every scope, free everything, release every pool and empty the cache: the
        device must then hold nothing (all the pools' memory came back)."""
        while self.scopes:
            self.leave_scope()
        for ptr in sorted(self.live):
            self.free_pointer(ptr)
        for pool in self.pools:
            if pool.id not in self.released_pools:
                pool.release()
                self.released_pools.add(pool.id)
        self.alloc.empty_cache()
        self.check_released_pools_empty()
        assert self.alloc.memory_reserved() == 0, self.alloc._segments()
        assert self.sim.used_memory == 0
        assert self.sim.reservations() == [], "address space still reserved"
        assert self.alloc._private_pool_ids() == [], "released, emptied pools not forgotten"
        self.pools = []
        self.released_pools = set()
        self.steps_since_drain = 0

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def live_allocations_do_not_overlap(self):
        if not hasattr(self, "live"):
            return
        spans = sorted((ptr, ptr + size) for ptr, (size, _, _, _) in self.live.items())
        for (a_start, a_end), (b_start, _) in zip(spans, spans[1:]):
            assert a_end <= b_start, f"[{a_start:#x}, {a_end:#x}) overlaps {b_start:#x}"

    @invariant()
    def live_allocations_lie_in_their_pools_and_device_memory(self):
        if not hasattr(self, "live"):
            return
        segments = self.alloc._segments()
        starts = [s["address"] for s in segments]
        device = self.sim.segments()
        device_starts = [addr for addr, _ in device]
        allocated = {b["address"] for s in segments for b in s["blocks"] if b["allocated"]}
        assert allocated == set(self.live), "the snapshot's allocated blocks are not the live ones"
        for ptr, (size, _, _, pid) in self.live.items():
            i = bisect.bisect_right(starts, ptr) - 1
            assert i >= 0, f"{ptr:#x} lies below every segment"
            seg = segments[i]
            assert ptr + size <= seg["address"] + seg["total_size"], f"{ptr:#x} (+{size}) is outside its segment"
            assert tuple(seg["pool_id"]) == pid, f"{ptr:#x} of pool {pid} lies in a segment of {seg['pool_id']}"
            if seg["is_expandable"]:
                assert self.sim.is_mapped(ptr, size), f"{ptr:#x} (+{size}) is not mapped"
            else:
                j = bisect.bisect_right(device_starts, ptr) - 1
                assert j >= 0, f"{ptr:#x} lies below every device segment"
                addr, seg_size = device[j]
                assert ptr + size <= addr + seg_size, f"{ptr:#x} (+{size}) is outside every device segment"
        # The public snapshot (torch's format) says the same, and each MemPool's snapshot()
        # is its share of it.
        snapshot = [(s["address"], tuple(s["segment_pool_id"]))
                    for s in self.alloc.snapshot()["segments"]]
        assert snapshot == [(s["address"], tuple(s["pool_id"])) for s in segments]
        for pool in self.pools:
            assert [s["address"] for s in pool.snapshot()] == [
                addr for addr, pid in snapshot if pid == pool.id]
        no_split = {p.id for p in self.pools if p.no_split}
        known = {p.id for p in self.pools} | {DEFAULT}
        for seg in segments:
            pid = tuple(seg["pool_id"])
            assert pid in known, f"segment {seg['address']:#x} of unknown pool {pid}"
            if pid in no_split and not seg["is_expandable"]:
                assert len(seg["blocks"]) == 1, f"segment {seg['address']:#x} of no_split pool {pid} split"

    @invariant()
    def stats_match_a_recount(self):
        if not hasattr(self, "live"):
            return
        self.alloc._check_invariants()
        stats = self.alloc.memory_stats()
        assert stats["allocation.all.current"] == len(self.live)
        reserved = stats["reserved_bytes.all.current"]
        assert reserved == self.alloc.memory_reserved()
        assert reserved == sum(s for _, s in self.sim.segments()) + self.sim.mapped_memory
        assert reserved == sum(s["total_size"] for s in self.alloc._segments())
        assert stats["segment.all.current"] == len(self.sim.segments())
        assert stats["allocated_bytes.all.current"] <= stats["active_bytes.all.current"]
        if self.limit and not self.expandable:
            # (Expandable segments check the cap against the segment size, then map whole
            # pages, which may be more, as PyTorch does.)
            assert reserved <= self.limit, f"{reserved} bytes reserved over the cap {self.limit}"

    @invariant()
    def pool_use_counts(self):
        if not hasattr(self, "pools"):
            return
        routed = self.routed_ids()
        for pool in self.pools:
            info = self.alloc._pool_info(pool.id)
            expected = self.expected_use_count(pool)
            if expected:
                assert info is not None, f"pool {pool.id} in use ({expected}) is gone"
                assert info["use_count"] == expected, f"pool {pool.id}: {info}, expected {expected} uses"
                assert info["routed"] == (pool.id in routed), f"pool {pool.id}: {info}"
                assert info["use_on_oom"] == (pool.use_on_oom and pool.id not in self.released_pools)
            else:
                assert info is None or (info["use_count"] == 0 and not info["routed"]), (
                    f"released pool {pool.id}: {info}")

    @invariant()
    def forget_satisfied_guards(self):
        if not hasattr(self, "guarded"):
            return
        pending = [g for g in self.guarded
                   if any(self.completed(s) < launched for s, launched in g[2])]
        self.released = (self.released + [g for g in self.guarded if g not in pending])[-50:]
        self.guarded = pending
        self.steps_since_drain += 1


AllocatorMachine.TestCase.settings = settings(
    max_examples=examples(quick=200, thorough=1200), stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])

TestAllocatorMachine = AllocatorMachine.TestCase


# ------------------------------------------------------------------------------- on the GPU
#
# The same machine over CudaDevice (the conformance suite's other backend, tests/backends.py):
# real streams whose work is held on host flags, real segments and mappings. A device of
# `total_memory` bytes is the GPU capped by a memory fraction, so out-of-memory stays common; the
# drawn fraction, if any, applies on top (cap = fraction x total_memory). Fewer, shorter examples
# than on SimDevice: every step makes driver calls, and a flush that waits for held work waits
# for the watchdog.

class CudaAllocatorMachine(AllocatorMachine):

    def make_device(self, total_memory):
        from pyalloc.cuda_backend import open_device
        from backends import CudaPropertyDevice
        view = CudaPropertyDevice(open_device(0))
        view.total = total_memory
        return view, view.backend

    def apply_fraction(self, fraction, total_memory):
        self.sim.alloc = self.alloc
        cap = self.sim.cap_to(self.alloc, (1.0 if fraction is None else fraction) * total_memory)
        return 0 if fraction is None else cap

    def teardown(self):
        super().teardown()
        view = getattr(self, "sim", None)
        if view is not None:
            for pool in getattr(self, "pools", []):
                if pool.id not in self.released_pools:
                    pool.release()
            self.sim = None
            view.close()
            self.alloc = None


CudaAllocatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PYALLOC_CUDA_PROPERTY_EXAMPLES", "40")),
    stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.skipif(cuda_unavailable_reason() is not None,
                    reason=str(cuda_unavailable_reason()))
class TestCudaAllocatorMachine(CudaAllocatorMachine.TestCase):
    pass


# ------------------------------------------------------------------------------- found by the machine
#
# An expandable allocation that runs out of memory first reserves a new segment's address space
# (find_expandable_block, when the stream's segments have no room), then fails to map its pages.
# The reservation stayed (nothing was mapped in it, so no unmap released it), and in a private
# pool it stayed counted in device_allocations, so the released, emptied pool was never forgotten.
# Fixed: try_allocate_expandable_block releases a reservation whose first map fails.

def test_expandable_oom_leaves_no_reservation_behind():
    sim = SimDevice(96 * MiB)           # one expandable segment reserves 120 MiB of addresses
    a = CachingAllocator(backend=sim, config="expandable_segments:True")
    ptr = a.malloc(64 * MiB)            # maps 80 MiB; 16 MiB free + 40 MiB unmapped remain
    assert len(sim.reservations()) == 1
    try:
        a.malloc(64 * MiB)              # no room in that segment: a second one, then OOM
    except OutOfMemoryError:
        pass
    else:
        raise AssertionError("expected OutOfMemoryError")
    a.free(ptr)
    a.empty_cache()
    assert a.memory_reserved() == 0 and sim.used_memory == 0
    assert sim.reservations() == [], "empty_cache left an unmapped reservation"


def test_expandable_oom_in_a_pool_keeps_the_released_pool_forever():
    sim = SimDevice(96 * MiB)
    a = CachingAllocator(backend=sim, config="expandable_segments:True")
    pool = a.mem_pool()
    with a.use_mem_pool(pool):
        try:
            a.malloc(200 * MiB)         # reserves the pool's segment, then cannot map it
        except OutOfMemoryError:
            pass
        else:
            raise AssertionError("expected OutOfMemoryError")
    pool.release()
    a.empty_cache()
    assert a.memory_reserved() == 0
    assert a._pool_info(pool.id) is None, f"released, emptied pool still held: {a._pool_info(pool.id)}"
    assert sim.reservations() == []
