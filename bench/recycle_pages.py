"""Peak reserved / peak requested under recycle_pages, against PyTorch's settings (issue 30).

Replays the traces in tests/data (each workload's run under the default setting) and a mixed
trace made here (mixed_trace: 200,000 operations on one stream, sizes 256 B to 64 MiB skewed
small as exp(log 256 + u^2 (log 64 MiB - log 256)), u uniform in [0, 1), a free of a random live
block with probability 0.45, at most 2,000 live blocks) on the simulated device, fresh placement,
under PyTorch's four settings of the recorded runs, pyalloc's expandable segments with
recycle_pages, and prints a Markdown table: peak reserved / peak requested for each, the
live-page bound (the most 2 MiB pages that live blocks touched at once, in recycle_pages' layout,
over peak requested) and recycle_pages' page-table calls per 1,000 allocations (maps: vm_map and
vm_map_handles calls; unmaps: vm_unmap and vm_unmap_keep calls; pyalloc expandable's in
brackets).

    python bench/recycle_pages.py              # the table of docs/recycle_pages.md
    python bench/recycle_pages.py --choices    # its table of unmap times
    python bench/recycle_pages.py --ops 20000  # a shorter mixed trace
"""
from __future__ import annotations

import argparse
import gzip
import math
import pickle
import random
from pathlib import Path

from pyalloc.replay import replay

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
MiB = 1 << 20
PAGE = 2 * MiB
PYTORCH_SETTINGS = (("default", ""), ("split128", "max_split_size_mb:128"),
                    ("pow2div4", "roundup_power2_divisions:4"),
                    ("expandable", "expandable_segments:True"))
POLICY = "expandable_segments:True,recycle_pages:True"


def mixed_trace(ops: int = 200_000, seed: int = 0, max_live: int = 2000, p_free: float = 0.45) -> dict:
    """A snapshot dict (PyTorch's format) of the issue's mixed trace, one stream; each allocation
    has an address of its own in the trace (the replay places blocks itself)."""
    rng = random.Random(seed)
    lo, hi = math.log(256), math.log(64 * MiB)
    entries, live = [], []
    base = 0x7F0000000000
    for i in range(ops):
        if live and (len(live) >= max_live or rng.random() < p_free):
            addr, size = live.pop(rng.randrange(len(live)))
            entries.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0})
            entries.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0})
        else:
            size = int(math.exp(lo + rng.random() ** 2 * (hi - lo)))
            addr = base + i * 64 * MiB
            live.append((addr, size))
            entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0})
    return {"segments": [], "device_traces": [entries],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def live_page_peak(snapshot: dict) -> int:
    """The most 2 MiB pages touched at once by live blocks (requests rounded up to 512 bytes) in
    a replay's own memory history."""
    touching: dict[int, int] = {}
    live: dict[int, int] = {}
    peak = 0
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            end = e["addr"] + max(512, -(-e["size"] // 512) * 512)
            live[e["addr"]] = end
            for page in range(e["addr"] // PAGE, (end - 1) // PAGE + 1):
                touching[page] = touching.get(page, 0) + 1
            peak = max(peak, len(touching))
        elif e["action"] == "free_completed" and e["addr"] in live:
            end = live.pop(e["addr"])
            for page in range(e["addr"] // PAGE, (end - 1) // PAGE + 1):
                touching[page] -= 1
                if not touching[page]:
                    del touching[page]
    return peak * PAGE


def measure(trace, config: str, history: bool = False):
    """(ReplayResult, maps, unmaps) of a fresh-placement replay under `config`."""
    calls = {}

    def finish(alloc):
        calls.update(alloc.backend.counters)

    result = replay(trace, config=config, placement="fresh", on_finish=finish, history=history)
    maps = calls["vm_map"] + calls["vm_map_handles"]
    unmaps = calls["vm_unmap"] + calls["vm_unmap_keep"]
    return result, maps, unmaps


def drive(trace, config: str, release_every: int | None) -> tuple[float, float, float]:
    """The unmap-time alternatives to recycle_pages' lazy unmap, emulated on one stream: the
    trace's allocations and frees run through an allocator under `config` (recycle_pages: 2 MiB
    pages) that calls empty_cache() after every `release_every`-th free (1: at every free), so
    that the whole free pages are unmapped then and every growth maps pages anew. Returns (peak
    reserved / peak requested, maps, unmaps per 1,000 allocations)."""
    from pyalloc import CachingAllocator, SimDevice
    sim = SimDevice(80 << 30)
    alloc = CachingAllocator(backend=sim, config=config)
    live, frees, allocations = {}, 0, 0
    for e in trace["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = alloc.malloc(e["size"])
            allocations += 1
        elif e["action"] == "free_completed" and e["addr"] in live:
            alloc.free(live.pop(e["addr"]))
            frees += 1
            if frees % release_every == 0:
                alloc.empty_cache()
    stats = alloc.memory_stats()
    c = sim.counters
    return (stats["reserved_bytes.all.peak"] / stats["requested_bytes.all.peak"],
            1000 * (c["vm_map"] + c["vm_map_handles"]) / allocations,
            1000 * (c["vm_unmap"] + c["vm_unmap_keep"]) / allocations)


def choices_row(name: str, trace) -> str:
    cells = [name]
    for every in (1, 100):
        ratio, maps, unmaps = drive(trace, POLICY, every)
        cells += [f"{ratio:.3f}", f"{maps:.1f} / {unmaps:.1f}"]
    result, maps, unmaps = measure(trace, POLICY)
    cells += [f"{result.peak_reserved / result.peak_requested:.3f}",
              f"{1000 * maps / result.allocations:.1f} / {1000 * unmaps / result.allocations:.1f}"]
    return "| " + " | ".join(cells) + " |"


def row(name: str, trace) -> str:
    cells = [name]
    requested = None
    for _, config in PYTORCH_SETTINGS:
        result, maps, unmaps = measure(trace, config)
        requested = result.peak_requested
        cells.append(f"{result.peak_reserved / requested:.3f}")
        if config == "expandable_segments:True":
            plain = (1000 * maps / result.allocations, 1000 * unmaps / result.allocations)
    result, maps, unmaps = measure(trace, POLICY, history=True)
    assert result.peak_requested == requested
    cells.append(f"**{result.peak_reserved / requested:.3f}**")
    cells.append(f"{live_page_peak(result.snapshot) / requested:.3f}")
    cells.append(f"{1000 * maps / result.allocations:.1f} ({plain[0]:.1f})")
    cells.append(f"{1000 * unmaps / result.allocations:.1f} ({plain[1]:.1f})")
    cells.append(f"{result.allocations:,}")
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000, help="operations of the mixed trace")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the mixed trace")
    parser.add_argument("--choices", action="store_true",
                        help="the table of unmap times instead (at every free, every 100th free, lazily)")
    args = parser.parse_args(argv)
    traces = [(stem, pickle.load(gzip.open(DATA / f"{stem}-default.pickle.gz")))
              for stem in ("gpt2_train", "resnet_train")]
    traces.append((f"mixed ({args.ops:,} ops)", mixed_trace(args.ops, args.seed)))
    if args.choices:
        print("| trace | at free: reserved/requested | maps / unmaps per 1,000 allocs "
              "| every 100th free | maps / unmaps | lazily (recycle_pages) | maps / unmaps |")
        print("|---|---|---|---|---|---|---|")
        for name, trace in traces:
            print(choices_row(name, trace), flush=True)
        return
    print("| trace | default | split128 | pow2div4 | expandable | recycle_pages | live-page bound "
          "| maps / 1,000 allocs | unmaps / 1,000 allocs | allocations |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, trace in traces:
        print(row(name, trace), flush=True)


if __name__ == "__main__":
    main()
