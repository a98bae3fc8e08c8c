"""Finding the GPU: driver detection (once, cached) and opening a CudaDevice backend.

pyalloc._cuda (the only module that loads cuda.bindings) is imported here lazily, on the first
is_available() or open_device() call, so `import pyalloc` stays free of CUDA on every machine.
"""
import threading

from pyalloc.errors import NoCudaDriverError

_lock = threading.Lock()
_probe_result = None        # (device_count, reason) once probed; reason "" when a GPU is there


def _probe():
    try:
        from pyalloc import _cuda
    except ImportError as exc:
        return 0, f"the CUDA backend could not be imported ({type(exc).__name__}: {exc}); is cuda-bindings 13.x installed?"
    return _cuda.probe()


def _result():
    global _probe_result
    result = _probe_result
    if result is None:
        with _lock:
            if _probe_result is None:
                _probe_result = _probe()
            result = _probe_result
    return result


def is_available():
    """True when a CUDA driver and at least one GPU are usable. Probed once, then cached.

    No driver library, cuInit failing (e.g. CUDA_ERROR_NO_DEVICE when CUDA_VISIBLE_DEVICES hides
    every GPU) or zero devices all give False; unavailable_reason() says which.
    """
    return _result()[0] > 0


def unavailable_reason():
    """Why the CUDA backend is unavailable ("" when it is available)."""
    return _result()[1]


def device_count():
    """Number of visible GPUs (0 when the CUDA backend is unavailable)."""
    return _result()[0]


def open_device(device=0):
    """A CudaDevice backend for GPU `device` (an int ordinal).

    Raises NoCudaDriverError (with the reason) when no driver or GPU is available, ValueError for
    an ordinal outside [0, device_count()), TypeError for a non-int.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int ordinal, got {type(device).__name__} {device!r}")
    count, reason = _result()
    if count == 0:
        raise NoCudaDriverError(
            f"backend 'cuda' was asked for device {device}, but CUDA is not available: {reason}. "
            "Use backend='sim' for the simulated device, or backend=None to pick automatically.")
    if not 0 <= device < count:
        raise ValueError(f"device must be a CUDA ordinal in [0, {count}) ({count} GPUs visible), got {device}")
    from pyalloc._cuda import CudaDevice
    return CudaDevice(device)


def current_device():
    """Ordinal of the device whose context is current on this thread (0 when none is, or no GPU).

    This is what CuPy and PyTorch call the current device: both make the device's primary context
    current when a device is selected.
    """
    if _result()[0] == 0:
        return 0
    from pyalloc import _cuda
    d = _cuda.current_device()
    return d if d >= 0 else 0
