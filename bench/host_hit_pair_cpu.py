"""CPU cost of the pinned host allocator's cache-hit pair (HostAllocator.malloc then free of a
4 KiB block) on the simulated device, against a floor measured in the same rounds: two calls of an
extension method that reads one word (the device allocator's _lock_held, bench/bench_core.py's
floor). The loops are timed interleaved (bench/interleave.py); the ratio is the median of
per-round ratios. Where the build's malloc takes a stream, the pair on a stream that does not
capture (malloc asks the backend whether it does) is timed too.

    python bench/host_hit_pair_cpu.py            (from the repository root, pyalloc installed)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyalloc                                        # noqa: E402
from pyalloc.host import HostAllocator                # noqa: E402
from interleave import format_table, interleaved, ratio   # noqa: E402


def main():
    dev = pyalloc.SimDevice()
    h = HostAllocator(dev, config="")
    noop = pyalloc.CachingAllocator(backend=dev, config="")._lock_held
    malloc, free = h.malloc, h.free
    free(malloc(4096))
    stream = dev.create_stream()

    def floor(n):
        for _ in range(n):
            noop()
            noop()

    def pair(n):
        for _ in range(n):
            free(malloc(4096))

    def pair_on_stream(n):
        for _ in range(n):
            free(malloc(4096, stream))

    loops = {"floor (2 empty calls)": floor, "host hit pair 4 KiB": pair}
    try:
        free(malloc(4096, stream))
        loops["host hit pair 4 KiB, stream given"] = pair_on_stream
    except TypeError:
        pass                # a build whose malloc takes no stream
    samples = interleaved(loops)
    results = {k: (min(v), sorted(v)[len(v) // 2]) for k, v in samples.items()}
    ratios = {f"{k} / floor": ratio(samples, k, "floor (2 empty calls)")
              for k in loops if k.startswith("host")}
    print(format_table(results, ratios))


if __name__ == "__main__":
    main()
