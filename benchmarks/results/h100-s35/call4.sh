#!/bin/bash
# Session 35, call 4: the final tree's fast precision beside exact (the ratio the targets name:
# fast C = 64 p50 <= 0.6x exact), `kalos serve --device cuda [--precision fast]` at 1, 16, 64,
# alternated twice.
#   BUDGET_S=300 OUT=$OUT bash benchmarks/results/h100-s35/call4.sh   (carry this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
build_fence src
FAST="--serve-arg=--precision --serve-arg=fast"
for round in 1 2; do
  NEED_S=40 INTO=fast CROWD=1,16,64 crowd src exact-$round ""
  NEED_S=40 INTO=fast CROWD=1,16,64 crowd src fast-$round "" $FAST
done
echo "=== done ${SECONDS}s"
summary
