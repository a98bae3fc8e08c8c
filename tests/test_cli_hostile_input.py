"""The command line against hostile or broken snapshots (issue 25, items 12-15): every one is
answered with one line on stderr and exit status 2, never a traceback, an endless read or a
terminal taken over; output files are replaced whole or not at all.

Every snapshot here is built by the test itself, in tmp_path.
"""
import gzip
import os
import pickle
import resource
import signal
import stat
import subprocess
import sys

import pytest

from pyalloc import __main__ as cli
from pyalloc import snapshot as snapshot_module
from pyalloc.snapshot import load

from units import MiB


def entry(action="alloc", addr=1 << 30, size=4096, **fields):
    out = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1,
           "compile_context": "N/A", "user_metadata": ""}
    out.update(fields)
    return out


def snapshot_of(entries, conf=""):
    return {"segments": [], "device_traces": [entries],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": conf}}


def write(path, snapshot):
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    return path


def alloc_free(**fields):
    """One allocation and its free, both carrying `fields` (user_metadata, frames)."""
    return [entry(**fields), entry("free_requested", **fields), entry("free_completed", **fields)]


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *fragments):
    assert (rc, out) == (2, ""), err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pyalloc: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def run_cli(tmp_path, *argv, **kwargs):
    """`python -m pyalloc ARGV` in a subprocess with UTF-8 standard streams."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "pyalloc", *map(str, argv)], cwd=tmp_path, env=env,
                          capture_output=True, timeout=120, **kwargs)


# -- item 12: lone surrogates, and output files replaced whole ------------------------------------

SURROGATE_TAG = "kv\ud800cache"
SURROGATE_FRAME = [{"filename": "train.py", "line": 7, "name": "step\udfff"}]


def test_view_summary_prints_a_lone_surrogate_in_a_tag_as_its_escape(tmp_path):
    path = write(tmp_path / "s.pickle", snapshot_of(alloc_free(user_metadata=SURROGATE_TAG)))
    proc = run_cli(tmp_path, "view", path)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "kv\\ud800cache" in proc.stdout.decode("utf-8")


def test_view_page_shows_a_lone_surrogate_in_a_frame_name_as_its_escape(capsys, tmp_path):
    path = write(tmp_path / "s.pickle", snapshot_of([entry(frames=SURROGATE_FRAME)]))
    out = tmp_path / "page.html"
    rc, _, err = run(capsys, "view", path, "-o", out)
    assert rc == 0, err
    assert "step\\udfff" in out.read_text(encoding="utf-8")


def limited_file_size(limit):
    """preexec_fn: files the child writes stop at `limit` bytes (write fails with EFBIG)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("command", [["view", "{trace}", "-o", "{out}"],
                                     ["replay", "{trace}", "--dump", "{out}"]], ids=["view-o", "replay-dump"])
def test_an_output_file_that_cannot_be_written_keeps_the_old_one_whole(tmp_path, command):
    trace = write(tmp_path / "t.pickle", snapshot_of(alloc_free() * 50))
    out = tmp_path / "old-output"
    old = b"the previous page, still wanted"
    out.write_bytes(old)
    argv = [a.format(trace=trace, out=out) for a in command]
    proc = run_cli(tmp_path, *argv, preexec_fn=limited_file_size(4096))
    assert proc.returncode == 2, proc.stderr.decode()
    assert len(proc.stderr.decode().splitlines()) == 1 and b"Traceback" not in proc.stderr
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old-output", "t.pickle"]   # no temporary left


def test_write_atomically_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "page.html"
    path.write_bytes(b"old")
    path.chmod(0o640)
    snapshot_module.write_atomically(path, b"new")
    assert (path.read_bytes(), path.stat().st_mode & 0o777) == (b"new", 0o640)


def test_write_atomically_writes_through_a_named_pipe_and_leaves_it_a_pipe(tmp_path):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)     # so that the writer's open returns
    try:
        snapshot_module.write_atomically(pipe, b"page")
        assert os.read(reader, 100) == b"page"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


def full_device(tmp_path):
    """A device node like /dev/full (writes fail with ENOSPC) in tmp_path, so that a test that
    fails replaces a copy and not the system's; skips where this process may not make one."""
    path = tmp_path / "full"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except (PermissionError, AttributeError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


@pytest.mark.parametrize("command", [["view", "{trace}", "-o", "{out}"],
                                     ["replay", "{trace}", "--dump", "{out}"]], ids=["view-o", "replay-dump"])
def test_an_output_on_a_full_device_is_one_line_error_and_the_device_stays(tmp_path, command):
    trace = write(tmp_path / "t.pickle", snapshot_of(alloc_free() * 50))
    out = full_device(tmp_path)
    proc = run_cli(tmp_path, *[a.format(trace=trace, out=out) for a in command])
    assert proc.returncode == 2, proc.stderr.decode()
    assert proc.stderr.decode().splitlines() == [proc.stderr.decode().strip()]
    assert b"No space left on device" in proc.stderr and b"Traceback" not in proc.stderr
    assert stat.S_ISCHR(os.stat(out).st_mode)


# -- item 13: snapshots that made the command line print a traceback ------------------------------

@pytest.mark.parametrize("command", ["replay", "tune"])
def test_trace_of_one_oom_with_nothing_free_is_one_line_error(capsys, tmp_path, command):
    oom = {"action": "oom", "device_free": 0, "size": 4096, "stream": 0, "time_us": 1,
           "compile_context": "N/A", "user_metadata": ""}
    path = write(tmp_path / "oom.pickle", snapshot_of([oom]))
    extra = ["--jobs", "1"] if command == "tune" else []
    assert_one_line_error(*run(capsys, command, path, *extra), "--device-memory")


@pytest.mark.parametrize("command", ["replay", "tune", "view"])
def test_setting_stored_as_an_int_is_one_line_error(capsys, tmp_path, command):
    path = write(tmp_path / "conf.pickle", snapshot_of(alloc_free(), conf=5))
    extra = ["--jobs", "1"] if command == "tune" else []
    assert_one_line_error(*run(capsys, command, path, *extra), "PYTORCH_CUDA_ALLOC_CONF")


def test_replay_of_a_trace_entry_that_is_a_list_is_one_line_error(capsys, tmp_path):
    path = write(tmp_path / "list.pickle", snapshot_of([entry(), ["alloc", 1, 2]]))
    assert_one_line_error(*run(capsys, "replay", path), "entry 1 is a list")


def test_view_page_of_frames_that_are_a_string_is_one_line_error(capsys, tmp_path):
    path = write(tmp_path / "frames.pickle", snapshot_of([entry(frames="train.py:7")]))
    assert_one_line_error(*run(capsys, "view", path, "-o", tmp_path / "p.html"), "frames is a str")


def nested_list_pickle(snapshot, placeholder, depth):
    """pickle bytes of `snapshot` with the string `placeholder` replaced by `depth` lists, each
    holding the next and the innermost holding 'x': written as opcodes, since pickling so deep a
    structure would itself overflow Python's recursion limit."""
    data = pickle.dumps(snapshot, protocol=2)          # protocol 2: no frames, so bytes can be spliced
    encoded = placeholder.encode()
    marker = b"X" + len(encoded).to_bytes(4, "little") + encoded
    assert data.count(marker) == 1
    nested = b"]" * depth + b"X\x01\x00\x00\x00x" + b"a" * depth    # EMPTY_LIST..., "x", APPEND...
    return data.replace(marker, nested)


def test_view_page_of_a_frame_name_nested_100000_deep_is_one_line_error(capsys, tmp_path):
    frames = [{"filename": "train.py", "line": 7, "name": "NESTED"}]
    path = tmp_path / "deep.pickle"
    path.write_bytes(nested_list_pickle(snapshot_of([entry(frames=frames)]), "NESTED", 100_000))
    assert isinstance(load(path)["device_traces"][0][0]["frames"][0]["name"], list)
    assert_one_line_error(*run(capsys, "view", path, "-o", tmp_path / "p.html"), "frames[0]['name']")


class FullStdout:
    """A standard output on a full disk: every write fails as /dev/full's does."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass


@pytest.mark.parametrize("command", [["replay"], ["tune", "--jobs", "1", "--config", "max_split_size_mb:64"],
                                     ["view"]], ids=lambda c: c[0])
def test_full_stdout_is_one_line_error(capsys, tmp_path, monkeypatch, command):
    path = write(tmp_path / "t.pickle", snapshot_of(alloc_free()))
    monkeypatch.setattr(sys, "stdout", FullStdout())
    rc = cli.main([command[0], str(path), *command[1:]])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("pyalloc: error: cannot write to standard output: No space left on device")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_replay_into_dev_full_is_one_line_error(tmp_path):
    path = write(tmp_path / "t.pickle", snapshot_of(alloc_free()))
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "pyalloc", "replay", str(path)], cwd=tmp_path,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "No space left on device" in proc.stderr


# -- item 14: unbounded input ----------------------------------------------------------------------

def gzip_bomb(path, inflated):
    """A small .gz file of `inflated` zero bytes."""
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(inflated // MiB):
            f.write(bytes(MiB))
    return path


def test_gzip_bomb_stops_at_the_size_limit_with_one_line(capsys, tmp_path):
    bomb = gzip_bomb(tmp_path / "bomb.pickle.gz", 64 * MiB)
    assert bomb.stat().st_size < MiB
    assert_one_line_error(*run(capsys, "view", bomb, "--max-input-size", "16MiB"),
                          "decompresses to", "larger than the limit", "--max-input-size")


def test_load_stops_decompressing_past_max_bytes(tmp_path):
    bomb = gzip_bomb(tmp_path / "bomb.pickle.gz", 64 * MiB)
    with pytest.raises(snapshot_module.SnapshotTooLargeError, match="decompresses to"):
        load(bomb, max_bytes=16 * MiB)


def test_the_default_limit_applies_without_the_option(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_module, "DEFAULT_MAX_BYTES", 16 * MiB)
    bomb = gzip_bomb(tmp_path / "bomb.pickle.gz", 64 * MiB)
    assert_one_line_error(*run(capsys, "replay", bomb), "larger than the limit")


def test_raising_the_limit_reads_a_snapshot_above_the_default(capsys, tmp_path):
    path = write(tmp_path / "big.pickle", snapshot_of(alloc_free(user_metadata="x" * (3 * MiB))))
    assert_one_line_error(*run(capsys, "replay", path, "--max-input-size", "2MiB"), "is larger than")
    rc, _, err = run(capsys, "replay", path, "--max-input-size", "8MiB")
    assert rc == 0, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_view_of_a_fifo_is_refused_as_not_a_regular_file(tmp_path):
    fifo = tmp_path / "trace.pickle"
    os.mkfifo(fifo)        # no writer: reading it would wait for ever
    proc = run_cli(tmp_path, "view", fifo)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().strip().endswith("not a regular file (a FIFO)")


# -- item 15: terminal escapes, and each string stored once in the page ---------------------------

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x9b31m"


def test_view_summary_escapes_terminal_control_characters(capsys, tmp_path):
    path = write(tmp_path / "esc.pickle", snapshot_of(alloc_free(user_metadata=ESCAPES)))
    rc, out, err = run(capsys, "view", path)
    assert rc == 0, err
    assert not any(c in out for c in "\x1b\x07\x9b")
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m" in out


def test_view_page_stores_a_long_frame_string_once(capsys, tmp_path):
    name = "frame_" + "n" * 200_000
    frames = [{"filename": "train.py", "line": 7, "name": name},
              {"filename": "main.py", "line": 1, "name": "main"}]
    entries = [entry(addr=(1 << 30) + k * (1 << 20), frames=frames) for k in range(30)]
    oom = {"action": "oom", "device_free": 1 << 30, "size": 4096, "stream": 0, "time_us": 1,
           "compile_context": "N/A", "user_metadata": "", "frames": frames}
    path = write(tmp_path / "long.pickle", snapshot_of(entries + [oom] * 5))
    out = tmp_path / "p.html"
    rc, _, err = run(capsys, "view", path, "-o", out)
    assert rc == 0, err
    page = out.read_text()
    assert page.count(name) == 1
    assert len(page) < len(name) + 200_000


def test_view_page_cuts_a_long_tag_in_its_markup_and_keeps_it_whole_once(capsys, tmp_path):
    tag = "tag_" + "t" * 200_000
    entries = [entry(addr=(1 << 30) + k * (1 << 20), user_metadata=tag) for k in range(30)]
    path = write(tmp_path / "tag.pickle", snapshot_of(entries))
    out = tmp_path / "p.html"
    rc, _, err = run(capsys, "view", path, "-o", out)
    assert rc == 0, err
    page = out.read_text()
    assert page.count(tag) == 1
    assert "more characters)" in page


def test_replay_with_stdout_closed_says_so_in_one_line(tmp_path):
    path = write(tmp_path / "t.pickle", snapshot_of(alloc_free()))
    proc = subprocess.run([sys.executable, "-m", "pyalloc", "replay", str(path)], cwd=tmp_path,
                          stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "pyalloc: error: cannot write to standard output: it is closed\n"
