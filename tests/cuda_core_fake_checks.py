"""Scenarios for pyalloc.cuda_core with real cuda.core Buffers over tests/fake_libcuda.c; run by
test_cuda_core_fake_driver.py in a child interpreter whose LD_LIBRARY_PATH puts the fake driver
first (usage: `python cuda_core_fake_checks.py /path/to/libcuda.so.1`). Prints one JSON object:
scenario name -> {"value": ...} or {"error": ..., "traceback": ...}.

The fake keeps no memory behind its addresses: these check what the resource hands cuda.core and
what it does with the streams cuda.core hands back, not data.
"""
import ctypes
import gc
import json
import sys
import traceback
import weakref

from units import MiB

fake = ctypes.CDLL(sys.argv[1])
fake.fake_launch.argtypes = [ctypes.c_size_t, ctypes.c_ulonglong]
fake.fake_complete.argtypes = [ctypes.c_size_t]
fake.fake_count.restype = ctypes.c_long
fake.fake_count.argtypes = [ctypes.c_char_p]

import pyalloc                        # noqa: E402  (after the fake is loaded)
import pyalloc.cuda_core as pcc       # noqa: E402

core = pcc.import_cuda_core()
try:
    device = core.Device(0)
    device.set_current()
    device.create_stream().close()
except Exception as exc:              # noqa: BLE001 -- the parent skips, naming it
    if type(exc).__name__ != "FunctionNotFoundError":
        raise
    # This cuda.core calls a driver function the fake does not model: say which, and stop.
    print(json.dumps({"setup": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
alloc = pyalloc.get_allocator(0)
mr = pcc.PyallocMemoryResource(0)
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def buffer_is_a_block_of_the_default_allocator():
    s = device.create_stream()
    buf = mr.allocate(MiB, stream=s)
    seen = [int(buf.handle) in mr._streams, buf.size, alloc.memory_allocated(),
            mr._streams.get(int(buf.handle)) == int(s.handle)]
    buf.close()
    return seen + [alloc.memory_allocated(), mr._streams]


@scenario
def close_on_the_allocation_stream_makes_the_block_reusable_at_once():
    s = device.create_stream()
    buf = mr.allocate(MiB, stream=s)
    address = int(buf.handle)
    fake.fake_launch(int(s.handle), 1)         # work still queued on the allocation stream
    events = fake.fake_count(b"event_record")
    buf.close()                                 # cuda.core passes a new Stream object for s
    again = mr.allocate(MiB, stream=s)
    result = [int(again.handle) == address, fake.fake_count(b"event_record") - events]
    again.close()
    fake.fake_complete(int(s.handle))
    return result


@scenario
def close_on_another_stream_waits_for_that_streams_work():
    s1, s2 = device.create_stream(), device.create_stream()
    buf = mr.allocate(MiB, stream=s1)
    address = int(buf.handle)
    fake.fake_launch(int(s2.handle), 1)        # s2 uses the block when it is freed there
    buf.close(stream=s2)
    busy = mr.allocate(MiB, stream=s1)
    fake.fake_complete(int(s2.handle))
    after = mr.allocate(MiB, stream=s1)
    result = [int(busy.handle) != address, int(after.handle) == address]
    busy.close()
    after.close()
    return result


@scenario
def a_collected_buffer_gives_its_block_back():
    before = alloc.memory_allocated()
    buf = mr.allocate(MiB, stream=device.create_stream())
    during = alloc.memory_allocated() - before
    del buf
    gc.collect()
    return [during, alloc.memory_allocated() - before, mr._streams]


@scenario
def out_of_memory_is_pyalloc_out_of_memory_error_and_changes_nothing():
    before = alloc.memory_allocated()
    try:
        mr.allocate(1 << 40, stream=device.create_stream())
    except pyalloc.OutOfMemoryError as exc:
        return [type(exc).__name__, alloc.memory_allocated() - before, mr._streams]
    return "no error"


@scenario
def a_dropped_stream_is_kept_while_its_work_is_queued_then_let_go():
    s = device.create_stream()
    handle, gone = int(s.handle), weakref.ref(s)
    buf = mr.allocate(MiB, stream=s)
    fake.fake_launch(handle, 1)
    buf.close()
    del s, buf
    mr.allocate(MiB, stream=device.create_stream()).close()     # another stream: the memo moves
    for _ in range(2):                      # the first records the stream's event, the next polls it
        alloc.process_events()
    kept_while_busy = gone() is not None
    fake.fake_complete(handle)
    for _ in range(2):
        alloc.process_events()
    return [kept_while_busy, gone() is None]


def main():
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = {"value": fn()}
        except BaseException as exc:      # noqa: BLE001 -- reported to the parent test
            results[name] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
