#!/bin/bash
# For the next session's first device call. Session 37's call 4 saw late connects at C = 32-64 take
# 7.8-20.2 ms p99 for both trees, against 1.9-2.6 ms in every run of session 35; both trees ran
# the crowd.py whose clients check their answers after the crowd (ea9ff64), not between recalls.
# This separates the two: one tree (src), the crowd.py of 39799a6 (checks between recalls) and
# this one, alternated twice, C = 16, 32, 64, default serve. Predicted: if the hotter loop is
# the cause, the old crowd.py's late connects read ~2-3 ms and the new one's 8-20 ms, with the new
# one's rate a few percent higher.
#   mkdir -p .snap/crowd-old && git show 39799a6:src/kalos/tools/crowd.py > .snap/crowd-old/crowd.py
#   BUDGET_S=400 OUT=$OUT bash benchmarks/results/h100-s37/next.sh   (carry .snap/crowd-old)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
[ -f .snap/crowd-old/crowd.py ] || { echo "missing .snap/crowd-old/crowd.py: see this script's header"; exit 1; }
build_fence src
for label in new old new2 old2; do
  script=src/kalos/tools/crowd.py; [[ $label == old* ]] && script=.snap/crowd-old/crowd.py
  (( SECONDS + 60 < budget )) || { echo "--- skipped $label: ${SECONDS}s gone"; continue; }
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"; echo "##### $label" >> $OUT/crowd-connects.txt
  PYTHONPATH=src timeout $(( budget - SECONDS )) python3 $script --device cuda --crowd 16,32,64 --crowd-seconds 2 \
    >> $OUT/crowd-connects.txt 2>&1
  pkill -9 -f "kalos[ ]serve" 2>/dev/null
done
echo "=== done ${SECONDS}s"
summary
