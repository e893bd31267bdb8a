#!/bin/bash
# Session 31, call 1 (asked for an H200): the crowd 1-64 (kalos.tools.crowd, default
# `kalos serve --device cuda`, 65,536 x 1024, k = 8, 2 s a crowd) with 16 and 64 beside the
# GEMMs, this tree (4b7f4da) against 538d535 (.snap/trees/s30-base: git archive 538d535 src),
# after a short warm-up crowd; then this tree's fast precision crowd; recall_text (issue 20,
# 65,536 x 384, the item cache on); the rounds in process, kernels profiled at 16 and 64.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s31/call1.sh
#   (carry .snap/trees/s30-base, .snap/model, this folder)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s30-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-540}
B=.snap/trees/s30-base/src
nvidia-smi --query-gpu=name --format=csv,noheader
crowd() { # tree label [colocated] [serve args...]
  local tree=$1 label=$2 colo=$3; shift 3
  (( SECONDS + 100 < budget )) || { echo "--- skipped crowd $label: ${SECONDS}s gone"; return 1; }
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 $tree/kalos/tools/crowd.py --device cuda \
    --crowd ${CROWD:-1,2,4,8,16,32,64} --crowd-seconds 2 ${colo:+--colocated $colo} "$@" > $OUT/crowd-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
  grep -E "Traceback|Error" $OUT/crowd-$label.txt | head -4
}
PYTHONPATH=src timeout 60 python3 src/kalos/tools/crowd.py --device cuda --crowd 16 --crowd-seconds 1 \
  > $OUT/crowd-warmup.txt 2>&1; pkill -9 -f "kalos serve" 2>/dev/null
crowd src this 16,64
crowd $B base 16,64
crowd src this-fast "" --serve-arg=--precision --serve-arg=fast
if (( SECONDS + 90 < budget )); then
  echo "=== text $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/model:src timeout 90 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 300 --embed-runtime triton > $OUT/text-cache.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
fi
if (( SECONDS + 60 < budget )); then
  echo "=== rounds $(date +%T) (${SECONDS}s)"
  PYTHONPATH=src timeout $(( budget - SECONDS )) python3 benchmarks/rounds.py --sizes 1,8,16,32,64 --rounds 300 \
    --profile 16,64 > $OUT/rounds.txt 2>&1
fi
echo "=== done ${SECONDS}s"
for f in $(ls $OUT/crowd-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"; grep -E "^ +[0-9]+ +[0-9.]+ |GEMMs [0-9]" $f | head -14; done
grep -E "one round trip \||in process" $OUT/text-cache.txt 2>/dev/null | head -4
grep -A6 "^variant" $OUT/rounds.txt 2>/dev/null
