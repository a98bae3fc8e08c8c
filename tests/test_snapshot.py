"""Specification of snapshots: PyTorch's format, block states, frames, files, viewers, replay."""
import base64
import gzip
import inspect
import json
import os
import pickle
import pickletools
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pyalloc
from pyalloc import CachingAllocator, SimDevice
from pyalloc.replay import replay
from pyalloc.snapshot import SnapshotError, dump, load

from units import MiB
TRACES = Path(__file__).resolve().parent / "data"     # PyTorch traces (tests/data/README.md)


@pytest.fixture(autouse=True)
def no_metadata():
    pyalloc.set_memory_metadata("")
    yield
    pyalloc.set_memory_metadata("")


def make_allocator(sim=None, **history):
    alloc = CachingAllocator(backend=sim or SimDevice(1 << 30), config="")
    alloc.record_memory_history(**history)
    return alloc


def busy_allocator():
    """Live, pending-free and cached blocks on two streams, tagged with metadata."""
    sim = SimDevice(1 << 30)
    alloc = make_allocator(sim)
    side = sim.create_stream()
    pyalloc.set_memory_metadata("kv-cache")
    kept = alloc.malloc(1000)
    pending = alloc.malloc(2000)
    alloc.record_stream(pending, side)
    sim.launch(side)
    alloc.free(pending)                     # waits for `side`: active_pending_free
    pyalloc.set_memory_metadata("weights")
    big = alloc.malloc(3 * MiB, stream=side)
    alloc.free(alloc.malloc(5 * MiB))       # a cached large segment
    pyalloc.set_memory_metadata("")
    return alloc, {"kept": kept, "pending": pending, "big": big, "side": side}


def pytorch_snapshot(name="resnet_train-default"):
    return load(TRACES / f"{name}.pickle.gz")


# ------------------------------------------------------------------------------- format

def test_top_level_keys_are_pytorchs():
    alloc, _ = busy_allocator()
    assert list(alloc.snapshot()) == list(pytorch_snapshot())


def test_segment_keys_are_pytorchs_in_pytorchs_order():
    alloc, _ = busy_allocator()
    theirs = pytorch_snapshot()["segments"][0]
    for seg in alloc.snapshot()["segments"]:
        assert list(seg) == list(theirs)


def test_block_keys_are_pytorchs_plus_user_metadata():
    alloc, _ = busy_allocator()
    theirs = list(pytorch_snapshot()["segments"][0]["blocks"][0])
    for seg in alloc.snapshot()["segments"]:
        for b in seg["blocks"]:
            assert list(b) == theirs + ["user_metadata"]


def test_trace_entry_keys_are_pytorchs_without_context():
    alloc = make_allocator(context=None)
    alloc.free(alloc.malloc(100))
    theirs = list(pytorch_snapshot()["device_traces"][0][0])
    for e in alloc.snapshot()["device_traces"][0]:
        assert list(e) == theirs


def test_allocator_settings_have_pytorchs_keys_and_values_for_the_same_config():
    ref = pytorch_snapshot("resnet_train-split128")
    alloc = CachingAllocator(backend=SimDevice(), config=ref["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"])
    assert alloc.snapshot()["allocator_settings"] == ref["allocator_settings"]


def test_segment_fields_describe_the_segment():
    alloc, ptrs = busy_allocator()
    segs = {s["address"]: s for s in alloc.snapshot()["segments"]}
    small = segs[ptrs["kept"]]
    assert (small["device"], small["total_size"], small["stream"], small["segment_type"],
            small["segment_pool_id"], small["is_expandable"]) == (0, 2 * MiB, 0, "small", (0, 0), False)
    big = segs[ptrs["big"]]
    assert (big["total_size"], big["stream"], big["segment_type"]) == (20 * MiB, ptrs["side"], "large")


def test_segments_are_sorted_by_address_and_blocks_tile_them():
    alloc, _ = busy_allocator()
    segs = alloc.snapshot()["segments"]
    assert [s["address"] for s in segs] == sorted(s["address"] for s in segs)
    for s in segs:
        addr = s["address"]
        for b in s["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
        assert addr == s["address"] + s["total_size"]


def test_segment_sizes_equal_a_recount_of_their_blocks():
    alloc, _ = busy_allocator()
    for s in alloc.snapshot()["segments"]:
        blocks = s["blocks"]
        assert s["allocated_size"] == sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        assert s["active_size"] == sum(b["size"] for b in blocks if b["state"] != "inactive")
        assert s["requested_size"] == sum(b["requested_size"] for b in blocks if b["state"] != "inactive")


def test_snapshot_totals_match_memory_stats():
    alloc, _ = busy_allocator()
    segs = alloc.snapshot()["segments"]
    stats = alloc.memory_stats()
    assert sum(s["total_size"] for s in segs) == stats["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in segs) == stats["allocated_bytes.all.current"]
    assert sum(s["active_size"] for s in segs) == stats["active_bytes.all.current"]
    assert sum(s["requested_size"] for s in segs) == stats["requested_bytes.all.current"]


def test_device_traces_is_indexed_by_device():
    alloc = CachingAllocator(2, backend=SimDevice(device=2), config="")
    alloc.record_memory_history()
    ptr = alloc.malloc(100)
    snap = alloc.snapshot()
    assert snap["device_traces"][:2] == [[], []]
    assert [e["addr"] for e in snap["device_traces"][2] if e["action"] == "alloc"] == [ptr]
    assert {s["device"] for s in snap["segments"]} == {2}


def test_external_annotations_is_an_empty_list():
    alloc, _ = busy_allocator()
    assert alloc.snapshot()["external_annotations"] == []


# ------------------------------------------------------------------------------- block states

def block_at(snapshot, address):
    return next(b for s in snapshot["segments"] for b in s["blocks"] if b["address"] == address)


def test_live_block_is_active_allocated():
    alloc, ptrs = busy_allocator()
    b = block_at(alloc.snapshot(), ptrs["kept"])
    assert (b["state"], b["requested_size"], b["size"]) == ("active_allocated", 1000, 1024)


def test_freed_block_waiting_for_another_stream_is_active_pending_free():
    alloc, ptrs = busy_allocator()
    b = block_at(alloc.snapshot(), ptrs["pending"])
    assert (b["state"], b["requested_size"], b["size"]) == ("active_pending_free", 2000, 2048)


def test_pending_free_block_becomes_inactive_when_the_stream_is_done():
    alloc, ptrs = busy_allocator()
    alloc.backend.synchronize()
    alloc.process_events()
    segs = alloc.snapshot()["segments"]
    small = next(s for s in segs if s["address"] == ptrs["kept"])
    assert [b["state"] for b in small["blocks"]] == ["active_allocated", "inactive"]


def test_cached_block_is_inactive():
    alloc, _ = busy_allocator()
    cached = [s for s in alloc.snapshot()["segments"] if s["active_size"] == 0]
    assert len(cached) == 1
    assert [(b["state"], b["size"]) for b in cached[0]["blocks"]] == [("inactive", 20 * MiB)]


def test_block_user_metadata_is_the_metadata_current_at_allocation():
    alloc, ptrs = busy_allocator()
    snap = alloc.snapshot()
    assert block_at(snap, ptrs["kept"])["user_metadata"] == "kv-cache"
    assert block_at(snap, ptrs["pending"])["user_metadata"] == "kv-cache"
    assert block_at(snap, ptrs["big"])["user_metadata"] == "weights"


def test_inactive_blocks_carry_no_metadata_or_frames():
    alloc, _ = busy_allocator()
    for s in alloc.snapshot()["segments"]:
        for b in s["blocks"]:
            if b["state"] == "inactive":
                assert (b["user_metadata"], b["frames"]) == ("", [])


# ------------------------------------------------------------------------------- frames

def inner(alloc):
    return alloc.malloc(100), inspect.currentframe().f_lineno


def outer(alloc):
    return inner(alloc), inspect.currentframe().f_lineno


def test_frames_are_innermost_first_with_file_line_and_function():
    alloc = make_allocator(context="alloc")
    (ptr, inner_line), outer_line = outer(alloc)
    frames = block_at(alloc.snapshot(), ptr)["frames"]
    assert [(f["filename"], f["line"], f["name"]) for f in frames[:3]] == [
        (__file__, inner_line, "inner"), (__file__, outer_line, "outer"),
        (__file__, frames[2]["line"], "test_frames_are_innermost_first_with_file_line_and_function")]
    # Below inner and outer: this test and whatever called it, as the interpreter reports them.
    assert [f["name"] for f in frames[2:]] == [f.function for f in inspect.stack()]


def test_alloc_trace_entry_has_the_same_frames_as_its_block():
    alloc = make_allocator(context="alloc")
    (ptr, _), _ = outer(alloc)
    snap = alloc.snapshot()
    entry = next(e for e in snap["device_traces"][0] if e["action"] == "alloc")
    assert entry["frames"] == block_at(snap, ptr)["frames"]


def test_segment_frames_are_the_stack_that_allocated_the_segment():
    alloc = make_allocator(context="state")
    (ptr, _), _ = outer(alloc)           # splits the new segment: the front block heads it
    alloc.malloc(200)                    # from the same segment
    seg = next(s for s in alloc.snapshot()["segments"] if s["address"] == ptr)
    assert [f["name"] for f in seg["frames"][:2]] == ["inner", "outer"]


def test_segment_frames_survive_free_and_merge():
    alloc = make_allocator(context="state")
    (ptr, _), _ = outer(alloc)
    alloc.free(ptr)                      # merges the whole segment back into one block
    seg = next(s for s in alloc.snapshot()["segments"] if s["address"] == ptr)
    assert [f["name"] for f in seg["frames"][:2]] == ["inner", "outer"]


def test_stack_key_names_code_and_instruction_of_each_frame():
    from pyalloc._stacks import stack_key
    here = inspect.currentframe()
    key = stack_key()
    words = [int.from_bytes(key[i:i + 8], sys.byteorder) for i in range(0, len(key), 8)]
    codes = words[0::2]
    expected = []
    f = here
    while f is not None:
        expected.append(id(f.f_code))
        f = f.f_back
    assert codes == expected
    assert stack_key(len(expected)) == b""        # every frame skipped: no stack


def test_identical_stacks_are_interned_once():
    alloc = make_allocator(context="all")
    for _ in range(50):
        ptr = alloc.malloc(100)
        alloc.free(ptr)
    assert len(alloc._stacks) == 2         # the malloc line and the free line of this loop


# ------------------------------------------------------------------------------- files

def pickle_protocol(raw):
    op, arg, _ = next(pickletools.genops(raw))
    assert op.name == "PROTO"
    return arg


@pytest.mark.parametrize("name", ["snap.pickle", "snap.pickle.gz"])
def test_dump_and_load_round_trip(tmp_path, name):
    alloc, _ = busy_allocator()
    snap = alloc.snapshot()
    dump(snap, tmp_path / name)
    assert load(tmp_path / name) == snap


def test_dump_snapshot_writes_the_allocators_snapshot(tmp_path):
    alloc, ptrs = busy_allocator()
    alloc.dump_snapshot(str(tmp_path / "s.pickle"))
    loaded = load(tmp_path / "s.pickle")
    assert block_at(loaded, ptrs["kept"])["user_metadata"] == "kv-cache"


def test_dump_uses_pickle_protocol_at_most_4(tmp_path):
    alloc, _ = busy_allocator()
    alloc.dump_snapshot(tmp_path / "s.pickle")
    assert pickle_protocol((tmp_path / "s.pickle").read_bytes()) <= 4


def test_gz_name_writes_gzip_with_protocol_at_most_4(tmp_path):
    alloc, _ = busy_allocator()
    alloc.dump_snapshot(tmp_path / "s.pickle.gz")
    raw = (tmp_path / "s.pickle.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b"
    assert pickle_protocol(gzip.decompress(raw)) <= 4


def test_dump_rejects_protocol_5(tmp_path):
    with pytest.raises(ValueError, match="protocol must be an int in 0..4"):
        dump({"segments": []}, tmp_path / "x.pickle", protocol=5)
    assert not (tmp_path / "x.pickle").exists()


def test_dump_rejects_a_non_dict(tmp_path):
    with pytest.raises(TypeError, match="snapshot must be a dict"):
        dump([1, 2], tmp_path / "x.pickle")


def test_load_reads_pytorchs_own_snapshot():
    snap = pytorch_snapshot()
    assert len(snap["segments"]) == 134 and len(snap["device_traces"][0]) == 24656


def test_load_wraps_a_bare_segment_list(tmp_path):
    alloc, _ = busy_allocator()
    segs = alloc.snapshot()["segments"]
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(segs, protocol=4))
    assert load(tmp_path / "s.pickle") == {"segments": segs, "device_traces": []}


class Foreign:
    pass


@pytest.mark.parametrize("content, fragment", [
    (b"this is not a pickle\n", "not a pickle"),
    (b"", "not a pickle"),
    (pickle.dumps(42), "is a pickle but not a memory snapshot: expected a dict with 'segments', got int"),
    (pickle.dumps({"traces": []}), "expected a dict with 'segments', got dict"),
    (pickle.dumps({"segments": "abc"}), "'segments' is not a list of segment dicts"),
    (pickle.dumps({"segments": [{"address": 1}]}), "a segment lacks total_size, blocks"),
    (pickle.dumps({"segments": [], "device_traces": {}}), "'device_traces' is not a list of lists"),
    (pickle.dumps({"segments": [], "x": Foreign()}), f"references {__name__}.Foreign"),
    (pickle.dumps({"segments": [], "x": os.system}), "references posix.system"),
    (gzip.compress(pickle.dumps({"segments": []}), mtime=0)[:20], "does not decompress"),
])
def test_load_rejects_a_foreign_file_naming_it(tmp_path, content, fragment):
    path = tmp_path / "foreign.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as info:
        load(path)
    assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_load_never_runs_code_from_the_pickle(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"segments": [], "x": Exploit(str(marker))})
    (tmp_path / "evil.pickle").write_bytes(payload)
    with pytest.raises(SnapshotError):
        load(tmp_path / "evil.pickle")
    assert not marker.exists()


class Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_load_of_a_missing_file_says_it_cannot_read_it(tmp_path):
    with pytest.raises(SnapshotError, match="cannot read snapshot .*missing.pickle.*No such file"):
        load(tmp_path / "missing.pickle")


def test_load_of_a_directory_says_it_cannot_read_it(tmp_path):
    with pytest.raises(SnapshotError, match="cannot read snapshot"):
        load(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_load_of_an_unreadable_file_says_it_cannot_read_it(tmp_path):
    path = tmp_path / "secret.pickle"
    path.write_bytes(pickle.dumps({"segments": []}))
    path.chmod(0)
    with pytest.raises(SnapshotError, match="cannot read snapshot .*Permission denied"):
        load(path)


@pytest.mark.parametrize("bad", [3, None, ["a.pickle"]])
def test_load_rejects_a_path_that_is_not_a_path(bad):
    with pytest.raises(TypeError, match="snapshot path must be a file path"):
        load(bad)


# ------------------------------------------------------------------------------- PyTorch's viewers

@pytest.fixture(scope="module")
def memory_viz():
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz
    return _memory_viz


def viewer_snapshot():
    """A snapshot with every action, stacks, pending frees and metadata, for PyTorch's tools."""
    sim = SimDevice(256 * MiB)
    alloc = make_allocator(sim, context="all")
    side = sim.create_stream()
    pyalloc.set_memory_metadata("kv-cache")
    alloc.malloc(1000)
    pyalloc.set_memory_metadata("activations")
    alloc.free(alloc.malloc(2 * MiB))
    alloc.snapshot()
    alloc.empty_cache()
    with pytest.raises(pyalloc.OutOfMemoryError):
        alloc.malloc(1 << 40)
    alloc.malloc(5 * MiB)
    pyalloc.set_memory_metadata("kv-cache")
    b = alloc.malloc(30 * MiB)
    alloc.record_stream(b, side)
    sim.launch(side)
    alloc.free(b)                            # stays active_pending_free
    pyalloc.set_memory_metadata("")
    return alloc.snapshot()


def embedded_snapshot(html):
    """The snapshot trace_plot/segment_plot embed in their HTML (base64 of a zero-padded pickle)."""
    files = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))
    raw = base64.b64decode(files[0]["base64"])
    return pickle.loads(raw)         # the padding zeros follow the STOP opcode


def test_memory_viz_segsum_reads_pyalloc_snapshot(memory_viz):
    snap = viewer_snapshot()
    out = memory_viz.segsum(snap)
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert f"segments: {len(snap['segments'])}" in out
    assert f"total_reserved: {memory_viz.Bytes(reserved)}" in out


def test_memory_viz_trace_reads_pyalloc_snapshot(memory_viz):
    snap = viewer_snapshot()
    out = memory_viz.trace(snap)
    assert f"{len(snap['device_traces'][0])} entries" in out
    assert "cudaMalloc(" in out and "cudaFree(" in out and "raise OutOfMemoryError" in out


@pytest.mark.parametrize("plot_segments", [False, True])
def test_memory_viz_trace_plot_embeds_the_metadata(memory_viz, plot_segments):
    snap = viewer_snapshot()
    html = memory_viz.trace_plot(snap, plot_segments=plot_segments)
    embedded = embedded_snapshot(html)
    assert embedded == snap
    seen = {e["user_metadata"] for e in embedded["device_traces"][0]}
    assert {"kv-cache", "activations"} <= seen


def test_memory_viz_segment_plot_reads_pyalloc_snapshot(memory_viz):
    snap = viewer_snapshot()
    html = memory_viz.segment_plot(snap)
    assert "Allocator State History" in html
    assert embedded_snapshot(html) == snap


def test_memory_viz_flamegraph_views_read_pyalloc_snapshot(memory_viz):
    # segments/memory/compare hand their lines to flamegraph.pl (downloaded from the network);
    # an identity formatter runs everything that reads the snapshot.
    snap = viewer_snapshot()
    lines = memory_viz.segments(snap, format_flamegraph=lambda text: text)
    assert ";active_allocated;" in lines and ";active_pending_free;" in lines
    assert memory_viz.memory(snap, format_flamegraph=lambda text: text)
    memory_viz.compare(snap["segments"], [], format_flamegraph=lambda text: text)


def test_memory_viz_command_line_reads_a_dumped_snapshot(memory_viz, tmp_path):
    alloc, _ = busy_allocator()
    alloc.dump_snapshot(tmp_path / "s.pickle")
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot",
                          str(tmp_path / "s.pickle"), "-o", str(tmp_path / "s.html")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert embedded_snapshot((tmp_path / "s.html").read_text()) == load(tmp_path / "s.pickle")


# ------------------------------------------------------------------------------- replay

def segment_layout(snapshot):
    return [(s["address"], s["total_size"], s["segment_type"], s["is_expandable"],
             [(b["size"], b["state"]) for b in s["blocks"]])
            for s in snapshot["segments"]]


@pytest.mark.parametrize("name", ["resnet_train-default", "resnet_train-split128", "resnet_train-expandable"])
def test_replay_with_history_ends_with_pytorchs_segments(name):
    ref = pytorch_snapshot(name)
    result = replay(TRACES / f"{name}.pickle.gz", placement="recorded", history=True)
    assert segment_layout(result.snapshot) == segment_layout(ref)


def test_replay_with_history_records_pytorchs_events():
    ref = pytorch_snapshot("resnet_train-default")
    result = replay(TRACES / "resnet_train-default.pickle.gz", history=True)
    ours = [(e["action"], e["addr"], e["size"], e["stream"]) for e in result.snapshot["device_traces"][0]]
    theirs = [(e["action"], e["addr"], e["size"], e["stream"]) for e in ref["device_traces"][0]]
    assert ours == theirs


def test_replay_without_history_keeps_no_snapshot():
    alloc, _ = busy_allocator()
    result = replay(alloc.snapshot())
    assert result.snapshot is None
    assert "snapshot" not in result.as_dict()


def test_replay_history_must_be_a_bool():
    with pytest.raises(TypeError, match="history must be True or False, got str 'yes'"):
        replay({"segments": [], "device_traces": [[]]}, history="yes")


def test_replay_of_a_pyalloc_snapshot_reproduces_its_segments():
    alloc, _ = busy_allocator()
    alloc.backend.synchronize()
    alloc.process_events()
    snap = alloc.snapshot()
    result = replay(snap, history=True)
    assert segment_layout(result.snapshot) == segment_layout(snap)
