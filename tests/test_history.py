"""Specification of memory history: the ring buffer, trace actions, arguments and user metadata.

Every test runs on SimDevice and, where a GPU is present, on the GPU (tests/backends.py's harness,
as tests/test_core.py: [sim] and [cuda]); @sim_only marks, with the reason, those that need what
only the simulator has."""
import sys
import threading

import pytest
from hypothesis import given, settings, strategies as st

import pyalloc
from pyalloc import CachingAllocator, OutOfMemoryError, SimDevice
from pyalloc.snapshot import DEFAULT_MAX_ENTRIES, SKIPPABLE_ACTIONS

import backends
from backends import backend, make, sim_only  # noqa: F401 (backend: the autouse fixture)
from units import MiB
SMALL_SEGMENT = 2 * MiB       # a small-pool segment (requests up to 1 MiB)
LARGE_SEGMENT = 20 * MiB      # a large-pool segment for requests in (1 MiB, 10 MiB)


BASE = 0x7F0000000000
HISTORY_MEMORY = 1 << 30      # the simulated device of make_allocator, unless a test asks for another


def make_allocator(total_memory=HISTORY_MEMORY, **history):
    """An allocator recording history with `history` as arguments, on the running test's device
    (tests/backends.py: [sim] or [cuda]). On SimDevice its segments start at BASE even while
    another test device lives (live SimDevices without a base_address get disjoint addresses), so
    that two runs of one program trace the same addresses."""
    if backends._backend == "sim":
        alloc = CachingAllocator(backend=SimDevice(total_memory, base_address=BASE), config="")
    else:
        assert total_memory == HISTORY_MEMORY, "a test that needs a device of its own size is @sim_only"
        dev, alloc = make()
        alloc.test_device = dev           # CudaTestDevice: the GPU with SimDevice's test API
    alloc.record_memory_history(**history)
    return alloc


def new_stream(alloc):
    """A stream made by the allocator's device (a cache miss refuses a handle no stream has)."""
    return getattr(alloc, "test_device", alloc.backend).create_stream()


def trace(alloc):
    return alloc.snapshot()["device_traces"][alloc.device]


def actions(alloc):
    return [e["action"] for e in trace(alloc)]


def events(alloc):
    """(action, addr, size) of the ring buffer's entries, oldest first, without taking a snapshot."""
    return [(a, addr, size) for a, addr, size, *_ in alloc._history_entries()[0]]


@pytest.fixture(autouse=True)
def no_metadata():
    pyalloc.set_memory_metadata("")
    yield
    pyalloc.set_memory_metadata("")


# ------------------------------------------------------------------------------- ring buffer

def run_ops(alloc, sizes):
    """Allocate and free each size in turn (cache hits after the first segment)."""
    for n in sizes:
        alloc.free(alloc.malloc(n))


@sim_only("two devices that hand out the same addresses (base_address), to compare their traces")
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=60), capacity=st.integers(1, 50))
def test_ring_buffer_keeps_newest_max_entries_in_order(sizes, capacity):
    full = make_allocator(max_entries=10_000)
    run_ops(full, sizes)
    everything = events(full)
    ring = make_allocator(max_entries=capacity)
    run_ops(ring, sizes)
    _, dropped = ring._history_entries()
    assert events(ring) == everything[-capacity:]
    assert dropped == max(0, len(everything) - capacity)


def test_changing_max_entries_while_recording_keeps_the_newest_entries():
    alloc = make_allocator(max_entries=100)
    run_ops(alloc, [512 * i for i in range(1, 11)])
    before = events(alloc)
    alloc.record_memory_history(max_entries=7)
    assert events(alloc) == before[-7:]
    alloc.record_memory_history(max_entries=50)
    assert events(alloc) == before[-7:]
    run_ops(alloc, [4096])
    assert events(alloc)[-3:] == [(a, events(alloc)[-1][1], 4096)
                                  for a in ("alloc", "free_requested", "free_completed")]


def test_clear_history_empties_the_ring_buffer():
    alloc = make_allocator()
    run_ops(alloc, [100, 200])
    alloc.record_memory_history(clear_history=True)
    assert events(alloc) == []


def test_enabling_again_without_clear_keeps_the_entries():
    alloc = make_allocator()
    run_ops(alloc, [100])
    before = events(alloc)
    alloc.record_memory_history(context=None)
    assert events(alloc) == before


def test_enabled_none_stops_recording_and_clears():
    alloc = make_allocator()
    run_ops(alloc, [100, 200])
    alloc.record_memory_history(enabled=None)
    assert alloc.history_settings is None
    run_ops(alloc, [300])
    assert events(alloc) == []
    alloc.record_memory_history()
    assert events(alloc) == []
    run_ops(alloc, [400])
    assert [a for a, _, _ in events(alloc)] == ["alloc", "free_requested", "free_completed"]


def test_history_is_off_by_default():
    _, alloc = make()
    run_ops(alloc, [100])
    assert alloc.history_settings is None
    assert events(alloc) == []
    assert alloc.snapshot()["device_traces"] == [[]]


def test_enabled_state_keeps_a_single_trace_entry():
    alloc = make_allocator(enabled="state")
    run_ops(alloc, [100, 200, 300])
    assert alloc.history_settings.max_entries == 1
    assert events(alloc) == [("free_completed", events(alloc)[0][1], 300)]


def test_default_max_entries_is_documented_value():
    alloc = make_allocator()
    assert alloc.history_settings.max_entries == DEFAULT_MAX_ENTRIES == 1_000_000


# ------------------------------------------------------------------------------- actions

def test_alloc_entry_has_address_requested_size_and_stream():
    alloc = make_allocator()
    stream = new_stream(alloc)
    ptr = alloc.malloc(1000, stream=stream)
    e = trace(alloc)[-1]
    assert (e["action"], e["addr"], e["size"], e["stream"]) == ("alloc", ptr, 1000, stream)


def test_new_segment_is_recorded_before_the_allocation_it_serves():
    alloc = make_allocator()
    ptr = alloc.malloc(3 * MiB)
    t = trace(alloc)
    assert [(e["action"], e["addr"], e["size"]) for e in t] == [
        ("segment_alloc", ptr, LARGE_SEGMENT), ("alloc", ptr, 3 * MiB)]


def test_free_without_other_streams_completes_at_once():
    alloc = make_allocator()
    ptr = alloc.malloc(1000)
    alloc.free(ptr)
    assert [(e["action"], e["addr"], e["size"]) for e in trace(alloc)[-2:]] == [
        ("free_requested", ptr, 1000), ("free_completed", ptr, 1000)]


def test_free_of_block_used_on_another_stream_completes_when_that_work_does():
    sim, alloc = make()
    alloc.record_memory_history(context=None)
    side = sim.create_stream()
    ptr = alloc.malloc(1000)
    alloc.record_stream(ptr, side)
    sim.launch(side)                  # work on `side` still uses the block
    alloc.free(ptr)
    assert actions(alloc)[-1] == "free_requested"
    other = alloc.malloc(5000)        # malloc polls events: not complete yet
    assert "free_completed" not in actions(alloc)
    sim.complete(side)
    alloc.malloc(6000)                # now the event is complete: freed before this alloc
    t = trace(alloc)
    done = [i for i, e in enumerate(t) if e["action"] == "free_completed"]
    assert len(done) == 1
    assert (t[done[0]]["addr"], t[done[0]]["size"]) == (ptr, 1000)
    assert (t[done[0] + 1]["action"], t[done[0] + 1]["size"]) == ("alloc", 6000)
    assert other != ptr


def test_empty_cache_records_segment_free_for_each_released_segment():
    alloc = make_allocator()
    small = alloc.malloc(1000)
    large = alloc.malloc(3 * MiB)
    alloc.free(small)
    alloc.free(large)
    alloc.empty_cache()
    freed = [(e["addr"], e["size"]) for e in trace(alloc) if e["action"] == "segment_free"]
    assert sorted(freed) == sorted([(small, SMALL_SEGMENT), (large, LARGE_SEGMENT)])


def test_expandable_segments_record_segment_map_and_unmap():
    _, alloc = make("expandable_segments:True")
    alloc.record_memory_history(skip_actions=list(SKIPPABLE_ACTIONS))   # these cannot be skipped
    ptr = alloc.malloc(3 * MiB)
    alloc.free(ptr)
    alloc.empty_cache()
    assert events(alloc) == [("segment_map", ptr, LARGE_SEGMENT), ("segment_unmap", ptr, LARGE_SEGMENT)]


@sim_only("a device of 64 MiB, so that out of memory comes where the test needs it")
def test_oom_entry_has_device_free_bytes_and_rounded_request():
    alloc = make_allocator(total_memory=64 * MiB)
    keep = alloc.malloc(30 * MiB)
    stream = new_stream(alloc)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(40 * MiB + 1, stream=stream)
    e = trace(alloc)[-1]
    assert e["action"] == "oom"
    assert "addr" not in e
    free_now, _total = alloc.backend.mem_get_info()
    assert e["device_free"] == free_now == 64 * MiB - 30 * MiB
    assert e["size"] == alloc.round_size(40 * MiB + 1) == 40 * MiB + 512
    assert e["stream"] == stream
    assert keep


def test_snapshot_records_a_snapshot_entry_with_active_bytes():
    alloc = make_allocator()
    alloc.malloc(1000)
    alloc.malloc(3 * MiB)
    first = alloc.snapshot()
    assert "snapshot" not in [e["action"] for e in first["device_traces"][0]]
    e = trace(alloc)[-1]
    assert (e["action"], e["addr"], e["size"]) == ("snapshot", 0, 1024 + 3 * MiB)


def test_trace_entries_carry_pytorchs_fields():
    alloc = make_allocator(context=None)
    alloc.free(alloc.malloc(100))
    for e in trace(alloc):
        assert list(e) == ["action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata"]
        assert e["compile_context"] == "N/A"
        assert e["user_metadata"] == ""


def test_times_are_epoch_microseconds():
    import time
    alloc = make_allocator()
    before = int(time.time() * 1e6)
    alloc.malloc(100)
    after = int(time.time() * 1e6)
    assert before - 1000 <= trace(alloc)[-1]["time_us"] <= after + 1000


# ------------------------------------------------------------------------------- skip_actions

def do_everything(alloc):
    """Cause every skippable action once: segment_alloc, alloc, free_*, snapshot, segment_free, oom."""
    ptr = alloc.malloc(3 * MiB)
    alloc.free(ptr)
    alloc.snapshot()
    alloc.empty_cache()
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(alloc.backend.total_memory + 1)


@sim_only("a device of 256 MiB, so that an out-of-memory entry comes where the test needs it")
@pytest.mark.parametrize("skipped", SKIPPABLE_ACTIONS)
def test_skip_actions_drops_only_the_named_action(skipped):
    alloc = make_allocator(total_memory=256 * MiB, skip_actions=[skipped])
    do_everything(alloc)
    seen = set(a for a, _, _ in events(alloc))
    assert seen == set(SKIPPABLE_ACTIONS) - {skipped}


@sim_only("a device of 256 MiB, so that an out-of-memory entry comes where the test needs it")
def test_without_skip_actions_every_action_is_recorded():
    alloc = make_allocator(total_memory=256 * MiB)
    do_everything(alloc)
    assert set(a for a, _, _ in events(alloc)) == set(SKIPPABLE_ACTIONS)


def test_skip_actions_can_name_several():
    alloc = make_allocator(skip_actions=("alloc", "free_requested", "segment_alloc"))
    alloc.free(alloc.malloc(100))
    assert [a for a, _, _ in events(alloc)] == ["free_completed"]
    assert alloc.history_settings.skip_actions == ("alloc", "free_requested", "segment_alloc")


# ------------------------------------------------------------------------------- bad arguments

BAD_ARGUMENTS = [
    (dict(enabled="everything"), ValueError, "expected state to be 'state', 'all', or None, got 'everything'"),
    (dict(enabled=True), TypeError, "expected state to be 'state', 'all', or None, got bool True"),
    (dict(enabled=1), TypeError, "got int 1"),
    (dict(context="stack"), ValueError, "expected context to be 'state', 'alloc', 'all', or None, got 'stack'"),
    (dict(context=0), TypeError, "expected context to be 'state', 'alloc', 'all', or None, got int 0"),
    (dict(stacks="cpp"), ValueError, "expected stacks to be 'python', or 'all', got 'cpp'"),
    (dict(stacks=None), TypeError, "expected stacks to be 'python', or 'all', got NoneType None"),
    (dict(max_entries=0), ValueError, "max_entries must be between 1 and sys.maxsize, got 0"),
    (dict(max_entries=-5), ValueError, "got -5"),
    (dict(max_entries=sys.maxsize + 1), ValueError, f"got {sys.maxsize + 1}"),
    (dict(max_entries=10.0), TypeError, "max_entries must be an int number of trace entries, got float 10.0"),
    (dict(max_entries=True), TypeError, "got bool True"),
    (dict(clear_history="yes"), TypeError, "clear_history must be True or False, got str 'yes'"),
    (dict(skip_actions="alloc"), TypeError, "skip_actions must be a list of action names"),
    (dict(skip_actions=5), TypeError, "got int 5"),
    (dict(skip_actions=["alloc", "malloc"]), ValueError, "unknown action 'malloc'"),
    (dict(skip_actions=["segment_map"]), ValueError, "'segment_map' cannot be skipped"),
]


@pytest.mark.parametrize("kwargs, error, text", BAD_ARGUMENTS)
def test_bad_argument_raises_naming_the_value(kwargs, error, text):
    alloc = make_allocator()
    with pytest.raises(error) as info:
        alloc.record_memory_history(**kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize("kwargs, error, text", BAD_ARGUMENTS)
def test_bad_argument_leaves_history_unchanged(kwargs, error, text):
    alloc = make_allocator(max_entries=50, context="alloc", skip_actions=["snapshot"])
    run_ops(alloc, [100, 200])
    settings_before = alloc.history_settings
    entries_before = alloc._history_entries()
    with pytest.raises(error):
        alloc.record_memory_history(**kwargs)
    assert alloc.history_settings == settings_before
    assert alloc._history_entries() == entries_before
    run_ops(alloc, [300])       # still recording as before, with stacks on alloc entries
    assert events(alloc)[-3:] == [(a, events(alloc)[-1][1], 300)
                                  for a in ("alloc", "free_requested", "free_completed")]
    assert "frames" in trace(alloc)[-3]


def test_bad_argument_leaves_history_off_when_it_was_off():
    _, alloc = make()
    with pytest.raises(ValueError):
        alloc.record_memory_history(context="bogus")
    run_ops(alloc, [100])
    assert alloc.history_settings is None and events(alloc) == []


def test_stacks_all_is_accepted_and_records_python_frames():
    alloc = make_allocator(stacks="all")
    alloc.malloc(100)
    assert trace(alloc)[-1]["frames"][0]["name"] == "test_stacks_all_is_accepted_and_records_python_frames"


# ------------------------------------------------------------------------------- metadata

def test_metadata_is_stamped_on_trace_entries_while_set():
    alloc = make_allocator()
    alloc.malloc(100)
    pyalloc.set_memory_metadata("kv-cache")
    alloc.malloc(200)
    pyalloc.set_memory_metadata("")
    alloc.malloc(300)
    assert [(e["size"], e["user_metadata"]) for e in trace(alloc) if e["action"] == "alloc"] == [
        (100, ""), (200, "kv-cache"), (300, "")]


def test_free_completed_by_a_later_malloc_carries_that_calls_metadata():
    # PyTorch's documented caveat: metadata is the value current when the event is recorded.
    sim, alloc = make()
    alloc.record_memory_history()
    side = sim.create_stream()
    pyalloc.set_memory_metadata("weights")
    ptr = alloc.malloc(1000)
    alloc.record_stream(ptr, side)
    sim.launch(side)
    alloc.free(ptr)
    sim.complete(side)
    pyalloc.set_memory_metadata("activations")
    alloc.malloc(10)
    done = [e for e in trace(alloc) if e["action"] == "free_completed"]
    assert [(e["addr"], e["user_metadata"]) for e in done] == [(ptr, "activations")]


def test_get_memory_metadata_returns_what_was_set():
    pyalloc.set_memory_metadata("optimizer state")
    assert pyalloc.get_memory_metadata() == "optimizer state"
    pyalloc.set_memory_metadata("")
    assert pyalloc.get_memory_metadata() == ""


@pytest.mark.parametrize("bad", [None, 5, b"bytes", ["x"]])
def test_set_memory_metadata_rejects_non_string_and_keeps_the_old_value(bad):
    pyalloc.set_memory_metadata("kept")
    with pytest.raises(TypeError) as info:
        pyalloc.set_memory_metadata(bad)
    assert repr(bad) in str(info.value) and "must be a str" in str(info.value)
    assert pyalloc.get_memory_metadata() == "kept"


def test_metadata_set_in_one_thread_does_not_leak_into_another():
    alloc = make_allocator()
    tagged = threading.Event()
    other_done = threading.Event()
    seen = {}

    def tagger():
        pyalloc.set_memory_metadata("thread-A")
        tagged.set()
        other_done.wait(10)
        seen["A"] = alloc.malloc(1000)
        seen["A meta"] = pyalloc.get_memory_metadata()

    def plain():
        tagged.wait(10)                       # A has set its metadata by now
        seen["B meta"] = pyalloc.get_memory_metadata()
        seen["B"] = alloc.malloc(2000)
        other_done.set()

    threads = [threading.Thread(target=tagger), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["A meta"] == "thread-A" and seen["B meta"] == ""
    by_addr = {e["addr"]: e["user_metadata"] for e in trace(alloc) if e["action"] == "alloc"}
    assert by_addr == {seen["A"]: "thread-A", seen["B"]: ""}
    assert pyalloc.get_memory_metadata() == ""      # this thread never set any
    blocks = {b["address"]: b["user_metadata"] for s in alloc.snapshot()["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert blocks == {seen["A"]: "thread-A", seen["B"]: ""}


def test_same_string_from_many_threads_interns_to_one_value():
    alloc = make_allocator()
    ptrs = []
    lock = threading.Lock()

    def work(i):
        pyalloc.set_memory_metadata(f"tag-{i % 3}")
        p = alloc.malloc(512 * (i + 1))
        with lock:
            ptrs.append((p, f"tag-{i % 3}", 512 * (i + 1)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    expected = {}
    for _, tag, n in ptrs:
        expected[tag] = expected.get(tag, 0) + n
    assert alloc.memory_by_metadata(requested=True) == dict(sorted(expected.items(), key=lambda kv: (-kv[1], kv[0])))


# ------------------------------------------------------------------------------- memory_by_metadata

TAGS = ["", "kv-cache", "weights", "activations"]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["malloc", "free"]), st.sampled_from(TAGS),
                              st.integers(1, 3 * MiB), st.integers(0, 1 << 30)), max_size=40))
def test_memory_by_metadata_equals_a_recount(ops):
    alloc = make_allocator(total_memory=1 << 30, context=None)
    live = {}                    # ptr -> (tag, requested bytes), kept by the test itself
    for op, tag, size, pick in ops:
        if op == "malloc":
            pyalloc.set_memory_metadata(tag)
            live[alloc.malloc(size)] = (tag, size)
        elif live:
            ptr = sorted(live)[pick % len(live)]
            alloc.free(ptr)
            del live[ptr]
    pyalloc.set_memory_metadata("")
    requested = {}
    for tag, size in live.values():
        requested[tag] = requested.get(tag, 0) + size
    assert alloc.memory_by_metadata(requested=True) == requested
    by_block = {}
    for seg in alloc.snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                by_block[b["user_metadata"]] = by_block.get(b["user_metadata"], 0) + b["size"]
    assert alloc.memory_by_metadata() == by_block
    assert sum(alloc.memory_by_metadata().values()) == alloc.memory_allocated()


def test_memory_by_metadata_works_with_history_off_and_orders_largest_first():
    _, alloc = make()
    pyalloc.set_memory_metadata("small")
    alloc.malloc(512)
    pyalloc.set_memory_metadata("big")
    alloc.malloc(4096)
    assert list(alloc.memory_by_metadata().items()) == [("big", 4096), ("small", 512)]


def test_memory_by_metadata_leaves_out_blocks_waiting_for_other_streams():
    sim, alloc = make()
    side = sim.create_stream()
    pyalloc.set_memory_metadata("kv-cache")
    ptr = alloc.malloc(1000)
    alloc.record_stream(ptr, side)
    sim.launch(side)
    alloc.free(ptr)
    assert alloc.memory_by_metadata() == {}


# ------------------------------------------------------------------------------- stacks

def test_context_none_captures_no_stacks():
    alloc = make_allocator(context=None)
    alloc.free(alloc.malloc(100))
    alloc.malloc(100)
    snap = alloc.snapshot()
    assert all("frames" not in e for e in snap["device_traces"][0])
    assert all(b["frames"] == [] for s in snap["segments"] for b in s["blocks"])


def test_context_state_puts_stacks_on_blocks_and_free_entries_only():
    alloc = make_allocator(context="state")
    ptr = alloc.malloc(100)
    alloc.free(ptr)
    alloc.malloc(100)
    snap = alloc.snapshot()
    by_action = {}
    for e in snap["device_traces"][0]:
        by_action.setdefault(e["action"], []).append("frames" in e)
    assert by_action["alloc"] == [False, False]
    assert by_action["segment_alloc"] == [False]
    assert by_action["free_requested"] == [True] and by_action["free_completed"] == [True]
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert live[0]["frames"][0]["name"] == "test_context_state_puts_stacks_on_blocks_and_free_entries_only"


def allocate_here(alloc):
    return alloc.malloc(100)


def free_here(alloc, ptr):
    alloc.free(ptr)


def test_context_alloc_gives_free_entries_the_allocation_stack():
    alloc = make_allocator(context="alloc")
    free_here(alloc, allocate_here(alloc))
    t = trace(alloc)
    assert [(e["action"], e["frames"][0]["name"]) for e in t] == [
        ("segment_alloc", "allocate_here"), ("alloc", "allocate_here"),
        ("free_requested", "allocate_here"), ("free_completed", "allocate_here")]


def test_context_all_gives_free_entries_the_free_call_stack():
    alloc = make_allocator(context="all")
    free_here(alloc, allocate_here(alloc))
    t = trace(alloc)
    assert [(e["action"], e["frames"][0]["name"]) for e in t] == [
        ("segment_alloc", "allocate_here"), ("alloc", "allocate_here"),
        ("free_requested", "free_here"), ("free_completed", "free_here")]


def test_turning_history_off_stops_stack_capture():
    alloc = make_allocator(context="all")
    alloc.record_memory_history(enabled=None)
    assert not alloc.capture_alloc_stacks and not alloc.capture_free_stacks
    ptr = alloc.malloc(100)
    blocks = [b for s in alloc.snapshot()["segments"] for b in s["blocks"] if b["address"] == ptr]
    assert blocks[0]["frames"] == []
