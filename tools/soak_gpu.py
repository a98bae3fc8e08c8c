#!/usr/bin/env python3
"""GPU soak test of pyalloc under CuPy: threads, streams, record_stream, stream churn, expandable
segments off and on, and a data-integrity check of every block before it is freed.

    python3 tools/soak_gpu.py [--seconds 300] [--threads 4] [--streams 3] [--json out.json]

Each thread allocates CuPy arrays (uint32, sizes log-uniform from 256 bytes to --max-mib MiB) on
one of its streams, and a kernel fills each with a pattern of its own (a seed and the index).
Arrays are retired in random order: a kernel checks the pattern, on the allocation stream or, a
third of the time, on another stream that waits for it (then pyalloc.record_stream names that
stream), and the array is dropped right away, without waiting. Mismatches are counted on the GPU
(atomicAdd), so any block handed out again before the work of every stream that used it is over
shows up as corruption: the next owner's fill overwrites what a pending check still reads. Now and
then a thread replaces one of its streams (the old one dies with work queued on it, and the driver
may hand its handle to the new one).

The run is split in two phases of equal length, expandable_segments False then True. After each,
everything is freed, the device synchronized, and pyalloc.empty_cache() run; device memory in use
(cudaMemGetInfo) must be back at its level before the phase (within --leak-mib, default 16: the
CUDA context may grow by itself).

With --control-seconds, the same load then runs on CuPy's own memory pool (pyalloc uninstalled;
the cross-stream checks make the allocation stream wait instead of record_stream), and its device
memory growth is reported beside pyalloc's: growth that shows there too is not pyalloc's.

Prints one line per phase and a JSON summary last (allocations/s, corruption count, device memory
before and after, expandable segments seen). Exit status 0 when there was no corruption, no leak
and no error; 1 otherwise; 2 when CuPy or a GPU is missing.
"""
import argparse
import gc
import json
import math
import random
import sys
import threading
import time

MiB = 1 << 20

KERNELS = r"""
extern "C" __global__
void pyalloc_soak_fill(unsigned int* p, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x)
        p[i] = seed ^ (unsigned int)(i * 2654435761ull);
}

extern "C" __global__
void pyalloc_soak_check(const unsigned int* p, unsigned long long n, unsigned int seed,
                        unsigned long long* bad) {
    unsigned long long mine = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x)
        if (p[i] != (seed ^ (unsigned int)(i * 2654435761ull)))
            mine++;
    if (mine)
        atomicAdd(bad, mine);
}
"""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="total run time (default 300)")
    p.add_argument("--threads", type=int, default=4, help="worker threads (default 4)")
    p.add_argument("--streams", type=int, default=3, help="streams per thread (default 3)")
    p.add_argument("--max-mib", type=float, default=32.0, help="largest array in MiB (default 32)")
    p.add_argument("--window", type=int, default=24, help="live arrays per thread at most (default 24)")
    p.add_argument("--churn", type=int, default=300,
                   help="replace one stream of a thread every N allocations (0: never; default 300)")
    p.add_argument("--leak-mib", type=float, default=16.0,
                   help="device memory growth over a phase taken as a leak, MiB (default 16)")
    p.add_argument("--control-seconds", type=float, default=0.0,
                   help="after the pyalloc phases, run the same load this long on CuPy's own "
                        "memory pool (pyalloc uninstalled) and report its device memory growth "
                        "too: growth there is not pyalloc's (default 0: no control phase)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write the summary to this file")
    args = p.parse_args(argv)
    args.control = False
    if args.seconds <= 0 or args.threads < 1 or args.streams < 1 or args.window < 1 or args.max_mib <= 0:
        p.error("--seconds, --max-mib must be > 0 and --threads, --streams, --window >= 1")
    return args


class Worker(threading.Thread):
    def __init__(self, index, args, cp, np, fill, check, stop, deadline):
        super().__init__(name=f"soak-{index}", daemon=True)
        self.index, self.args, self.cp, self.np = index, args, cp, np
        self.fill, self.check = fill, check
        self.stop, self.deadline = stop, deadline
        self.rng = random.Random(args.seed * 1000 + index)
        self.allocations = 0
        self.cross_stream = 0
        self.streams_replaced = 0
        self.error = None
        self.bad = None
        self.record_stream = None          # control phase: CuPy's pool has no record_stream
        if not args.control:
            import pyalloc
            self.record_stream = pyalloc.record_stream

    def launch(self, kernel, n, *args):
        blocks = int(min(1024, max(1, (n + 255) // 256)))
        kernel((blocks,), (256,), args)

    def run(self):
        cp, np = self.cp, self.np
        try:
            cp.cuda.Device(0).use()
            self.bad = cp.zeros(1, dtype=cp.uint64)
            cp.cuda.Device(0).synchronize()
            streams = [cp.cuda.Stream(non_blocking=True) for _ in range(self.args.streams)]
            live = []
            lo, hi = math.log(64), math.log(self.args.max_mib * MiB / 4)
            seed = self.index << 24
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                stream = self.rng.choice(streams)
                n = int(math.exp(self.rng.uniform(lo, hi)))
                seed = (seed + 1) & 0xFFFFFFFF
                with stream:
                    arr = cp.empty(n, dtype=cp.uint32)
                    self.launch(self.fill, n, arr, np.uint64(n), np.uint32(seed))
                self.allocations += 1
                live.append((arr, n, seed, stream))
                del arr
                while len(live) > self.args.window or (live and self.rng.random() < 0.45):
                    self.retire(live.pop(self.rng.randrange(len(live))), streams)
                if self.args.churn and self.allocations % self.args.churn == 0:
                    # The old stream dies with work queued (unless an array still names it).
                    streams[self.rng.randrange(len(streams))] = cp.cuda.Stream(non_blocking=True)
                    self.streams_replaced += 1
            while live:
                self.retire(live.pop(), streams)
        except BaseException as exc:   # reported by the main thread, which fails the run
            self.error = f"{type(exc).__name__}: {exc}"
            self.stop.set()

    def retire(self, entry, streams):
        """Check an array's pattern on its stream or another one, then drop it without waiting."""
        cp, np = self.cp, self.np
        arr, n, seed, alloc_stream = entry
        others = [s for s in streams if s is not alloc_stream]
        if others and self.rng.random() < 0.33:
            user = self.rng.choice(others)
            user.wait_event(alloc_stream.record())
            with user:
                self.launch(self.check, n, arr, np.uint64(n), np.uint32(seed), self.bad)
            if self.record_stream is not None:
                self.record_stream(arr, user)
            else:       # the allocation stream waits for the check instead
                alloc_stream.wait_event(user.record())
            self.cross_stream += 1
        else:
            with alloc_stream:
                self.launch(self.check, n, arr, np.uint64(n), np.uint32(seed), self.bad)
        del arr, entry


def device_used(cp):
    free, total = cp.cuda.runtime.memGetInfo()
    return total - free


def run_workers(args, cp, np, fill, check, seconds, sample=None):
    """Run --threads workers for `seconds` (calling sample() about 20 times meanwhile); returns
    (elapsed s, arrays allocated, corruption count, error lines) once the device is idle."""
    stop = threading.Event()
    start = time.monotonic()
    workers = [Worker(i, args, cp, np, fill, check, stop, start + seconds) for i in range(args.threads)]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        time.sleep(min(1.0, max(0.05, seconds / 20)))
        if sample is not None:
            sample()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - start
    cp.cuda.Device(0).synchronize()
    corruption = sum(int(w.bad.get()[0]) for w in workers if w.bad is not None)
    allocations = sum(w.allocations for w in workers)
    errors = [f"{w.name}: {w.error}" for w in workers if w.error]
    for w in workers:
        w.bad = None              # the workers' device arrays go before the memory is measured
    return elapsed, allocations, corruption, errors


def run_phase(args, cp, np, fill, check, expandable, seconds):
    import pyalloc
    pyalloc.set_allocator_settings(f"expandable_segments:{expandable}")
    alloc = pyalloc.get_allocator(0)
    cp.cuda.Device(0).synchronize()
    pyalloc.empty_cache()
    used_before = device_used(cp)
    stats_before = alloc.memory_stats()["allocation.all.allocated"]
    seen = [0]

    def sample():       # while the workers run: the phase's setting must show in the segments
        seen[0] = max(seen[0], sum(1 for seg in alloc._segments() if seg.get("is_expandable")))

    elapsed, allocations, corruption, errors = run_workers(args, cp, np, fill, check, seconds, sample)
    expandable_seen = seen[0]
    all_allocations = alloc.memory_stats()["allocation.all.allocated"] - stats_before
    gc.collect()                       # arrays held by reference cycles (e.g. a traceback)
    cp.cuda.Device(0).synchronize()
    alloc.process_events()
    pyalloc.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    used_after = device_used(cp)
    return {
        "expandable_segments": expandable,
        "seconds": round(elapsed, 1),
        "arrays": allocations,
        "arrays_per_s": round(allocations / elapsed, 1),
        "pyalloc_allocations": all_allocations,
        "pyalloc_allocations_per_s": round(all_allocations / elapsed, 1),
        "corruption": corruption,
        "device_used_before_mib": round(used_before / MiB, 1),
        "device_used_after_mib": round(used_after / MiB, 1),
        "leak": used_after - used_before > args.leak_mib * MiB,
        "reserved_after_empty_cache": alloc.memory_reserved(),
        "allocated_after": alloc.memory_allocated(),
        "expandable_segments_seen": expandable_seen,
        "errors": errors,
    }


def run_control_phase(args, cp, np, fill, check, seconds):
    """The same load on CuPy's own pool (pyalloc uninstalled): device memory in use before and
    after, once everything is freed and the pool's blocks are released."""
    args.control = True
    pool = cp.get_default_memory_pool()
    cp.cuda.Device(0).synchronize()
    pool.free_all_blocks()
    used_before = device_used(cp)
    elapsed, allocations, corruption, errors = run_workers(args, cp, np, fill, check, seconds)
    gc.collect()
    cp.cuda.Device(0).synchronize()
    pool.free_all_blocks()
    args.control = False
    return {"seconds": round(elapsed, 1), "arrays": allocations,
            "arrays_per_s": round(allocations / elapsed, 1),
            "corruption_without_record_stream": corruption,
            "device_used_before_mib": round(used_before / MiB, 1),
            "device_used_after_mib": round(device_used(cp) / MiB, 1), "errors": errors}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import cupy as cp
        import numpy as np
    except ImportError as exc:
        print(f"soak_gpu: needs CuPy and NumPy: {exc}", file=sys.stderr)
        return 2
    import pyalloc
    import pyalloc.cupy
    from pyalloc import cuda_backend
    if not cuda_backend.is_available():
        print(f"soak_gpu: needs a GPU: {cuda_backend.unavailable_reason()}", file=sys.stderr)
        return 2
    pyalloc.cupy.install()
    module = cp.RawModule(code=KERNELS)
    fill, check = module.get_function("pyalloc_soak_fill"), module.get_function("pyalloc_soak_check")
    # Compile and load the kernels before the first memory figure.
    probe = cp.empty(256, dtype=cp.uint32)
    bad = cp.zeros(1, dtype=cp.uint64)
    fill((1,), (256,), (probe, np.uint64(256), np.uint32(7)))
    check((1,), (256,), (probe, np.uint64(256), np.uint32(7), bad))
    if int(bad.get()[0]) != 0:
        print("soak_gpu: the check kernel finds its own fill wrong", file=sys.stderr)
        return 1
    del probe, bad
    # A short round first, outside the leak check: in the first H200 soak, device memory in use
    # outside pyalloc grew by 2,182 MiB in the first phase (pyalloc held nothing after
    # empty_cache) and not at all in the second, i.e. once per process, not per allocation.
    warm = run_phase(args, cp, np, fill, check, False, min(20.0, args.seconds / 10))
    print(f"warm-up: device used {warm['device_used_before_mib']} -> {warm['device_used_after_mib']} MiB, "
          f"corruption {warm['corruption']}, errors {len(warm['errors'])}", flush=True)
    phases = []
    for expandable in (False, True):
        phase = run_phase(args, cp, np, fill, check, expandable, args.seconds / 2)
        phases.append(phase)
        print(f"expandable_segments={expandable}: {phase['arrays']} arrays in {phase['seconds']} s "
              f"({phase['arrays_per_s']}/s; {phase['pyalloc_allocations_per_s']} pyalloc allocations/s), "
              f"corruption {phase['corruption']}, device used {phase['device_used_before_mib']} -> "
              f"{phase['device_used_after_mib']} MiB, reserved after empty_cache "
              f"{phase['reserved_after_empty_cache']}, expandable segments seen "
              f"{phase['expandable_segments_seen']}, errors {len(phase['errors'])}", flush=True)
        for err in phase["errors"]:
            print(f"  {err}", flush=True)
    pyalloc.cupy.uninstall()
    control = None
    if args.control_seconds > 0:
        control = run_control_phase(args, cp, np, fill, check, args.control_seconds)
        print(f"control, CuPy's own pool: {control['arrays']} arrays in {control['seconds']} s "
              f"({control['arrays_per_s']}/s), device used {control['device_used_before_mib']} -> "
              f"{control['device_used_after_mib']} MiB after free_all_blocks, errors "
              f"{len(control['errors'])}", flush=True)
    ok = all(p["corruption"] == 0 and not p["leak"] and not p["errors"]
             and p["reserved_after_empty_cache"] == 0 and p["allocated_after"] == 0
             and (p["expandable_segments_seen"] > 0) == p["expandable_segments"] for p in phases)
    ok = ok and warm["corruption"] == 0 and not warm["errors"]
    summary = {"ok": ok, "threads": args.threads, "streams_per_thread": args.streams,
               "warm_up": warm, "phases": phases, "control_cupy_pool": control}
    line = json.dumps(summary)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
