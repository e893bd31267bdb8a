#!/bin/bash
# Prepared in session 25 for the next device call (no second machine came): where recall_text's
# time goes on the GPU sidecar
# (probe/probe_text.py: timers inside the sidecar, py-spy on it), GPU polling on and off; main
# against the candidate .snap/trees/n-yieldnap (a client that spun yielding naps before it
# sleeps) beside the GEMMs at C = 16 and 64 (the first call's yieldnap doubled C = 64's rate
# there: noise or not), and against .snap/trees/n-gap0 (main with DEFAULT_GAP_S = 0) alone at
# 1-64; a control operation's round trip with and without the client's look for the reply
# (benchmarks/control_round_trip.py); in order of what matters most, each while BUDGET_S leaves room.
# Carry .snap/model, .snap/bin (py-spy), .snap/trees/n-{yieldnap,gap0} and this folder.
# Trees (main's src at the time of the run, one change each) and .snap/bin/py-spy: make_trees.sh
# beside this script (n-gap0 sets DEFAULT_GAP_S = 0.0 in kalos/engine/gpu/slot_server.py;
# n-yieldnap makes ClientChannel._budgets return (self._spin_s, True, True) for a yielding client).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/n-yieldnap/src .snap/trees/n-gap0/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-580}
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
probe() { # label extra...
  room 60 "probe $1" || return 1
  echo "=== probe $1 $(date +%T) (${SECONDS}s)"
  local label=$1; shift
  PYTHONPATH=.snap/model:src timeout $(( budget - SECONDS < 150 ? budget - SECONDS : 150 )) python3 benchmarks/results/h200-s25/probe/probe_text.py --label $label \
    --out $OUT "$@" > $OUT/probe-$label.txt 2>&1
  tail -3 $OUT/probe-$label.txt
}
crowd() { # tree label [sizes [colocated]]
  room 30 "crowd $2" || return 1
  echo "=== crowd $2 $(date +%T) (${SECONDS}s)"
  local colo=${4-16,64}
  PYTHONPATH=$1 timeout $(( budget - SECONDS )) python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd ${3:-16,64} --crowd-seconds 2 ${colo:+--colocated $colo} > $OUT/crowd-$2.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$2.txt | head -6
}
# In order of what matters most, each while the budget leaves room.
probe polling --py-spy .snap/bin/py-spy
if room 40 "control round trips"; then
  echo "=== control round trips $(date +%T) (${SECONDS}s)"
  PYTHONPATH=src timeout 60 python3 benchmarks/control_round_trip.py --device cuda --blocks 6 --rounds 1200 \
    > $OUT/control-round-trip.txt 2>&1; tail -4 $OUT/control-round-trip.txt
fi
# Does the gathering's gap rule (10 us) cost C = 16 the ~10 us it lost in the first call? n-gap0:
# main with DEFAULT_GAP_S = 0 (a round goes at its 20 us window, as before session 24).
crowd .snap/trees/n-gap0/src gap0-1 16,32,64 ""; crowd src main-3 16,32,64 ""; crowd .snap/trees/n-gap0/src gap0-2 16,32,64 ""
probe polling-off --serve-arg=--gpu-polling --serve-arg=off
crowd src main-1; crowd .snap/trees/n-yieldnap/src yieldnap-1
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
for f in $OUT/probe-*.txt; do echo "--- $f"; sed -n '/client p50/,/py-spy --idle/p' $f | head -45; done
