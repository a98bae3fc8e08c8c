"""Fixtures shared by the framework-hook specifications (tests/test_numba_hook.py,
tests/test_cuda_core_hook.py)."""
import gc

import pytest

import pyalloc
from pyalloc import defaults


@pytest.fixture
def sim_defaults():
    """The default allocators on 64 MiB simulated devices for the test (the device-0 one is
    yielded); the automatic choice again afterwards."""
    pyalloc.set_default_backend(lambda d: pyalloc.SimDevice(64 << 20, device=d))
    yield defaults.get_allocator(0)
    gc.collect()
    pyalloc.set_default_backend(None)
