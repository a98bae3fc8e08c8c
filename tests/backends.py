"""The conformance suite's backends: the policy specifications (tests/test_core.py) run on
SimDevice everywhere and on the real GPU (CudaDevice) where one is present, as RMM runs one suite
over every memory resource.

On the GPU, CudaTestDevice gives the tests SimDevice's test API (create_stream, destroy_stream,
launch, complete, pending, synchronize, record_event, wait_event, the capture queries, segments)
over real streams: launch(stream, n) queues n units of work, each a cuStreamWaitValue32 on a flag
in host-mapped memory, so the work stays pending until complete() (or the watchdog, see below)
writes the flag. What the allocator does with pending work (events, reuse) is then what it does on
a real device. While the stream captures, launch adds a real node to the captured graph instead:
a one-byte cuMemsetD8Async on each block it uses (on a scratch word when it uses none), as
SimDevice adds one kernel node that uses those blocks.

The watchdog: SimDevice completes the awaited work when the allocator synchronizes an event or the
device (it has no clock); a real GPU would wait forever for a flag only the blocked test thread
could write. So when work is pending and the test has not called this device for WATCHDOG_S
seconds (the test thread is blocked in a synchronizing driver call), a watchdog thread writes
every flag, as if the work had finished; `watchdog_releases` counts how often.
"""
import ctypes
import os
import threading
import time

import pytest

from pyalloc import CachingAllocator, SimDevice
from units import MiB, GiB

WATCHDOG_S = 1.0


def cuda_unavailable_reason():
    """None when the CUDA backend can run here, else why not."""
    try:
        from pyalloc import cuda_backend
    except ImportError as exc:        # pragma: no cover - pyalloc itself always imports
        return str(exc)
    if not cuda_backend.is_available():
        return f"needs an NVIDIA GPU: {cuda_backend.unavailable_reason()}"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError as exc:
        return f"needs cuda-bindings' driver module: {exc}"
    return None


# ------------------------------------------------------------------------------- the harness
#
# A test file runs through it by importing `backend` (an autouse fixture: every test once on
# SimDevice, [sim], and once on the GPU, [cuda], skipped with the reason where there is none),
# `make` (the test's device and allocator) and `sim_only` (the mark of a test that needs what only
# SimDevice has, with the reason): `from backends import backend, make, sim_only`.

DEFAULT_SIM_MEMORY = 80 * GiB
_backend = "sim"          # the running test's backend (the `backend` fixture sets it)
_made = []                # the GPU devices the running test made, emptied and closed after it


def sim_only(reason):
    """Mark a test that runs on SimDevice only; `reason` names what only the simulator has."""
    def mark(test):
        test.sim_only = reason
        return test
    return mark


# PYALLOC_TEST_BACKENDS (default "sim,cuda") picks the backends; the fake-driver conformance run
# (test_conformance_fake_driver.py) asks for "cuda" alone: the [sim] cases run in the main suite.
BACKENDS = os.environ.get("PYALLOC_TEST_BACKENDS", "sim,cuda").split(",")
if not BACKENDS or not set(BACKENDS) <= {"sim", "cuda"}:
    raise ValueError(f"PYALLOC_TEST_BACKENDS must name sim and/or cuda, comma-separated, "
                     f"got {os.environ.get('PYALLOC_TEST_BACKENDS')!r}")


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request):
    """Every test once per backend: SimDevice, and the GPU where there is one."""
    global _backend
    if request.param == "cuda":
        reason = getattr(request.function, "sim_only", None)
        if reason is not None:
            pytest.skip(f"SimDevice only: {reason}")
        reason = cuda_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
    _backend = request.param
    try:
        yield request.param
    finally:
        _backend = "sim"
        made = list(_made)
        _made.clear()
        leftover = [dev.close() for dev in made]
    assert not any(leftover), f"the GPU allocators still reserved {leftover} bytes after the test"


def make(config="", total_memory=DEFAULT_SIM_MEMORY):
    """A device and a CachingAllocator on it with an explicit config (no environment): a SimDevice
    of `total_memory` bytes, or on the [cuda] run the GPU (tests/backends.py's CudaTestDevice)."""
    if _backend == "sim":
        sim = SimDevice(total_memory)
        return sim, CachingAllocator(backend=sim, config=config)
    assert total_memory == DEFAULT_SIM_MEMORY, "a test that needs a device of its own size is @sim_only"
    alloc = CachingAllocator(backend="cuda", config=config)
    dev = CudaTestDevice(alloc.backend)
    dev.alloc = alloc
    _made.append(dev)
    return dev, alloc


def _check(result, call):
    """cuda.bindings.driver returns (CUresult, values...): the values, or RuntimeError."""
    from cuda.bindings import driver
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed: {err!r}")
    rest = result[1:]
    return rest[0] if len(rest) == 1 else rest


class _StreamWork:
    """One stream's queued units: its flag in host-mapped memory and an event after each unit."""

    def __init__(self, handle):
        from cuda.bindings import driver
        self.handle = handle
        self.host = _check(driver.cuMemHostAlloc(4, driver.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")
        self.flag = ctypes.c_uint32.from_address(int(self.host))
        self.flag.value = 0
        self.device_ptr = _check(driver.cuMemHostGetDevicePointer(self.host, 0),
                                 "cuMemHostGetDevicePointer")
        self.launched = 0
        self.events = []              # events[i] is recorded after unit i + 1 (its wait)
        self.before = []              # before[i] just before unit i + 1: after what came earlier

    def close(self):
        from cuda.bindings import driver
        self.flag.value = self.launched      # the wait is a cyclic >=: never a huge value
        for ev in self.events + self.before:
            _check(driver.cuEventSynchronize(ev), "cuEventSynchronize")
            _check(driver.cuEventDestroy(ev), "cuEventDestroy")
        self.events, self.before = [], []
        _check(driver.cuMemFreeHost(self.host), "cuMemFreeHost")


class CudaTestDevice:
    """SimDevice's test API (create_stream, destroy_stream, is_destroyed, launch, complete,
    pending, synchronize, record_event, wait_event, stream_capture_info, node_parents,
    mapped_memory, reservations, segments) over a CudaDevice; see the module doc. `backend` is
    the CudaDevice, `alloc` (set by the suite) the allocator whose segments segments() reports."""

    watchdog_s = WATCHDOG_S      # seconds without a call before the watchdog completes all work

    def __init__(self, backend):
        from cuda.bindings import driver
        self.backend = backend
        self.alloc = None
        self._dev = _check(driver.cuDeviceGet(backend.device), "cuDeviceGet")
        self._ctx = _check(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._work = {}               # stream handle -> _StreamWork
        self._dead = []               # the _StreamWork of destroyed streams, closed by close()
        self._streams = []            # streams made by create_stream, destroyed by close()
        self._destroyed = set()       # handles destroyed and not handed out again
        self._events = []             # events made by record_event, destroyed by close()
        self._closed = False
        # The word a captured launch that uses no block writes (cuMemAlloc is refused during a
        # global-mode capture, so it is made now); device memory, as a memset node needs.
        self._scratch = _check(driver.cuMemAlloc(4), "cuMemAlloc")
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self.watchdog_releases = 0
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="cuda-test-device-watchdog",
                                          daemon=True)
        self._watchdog.start()

    # ---------------------------------------------------------------- the watchdog

    def _touch(self):
        self._last_call = time.monotonic()

    def _watch(self):
        while not self._closing.wait(0.05):
            if time.monotonic() - self._last_call < self.watchdog_s:
                continue
            with self._lock:
                released = False
                for work in list(self._work.values()) + self._dead:
                    if work.flag.value < work.launched:
                        work.flag.value = work.launched
                        released = True
                if released:
                    self.watchdog_releases += 1

    # ---------------------------------------------------------------- SimDevice's test API

    def create_stream(self):
        """A new non-blocking stream's handle (an int)."""
        from cuda.bindings import driver
        self._touch()
        stream = _check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
                        "cuStreamCreate")
        self._streams.append(stream)
        self._destroyed.discard(int(stream))     # the driver may hand a destroyed handle out again
        return int(stream)

    def destroy_stream(self, stream):
        """cuStreamDestroy on a stream made by create_stream: returns at once, and the work queued
        on it still runs (its flag is written by complete-all, synchronize or the watchdog, as
        for a live stream). A handle this device did not make, or destroyed already (also by
        close(), when a stream object outlives the test), is a ValueError: the driver's answer
        to a dead handle is undefined, not an error."""
        from cuda.bindings import driver
        self._touch()
        live = [s for s in self._streams if int(s) == stream]
        if not live:
            if self._closed:
                return          # close() destroyed it: the object that owned it died later
            raise ValueError(f"stream {stream:#x} was not made by this CudaTestDevice or was destroyed")
        with self._lock:
            work = self._work.pop(stream, None)
            if work is not None:
                self._dead.append(work)          # its units still run: kept for their flag
        self._streams.remove(live[0])
        _check(driver.cuStreamDestroy(live[0]), "cuStreamDestroy")
        self._destroyed.add(stream)

    def is_destroyed(self, stream):
        """True when `stream` was destroyed and its handle not handed out again."""
        return stream in self._destroyed

    def _work_of(self, stream):
        work = self._work.get(stream)
        if work is None:
            work = self._work[stream] = _StreamWork(stream)
        return work

    def launch(self, stream=0, count=1, uses=()):
        """Queue `count` units of work on `stream`; returns the stream's queued total.

        While `stream` captures, queues nothing: adds one node after the stream's terminals per
        block in `uses` (an address, or (address, nbytes)), a cuMemsetD8Async of its first byte,
        or one on a scratch word when `uses` is empty, and returns the handle of the last one
        (the stream's terminal now, which depends on the others). `count` is then not used: a
        memset node is one unit of work when the graph is launched."""
        from cuda.bindings import driver
        self._touch()
        if self.backend.stream_capture_info(stream) is not None:
            return self._launch_captured(stream, uses)
        with self._lock:
            work = self._work_of(stream)
            for _ in range(count):
                work.before.append(self._record(stream))
                work.launched += 1
                _check(driver.cuStreamWaitValue32(driver.CUstream(stream), work.device_ptr,
                                                  work.launched,
                                                  driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                       "cuStreamWaitValue32")
                work.events.append(self._record(stream))
            return work.launched

    def _launch_captured(self, stream, uses):
        from cuda.bindings import driver
        targets = [use[0] if isinstance(use, tuple) else use for use in uses] or [int(self._scratch)]
        for address in targets:
            _check(driver.cuMemsetD8Async(driver.CUdeviceptr(address), 0, 1, driver.CUstream(stream)),
                   "cuMemsetD8Async")
        _, terminals = self.backend.stream_capture_info(stream)
        assert len(terminals) == 1, f"a captured memset left {len(terminals)} terminals on {stream:#x}"
        return terminals[0]

    @staticmethod
    def _record(stream):
        from cuda.bindings import driver
        ev = _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        _check(driver.cuEventRecord(ev, driver.CUstream(stream)), "cuEventRecord")
        return ev

    def _completed(self, work):
        from cuda.bindings import driver
        done = 0
        for ev in work.events:
            err = driver.cuEventQuery(ev)[0]
            if err == driver.CUresult.CUDA_ERROR_NOT_READY:
                break
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuEventQuery failed: {err!r}")
            done += 1
        return done

    def pending(self, stream=0):
        """Units of work queued on `stream` and not completed."""
        self._touch()
        work = self._work.get(stream)
        return 0 if work is None else work.launched - self._completed(work)

    def complete(self, stream=0, count=None):
        """Finish queued work on `stream` in order (all of it, or `count` more units) and wait for
        it; returns the number of units completed now."""
        from cuda.bindings import driver
        self._touch()
        work = self._work.get(stream)
        if work is None or work.launched == 0:
            return 0
        before = self._completed(work)
        target = work.launched if count is None else min(before + count, work.launched)
        with self._lock:
            if work.flag.value < target:
                work.flag.value = target
        # Wait for everything queued before the next unit's wait (e.g. the allocator's events
        # recorded after unit `target`), as SimDevice completes it: all of the stream when no
        # wait is left, else up to the event recorded just before unit target + 1.
        if target == work.launched:
            _check(driver.cuStreamSynchronize(driver.CUstream(stream)), "cuStreamSynchronize")
        else:
            _check(driver.cuEventSynchronize(work.before[target]), "cuEventSynchronize")
        self._touch()
        return target - before

    def synchronize(self):
        """Finish all queued work (every flag written) and wait for the device."""
        from cuda.bindings import driver
        self._touch()
        with self._lock:
            for work in list(self._work.values()) + self._dead:
                work.flag.value = max(work.flag.value, work.launched)
        _check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
        self._touch()

    def record_event(self, stream=0):
        """A new event recorded on `stream` now (destroyed by close()); its handle."""
        self._touch()
        event = self.backend.record_event(stream)
        self._events.append(event)
        return event

    def wait_event(self, stream, event):
        """Work queued on `stream` from now on waits for `event` (cuStreamWaitEvent); in a
        capture, a capture event joins `stream` to it or adds its nodes to the stream's terminals."""
        from cuda.bindings import driver
        self._touch()
        _check(driver.cuStreamWaitEvent(driver.CUstream(stream), driver.CUevent(event), 0),
               "cuStreamWaitEvent")

    def stream_capture_info(self, stream):
        """(capture id, [terminal nodes]) while `stream` captures, else None (the driver's)."""
        self._touch()
        return self.backend.stream_capture_info(stream)

    def node_parents(self, node):
        """The nodes a captured node depends on (cuGraphNodeGetDependencies)."""
        self._touch()
        return self.backend.node_parents(node)

    @property
    def mapped_memory(self):
        """Bytes the allocator has mapped through the CudaDevice (expandable segments)."""
        return self.backend.mapped_bytes

    def reservations(self):
        """One entry per address range the CudaDevice reserved and did not free (the driver has
        no query; SimDevice lists the ranges themselves, so tests compare counts or [])."""
        return [("reserved range", i) for i in range(self.backend.live_reservations)]

    def segments(self):
        """(address, bytes) of the allocator's live device segments, by address; checked against
        the CudaDevice's own count and bytes of segments it holds from the driver."""
        segs = sorted((s["address"], s["total_size"]) for s in self.alloc._segments()
                      if not s["is_expandable"])
        assert len(segs) == self.backend.live_segments, (segs, self.backend.live_segments)
        assert sum(n for _, n in segs) == self.backend.live_bytes
        return segs

    # ---------------------------------------------------------------- teardown

    def close(self):
        """Release all work, free what the allocator still holds, destroy streams and flags.
        Returns the allocator's reserved bytes after emptying its cache (0 when nothing leaked)."""
        from cuda.bindings import driver
        self._touch()
        self.synchronize()
        leftover = 0
        if self.alloc is not None:
            for seg in self.alloc._segments():
                for blk in seg["blocks"]:
                    if blk["allocated"]:
                        self.alloc.free(blk["address"])
            self.alloc.process_events()
            self.alloc.empty_cache()
            leftover = self.alloc.memory_reserved()
        self._closing.set()
        self._watchdog.join()
        for work in list(self._work.values()) + self._dead:
            work.close()
        self._work.clear()
        self._dead.clear()
        for event in self._events:
            self.backend.destroy_event(event)
        self._events.clear()
        for stream in self._streams:
            _check(driver.cuStreamDestroy(stream), "cuStreamDestroy")
        self._streams.clear()
        self._closed = True
        _check(driver.cuMemFree(self._scratch), "cuMemFree")
        _check(driver.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
        return leftover


class CudaPropertyDevice(CudaTestDevice):
    """The device view the property tests (tests/test_properties.py) read, over a CudaDevice: a
    device of `total` bytes, made by capping the allocator with a memory fraction (the GPU's own
    memory is far larger), with SimDevice's test API and its memory views.

    `cap` is the allocator's allowed maximum in bytes, computed as the allocator computes it from
    the fraction (so that a request that exactly fills the device is judged alike);
    mem_get_info, used_memory and mapped_memory count what the allocator holds from the driver
    (the CudaDevice's own counts); reservations() lists one entry per address range reserved and
    not freed (the CudaDevice counts them: the driver has no query); is_mapped asks the driver
    for the physical allocation behind every 2 MiB of a range."""

    # A state machine step blocks in a synchronizing call more often than a policy test does
    # (every out-of-memory flush waits for pending events): release sooner.
    watchdog_s = 0.25

    def __init__(self, backend):
        super().__init__(backend)
        self.cap = None          # the allocator's cap in bytes (cap_to)
        self.total = None        # bytes of the device this view stands for (the caller sets it)

    def cap_to(self, alloc, total_memory):
        """Cap `alloc` to `total_memory` bytes of this GPU; returns the cap in bytes."""
        _, device_total = self.backend.mem_get_info()
        fraction = total_memory / device_total
        alloc.set_memory_fraction(fraction)
        self.cap = int(fraction * float(device_total))     # the allocator's own arithmetic
        return self.cap

    def mem_get_info(self):
        """(free, total) bytes of the device of `total` bytes this view stands for."""
        return max(0, self.total - self.used_memory), self.total

    @property
    def used_memory(self):
        return self.backend.live_bytes + self.backend.mapped_bytes

    def is_mapped(self, addr, nbytes):
        from cuda.bindings import driver
        page = addr & ~(2 * MiB - 1)
        while page < addr + nbytes:
            err, handle = driver.cuMemRetainAllocationHandle(page)
            if err != driver.CUresult.CUDA_SUCCESS:
                return False
            _check(driver.cuMemRelease(handle), "cuMemRelease")
            page += 2 * MiB
        return True
