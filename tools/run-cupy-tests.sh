#!/bin/bash
# Run test files of CuPy's own suite with pyalloc installed as CuPy's allocator (and, with
# --baseline, also without it), on the GPU machine. CuPy's tests are not part of this repository:
# pass the path of a copy (e.g. tests/cupy_tests/cuda_tests/test_graph.py of CuPy's sources).
# Usage: bash tools/run-cupy-tests.sh [--baseline] [--pinned] FILE_OR_DIR... [-- PYTEST_ARGS...]
# --pinned also installs pyalloc's pinned host allocator (pyalloc.cupy.install(pinned=True)), for
# CuPy's pinned-memory tests (tests/cupy_tests/cuda_tests/test_pinned_memory.py, test_memory.py).
# PYTHONPATH must reach the built pyalloc (tools/gpu-check.sh's /tmp/inst:/tmp/site).
set -uo pipefail
baseline=0
install_args=""
paths=()
while [ $# -gt 0 ]; do
    case "$1" in
        --baseline) baseline=1 ;;
        --pinned) install_args="pinned=True" ;;
        --) shift; break ;;
        *) paths+=("$(cd "$(dirname "$1")" && pwd)/$(basename "$1")") ;;
    esac
    shift
done
run() {   # $1: "pyalloc" or "cupy-pool"; the rest: pytest arguments
    local label=$1 T
    shift
    T=$(mktemp -d)
    for p in "${paths[@]}"; do cp -r "$p" "$T/"; done
    if [ "$label" = pyalloc ]; then
        # Installed before any test module is imported: every CuPy allocation goes through pyalloc.
        printf 'import pyalloc.cupy\npyalloc.cupy.install(%s)\n' "$install_args" > "$T/conftest.py"
    fi
    echo "== CuPy tests on $label: ${paths[*]}"
    (cd "$T" && python3 -m pytest -q -p no:cacheprovider -rfE "$@" . 2>&1 | tail -25)
    rm -rf "$T"
}
[ "$baseline" = 1 ] && run cupy-pool "$@"
run pyalloc "$@"
