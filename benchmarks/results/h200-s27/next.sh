#!/bin/bash
# Prepared in session 27 for the next device call (its three calls all ran on H100s): on the
# H200 the issue targets are set for, (1) the CUDA tests, with room (the slot server's take ~2
# minutes: session 27's 240 s limit cut them), (2) recall_text with the item cache (main)
# against 6f05662 (.snap/trees/s27-base) and against itself with the cache off (a memory's
# first recall), alternated (budget: the tests ~150 s, then ~45 s a run), (3) the crowd 1-64 with a
# warm-up crowd first (the first crowd of a call beside the GEMMs read 2.6-2.7 ms at C = 64
# twice, an order effect), main then the base then main again.
# Before the call: rm -rf .snap/trees/s27-base && mkdir -p .snap/trees/s27-base &&
#   git archive 6f05662 src | tar -x -C .snap/trees/s27-base
# Carry .snap/model, .snap/trees/s27-base and this folder. Two calls (each fits 600 s):
#   PART=1 BUDGET_S=560 OUT=$OUT bash this   (the tests, recall_text)
#   PART=2 BUDGET_S=560 OUT=$OUT bash this   (the crowds)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s27-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-560}
B=.snap/trees/s27-base/src
pkill -9 -f "kalos serve" 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
text() { # tree label [env...]
  local src=$1 label=$2; shift 2
  room 60 "text $label" || return 1
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  env "$@" PYTHONPATH=.snap/model:$src timeout 100 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 300 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null; sleep 1
  grep -E "one round trip \|" $OUT/text-$label.txt | head -1
}
crowd() { # tree label [colocated]
  room 125 "crowd $2" || return 1
  echo "=== crowd $2 $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$1 timeout $(( budget - SECONDS )) python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 ${3:+--colocated $3} > $OUT/crowd-$2.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
  grep -E "GEMMs|Traceback|Error" $OUT/crowd-$2.txt | head -4
}
if [ "${PART:-1}" = 1 ]; then
echo "=== GPU tests $(date +%T)"
PYTHONPATH=.snap/model:src timeout 330 python3 -m pytest -q -p no:cacheprovider -m cuda --durations=5 \
  tests/test_sidecar_embed.py tests/test_minilm_kernels.py tests/test_torch_engine.py tests/test_slot_server.py \
  > $OUT/gpu-tests.txt 2>&1; tail -3 $OUT/gpu-tests.txt
pkill -9 -f "kalos serve" 2>/dev/null
# (nocache: the same tree with the cache off, what a memory's first recall costs)
text src cache-1; text $B base-1; text src nocache-1 KALOS_ITEM_CACHE_BYTES=0; text src cache-2; text $B base-2
text src nocache-2 KALOS_ITEM_CACHE_BYTES=0; text src cache-3
else
PYTHONPATH=src timeout 60 python3 src/kalos/tools/crowd.py --device cuda --crowd 64 --crowd-seconds 2 \
  --colocated 64 > $OUT/crowd-warmup.txt 2>&1; pkill -9 -f "kalos serve" 2>/dev/null
crowd src main 16,64; crowd $B base 16,64; crowd src main-2 16,64
fi
echo; echo "=== recall_text one round trip p50 / p99 ms"
for f in $(ls $OUT/text-*.txt 2>/dev/null); do
  printf "%-10s %s\n" $(basename $f .txt) "$(grep 'one round trip |' $f | awk -F'|' '{print $3, "/", $4}')"; done
echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $(ls $OUT/crowd-*.txt 2>/dev/null); do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
cd $OUT && ls text-*.txt >/dev/null 2>&1 && tar czf texts.tgz text-*.txt && rm text-*.txt
