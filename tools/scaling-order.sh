#!/bin/bash
# Does the order in which pytest-benchmark runs the live-block scaling cases change their ratio?
# Runs the three cases in ascending and then descending order, and prints both reports.
# Usage (after tools/gpu-check.sh has built pyalloc into /tmp/inst and copied tests to /tmp/t):
#   bash tools/scaling-order.sh
cd "${T:-/tmp/t}/repo" || exit 2
export PYTHONPATH="${INST:-/tmp/inst}:${SITE:-/tmp/site}"
t=bench/bench_core.py::test_pair_with_live_blocks
for order in "100 10000 100000" "100000 10000 100"; do
    ids=(); for n in $order; do ids+=("$t[$n]"); done
    echo "== order: $order"
    python3 -m pytest -p no:cacheprovider -q "${ids[@]}" --benchmark-only --benchmark-max-time=0.5 \
        --benchmark-json=/tmp/scaling.json >/dev/null 2>&1
    python3 bench/report.py /tmp/scaling.json | grep -E "live"
done
