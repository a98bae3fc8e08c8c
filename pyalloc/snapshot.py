"""Memory history and snapshots in PyTorch's format: building, writing and reading them.

A snapshot is the dict torch.cuda.memory._snapshot() returns:

* ``segments``: one dict per segment, sorted by address, with PyTorch's fields (``device``,
  ``address``, ``total_size``, ``allocated_size``, ``active_size``, ``requested_size``, ``stream``,
  ``segment_type``, ``segment_pool_id``, ``is_expandable``, ``frames``, ``blocks``); each block has
  ``address``, ``size``, ``requested_size``, ``state`` (``active_allocated``,
  ``active_pending_free`` or ``inactive``), ``frames`` and, beyond PyTorch, ``user_metadata``
  (the metadata current when it was allocated).
* ``device_traces``: a list indexed by device ordinal, each the history ring buffer's entries
  oldest first (``action``, ``addr`` (``device_free`` for ``oom``), ``size``, ``stream``,
  ``time_us``, ``compile_context``, ``user_metadata`` and, where a stack was captured, ``frames``).
* ``allocator_settings`` and ``external_annotations`` (always empty: pyalloc has no
  record_function annotations).

Files are pickles (protocol 4 at most, which pytorch.org/memory_viz reads), gzip-compressed when
the name ends in ``.gz``. ``python -m torch.cuda._memory_viz`` and pytorch.org/memory_viz read the
uncompressed ones.

Sizes are bytes, times are microseconds since the epoch, streams are int handles.
"""
import gzip
import io
import os
import pickle
import stat
import sys
import threading
from dataclasses import dataclass

from pyalloc._core import TRACE_ACTIONS
from pyalloc._metadata import metadata_string
from pyalloc._stacks import stack_key

# Ring buffer capacity when record_memory_history is not told otherwise. PyTorch's default is
# sys.maxsize (never drop anything, grow without bound). pyalloc keeps the newest million events
# instead: the core stores 48 bytes per entry (~48 MB full), and snapshot() turns each entry into
# a Python dict (~0.4 KB; ~1.3 s per million entries), the real cost of a huge trace. Pass
# max_entries=sys.maxsize to keep everything, as PyTorch does.
DEFAULT_MAX_ENTRIES = 1_000_000

# Actions skip_actions may name (PyTorch's list); segment_map/segment_unmap cannot be skipped.
SKIPPABLE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                     "oom", "snapshot")
_FREE_ACTIONS = frozenset(("free_requested", "free_completed"))


class SnapshotError(ValueError):
    """A file is not a readable memory snapshot."""

    def __init__(self, message):     # spelled out for inspect.signature (see errors.NoCudaDriverError)
        super().__init__(message)


# ------------------------------------------------------------------------------- history settings

@dataclass(frozen=True)
class HistorySettings:
    """What record_memory_history last switched on (None is stored when history is off).

    enabled: "all" (keep the event trace) or "state" (live blocks only; the trace keeps 1 entry).
    context: when Python stacks are captured: None, "state" (on live blocks), "alloc" (also on
        trace entries), "all" (also the stack of each free() call).
    stacks: "python" ("all" is accepted and means the same: pyalloc has no C++ callers to unwind).
    max_entries: ring buffer capacity in entries.
    skip_actions: actions not recorded.
    """
    enabled: str
    context: str | None
    stacks: str
    max_entries: int
    skip_actions: tuple


def _describe(value):
    return f"{type(value).__name__} {value!r}"


def check_history_args(enabled, context, stacks, max_entries, clear_history, skip_actions):
    """Validate record_memory_history's arguments (PyTorch's rules and texts, plus the value).

    Returns (HistorySettings or None when enabled is None, ring capacity, skip bit mask).
    Raises TypeError for a value of the wrong type, ValueError for a wrong value.
    """
    if enabled is not None and (isinstance(enabled, bool) or not isinstance(enabled, str)):
        hint = " (PyTorch's legacy boolean form is not supported)" if isinstance(enabled, bool) else ""
        raise TypeError(f"expected state to be 'state', 'all', or None, got {_describe(enabled)}{hint}")
    if enabled not in (None, "state", "all"):
        raise ValueError(f"expected state to be 'state', 'all', or None, got {enabled!r}")
    if context is not None and not isinstance(context, str):
        raise TypeError(f"expected context to be 'state', 'alloc', 'all', or None, got {_describe(context)}")
    if context not in (None, "state", "alloc", "all"):
        raise ValueError(f"expected context to be 'state', 'alloc', 'all', or None, got {context!r}")
    if not isinstance(stacks, str):
        raise TypeError(f"expected stacks to be 'python', or 'all', got {_describe(stacks)}")
    if stacks not in ("python", "all"):
        raise ValueError(f"expected stacks to be 'python', or 'all', got {stacks!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int):
        raise TypeError(f"max_entries must be an int number of trace entries, got {_describe(max_entries)}")
    if not 1 <= max_entries <= sys.maxsize:
        raise ValueError(f"max_entries must be between 1 and sys.maxsize, got {max_entries}")
    if not isinstance(clear_history, bool):
        raise TypeError(f"clear_history must be True or False, got {_describe(clear_history)}")
    mask = 0
    skipped = ()
    if skip_actions is not None:
        if isinstance(skip_actions, (str, bytes)) or not hasattr(skip_actions, "__iter__"):
            raise TypeError(
                f"skip_actions must be a list of action names such as ['alloc'], got {_describe(skip_actions)}")
        skipped = tuple(skip_actions)
        for name in skipped:
            if name in ("segment_map", "segment_unmap"):
                raise ValueError(f"skip_actions: {name!r} cannot be skipped (PyTorch always records it)")
            if name not in SKIPPABLE_ACTIONS:
                raise ValueError(
                    f"skip_actions: unknown action {name!r}; expected some of {', '.join(SKIPPABLE_ACTIONS)}")
            mask |= 1 << TRACE_ACTIONS.index(name)
    if enabled is None:
        return None, 0, 0
    # enabled="state" keeps no trace to speak of: PyTorch forces the capacity to one entry.
    capacity = 1 if enabled == "state" else max_entries
    settings = HistorySettings(enabled, context, stacks, capacity,
                               tuple(sorted(set(skipped), key=SKIPPABLE_ACTIONS.index)))
    return settings, capacity, mask


# ------------------------------------------------------------------------------- stacks

class StackTable:
    """Python call stacks interned to uint32 ids (0 = no stack), for the core to store.

    `record()` is the allocator's context_recorder: the core calls it (outside its lock) on
    malloc, and on free when context="all". A stack is recognised by the code object and last
    instruction of every frame, read in C (pyalloc._stacks.stack_key), so a stack seen before costs
    about a microsecond; a new one is read frame by frame in Python once. The table grows by one
    entry per distinct stack, not per call, and keeps that stack's code objects alive (so their
    addresses in the keys stay unique) for as long as the allocator lives.
    """

    def __init__(self):
        self._ids = {}              # stack key (bytes) -> id
        self._stacks = [()]         # id -> ((filename, line, name), ...) innermost first
        self._codes = [()]          # id -> the code objects its key names, kept alive
        self._lock = threading.Lock()

    def __len__(self):
        """Distinct stacks recorded."""
        return len(self._stacks) - 1

    def record(self):
        """Intern the calling thread's Python stack, innermost frame first, and return its id.

        The innermost frame is the Python code that called record(); the core calls it from
        compiled code, which has no frame, so that is the code that called malloc/free.
        """
        key = stack_key(1)
        if not key:
            return 0        # called with no Python code on the stack (from C code in a thread)
        stack_id = self._ids.get(key)
        if stack_id is None:
            stack_id = self._intern(key, sys._getframe(1))
        return stack_id

    def _intern(self, key, frame):
        codes = []
        stack = []
        while frame is not None:
            code = frame.f_code
            codes.append(code)
            stack.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        with self._lock:
            stack_id = self._ids.get(key)
            if stack_id is None:
                stack_id = len(self._stacks)
                self._stacks.append(tuple(stack))
                self._codes.append(tuple(codes))
                self._ids[key] = stack_id
        return stack_id

    def frames(self, stack_id):
        """The stack of an id as PyTorch's frame dicts {filename, line, name}, innermost first."""
        return [{"filename": fn, "line": line, "name": name} for fn, line, name in self._stacks[stack_id]]


# ------------------------------------------------------------------------------- building

def build_snapshot(allocator, history, stacks):
    """The snapshot dict of one pyalloc allocator (see the module docstring for its shape).

    `history` is the allocator's HistorySettings (None when off) and `stacks` its StackTable (or
    None). As in PyTorch, the trace is read first and then the segments, and reading the
    segments records a `snapshot` trace entry (addr 0, size = active bytes), so a snapshot's own
    entry shows in the next snapshot's trace.
    """
    device = allocator.device
    entries, _dropped = allocator._history_entries()
    segments = allocator._segments()
    allocator._record_snapshot_entry()

    frames_of = {}
    metadata_of = {}

    def frames(stack_id):
        # One list per stack and snapshot: entries with the same stack share it (the pickle
        # memoizes it once, which keeps files of long traces small).
        out = frames_of.get(stack_id)
        if out is None:
            out = frames_of[stack_id] = stacks.frames(stack_id) if stacks is not None else []
        return out

    def metadata(metadata_id):
        text = metadata_of.get(metadata_id)
        if text is None:
            text = metadata_of[metadata_id] = metadata_string(metadata_id)
        return text

    level = history.context if history is not None else None
    stacks_on_entries = level in ("alloc", "all")
    trace = []
    for action, addr, size, stream, time_us, metadata_id, stack_id in entries:
        entry = {"action": action, ("device_free" if action == "oom" else "addr"): addr,
                 "size": size, "stream": stream, "time_us": time_us,
                 "compile_context": "N/A", "user_metadata": metadata(metadata_id)}
        # PyTorch: entries carry frames when context >= "alloc"; free entries also carry the
        # block's allocation stack whenever one was kept (so even with context="state").
        if stack_id and (stacks_on_entries or action in _FREE_ACTIONS):
            entry["frames"] = frames(stack_id)
        trace.append(entry)

    out_segments = []
    for seg in segments:
        blocks = []
        allocated_size = active_size = requested_size = 0
        for b in seg["blocks"]:
            size = b["size"]
            if b["allocated"]:
                state = "active_allocated"
                allocated_size += size
            elif b["pending_free"]:
                state = "active_pending_free"
            else:
                state = "inactive"
            if state != "inactive":
                active_size += size
                requested_size += b["requested_size"]
            blocks.append({
                "address": b["address"], "size": size, "requested_size": b["requested_size"],
                "state": state, "frames": frames(b["context_id"]) if b["context_id"] else [],
                "user_metadata": metadata(b["metadata_id"]),
            })
        out_segments.append({
            "device": device, "address": seg["address"], "total_size": seg["total_size"],
            "allocated_size": allocated_size, "active_size": active_size,
            "requested_size": requested_size, "stream": seg["stream"],
            "segment_type": "small" if seg["is_small"] else "large",
            "segment_pool_id": seg["pool_id"], "is_expandable": seg["is_expandable"],
            "frames": frames(seg["context_id"]) if seg["context_id"] else [],
            "blocks": blocks,
        })

    device_traces = [[] for _ in range(device)]
    device_traces.append(trace)
    return {
        "segments": out_segments,
        "device_traces": device_traces,
        "allocator_settings": allocator.settings.to_snapshot_dict(),
        "external_annotations": [],
    }


# ------------------------------------------------------------------------------- files

MAX_PROTOCOL = 4   # pytorch.org/memory_viz cannot read protocol 5 ("Unhandled version 5")


def _path(path, what):
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"{what} must be a file path (str or os.PathLike), got {_describe(path)}") from None


def dump(snapshot, path, *, protocol=MAX_PROTOCOL):
    """Write a snapshot dict to `path` as a pickle; gzip-compressed when the name ends in ".gz".

    `protocol` is the pickle protocol, at most 4 (the default) so pytorch.org/memory_viz reads
    the file. Raises TypeError for a non-dict snapshot or a bad path, ValueError for a protocol
    above 4, OSError when the file cannot be written.
    """
    path = _path(path, "path")
    if not isinstance(snapshot, dict):
        raise TypeError(f"snapshot must be a dict (from snapshot()), got {type(snapshot).__name__}")
    if isinstance(protocol, bool) or not isinstance(protocol, int) or not 0 <= protocol <= MAX_PROTOCOL:
        raise ValueError(f"protocol must be an int in 0..{MAX_PROTOCOL} (memory_viz reads no higher), got {protocol!r}")
    data = pickle.dumps(snapshot, protocol=protocol)
    name = path.decode() if isinstance(path, bytes) else path
    if name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6)
    write_atomically(path, data)


def write_atomically(path, data):
    """Write the bytes `data` to `path` through a temporary file in the same folder, renamed over
    `path` once complete: a failure (full disk, an encoding error before this call) leaves any
    old file whole and no temporary file behind. A new file gets the mode open() would give it
    (0o666 less the umask), a replaced one keeps its own; a symbolic link is followed, so its
    target is replaced and the link stays. A path that is not a regular file (a device such as
    /dev/null or /dev/full, a named pipe) is written in place, as open() would. Returns the bytes
    written; OSError when it cannot."""
    path = os.path.realpath(os.fspath(path))
    folder, base = os.path.split(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # A rename would put a regular file where the device or pipe was (as root, even in /dev),
        # and a full device's error would never be seen.
        with open(path, "wb") as f:
            f.write(data)
        return len(data)
    mode = None if st is None else stat.S_IMODE(st.st_mode)
    # The rename would replace a file this process may not write to; open() would refuse it.
    if mode is not None and not os.access(path, os.W_OK):
        raise PermissionError(13, "Permission denied", path)
    for attempt in range(100):
        temp = os.path.join(folder, f".{base}.{os.getpid()}.{attempt}.tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:      # another writer's temporary file: take the next name
            continue
    else:
        raise FileExistsError(f"no free temporary file name beside {path!r}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    return len(data)


class _PlainUnpickler(pickle.Unpickler):
    # Snapshots hold only dicts, lists, tuples, strings and numbers. Refusing every global keeps
    # a foreign or malicious pickle from running code when a user replays a file they were sent.
    def find_class(self, module, name):
        raise SnapshotError(f"snapshot pickles contain only plain data, this one references {module}.{name}")


# The most bytes load() reads by default, of the file and of its decompressed pickle. Loading
# takes about 5 times the pickle's size in memory (measured: gpt2_train-default, 3.85 MB of
# pickle for 52,906 entries, grew the process's peak RSS by 20.0 MiB), so this bounds what a
# hostile or mistaken input (a gzip bomb, /dev/zero) makes load() allocate to ~5 GiB, while
# a trace of ~14 million entries (~73 bytes of pickle each) still loads.
DEFAULT_MAX_BYTES = 1 << 30


class SnapshotTooLargeError(SnapshotError):
    """A snapshot file, or what it decompresses to, is larger than load()'s max_bytes."""


def _read_regular_file(path, max_bytes):
    """The bytes of the regular file `path`, at most max_bytes of them (None: no limit).
    SnapshotError for anything else (a device, a FIFO, a folder: reading /dev/zero would never
    end) or a larger file."""
    # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise SnapshotError(f"cannot read snapshot {path!r}: {err.strerror or err}") from err
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise SnapshotError(f"cannot read snapshot {path!r}: not a regular file "
                            f"({_file_kind(info.st_mode)})")
    with os.fdopen(fd, "rb") as f:
        if max_bytes is not None and info.st_size > max_bytes:
            raise SnapshotTooLargeError(_too_large(path, "is", max_bytes))
        try:
            raw = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as err:
            raise SnapshotError(f"cannot read snapshot {path!r}: {err.strerror or err}") from err
    if max_bytes is not None and len(raw) > max_bytes:    # it grew while being read
        raise SnapshotTooLargeError(_too_large(path, "is", max_bytes))
    return raw


def _file_kind(mode):
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _too_large(path, verb, max_bytes):
    from pyalloc.errors import format_bytes
    return (f"{path!r} {verb} larger than the limit of {format_bytes(max_bytes)} "
            f"({max_bytes:,} bytes) for a snapshot; raise the limit (max_bytes, or "
            f"--max-input-size on the command line) to read it")


def _gunzip(path, raw, max_bytes):
    """raw decompressed, stopping with SnapshotTooLargeError past max_bytes (None: no limit), so
    that a small file inflating to gigabytes (a gzip bomb) costs at most max_bytes + 1."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except (OSError, EOFError, ValueError) as err:
        raise SnapshotError(f"{path!r} looks gzip-compressed but does not decompress: {err}") from err
    if max_bytes is not None and len(data) > max_bytes:
        raise SnapshotTooLargeError(_too_large(path, "decompresses to", max_bytes))
    return data


def load(path, *, max_bytes=DEFAULT_MAX_BYTES):
    """Read a PyTorch or pyalloc snapshot (.pickle or .pickle.gz) and return its dict.

    Compression is detected from the content, not the name. A bare list of dicts (an old
    torch.cuda.memory_snapshot() segment list) is wrapped as {"segments": list, "device_traces": []},
    as torch.cuda._memory_viz does. `max_bytes`: the largest file, and the largest decompressed
    pickle, read (bytes; default DEFAULT_MAX_BYTES, 1 GiB; None for no limit).
    Raises TypeError for a path that is not str/PathLike, and SnapshotError (a ValueError) naming
    the file for anything unreadable or not a snapshot: a missing or unreadable file, one that is
    not a regular file (a device, a FIFO, a folder), one larger than max_bytes or decompressing
    to more (SnapshotTooLargeError), bad gzip data, a non-pickle, a pickle that references any
    global (it is never imported), or a pickle of something other than a snapshot.
    """
    path = _path(path, "snapshot path")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes < 0):
        raise ValueError(f"max_bytes must be None or an int >= 0, got {max_bytes!r}")
    raw = _read_regular_file(path, max_bytes)
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(path, raw, max_bytes)
    try:
        data = _PlainUnpickler(io.BytesIO(raw)).load()
    except SnapshotError as err:
        raise SnapshotError(f"{path!r} is not a memory snapshot: {err}") from None
    except Exception as err:  # pickle raises many types for non-pickle input
        raise SnapshotError(f"{path!r} is not a memory snapshot (not a pickle: {type(err).__name__}: {err})") from err
    if isinstance(data, list) and all(isinstance(s, dict) for s in data):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        got = type(data).__name__
        if isinstance(data, list):
            kinds = sorted({type(s).__name__ for s in data if not isinstance(s, dict)})
            got = f"a list of {', '.join(kinds)} (an old snapshot's bare list holds segment dicts)"
        raise SnapshotError(
            f"{path!r} is a pickle but not a memory snapshot: expected a dict with 'segments', "
            f"got {got}")
    _check_shape(path, data)
    return data


def _check_shape(path, data):
    """Reject dicts that merely have a 'segments' key: what replay and the viewers index must be there."""
    segments = data["segments"]
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        raise SnapshotError(f"{path!r} is not a memory snapshot: 'segments' is not a list of segment dicts")
    for s in segments:
        missing = [k for k in ("address", "total_size", "blocks") if k not in s]
        if missing:
            raise SnapshotError(
                f"{path!r} is not a memory snapshot: a segment lacks {', '.join(missing)}")
    traces = data.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{path!r} is not a memory snapshot: 'device_traces' is not a list of lists")
