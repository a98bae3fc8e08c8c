#!/bin/bash
# One GPU-machine call for this round's checks, on top of tools/gpu-check.sh's build: the GPU tests
# (also under expandable segments), the CPU suite on that machine's Python, CuPy's own graph tests
# with pyalloc installed, the capture benchmark (CuPy + pyalloc against PyTorch), the old-vs-new
# build comparison, and bench_gpu. ~5 minutes on one H200. The conformance suite (tests/test_core.py
# on both backends) gets a step of its own with pass/skip/fail counts per backend. The GPU soak
# (tools/soak_gpu.py) runs with SOAK_SECONDS=N, or alone with SOAK_ONLY=1 (build, then the soak).
#
# Carry `.whl` (../shared/tools/gpu-wheels.sh) and, optionally:
#   .cupy_tests/  CuPy test files to run with pyalloc (e.g. tests/cupy_tests/cuda_tests/test_graph.py
#                 of CuPy's sources at the installed version's tag; not part of this repository)
#   .oldsrc/      an older pyalloc source tree (git archive REV | tar -x -C .oldsrc) to compare with
# Both are git-ignored here (.git/info/exclude). Results go to $OUT (default /tmp/pyalloc-gpu-out).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/pyalloc-gpu-out}
mkdir -p "$OUT"
GPU_CHECK_BUILD_ONLY=1 bash "$ROOT/tools/gpu-check.sh" "$OUT" > "$OUT/build.txt" 2>&1
echo "build rc $?"; tail -1 "$OUT/build.txt"
export PYTHONPATH=/tmp/inst:/tmp/site PATH=/tmp/site/bin:$PATH
if [ "${SOAK_ONLY:-0}" = 1 ]; then
    echo "== GPU soak, ${SOAK_SECONDS:-300} s"
    timeout $(( ${SOAK_SECONDS:-300} + 180 )) python3 "$ROOT/tools/soak_gpu.py" --seconds "${SOAK_SECONDS:-300}" \
        --json "$OUT/soak.json" 2>&1 | tail -8
    exit 0
fi
GPU_TESTS="tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_cupy_graph_gpu.py tests/test_expandable_gpu.py
           tests/test_stream_lifetime_gpu.py"
cd /tmp/t/repo
echo "== GPU tests"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider $GPU_TESTS 2>&1 | tail -7
echo "== GPU tests, PYALLOC_CONF=expandable_segments:True"
PYALLOC_CONF=expandable_segments:True timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_cupy_graph_gpu.py 2>&1 | tail -2
echo "== conformance suite: tests/test_core.py on SimDevice and on the GPU"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_core.py \
    --junitxml="$OUT/conformance.xml" 2>&1 | tail -6
python3 - "$OUT/conformance.xml" <<'PY' 2>&1 | tail -1
import collections, sys, xml.etree.ElementTree as E
counts = collections.Counter()
for case in E.parse(sys.argv[1]).getroot().iter("testcase"):
    backend = "cuda" if "[cuda" in case.get("name", "") else "sim"
    outcome = ("skipped" if case.find("skipped") is not None else
               "failed" if case.find("failure") is not None or case.find("error") is not None else "passed")
    counts[backend, outcome] += 1
print("conformance counts:", {f"{b} {o}": n for (b, o), n in sorted(counts.items())})
PY
echo "== the rest of the suite on this machine's Python"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    $(for f in $GPU_TESTS tests/test_core.py; do echo --ignore=$f; done) tests 2>&1 | tail -4
if ls "$ROOT"/.cupy_tests/*.py >/dev/null 2>&1; then
    echo "== CuPy's own tests"
    (cd "$ROOT" && timeout 150 bash tools/run-cupy-tests.sh --baseline .cupy_tests/*.py -- --tb=line \
        2>&1 | grep -E "^==|passed|failed|^FAILED")
fi
echo "== capture benchmark"
timeout 300 python3 bench/capture_gpu.py --json "$OUT/capture_gpu.json" 2>&1 | tail -48
if [ -d "$ROOT/.oldsrc" ]; then
    echo "== old build against new"
    PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/old \
        "$ROOT/.oldsrc" > "$OUT/old-build.txt" 2>&1 || { echo "old build failed"; tail -5 "$OUT/old-build.txt"; }
    PYTHONPATH=/tmp/site timeout 200 python3 bench/compare_builds.py /tmp/old /tmp/inst --rounds 9 \
        > "$OUT/compare.json" 2>&1 && python3 -c "import json; d = json.load(open('$OUT/compare.json')); \
print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items() if k.startswith('new/old')})"
fi
echo "== bench_gpu"
timeout 100 python3 bench/bench_gpu.py --rounds 41 2>&1 | tail -8
if [ "${SOAK_SECONDS:-0}" != 0 ]; then
    # Off by default: the round above takes ~5 minutes of a call's 10. Run it as its own call:
    #   SOAK_ONLY=1 SOAK_SECONDS=300 bash tools/gpu-round.sh   (builds, then only the soak)
    echo "== GPU soak, ${SOAK_SECONDS} s"
    timeout $(( ${SOAK_SECONDS%.*} + 180 )) python3 "$ROOT/tools/soak_gpu.py" --seconds "$SOAK_SECONDS" \
        --json "$OUT/soak.json" 2>&1 | tail -8
fi
