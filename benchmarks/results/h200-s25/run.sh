#!/bin/bash
# Session 25, one device call: main (the sweep's wait for the kernel's news and the gathering
# rounds with yielding crowded clients, both landed in session 24) beside the baseline
# .snap/trees/n-base (5468e60, main before them): the crowd 1-64 and beside the GEMMs at 1, 16,
# 64. Then the candidate .snap/trees/n-yieldnap (main, but a client that spun yielding naps before
# it sleeps: the GEMM case's cost), recall_text on main, and main in fast precision, each while
# the budget (BUDGET_S) leaves room. A table of every crowd last.
# Trees: mkdir -p .snap/trees/n-base && git archive 5468e60 src | tar -x -C .snap/trees/n-base;
# n-yieldnap is main with ClientChannel._budgets returning (spin, True, True) for yielders.
# Carry .snap/model, .snap/trees/n-base, .snap/trees/n-yieldnap.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/n-base/src .snap/trees/n-yieldnap/src; do
  [ -d $s ] || continue
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-580}
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
crowd() { # tree label sizes colocated estimate extra...
  local src=$1 label=$2 sizes=$3 colo=$4 est=$5; shift 5
  room $est "crowd $label" || return 1
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$src timeout $(( budget - SECONDS )) python3 $src/kalos/tools/crowd.py --device cuda \
    --crowd $sizes --crowd-seconds 2 ${colo:+--colocated $colo} "$@" > $OUT/crowd-$label.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$label.txt | head -6
}
all=1,2,4,8,16,32,64
crowd src main $all 1,16,64 140
crowd .snap/trees/n-base/src base $all 1,16,64 140
crowd .snap/trees/n-yieldnap/src yieldnap 1,16,64 16,64 80
if room 60 "text main"; then
  echo "=== text main $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/model:src timeout 80 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 100 --embed-runtime triton > $OUT/text-main.txt 2>&1
  grep -E "one round trip|three round|embed op|Error|Traceback" $OUT/text-main.txt | head -4
fi
crowd src main-fast 1,16,64 "" 40 --serve-arg=--precision --serve-arg=fast
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
done
