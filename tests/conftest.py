"""Fixtures shared by several test files: the default allocators on simulated devices (the
framework-hook specifications, tests/test_numba_hook.py and test_cuda_core_hook.py) and the fake
CUDA driver (tests/test_cuda_fake_driver.py and test_conformance_fake_driver.py)."""
import gc

import pytest

import pyalloc
from pyalloc import defaults


# Files whose tests run on one pytest-xdist worker: their module fixtures (for test_view.py a
# Chromium and a million-event page, 6 s to build) are then built once per run, not once per worker.
ONE_WORKER_FILES = {"test_view.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's hook: under -n, the tests of ONE_WORKER_FILES go to one worker as a single
    unit; every other test is scheduled on its own, as -n's default ("load") does. (xdist's own
    xdist_group marks do not group under pytest 9, whose node ids cannot be renamed.) An explicit
    --dist is left as given."""
    explicit = any(arg == "-d" or arg.startswith("--dist") for arg in config.invocation_params.args)
    if config.getoption("dist") != "load" or explicit:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if path.rsplit("/", 1)[-1] in ONE_WORKER_FILES else nodeid

    return OneWorkerFiles(config, log)


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
