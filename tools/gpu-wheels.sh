#!/bin/bash
# Download, into .whl/ of this repository (git-ignored), the wheels that the GPU machine lacks for
# building pyalloc there: its python3 is CPython 3.12 with Cython, numpy, pytest, pytest-benchmark,
# torch, cupy and cuda-bindings 13.3, but no meson/meson-python/ninja, and cuda-bindings 13.3's
# cydriver.pxd needs headers that do not match. The GPU machine has no internet: run this on a
# machine that has, from the repository root (`bash tools/gpu-wheels.sh [more requirements]`), and
# take .whl/ along. tools/gpu-check.sh and tools/gpu-round.sh install them on the GPU machine.
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  meson-python==0.22.1 meson==1.12.1 ninja==1.13.2 pyproject-metadata==0.12.1 \
  cuda-bindings==13.5.0 nvidia-cuda-runtime==13.5.37 cuda-pathfinder==1.9.1 "$@"
ls -1 .whl
