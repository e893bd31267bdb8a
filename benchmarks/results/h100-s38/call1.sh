#!/bin/bash
# Session 38, first device call. Session 37 saw late connects at C = 32-64 take 7.8-20.2 ms p99
# (1.9-2.6 in session 35). Hypothesis: the busy sweep waits with sched_yield, which hands the
# GIL back to itself, so a control thread waits the interpreter's 5 ms switch interval at each
# GIL acquisition of a hello; the hotter crowd.py keeps the sweep busier. The change: the
# sidecar serves with a 0.2 ms switch interval (this tree) against c744af8 (base, 5 ms).
# Predicted: with --gpu-polling off (the sweep answers, and waits for its passes in flight with
# sched_yield) late-connect p99 at C = 32-64 under 3 ms with the change, 2.6-13.7 without
# (session 35); with GPU polling (the sweep waits for the kernel with the GIL released) little
# change; recall p50 and rate within 3% in both. Then the old crowd.py (39799a6) on base: if its late connects
# read 2-3 ms, the hotter loop was what exposed it. Then the rounds in process over 1,024 rows
# under the profiler (where a C = 64 round's floor goes).
# The change is candidate-switch-interval.patch (beside this script), applied to src here when
# src lacks it; base is the tree it applies to.
#   mkdir -p .snap/crowd-old && git show 39799a6:src/kalos/tools/crowd.py > .snap/crowd-old/crowd.py
#   mkdir -p .snap/trees/s38base && git archive c744af8 src | tar -x -C .snap/trees/s38base
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s38/call1.sh   (carry both)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s38/prelude.sh
NEED_S=100 INTO=default crowd src this 16,64
NEED_S=100 INTO=default crowd $B base 16,64
echo "=== old crowd.py on base $(date +%T) (${SECONDS}s)"; echo "##### base-oldcrowd" >> $OUT/crowd-connects.txt
(( SECONDS + 60 < budget )) && PYTHONPATH=$B timeout $(( budget - SECONDS )) python3 .snap/crowd-old/crowd.py --device cuda \
  --crowd 16,32,64 --crowd-seconds 2 >> $OUT/crowd-connects.txt 2>&1; pkill -9 -f "kalos[ ]serve" 2>/dev/null
NEED_S=45 INTO=sweep CROWD=16,32,64 crowd src this-sweep "" --serve-arg=--gpu-polling --serve-arg=off
NEED_S=45 INTO=sweep CROWD=16,32,64 crowd $B base-sweep "" --serve-arg=--gpu-polling --serve-arg=off
NEED_S=70 rounds n1024 src --n 1024 --sizes 1,16,64 --profile 16,64
echo "=== done ${SECONDS}s"
summary
