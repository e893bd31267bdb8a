#!/bin/bash
# Session 27, call 3: the crowd 1-64 (alone, and 16 and 64 beside the GEMMs) with the item cache
# (src) beside main before it (.snap/trees/s27-base), in one call; the cache is not on the
# crowd's path (single recalls through the slots), so the prediction is: alike within noise.
# Then one more recall_text pair if the budget leaves room. Carry .snap/model,
# .snap/trees/s27-base and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s27-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-380}
pkill -9 -f "kalos serve" 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
crowd() { # tree label
  local src=$1 label=$2
  (( SECONDS + 120 < budget )) || { echo "--- skipped crowd $label: ${SECONDS}s gone"; return 1; }
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$src timeout $(( budget - SECONDS )) python3 $src/kalos/tools/crowd.py --device cuda \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 --colocated 16,64 > $OUT/crowd-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$label.txt | head -6
}
text() { # tree label
  local src=$1 label=$2
  (( SECONDS + 55 < budget )) || { echo "--- skipped text $label: ${SECONDS}s gone"; return 1; }
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/model:$src timeout 90 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 300 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null; sleep 1
  grep -E "one round trip \|" $OUT/text-$label.txt | head -1
}
B=.snap/trees/s27-base/src
crowd src cache; crowd $B base
text src cache-5; text $B base-5
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
