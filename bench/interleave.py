"""Ratios of timings that survive a noisy machine: measure the compared loops interleaved.

pytest-benchmark times one benchmark after another, so a ratio of two of its medians also
measures how the machine's speed drifted between them (other tenants, frequency changes); on
the shared machines this project runs on that drift moved pair/floor between 1.1 and 4.1 from
run to run. Here every round times each loop once, back to back, in an order that rotates from
round to round, and a ratio is the median over rounds of the ratio within a round.

A loop is a callable loop(iterations) that runs the measured operation that many times.
"""
import statistics
import time


def interleaved(loops, iterations=2000, rounds=101, warmup=1000):
    """{name: [ns per iteration, one per round]} for the callables in `loops` (name -> loop)."""
    names = list(loops)
    for name in names:
        loops[name](warmup)
    samples = {name: [] for name in names}
    clock = time.perf_counter_ns
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            loop = loops[name]
            t0 = clock()
            loop(iterations)
            samples[name].append((clock() - t0) / iterations)
    return samples


def ratio(samples, numerator, denominator):
    """(median, first quartile, third quartile) of the per-round ratio numerator / denominator."""
    per_round = [a / b for a, b in zip(samples[numerator], samples[denominator])]
    q1, median, q3 = statistics.quantiles(per_round, n=4)
    return median, q1, q3


def format_table(results, ratios, notes=()):
    """The text table the GPU benchmarks print: results {case: (best, median) ns per op}, ratios
    {label: (median, q1, q3)} (from ratio), then the lines of `notes`."""
    case_width = max([len("case")] + [len(name) for name in results]) + 4
    label = "ratio (median of per-round ratios)"
    label_width = max([len(label)] + [len(name) for name in ratios]) + 2
    lines = [f"{'case':<{case_width}}{'best ns/op':>12}{'median ns/op':>14}"]
    for name, (best, median) in results.items():
        lines.append(f"{name:<{case_width}}{best:>12.1f}{median:>14.1f}")
    lines.append("")
    lines.append(f"{label:<{label_width}}{'median':>8}{'q1 - q3':>16}")
    for name, (median, q1, q3) in ratios.items():
        lines.append(f"{name:<{label_width}}{median:>8.3f}{q1:>8.3f} -{q3:>6.3f}")
    lines.extend(notes)
    return "\n".join(lines)


def repeat(fn):
    """loop(iterations) calling fn() that many times: the shape of pytest-benchmark's own loop,
    so a ratio of two such loops is the ratio pytest-benchmark's medians estimate."""
    def loop(iterations):
        for _ in range(iterations):
            fn()
    return loop
