"""PyTorch PR #162186's random multi-stream capture benchmark, for pyalloc on the simulated device.

    python bench/bench_capture.py                   the full grid: 2x2x3 programs x 5 settings
    python bench/bench_capture.py --quick           2 small programs, 2 timed runs (a smoke test)
    python bench/bench_capture.py --json out.json   also every figure as JSON

Every program of bench/capture_program.py (streams 2, 4; steps 500, 2000; (alloc, free, join)
probabilities (0.5, 0.4, 0.1), (0.4, 0.4, 0.2), (0.34, 0.33, 0.33)) is captured on a fresh
SimDevice + CachingAllocator through `a.graph(stream 0)`, under five settings:

    off     ""                                           (frees with record_stream wait for the end)
    on      graph_capture_record_stream_reuse:True       (#162186's in-capture reuse)
    on+a    ... + graph_capture_cross_stream_reuse:True  (pyalloc: whole segments change streams)
    on+b    ... + graph_capture_last_use_marks:True      (pyalloc: record_stream(.., last_use=True)
                                                          issued after each tensor's last kernel
                                                          on each stream)
    on+a+b  both

A kernel is `sim.launch(stream, uses=(ptr,))` (a graph node), a join an event recorded on one
stream and waited on by the other (one event per stream, re-recorded).

Figures, per program and setting:
  * peak reserved: the private pool's reserved bytes (a._pool_info(g.pool())["reserved_bytes"])
    after every op, the maximum. The allocator is fresh and the pool its only user, so this is
    also a.max_memory_reserved(); the run asserts both are equal.
  * peak allocated: a.max_memory_allocated() (the pool is the only user). As in PyTorch, a
    block leaves the allocated bytes at its free even when its reuse is deferred, so this is
    about the same under every setting: the settings differ in reserved bytes.
  * V, E: nodes and edges (parent links) of the captured graph (sim.graph_nodes).
  * capture time: wall seconds of the program's loop inside `with a.graph(s0):` (begin and end
    of capture excluded, as in the GPU runners, where ending a capture instantiates the graph),
    median of 5 runs without the per-op tracking; the settings take turns run by run (the order
    rotates).
  * expanded: a._capture_stats()["nodes_expanded"], graph nodes the reuse walk expanded.
  * every run ends with a._check_invariants() (no block handed out twice, statistics agree), and
    the program's digest (sha256 of the op list) is printed; the tracked run re-derives the digest
    from what it executed and checks it equals the program's.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # capture_program, as a script too
import capture_program as cp   # noqa: E402

REUSE = "graph_capture_record_stream_reuse:True"
CROSS = "graph_capture_cross_stream_reuse:True"
MARKS = "graph_capture_last_use_marks:True"

SETTINGS = {                       # name -> (config string, issue last-use marks)
    "off": ("", False),
    "on": (REUSE, False),
    "on+a": (f"{REUSE},{CROSS}", False),
    "on+b": (f"{REUSE},{MARKS}", True),
    "on+a+b": (f"{REUSE},{CROSS},{MARKS}", True),
}

MiB = 1 << 20


class SimRunner(cp.Runner):
    """The program on a SimDevice: tensors are device pointers. sized: remember each pointer's
    size (for the executed-op digest; off in timed runs)."""

    def __init__(self, sim, alloc, nstreams, sized=False):
        self.streams = [sim.create_stream() for _ in range(nstreams)]
        events = {s: sim.create_event() for s in self.streams}
        self.sizes = {}
        self.free = alloc.free
        self.record_stream = alloc.record_stream
        launch, malloc, record = sim.launch, alloc.malloc, alloc.record_stream
        record_event, wait_event = sim.record_event, sim.wait_event
        self.kernel = lambda ptr, s: launch(s, 1, (ptr,))
        self.mark = lambda ptr, s: record(ptr, s, True)
        if sized:
            sizes = self.sizes

            def alloc_sized(nbytes, stream):
                ptr = malloc(nbytes, stream)
                sizes[ptr] = nbytes
                return ptr
            self.alloc = alloc_sized
        else:
            self.alloc = malloc

        def join(dst, src):
            ev = events[src]
            record_event(src, ev)
            wait_event(dst, ev)
        self.join = join

    def nbytes(self, ptr):
        return self.sizes[ptr]


def run_sim(prog, config, marks, track=False):
    """One capture of `prog` on a fresh simulated device. Returns a dict of figures."""
    from pyalloc import CachingAllocator, SimDevice
    sim = SimDevice()
    a = CachingAllocator(backend=sim, config=config)
    r = SimRunner(sim, a, prog.streams, sized=track)
    out = {}
    graph = a.graph(r.streams[0])
    peak = [0]
    pool_info = a._pool_info

    def after_op(i):
        info = pool_info(pool)
        if info is not None and info["reserved_bytes"] > peak[0]:
            peak[0] = info["reserved_bytes"]
    with graph as g:
        pool = g.pool()
        t0 = time.perf_counter()
        digest = cp.execute(prog, r, marks=marks, after_op=after_op if track else None, record=track)
        seconds = time.perf_counter() - t0
    pool_reserved = a._pool_info(g.pool())["reserved_bytes"]
    a._check_invariants()
    nodes = sim.graph_nodes(g.graph)
    out.update(seconds=seconds, final_reserved=pool_reserved,
               max_reserved=a.max_memory_reserved(), peak_allocated=a.max_memory_allocated(),
               nodes_expanded=a._capture_stats()["nodes_expanded"],
               V=len(nodes), E=sum(len(parents) for _, parents, _ in nodes))
    if track:
        out["peak_reserved"] = peak[0]
        out["executed_digest"] = digest
        if peak[0] != out["max_reserved"]:
            raise AssertionError(f"pool peak {peak[0]} != allocator peak {out['max_reserved']}: "
                                 "the pool is not the allocator's only user")
        if digest != prog.digest:
            raise AssertionError(f"executed ops {digest} differ from the program {prog.digest}")
    g.reset()
    a._check_invariants()
    return out


def bench_program(prog, settings, runs):
    """Tracked run per setting, then `runs` timed runs with the settings taking turns."""
    res = {}
    for name in settings:
        config, marks = SETTINGS[name]
        res[name] = run_sim(prog, config, marks, track=True)
        res[name]["times"] = []
    names = list(settings)
    for k in range(runs):
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            config, marks = SETTINGS[name]
            r = run_sim(prog, config, marks)
            if r["final_reserved"] != res[name]["peak_reserved"]:
                raise AssertionError(f"{prog.name} {name}: reserved {r['final_reserved']} differs "
                                     f"between runs ({res[name]['peak_reserved']})")
            res[name]["times"].append(r["seconds"])
    for name in names:
        t = res[name]["times"]
        res[name]["capture_s"] = statistics.median(t) if t else res[name]["seconds"]
    return res


def reduction(x, base):
    return 1.0 - x / base if base else 0.0


def summarize(prog, res):
    off, on = res["off"]["peak_reserved"], res["on"]["peak_reserved"]
    row = dict(config=prog.key, name=prog.name, digest=prog.digest, streams=prog.streams,
               steps=prog.steps, probs=list(prog.probs), counts=prog.counts,
               V=res["off"]["V"], E=res["off"]["E"], settings={})
    for name, r in res.items():
        row["settings"][name] = dict(
            config=SETTINGS[name][0], peak_reserved=r["peak_reserved"],
            peak_allocated=r["peak_allocated"], capture_s=r["capture_s"], times_s=r["times"],
            nodes_expanded=r["nodes_expanded"], V=r["V"], E=r["E"],
            reduction_vs_off=reduction(r["peak_reserved"], off),
            reduction_vs_on=reduction(r["peak_reserved"], on))
    if "on" in res and "off" in res:
        row["capture_ratio_on_off"] = res["on"]["capture_s"] / res["off"]["capture_s"]
    return row


def mib(n):
    return f"{n / MiB:.0f}"


def pct(x):
    return f"{100 * x:.0f}%"


def print_tables(rows, settings, file=sys.stdout):
    def p(*a):
        print(*a, file=file)
    w = max(len(r["name"]) for r in rows)
    p("Programs and capture time (ms: median of the timed runs; ratio on/off; expanded: nodes "
      "the reuse walk expanded, setting on)")
    p(f"{'config':<{w}} {'digest':<16} {'alloc':>5} {'free':>5} {'join':>5} {'V':>5} {'E':>5} "
      f"{'ms off':>7} {'ms on':>7} {'on/off':>6} {'expand':>6}")
    for r in rows:
        c, s = r["counts"], r["settings"]
        p(f"{r['name']:<{w}} {r['digest']} {c['allocs']:5} {c['frees']:5} {c['joins']:5} "
          f"{r['V']:5} {r['E']:5} {1e3 * s['off']['capture_s']:7.2f} "
          f"{1e3 * s['on']['capture_s']:7.2f} {r['capture_ratio_on_off']:6.2f} "
          f"{s['on']['nodes_expanded']:6}")
    p()
    head = " ".join(f"{n:>6}" for n in settings)
    p(f"Private-pool peak reserved MiB, then peak allocated MiB, per setting")
    p(f"{'config':<{w}} {head}  | {head}")
    for r in rows:
        s = r["settings"]
        res = " ".join(f"{mib(s[n]['peak_reserved']):>6}" for n in settings)
        al = " ".join(f"{mib(s[n]['peak_allocated']):>6}" for n in settings)
        p(f"{r['name']:<{w}} {res}  | {al}")
    p()
    opts = [n for n in settings if n != "off"]
    extra = [n for n in opts if n != "on"]
    p("Peak reserved reduction: vs off (each option), then vs on (the pyalloc options)")
    p(f"{'config':<{w}} " + " ".join(f"{n:>6}" for n in opts) + "  | "
      + " ".join(f"{n:>6}" for n in extra))
    for r in rows:
        s = r["settings"]
        p(f"{r['name']:<{w}} " + " ".join(f"{pct(s[n]['reduction_vs_off']):>6}" for n in opts)
          + "  | " + " ".join(f"{pct(s[n]['reduction_vs_on']):>6}" for n in extra))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=cp.SEED)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per program and setting (5)")
    ap.add_argument("--quick", action="store_true",
                    help="two programs (S2 and S4, 500 steps, the first probabilities), 2 runs")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH ('-': stdout)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.quick:
        progs = cp.grid(args.seed, steps=(500,), probs=cp.PROBS[:1])
        runs = min(args.runs, 2)
    else:
        progs = cp.grid(args.seed)
        runs = args.runs
    settings = list(SETTINGS)
    rows = []
    for prog in progs:
        cp.check(prog)
        rows.append(summarize(prog, bench_program(prog, settings, runs)))
    elapsed = time.perf_counter() - t0
    out = sys.stderr if args.json == "-" else sys.stdout
    print_tables(rows, settings, file=out)
    import pyalloc
    print(f"\n{len(progs)} programs x {len(settings)} settings, {runs} timed runs each, seed "
          f"{args.seed}; invariants checked after every run; {elapsed:.1f} s "
          f"(pyalloc {pyalloc.__version__}, Python {sys.version.split()[0]})", file=out)
    if args.json:
        doc = dict(benchmark="capture_record_stream_reuse", device="sim", seed=args.seed,
                   runs=runs, settings={n: SETTINGS[n][0] for n in settings},
                   peak_reserved_source="per-op max of _pool_info(pool)['reserved_bytes'] "
                                        "(== max_memory_reserved(), checked)",
                   elapsed_s=elapsed, rows=rows)
        if args.json == "-":
            json.dump(doc, sys.stdout, indent=1)
        else:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
