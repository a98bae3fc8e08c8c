"""The fake CUDA driver (tests/fake_libcuda.c) for child processes: build it, and the environment
that makes cuda-bindings load it in place of libcuda (it finds every driver function through
cuGetProcAddress_v2, which the fake exports)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_libcuda.c"


def build(directory):
    """Compile the fake into `directory`/libcuda.so.1; its path, or None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib = Path(directory) / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(SOURCE)],
                   check=True, capture_output=True)
    return lib


def child_env(lib, devices, memory_bytes, **more):
    """The environment of a child process that loads the fake driver `lib`, with `devices` devices
    of `memory_bytes` each, this interpreter's import path, and the variables in `more`."""
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               FAKE_CUDA_DEVICES=str(devices), FAKE_CUDA_MEMORY=str(memory_bytes),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **more)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env
