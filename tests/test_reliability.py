"""Nothing crashes, nothing is handed out twice (issue 15, the CPU-side items).

Each test pins one behaviour that used to fail: a crash, a leak, a second owner of one block, a
wrong size or limit, a snapshot read while the garbage collector freed a block, or a placement
that walked every live segment. Tests whose failure was a segfault run Python in a subprocess, so
that the old behaviour fails the test instead of killing the test run.
"""
import copy
import gc
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time

import pytest

from pyalloc import Buffer, CachingAllocator, OutOfMemoryError, SimDevice, config
from pyalloc._core import DeviceCachingAllocator

from units import KiB, MiB, GiB


def run_python(code):
    """Run `code` in a fresh interpreter; returns the CompletedProcess (text stdout/stderr).

    cwd: the tests folder, so that a source checkout's pyalloc/ (no compiled modules when the
    package is installed elsewhere, as in CI) never shadows the installed package."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))


def assert_clean_exit(out):
    assert out.returncode == 0 and out.stderr == "", (out.returncode, out.stderr)


# ------------------------------------------------------------------ 1. collection order and exit

# A Buffer reachable only from its allocator's own fields: the allocator and the Buffer are
# garbage together, and the collector may clear the allocator before the Buffer is freed. The
# Buffer was used on a second stream, so its free records an event on the backend.
CYCLE_WITH_STREAM_USE = """
    import gc, weakref, pyalloc
    sim = pyalloc.SimDevice()
    a = pyalloc.CachingAllocator(backend=sim, config="")
    b = a.allocate(4096)
    s = sim.create_stream()
    a.record_stream(b.ptr, s)
    sim.launch(s)
    a.oom_observers.append(lambda *args, keep=b: None)
    alive = weakref.ref(a)
    del a, b
"""


def test_buffer_freed_by_a_collection_that_clears_its_allocator_first_frees_through_it():
    out = run_python(CYCLE_WITH_STREAM_USE + """
    gc.collect()
    print(alive() is None, sim.counters["event_record"])
    """)
    assert_clean_exit(out)
    assert out.stdout.split() == ["True", "1"]      # collected, and the free recorded its event


def test_allocator_and_backend_collected_together_with_a_buffer_do_not_crash():
    # Nothing outside the cycle holds the SimDevice either: it may be cleared before both.
    out = run_python("""
    import gc, weakref, pyalloc
    a = pyalloc.CachingAllocator(backend=pyalloc.SimDevice(), config="")
    b = a.allocate(4096)
    s = a.backend.create_stream()
    a.record_stream(b.ptr, s)
    a.backend.launch(s)
    a.oom_observers.append(lambda *args, keep=b: None)
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    print(alive() is None)
    """)
    assert_clean_exit(out)
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize("through", ["oom_observers", "context_recorder"])
def test_buffer_collected_with_its_allocator_while_history_records_free_stacks_prints_nothing(through):
    out = run_python(f"""
    import gc, weakref, pyalloc
    a = pyalloc.CachingAllocator(config="")
    a.record_memory_history(context="all")
    b = a.allocate(4096)
    record = a.context_recorder
    if {through!r} == "oom_observers":
        a.oom_observers.append(lambda *args, keep=b: None)
    else:
        a.context_recorder = lambda keep=b: record()
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    print(alive() is None)
    """)
    assert_clean_exit(out)
    assert out.stdout.split() == ["True"]


# A free-stack recorder the collector clears before the Buffer it holds is freed: the function's
# globals are gone when the Buffer's free would call it (calling it crashed CPython). The
# recorder is made old (it survived a collection) so that the collector clears it first; its
# globals dict is tracked only once it holds the list, so it is younger and cleared after.
CLEARED_RECORDER = """
    import gc, types, weakref, pyalloc
    rec = types.FunctionType((lambda: 0 if keep else 0).__code__, {"keep": None})
    gc.collect()
    a = pyalloc.CachingAllocator(config="")
    a.record_memory_history(context="all")
    a.context_recorder = rec
    rec.__globals__["keep"] = [a.allocate(4096)]    # the Buffer: reachable only through rec
    alive = weakref.ref(a)
"""


def test_buffer_freed_by_the_collector_does_not_call_a_recorder_the_collector_cleared():
    out = run_python(CLEARED_RECORDER + """
    del a, rec
    gc.collect()
    print(alive() is None)
    """)
    assert_clean_exit(out)
    assert out.stdout.split() == ["True"]


def test_buffer_freed_at_interpreter_exit_does_not_call_a_recorder_the_collector_cleared():
    assert_clean_exit(run_python(CLEARED_RECORDER))     # the cycle is garbage once __main__ is cleared


@pytest.mark.parametrize("history", [False, True])
def test_allocators_in_cycles_with_their_buffers_at_interpreter_exit_exit_cleanly(history):
    out = run_python(f"""
    import pyalloc
    sim = pyalloc.SimDevice()
    for _ in range(3):
        a = pyalloc.CachingAllocator(backend=sim, config="")
        if {history}:
            a.record_memory_history(context="all")
        b = a.allocate(4096)
        s = sim.create_stream()
        a.record_stream(b.ptr, s)
        sim.launch(s)
        a.oom_observers.append(lambda *args, keep=b: None)
        kept = a.allocate(1 << 20)      # no cycle: freed when the module's names are cleared
    """)
    assert_clean_exit(out)


# ------------------------------------------------------------------ 2. an allocator never initialised

UNINITIALISED = """
    import pyalloc
    from pyalloc._core import DeviceCachingAllocator

    class Forgetful(pyalloc.CachingAllocator):
        def __init__(self):
            pass                        # no super().__init__()

    makers = {"subclass": Forgetful,
              "CachingAllocator.__new__": lambda: pyalloc.CachingAllocator.__new__(pyalloc.CachingAllocator),
              "DeviceCachingAllocator.__new__": lambda: DeviceCachingAllocator.__new__(DeviceCachingAllocator)}
    a = makers[MAKER]()
    try:
        CALL
    except RuntimeError as err:
        print("RuntimeError", "__init__" in str(err))
    else:
        print("no error")
"""


@pytest.mark.parametrize("maker", ["subclass", "CachingAllocator.__new__", "DeviceCachingAllocator.__new__"])
@pytest.mark.parametrize("call", ["a.malloc(4096)", "pyalloc.Buffer(a, 4096)", "a.set_memory_fraction(0.5)",
                                  "a.begin_allocate_to_pool((0, 99), ('capture', 1)); a.malloc(4096)"])
def test_allocator_whose_init_never_ran_raises_runtime_error_naming_init(maker, call):
    out = run_python(UNINITIALISED.replace("MAKER", repr(maker)).replace("CALL", call))
    assert_clean_exit(out)
    assert out.stdout.split() == ["RuntimeError", "True"]


# ------------------------------------------------------------------ 3. one owner per block

@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy])
def test_copying_a_buffer_is_refused(duplicate):
    a = CachingAllocator(config="")
    b = a.allocate(4096)
    with pytest.raises(TypeError, match="Buffer"):
        duplicate(b)
    del b
    assert a.memory_allocated() == 0


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_a_buffer_is_refused(protocol):
    a = CachingAllocator(config="")
    b = a.allocate(4096)
    with pytest.raises(TypeError, match="Buffer"):
        pickle.dumps(b, protocol)
    with pytest.raises(TypeError, match="Buffer"):
        b.__reduce_ex__(protocol)       # what copy.copy asks for


def test_second_init_of_a_buffer_is_refused_and_keeps_its_block():
    a = CachingAllocator(config="")
    b = a.allocate(4096)
    ptr = b.ptr
    with pytest.raises(RuntimeError, match="once"):
        b.__init__(a, 8192)
    assert (b.ptr, b.size, a.memory_allocated()) == (ptr, 4096, 4096)
    b.close()
    assert a.memory_allocated() == 0


# ------------------------------------------------------------------ 4. sizes

class Index:
    """An object with __index__ returning whatever it was given."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


SIZE_ENTRY_POINTS = {
    "malloc": lambda a, n: a.malloc(n),
    "Buffer": lambda a, n: Buffer(a, n),
    "allocate": lambda a, n: a.allocate(n),
    "round_size": lambda a, n: a.round_size(n),
    "warm_up": lambda a, n: a.warm_up([(0, False, n)]),
}


@pytest.mark.parametrize("entry", sorted(SIZE_ENTRY_POINTS))
@pytest.mark.parametrize("result", ["a", 2.0, None, b"\x00\x00\x00\xc0"])
def test_size_whose_index_returns_a_non_int_is_refused_with_type_error(entry, result):
    a = CachingAllocator(config="expandable_segments:True")
    with pytest.raises(TypeError, match="__index__"):
        SIZE_ENTRY_POINTS[entry](a, Index(result))
    assert a.memory_reserved() == 0


@pytest.mark.parametrize("entry", ["free", "record_stream"])
def test_pointer_whose_index_returns_a_non_int_is_refused_with_type_error(entry):
    a = CachingAllocator(config="")
    call = {"free": lambda p: a.free(p), "record_stream": lambda p: a.record_stream(p, 1)}[entry]
    with pytest.raises(TypeError, match="__index__"):
        call(Index("a"))


@pytest.mark.parametrize("entry", sorted(SIZE_ENTRY_POINTS))
def test_size_from_index_is_read_as_operator_index_reads_it(entry):
    a = CachingAllocator(config="expandable_segments:True")
    b = CachingAllocator(config="expandable_segments:True")
    SIZE_ENTRY_POINTS[entry](a, Index(3 * MiB))
    SIZE_ENTRY_POINTS[entry](b, 3 * MiB)
    assert a.memory_stats() == b.memory_stats()


# ------------------------------------------------------------------ 5. limits at their edges

def test_memory_fraction_zero_allows_no_new_segment():
    sim = SimDevice(80 * GiB)
    a = CachingAllocator(backend=sim, config="")
    a.set_memory_fraction(0.0)
    with pytest.raises(OutOfMemoryError, match="0 bytes allowed"):
        a.malloc(4096)
    assert sim.counters["segment_alloc"] == 0


def test_memory_fraction_zero_still_serves_cached_blocks():
    sim = SimDevice(80 * GiB)
    a = CachingAllocator(backend=sim, config="")
    a.free(a.malloc(4096))
    a.set_memory_fraction(0.0)
    a.malloc(4096)                      # the cached small segment serves it
    assert sim.counters["segment_alloc"] == 1
    with pytest.raises(OutOfMemoryError):
        a.malloc(4 * MiB)               # a large block needs a new segment


def test_memory_fraction_of_less_than_one_byte_allows_nothing():
    a = CachingAllocator(backend=SimDevice(80 * GiB), config="")
    a.set_memory_fraction(1e-12)        # 0.086 bytes of 80 GiB
    with pytest.raises(OutOfMemoryError):
        a.malloc(4096)


def test_memory_fraction_one_removes_a_cap_of_zero():
    a = CachingAllocator(config="")
    a.set_memory_fraction(0.0)
    a.set_memory_fraction(1.0)
    a.malloc(4096)
    assert a.memory_reserved() == 2 * MiB


def test_per_process_memory_fraction_zero_in_the_config_allows_no_new_segment():
    a = CachingAllocator(config="per_process_memory_fraction:0.0")
    with pytest.raises(OutOfMemoryError):
        a.malloc(4096)


def test_huge_max_non_split_rounding_lets_a_smaller_request_reuse_an_oversize_block():
    a = CachingAllocator(config=f"max_split_size_mb:20,max_non_split_rounding_mb:{2**60}")
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)                  # 70 MiB of excess is far under the rounding limit
    assert a.memory_reserved() == 100 * MiB


@pytest.mark.parametrize("device", [2**31, 2**63, 2**70])
def test_device_ordinal_out_of_range_raises_value_error_naming_it(device):
    with pytest.raises(ValueError, match=str(device)):
        CachingAllocator(device=device)


def test_simulated_device_past_the_address_space_raises_value_error_naming_it():
    with pytest.raises(ValueError, match=str(2**30)):
        CachingAllocator(device=2**30, backend="sim")


@pytest.fixture
def fresh_listeners(monkeypatch):
    monkeypatch.setattr(config, "_listeners", [])


def test_dropped_allocators_leave_no_dead_entries_in_the_settings_listeners(fresh_listeners):
    for _ in range(2000):
        CachingAllocator()              # config=None: follows the process settings
    gc.collect()
    assert len(config._listeners) <= 2
    kept = [CachingAllocator() for _ in range(3)]
    config.set_allocator_settings("max_split_size_mb:40")
    assert all(a.settings.max_split_size == 40 * MiB for a in kept)


# ------------------------------------------------------------------ 6. snapshots and the collector

def tiles(segments, sim):
    """Whether every segment of a._segments() is covered exactly by its blocks, in order."""
    sizes = dict(sim.segments())
    for seg in segments:
        addr = seg["address"]
        for blk in seg["blocks"]:
            if blk["address"] != addr:
                return False
            addr += blk["size"]
        if addr - seg["address"] != sizes.get(seg["address"]):
            return False
    return True


def segments_while_collecting(nth):
    """a._segments() with a collection at every allocation of tracked objects, where the nth
    collection of the call frees a Buffer of `a`: the collection's start callback moves the
    Buffer's last reference into a new cycle, which that collection finds garbage (it is young)
    and frees. Returns (segments, (segments before, after the free), sim, a, collections
    during the call)."""
    sim = SimDevice()
    a = CachingAllocator(backend=sim, config="")
    keep = [a.malloc(512) for _ in range(2)]
    holder = [Buffer(a, 512)]           # between a live block and the free rest, which absorbs it
    before = a._segments()
    seen = {"armed": False, "collections": 0}

    def callback(phase, info):
        if phase == "start" and seen["armed"]:
            seen["collections"] += 1
            if seen["collections"] == nth:
                cycle = [holder.pop()]
                cycle.append(cycle)

    gc.collect()
    thresholds = gc.get_threshold()
    gc.callbacks.append(callback)
    try:
        gc.set_threshold(1)
        seen["armed"] = True
        segments = a._segments()
    finally:
        seen["armed"] = False
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(callback)
    holder.clear()
    gc.collect()
    return segments, (before, a._segments()), sim, a, seen["collections"]


def test_segments_read_while_the_collector_frees_a_buffer_tile_and_the_free_happens():
    """The Buffer is freed at each collection the call makes in turn: every result tiles its
    segments and is the state either before or after the free, and the block is freed."""
    calls = segments_while_collecting(0)[4]
    # CPython 3.11 collects at allocations of tracked objects (three times in the call when run
    # alone, in 300 of 300 tries), but a full-suite run once saw one ("assert 1 >= 3"), not
    # reproduced since. The likely cause: an object taken from a free list (dicts, lists, tuples)
    # does not count towards the threshold, and what the free lists hold depends on the process's
    # other threads (xdist's I/O thread). 3.12+ defers collections to the eval loop's checks, which
    # the C code meets once. So at least one, and each collection there was is tried in turn.
    assert calls >= 1
    for nth in range(1, calls + 1):
        segments, states, sim, a, _ = segments_while_collecting(nth)
        assert tiles(segments, sim), nth
        assert segments in states, nth
        assert a.memory_allocated() == 2 * 512
        a._check_invariants()


# ------------------------------------------------------------------ 7. segment placement

TOP_DOWN_RANGE = 1 << 40


def walk_first_fit(segments, base, align, n):
    """SimDevice's first-fit placement as it walked every live segment (the reference)."""
    cursor = base
    for start, size in segments:
        if start < base:
            continue
        if start >= cursor + n:
            break
        if start + size > cursor:
            cursor = (start + size + align - 1) & ~(align - 1)
    return cursor


def walk_top_fit(segments, base, align, n):
    """SimDevice's top-down placement as it walked every live segment (the reference)."""
    top = base + TOP_DOWN_RANGE
    if n > TOP_DOWN_RANGE:
        return walk_first_fit(segments, base, align, n)
    addr = (top - n) & ~(align - 1)
    for start, size in reversed([s for s in segments if s[0] < top]):
        if start + size <= addr:
            break
        if start < addr + n:
            if start < base + n:
                return walk_first_fit(segments, base, align, n)
            addr = (start - n) & ~(align - 1)
    if addr < base:
        return walk_first_fit(segments, base, align, n)
    return addr


@pytest.mark.parametrize("top_down", [False, True])
@pytest.mark.parametrize("align,base", [(2 * MiB, 0x7F0000000000), (8 * MiB, 0x7F0000000000),
                                        (2 * MiB, 0x7F0000000000 + 512 * KiB)])
@pytest.mark.parametrize("straddle", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_segment_placement_gives_the_addresses_of_the_walk_over_every_live_segment(top_down, align,
                                                                                    base, straddle,
                                                                                    seed):
    """Random segment sizes (up to whole top-down ranges, so that top-down placement falls back to
    first fit), frees anywhere, and queued placements: every new segment lands where the walk
    over all live segments put it. With `straddle`, some queued segments start below
    base_address and reach past it, where first fit (which ignores them) overlaps them."""
    rng = random.Random(seed)
    sim = SimDevice(1 << 50, base_address=base, alignment=align, top_down=top_down)
    a = CachingAllocator(backend=sim, config="")
    walk = walk_top_fit if top_down else walk_first_fit
    live = []
    for step in range(1500):
        r = rng.random()
        if live and r < 0.4:
            a.free(live.pop(rng.randrange(len(live))))
            a.empty_cache()
            continue
        # Requests of 10 MiB and more in whole 2 MiB: each gets a segment of exactly its size.
        size = rng.choice([10 * MiB, 20 * MiB, 22 * MiB, 64 * MiB, 2 * MiB * rng.randrange(5, 400)])
        if rng.random() < 0.005:
            size = 200 * GiB
        queued = r < 0.45
        if queued:              # a queued address: inside the range, or straddling base_address
            addr = (base - 4 * MiB if straddle and rng.random() < 0.03
                    else base + rng.randrange(1 << 34) // align * align)
            if any(s < addr + size and addr < s + n for s, n in sim.segments()):
                continue
            sim.place_segments([(addr, size)])
        before = sim.segments()
        live.append(a.malloc(size))
        (new,) = set(sim.segments()) - set(before)
        assert new[1] == size
        if queued:
            assert new[0] == addr
        else:
            assert new[0] == walk(before, base, align, size), (step, new)


@pytest.mark.parametrize("top_down", [False, True])
def test_placing_40000_live_segments_does_not_walk_them_all(top_down):
    """40,000 segments, each placed with all the others live: 7 s when every placement walked
    every live segment (O(n**2)), well under a second in O(log n)."""
    sim = SimDevice(1 << 50, top_down=top_down)
    a = CachingAllocator(backend=sim, config="")
    start = time.perf_counter()
    for _ in range(40000):
        a.malloc(20 * MiB)
    elapsed = time.perf_counter() - start
    assert len(sim.segments()) == 40000
    assert elapsed < 2.0, f"{elapsed:.2f} s"
