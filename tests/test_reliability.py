"""Nothing crashes, nothing is handed out twice (issue 15, the CPU-side items).

Each test pins one behaviour that used to fail: a crash, a leak, a second owner of one block, a
wrong size or limit, a snapshot read while the garbage collector freed a block, or a placement
that walked every live segment. Tests whose failure was a segfault run Python in a subprocess, so
that the old behaviour fails the test instead of killing the test run.
"""
import copy
import gc
import pickle
import random
import subprocess
import sys
import textwrap
import time

import pytest

from pyalloc import Buffer, CachingAllocator, OutOfMemoryError, SimDevice, config
from pyalloc._core import DeviceCachingAllocator

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def run_python(code):
    """Run `code` in a fresh interpreter; returns the CompletedProcess (text stdout/stderr)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def assert_clean_exit(out):
    assert out.returncode == 0 and out.stderr == "", (out.returncode, out.stderr)


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
