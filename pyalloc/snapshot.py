"""Memory snapshots in PyTorch's format: reading them (and, with memory history, writing them).

A snapshot is the dict torch.cuda.memory._snapshot() returns: `segments`, `device_traces`,
`allocator_settings`, `external_annotations`. Files are pickles, optionally gzip-compressed.
"""
import gzip
import io
import pickle


class SnapshotError(ValueError):
    """A file is not a readable memory snapshot."""


class _PlainUnpickler(pickle.Unpickler):
    # Snapshots hold only dicts, lists, tuples, strings and numbers. Refusing every global keeps
    # a foreign or malicious pickle from running code when a user replays a file they were sent.
    def find_class(self, module, name):
        raise SnapshotError(f"snapshot pickles contain only plain data, this one references {module}.{name}")


def load(path):
    """Read a PyTorch or pyalloc snapshot (.pickle or .pickle.gz) and return its dict.

    A bare list (an old torch.cuda.memory_snapshot() segment list) is wrapped as
    {"segments": list, "device_traces": []}, as torch.cuda._memory_viz does.
    Raises SnapshotError naming the file for anything that is not a snapshot.
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise SnapshotError(f"cannot read snapshot {path!r}: {err.strerror or err}") from err
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise SnapshotError(f"{path!r} looks gzip-compressed but does not decompress: {err}") from err
    try:
        data = _PlainUnpickler(io.BytesIO(raw)).load()
    except SnapshotError as err:
        raise SnapshotError(f"{path!r} is not a memory snapshot: {err}") from None
    except Exception as err:  # pickle raises many types for non-pickle input
        raise SnapshotError(f"{path!r} is not a memory snapshot (not a pickle: {type(err).__name__}: {err})") from err
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise SnapshotError(
            f"{path!r} is a pickle but not a memory snapshot: expected a dict with 'segments', "
            f"got {type(data).__name__}")
    return data
