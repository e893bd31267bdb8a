#!/bin/bash
# Session 27, call 2: recall_text with the sidecar's item cache (this tree, src) against main
# before it (.snap/trees/s27-base: HEAD at the call's start, 6f05662), alternated three times;
# then KALOS_SIDECAR_SWITCH_US=20 on each, alternated (call 1 saw it slower: 1.67 against
# 1.23 ms, where session 26 saw it faster). Prediction: the cache takes 0.15-0.3 ms off the
# one round trip (on the VM, in process with a stand-in embedder: 754 -> 639 us).
# Carry .snap/model, .snap/trees/s27-base and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s27-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-560}
nvidia-smi --query-gpu=name --format=csv,noheader
text() { # tree label env...
  local src=$1 label=$2; shift 2
  (( SECONDS + 60 < budget )) || { echo "--- skipped $label: ${SECONDS}s gone"; return 1; }
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  env "$@" PYTHONPATH=.snap/model:$src timeout 100 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 300 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null; sleep 1  # (a run cut by the timeout leaves its sidecar)
  grep -E "one round trip|embed op|get of" $OUT/text-$label.txt | head -3
}
B=.snap/trees/s27-base/src
text src cache-1 DUMMY=1; text $B base-1 DUMMY=1
text src cache-2 DUMMY=1; text $B base-2 DUMMY=1
text src cache-3 DUMMY=1; text $B base-3 DUMMY=1
text src cache-sw20-1 KALOS_SIDECAR_SWITCH_US=20; text src cache-4 DUMMY=1
text $B base-4 DUMMY=1
echo; echo "=== recall_text one round trip p50 / p99 ms, ${SECONDS}s"
for f in $OUT/text-*.txt; do  # (the files come back in one tar: at most 8 files return)
  printf "%-14s %s\n" $(basename $f .txt) "$(grep 'one round trip |' $f | awk -F'|' '{print $3, "/", $4}')"
done
cd $OUT && tar czf texts.tgz text-*.txt && rm text-*.txt
