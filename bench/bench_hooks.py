"""Per-allocation cost through pyalloc's Numba and cuda.core hooks against each framework's own
allocator, interleaved in one run (GPU machine).

    python bench/bench_hooks.py [--json out.json] [--nbytes 1048576] [--iters 500] [--rounds 41]

Cases (each allocates `nbytes` and drops or closes it at once, so pyalloc serves cache hits):
  numba_array_pyalloc / numba_array_default
      numba.cuda.device_array(nbytes, uint8), dropped, with pyalloc's EMM plugin / with Numba's own
      memory manager (cuMemAlloc; cuMemFree batched by its pending-deallocation queue, which each
      loop flushes at its end so that every free is counted)
  numba_memalloc_pyalloc / numba_memalloc_default
      the context's memalloc alone (no DeviceNDArray): the memory manager's own part
  core_buffer_pyalloc / core_buffer_dmr
      a cuda.core Buffer from pyalloc.cuda_core.PyallocMemoryResource / from cuda.core's
      DeviceMemoryResource (the driver's stream-ordered pool), closed, on a created stream
  pyalloc_pair, pyalloc_pair_stream
      allocator.malloc + allocator.free of the same default allocator, on stream 0 / on the
      cuda.core stream: pyalloc's own part of the hook calls above
  pyalloc_buffer_pair
      pyalloc.Buffer(allocator, nbytes) + close(): the object the Numba plugin wraps

Numba picks a memory manager when it creates a context and calls context.memory_manager.memalloc
for every allocation; the loops here assign the manager they measure to the one context before
running (each array keeps the finalizer of the manager that made it), so both managers are timed
in one process, interleaved round by round (bench/interleave.py). Targets (issue 18): the Numba and
cuda.core ratios <= 1.0.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/interleave.py, as a script too
from interleave import format_table, interleaved, ratio   # noqa: E402


def _gpu_reason():
    try:
        from pyalloc import cuda_backend
    except ImportError as exc:
        return f"pyalloc does not import: {exc}"
    if not cuda_backend.is_available():
        return f"no GPU: {cuda_backend.unavailable_reason()}"
    return None


def numba_cases(nbytes, alloc):
    """The Numba loops, or {} with a note where Numba is missing."""
    try:
        import numpy as np
        from numba import cuda
        from numba.cuda.cudadrv import driver
    except ImportError as exc:
        return {}, f"Numba left out: {exc}"
    import pyalloc.numba as pn
    ctx = cuda.current_context()
    own = driver.NumbaCUDAMemoryManager(context=ctx)
    own.initialize()
    ours = pn.PyallocMemoryManager(context=ctx)
    ours.initialize()

    def array_loop(manager, flush):
        def loop(iters):
            ctx.memory_manager = manager
            device_array = cuda.device_array
            for _ in range(iters):
                device_array(nbytes, dtype=np.uint8)
            flush()
        return loop

    def memalloc_loop(manager, flush):
        def loop(iters):
            ctx.memory_manager = manager
            memalloc = ctx.memalloc
            for _ in range(iters):
                memalloc(nbytes)
            flush()
        return loop

    def nothing():
        pass

    cases = {
        "numba_array_pyalloc": array_loop(ours, nothing),
        "numba_array_default": array_loop(own, own.deallocations.clear),
        "numba_memalloc_pyalloc": memalloc_loop(ours, nothing),
        "numba_memalloc_default": memalloc_loop(own, own.deallocations.clear),
    }
    return cases, f"numba-cuda {_version('numba_cuda')}, numba {_version('numba')}"


def core_cases(nbytes, alloc):
    """The cuda.core loops, or {} with a note where cuda.core is missing."""
    import pyalloc.cuda_core as pcc
    try:
        core = pcc.import_cuda_core()
    except ImportError as exc:
        return {}, f"cuda.core left out: {exc}"
    dev = core.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    ours = pcc.PyallocMemoryResource(0)
    theirs = core.DeviceMemoryResource(0)
    handle = int(stream.handle)

    def buffer_loop(mr):
        def loop(iters):
            allocate = mr.allocate
            for _ in range(iters):
                allocate(nbytes, stream=stream).close()
        return loop

    def pair_on_stream(iters):
        malloc, free = alloc.malloc, alloc.free
        for _ in range(iters):
            free(malloc(nbytes, handle))

    cases = {"core_buffer_pyalloc": buffer_loop(ours), "core_buffer_dmr": buffer_loop(theirs),
             "pyalloc_pair_stream": pair_on_stream}
    return cases, f"cuda.core {getattr(core, '__version__', '?')}"


def _version(module):
    try:
        return getattr(__import__(module), "__version__", "?")
    except ImportError:
        return "absent"


def make_cases(nbytes):
    import pyalloc
    from pyalloc import Buffer
    pyalloc.set_default_backend(None)
    alloc = pyalloc.get_allocator(0)

    def pyalloc_pair(iters):
        malloc, free = alloc.malloc, alloc.free
        for _ in range(iters):
            free(malloc(nbytes, 0))

    def pyalloc_buffer_pair(iters):
        for _ in range(iters):
            Buffer(alloc, nbytes, 0).close()

    cases = {"pyalloc_pair": pyalloc_pair, "pyalloc_buffer_pair": pyalloc_buffer_pair}
    notes = []
    for part in (numba_cases, core_cases):
        more, note = part(nbytes, alloc)
        cases.update(more)
        notes.append(note)
    return cases, notes


RATIOS = [    # (label, numerator case, denominator case)
    ("numba device_array: pyalloc / Numba's own (target <= 1.0)",
     "numba_array_pyalloc", "numba_array_default"),
    ("numba memalloc: pyalloc / Numba's own", "numba_memalloc_pyalloc", "numba_memalloc_default"),
    ("cuda.core Buffer: pyalloc / DeviceMemoryResource (target <= 1.0)",
     "core_buffer_pyalloc", "core_buffer_dmr"),
    ("pyalloc's part: pair / numba device_array via pyalloc", "pyalloc_pair", "numba_array_pyalloc"),
    ("pyalloc's part: Buffer pair / numba memalloc via pyalloc",
     "pyalloc_buffer_pair", "numba_memalloc_pyalloc"),
    ("pyalloc's part: pair on the stream / cuda.core Buffer via pyalloc",
     "pyalloc_pair_stream", "core_buffer_pyalloc"),
]


def run(nbytes, iters, rounds):
    cases, notes = make_cases(nbytes)
    samples = interleaved(cases, iterations=iters, rounds=rounds, warmup=200)
    results = {name: (min(v), statistics.median(v)) for name, v in samples.items()}
    ratios = {label: ratio(samples, a, b) for label, a, b in RATIOS if a in samples and b in samples}
    return results, ratios, notes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--nbytes", type=int, default=1 << 20, help="bytes per allocation (1 MiB)")
    parser.add_argument("--iters", type=int, default=500, help="iterations per case per round")
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args(argv)
    reason = _gpu_reason()
    if reason is not None:
        print(f"bench_hooks: {reason}; nothing measured")
        return 0
    results, ratios, notes = run(args.nbytes, args.iters, args.rounds)
    print(format_table(results, ratios, notes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ns_per_op": {k: {"best": v[0], "median": v[1]} for k, v in results.items()},
                       "ratios": {k: {"median": m, "q1": a, "q3": b} for k, (m, a, b) in ratios.items()},
                       "nbytes": args.nbytes, "notes": notes}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
