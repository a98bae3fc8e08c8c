"""CPU cost of the pinned host allocator's cache-hit pair (HostAllocator.malloc then free of a
4 KiB block) on the simulated device, against a floor measured in the same rounds: two calls of an
empty method of the extension (the device allocator's _noop, bench/bench_core.py's floor). The
loops are timed interleaved (bench/interleave.py); the ratio is the median of per-round ratios.

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
    noop = pyalloc.CachingAllocator(backend=dev, config="")._noop
    malloc, free = h.malloc, h.free
    free(malloc(4096))

    def floor(n):
        for _ in range(n):
            noop()
            noop()

    def pair(n):
        for _ in range(n):
            free(malloc(4096))

    samples = interleaved({"floor (2 empty calls)": floor, "host hit pair 4 KiB": pair})
    results = {k: (min(v), sorted(v)[len(v) // 2]) for k, v in samples.items()}
    print(format_table(results, {"host pair / floor": ratio(samples, "host hit pair 4 KiB",
                                                             "floor (2 empty calls)")}))


if __name__ == "__main__":
    main()
