"""torch.empty(1 MiB) + its free: through pyalloc (pyalloc.torch.install) against PyTorch's native
caching allocator, in one run on a GPU.

PyTorch takes its allocator once per process, so each allocator runs in its own child process;
the parent starts one child per allocator per round, in an order that rotates from round to
round, and reports the median over rounds of each child's median time per allocation+free
(a loop of `torch.empty(1 MiB, uint8, cuda)` whose result is dropped at once). In every child the
measuring thread runs pinned to the same CPU (--cpu), so that the comparison is not one between
cores; it is pinned after CUDA's initialisation, so the driver's threads run on other CPUs.

A third child loads a one-slot cache through the same pluggable path (pyalloc_torch_one_slot_*
in libpyalloc_torch.so: no lock, no statistics), so that the cost of PyTorch's pluggable path
itself is known: pyalloc's own share of an allocation is (pyalloc - one-slot).

With --old DIR (an older pyalloc installed into DIR, e.g. pip install --target DIR), a fourth
child runs pyalloc from DIR in every round, so that a hot-path change is measured old build
against new in one run.

Run on the GPU machine:  python bench/bench_torch_hook.py [--rounds 9] [--json out.json] [--old DIR]
Target (issue 18): pyalloc / native <= 0.8.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, statistics, sys, time
kind, n, repeats, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import torch
if kind in ("pyalloc", "pyalloc-old"):
    import pyalloc.torch as pt
    pt.install()
elif kind == "one-slot":
    import pyalloc.torch as pt
    pt.library()
    torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
        pt.library_path(), "pyalloc_torch_one_slot_malloc", "pyalloc_torch_one_slot_free"))
size = 1 << 20
empty, u8 = torch.empty, torch.uint8
dev = torch.device("cuda", 0)
for _ in range(2000):
    empty(size, dtype=u8, device=dev)
torch.cuda.synchronize()
if cpu >= 0:
    # This thread only, after CUDA's initialisation: the driver's own threads (started with the
    # context) keep running elsewhere instead of sharing the measured thread's CPU.
    os.sched_setaffinity(0, {cpu})
samples = []
for _ in range(repeats):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        empty(size, dtype=u8, device=dev)
    samples.append((time.perf_counter_ns() - t0) / n)
slow = direct = None
if kind == "pyalloc":
    from pyalloc import _capi
    slow = _capi.slow_path_calls()     # cache hits should leave these near the warm-up's misses
    # The library's two pairs called straight through ctypes in this process, interleaved:
    # pyalloc's own part without PyTorch around it (ctypes' cost is in both).
    import ctypes
    lib = pt.library()
    fns = {}
    for name in ("pyalloc_torch", "pyalloc_torch_one_slot"):
        m, f = getattr(lib, name + "_malloc"), getattr(lib, name + "_free")
        m.argtypes, m.restype = (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
        f.argtypes, f.restype = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p), None
        fns[name] = (m, f)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (m, f) in fns.items():
            t0 = time.perf_counter_ns()
            for _ in range(n // 4):
                f(m(size, 0, None), size, 0, None)
            times[name].append((time.perf_counter_ns() - t0) / (n // 4))
    direct = {name: statistics.median(v) for name, v in times.items()}
print(json.dumps({"kind": kind, "ns": statistics.median(samples), "slow_path_calls": slow,
                  "allocations": 2000 + n * repeats, "ctypes_pairs": direct}))
"""

KINDS = ("native", "pyalloc", "one-slot")
OLD = "pyalloc-old"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--n", type=int, default=20000, help="allocations per timed loop")
    parser.add_argument("--repeats", type=int, default=15, help="timed loops per child")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--old", metavar="DIR",
                        help="an older pyalloc installed in DIR, run as a fourth child each round")
    parser.add_argument("--cpu", type=int, default=None,
                        help="CPU every child runs on (default: the last one this process may "
                             "use; -1: no pinning). One CPU for all children keeps the clock and "
                             "caches the same for each allocator")
    args = parser.parse_args(argv)
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    kinds = KINDS + ((OLD,) if args.old else ())
    per_kind = {k: [] for k in kinds}
    slow_path = (None, None)
    direct = []
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            env = dict(os.environ)
            if kind == OLD:
                env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.old)]
                                                    + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            out = subprocess.run([sys.executable, "-c", CHILD, kind, str(args.n), str(args.repeats),
                                  str(cpu)], env=env,
                                 capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
            if out.returncode != 0:
                print(f"{kind} child failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
            child = json.loads(out.stdout.strip().splitlines()[-1])
            per_kind[kind].append(child["ns"])
            if kind == "pyalloc" and child["slow_path_calls"] is not None:
                slow_path = (child["slow_path_calls"], child["allocations"])
                direct.append(child["ctypes_pairs"]["pyalloc_torch"]
                              - child["ctypes_pairs"]["pyalloc_torch_one_slot"])
    med = {k: statistics.median(v) for k, v in per_kind.items()}
    result = {
        "ns_per_alloc_free": med,
        "rounds": args.rounds,
        "cpu": cpu,
        "pyalloc_over_native": med["pyalloc"] / med["native"],
        "one_slot_over_native": med["one-slot"] / med["native"],
        "pyalloc_own_ns": med["pyalloc"] - med["one-slot"],
        "per_round": per_kind,
        "pyalloc_slow_path_calls": slow_path[0], "pyalloc_allocations": slow_path[1],
        "pyalloc_own_ns_through_ctypes": statistics.median(direct),
    }
    if args.old:
        # Per round, new over old (the two children of a round ran back to back on one CPU).
        result["new_over_old_per_round"] = [n / o for n, o in zip(per_kind["pyalloc"], per_kind[OLD])]
        result["new_over_old"] = statistics.median(result["new_over_old_per_round"])
        result["old_over_native"] = med[OLD] / med["native"]
    print(f"torch.empty(1 MiB)+free, median of {args.rounds} rounds (ns): "
          + ", ".join(f"{k} {med[k]:.0f}" for k in kinds))
    print(f"pyalloc / native = {result['pyalloc_over_native']:.3f} (target <= 0.8); "
          f"one-slot / native = {result['one_slot_over_native']:.3f}; "
          f"pyalloc's own code: {result['pyalloc_own_ns']:.0f} ns per allocation+free")
    print(f"pyalloc's own code called through ctypes in the pyalloc child (its pair minus the "
          f"one-slot pair, median of rounds): {result['pyalloc_own_ns_through_ctypes']:.0f} ns")
    print(f"pyalloc child, last round: {slow_path[1]} allocations, of which the C entry points sent "
          f"down the ordinary (GIL) path: {slow_path[0]}")
    if args.old:
        print(f"old build ({args.old}) / native = {result['old_over_native']:.3f}; new / old, median "
              f"of per-round ratios = {result['new_over_old']:.3f}")
    print("per round (ns): " + "; ".join(f"{k} " + " ".join(f"{v:.0f}" for v in per_kind[k])
                                        for k in kinds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
