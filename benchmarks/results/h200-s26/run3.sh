#!/bin/bash
# Session 26, call 3: this session's recall_text changes (the graphed embedder's copies inside
# its graph and a one-text path; `kalos serve` sets a 50 us switch interval; replies encoded
# once, their exact size checked) in src, beside .snap/trees/s26-base (4e1b8fa, main before
# them): recall_text on 65,536 x 384 (benchmarks/text_recall.py), then the crowd 1-64 alone and
# beside the GEMMs at 16 and 64, then src with a 20 us switch interval, each while BUDGET_S
# leaves room. Carry .snap/model, .snap/trees/s26-base and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s26-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-480}
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
text() { # tree label env...
  local src=$1 label=$2; shift 2
  room 60 "text $label" || return 1
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  env "$@" PYTHONPATH=.snap/model:$src timeout 90 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 200 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  grep -E "one round trip|three round|embed op|get of|recall of|in process|Error|Traceback" $OUT/text-$label.txt | head -7
}
crowd() { # tree label
  room 110 "crowd $2" || return 1
  echo "=== crowd $2 $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$1 timeout $(( budget - SECONDS )) python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 --colocated 16,64 > $OUT/crowd-$2.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$2.txt | head -6
}
text src cand DUMMY=1
text .snap/trees/s26-base/src base DUMMY=1
crowd src cand
crowd .snap/trees/s26-base/src base
text src cand-switch20 KALOS_SIDECAR_SWITCH_US=20
text .snap/trees/s26-base/src base-2 DUMMY=1
text src cand-2 DUMMY=1
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
