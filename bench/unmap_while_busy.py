"""Does cuMemUnmap wait for work queued on the device? (run on the GPU machine; needs torch for
its sleep kernel)

    python3 bench/unmap_while_busy.py [--pages 10] [--sleep-cycles 200000000]

Maps --pages 2 MiB pages (cuMemCreate handles) into a reservation, then, with the device idle and
with a torch.cuda._sleep kernel of --sleep-cycles queued: unmaps them (cuMemUnmap, keeping the
handles), maps the same handles at another address (cuMemMap + cuMemSetAccess), maps them again
at the first address (a handle mapped twice), unmaps the second mapping. Prints each step in
microseconds and whether the stream was still busy afterwards: a step that waited for the kernel
takes about as long as the kernel ("sleep kernel alone"). recycle_pages relies on the answer
(docs/recycle_pages.md): the unmap does not wait, so the allocator must.
"""
import argparse
import time


def check(result):
    from cuda.bindings import driver
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


def microseconds(step):
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=10, help="2 MiB pages (default 10)")
    parser.add_argument("--sleep-cycles", type=int, default=200_000_000,
                        help="clock cycles of the queued kernel (default 2e8, ~0.1 s on an H200)")
    args = parser.parse_args()
    try:
        import torch
        from cuda.bindings import driver
    except ImportError as exc:
        raise SystemExit(f"unmap_while_busy: needs torch and cuda-bindings: {exc}")
    if not torch.cuda.is_available():
        raise SystemExit("unmap_while_busy: needs an NVIDIA GPU")
    torch.zeros(1, device="cuda")                       # the primary context, current
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = torch.cuda.current_device()
    page = check(driver.cuMemGetAllocationGranularity(
        prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    n = args.pages
    base = int(check(driver.cuMemAddressReserve(2 * n * page, 0, 0, 0)))
    handles = [check(driver.cuMemCreate(page, prop, 0)) for _ in range(n)]
    access = driver.CUmemAccessDesc()
    access.location = prop.location
    access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def map_at(offset):
        for i, handle in enumerate(handles):
            check(driver.cuMemMap(base + offset + i * page, page, 0, handle, 0))
        check(driver.cuMemSetAccess(base + offset, n * page, [access], 1))

    def unmap_at(offset):
        for i in range(n):
            check(driver.cuMemUnmap(base + offset + i * page, page))

    stream = torch.cuda.current_stream().cuda_stream
    map_at(0)
    print(f"{n} pages of {page >> 20} MiB; times in microseconds")
    for label, busy in (("idle", False), ("kernel queued", True)) * 2:
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(args.sleep_cycles)
        unmap = microseconds(lambda: unmap_at(0))
        remap = microseconds(lambda: map_at(n * page))
        twice = microseconds(lambda: map_at(0))
        unmap_second = microseconds(lambda: unmap_at(n * page))
        still_busy = driver.cuStreamQuery(stream)[0] == driver.CUresult.CUDA_ERROR_NOT_READY
        print(f"{label:14s} unmap {unmap:8.0f}  map elsewhere {remap:8.0f}  map at the first "
              f"address too {twice:8.0f}  unmap the second {unmap_second:8.0f}  "
              f"stream busy after: {still_busy}")
    torch.cuda.synchronize()
    unmap_at(0)
    for handle in handles:
        check(driver.cuMemRelease(handle))
    check(driver.cuMemAddressFree(base, 2 * n * page))
    start = time.perf_counter()
    torch.cuda._sleep(args.sleep_cycles)
    torch.cuda.synchronize()
    print(f"sleep kernel alone {(time.perf_counter() - start) * 1e6:8.0f}")


if __name__ == "__main__":
    main()
