#!/bin/bash
# This round's GPU-machine checks, on top of tools/gpu-check.sh's build, in three parts that each fit
# one call (10 minutes) on one H200:
#   bash tools/gpu-round.sh tests   the GPU tests (CUDA, CuPy, graphs, expandable, stream lifetime,
#                                   PyTorch, Numba, cuda.core, four frameworks in one process), again
#                                   under PYALLOC_CONF=expandable_segments:True (and with
#                                   recycle_pages:True), the conformance suite
#                                   (tests/backends.py's harness files on both backends, counts per
#                                   backend, and
#                                   the property machine on CudaDevice) and
#                                   CuPy's own test files in .cupy_tests/ with and without pyalloc
#   bash tools/gpu-round.sh bench   PyTorch's torch.empty through pyalloc against native, the training
#                                   comparison, Numba and cuda.core hooks against their own allocators,
#                                   old build against new (.oldsrc/), bench_gpu, then the CPU suite on
#                                   that machine's Python
#   bash tools/gpu-round.sh soak    the GPU soak (tools/soak_gpu.py) for SOAK_SECONDS (default 300),
#                                   then 40 s of its load on CuPy's own pool (the control)
# A part finds the build of an earlier part of the same machine in /tmp/inst and reuses it.
#
# Carry `.whl` (bash tools/gpu-wheels.sh) and, optionally:
#   .cupy_tests/  CuPy test files to run with pyalloc (e.g. tests/cupy_tests/cuda_tests/test_graph.py
#                 of CuPy's sources at the installed version's tag; not part of this repository)
#   .oldsrc/      an older pyalloc source tree (git archive REV | tar -x -C .oldsrc) to compare with
# Both are git-ignored here (.git/info/exclude). Results go to $OUT (default /tmp/pyalloc-gpu-out).
set -u
PART=${1:-tests}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/pyalloc-gpu-out}
mkdir -p "$OUT"
if [ -f /tmp/inst/pyalloc/__init__.py ] && [ -d /tmp/t/repo ]; then
    echo "build: reusing /tmp/inst"
    rm -rf /tmp/t/repo/tests && cp -r "$ROOT/tests" /tmp/t/repo/tests
else
    GPU_CHECK_BUILD_ONLY=1 bash "$ROOT/tools/gpu-check.sh" "$OUT" > "$OUT/build.txt" 2>&1
    echo "build rc $?"; tail -1 "$OUT/build.txt"
fi
export PYTHONPATH=/tmp/inst:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
cd /tmp/t/repo
cp -r "$ROOT/bench" "$ROOT/tools" /tmp/t/repo/ 2>/dev/null

case "$PART" in
tests)
    GPU_TESTS=$(cd /tmp/t/repo && ls tests/test_*_gpu.py)
    echo "== GPU tests: $(echo $GPU_TESTS | wc -w) files"
    timeout 280 python3 -m pytest -q -rfEs -p no:cacheprovider $GPU_TESTS 2>&1 | tail -40
    echo "== GPU tests, PYALLOC_CONF=expandable_segments:True"
    PYALLOC_CONF=expandable_segments:True timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider \
        tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_cupy_graph_gpu.py \
        tests/test_frameworks_gpu.py tests/test_stream_lifetime_gpu.py 2>&1 | tail -12
    echo "== GPU tests, PYALLOC_CONF=expandable_segments:True,recycle_pages:True"
    PYALLOC_CONF=expandable_segments:True,recycle_pages:True timeout 150 python3 -m pytest -q -rfE \
        -p no:cacheprovider tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_cupy_graph_gpu.py \
        tests/test_frameworks_gpu.py tests/test_stream_lifetime_gpu.py tests/test_recycle_pages_gpu.py \
        2>&1 | tail -12
    echo "== conformance suite: the harness files on SimDevice and on the GPU"
    HARNESS="tests/test_core.py tests/test_pools.py tests/test_history.py tests/test_graphs.py
             tests/test_stream_lifetime.py tests/test_expandable.py"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short $HARNESS \
        --junitxml="$OUT/conformance.xml" 2>&1 | tail -8
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
    echo "== property state machine on the GPU (tests/test_properties.py CudaAllocatorMachine)"
    PYALLOC_CUDA_PROPERTY_EXAMPLES=${CUDA_PROPERTY_EXAMPLES:-40} timeout 200 python3 -m pytest -q \
        -p no:cacheprovider -rfE --tb=short tests/test_properties.py -k Cuda 2>&1 | tail -6
    if ls "$ROOT"/.cupy_tests/*.py >/dev/null 2>&1; then
        echo "== CuPy's own tests"
        (cd "$ROOT" && timeout 200 bash tools/run-cupy-tests.sh --baseline .cupy_tests/*.py -- --tb=line \
            2>&1 | grep -E "^==|passed|failed|^FAILED")
    fi
    ;;
bench)
    echo "== PyTorch: torch.empty through pyalloc against native"
    # 5 rounds take about 2 minutes on the H200 (9 ran past a 150 s timeout and printed nothing).
    timeout 200 python3 bench/bench_torch_hook.py --rounds ${TORCH_ROUNDS:-5} --json "$OUT/torch_hook.json" \
        2>&1 | tail -6
    echo "== PyTorch: training on pyalloc against native"
    timeout 200 python3 bench/torch_train_compare.py --steps ${TRAIN_STEPS:-100} --rounds 2 \
        --json "$OUT/torch_train.json" 2>&1 | tail -8
    echo "== bench_hooks (Numba and cuda.core through pyalloc against their own allocators)"
    timeout 120 python3 bench/bench_hooks.py --json "$OUT/bench_hooks.json" 2>&1 | tail -20
    if [ -d "$ROOT/.oldsrc" ]; then
        echo "== old build against new"
        PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/old \
            "$ROOT/.oldsrc" > "$OUT/old-build.txt" 2>&1 || { echo "old build failed"; tail -5 "$OUT/old-build.txt"; }
        PYTHONPATH=/tmp/site timeout 150 python3 bench/compare_builds.py /tmp/old /tmp/inst --rounds 9 \
            > "$OUT/compare.json" 2>&1 && python3 -c "import json; d = json.load(open('$OUT/compare.json')); \
print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items() if k.startswith('new/old')})"
    fi
    echo "== bench_gpu"
    timeout 80 python3 bench/bench_gpu.py --rounds 41 2>&1 | tail -8
    echo "== the CPU suite on this machine's Python"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
        $(for f in tests/test_*_gpu.py tests/test_core.py; do echo --ignore=$f; done) tests 2>&1 | tail -6
    ;;
soak)
    echo "== GPU soak, ${SOAK_SECONDS:-300} s"
    timeout $(( ${SOAK_SECONDS:-300} + 200 )) python3 tools/soak_gpu.py --seconds "${SOAK_SECONDS:-300}" --control-seconds 40 \
        --json "$OUT/soak.json" 2>&1 | tail -12
    ;;
*)
    echo "gpu-round.sh: unknown part '$PART' (expected tests, bench or soak)" >&2
    exit 2
    ;;
esac
