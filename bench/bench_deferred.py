"""Cost of blocks deferred in one capture (graph_capture_record_stream_reuse), as their number grows.

    python bench/bench_deferred.py                 N = 1,000 / 10,000 / 100,000 deferred blocks
    python bench/bench_deferred.py --sizes 1000 20000 --pairs 200

For each N, on a fresh SimDevice and CachingAllocator with graph_capture_record_stream_reuse:True,
inside one capture on stream s: N blocks of 512 bytes are allocated on s, used by a kernel on a
side stream that joined the capture (record_stream), and freed. Each is deferred with free markers
that s's work does not follow yet, so every later malloc on s in the capture has N candidates.
Then:
  * pair: a malloc + free of 512 bytes on s (no deferred block can serve it), median over
    --pairs pairs, in microseconds;
  * release: s joins the side stream (waits on an event recorded there), and the next malloc on
    s releases all N blocks: that one malloc, in milliseconds, and per released block in ns.
The figure to read is pair(N) / pair(smallest N): flat means the per-malloc cost does not grow
with the number of deferred blocks. Wall times on a shared machine: compare ratios from one run.
"""
import argparse
import statistics
import time

from pyalloc import CachingAllocator, SimDevice

REUSE = "graph_capture_record_stream_reuse:True"


def measure(n, pairs):
    """(median pair seconds, releasing malloc seconds, blocks released) for n deferred blocks."""
    sim = SimDevice()
    alloc = CachingAllocator(backend=sim, config=REUSE)
    s, side = sim.create_stream(), sim.create_stream()
    with alloc.graph(s) as graph:
        sim.launch(s)                                         # s has a terminal node
        sim.wait_event(side, sim.record_event(s))            # side joins the capture
        for _ in range(n):
            p = alloc.malloc(512, s)
            sim.launch(side, uses=(p,))
            alloc.record_stream(p, side)
            alloc.free(p)
        deferred = alloc._capture_stats()["deferred_blocks"]
        assert deferred == n, (deferred, n)
        times = []
        for _ in range(pairs):
            t0 = time.perf_counter()
            alloc.free(alloc.malloc(512, s))
            times.append(time.perf_counter() - t0)
        sim.wait_event(s, sim.record_event(side))             # now s follows every use
        t0 = time.perf_counter()
        q = alloc.malloc(512, s)
        release = time.perf_counter() - t0
        released = n - alloc._capture_stats()["deferred_blocks"]
        alloc.free(q)
    alloc._check_invariants()
    graph.reset()
    return statistics.median(times), release, released


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000],
                    help="numbers of deferred blocks (default 1000 10000 100000)")
    ap.add_argument("--pairs", type=int, default=100, help="timed pairs per size (default 100)")
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        pair, release, released = measure(n, args.pairs)
        rows.append((n, pair, release, released))
    base = rows[0][1]
    print(f"{'deferred':>9} {'pair us':>9} {'x smallest':>10} {'release ms':>11} {'ns/block':>9}")
    for n, pair, release, released in rows:
        print(f"{n:>9,} {pair * 1e6:>9.2f} {pair / base:>10.2f} {release * 1e3:>11.2f} "
              f"{release * 1e9 / max(released, 1):>9.0f}")
        assert released == n, f"the releasing malloc released {released} of {n} blocks"


if __name__ == "__main__":
    main()
