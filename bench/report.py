"""Print the ratios the README quotes from one pytest-benchmark JSON file.

Two kinds: ratios of pytest-benchmark medians (each benchmark run after the other), and the
interleaved ratios the tests store in extra_info (pair_over_floor, cost_over_100_live: the
compared loops timed in alternation, see bench/interleave.py), which machine-speed drift does not move.

Usage: python -m pytest bench/bench_core.py --benchmark-only --benchmark-json=out.json
       python bench/report.py out.json
"""
import json
import sys


def main(path):
    data = json.load(open(path))
    # Several files define their own floors: keep the first of each name (bench_core's when it
    # runs first) rather than letting a later file overwrite it.
    med = {}
    for b in data["benchmarks"]:
        med.setdefault(b["name"], b["stats"]["median"])
    floor = med.get("test_floor")
    floor_sig = med.get("test_floor_signature")
    rows = []
    for name, value in sorted(med.items()):
        row = f"{name:45s} median {value * 1e9:9.1f} ns"
        if floor and name.startswith("test_malloc_free_pair"):
            row += f"   pair/floor {value / floor:5.2f}   pair/floor_signature {value / floor_sig:5.2f}"
        rows.append(row)
    for b in sorted(data["benchmarks"], key=lambda b: b["name"]):
        name = b["name"]
        if b.get("extra_info"):
            info = ", ".join(f"{k}={v:,}" if isinstance(v, int) else
                             f"{k}={v:,.3f}" if isinstance(v, float) and abs(v) < 100 else
                             f"{k}={v:,.0f}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in b["extra_info"].items())
            rows.append(f"{name:45s} {info}")
    off = next((v for k, v in med.items() if "history" in k and k.endswith("[off]")), None)
    if off:
        for name, value in sorted(med.items()):
            if "history" in name and not name.endswith("[off]"):
                rows.append(f"{name:45s} / history off: {value / off:5.2f}")
    base = med.get("test_pair_with_live_blocks[100]")
    if base:
        for live in (10_000, 100_000):
            v = med.get(f"test_pair_with_live_blocks[{live}]")
            if v:
                rows.append(f"cost at {live} live blocks / cost at 100: {v / base:5.2f}")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1])
