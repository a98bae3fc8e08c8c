"""pyalloc.cuda_core's resource without a GPU: real cuda.core Buffers over the fake driver
(tests/fake_libcuda.c), per allocate + close, interleaved, against a trivial Python resource
(malloc + Buffer.from_handle, free) and a null one (Buffer.from_handle of a fixed address, no
allocator: what cuda.core itself costs a Python resource's Buffer).

    python bench/cuda_core_resource_cpu.py [--buffers 5000] [--rounds 11]

The resource's own code is (pyalloc - trivial); pyalloc's allocator pair is in both. On the GPU,
bench/bench_hooks.py measures the same Buffers against cuda.core's DeviceMemoryResource. Needs a
C compiler (for the fake driver) and cuda-core.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CHILD = r"""
import json, statistics, sys, time
import pyalloc, pyalloc.cuda_core as pcc
from pyalloc import defaults
core = pcc.import_cuda_core()
device = core.Device(0)
device.set_current()
stream = device.create_stream()
handle = int(stream.handle)
alloc = defaults.get_allocator(0)
nbytes = 1 << 20


class Resource(core.MemoryResource):
    is_device_accessible = True
    is_host_accessible = False
    device_id = 0


class Trivial(Resource):
    def allocate(self, size, stream=None):
        return core.Buffer.from_handle(alloc.malloc(size, handle), size, mr=self, stream=stream)

    def deallocate(self, ptr, size, stream=None):
        alloc.free(ptr)


class Null(Resource):
    def allocate(self, size, stream=None):
        return core.Buffer.from_handle(0x1000, size, mr=self, stream=stream)

    def deallocate(self, ptr, size, stream=None):
        pass


def loop(mr, buffers):
    allocate = mr.allocate
    start = time.perf_counter_ns()
    for _ in range(buffers):
        allocate(nbytes, stream=stream).close()
    return (time.perf_counter_ns() - start) / buffers


buffers, rounds = int(sys.argv[1]), int(sys.argv[2])
cases = {"pyalloc": pcc.PyallocMemoryResource(0), "trivial": Trivial(), "null": Null()}
times = {name: [] for name in cases}
for name, mr in cases.items():
    loop(mr, 200)                                   # warm-up
for _ in range(rounds):
    for name, mr in cases.items():
        times[name].append(loop(mr, buffers))
ratios = [p / t for p, t in zip(times["pyalloc"], times["trivial"])]
print(json.dumps({"ns": {k: statistics.median(v) for k, v in times.items()},
                  "pyalloc/trivial": statistics.median(ratios),
                  "cuda_core": getattr(core, "__version__", "?")}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args(argv)
    try:
        import pyalloc.cuda_core as pcc
        pcc.import_cuda_core()
    except ImportError as exc:
        print(f"cuda_core_resource_cpu: {exc}; nothing measured")
        return 1
    from fake_driver import build, child_env
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        if lib is None:
            print("cuda_core_resource_cpu: no C compiler for the fake driver; nothing measured")
            return 1
        env = child_env(lib, 1, 64 << 30)
        env.pop("PYALLOC_CONF", None)
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.buffers), str(args.rounds)],
                             capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    if out.returncode != 0:
        print(f"cuda_core_resource_cpu: the child failed:\n{out.stderr[-3000:]}")
        return 1
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ns = r["ns"]
    print(f"cuda.core {r['cuda_core']} Buffer allocate+close over the fake driver, median of "
          f"{args.rounds} rounds of {args.buffers}: pyalloc {ns['pyalloc']:.0f} ns, trivial "
          f"Python resource {ns['trivial']:.0f}, null resource {ns['null']:.0f}; pyalloc/trivial "
          f"{r['pyalloc/trivial']:.3f}; the resource's own code {ns['pyalloc'] - ns['trivial']:.0f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
