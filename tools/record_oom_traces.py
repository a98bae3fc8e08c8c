"""Record small real PyTorch traces of the cases replay must get right around out-of-memory, and an oracle.

Run on a machine with a CUDA GPU and PyTorch (written for torch 2.11, CUDA 13, one H200):

    python3 tools/record_oom_traces.py OUTDIR                  # the four scenario traces + the oracle
    python3 tools/record_oom_traces.py OUTDIR --only streams gc-fraction

Each run is its own process (PyTorch reads PYTORCH_CUDA_ALLOC_CONF once, when CUDA starts, and the
memory fraction is per process). Memory history is on (enabled="all", context=None) before the
first CUDA allocation, so the trace holds every allocator event and a replay can reproduce PyTorch's
figures. Every run writes NAME.pickle.gz (the snapshot, gzip'd pickle) and NAME.json: the figures of
torch.cuda.memory_stats() at the end (peak_reserved, peak_allocated, peak_requested,
num_device_alloc, num_alloc_retries, num_ooms, final_reserved), the setting (conf), the memory
fraction given to torch.cuda.set_per_process_memory_fraction (null: none), the device's total
memory as cudaMemGetInfo reports it (total_memory) and the cap PyTorch derives from both (allowed:
int(fraction * total_memory), the limit its allocator enforces), the event counts, the versions.

Scenarios (random request sizes from a seeded generator, so the runs repeat):
  streams              default setting; allocations on the default stream and three side streams,
                       tensors used on other streams and marked with Tensor.record_stream, so frees
                       complete late (free_requested ... free_completed)
  expandable-empty-cache  expandable_segments:True with torch.cuda.empty_cache() every few rounds
                       (empty_cache leaves segment_unmap runs in the trace)
  gc-fraction          garbage_collection_threshold:0.5 under a 560 MiB fraction cap: the allocator
                       frees some cached segments inside mallocs (the GC acts only with a fraction)
  tight-fraction       default setting under a 192 MiB cap: some requests run out of memory, the
                       program catches torch.OutOfMemoryError, drops half its tensors and goes on
  oracle               a small GPT-style model trained with varying sequence lengths (the workload
                       of tools/record_example_trace.py), first uncapped under the default setting,
                       then under caps between its peak allocated and peak reserved until the default
                       setting runs out of memory; at that cap every setting of ORACLE_SETTINGS runs.
                       A run that runs out of memory dumps its snapshot in the except block and stops,
                       as a user's program would. oracle.json lists every run's outcome and figures;
                       the snapshots are oracle-<setting>.pickle.gz for the runs that ran out of memory.
"""
import argparse
import collections
import gzip
import json
import os
import pickle
import random
import subprocess
import sys
import time

MiB = 1 << 20
SCENARIOS = ("streams", "expandable-empty-cache", "gc-fraction", "tight-fraction")
ORACLE_SETTINGS = ("", "expandable_segments:True", "max_split_size_mb:64", "max_split_size_mb:128",
                   "roundup_power2_divisions:4", "garbage_collection_threshold:0.8")
HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------- one run

def start(torch, cap_bytes):
    """History on, then the cap (a fraction of the device's total memory) if any; returns (fraction, total)."""
    torch.cuda.init()
    total = torch.cuda.mem_get_info(0)[1]
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=2_000_000)
    fraction = None
    if cap_bytes:
        fraction = cap_bytes / total
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction, total


def finish(torch, out, name, conf, fraction, total, extra):
    """Write NAME.pickle.gz and NAME.json into out; returns the figures."""
    snapshot = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][0]
    path = os.path.join(out, name + ".pickle.gz")
    with gzip.open(path, "wb", compresslevel=9) as f:
        pickle.dump(snapshot, f, protocol=4)
    figures = {
        "name": name, "conf": conf, "fraction": fraction, "total_memory": total,
        "allowed": int(fraction * total) if fraction is not None else None,
        "events": len(trace), "actions": dict(collections.Counter(e["action"] for e in trace)),
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "peak_requested": stats["requested_bytes.all.peak"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_device_free": stats.get("num_device_free"),
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": stats["num_ooms"],
        "final_reserved": stats["reserved_bytes.all.current"],
        "final_allocated": stats["allocated_bytes.all.current"],
        "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
    }
    figures.update(extra)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(figures, f, indent=1)
        f.write("\n")
    return figures


def sizes(rng, n, lo, hi):
    """n irregular request sizes in bytes between lo and hi (log-uniform, not multiples of 512)."""
    import math
    return [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) | 1 for _ in range(n)]


def run_streams(torch, rng):
    dev = torch.device("cuda", 0)
    side = [torch.cuda.Stream() for _ in range(3)]
    live = []
    for i, n in enumerate(sizes(rng, 900, 300, 24 * MiB)):
        s = rng.choice([None] + side)
        if s is None:
            t = torch.empty(n, dtype=torch.uint8, device=dev)
            t.fill_(i % 251)
        else:
            with torch.cuda.stream(s):
                t = torch.empty(n, dtype=torch.uint8, device=dev)
                t.fill_(i % 251)
        live.append((t, s))
        if rng.random() < 0.3:
            # Use a tensor of the default stream on a side stream: it must outlive that work.
            t2, s2 = rng.choice(live)
            user = rng.choice(side)
            if user is not s2:
                user.wait_stream(torch.cuda.current_stream() if s2 is None else s2)
                with torch.cuda.stream(user):
                    t2.add_(1)
                t2.record_stream(user)
        while len(live) > 40 or (live and rng.random() < 0.45):
            live.pop(rng.randrange(len(live)))
    del live
    torch.cuda.synchronize()
    return {}


def run_expandable_empty_cache(torch, rng):
    dev = torch.device("cuda", 0)
    live = []
    calls = 0
    for i, n in enumerate(sizes(rng, 1000, 400, 48 * MiB)):
        live.append(torch.empty(n, dtype=torch.uint8, device=dev))
        while len(live) > 30 or (live and rng.random() < 0.45):
            live.pop(rng.randrange(len(live)))
        if i % 97 == 96:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            calls += 1
    del live
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"empty_cache_calls": calls + 1}


def run_gc_fraction(torch, rng):
    dev = torch.device("cuda", 0)
    live = []
    for n in sizes(rng, 1200, 1 * MiB, 40 * MiB):
        live.append(torch.empty(n, dtype=torch.uint8, device=dev))
        while len(live) > 12 or (live and rng.random() < 0.4):
            live.pop(rng.randrange(len(live)))
    del live
    torch.cuda.synchronize()
    return {}


def run_tight_fraction(torch, rng):
    dev = torch.device("cuda", 0)
    live = []
    caught = 0
    for n in sizes(rng, 1200, 4096, 64 * MiB):
        try:
            live.append(torch.empty(n, dtype=torch.uint8, device=dev))
        except torch.OutOfMemoryError:
            caught += 1
            rng.shuffle(live)
            del live[:len(live) // 2]
        while len(live) > 14 or (live and rng.random() < 0.3):
            live.pop(rng.randrange(len(live)))
    del live
    torch.cuda.synchronize()
    return {"ooms_caught": caught}


def run_oracle_workload(torch, rng, steps):
    """The training loop of record_example_trace.py (same model), with more varied shapes."""
    sys.path.insert(0, HERE)
    from record_example_trace import build_model, train_step
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    vocab, width, layers, heads, max_len = 5000, 384, 4, 6, 640
    model = build_model(torch, vocab, width, layers, heads, max_len).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    shapes = [(8, 137), (13, 251), (5, 509), (11, 333), (7, 421), (16, 97), (6, 613), (9, 287),
              (12, 199), (4, 577), (10, 463), (14, 173)]
    for step in range(steps):
        batch, seq = shapes[step % len(shapes)]
        train_step(torch, model, opt, vocab, batch, seq, dev)
    torch.cuda.synchronize()
    return {"steps": steps}


RUNNERS = {"streams": run_streams, "expandable-empty-cache": run_expandable_empty_cache,
           "gc-fraction": run_gc_fraction, "tight-fraction": run_tight_fraction}
SCENARIO_SETUP = {  # name -> (PYTORCH_CUDA_ALLOC_CONF, cap in bytes or 0)
    "streams": ("", 0),
    "expandable-empty-cache": ("expandable_segments:True", 0),
    "gc-fraction": ("garbage_collection_threshold:0.5", 560 * MiB),
    "tight-fraction": ("", 192 * MiB),
}


def run_one(args):
    """Child process: one run, its files, and one JSON line of its figures on stdout."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.conf
    import torch
    if not torch.cuda.is_available():
        sys.exit("record_oom_traces.py needs a CUDA GPU")
    rng = random.Random(args.seed)
    fraction, total = start(torch, args.cap_bytes)
    started = time.perf_counter()
    def about(outcome, extra):
        extra.update({"outcome": outcome, "secs": round(time.perf_counter() - started, 2),
                      "seed": args.seed, "scenario": args.scenario, "cap_bytes": args.cap_bytes})
        return extra

    if args.scenario == "oracle":
        try:
            extra = about("completed", run_oracle_workload(torch, rng, args.steps))
        except torch.OutOfMemoryError as e:
            # As a user would: the snapshot is dumped in the except block, while the failed
            # step's tensors are still alive.
            figures = finish(torch, args.out, args.name, args.conf, fraction, total,
                             about("oom", {"error": str(e).splitlines()[0][:400]}))
            print("FIGURES " + json.dumps(figures), flush=True)
            return
    else:
        extra = about("completed", RUNNERS[args.scenario](torch, rng))
    if args.scenario == "oracle" and not args.keep_completed:
        # Completed oracle runs need only their figures; their snapshot is not kept.
        stats = torch.cuda.memory_stats()
        torch.cuda.memory._record_memory_history(enabled=None)
        figures = {"name": args.name, "conf": args.conf, "fraction": fraction, "total_memory": total,
                   "allowed": int(fraction * total) if fraction is not None else None,
                   "peak_reserved": stats["reserved_bytes.all.peak"],
                   "peak_allocated": stats["allocated_bytes.all.peak"],
                   "num_device_alloc": stats["num_device_alloc"],
                   "num_alloc_retries": stats["num_alloc_retries"], "num_ooms": stats["num_ooms"]}
        figures.update(extra)
    else:
        figures = finish(torch, args.out, args.name, args.conf, fraction, total, extra)
    print("FIGURES " + json.dumps(figures), flush=True)


# ----------------------------------------------------------------------------------- parent

def child(out, scenario, name, conf, cap_bytes, seed=0, steps=12):
    cmd = [sys.executable, os.path.abspath(__file__), out, "--run-one", scenario, "--name", name,
           "--conf", conf, "--cap-bytes", str(cap_bytes), "--seed", str(seed), "--steps", str(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
    for line in p.stdout.splitlines():
        if line.startswith("FIGURES "):
            return json.loads(line[len("FIGURES "):])
    raise RuntimeError(f"run {name} failed (rc {p.returncode}): {p.stderr[-2000:]}")


def brief(f):
    keys = ("name", "conf", "outcome", "allowed", "peak_reserved", "peak_allocated",
            "num_device_alloc", "num_alloc_retries", "num_ooms", "events", "secs")
    return {k: f[k] for k in keys if k in f}


def oracle(out, steps):
    """Find a cap at which the default setting runs out of memory, then run every setting there."""
    free = child(out, "oracle", "oracle-uncapped", "", 0, steps=steps)
    print("oracle uncapped:", json.dumps(brief(free)), flush=True)
    pa, pr = free["peak_allocated"], free["peak_reserved"]
    tried = []
    cap = None
    for k in (0.6, 0.45, 0.3, 0.2, 0.12, 0.06, 0.02):
        c = (pa + int(k * (pr - pa))) // MiB * MiB
        f = child(out, "oracle", "oracle-probe", "", c, steps=steps)
        tried.append({"cap_bytes": c, "outcome": f["outcome"], "num_ooms": f["num_ooms"]})
        print(f"oracle probe cap {c / MiB:.0f} MiB: {f['outcome']}", flush=True)
        if f["outcome"] == "oom":
            cap = c
            break
    runs = []
    if cap is not None:
        for conf in ORACLE_SETTINGS:
            tag = conf.replace(":", "-").replace("_", "-").replace(".", "") or "default"
            f = child(out, "oracle", "oracle-" + tag, conf, cap, steps=steps)
            runs.append(f)
            print("oracle run:", json.dumps(brief(f)), flush=True)
        for suffix in (".pickle.gz", ".json"):     # the probe repeats the default run at this cap
            p = os.path.join(out, "oracle-probe" + suffix)
            if os.path.exists(p):
                os.remove(p)
    result = {"uncapped": free, "probes": tried, "cap_bytes": cap, "runs": runs,
              "settings": list(ORACLE_SETTINGS), "steps": steps}
    with open(os.path.join(out, "oracle.json"), "w") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    for suffix in (".pickle.gz", ".json"):
        p = os.path.join(out, "oracle-uncapped" + suffix)
        if os.path.exists(p):
            os.remove(p)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for the traces and their figures")
    p.add_argument("--only", nargs="+", choices=SCENARIOS + ("oracle",), default=None)
    p.add_argument("--steps", type=int, default=12, help="oracle training steps (default 12)")
    p.add_argument("--run-one", dest="scenario", default=None, help=argparse.SUPPRESS)
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--conf", default="", help=argparse.SUPPRESS)
    p.add_argument("--cap-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--keep-completed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    if args.scenario:
        return run_one(args)
    for name in (args.only or SCENARIOS + ("oracle",)):
        if name == "oracle":
            oracle(args.out, args.steps)
            continue
        conf, cap = SCENARIO_SETUP[name]
        f = child(args.out, name, name, conf, cap)
        print("scenario:", json.dumps(brief(f)), flush=True)


if __name__ == "__main__":
    main()
