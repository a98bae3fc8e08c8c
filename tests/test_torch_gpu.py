"""PyTorch on pyalloc, on a GPU: torch tensors allocated through pyalloc.torch.

Each test runs a small program in a fresh interpreter: PyTorch takes its allocator before its
first CUDA allocation, once per process. Skipped without torch, CUDA or a GPU.
"""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))


def run(program, timeout=180):
    """Run `program` (after `import torch, pyalloc, pyalloc.torch as pt`) in a fresh interpreter
    from the tests folder; returns its stdout lines. Fails with its stderr when it fails."""
    code = "import torch, pyalloc, pyalloc.torch as pt\n" + textwrap.dedent(program)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=HERE, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.split("\n")


def test_kernels_write_and_read_pyalloc_memory_through_torch_tensors():
    lines = run("""
        pt.install()
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        y = (x * 2 + 1).sum().item()
        seg = [s for s in pyalloc.get_allocator(0)._segments()
               if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
        print(pt.is_installed(), y == float(2 * ((1 << 20) - 1) * (1 << 20) / 2 + (1 << 20)),
              bool(seg), pyalloc.memory_allocated(0) >= 4 << 20)
    """)
    assert lines[0].split() == ["True", "True", "True", "True"]


def test_out_of_memory_is_torch_out_of_memory_error_and_a_memory_error():
    lines = run("""
        pt.install()
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            print("oom", isinstance(exc, MemoryError), isinstance(exc, pyalloc.OutOfMemoryError),
                  exc.requested == 1 << 50)
        x = torch.ones(1000, device="cuda")          # still usable afterwards
        print("after", x.sum().item())
    """)
    assert lines[0].split() == ["oom", "True", "True", "True"]
    assert lines[1].split() == ["after", "1000.0"]


def test_empty_cache_returns_pyallocs_cached_segments():
    lines = run("""
        pt.install()
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del x
        before = pyalloc.memory_reserved(0)
        torch.cuda.empty_cache()
        print(before >= 64 << 20, pyalloc.memory_reserved(0))
    """)
    assert lines[0].split() == ["True", "0"]


# A stream kept busy until the host says so: it waits (cuStreamWaitValue32) on an int32 in mapped
# pinned memory. A kernel that sleeps does not do: torch.cuda._sleep(4e9 cycles) returned to the
# host only after ~2 s on the H200, with the stream already idle, under PyTorch's own allocator too.
HOLD = """
import ctypes
from cuda.bindings import driver as _d
def _call(f, *args):
    r = f(*args)
    assert int(r[0]) == 0, (f.__name__, r[0])
    return r[1] if len(r) > 1 else None
class Hold:
    def __init__(self):
        self.host = _call(_d.cuMemHostAlloc, 4, _d.CU_MEMHOSTALLOC_DEVICEMAP)
        self.dev = _call(_d.cuMemHostGetDevicePointer, self.host, 0)
        self.flag = ctypes.c_int32.from_address(int(self.host))
        self.flag.value = 0
    def block(self, stream):
        _call(_d.cuStreamWaitValue32, stream.cuda_stream, self.dev, 1,
              int(_d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
    def release(self):
        self.flag.value = 1
"""


def record_stream_program(mark, install=True):
    """x used on a held side stream, marked with `mark`, freed; prints whether the next request
    of its size got x's block while the side stream was still held, then the side's result.

    While the side stream is held, nothing may wait for the device: on the H200 this program hung
    at the side stream's first `x * 2`, under PyTorch's own allocator as well as pyalloc's (a
    kernel's first launch loads its module, and allocations may come from the driver). So the
    multiply runs once before the hold, y is made before it, and a free cached block a little
    larger than x (`spare`) is there for z: z takes x's block if that is free (the best fit),
    else the spare, never the driver. The mark "pass" (no record_stream) is the control: there
    z must get x's block."""
    return HOLD + textwrap.dedent(f"""
        if {install}:
            pt.install()
        side = torch.cuda.Stream()
        x = torch.ones(16 << 20, device="cuda")
        spare = torch.empty((16 << 20) + (512 << 10), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = torch.empty_like(x)
            torch.mul(x, 2, out=y)                     # loads the kernel before the hold
        torch.cuda.synchronize()
        del spare
        hold = Hold()
        side.wait_stream(torch.cuda.current_stream())
        hold.block(side)
        with torch.cuda.stream(side):
            torch.mul(x, 2, out=y)
        {mark}
        ptr = x.data_ptr()
        del x
        z = torch.empty(16 << 20, device="cuda")      # must not get x's block yet
        print("reused", z.data_ptr() == ptr, "busy", not side.query())
        hold.release()
        torch.cuda.synchronize()
        print("sum", y[:4].sum().item())
    """)


def test_without_record_stream_the_freed_block_is_reused_at_once():
    # The control for the two tests below: their program can tell reuse from no reuse.
    lines = run(record_stream_program("pass"), timeout=60)
    assert lines[0].split() == ["reused", "True", "busy", "True"]


def test_record_stream_keeps_memory_until_the_other_stream_is_done():
    lines = run(record_stream_program("pt.record_stream(x, side)"), timeout=60)
    assert lines[0].split() == ["reused", "False", "busy", "True"]
    assert lines[1].split() == ["sum", "8.0"]


def test_tensor_record_stream_reaches_pyalloc():
    lines = run(record_stream_program("x.record_stream(side)"), timeout=60)
    assert lines[0].split() == ["reused", "False", "busy", "True"]
    assert lines[1].split() == ["sum", "8.0"]


def test_mempool_scoped_use_takes_segments_from_pyalloc():
    lines = run("""
        pool = torch.cuda.MemPool(pt.allocator().allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(8 << 20, device="cuda")
        inside = pyalloc.memory_allocated(0)
        y = torch.ones(8 << 20, device="cuda")          # outside: PyTorch's own memory
        print(inside >= 32 << 20, pyalloc.memory_allocated(0) == inside, (x + 1).sum().item(),
              pt.is_installed())
    """)
    assert lines[0].split() == ["True", "True", str(float(3 * (8 << 20) - (8 << 20))), "False"]


def test_install_after_the_first_cuda_allocation_raises_pytorchs_error():
    lines = run("""
        torch.empty(1, device="cuda")
        try:
            pt.install()
        except RuntimeError as exc:
            print("refused", "initialized allocator" in str(exc), pt.is_installed())
    """)
    assert lines[0].split() == ["refused", "True", "False"]


def test_autograd_threads_allocate_through_pyalloc():
    lines = run("""
        pt.install()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
        data = torch.randn(64, 256)
        ref = model(data).sum()
        ref.backward()
        ref_grad = model[0].weight.grad.clone()
        model.zero_grad()
        model.cuda()
        out = model(data.cuda()).sum()
        out.backward()                                  # autograd's device thread allocates
        print(torch.allclose(model[0].weight.grad.cpu(), ref_grad, atol=1e-4),
              pyalloc.memory_stats(0)["allocation.all.allocated"] > 5)
    """)
    assert lines[0].split() == ["True", "True"]


def test_python_threads_allocate_at_once():
    lines = run("""
        import threading
        pt.install()
        errors = []
        def work(i):
            try:
                for n in range(200):
                    t = torch.full((1000 + 37 * i + n,), float(i), device="cuda")
                    assert t.sum().item() == float(i) * t.numel()
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        torch.cuda.synchronize()
        print(errors == [], pyalloc.memory_allocated(0))
    """)
    assert lines[0].split() == ["True", "0"]
