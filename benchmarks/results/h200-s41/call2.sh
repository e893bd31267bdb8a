#!/bin/bash
# Session 41, second device call. On an H200: issue 18's measurement (h200-s40/call2.sh) and
# nothing else (it takes the call). On any other card: AsyncClient's coroutines, this tree
# against a candidate (.snap/trees/cand41: a request carrying several callers' recalls spins as
# long as a lone recall's, by the adaptive rule, instead of SHORT_SPIN_US at most; only callers
# queued behind it keep it short), alternated src, cand, src, cand. Predicted on an H100: 16
# coroutines ~20% more recalls/s (a batch of 16 is answered in ~226 us, within the whole 250 us
# spin, so the round skips the sleep and the sidecar's bell); 64 within the spread (its ~300 us
# answer outlasts the whole spin, and three misses shorten it).
#   mkdir -p .snap/trees/cand41 && git archive HEAD src | tar -x -C .snap/trees/cand41, then
#   the one-line change in _others_wait (benchmarks/results/h200-s41/cand41.patch)
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s41/call2.sh
#     (carry benchmarks/results/h200-s40, benchmarks/results/h200-s41, .snap/trees/s35-base, .snap/trees/cand41)
cd "$(dirname "$0")/../../.."
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
if [[ $card == *H200* && -z $ASYNC_ONLY ]]; then exec bash benchmarks/results/h200-s40/call2.sh; fi
source benchmarks/results/h100-s32/lib.sh
C=.snap/trees/cand41/src
build_fence src $C
for t in src $C src $C; do
  (( SECONDS + 45 < budget )) || break
  echo "== $t $(date +%T) (${SECONDS}s)" | tee -a $OUT/async-cand.txt
  PYTHONPATH=$t timeout $(( budget - SECONDS )) python3 benchmarks/async_client.py --device cuda --sizes 65536 \
    --dim 1024 --recalls 3000 --coroutines 1,16,64 --only-coroutines >> $OUT/async-cand.txt 2>&1
  pkill -9 -f "kalos[ ]serve" 2>/dev/null
done
grep -E "^==|coroutines at once|Error" $OUT/async-cand.txt
