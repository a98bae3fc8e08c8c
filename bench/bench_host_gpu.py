"""Pinned host memory on the GPU: pyalloc's HostAllocator against CuPy's PinnedMemoryPool and
torch.empty(pin_memory=True), interleaved. Self-contained (runs from an installed wheel).

1. Cache-hit pair: allocate + free of a 4 KiB, 1 MiB and 64 MiB pinned block, each allocator warm
   (the block is cached), every round timing each case once in a rotating order; the figure is
   the median over rounds, and each ratio the median of per-round ratios pyalloc / other.
2. Cold 1 GiB: a new allocator per round per setting (cuMemHostAlloc; register with 1, 4 and 16
   threads), one allocation of 1 GiB timed, then freed and the cache emptied.
3. Settings (--settings-rounds > 0): per pinned_* setting, the 4 KiB cache-hit pair (interleaved
   like 1.) and the first 64 allocations of 1 MiB of a new allocator (cold: the reserve segment
   carves them out of one allocation made at the first; the others allocate each).

    python bench/bench_host_gpu.py [--rounds 51] [--cold-rounds 5] [--settings-rounds 15]
"""
import argparse
import statistics
import time

import pyalloc
from pyalloc import cuda_backend
from pyalloc.host import HostAllocator

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def loops(sizes):
    out = {}
    dev = cuda_backend.open_device(0)
    h = HostAllocator(dev, config="")
    for n in sizes:
        h.free(h.malloc(n))

        def ours(k, n=n, malloc=h.malloc, free=h.free):
            for _ in range(k):
                free(malloc(n))
        out[f"pyalloc {n // KiB} KiB"] = ours
    try:
        import cupy
        pool = cupy.cuda.PinnedMemoryPool()
        for n in sizes:
            pool.malloc(n)

            def cupys(k, n=n, malloc=pool.malloc):
                for _ in range(k):
                    m = malloc(n)
                    del m
            out[f"cupy {n // KiB} KiB"] = cupys
    except ImportError:
        pass
    try:
        import torch
        torch.empty(1, pin_memory=True)
        for n in sizes:
            torch.empty(n, dtype=torch.uint8, pin_memory=True)

            def torchs(k, n=n, empty=torch.empty, u8=torch.uint8):
                for _ in range(k):
                    t = empty(n, dtype=u8, pin_memory=True)
                    del t
            out[f"torch {n // KiB} KiB"] = torchs
    except ImportError:
        pass
    return out


def interleaved(cases, rounds, iterations):
    names = list(cases)
    samples = {k: [] for k in names}
    for k in names:
        cases[k](iterations)
    for r in range(rounds):
        shift = r % len(names)
        for k in names[shift:] + names[:shift]:
            t0 = time.perf_counter_ns()
            cases[k](iterations)
            samples[k].append((time.perf_counter_ns() - t0) / iterations)
    return samples


def cold(rounds):
    settings = {"cuMemHostAlloc": "",
                **{f"register, {t} threads": f"pinned_use_cuda_host_register:True,"
                                             f"pinned_num_register_threads:{t}" for t in (1, 4, 16)}}
    dev = cuda_backend.open_device(0)
    samples = {k: [] for k in settings}
    for r in range(rounds):
        names = list(settings)
        shift = r % len(names)
        for k in names[shift:] + names[:shift]:
            h = HostAllocator(dev, config=settings[k])
            t0 = time.perf_counter_ns()
            p = h.malloc(GiB)
            samples[k].append((time.perf_counter_ns() - t0) / 1e6)
            h.free(p)
            h.close()
    return samples


SETTINGS = {"default (cuMemHostAlloc)": "",
            "pinned_reserve_segment_size_mb:256": "pinned_reserve_segment_size_mb:256",
            "pinned_use_background_threads:True": "pinned_use_background_threads:True",
            "pinned_use_cuda_host_register:True": "pinned_use_cuda_host_register:True"}


def settings_rows(rounds, iterations):
    """What each pinned setting costs: its 4 KiB hit pair and its first 64 x 1 MiB (cold)."""
    dev = cuda_backend.open_device(0)
    hosts = {k: HostAllocator(dev, config=c) for k, c in SETTINGS.items()}
    cases = {}
    for k, h in hosts.items():
        h.free(h.malloc(4 * KiB))

        def pair(n, malloc=h.malloc, free=h.free):
            for _ in range(n):
                free(malloc(4 * KiB))
        cases[k] = pair
    hit = interleaved(cases, rounds, iterations)
    for h in hosts.values():
        h.close()
    first = {k: [] for k in SETTINGS}
    names = list(SETTINGS)
    for r in range(rounds):
        shift = r % len(names)
        for k in names[shift:] + names[:shift]:
            h = HostAllocator(dev, config=SETTINGS[k])
            t0 = time.perf_counter_ns()
            ptrs = [h.malloc(MiB) for _ in range(64)]
            first[k].append((time.perf_counter_ns() - t0) / 1e6)
            for p in ptrs:
                h.free(p)
            h.close()
    return hit, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=51)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--cold-rounds", type=int, default=5)
    ap.add_argument("--settings-rounds", type=int, default=0)
    args = ap.parse_args()
    sizes = [4 * KiB, MiB, 64 * MiB]
    samples = interleaved(loops(sizes), args.rounds, args.iterations)
    print(f"cache-hit pair, ns per allocate+free (median of {args.rounds} rounds x "
          f"{args.iterations} pairs)")
    for k, v in samples.items():
        print(f"  {k:<22}{statistics.median(v):>10.1f}")
    for other in ("cupy", "torch"):
        for n in sizes:
            a, b = f"pyalloc {n // KiB} KiB", f"{other} {n // KiB} KiB"
            if b in samples:
                r = statistics.median(x / y for x, y in zip(samples[a], samples[b]))
                print(f"  pyalloc / {other} at {n // KiB} KiB: {r:.3f}")
    print(f"cold 1 GiB allocation, ms (median of {args.cold_rounds} rounds)")
    for k, v in cold(args.cold_rounds).items():
        print(f"  {k:<22}{statistics.median(v):>10.1f}  (min {min(v):.1f}, max {max(v):.1f})")
    if args.settings_rounds:
        hit, first = settings_rows(args.settings_rounds, args.iterations)
        print(f"settings (median of {args.settings_rounds} rounds): 4 KiB hit pair ns, "
              f"first 64 x 1 MiB of a new allocator ms")
        for k in SETTINGS:
            print(f"  {k:<38}{statistics.median(hit[k]):>10.1f}{statistics.median(first[k]):>10.2f}")


if __name__ == "__main__":
    main()
