"""One process, four frameworks, one allocator: run by tests/test_frameworks_gpu.py in a fresh
interpreter (each framework picks its allocator once per process, so the hooks must be installed
before anything touches the GPU), it prints one JSON object {check name: "ok" | "skip: why" |
"error text"} on its last line of stdout.

Numba (pyalloc.numba), CuPy (pyalloc.cupy), PyTorch (pyalloc.torch, where this build has it) and
cuda.core (pyalloc.cuda_core) all allocate from pyalloc's default allocator of device 0; arrays
cross between them by __cuda_array_interface__ and DLPack, and each block must stay allocated
while any holder remains and be free once the last one is gone.
"""
import gc
import json
import sys
import traceback

import numpy as np

import pyalloc
import pyalloc.cuda_core
import pyalloc.cupy
import pyalloc.numba
from gpu_helpers import let_numba_cuda_compile_with_this_numpy

results = {}
N = 1 << 18                      # elements per array (1 MiB of float32)


def check(name, needs=()):
    """Run fn as check `name`, recording "ok", the error, or why it was skipped."""
    def run(fn):
        missing = [what for what, have in needs if not have]
        if missing:
            results[name] = "skip: " + ", ".join(missing)
            return fn
        try:
            fn()
            results[name] = "ok"
        except BaseException as exc:       # noqa: BLE001 - reported to the test, which fails on it
            results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        gc.collect()
        return fn
    return run


# --- the hooks, before any framework touches the GPU ----------------------------------------
pyalloc.numba.install()
try:
    import pyalloc.torch as pyalloc_torch
except ImportError:
    pyalloc_torch = None
TORCH_HOOK = pyalloc_torch is not None and hasattr(pyalloc_torch, "install")
if TORCH_HOOK:
    pyalloc_torch.install()
pyalloc.cupy.install()

import cupy                      # noqa: E402
import torch                     # noqa: E402
from numba import cuda           # noqa: E402

core = pyalloc.cuda_core.import_cuda_core()
device = core.Device(0)
device.set_current()
core_stream = device.create_stream()
mr = pyalloc.cuda_core.PyallocMemoryResource(0)
alloc = pyalloc.get_allocator(0)
torch_hook = ("pyalloc.torch with install() (not in this build)", TORCH_HOOK)


def live(ptr):
    """Whether `ptr` lies in a block that pyalloc's allocator has handed out and not taken back."""
    for seg in alloc._segments():
        for blk in seg["blocks"]:
            if blk["allocated"] and blk["address"] <= ptr < blk["address"] + blk["size"]:
                return True
    return False


def expect(condition, what):
    if not condition:
        raise AssertionError(what)


def double_in_place(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = 2 * x[i]


let_numba_cuda_compile_with_this_numpy()
try:
    double_in_place = cuda.jit("void(float32[:])")(double_in_place)    # compiled now
    numba_kernels = ("Numba kernels", True)
except Exception as exc:         # noqa: BLE001 - reported as the reason of the checks that need it
    numba_kernels = (f"Numba kernels (cannot compile here: {type(exc).__name__}: {exc})", False)


base_count = alloc.memory_stats()["allocation.all.current"]
base_bytes = alloc.memory_allocated()
base_requested = alloc.memory_stats()["requested_bytes.all.current"]


@check("numba_allocates_from_pyalloc")
def _():
    d = cuda.device_array(N, dtype=np.float32)
    expect(live(d.__cuda_array_interface__["data"][0]), "Numba's array is not a pyalloc block")


@check("cupy_allocates_from_pyalloc")
def _():
    c = cupy.empty(N, dtype=cupy.float32)
    expect(live(c.data.ptr), "CuPy's array is not a pyalloc block")


@check("cuda_core_allocates_from_pyalloc")
def _():
    b = mr.allocate(4 * N, stream=core_stream)
    expect(live(int(b.handle)), "cuda.core's Buffer is not a pyalloc block")
    b.close()


@check("torch_allocates_from_pyalloc", needs=[torch_hook])
def _():
    t = torch.empty(N, dtype=torch.float32, device="cuda")
    expect(live(t.data_ptr()), "PyTorch's tensor is not a pyalloc block")


@check("memory_stats_counts_every_framework")
def _():
    held = [cuda.device_array(N, dtype=np.float32), cupy.empty(N, dtype=cupy.float32),
            mr.allocate(4 * N, stream=core_stream)]
    if TORCH_HOOK:
        held.append(torch.empty(N, dtype=torch.float32, device="cuda"))
    stats = pyalloc.memory_stats(0)
    expect(stats["allocation.all.current"] == base_count + len(held),
           f"{stats['allocation.all.current']} live allocations, expected {base_count} + {len(held)}")
    expect(stats["requested_bytes.all.current"] == base_requested + 4 * N * len(held),
           f"requested bytes {stats['requested_bytes.all.current']} < {len(held)} x {4 * N}")
    del held
    gc.collect()
    expect(pyalloc.memory_stats(0)["allocation.all.current"] == base_count, "not all freed")


@check("numba_array_in_torch_lives_until_torch_drops_it")
def _():
    d = cuda.to_device(np.arange(N, dtype=np.float32))
    ptr = d.__cuda_array_interface__["data"][0]
    t = torch.as_tensor(d, device="cuda")                  # __cuda_array_interface__: no copy
    expect(t.data_ptr() == ptr, "torch copied the Numba array")
    del d
    gc.collect()
    expect(live(ptr), "freed while PyTorch still holds it")
    expect(torch.equal(t.cpu(), torch.arange(N, dtype=torch.float32)), "wrong data in torch")
    del t
    gc.collect()
    expect(not live(ptr), "not freed after the last holder dropped it")


@check("cupy_array_in_numba_lives_until_numba_drops_it")
def _():
    c = cupy.arange(N, dtype=cupy.float32)
    ptr = c.data.ptr
    d = cuda.as_cuda_array(c)
    del c
    gc.collect()
    expect(live(ptr), "freed while Numba still holds it")
    expect(np.array_equal(d.copy_to_host(), np.arange(N, dtype=np.float32)), "wrong data")
    del d
    gc.collect()
    expect(not live(ptr), "not freed after the last holder dropped it")


@check("numba_kernel_computes_on_cupy_memory", needs=[numba_kernels])
def _():
    c = cupy.arange(N, dtype=cupy.float32)
    d = cuda.as_cuda_array(c)
    cupy.cuda.Device().synchronize()
    double_in_place[(N + 255) // 256, 256](d)
    cuda.synchronize()
    expect(cupy.array_equal(c, 2 * cupy.arange(N, dtype=cupy.float32)), "wrong data in CuPy")


@check("torch_tensor_in_cupy_lives_until_cupy_drops_it", needs=[torch_hook])
def _():
    t = torch.arange(N, dtype=torch.float32, device="cuda")
    ptr = t.data_ptr()
    c = cupy.from_dlpack(t)
    del t
    gc.collect()
    expect(live(ptr), "freed while CuPy still holds it")
    expect(int(c[N - 1]) == N - 1, "wrong data in CuPy")
    del c
    gc.collect()
    expect(not live(ptr), "not freed after the last holder dropped it")


@check("cupy_array_in_torch_lives_until_torch_drops_it")
def _():
    c = cupy.arange(N, dtype=cupy.float32)
    ptr = c.data.ptr
    t = torch.from_dlpack(c)
    del c
    gc.collect()
    expect(live(ptr), "freed while PyTorch still holds it")
    expect(float(t[N - 1]) == N - 1, "wrong data in torch")
    del t
    gc.collect()
    expect(not live(ptr), "not freed after the last holder dropped it")


@check("cuda_core_buffer_in_cupy_lives_until_cupy_drops_it")
def _():
    b = mr.allocate(4 * N, stream=core_stream)
    ptr = int(b.handle)
    raw = cupy.from_dlpack(b)                               # cuda.core exports bytes (int8)
    core_stream.sync()
    del b
    gc.collect()
    expect(live(ptr), "freed while CuPy still holds it")
    c = raw.view(cupy.float32)
    c[:] = 3
    expect(float(c.sum()) == 3.0 * N, "wrong data in CuPy")
    del raw, c
    gc.collect()
    expect(not live(ptr), "not freed after the last holder dropped it")


@check("everything_is_freed_at_the_end")
def _():
    cupy.cuda.Device().synchronize()
    gc.collect()
    expect(alloc.memory_allocated() == base_bytes,
           f"{alloc.memory_allocated() - base_bytes} bytes still allocated")


results["_versions"] = {"numba_cuda": getattr(sys.modules.get("numba_cuda"), "__version__", "?"),
                        "cuda_core": getattr(core, "__version__", "?"), "cupy": cupy.__version__,
                        "torch": torch.__version__, "torch_hook": TORCH_HOOK}
print(json.dumps(results))
