#!/bin/bash
# One GPU-machine call for this round's checks, on top of tools/gpu-check.sh's build: the GPU tests
# (also under expandable segments; the framework hooks' among them), the CPU suite on that
# machine's Python, CuPy's own graph tests with pyalloc installed, the capture benchmark (CuPy +
# pyalloc against PyTorch), the old-vs-new build comparison, PyTorch on pyalloc (its GPU tests,
# torch.empty cost, training comparison), bench_gpu and bench_hooks. ~12 minutes on one H200.
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
GPU_TESTS="tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_cupy_graph_gpu.py tests/test_expandable_gpu.py
           tests/test_frameworks_gpu.py"
cd /tmp/t/repo
echo "== GPU tests"
timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider $GPU_TESTS 2>&1 | tail -30
echo "== GPU tests, PYALLOC_CONF=expandable_segments:True"
PYALLOC_CONF=expandable_segments:True timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider \
    tests/test_cuda_gpu.py tests/test_cupy_gpu.py tests/test_cupy_graph_gpu.py tests/test_frameworks_gpu.py \
    2>&1 | tail -12
echo "== the rest of the suite on this machine's Python"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    $(for f in $GPU_TESTS tests/test_torch_gpu.py; do echo --ignore=$f; done) tests 2>&1 | tail -4
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
echo "== PyTorch on pyalloc: GPU tests, torch.empty cost, training comparison"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_torch_gpu.py 2>&1 | tail -7
timeout 240 python3 bench/bench_torch_hook.py --rounds 9 --json "$OUT/torch_hook.json" 2>&1 | tail -3
timeout 400 python3 bench/torch_train_compare.py --steps 200 --rounds 3 --json "$OUT/torch_train.json" \
    2>&1 | tail -4
echo "== bench_gpu"
timeout 100 python3 bench/bench_gpu.py --rounds 41 2>&1 | tail -8
echo "== bench_hooks (Numba and cuda.core through pyalloc against their own allocators)"
timeout 150 python3 bench/bench_hooks.py --json "$OUT/bench_hooks.json" 2>&1 | tail -20
