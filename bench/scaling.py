"""Cost per operation against how much else is alive (issue 29), on the simulated device through
the Python API.

    python bench/scaling.py [--rounds 7] [--only pins,gc,...]

Each row of the table builds two allocators, one with the row's smallest size of what grows and
one with its largest, and times the same operation on both, the two taking turns round by round
(the order alternates); a figure is the median over rounds of the time per operation. Ratio is
largest / smallest: an operation whose cost does not depend on what else is alive shows about 1
(the target is <= 2 for every row, <= 3 for the capture walk's row, whose graph also grows).

Rows (what grows, the operation timed):
  pins      stream objects pinned by record_stream (P), pair malloc+free of 512 B on stream 0
  kept      allocation-stream objects the program holds (S), malloc+free on a new stream object
  events    streams with an incomplete event (S), pair malloc+free of 512 B on stream 0
  events_polled  the same with event_poll_streams:1 (pyalloc only: a cache hit polls one
            stream's events, in turn; a miss polls all)
  gc        cached large blocks under garbage_collection_threshold:0.5 (N), cache-miss malloc
            (+ its free; each miss's GC releases the segment the previous op freed)
  empty     live blocks with one allocation-stream object kept (N), empty_cache()
  uses      streams used by one block (U), record_stream of a stream the block already uses
  routes    thread routes open (R; this thread's the oldest), pair malloc+free of 512 B
  capture   streams in a capture (S; 8,000 steps of bench/capture_program.py's random program,
            graph_capture_record_stream_reuse:True), capture time per step
"""
import argparse
import os
import statistics
import sys
import threading
import time

import pyalloc
from pyalloc import CachingAllocator, SimDevice

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # capture_program, as a script too
import capture_program as cp   # noqa: E402

MiB = 1 << 20


class Stream:
    """A stream object (handle in .ptr), as a framework's stream is."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


def pair_loop(a, stream=0, nbytes=512):
    malloc, free = a.malloc, a.free

    def loop(n):
        for _ in range(n):
            free(malloc(nbytes, stream))
    return loop


# Each setup(size) returns (loop, teardown): loop(n) runs the operation n times.

def setup_pins(p):
    sim = SimDevice(1 << 40)
    a = CachingAllocator(backend=sim, config="")
    ptrs = [a.malloc(512) for _ in range(p)]
    objs = [Stream(sim.create_stream()) for _ in range(p)]
    for ptr, s in zip(ptrs, objs):
        a.record_stream(ptr, s)
    a.free(a.malloc(512))
    return pair_loop(a), (ptrs, objs)


def setup_kept(s):
    sim = SimDevice(1 << 40)
    a = CachingAllocator(backend=sim, config="")
    objs = [Stream(sim.create_stream()) for _ in range(s)]
    ptrs = [a.malloc(512, o) for o in objs]
    fresh = []

    def loop(n):
        new = [Stream(sim.create_stream()) for _ in range(n)]
        fresh.extend(new)              # the program holds them: kept, never reaped
        malloc, free = a.malloc, a.free
        for o in new:
            free(malloc(512, o))
    return loop, (objs, ptrs, fresh)


def setup_events(s, config=""):
    sim = SimDevice(1 << 40)
    a = CachingAllocator(backend=sim, config=config)
    streams = [sim.create_stream() for _ in range(s)]
    for h in streams:
        p = a.malloc(512)
        a.record_stream(p, h)
        sim.launch(h)                  # queued work: the free's event there stays incomplete
        a.free(p)
    a.free(a.malloc(512))
    return pair_loop(a), streams


def setup_events_polled(s):
    return setup_events(s, "event_poll_streams:1")


def setup_gc(n):
    sim = SimDevice(1 << 44)
    a = CachingAllocator(backend=sim, config="garbage_collection_threshold:0.5")
    # n segments of 20 MiB, each split: 8 MiB live, 12 MiB cached (never a GC candidate).
    live = [a.malloc(8 * MiB) for _ in range(n)]
    allowed = int(a.memory_reserved() * 1.5) + 64 * MiB
    a.set_memory_fraction(allowed / sim.total_memory)
    s1, s2 = sim.create_stream(), sim.create_stream()

    def loop(k):
        malloc, free = a.malloc, a.free
        for i in range(k):
            free(malloc(16 * MiB, s1 if i & 1 else s2))
    return loop, live


def setup_empty(n):
    sim = SimDevice(1 << 44)
    a = CachingAllocator(backend=sim, config="")
    obj = Stream(sim.create_stream())
    kept = a.malloc(512, obj)          # keeps obj (a block of its stream is live)
    live = [a.malloc(512) for _ in range(n)]
    return (lambda k: [a.empty_cache() for _ in range(k)]), (obj, kept, live)


def setup_uses(u):
    sim = SimDevice(1 << 40)
    a = CachingAllocator(backend=sim, config="")
    p = a.malloc(512)
    streams = [sim.create_stream() for _ in range(u)]
    for h in streams:
        a.record_stream(p, h)
    last = streams[-1]
    record = a.record_stream

    def loop(k):
        for _ in range(k):
            record(p, last)
    return loop, (p, streams)


def setup_routes(r):
    sim = SimDevice(1 << 40)
    a = CachingAllocator(backend=sim, config="")
    # This thread's route first (the oldest), then r - 1 other threads' routes.
    a.begin_allocate_to_pool((1, 0), ("thread", pyalloc._core.current_thread_key()))
    done = threading.Event()
    opened = threading.Barrier(r)
    threads = []

    def other(i):
        a.begin_allocate_to_pool((i + 2, 0), ("thread", pyalloc._core.current_thread_key()))
        opened.wait()
        done.wait()
    for i in range(r - 1):
        t = threading.Thread(target=other, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    if r > 1:
        opened.wait()
    a.free(a.malloc(512))
    return pair_loop(a), (done, threads)


def setup_capture(s):
    prog = cp.generate(streams=s, steps=8000)
    import bench_capture as bc

    def loop(k):
        for _ in range(k):
            out = bc.run_sim(prog, bc.REUSE, False)
            loop.last = out["seconds"] / 8000 * 1e9   # ns per step
    loop.last = None
    return loop, prog


ROWS = {                 # name -> (setup, smallest, largest, ops per round, what grows, unit)
    "pins": (setup_pins, 0, 10_000, 2000, "stream objects pinned by record_stream", "P"),
    "kept": (setup_kept, 1000, 30_000, 20, "allocation-stream objects kept", "S"),
    "events": (setup_events, 1, 10_000, 2000, "streams with an incomplete event", "S"),
    "events_polled": (setup_events_polled, 1, 10_000, 2000,
                      "streams with an incomplete event, event_poll_streams:1", "S"),
    "gc": (setup_gc, 100, 100_000, 20, "cached large blocks under GC threshold", "N"),
    "empty": (setup_empty, 1000, 1_000_000, 20, "live blocks, one allocation stream kept", "N"),
    "uses": (setup_uses, 1000, 10_000, 2000, "streams used by one block", "U"),
    "routes": (setup_routes, 1, 1000, 2000, "thread routes open (this thread's oldest)", "R"),
    "capture": (setup_capture, 2, 128, 1, "streams in a capture (8,000 steps)", "S"),
}


def measure(name, rounds):
    setup, small, large, ops = ROWS[name][:4]
    loops = {}
    keep = []
    for size in (small, large):
        loop, held = setup(size)
        keep.append(held)
        loop(max(1, ops // 10))        # warm up
        loops[size] = loop
    samples = {small: [], large: []}
    clock = time.perf_counter_ns
    for r in range(rounds):
        for size in ((small, large) if r % 2 == 0 else (large, small)):
            t0 = clock()
            loops[size](ops)
            ns = (clock() - t0) / ops
            if name == "capture":
                ns = loops[size].last   # the loop inside the capture, per step
            samples[size].append(ns)
    if name == "routes":
        for held in keep:
            held[0].set()
    return statistics.median(samples[small]), statistics.median(samples[large])


def fmt(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.0f} ns"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default=",".join(ROWS), help="comma-separated rows")
    args = parser.parse_args(argv)
    names = args.only.split(",")
    for name in names:
        if name not in ROWS:
            parser.error(f"unknown row {name!r}, expected one of {', '.join(ROWS)}")
    print(f"pyalloc {pyalloc.__file__}, median of {args.rounds} interleaved rounds")
    print(f"| row | what grows | smallest | largest | per op at smallest | per op at largest | ratio |")
    print(f"|---|---|---|---|---|---|---|")
    for name in names:
        small_ns, large_ns = measure(name, args.rounds)
        _, small, large, _, what, unit = ROWS[name]
        print(f"| {name} | {what} | {unit} = {small:,} | {unit} = {large:,} | {fmt(small_ns)} | "
              f"{fmt(large_ns)} | {large_ns / small_ns:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
