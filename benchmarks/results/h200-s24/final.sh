#!/bin/bash
# Session 24, the second call: main with the sweep's wait for the kernel's news (issue 20's GIL
# fix, candidate-watch.patch) and the gathering rounds with yielding crowded clients
# (candidate-gather.patch) landed, beside the baseline .snap/trees/n-base (main before them) in
# one call: the crowd 1-64 and beside the GEMMs at 1, 16, 64, main first; recall_text on main if time is left.
# n-base: mkdir -p .snap/trees/n-base && git archive 5468e60 src | tar -x -C .snap/trees/n-base.
# Carry .snap/model, .snap/trees/n-base and this folder. Budget from BUDGET_S.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/n-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-585}
nvidia-smi --query-gpu=name --format=csv,noheader
crowd() { # tree label
  echo "=== crowd $2 $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$1 timeout $(( budget - SECONDS )) python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd ${CROWD_SIZES:-1,2,4,8,16,32,64} --crowd-seconds 2 --colocated ${COLOCATED:-1,16,64} > $OUT/crowd-$2.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$2.txt | head -6
}
crowd src main
crowd .snap/trees/n-base/src base
if (( SECONDS + 45 < budget )); then
  echo "=== text main $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/model:src timeout $(( budget - SECONDS )) python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 100 --embed-runtime triton > $OUT/text-main.txt 2>&1
  grep -E "one round trip|three round|embed op|Error|Traceback" $OUT/text-main.txt | head -4
fi
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
done
