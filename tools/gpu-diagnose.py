"""Quick checks on the GPU machine while debugging (expandable mapping access; CuPy allocator routing)."""
import sys
import numpy as np
import pyalloc
from cuda.bindings import driver as d

MiB = 1 << 20


def ok(x):
    err = x[0] if isinstance(x, tuple) else x
    assert int(err) == 0, x
    return x[1] if isinstance(x, tuple) and len(x) == 2 else x


def roundtrip(a, nbytes, label):
    p = a.malloc(nbytes)
    ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
    r = d.cuMemsetD8(p, 7, nbytes)
    r2 = d.cuCtxSynchronize()
    host = np.empty(16, np.uint8)
    r3 = d.cuMemcpyDtoH(host.ctypes.data, p + nbytes - 16, 16)
    print(label, hex(p), "memset", r, "sync", r2, "copy", r3, host[:4], flush=True)
    return p


mode = sys.argv[1]
if mode == "expandable":
    ok(d.cuInit(0))
    a = pyalloc.CachingAllocator(0, backend="cuda", config="expandable_segments:True")
    a.malloc(4096)
    print("reservations/mapped", a.backend.mapped_bytes, a._segments()[0]["address"] if a._segments() else None)
    roundtrip(a, 30 * MiB, "expandable 30MiB")
elif mode == "plain":
    ok(d.cuInit(0))
    a = pyalloc.CachingAllocator(0, backend="cuda")
    roundtrip(a, 30 * MiB, "plain 30MiB")
elif mode == "cupy":
    import cupy as cp
    import pyalloc.cupy as pc
    from pyalloc import defaults
    pc.install()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.empty(MiB, dtype=cp.uint8)
    print("device id", cp.cuda.device.get_device_id(), "allocators", defaults._allocators,
          "ptr", hex(x.data.ptr), "mem", type(x.data.mem), "owner", getattr(x.data.mem, "owner", None))
    print("get_allocator(0)", pyalloc.get_allocator(0), [a._segments() for a in defaults._allocators.values()][:1])
