#!/bin/bash
# Session 42's final read: the default crowd 1-64 (and beside the GEMMs at 16 and 64) of this
# tree on whatever card comes, then the crowd beside 8 writers at C = 1, 16, 64 if time is left.
#   BUDGET_S=280 OUT=$OUT bash benchmarks/results/h200-s42/call4.sh   (carry benchmarks/results/h200-s42)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
build_fence src
NEED_S=120 INTO=default crowd src this 16,64
NEED_S=60 INTO=writers CROWD=1,16,64 crowd src this-w8 "" --crowd-writers 8
echo "=== done ${SECONDS}s"
summary
grep -E "  C=|beside .* writers|first error" $OUT/crowd-writers.txt 2>/dev/null
