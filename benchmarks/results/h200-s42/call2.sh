#!/bin/bash
# Session 42: on an H200 first the default crowd 1-64 of this tree (issue 18's targets; none lent
# since session 26); on any card the crowd beside writers: C = 1, 16, 64 single recalls with 0
# and with 8 processes adding one memory at a time meanwhile (crowd.py --crowd-writers, this
# session), the store of 65,536 x 1024 growing past the engine's capacity on the first add.
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s42/call2.sh   (carry benchmarks/results/h200-s42)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
build_fence src
[[ $card == *H200* ]] && NEED_S=90 INTO=default crowd src this
for w in 0 8; do NEED_S=60 INTO=writers CROWD=${WCROWD:-1,16,64} crowd src writers-$w "" --crowd-writers $w; done
echo "=== done ${SECONDS}s"
summary
grep -E "^#####|beside .* writers|first error" $OUT/crowd-writers.txt
