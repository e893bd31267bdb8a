#!/bin/bash
# Session 31, call 4: collect_kernel walking the picked groups 16 or 32 at a time (pipeline's
# _COLLECT_STEP; .snap/trees/s31-step16, -step32: git archive 4b7f4da src with that constant
# changed) against 8 (4b7f4da, .snap/trees/s31-base): the rounds in process (kernels profiled at
# 16 and 64), then the exact crowd 1-64 of each (default `kalos serve --device cuda`, 65,536 x
# 1024, k = 8, 2 s a crowd), then 16 and 64 beside the GEMMs for step16 and base.
#   BUDGET_S=395 OUT=$OUT bash benchmarks/results/h100-s31/call4.sh   (as run; the default is 400)   (carry the three trees, this folder)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
T=.snap/trees
for s in $T/s31-base/src $T/s31-step16/src $T/s31-step32/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-400}
nvidia-smi --query-gpu=name --format=csv,noheader
crowd() { # tree label [colocated] [args...]
  local tree=$1 label=$2 colo=$3; shift 3
  (( SECONDS + 40 < budget )) || { echo "--- skipped crowd $label: ${SECONDS}s gone"; return 1; }
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 $tree/kalos/tools/crowd.py --device cuda \
    --crowd ${CROWD:-1,2,4,8,16,32,64} --crowd-seconds 2 ${colo:+--colocated $colo} "$@" > $OUT/crowd-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
  grep -E "Traceback|Error" $OUT/crowd-$label.txt | head -4
}
rounds() { # label tree [args...]
  local label=$1 tree=$2; shift 2
  (( SECONDS + 45 < budget )) || { echo "--- skipped rounds $label: ${SECONDS}s gone"; return; }
  echo "=== rounds $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 benchmarks/rounds.py --sizes 1,8,16,32,64 --rounds 300 "$@" \
    > $OUT/rounds-$label.txt 2>&1
}
rounds base $T/s31-base/src --profile 16,64
rounds step16 $T/s31-step16/src --profile 16,64
rounds step32 $T/s31-step32/src --profile 16,64
crowd $T/s31-base/src base ""
crowd $T/s31-step16/src step16 ""
crowd $T/s31-step32/src step32 ""
CROWD=16,64 crowd $T/s31-step16/src step16-colo 16,64
CROWD=16,64 crowd $T/s31-base/src base-colo 16,64
echo "=== done ${SECONDS}s"
for f in $(ls $OUT/crowd-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"; grep -E "^ +[0-9]+ +[0-9.]+ |GEMMs [0-9]" $f | head -14; done
for f in $(ls $OUT/rounds-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"; grep -A3 "^variant" $f; grep -E "collect_kernel" $f; done
