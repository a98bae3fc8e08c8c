#!/bin/bash
# Build pyalloc on the GPU machine, run its GPU tests, the whole suite and the GPU benchmark, and
# print a short table last. Results (junit xml, benchmark json, logs) go to $OUT (or the first
# argument, default /tmp/pyalloc-gpu-out).
#
# The GPU machine has Python 3.12, torch, CuPy, Cython, numpy, pytest, pytest-benchmark and
# cuda-bindings 13.3, but no meson and no internet: first fetch the missing wheels, on a machine
# with internet, from the repository root:   bash tools/gpu-wheels.sh   (fills .whl/)
# and take .whl/ along (it is git-ignored). Then, from the repository root on the GPU machine:
#     bash tools/gpu-check.sh
# The build goes to /tmp/inst, the wheels to /tmp/site, and tests run from a copy in /tmp/t so
# that the source tree does not shadow the built package (SITE, INST, T override these folders;
# GPU_CHECK_NO_WHEELS=1 skips the wheels, for a dry run elsewhere; GPU_CHECK_BUILD_ONLY=1 stops
# after the build, for scripts such as tools/scaling-order.sh).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-${OUT:-/tmp/pyalloc-gpu-out}}
SITE=${SITE:-/tmp/site}
INST=${INST:-/tmp/inst}
T=${T:-/tmp/t}
mkdir -p "$OUT"

say() { echo; echo "== $*"; }

say "machine"
nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
python3 -V

say "wheels -> $SITE"
if [ "${GPU_CHECK_NO_WHEELS:-0}" = 1 ]; then
    echo "(skipped: GPU_CHECK_NO_WHEELS=1, a local dry run with this python's packages)"
elif ! ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    echo "no wheels in $ROOT/.whl: run bash tools/gpu-wheels.sh from the repository root first"
    exit 2
else
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
        "$ROOT"/.whl/*.whl || exit 2
fi
export PATH="$SITE/bin:$PATH"

say "build -> $INST"
rm -rf "$INST"
if ! PYTHONPATH="$SITE" python3 -m pip install -q --no-build-isolation --no-deps --target "$INST" "$ROOT" \
        >"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 2
fi

# Tests and benchmarks read only the repository (tests/data, examples/): copy those folders, not
# the package sources, so that the built package in $INST is the one imported.
rm -rf "$T"
mkdir -p "$T/repo"
cp -r "$ROOT/tests" "$T/repo/tests"
cp -r "$ROOT/bench" "$T/repo/bench"
cp -r "$ROOT/examples" "$T/repo/examples"
cp "$ROOT/README.md" "$T/repo/README.md"      # tests/test_readme.py runs its examples
printf '[pytest]\nmarkers =\n    gpu: needs an NVIDIA GPU and driver (skipped elsewhere)\n' > "$T/repo/pytest.ini"
cd "$T/repo"
export PYTHONPATH="$INST:$SITE"
if [ "${GPU_CHECK_BUILD_ONLY:-0}" = 1 ]; then
    echo "built into $INST, tests copied to $T/repo (GPU_CHECK_BUILD_ONLY=1: nothing run)"
    exit 0
fi

say "versions"
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib
for name in ("pyalloc", "cuda.bindings", "cupy", "torch", "numpy", "Cython", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"{name:14} {getattr(m, '__version__', '?'):12} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{name:14} missing ({type(exc).__name__}: {exc})")
from pyalloc import cuda_backend
print("cuda available:", cuda_backend.is_available(), "devices:", cuda_backend.device_count(),
      cuda_backend.unavailable_reason())
if cuda_backend.is_available():
    from pyalloc import _cuda
    print("driver CUDA version:", _cuda.driver_version())
EOF

say "GPU tests"
timeout 240 python3 -m pytest -p no:cacheprovider -q -rs --junitxml="$OUT/junit-gpu.xml" \
    tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_expandable_gpu.py 2>&1 \
    | tee "$OUT/pytest-gpu.txt" | tail -40
gpu_rc=${PIPESTATUS[0]}

say "GPU tests again, every allocator with expandable_segments:True"
PYALLOC_CONF=expandable_segments:True timeout 150 python3 -m pytest -p no:cacheprovider -q -rs \
    --junitxml="$OUT/junit-gpu-expandable.xml" tests/test_cuda_gpu.py tests/test_cupy_gpu.py 2>&1 \
    | tee "$OUT/pytest-gpu-expandable.txt" | tail -30
exp_rc=${PIPESTATUS[0]}

say "rest of the suite (CPU tests on this machine's Python)"
timeout 120 python3 -m pytest -p no:cacheprovider -q -x --junitxml="$OUT/junit-all.xml" \
    --ignore=tests/test_cuda_gpu.py --ignore=tests/test_cupy_gpu.py --ignore=tests/test_expandable_gpu.py \
    tests 2>&1 | tail -8
all_rc=${PIPESTATUS[0]}

say "GPU benchmark (same-run table)"
timeout 120 python3 bench/bench_gpu.py --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.txt"

say "expandable segments: cost of a map and an unmap"
timeout 60 python3 bench/expandable_gpu_cost.py --repeat 200 2>&1 | tee "$OUT/expandable-cost.txt"
timeout 60 python3 bench/expandable_gpu_cost.py --pages 5 --repeat 100 2>&1 | tee -a "$OUT/expandable-cost.txt"

say "core hot path, replay and history benchmarks (absolute times on this machine's CPU)"
timeout 150 python3 -m pytest -p no:cacheprovider -q bench/bench_core.py bench/bench_replay.py \
    bench/bench_history.py --benchmark-only --benchmark-max-time=0.5 --benchmark-min-rounds=5 \
    --benchmark-json="$OUT/bench-cpu.json" 2>&1 | tail -5
python3 bench/report.py "$OUT/bench-cpu.json" 2>&1 | tee "$OUT/bench-cpu.txt"

say "summary"
python3 - "$OUT" <<'EOF'
import sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'suite':<24}{'tests':>7}{'passed':>8}{'failed':>8}{'errors':>8}{'skipped':>9}")
for name in ("junit-gpu.xml", "junit-gpu-expandable.xml", "junit-all.xml"):
    p = out / name
    if not p.exists():
        print(f"{name:<24}  (missing)")
        continue
    root = ET.parse(p).getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    t, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
    print(f"{name:<24}{t:>7}{t - f - e - k:>8}{f:>8}{e:>8}{k:>9}")
    for case in s.iter("testcase"):
        for kind in ("failure", "error"):
            if case.find(kind) is not None:
                print(f"   {kind.upper()}: {case.get('classname')}::{case.get('name')}")
bench = out / "bench-gpu.txt"
if bench.exists():
    print()
    print(bench.read_text().rstrip())
EOF

[ "$gpu_rc" -eq 0 ] && [ "$exp_rc" -eq 0 ] && [ "$all_rc" -eq 0 ]
