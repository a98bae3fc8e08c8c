"""Instructions per cache-hit malloc+free pair from Python, by callgrind, for one or more builds.

For each SITE (a folder with an installed pyalloc, or "." for the one Python finds), runs a
process doing N pairs `free(malloc(4096))` and the same process doing 0 pairs under
`valgrind --tool=callgrind`, and reports (Ir(N) - Ir(0)) / N: deterministic, so two builds
compare in one run without timing noise. The count includes the Python loop around the calls
(the same for every build).

Run:  python bench/callgrind_pair.py [--pairs 20000] SITE [SITE ...]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

CHILD = r"""
import gc, sys
import pyalloc
gc.disable()
a = pyalloc.CachingAllocator(backend=pyalloc.SimDevice(), config="")
malloc, free = a.malloc, a.free
free(malloc(4096))
for _ in range(int(sys.argv[1])):
    free(malloc(4096))
"""


def instructions(site, pairs, python):
    env = dict(os.environ, PYTHONHASHSEED="0")     # the same interpreter start-up every time
    if site != ".":
        env["PYTHONPATH"] = os.path.abspath(site) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "cg.out")
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
                              python, "-c", CHILD, str(pairs)],
                             capture_output=True, text=True, env=env, cwd=tmp)
        if run.returncode != 0:
            raise SystemExit(f"valgrind failed for {site}:\n{run.stderr[-2000:]}")
        match = re.search(r"Collected : (\d+)", run.stderr)
        if match is None:
            raise SystemExit(f"no instruction count in valgrind's output for {site}")
        return int(match.group(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sites", nargs="+")
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    for site in args.sites:
        per_pair = (instructions(site, args.pairs, args.python)
                    - instructions(site, 0, args.python)) / args.pairs
        print(f"{site}: {per_pair:.1f} instructions per cache-hit pair")
    return 0


if __name__ == "__main__":
    sys.exit(main())
