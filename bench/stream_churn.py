"""Stream churn on the simulated device: a program that makes a stream, allocates on it, frees,
and drops the stream (CuPy destroys a stream when its object dies), N times.

    python bench/stream_churn.py [--streams 8000]

Prints the time per stream, how many stream objects are still alive at the end (the allocator
keeps an allocation stream's object while blocks of it may be cached, and lets go of one the
program dropped once its work is done), and the memory the allocator reserves then (blocks
cached for a stream whose object is kept cannot serve the next stream, which gets another
handle). Run it with PYTHONPATH set to two builds to compare them.
"""
import argparse
import time

import pyalloc
from pyalloc import CachingAllocator, SimDevice

MiB = 1 << 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8000)
    args = parser.parse_args(argv)
    alive = [0]

    class Stream:                      # destroys its stream when it dies, as cupy.cuda.Stream
        def __init__(self, sim):
            self.sim, self.ptr = sim, sim.create_stream()
            alive[0] += 1

        def __del__(self):
            self.sim.destroy_stream(self.ptr)
            alive[0] -= 1

    sim = SimDevice(1 << 36)
    alloc = CachingAllocator(backend=sim, config="")
    start = time.perf_counter()
    for _ in range(args.streams):
        s = Stream(sim)
        p = alloc.malloc(4096, s)
        sim.launch(s.ptr)              # work using the block, then the free, stream-ordered
        alloc.free(p)
        sim.complete(s.ptr)
        del s
    elapsed = time.perf_counter() - start
    print(f"pyalloc {pyalloc.__file__}: {args.streams} streams, "
          f"{elapsed / args.streams * 1e6:.1f} us per stream, {alive[0]} stream objects alive "
          f"at the end, {alloc.memory_reserved() / MiB:.0f} MiB reserved")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
