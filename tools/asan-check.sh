#!/bin/bash
# Build pyalloc's compiled core with AddressSanitizer and UndefinedBehaviorSanitizer (meson's
# built-in b_sanitize option; meson.build is unchanged) into a venv outside the source tree, run the
# core's tests with the ASan runtime preloaded, and exit non-zero on any sanitizer report.
#
# Usage, from anywhere:
#     tools/asan-check.sh                 build (incremental: the build folder is kept), then test
#     tools/asan-check.sh --no-build      test the last build again without compiling anything
#     tools/asan-check.sh --no-ubsan      AddressSanitizer only (the build folder gets its own name)
#     tools/asan-check.sh [opts] -- ARGS  run pytest on ARGS instead of the default files below
#     tools/asan-check.sh [opts] --exec CMD ARGS...
#                                         run any command (say `python snippet.py`) in the same
#                                         sanitized environment, then check its reports likewise
# Environment: ASAN_WORK (default ${TMPDIR:-/tmp}/pyalloc-asan) holds the venv, the build folder
# and the reports; ASAN_VENV names an existing venv to use instead (the build requirements of
# pyproject.toml and the test requirements are installed into it when missing).
#
# Exit status: 0 when the tests pass and no sanitizer wrote a report; 1 when a report was written
# (the paths and their first lines are printed; each process that reported writes its own
# $ASAN_WORK/reports/{asan,ubsan}.PID), 2 when the build failed, otherwise pytest's status.
#
# How the run is set up, and why:
#  - LD_PRELOAD of gcc's libasan.so: the interpreter is not instrumented, so the runtime must be
#    first in the process for an instrumented extension module to load at all.
#  - PYTHONMALLOC=malloc: pymalloc's arenas would hide small objects' overruns and uses after free
#    from ASan; with it, every Python object comes from ASan's malloc.
#  - detect_leaks=0: CPython does not free everything at exit, by design, so LeakSanitizer would
#    report at every exit.
#  - halt_on_error=1 (both sanitizers): the first report ends the process, so nothing runs on
#    corrupted state; a child that dies so fails the test that started it, and its report file
#    stays here either way.
#  - log_path: reports go to files, not stderr, so a report from a child process (the tests run
#    fresh interpreters with subprocess, which inherit this environment and so run under ASan
#    too) is found even when the test captures and ignores the child's stderr, and tests that
#    require an empty stderr are not failed by a note from the runtime.
#  - allocator_may_return_null=1: an oversized host malloc returns NULL (MemoryError in Python)
#    as it does without ASan, instead of being reported as an error of ASan's own.
#  - -Dbuildtype=debugoptimized (-O2 -g): report stacks have file:line. A frame in Cython's
#    generated C++ (NAME.pyx.cpp:N) is then annotated in the report file with the .pyx/.pxd line
#    that produced it ([pyalloc/_core.pyx:M], read from the comments Cython writes before each
#    statement). (Cython's --line-directives would do it at compile time, but meson 1.12.1 here
#    listed -Dcython_args=--line-directives in its summary and left it off cython's command line;
#    meson.build is not this script's to edit.)
#
# Tests deselected under ASan, each because it cannot be run there as written: none (SKIPS below).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${ASAN_WORK:-${TMPDIR:-/tmp}/pyalloc-asan}
BUILD=1
SANITIZE=address,undefined
EXEC=()
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) BUILD=0 ;;
        --no-ubsan) SANITIZE=address ;;
        --exec) shift; EXEC=("$@"); break ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "asan-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# The default test set (issue 25): the core, pools, graphs and reliability specifications, the C
# entry points (tests/test_capi.py) and the CUDA backend over the fake C driver (the two
# *_fake_driver.py files: each runs its scenarios in a child interpreter, under ASan like this one).
TESTS=(tests/test_core.py tests/test_pools.py tests/test_graphs.py tests/test_reliability.py tests/test_reliability_core.py
       tests/test_capi.py tests/test_cuda_fake_driver.py tests/test_conformance_fake_driver.py)
# Deselected, each with its reason (pytest node ids; none now). Every test of the files above runs:
# the one wall-clock bound among them (tests/test_reliability.py::
# test_placing_40000_live_segments_does_not_walk_them_all, 40,000 placements in under 2 s) passes
# under ASan too, and the tests that run fresh interpreters pass this environment on to them.
SKIPS=()

VENV=${ASAN_VENV:-$WORK/venv}
BUILD_DIR=$WORK/build-${SANITIZE//,/-}
REPORTS=$WORK/reports
mkdir -p "$WORK"

say() { echo "== asan-check: $*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "venv $VENV (new)"
    python3 -m venv "$VENV" || exit 2
fi
export PATH="$VENV/bin:$PATH"        # meson-python runs `meson` and `ninja` from PATH
if ! python -c "import mesonpy, Cython, cuda.bindings, pytest, hypothesis, numpy" 2>/dev/null; then
    say "installing the build and test requirements into $VENV"
    python -m pip install -q meson-python meson ninja 'cython>=3.0.10' 'cuda-bindings>=13.4,<14' \
        'nvidia-cuda-runtime>=13.4,<14' 'cuda-pathfinder>=1.2' tqdm pytest hypothesis \
        pytest-benchmark numpy websocket-client || exit 2
fi

LIBASAN=$(gcc -print-file-name=libasan.so)
if [ ! -e "$LIBASAN" ]; then
    echo "asan-check: gcc has no libasan.so ($LIBASAN)" >&2
    exit 2
fi

if [ "$BUILD" = 1 ]; then
    say "build ($SANITIZE) in $BUILD_DIR, log $WORK/build.log"
    start=$SECONDS
    if ! python -m pip install -v --no-build-isolation --no-deps --force-reinstall "$ROOT" \
            -Csetup-args=-Db_sanitize="$SANITIZE" -Csetup-args=-Db_lundef=false \
            -Csetup-args=-Dbuildtype=debugoptimized \
            -Cbuild-dir="$BUILD_DIR" >"$WORK/build.log" 2>&1; then
        grep -v "is ignored" "$WORK/build.log" | tail -40
        exit 2
    fi
    say "build took $((SECONDS - start)) s"
fi

rm -rf "$REPORTS"
mkdir -p "$REPORTS"
export LD_PRELOAD="$LIBASAN${LD_PRELOAD:+:$LD_PRELOAD}"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:allocator_may_return_null=1:log_path=$REPORTS/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
say "LD_PRELOAD=$LD_PRELOAD PYTHONMALLOC=$PYTHONMALLOC"
say "ASAN_OPTIONS=$ASAN_OPTIONS"
say "UBSAN_OPTIONS=$UBSAN_OPTIONS"

# The module imported must be the sanitized one in the venv, never a source checkout's.
core=$(cd "$WORK" && python -c "import pyalloc._core as c; print(c.__file__)") || exit 2
case "$core" in
    "$VENV"/*) ;;
    *) echo "asan-check: pyalloc._core comes from $core, not from $VENV" >&2; exit 2 ;;
esac
if ! readelf -d "$core" | grep -q "libasan"; then
    echo "asan-check: $core is not built with AddressSanitizer (run without --no-build)" >&2
    exit 2
fi

start=$SECONDS
if [ ${#EXEC[@]} -gt 0 ]; then
    say "exec: ${EXEC[*]}"
    "${EXEC[@]}"
    rc=$?
else
    if [ ${#PYTEST_ARGS[@]} -eq 0 ]; then
        PYTEST_ARGS=("${TESTS[@]}")
        for s in "${SKIPS[@]+"${SKIPS[@]}"}"; do PYTEST_ARGS+=(--deselect "$s"); done
    fi
    say "pytest ${PYTEST_ARGS[*]}"
    # From the repository root with the venv's pytest script (not `python -m`, which would put the
    # root and so the source's pyalloc/ first on sys.path): tests/ goes on sys.path (conftest.py),
    # the root does not. -p no:cacheprovider: nothing written into the checkout.
    (cd "$ROOT" && "$VENV/bin/pytest" -q -p no:cacheprovider "${PYTEST_ARGS[@]}")
    rc=$?
fi
say "run took $((SECONDS - start)) s, exit status $rc"

reports=("$REPORTS"/*)
if [ -e "${reports[0]}" ]; then
    say "SANITIZER REPORTS (${#reports[@]}):"
    python - "$BUILD_DIR" "${reports[@]}" <<'PY'
import pathlib, re, sys
build = pathlib.Path(sys.argv[1])
frame = re.compile(r"(\S+?)\.pyx\.cpp:(\d+)")
marks = {}
def source_line(name, n):
    """The .pyx/.pxd line of generated line n of NAME.pyx.cpp: the last Cython comment before it."""
    if name not in marks:
        found = list(build.glob(f"*.so.p/{pathlib.Path(name).name}.pyx.cpp"))
        lines = found[0].read_text(errors="replace").splitlines() if found else []
        last, table = None, []
        for line in lines:
            m = re.match(r'\s*/\* "(pyalloc/[^"]+)":(\d+)', line)
            if m:
                last = f"{m.group(1)}:{m.group(2)}"
            table.append(last)
        marks[name] = table
    table = marks[name]
    return table[n - 1] if 0 < n <= len(table) else None
for path in map(pathlib.Path, sys.argv[2:]):
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = frame.search(line)
        src = m and source_line(m.group(1), int(m.group(2)))
        out.append(f"{line} [{src}]" if src and "[pyalloc/" not in line else line)
    path.write_text("\n".join(out) + "\n")
    print("---", path)
    head = [l for l in out if "ERROR: AddressSanitizer" in l or "runtime error" in l][:1]
    ours = [l.strip() for l in out if "pyalloc/" in l and re.match(r"\s*#\d+ ", l)][:6]
    print("\n".join(head + ours) or "\n".join(out[:3]))
PY
    exit 1
fi
say "no sanitizer report"
exit "$rc"
