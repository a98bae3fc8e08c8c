"""What a newcomer's first look at the package shows: help(pyalloc), signatures, submodules.

The compiled classes keep Cython's binding=False (their methods stay fast method descriptors),
and meson.build's embedsignature.format=clinic gives each method a __text_signature__, which is
what inspect.signature and help() read. Cython writes none for a cdef class's __init__: those
classes' docstrings open with the constructor's signature in the same form ("Name(...)", a line
"--", a blank line), which CPython reads as the type's __text_signature__.
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
from pyalloc._cuda import CudaDevice
from pyalloc._sim import SimDevice
from units import MiB

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


# The cdef classes a user constructs, and the signature each constructor shows.
CONSTRUCTORS = [
    (SimDevice, "(total_memory=85899345920, *, device=0, base_address=None, alignment=2097152, "
                "top_down=False, check_reuse=False)"),
    (Buffer, "(allocator, nbytes, stream=0)"),
    (DeviceCachingAllocator, "(backend)"),
    (CudaDevice, "(device=0)"),
]


@pytest.mark.parametrize("cls, expected", CONSTRUCTORS, ids=[c[0].__name__ for c in CONSTRUCTORS])
def test_compiled_classes_have_their_constructors_signature(cls, expected):
    assert str(inspect.signature(cls)) == expected


def test_help_of_a_compiled_class_shows_its_signature_then_its_docstring():
    text = pydoc.render_doc(SimDevice, renderer=pydoc.plaintext)
    assert "|  SimDevice(total_memory=85899345920, *, device=0," in text
    doc = inspect.getdoc(SimDevice)
    assert doc.startswith("A simulated device.") and "\n--\n" not in doc


def test_simdevice_accepts_every_parameter_its_signature_names_with_the_default_shown():
    # The docstring's signature is written by hand: this is what keeps it true.
    params = inspect.signature(SimDevice).parameters
    kwargs = {name: p.default for name, p in params.items()}
    kwargs["total_memory"] = 64 * MiB
    sim = SimDevice(**kwargs)
    assert (sim.total_memory, sim.device) == (64 * MiB, params["device"].default)


def test_buffer_accepts_its_signatures_parameters_by_name():
    a = DeviceCachingAllocator(backend=SimDevice(64 * MiB))
    b = Buffer(allocator=a, nbytes=512, stream=inspect.signature(Buffer).parameters["stream"].default)
    assert b.size == 512
    b.close()


# The submodules a user imports for more than pyalloc's own names (the framework hooks aside).
SUBMODULES = ("config", "snapshot", "replay", "tune", "view", "cuda_backend", "graphs", "errors",
              "allocator")


def public_names():
    """(dotted name, object): pyalloc.__all__, the public names SUBMODULES define (or list in
    __all__), and the CUDA backend's class."""
    import importlib
    names = [(name, getattr(pyalloc, name)) for name in pyalloc.__all__]
    for sub in SUBMODULES:
        module = importlib.import_module(f"pyalloc.{sub}")
        for name in getattr(module, "__all__", None) or sorted(vars(module)):
            obj = getattr(module, name)
            if not name.startswith("_") and str(getattr(obj, "__module__", "")).startswith("pyalloc"):
                names.append((f"{sub}.{name}", obj))
    return names + [("cuda_backend.CudaDevice", CudaDevice)]


def public_callables():
    """(name, object) for every public name (public_names) and every public method of its
    classes (exception classes: the class only)."""
    found = []
    for name, obj in public_names():
        if not callable(obj):
            continue
        found.append((name, obj))
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr in dir(obj):
                member = inspect.getattr_static(obj, attr)
                if attr.startswith("_") or isinstance(member, property) or not callable(getattr(obj, attr)):
                    continue
                found.append((f"{name}.{attr}", getattr(obj, attr)))
    return found


def test_every_public_callable_of_pyalloc_has_a_signature():
    missing = []
    for name, obj in public_callables():
        try:
            inspect.signature(obj)
        except (ValueError, TypeError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []


def test_the_signature_check_covers_the_compiled_classes_and_their_methods():
    names = {name for name, _ in public_callables()}
    assert {"SimDevice", "Buffer", "CachingAllocator", "cuda_backend.CudaDevice", "SimDevice.launch",
            "CachingAllocator.malloc", "Buffer.close", "NoCudaDriverError", "allocator.Backend",
            "snapshot.SnapshotError", "tune.tune", "config.CudaAllocatorConfig"} <= names


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
