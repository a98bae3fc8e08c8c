"""torch.empty(1 MiB) + its free: through pyalloc (PyTorch's pluggable allocator path) against
PyTorch's native caching allocator, in one run on a GPU.

PyTorch takes its allocator once per process, so native and pyalloc run in separate child
processes; the parent starts one child of each kind per round, in an order that rotates from
round to round. A child times loops of `torch.empty(1 MiB, uint8, cuda)` whose result is dropped
at once (ns per allocation + free).

The pyalloc child installs libpyalloc_torch's benchmark pair (pyalloc_torch_bench_malloc/free)
and alternates, loop by loop, between pyalloc and a one-slot cache loaded through the same
pluggable path (no lock, no statistics: the floor of PyTorch's pluggable path itself). So
pyalloc's own share of an allocation, pyalloc - one-slot, is measured interleaved within one
process: separate processes differ by more than that share.

In every child the measuring thread is pinned to the same CPU (--cpu) after CUDA's
initialisation, so that the comparison is not one between cores and the driver's threads run
elsewhere.

With --old DIR (an older pyalloc installed into DIR, e.g. pip install --target DIR), a third child
runs that build through pyalloc.torch.install() in every round, so that a hot-path change is
measured old build against new in one run.

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
kind, n, repeats, cpu, pin_early = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                    int(sys.argv[4]), sys.argv[5] == "1")
if cpu >= 0 and pin_early:
    os.sched_setaffinity(0, {cpu})          # every thread, the driver's included
import torch
select = None
if kind == "pyalloc":
    import ctypes
    import pyalloc.torch as pt
    lib = pt.library()                      # loaded and bound to pyalloc's table
    lib.pyalloc_torch_bench_select.argtypes = (ctypes.c_int,)
    select = lib.pyalloc_torch_bench_select
    torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
        pt.library_path(), "pyalloc_torch_bench_malloc", "pyalloc_torch_bench_free"))
elif kind == "pyalloc-old":
    import pyalloc.torch as pt
    pt.install()
size = 1 << 20
empty, u8 = torch.empty, torch.uint8
dev = torch.device("cuda", 0)
for mode in (1, 0):
    if select is not None:
        select(mode)
    for _ in range(2000):
        empty(size, dtype=u8, device=dev)
torch.cuda.synchronize()
if cpu >= 0 and not pin_early:
    # This thread only, after CUDA's initialisation: the driver's own threads (started with the
    # context) keep running elsewhere instead of sharing the measured thread's CPU.
    os.sched_setaffinity(0, {cpu})

def loop():
    t0 = time.perf_counter_ns()
    for _ in range(n):
        empty(size, dtype=u8, device=dev)
    return (time.perf_counter_ns() - t0) / n

out = {"kind": kind}
if select is None:
    out["ns"] = statistics.median(loop() for _ in range(repeats))
else:
    from pyalloc import _capi
    before = _capi.slow_path_calls()["malloc"]
    times = {0: [], 1: []}
    for r in range(repeats):
        for mode in ((0, 1) if r % 2 == 0 else (1, 0)):
            select(mode)
            times[mode].append(loop())
    select(0)
    out["ns"] = statistics.median(times[0])
    out["one_slot_ns"] = statistics.median(times[1])
    out["share_ns"] = statistics.median(a - b for a, b in zip(times[0], times[1]))
    # Cache hits should send nothing down the ordinary path once warm: the timed loops' count.
    out["slow_path_mallocs"] = _capi.slow_path_calls()["malloc"] - before
    out["pyalloc_allocations"] = n * repeats
print(json.dumps(out))
"""

OLD = "pyalloc-old"


def run_child(kind, args, cpu):
    env = dict(os.environ)
    if kind == OLD:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(args.old)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(args.n), str(args.repeats), str(cpu),
                          "1" if args.pin_early else "0"],
                         env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    if out.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


SLOW_FACTOR = 1.3


def summarize(rounds, kinds):
    """Figures of a run's rounds ({kind: child result} per round)."""
    med = statistics.median
    native = [r["native"]["ns"] for r in rounds]
    pyalloc = [r["pyalloc"]["ns"] for r in rounds]
    one_slot = [r["pyalloc"]["one_slot_ns"] for r in rounds]
    share = [r["pyalloc"]["share_ns"] for r in rounds]
    result = {
        "rounds": len(rounds),
        "ns_per_alloc_free": {"native": med(native), "pyalloc": med(pyalloc), "one-slot": med(one_slot)},
        # Per round: the pyalloc and native children ran back to back on one CPU.
        "pyalloc_over_native": med(p / q for p, q in zip(pyalloc, native)),
        "one_slot_over_native": med(o / q for o, q in zip(one_slot, native)),
        "pyalloc_own_ns": med(share),
        "pyalloc_own_over_native": med(s / q for s, q in zip(share, native)),
        "slow_path_mallocs": [r["pyalloc"]["slow_path_mallocs"] for r in rounds],
        "pyalloc_allocations_per_child": rounds[0]["pyalloc"]["pyalloc_allocations"],
    }
    # On the H200 machines some children run all their loops at about twice the time of the
    # others (of every kind, at random; the machine's, not the allocator's). A child more than
    # SLOW_FACTOR times its kind's fastest child of the run is counted slow, and the figures are
    # given again over the fast children alone.
    times = {"native": native, "pyalloc": pyalloc}
    if OLD in kinds:
        times[OLD] = [r[OLD]["ns"] for r in rounds]
        result["ns_per_alloc_free"][OLD] = med(times[OLD])
        result["old_over_native"] = med(o / q for o, q in zip(times[OLD], native))
        result["new_over_old"] = med(p / o for p, o in zip(pyalloc, times[OLD]))
    fast = {k: [t < SLOW_FACTOR * min(v) for t in v] for k, v in times.items()}
    fast_ns = {k: med(t for t, ok in zip(v, fast[k]) if ok) for k, v in times.items()}
    fast_ns["one-slot"] = med(o for o, ok in zip(one_slot, fast["pyalloc"]) if ok)
    fast_share = med(s for s, ok in zip(share, fast["pyalloc"]) if ok)
    result["fast_children"] = {k: sum(v) for k, v in fast.items()}
    result["fast_ns_per_alloc_free"] = fast_ns
    result["fast_pyalloc_own_ns"] = fast_share
    result["fast_over_native"] = {k: v / fast_ns["native"] for k, v in fast_ns.items() if k != "native"}
    result["fast_pyalloc_own_over_native"] = fast_share / fast_ns["native"]
    return result


def report(result, rounds, kinds, old_dir):
    figures = result["ns_per_alloc_free"]
    print(f"torch.empty(1 MiB)+free, median of {len(rounds)} rounds (ns): "
          + ", ".join(f"{k} {v:.0f}" for k, v in figures.items()))
    print(f"pyalloc / native = {result['pyalloc_over_native']:.3f} (target <= 0.8); "
          f"one-slot / native = {result['one_slot_over_native']:.3f} (median of per-round ratios)")
    print(f"pyalloc's own code (pyalloc - one-slot, interleaved in one process): "
          f"{result['pyalloc_own_ns']:.0f} ns per allocation+free, "
          f"{result['pyalloc_own_over_native']:.3f} of native")
    print(f"timed mallocs sent down the ordinary (GIL) path, per child: {result['slow_path_mallocs']} "
          f"of {result['pyalloc_allocations_per_child']}")
    if OLD in kinds:
        print(f"old build ({old_dir}) / native = {result['old_over_native']:.3f}; new / old = "
              f"{result['new_over_old']:.3f} (medians of per-round ratios)")
    counts = result["fast_children"]
    print(f"fast children only (within {SLOW_FACTOR}x of their kind's fastest; "
          + ", ".join(f"{k} {n} of {len(rounds)}" for k, n in counts.items()) + "): "
          + ", ".join(f"{k} {v:.0f} ns" for k, v in result["fast_ns_per_alloc_free"].items()) + "; "
          + ", ".join(f"{k} / native {v:.3f}" for k, v in result["fast_over_native"].items())
          + f"; pyalloc's own code {result['fast_pyalloc_own_ns']:.0f} ns "
          f"({result['fast_pyalloc_own_over_native']:.3f} of native)")
    print("per round (ns): " + "; ".join(
        f"{k} " + " ".join(f"{r[k]['ns']:.0f}" for r in rounds) for k in kinds)
        + "; one-slot " + " ".join(f"{r['pyalloc']['one_slot_ns']:.0f}" for r in rounds)
        + "; share " + " ".join(f"{r['pyalloc']['share_ns']:.0f}" for r in rounds))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--n", type=int, default=20000, help="allocations per timed loop")
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed loops per child (the pyalloc child: of each of its two modes)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--old", metavar="DIR",
                        help="an older pyalloc installed in DIR, run as a third child each round")
    parser.add_argument("--cpu", type=int, default=None,
                        help="CPU every child's measuring thread runs on (default: the last one "
                             "this process may use; -1: no pinning)")
    parser.add_argument("--pin-early", action="store_true",
                        help="pin the whole child, CUDA driver threads included, before torch starts")
    parser.add_argument("--from-json", metavar="FILE",
                        help="print the figures of an earlier run's --json file, running nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        rounds = saved["per_round"]
        kinds = tuple(rounds[0])
        report(summarize(rounds, kinds), rounds, kinds, "old build")
        return 0
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    kinds = ("native", "pyalloc") + ((OLD,) if args.old else ())
    rounds = []
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        try:
            rounds.append({kind: run_child(kind, args, cpu) for kind in order})
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
    result = summarize(rounds, kinds)
    result["cpu"] = cpu
    result["per_round"] = rounds
    report(result, rounds, kinds, args.old)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
