"""What a newcomer's first look at the package shows: help(pyalloc), signatures, submodules.

The compiled classes keep Cython's binding=False (their methods stay fast method descriptors),
and meson.build's embedsignature.format=clinic gives each method a __text_signature__, which is
what inspect.signature and help() read.
"""
import doctest
import inspect
import pydoc
import subprocess
import sys

import pytest

import pyalloc
from pyalloc._buffer import Buffer
from pyalloc._core import DeviceCachingAllocator
from pyalloc._sim import SimDevice

# (callable, the parameter names inspect.signature must give); bound where the instance matters.
SIGNATURES = [
    ("DeviceCachingAllocator.malloc", DeviceCachingAllocator.malloc, ["self", "nbytes", "stream"]),
    ("DeviceCachingAllocator.free", DeviceCachingAllocator.free, ["self", "ptr"]),
    ("DeviceCachingAllocator.record_stream", DeviceCachingAllocator.record_stream,
     ["self", "ptr", "stream", "last_use"]),
    ("DeviceCachingAllocator.set_memory_fraction", DeviceCachingAllocator.set_memory_fraction,
     ["self", "fraction"]),
    ("DeviceCachingAllocator.empty_cache", DeviceCachingAllocator.empty_cache, ["self", "mempool_id"]),
    ("Buffer.close", Buffer.close, ["self"]),
    ("SimDevice.launch", SimDevice.launch, ["self", "stream", "count", "uses"]),
    ("set_memory_metadata", pyalloc.set_memory_metadata, ["text"]),
]


@pytest.mark.parametrize("name, func, params", SIGNATURES, ids=[s[0] for s in SIGNATURES])
def test_compiled_methods_have_a_signature(name, func, params):
    assert list(inspect.signature(func).parameters) == params


def test_a_bound_compiled_method_has_its_signature_without_self():
    a = pyalloc.CachingAllocator(backend="sim")
    sig = inspect.signature(a.malloc)
    assert str(sig) == "(nbytes, stream=0)"


def test_hot_methods_stay_method_descriptors_not_cython_function_objects():
    # binding=True would make them cyfunction objects: a slower call for every malloc and free.
    for name in ("malloc", "free"):
        assert type(DeviceCachingAllocator.__dict__[name]).__name__ == "method_descriptor"


def test_help_of_a_compiled_method_opens_with_its_signature():
    text = pydoc.render_doc(DeviceCachingAllocator.malloc, renderer=pydoc.plaintext)
    assert "malloc(self, /, nbytes, stream=0)" in text


def test_help_pyalloc_opens_with_what_it_is_and_an_example():
    doc = pyalloc.__doc__
    first_lines = doc.splitlines()[:2]
    assert "caching allocator" in first_lines[0] and "pyalloc tune" in " ".join(first_lines)
    assert ">>> a = pyalloc.CachingAllocator(" in "\n".join(doc.splitlines()[:8])


def test_help_pyalloc_example_runs():
    result = doctest.testmod(pyalloc, verbose=False)
    assert result.attempted >= 4 and result.failed == 0


def test_pyalloc_tune_tune_works_after_import_pyalloc(tmp_path):
    # A fresh interpreter: in this one another test may have imported pyalloc.tune already.
    code = "import pyalloc, sys; f = pyalloc.tune.tune; print(f.__module__, 'pyalloc.tune' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pyalloc.tune", "True"]


def test_import_pyalloc_does_not_import_tune_or_the_hooks(tmp_path):
    code = ("import pyalloc, sys; print(sorted(m for m in ('pyalloc.tune', 'pyalloc.view', "
            "'pyalloc.cupy', 'pyalloc.torch', 'pyalloc.numba', 'pyalloc.cuda_core') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_an_unknown_attribute_of_pyalloc_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        pyalloc.no_such_thing


def test_dir_pyalloc_lists_the_lazy_submodules():
    assert {"tune", "view", "cupy", "torch", "numba", "cuda_core", "graphs"} <= set(dir(pyalloc))
