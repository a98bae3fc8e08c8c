"""GPU allocation costs, pyalloc against CuPy's pool and PyTorch's caching allocator, in one run.

Two modes:
  pytest bench/bench_gpu.py --benchmark-json=out.json     pytest-benchmark, one benchmark per case
  python bench/bench_gpu.py [--json out.json]             a table of ns per operation and ratios

Cases (all 1 MiB, stream 0, steady state: every allocation is a cache hit):
  floor               an empty method of the pyalloc allocator: the Python -> extension call floor
  pyalloc_pair        allocator.malloc + allocator.free (bound methods of the default allocator)
  pyalloc_module_pair pyalloc.malloc + pyalloc.free (module level, device looked up)
  cupy_pool_pair      cupy.cuda.MemoryPool().malloc, then dropping the MemoryPointer (its free)
  torch_pair          torch.cuda.caching_allocator_alloc + caching_allocator_delete
  cupy_empty_pool     cupy.empty(1 MiB, uint8) on CuPy's own pool (the array dropped at once)
  cupy_empty_pyalloc  the same with pyalloc installed as CuPy's allocator (pyalloc.cupy.using)

Targets from issue 4: pyalloc_pair <= 1/4 of cupy_pool_pair; cupy_empty_pyalloc <= cupy_empty_pool.
Machines are noisy: compare the ratios of one run, not absolute numbers across runs.
Skipped (pytest) or left out (script) without a GPU, CuPy or PyTorch.
"""
import argparse
import json
import statistics
import sys
import time

NBYTES = 1 << 20


def _gpu_available():
    try:
        from pyalloc import cuda_backend
    except ImportError:
        return False
    return cuda_backend.is_available()


def make_cases():
    """{name: loop(iterations)} for every case whose library is present."""
    import pyalloc
    pyalloc.set_default_backend(None)
    alloc = pyalloc.get_allocator(0)
    if alloc.backend.kind != "cuda":
        raise RuntimeError("bench_gpu needs the CUDA backend")
    n = NBYTES
    cases = {}

    def floor(iters):
        noop = alloc._noop
        for _ in range(iters):
            noop()

    def pyalloc_pair(iters):
        malloc, free = alloc.malloc, alloc.free
        for _ in range(iters):
            free(malloc(n, 0))

    def pyalloc_module_pair(iters):
        malloc, free = pyalloc.malloc, pyalloc.free
        for _ in range(iters):
            free(malloc(n))

    cases.update(floor=floor, pyalloc_pair=pyalloc_pair, pyalloc_module_pair=pyalloc_module_pair)

    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        import pyalloc.cupy as pc
        pool = cupy.cuda.MemoryPool()

        def cupy_pool_pair(iters):
            malloc = pool.malloc
            for _ in range(iters):
                malloc(n)              # the MemoryPointer is dropped at once: that is its free

        def cupy_empty_pool(iters):
            empty, u8 = cupy.empty, cupy.uint8
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                for _ in range(iters):
                    empty(n, u8)

        def cupy_empty_pyalloc(iters):
            empty, u8 = cupy.empty, cupy.uint8
            with pc.using():
                for _ in range(iters):
                    empty(n, u8)

        cases.update(cupy_pool_pair=cupy_pool_pair, cupy_empty_pool=cupy_empty_pool,
                     cupy_empty_pyalloc=cupy_empty_pyalloc)

    try:
        import torch
        torch_ok = torch.cuda.is_available()
    except ImportError:
        torch_ok = False
    if torch_ok:
        def torch_pair(iters):
            alloc_fn, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
            stream = torch.cuda.current_stream(0)
            for _ in range(iters):
                delete(alloc_fn(n, 0, stream))

        cases["torch_pair"] = torch_pair
    return cases


def measure(loop, iters=20000, repeats=7):
    """ns per operation: (best, median) over `repeats` timed runs of `iters` iterations."""
    loop(1000)                                           # warm the caches (first segment etc.)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        loop(iters)
        samples.append((time.perf_counter_ns() - t0) / iters)
    return min(samples), statistics.median(samples)


def run(iters=20000, repeats=7):
    cases = make_cases()
    results = {name: measure(loop, iters, repeats) for name, loop in cases.items()}
    best = {k: v[0] for k, v in results.items()}
    ratios = {}
    if "cupy_pool_pair" in best:
        ratios["pyalloc_pair / cupy_pool_pair (target <= 0.25)"] = best["pyalloc_pair"] / best["cupy_pool_pair"]
    if "cupy_empty_pool" in best:
        ratios["cupy_empty_pyalloc / cupy_empty_pool (target <= 1.0)"] = (
            best["cupy_empty_pyalloc"] / best["cupy_empty_pool"])
    if "torch_pair" in best:
        ratios["pyalloc_pair / torch_pair"] = best["pyalloc_pair"] / best["torch_pair"]
    ratios["pyalloc_pair / floor"] = best["pyalloc_pair"] / best["floor"]
    return results, ratios


def format_table(results, ratios):
    lines = [f"{'case':<22}{'best ns/op':>12}{'median ns/op':>14}"]
    for name, (best, median) in results.items():
        lines.append(f"{name:<22}{best:>12.1f}{median:>14.1f}")
    lines.append("")
    for name, value in ratios.items():
        lines.append(f"{name:<58}{value:>8.3f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if not _gpu_available():
        print("bench_gpu: no GPU; nothing measured")
        return 0
    results, ratios = run(args.iters, args.repeats)
    print(format_table(results, ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ns_per_op": {k: {"best": v[0], "median": v[1]} for k, v in results.items()},
                       "ratios": ratios, "nbytes": NBYTES}, f, indent=2)
    return 0


# ------------------------------------------------------------------------------ pytest-benchmark

try:
    import pytest
except ImportError:      # script mode without pytest
    pytest = None

if pytest is not None and "pytest" in sys.modules and __name__ != "__main__":
    pytestmark = [pytest.mark.gpu,
                  pytest.mark.skipif(not _gpu_available(), reason="needs an NVIDIA GPU")]

    @pytest.fixture(scope="module")
    def cases():
        return make_cases()

    @pytest.mark.parametrize("name", ["floor", "pyalloc_pair", "pyalloc_module_pair", "cupy_pool_pair",
                                      "torch_pair", "cupy_empty_pool", "cupy_empty_pyalloc"])
    def test_allocation_cost(benchmark, cases, name):
        if name not in cases:
            pytest.skip(f"{name}: library not installed")
        loop = cases[name]
        loop(1000)
        benchmark.group = "gpu allocation, 1 MiB, 100 ops per round"
        benchmark(loop, 100)


if __name__ == "__main__":
    sys.exit(main())
