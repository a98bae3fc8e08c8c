"""torch.empty(1 MiB) + its free: through pyalloc (pyalloc.torch.install) against PyTorch's native
caching allocator, in one run on a GPU.

PyTorch takes its allocator once per process, so each allocator runs in its own child process;
the parent starts one child per allocator per round, in an order that rotates from round to
round, and reports the median over rounds of each child's median time per allocation+free
(a loop of `torch.empty(1 MiB, uint8, cuda)` whose result is dropped at once).

A third child loads a one-slot cache through the same pluggable path (pyalloc_torch_one_slot_*
in libpyalloc_torch.so: no lock, no statistics), so that the cost of PyTorch's pluggable path
itself is known: pyalloc's own share of an allocation is (pyalloc - one-slot).

Run on the GPU machine:  python bench/bench_torch_hook.py [--rounds 9] [--json out.json]
Target (issue 18): pyalloc / native <= 0.8.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
kind, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kind == "pyalloc":
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
samples = []
for _ in range(repeats):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        empty(size, dtype=u8, device=dev)
    samples.append((time.perf_counter_ns() - t0) / n)
slow = None
if kind == "pyalloc":
    from pyalloc import _capi
    slow = _capi.slow_path_calls()     # cache hits should leave these near the warm-up's misses
print(json.dumps({"kind": kind, "ns": statistics.median(samples), "slow_path_calls": slow,
                  "allocations": 2000 + n * repeats}))
"""

KINDS = ("native", "pyalloc", "one-slot")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--n", type=int, default=20000, help="allocations per timed loop")
    parser.add_argument("--repeats", type=int, default=15, help="timed loops per child")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    per_kind = {k: [] for k in KINDS}
    slow_path = (None, None)
    for r in range(args.rounds):
        order = KINDS[r % 3:] + KINDS[:r % 3]
        for kind in order:
            out = subprocess.run([sys.executable, "-c", CHILD, kind, str(args.n), str(args.repeats)],
                                 capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
            if out.returncode != 0:
                print(f"{kind} child failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
            child = json.loads(out.stdout.strip().splitlines()[-1])
            per_kind[kind].append(child["ns"])
            if child["slow_path_calls"] is not None:
                slow_path = (child["slow_path_calls"], child["allocations"])
    med = {k: statistics.median(v) for k, v in per_kind.items()}
    result = {
        "ns_per_alloc_free": med,
        "rounds": args.rounds,
        "pyalloc_over_native": med["pyalloc"] / med["native"],
        "one_slot_over_native": med["one-slot"] / med["native"],
        "pyalloc_own_ns": med["pyalloc"] - med["one-slot"],
        "per_round": per_kind,
        "pyalloc_slow_path_calls": slow_path[0], "pyalloc_allocations": slow_path[1],
    }
    print(f"torch.empty(1 MiB)+free, median of {args.rounds} rounds (ns): "
          + ", ".join(f"{k} {med[k]:.0f}" for k in KINDS))
    print(f"pyalloc / native = {result['pyalloc_over_native']:.3f} (target <= 0.8); "
          f"one-slot / native = {result['one_slot_over_native']:.3f}; "
          f"pyalloc's own code: {result['pyalloc_own_ns']:.0f} ns per allocation+free")
    print(f"pyalloc child, last round: {slow_path[1]} allocations, of which the C entry points sent "
          f"down the ordinary (GIL) path: {slow_path[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
