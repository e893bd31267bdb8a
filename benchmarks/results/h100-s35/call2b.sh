#!/bin/bash
# Session 35, call 2b: call 2 read this tree's default crowd (the engine split)
# at C = 64 276.2 us against 254.0 for 1e58364, with the candidate run first. The helpers only
# rename offsets and inline helpers (predicted: the same kernels), so: the two trees alternated,
# twice each, C = 16 and 64 (default polling), to tell order and noise from a change.
#   BUDGET_S=300 OUT=$OUT bash benchmarks/results/h100-s35/call2b.sh   (carry .snap/trees/s35-base, h100-s35, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
build_fence src $B
for round in 1 2; do
  NEED_S=40 INTO=ab CROWD=32,64 crowd $B base-$round ""
  NEED_S=40 INTO=ab CROWD=32,64 crowd src this-$round ""
done
echo "=== done ${SECONDS}s"
summary
