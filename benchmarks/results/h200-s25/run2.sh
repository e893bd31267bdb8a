#!/bin/bash
# Session 25, the second call: where recall_text's time goes on the GPU sidecar
# (probe/probe_text.py: timers inside the sidecar, py-spy on it), GPU polling on and off; then
# main against the candidate .snap/trees/n-yieldnap beside the GEMMs at C = 16 and 64, twice,
# alternated (the first call's yieldnap doubled C = 64's rate beside the GEMMs: noise or not).
# Then main against .snap/trees/n-gap0 (no gap rule) alone at 1, 16, 32, 64.
# Carry .snap/model, .snap/bin (py-spy), .snap/trees/n-{yieldnap,gap0} and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/n-yieldnap/src .snap/trees/n-gap0/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-580}
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
probe() { # label extra...
  room 90 "probe $1" || return 1
  echo "=== probe $1 $(date +%T) (${SECONDS}s)"
  local label=$1; shift
  PYTHONPATH=.snap/model:src timeout 150 python3 benchmarks/results/h200-s25/probe/probe_text.py --label $label \
    --out $OUT "$@" > $OUT/probe-$label.txt 2>&1
  tail -3 $OUT/probe-$label.txt
}
crowd() { # tree label [sizes [colocated]]
  room 50 "crowd $2" || return 1
  echo "=== crowd $2 $(date +%T) (${SECONDS}s)"
  local colo=${4-16,64}
  PYTHONPATH=$1 timeout $(( budget - SECONDS )) python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd ${3:-16,64} --crowd-seconds 2 ${colo:+--colocated $colo} > $OUT/crowd-$2.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$2.txt | head -6
}
# In order of what matters most, each while the budget leaves room.
probe polling --py-spy .snap/bin/py-spy
crowd src main-1; crowd .snap/trees/n-yieldnap/src yieldnap-1
# Does the gathering's gap rule (10 us) cost C = 16 the ~10 us it lost in the first call? n-gap0:
# main with DEFAULT_GAP_S = 0 (a round goes at its 20 us window, as before session 24).
crowd .snap/trees/n-gap0/src gap0-1 1,16,32,64 ""; crowd src main-3 1,16,32,64 ""
probe polling-off --serve-arg=--gpu-polling --serve-arg=off
crowd src main-2; crowd .snap/trees/n-yieldnap/src yieldnap-2
crowd .snap/trees/n-gap0/src gap0-2 1,16,32,64 ""
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
for f in $OUT/probe-*.txt; do echo "--- $f"; sed -n '/client p50/,/py-spy --idle/p' $f | head -45; done
