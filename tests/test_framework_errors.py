"""Specification of the out-of-memory error the framework hooks raise (pyalloc.errors'
framework_out_of_memory_error, used by pyalloc.cupy, pyalloc.torch and pyalloc.numba), against
stand-in framework exceptions, and of pyalloc.torch's error against a stand-in `torch` module.

The CuPy and Numba hooks' own errors are specified in test_cuda_cpu.py and test_numba_hook.py.
"""
import pickle
import sys
import types

import pytest

import pyalloc
from pyalloc.errors import OOM_FIGURES, framework_out_of_memory_error

from units import MiB


class FrameworkError(Exception):
    """A framework's own error whose __init__, __str__ and __reduce__ do not fit
    OutOfMemoryError's: Numba's CudaAPIError takes (code, msg) and prints "[code] msg"; CuPy's
    error pickles as its own arguments."""

    def __init__(self, code, msg):
        super().__init__(code, msg)
        self.code, self.msg = code, msg

    def __str__(self):
        return f"[{self.code}] {self.msg}"

    def __reduce__(self):
        return (type(self), (self.code, self.msg))


def stand_in_class():
    return _stand_in


def _mark(err, message):
    err.code = 2
    err.msg = message


_stand_in = framework_out_of_memory_error(FrameworkError, __name__, "StandInOutOfMemoryError",
                                          "doc", stand_in_class, _mark)


def error(**figures):
    return _stand_in("CUDA out of memory. Tried to allocate 8.00 MiB.", **figures)


def test_the_class_is_both_pyallocs_and_the_frameworks_error():
    err = error()
    assert isinstance(err, pyalloc.OutOfMemoryError) and isinstance(err, FrameworkError)
    assert isinstance(err, MemoryError)


def test_the_class_has_the_name_and_module_it_was_given():
    assert (_stand_in.__name__, _stand_in.__qualname__, _stand_in.__module__) == (
        "StandInOutOfMemoryError", "StandInOutOfMemoryError", __name__)


def test_str_is_the_message_even_where_the_framework_prints_otherwise():
    assert str(error()) == "CUDA out of memory. Tried to allocate 8.00 MiB."


def test_figures_given_are_set_and_the_others_are_none():
    err = error(requested=8 * MiB, allowed=16 * MiB)
    assert (err.requested, err.allowed) == (8 * MiB, 16 * MiB)
    assert all(getattr(err, name) is None for name in OOM_FIGURES if name not in ("requested", "allowed"))


def test_the_extra_initialiser_sets_the_frameworks_attributes():
    err = error()
    assert (err.code, err.msg) == (2, "CUDA out of memory. Tried to allocate 8.00 MiB.")


def test_it_pickles_with_its_message_and_figures():
    figures = {name: i for i, name in enumerate(OOM_FIGURES)}
    copy = pickle.loads(pickle.dumps(error(**figures)))
    assert type(copy) is _stand_in and str(copy) == str(error())
    assert {name: getattr(copy, name) for name in OOM_FIGURES} == figures


def test_from_error_copies_message_and_figures_of_a_pyalloc_error():
    plain = pyalloc.OutOfMemoryError("out of memory", requested=3, device=1, free=5)
    err = _stand_in.from_error(plain)
    assert type(err) is _stand_in and str(err) == "out of memory"
    assert (err.requested, err.device, err.free, err.total) == (3, 1, 5, None)


# ------------------------------------------------------------------------------ pyalloc.torch

@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in `torch` with torch's OutOfMemoryError (a RuntimeError), and pyalloc.torch's
    class made afresh over it."""
    import pyalloc.torch as pt

    class OutOfMemoryError(RuntimeError):
        pass

    module = types.ModuleType("torch")
    module.OutOfMemoryError = OutOfMemoryError
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(pt, "_oom_class", None)
    return module


def test_torch_error_is_torchs_and_pyallocs_out_of_memory_error(fake_torch):
    import pyalloc.torch as pt
    cls = pt.out_of_memory_error()
    assert issubclass(cls, fake_torch.OutOfMemoryError) and issubclass(cls, pyalloc.OutOfMemoryError)
    assert (cls.__module__, cls.__qualname__) == ("pyalloc.torch", "TorchOutOfMemoryError")


def test_torch_translator_turns_a_pyalloc_error_into_torchs_kind(fake_torch):
    import pyalloc.torch as pt
    err = pt._as_torch_error(pyalloc.OutOfMemoryError("CUDA out of memory.", requested=5))
    assert type(err) is pt.out_of_memory_error()
    assert (str(err), err.requested) == ("CUDA out of memory.", 5)


def test_torch_translator_leaves_other_errors_alone(fake_torch):
    import pyalloc.torch as pt
    other = ValueError("not memory")
    assert pt._as_torch_error(other) is other


def test_torch_error_pickles_with_its_figures(fake_torch):
    import pyalloc.torch as pt
    copy = pickle.loads(pickle.dumps(pt.out_of_memory_error()("CUDA out of memory.", requested=7)))
    assert type(copy) is pt.out_of_memory_error() and copy.requested == 7
