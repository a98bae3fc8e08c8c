"""The C entry points' cache-hit pair with cold caches, as PyTorch calls it, for one or more
builds: libpyalloc_torch's pyalloc_torch_malloc + pyalloc_torch_free of 1 MiB, called from C
without the GIL on a simulated device, after evicting caches (bench/cold_entry_pair.c).

Inside torch.empty the pair runs with the caches cold (PyTorch's own work between allocations
evicts pyalloc's code and data): 35 ns for the pair in a hot loop (--hot) on the development
machine against 86 - 106 ns inside PyTorch on the H200. Its cost there follows the cache lines
it touches, which this measures in two ways:

  time (default)  rounds of one child process per build, alternating; each times --pairs pairs,
                  each after reading --pollute-kib of a buffer and running 100 KB of code;
                  reports the median over rounds of each build's cold pair (ns) and of the
                  per-round ratios to the first build.
  --hot           the pair in a tight loop with nothing evicted (--pairs pairs per loop), for
                  comparison.
  --callgrind     deterministic counts per pair from valgrind's cache simulation: instructions,
                  L1 data lines missed (read, write), L1 instruction lines missed, from runs of
                  301 and 1 pairs (difference / 300).

SITE: a folder with an installed pyalloc (pip install --target SITE), or "." for the one this
Python imports. Needs a C compiler, Python's headers and a shared libpython (x86-64 Linux).

Run:  python bench/cold_entry_pair.py [--rounds 8] [--callgrind] SITE [SITE ...]
"""
import argparse
import os
import re
import shutil
import site
import statistics
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def build_harness(tmp):
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise SystemExit("cold_entry_pair: this Python has no shared libpython to embed")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("cold_entry_pair: no C compiler (cc) found")
    libdir = sysconfig.get_config_var("LIBDIR")
    exe = os.path.join(tmp, "cold_entry_pair")
    cmd = [cc, "-O2", "-o", exe, os.path.join(HERE, "cold_entry_pair.c"),
           "-I" + sysconfig.get_paths()["include"], "-L" + libdir,
           "-lpython" + sysconfig.get_config_var("LDVERSION"), "-ldl", "-Wl,-rpath," + libdir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cold_entry_pair: building the harness failed:\n{done.stderr[-2000:]}")
    return exe


def child_env(site_dir):
    env = dict(os.environ, PYTHONHASHSEED="0")
    if site_dir == ".":
        # The current interpreter's packages, .pth files included (an editable install).
        env["PYALLOC_SITEDIRS"] = os.pathsep.join(site.getsitepackages())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    else:
        # The build first, then this interpreter's path without its .pth hooks, which would put
        # an editable pyalloc ahead of the build.
        env.pop("PYALLOC_SITEDIRS", None)
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(site_dir)] + [p for p in sys.path if p])
    return env


def pair_ns(exe, site_dir, pairs, pollute_kib):
    """One child's figure: the cold pair (ns), or the hot pair when pollute_kib < 0."""
    done = subprocess.run([exe, str(pairs), str(pollute_kib)], capture_output=True, text=True,
                          env=child_env(site_dir))
    match = re.search(r"(?:cold|hot) pair: ([\d.]+) ns", done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"cold_entry_pair: the harness failed for {site_dir}:\n"
                         f"{done.stdout[-1000:]}{done.stderr[-2000:]}")
    return float(match.group(1))


EVENTS = ("Ir", "D1mr", "D1mw", "I1mr")


def callgrind_counts(exe, site_dir, pairs, pollute_kib, tmp):
    """Ir, D1mr, D1mw, I1mr summed over the two entry points (inclusive), for `pairs` pairs."""
    out_file = os.path.join(tmp, f"cg.{pairs}")
    done = subprocess.run(["valgrind", "--tool=callgrind", "--cache-sim=yes",
                           f"--callgrind-out-file={out_file}", exe, str(pairs), str(pollute_kib)],
                          capture_output=True, text=True, env=child_env(site_dir))
    if done.returncode != 0:
        raise SystemExit(f"cold_entry_pair: valgrind failed for {site_dir}:\n{done.stderr[-2000:]}")
    report = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100",
                             "--show=" + ",".join(EVENTS), out_file],
                            capture_output=True, text=True, check=True).stdout
    totals = [0] * len(EVENTS)
    for line in report.splitlines():
        if re.search(r"pyalloc_torch_(malloc|free) \[", line):
            values = re.findall(r"([\d,]+|\.)(?: \(\s*[\d.]+%\))?\s", line)[:len(EVENTS)]
            for k, v in enumerate(values):
                totals[k] += 0 if v == "." else int(v.replace(",", ""))
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sites", nargs="+", metavar="SITE")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=2000, help="timed pairs per child")
    parser.add_argument("--pollute-kib", type=int, default=4096,
                        help="data read before each pair (KiB; 4096 evicts L2 on most CPUs)")
    parser.add_argument("--hot", action="store_true",
                        help="time the pair in a tight loop, nothing evicted")
    parser.add_argument("--callgrind", action="store_true",
                        help="count instructions and cache lines per pair instead of timing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_harness(tmp)
        if args.callgrind:
            if shutil.which("valgrind") is None:
                raise SystemExit("cold_entry_pair: --callgrind needs valgrind")
            for site_dir in args.sites:
                few = callgrind_counts(exe, site_dir, 1, args.pollute_kib, tmp)
                many = callgrind_counts(exe, site_dir, 301, args.pollute_kib, tmp)
                per = [(m - f) / 300 for f, m in zip(few, many)]
                print(f"{site_dir}: per pair {per[0]:.0f} instructions, L1 data lines missed "
                      f"{per[1]:.1f} read + {per[2]:.1f} write, L1 instruction lines missed {per[3]:.1f}")
            return 0
        times = {s: [] for s in args.sites}
        for r in range(args.rounds):
            order = args.sites[r % len(args.sites):] + args.sites[:r % len(args.sites)]
            for site_dir in order:
                times[site_dir].append(pair_ns(exe, site_dir, args.pairs,
                                               -1 if args.hot else args.pollute_kib))
        first = args.sites[0]
        for site_dir in args.sites:
            ratio = statistics.median(t / f for t, f in zip(times[site_dir], times[first]))
            print(f"{site_dir}: {'hot' if args.hot else 'cold'} pair {statistics.median(times[site_dir]):.1f} ns "
                  f"(median of {args.rounds} rounds), / {first}: {ratio:.3f} (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
