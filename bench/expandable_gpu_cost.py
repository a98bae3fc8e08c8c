"""Cost of one expandable-segment map and unmap on the GPU (run on the GPU machine).

    python bench/expandable_gpu_cost.py [--pages 1] [--repeat 200]

A map is a malloc that has to grow the segment (cuMemCreate + cuMemMap + cuMemSetAccess per
20 MiB page, plus the core's bookkeeping); an unmap is empty_cache() after freeing it
(cuStreamSynchronize + cuMemUnmap + cuMemRelease). Then, under recycle_pages, an unmap + remap:
a malloc on one stream whose growth takes the pages of a free block of another stream (device
synchronize + cuMemUnmap of the free pages, cuMemMap + cuMemSetAccess of the same handles, no
cuMemCreate), the two streams taking turns; --pages counts 2 MiB pages there (10 per 20 MiB
page of the first part). Prints medians in microseconds.
"""
import argparse
import statistics
import time

import pyalloc

MiB = 1 << 20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=1, help="20 MiB pages per map")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True")
    keep = a.malloc(4096)                 # keeps the small-pool reservation; irrelevant to timing
    size = args.pages * 20 * MiB
    a.free(a.malloc(size))                # the reservation itself is made once, outside the timing
    a.empty_cache()
    maps, unmaps, hits = [], [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        p = a.malloc(size)                # maps
        t1 = time.perf_counter()
        a.free(p)
        t2 = time.perf_counter()
        a.free(a.malloc(size))            # cache hit: no driver call
        t3 = time.perf_counter()
        a.empty_cache()                   # unmaps
        t4 = time.perf_counter()
        maps.append(t1 - t0)
        hits.append(t3 - t2)
        unmaps.append(t4 - t3)
    a.free(keep)
    stats = a.memory_stats()
    print(f"pages per map: {args.pages} x 20 MiB, repeats: {args.repeat}, "
          f"num_device_alloc {stats['num_device_alloc']}, num_device_free {stats['num_device_free']}")
    print(f"map   (malloc that grows the segment): median {statistics.median(maps) * 1e6:8.1f} us")
    print(f"unmap (empty_cache of the free pages): median {statistics.median(unmaps) * 1e6:8.1f} us")
    print(f"cache-hit malloc+free pair, same size:  median {statistics.median(hits) * 1e6:8.1f} us")
    a.empty_cache()
    recycle_cost(args.pages * 10, args.repeat)


def recycle_cost(pages, repeat):
    """recycle_pages: the median time of a malloc whose growth unmaps `pages` 2 MiB pages of a
    free block on another stream and maps them again (printed in microseconds)."""
    import cupy                                   # streams of its own for the two segments
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True,recycle_pages:True")
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    size = pages * 2 * MiB
    # Each stream: a block of `size` bytes (whole pages at the segment's base), then a live 2 MiB
    # guard. Stream 1's block starts unmapped; then the two take turns: one frees its block and
    # the other's malloc maps the freed pages into its own unmapped range.
    blocks = []
    for s in streams:
        blocks.append(a.malloc(size, s.ptr))
        a.malloc(2 * MiB, s.ptr)
    a.free(blocks[1])
    a.empty_cache()
    times = []
    for i in range(repeat):
        a.free(blocks[i % 2])
        t0 = time.perf_counter()
        blocks[1 - i % 2] = a.malloc(size, streams[1 - i % 2].ptr)
        times.append(time.perf_counter() - t0)
    stats = a.memory_stats()
    print(f"unmap + remap ({pages} x 2 MiB pages, recycle_pages): median "
          f"{statistics.median(times) * 1e6:8.1f} us; num_page_remaps {stats['num_page_remaps']}, "
          f"num_device_alloc {stats['num_device_alloc']}")


if __name__ == "__main__":
    main()
