"""pyalloc.cuda_core's resource without a GPU: its own code per allocate + deallocate, against a
trivial Python resource (malloc, the same stand-in Buffer, free), interleaved, on the simulated
device.

    python bench/cuda_core_resource_cpu.py [--pairs 20000] [--rounds 15]

A stand-in replaces cuda.core's Buffer.from_handle (which needs a CUDA context); each deallocate
gets a new stream object for the Buffer's stream, as cuda.core 1.2 passes one. On the GPU,
bench/bench_hooks.py measures the real Buffers against DeviceMemoryResource.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    import pyalloc
    from pyalloc import defaults
    try:
        import pyalloc.cuda_core as pcc
        pcc.PyallocMemoryResource
    except ImportError as exc:
        print(f"cuda_core_resource_cpu: {exc}; nothing measured")
        return 0
    pyalloc.set_default_backend(lambda d: pyalloc.SimDevice(1 << 30, device=d))
    alloc = defaults.get_allocator(0)

    class Stream:                     # what cuda.core's Stream answers
        def __init__(self, handle):
            self.handle = handle

        def __cuda_stream__(self):
            return (0, self.handle)

    class Resource(pcc.PyallocMemoryResource):
        def _allocator(self):
            return defaults.get_allocator(self._device_id)

        @staticmethod
        def _from_handle(ptr, size, mr=None, stream=None):
            return ptr

    class Trivial:
        def allocate(self, size, stream=None):
            return alloc.malloc(size, handle)

        def deallocate(self, ptr, size, stream=None):
            alloc.free(ptr)

    handle = alloc.backend.create_stream()
    stream = Stream(handle)
    nbytes = 1 << 20

    def loop(resource):
        allocate, deallocate = resource.allocate, resource.deallocate
        start = time.perf_counter_ns()
        for _ in range(args.pairs):
            deallocate(allocate(nbytes, stream=stream), nbytes, stream=Stream(handle))
        return (time.perf_counter_ns() - start) / args.pairs

    cases = {"pyalloc resource": Resource(0), "trivial Python resource": Trivial()}
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, resource in cases.items():
            times[name].append(loop(resource))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(", ".join(f"{name} {ns:.0f} ns" for name, ns in med.items())
          + f" per allocate+deallocate (median of {args.rounds}); the resource's own code: "
          f"{med['pyalloc resource'] - med['trivial Python resource']:.0f} ns")
    pyalloc.set_default_backend(None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
