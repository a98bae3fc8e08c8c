"""The conformance suite's CUDA backend without a GPU: the [cuda] cases of the files that run
through the harness (HARNESS_FILES: tests/test_core.py, test_pools.py, test_history.py,
test_graphs.py, test_stream_lifetime.py, test_expandable.py) and the
property state machine's CUDA variant (tests/test_properties.py, CudaAllocatorMachine) run over
CudaDevice against the fake driver (tests/fake_libcuda.c, compiled here into a libcuda.so.1 that
cuda-bindings loads in place of the real one).

The fake keeps no memory behind its addresses and does not order streams by events, so this is
no substitute for the GPU run (tools/gpu-round.sh): it keeps the CUDA backend's code paths, the
suite's GPU adapter (tests/backends.py) and their agreement with SimDevice's results under test
everywhere. Every part runs in one child pytest with the fake first on LD_LIBRARY_PATH; the
tests below read its JUnit report.
"""
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from budget import examples
from fake_driver import child_env

HERE = Path(__file__).resolve().parent
SIM_ONLY = "SimDevice only"


@pytest.fixture(scope="module")
def fake_env(fake_libcuda, tmp_path_factory):
    # The CUDA property machine's examples: 60 in the default (quick) profile, which keeps the
    # README's test command under its time budget (150 took 31 s of the suite's one-core time),
    # 150 under PYALLOC_TEST_PROFILE=thorough.
    env = child_env(fake_libcuda, 1, 64 << 30, PYALLOC_TEST_BACKENDS="cuda",
                    PYALLOC_CUDA_PROPERTY_EXAMPLES=str(examples(quick=60, thorough=150)))
    env.pop("PYALLOC_CONF", None)
    return env, tmp_path_factory.mktemp("reports")


def run_child(fake_env, name, *args):
    """Run pytest on `args` in a child with the fake driver; {(file, test id): (outcome,
    message)}, the file without its ".py"."""
    env, reports = fake_env
    report = reports / f"{name}.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={report}", *args],
                         capture_output=True, text=True, env=env, cwd=str(HERE), timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    results = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        outcome = "skipped" if skipped is not None else "passed"
        # classname: "tests.test_core", or "tests.test_properties.TestCudaAllocatorMachine"
        file = next(part for part in case.get("classname").split(".") if part.startswith("test_"))
        results[file, case.get("name")] = (outcome, "" if skipped is None else skipped.get("message", ""))
    return results


# The files that run through the conformance harness (tests/backends.py), each with the fewest
# [cuda] cases it has and the fewest of them that must run (not @sim_only): a file that stops
# running through the harness, or marks most of itself sim-only, fails here.
HARNESS_FILES = {"test_core.py": (150, 100), "test_pools.py": (50, 40), "test_history.py": (70, 60),
                 "test_graphs.py": (40, 33), "test_stream_lifetime.py": (40, 18),
                 "test_expandable.py": (15, 8)}


@pytest.fixture(scope="module")
def harness_results(fake_env):
    """{(file, test id): (outcome, message)} of one child run over every harness file and the
    property machine's CUDA variant (PYALLOC_TEST_BACKENDS=cuda: the child runs only the [cuda]
    cases; -k cannot pick them, it also matches the sim_only attribute's name). One child, not
    one per file: each child's start and collection cost 1.5-3 s of the suite's time."""
    return run_child(fake_env, "harness", *sorted(HARNESS_FILES),
                     "test_properties.py::TestCudaAllocatorMachine")


@pytest.fixture(params=sorted(HARNESS_FILES))
def cuda_cases(harness_results, request):
    """(file, {test id: (outcome, message)} of its [cuda] cases)."""
    stem = request.param.removesuffix(".py")
    return request.param, {name: r for (file, name), r in harness_results.items()
                           if file == stem and "[cuda" in name}


def test_every_specification_runs_on_the_cuda_backend(cuda_cases):
    file, cases = cuda_cases
    ran = [name for name, (outcome, _) in cases.items() if outcome == "passed"]
    least_cases, least_ran = HARNESS_FILES[file]
    assert len(cases) > least_cases and len(ran) > least_ran


def test_only_the_simulator_only_cases_are_skipped(cuda_cases):
    _, cases = cuda_cases
    other = {name: message for name, (outcome, message) in cases.items()
             if outcome == "skipped" and SIM_ONLY not in message}
    assert other == {}


def test_the_property_machine_runs_on_the_cuda_backend(harness_results):
    machine = {name: r for (file, name), r in harness_results.items() if file == "test_properties"}
    assert machine == {"runTest": ("passed", "")}
