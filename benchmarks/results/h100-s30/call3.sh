#!/bin/bash
# Session 30, call 3: the crowd 1-64 (kalos.tools.crowd, default `kalos serve --device cuda`,
# 65,536 x 1024, k = 8) with 16 and 64 beside the GEMMs, this tree against the session's start
# (538d535, .snap/trees/s30-base), after a warm-up crowd: this, base, this with each query read
# from its slot by 8 programs (.snap/trees/s30-split: this src with Tuning.stage_split = 8),
# this again.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s30/call3.sh   (carry .snap/trees/s30-base, .snap/trees/s30-split, this folder)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s30-base/src .snap/trees/s30-split/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-540}
B=.snap/trees/s30-base/src
nvidia-smi --query-gpu=name --format=csv,noheader
crowd() { # tree label [colocated]
  (( SECONDS + 110 < budget )) || { echo "--- skipped crowd $2: ${SECONDS}s gone"; return 1; }
  echo "=== crowd $2 $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$1 timeout $(( budget - SECONDS )) python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd ${CROWD:-1,2,4,8,16,32,64} --crowd-seconds 2 ${3:+--colocated $3} > $OUT/crowd-$2.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
  grep -E "Traceback|Error" $OUT/crowd-$2.txt | head -4
}
PYTHONPATH=src timeout 90 python3 src/kalos/tools/crowd.py --device cuda --crowd 64 --crowd-seconds 2 \
  --colocated 64 > $OUT/crowd-warmup.txt 2>&1; pkill -9 -f "kalos serve" 2>/dev/null
crowd src main 16,64; crowd $B base 16,64; crowd .snap/trees/s30-split/src split8 16,64; crowd src main-2 16,64
echo "=== crowds, ${SECONDS}s"
for f in $(ls $OUT/crowd-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"; grep -E "^ +[0-9]+ +[0-9.]+ |GEMMs [0-9]" $f | head -14; done
