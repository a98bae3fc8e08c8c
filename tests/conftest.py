"""Fixtures shared by several test files: the default allocators on simulated devices (the
framework-hook specifications, tests/test_numba_hook.py and test_cuda_core_hook.py) and the fake
CUDA driver (tests/test_cuda_fake_driver.py and test_conformance_fake_driver.py)."""
import gc

import pytest

import pyalloc
from pyalloc import defaults


@pytest.fixture(autouse=True)
def report_width_default(monkeypatch):
    """Every test sees the command line's default report width (100 columns) unless it sets
    COLUMNS itself: pytest-xdist's workers export COLUMNS=80 (a plain run exports none), which
    would rewrap the reports whose lines the CLI tests look for."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def sim_defaults():
    """The default allocators on 64 MiB simulated devices for the test (the device-0 one is
    yielded); the automatic choice again afterwards."""
    pyalloc.set_default_backend(lambda d: pyalloc.SimDevice(64 << 20, device=d))
    yield defaults.get_allocator(0)
    gc.collect()
    pyalloc.set_default_backend(None)



@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory):
    """tests/fake_libcuda.c compiled into a libcuda.so.1 (its path), once per run; skips without
    a C compiler (tests/fake_driver.py)."""
    from fake_driver import build
    lib = build(tmp_path_factory.mktemp("fakecuda"))
    if lib is None:
        pytest.skip("no C compiler to build the fake libcuda")
    return lib


# The host allocator tests' device and allocator (test_host.py, test_host_capture.py; files that
# need others, such as test_host_history.py and test_host_gpu.py, define their own).

@pytest.fixture
def dev():
    """A simulated device with the reuse sanitizer on."""
    return pyalloc.SimDevice(check_reuse=True)


@pytest.fixture
def host(dev):
    """A pinned host allocator over `dev`, with the default settings."""
    from pyalloc.host import HostAllocator
    return HostAllocator(dev, config="")
