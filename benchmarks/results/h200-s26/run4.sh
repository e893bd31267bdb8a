#!/bin/bash
# Session 26, call 4 (the budget's last minutes): recall_text with src as landed (Python's switch
# interval by default) beside .snap/trees/s26-base, and src with KALOS_SIDECAR_SWITCH_US=20
# twice. Carry .snap/model, .snap/trees/s26-base and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s26-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-160}
text() { # tree label env...
  local src=$1 label=$2; shift 2
  (( SECONDS + 35 < budget )) || { echo "--- skipped $label"; return 1; }
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  env "$@" PYTHONPATH=.snap/model:$src timeout 60 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 150 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  grep -E "one round trip|embed op|get of" $OUT/text-$label.txt | head -3
}
text src switch20 KALOS_SIDECAR_SWITCH_US=20
text src landed DUMMY=1
text .snap/trees/s26-base/src base DUMMY=1
text src switch20-2 KALOS_SIDECAR_SWITCH_US=20
