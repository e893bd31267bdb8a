#!/bin/bash
# Session 42: the crowd beside writers (crowd.py --crowd-writers), 65,536 x 1024, exact, default
# serve: C = 1, 16, 64 single recalls with 0 and with 8 processes adding one memory at a time
# (the first add grows the engine past its capacity, 65,536, in the C = 1 crowd), this tree (an
# add stops the GPU's polling once, twice only when the engine grows) beside cb58ec2 (every add
# stops it twice), alternated this, base, this, then base without writers. On an H200, first the
# default crowd 1-64 of this tree (issue 18's targets; none lent since session 26).
# Predicted: beside 8 writers this tree loses about half the recall rate that cb58ec2 loses
# against no writers at C = 16 and 64; the C = 1 crowd's max holds the growth's recompile.
#   mkdir -p .snap/trees/s42-base && git archive cb58ec2 src | tar -x -C .snap/trees/s42-base
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s42/call3.sh
#     (carry benchmarks/results/h200-s42 and .snap/trees/s42-base)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s42-base/src
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
build_fence src $B
[[ $card == *H200* ]] && NEED_S=90 INTO=default crowd src this
W=${WCROWD:-1,16,64}
NEED_S=60 INTO=writers CROWD=$W crowd src this-w0 "" --crowd-writers 0
NEED_S=60 INTO=writers CROWD=$W crowd src this-w8 "" --crowd-writers 8
NEED_S=60 INTO=writers CROWD=$W crowd $B base-w8 "" --crowd-writers 8
NEED_S=60 INTO=writers CROWD=$W crowd src this-w8b "" --crowd-writers 8
NEED_S=60 INTO=writers CROWD=$W crowd $B base-w0 "" --crowd-writers 0
echo "=== done ${SECONDS}s"
summary
grep -E "^#####|  C=|beside .* writers|first error" $OUT/crowd-writers.txt
