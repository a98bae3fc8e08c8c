"""GPU allocation costs, pyalloc against CuPy's pool and PyTorch's caching allocator, in one run.

Two modes:
  pytest bench/bench_gpu.py --benchmark-json=out.json     pytest-benchmark, one benchmark per case
  python bench/bench_gpu.py [--json out.json]             a table of ns per operation and ratios

Cases (all 1 MiB, stream 0, steady state: every allocation is a cache hit):
  floor               an empty method of the pyalloc allocator: the Python -> extension call floor
  pyalloc_pair        allocator.malloc + allocator.free (bound methods of the default allocator)
  pyalloc_module_pair pyalloc.malloc + pyalloc.free (module level, device looked up)
  cupy_pool_pair      cupy.cuda.MemoryPool().malloc, then dropping the MemoryPointer (its free)
  cupy_hook_pair      pyalloc.cupy's allocator function (what cupy.empty calls with pyalloc
                      installed), then dropping its MemoryPointer: the pool pair's counterpart
  torch_pair          torch.cuda.caching_allocator_alloc + caching_allocator_delete
  cupy_empty_pool     cupy.empty(1 MiB, uint8) on CuPy's own pool (the array dropped at once)
  cupy_empty_pyalloc  the same with pyalloc installed as CuPy's allocator (pyalloc.cupy.using)
  cupy_empty_side_detect / cupy_empty_side_nodetect
                      cupy.empty on a non-blocking stream with pyalloc, with the default capture
                      detection (one cuStreamGetCaptureInfo per allocation) and with it off: the
                      difference is what detecting captures CuPy begins itself costs

Targets from issue 4: pyalloc_pair <= 1/4 of cupy_pool_pair; cupy_empty_pyalloc <= cupy_empty_pool.
The cases run interleaved (bench/interleave.py) and each ratio is the median of its per-round
ratios: machines are noisy, so compare those, not absolute numbers across runs.
Skipped (pytest) or left out (script) without a GPU, CuPy or PyTorch.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/interleave.py, as a script too
from interleave import format_table, interleaved, ratio   # noqa: E402

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
        noop = alloc._lock_held        # an extension method that reads one word
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

        hook = pc.allocator()

        def cupy_hook_pair(iters):
            for _ in range(iters):
                hook(n)                # pyalloc.cupy's allocator function, as cupy.empty calls it

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

        side = cupy.cuda.Stream(non_blocking=True)

        def side_empty(detect):
            def loop(iters):
                empty, u8 = cupy.empty, cupy.uint8
                with side, pc.using(detect_capture=detect):
                    for _ in range(iters):
                        empty(n, u8)
            return loop

        cases.update(cupy_pool_pair=cupy_pool_pair, cupy_hook_pair=cupy_hook_pair,
                     cupy_empty_pool=cupy_empty_pool,
                     cupy_empty_pyalloc=cupy_empty_pyalloc,
                     cupy_empty_side_detect=side_empty("route"),
                     cupy_empty_side_nodetect=side_empty("off"))

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


def run(iters=2000, rounds=61):
    """Time every case interleaved (bench/interleave.py): each round runs each case once.

    Returns ({case: (best, median) ns per operation}, {ratio name: (median, q1, q3)}), the ratios
    being medians of the per-round ratios, which the machine's drift over the run does not move.
    """
    cases = make_cases()
    samples = interleaved(cases, iterations=iters, rounds=rounds)
    results = {name: (min(v), statistics.median(v)) for name, v in samples.items()}
    ratios = {}
    if "cupy_pool_pair" in samples:
        ratios["pyalloc_pair / cupy_pool_pair (target <= 0.25)"] = ratio(samples, "pyalloc_pair", "cupy_pool_pair")
    if "cupy_hook_pair" in samples:
        ratios["cupy_hook_pair / cupy_pool_pair"] = ratio(samples, "cupy_hook_pair", "cupy_pool_pair")
    if "cupy_empty_pool" in samples:
        ratios["cupy_empty_pyalloc / cupy_empty_pool (target <= 1.0)"] = ratio(
            samples, "cupy_empty_pyalloc", "cupy_empty_pool")
    if "cupy_empty_side_detect" in samples:
        ratios["cupy_empty_side_detect / cupy_empty_side_nodetect"] = ratio(
            samples, "cupy_empty_side_detect", "cupy_empty_side_nodetect")
    if "torch_pair" in samples:
        ratios["pyalloc_pair / torch_pair"] = ratio(samples, "pyalloc_pair", "torch_pair")
    ratios["pyalloc_pair / floor"] = ratio(samples, "pyalloc_pair", "floor")
    return results, ratios


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--iters", type=int, default=2000, help="iterations per case per round")
    parser.add_argument("--rounds", type=int, default=61)
    args = parser.parse_args(argv)
    if not _gpu_available():
        print("bench_gpu: no GPU; nothing measured")
        return 0
    results, ratios = run(args.iters, args.rounds)
    print(format_table(results, ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ns_per_op": {k: {"best": v[0], "median": v[1]} for k, v in results.items()},
                       "ratios": {k: {"median": m, "q1": a, "q3": b} for k, (m, a, b) in ratios.items()},
                       "nbytes": NBYTES}, f, indent=2)
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
                                      "cupy_hook_pair", "torch_pair", "cupy_empty_pool",
                                      "cupy_empty_pyalloc"])
    def test_allocation_cost(benchmark, cases, name):
        if name not in cases:
            pytest.skip(f"{name}: library not installed")
        loop = cases[name]
        loop(1000)
        benchmark.group = "gpu allocation, 1 MiB, 100 ops per round"
        benchmark(loop, 100)


if __name__ == "__main__":
    sys.exit(main())
