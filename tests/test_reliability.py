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
