#!/bin/bash
# Session 38, call 1 cut to what device time the failed starts left (about 360 s): late connects
# only, C = 32 and 64. On base (c744af8): the new crowd.py, then the old (39799a6), default serve;
# then the sweep (--gpu-polling off) with candidate-switch-interval.patch and without.
# Predicted as in call1.sh: old and new crowd.py alike if the machine, not the hotter loop, made
# session 37's late connects slow; with the sweep, the patch's late-connect p99 under 3 ms.
#   (the .snap trees as in call1.sh's header)  BUDGET_S=220 OUT=$OUT bash benchmarks/results/h100-s38/call2.sh
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s38/prelude.sh
NEED_S=30 INTO=connects CROWD=32,64 crowd $B base-newcrowd ""
echo "=== old crowd.py on base $(date +%T) (${SECONDS}s)"; echo "##### base-oldcrowd" >> $OUT/crowd-connects.txt
(( SECONDS + 30 < budget )) && PYTHONPATH=$B timeout $(( budget - SECONDS )) python3 .snap/crowd-old/crowd.py --device cuda \
  --crowd 32,64 --crowd-seconds 2 >> $OUT/crowd-connects.txt 2>&1; pkill -9 -f "kalos[ ]serve" 2>/dev/null
NEED_S=30 INTO=sweep CROWD=32,64 crowd src this-sweep "" --serve-arg=--gpu-polling --serve-arg=off
NEED_S=30 INTO=sweep CROWD=32,64 crowd $B base-sweep "" --serve-arg=--gpu-polling --serve-arg=off
echo "=== done ${SECONDS}s"
summary
