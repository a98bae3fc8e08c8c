"""Old build against new build, side by side in one run: the cache-hit pair over its floor and
replay speed, measured in alternating child processes (one per build per round).

Two builds of pyalloc cannot be imported into one process, so each round starts a child for each
build, in an order that alternates from round to round; the child times the malloc+free pair and
the floor interleaved (bench/interleave.py) and replays the 846,496-event trace (GPT-2 training
trace of tests/data repeated 16 times, fresh placement). Reported: per build, the median over
rounds of the child's pair/floor ratio and of its events/s (with the trace check of `replay`, and
without it where the build has one: the loop alone), and new/old of each.

Run:  python bench/compare_builds.py OLD_SITE NEW_SITE [--rounds 7] [--python PY]
where each SITE is a folder that holds an installed pyalloc (pip install --target SITE .); both
are put first on PYTHONPATH of their children.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = r"""
import gc, gzip, json, pickle, sys, time
sys.path.insert(1, BENCH)
import pyalloc
from interleave import interleaved, ratio
from pyalloc.replay import replay

a = pyalloc.CachingAllocator(backend=pyalloc.SimDevice(), config="")
# The floor: an extension method that does next to nothing (it reads one word), in both builds.
malloc, free, noop = a.malloc, a.free, a._lock_held

def pair(n):
    for _ in range(n):
        free(malloc(4096))

def floor(n):
    for _ in range(n):
        noop()
        noop()

samples = interleaved({"pair": pair, "floor": floor}, iterations=2000, rounds=51)
pair_over_floor = ratio(samples, "pair", "floor")[0]
pair_ns = sorted(samples["pair"])[len(samples["pair"]) // 2]
gpt2 = pickle.load(gzip.open(TRACE))
big = {"segments": [], "device_traces": [gpt2["device_traces"][0] * 16],
       "allocator_settings": gpt2["allocator_settings"]}
import inspect
# replay(check=False) skips the trace check that issue 11 added (scan_trace validates every
# entry): the loop alone is what a core change can speed up or slow down.
core_kw = {"check": False} if "check" in inspect.signature(replay).parameters else {}
rates, core_rates = [], []
for _ in range(3):
    gc.collect()
    rates.append(replay(big, placement="fresh").events_per_second)
    gc.collect()
    core_rates.append(replay(big, placement="fresh", **core_kw).events_per_second)
print(json.dumps({"pyalloc": pyalloc.__file__, "pair_over_floor": pair_over_floor,
                  "pair_ns": pair_ns, "events_per_second": sorted(rates)[1],
                  "events_per_second_unchecked": sorted(core_rates)[1]}))
"""


def run_child(python, site, trace):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    code = f"BENCH = {str(HERE)!r}\nTRACE = {str(trace)!r}\n" + CHILD
    out = subprocess.run([python, "-c", code], env=env, cwd="/", capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_site")
    parser.add_argument("new_site")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for the children (one without an editable pyalloc, whose "
                             "import hook would shadow both sites)")
    args = parser.parse_args()
    trace = HERE.parent / "tests" / "data" / "gpt2_train-default.pickle.gz"
    results = {"old": [], "new": []}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for which in order:
            row = run_child(args.python, getattr(args, which + "_site"), trace)
            if not row["pyalloc"].startswith(os.path.abspath(getattr(args, which + "_site"))):
                sys.exit(f"the {which} child imported {row['pyalloc']}, not its site's pyalloc")
            results[which].append(row)
    summary = {}
    for which in ("old", "new"):
        rows = results[which]
        summary[which] = {key: statistics.median(row[key] for row in rows)
                          for key in ("pair_over_floor", "pair_ns", "events_per_second", "events_per_second_unchecked")}
        summary[which]["module"] = rows[0]["pyalloc"]
    for key in ("pair_over_floor", "pair_ns", "events_per_second", "events_per_second_unchecked"):
        summary["new/old " + key] = summary["new"][key] / summary["old"][key]
    per_round = [n["pair_over_floor"] / o["pair_over_floor"] for o, n in zip(results["old"], results["new"])]
    summary["new/old pair_over_floor per round"] = [round(x, 3) for x in per_round]
    per_round = [n["events_per_second_unchecked"] / o["events_per_second_unchecked"]
                 for o, n in zip(results["old"], results["new"])]
    summary["new/old events_per_second_unchecked per round"] = [round(x, 3) for x in per_round]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
