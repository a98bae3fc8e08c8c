"""Memory metadata strings, interned process-wide: blocks and trace entries hold a uint32 id, so
stamping them costs nothing (the id of the calling thread is kept by pyalloc._core, which the hot
path reads). The table only grows (one entry per distinct string ever set)."""
import threading

from pyalloc._core import _set_thread_metadata_id, _thread_metadata_id

_metadata_strings = [""]        # id -> string; id 0 is "no metadata"
_metadata_ids = {"": 0}
_metadata_lock = threading.Lock()   # two threads interning one new string must agree on its id


def set_memory_metadata(text):
    """Set this thread's metadata string; stamped on trace entries and live blocks. "" clears it.

    Per OS thread, process-wide (all allocators), like torch.cuda.memory._set_memory_metadata.
    Raises TypeError (state unchanged) when `text` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"memory metadata must be a str, got {type(text).__name__} {text!r}")
    text = str(text)        # a str subclass is stored as a plain str (it is pickled in snapshots)
    mid = _metadata_ids.get(text, 0)
    if text and not mid:
        with _metadata_lock:
            mid = _metadata_ids.get(text, 0)
            if not mid:
                mid = len(_metadata_strings)
                _metadata_strings.append(text)
                _metadata_ids[text] = mid
    _set_thread_metadata_id(mid)


def get_memory_metadata():
    """This thread's metadata string ("" when none)."""
    return _metadata_strings[_thread_metadata_id()]


def metadata_string(metadata_id):
    """The metadata string of an id recorded in blocks and trace entries."""
    return _metadata_strings[metadata_id]
