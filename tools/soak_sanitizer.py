#!/usr/bin/env python3
"""Soak the reuse sanitizer's state machines: run the hypothesis machines that drive the allocator
on SimDevice(check_reuse=True) with many more examples than CI does.

    python tools/soak_sanitizer.py --examples 5000            # the two-thread machine
    python tools/soak_sanitizer.py --examples 2000 --all      # and the other machines too
    python tools/soak_sanitizer.py --examples 5000 --seed 7   # reproducible

It sets PYALLOC_SANITIZER_EXAMPLES, which tests/test_reuse_machine.py (and the machines --all adds:
tests/test_properties.py's AllocatorMachine, tests/test_stream_churn_properties.py and the capture
property of tests/test_graphs.py) take as their number of examples, runs pytest from the
checkout and exits with its status. A failure prints the shrunk program hypothesis found.
(A plain `pytest -q tests` runs the quick counts of tests/budget.py, .ci/run the thorough ones.)
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MACHINE = "tests/test_reuse_machine.py"
OTHERS = ["tests/test_properties.py::TestAllocatorMachine",
          "tests/test_stream_churn_properties.py",
          "tests/test_graphs.py::test_no_block_is_handed_out_again_before_every_node_that_used_it_precedes_the_new_stream"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--examples", type=int, default=2000,
                        help="hypothesis examples per machine (default 2000; CI runs 150 to 1200)")
    parser.add_argument("--all", action="store_true",
                        help="also the allocator, stream-churn and capture machines")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    env = dict(os.environ, PYALLOC_SANITIZER_EXAMPLES=str(args.examples))
    targets = [MACHINE] + (OTHERS if args.all else [])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    if args.seed is not None:
        cmd += [f"--hypothesis-seed={args.seed}"]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
