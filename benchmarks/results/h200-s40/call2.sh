#!/bin/bash
# Session 40, second device call: issue 18's own measurement on whatever card comes (the H200
# the targets are for; none lent since session 26): the default crowd 1-64 with the co-located
# GEMMs at 16 and 64, this tree (TREE, default src) then c5539f3 (session 35's base, the baseline
# of BENCHMARKS.md's H100 tables), then fast precision at C = 1, 16, 64 on both. Predicted on an
# H200 from the H100 runs scaled by the single pass (74 against 97 us): this tree C = 16 about
# 135-145 us p50 at 105-115k/s, C = 64 230-250 us at 220-240k/s; fast C = 64 about 0.75x exact.
#   mkdir -p .snap/trees/s35-base && git archive c5539f3 src | tar -x -C .snap/trees/s35-base
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s40/call2.sh
#     (carry benchmarks/results/h200-s40 and .snap/trees/s35-base)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
T=${TREE:-src}
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B: see this script's header"; exit 1; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
[[ $card == *H200* || -n $ANY_CARD ]] || { echo "not an H200 (ANY_CARD=1 runs it anyway)"; exit 0; }
build_fence $T $B
FAST="--serve-arg=--precision --serve-arg=fast"
NEED_S=120 INTO=default crowd $T this 16,64
NEED_S=120 INTO=default crowd $B base 16,64
# One client's request of 16 or 64 queries (handed to the sweep by the polling rounds) against
# 16 or 64 clients' single recalls at once (gathered by the rounds): should AsyncClient spread?
(( SECONDS + 30 < budget )) && PYTHONPATH=$T timeout $(( budget - SECONDS )) python3 \
  benchmarks/results/h200-s40/batch_rtt.py > $OUT/batch-rtt.txt 2>&1
pkill -9 -f "kalos[ ]serve" 2>/dev/null
cat $OUT/batch-rtt.txt
NEED_S=40 INTO=fast CROWD=1,16,64 crowd $T this-fast "" $FAST
# AsyncClient's coroutines at this tree (session 40's first call read one coroutine's rate at 445
# recalls/s against a p50 of 130 us on an H100: some recall stalled for seconds; max shows it).
(( SECONDS + 40 < budget )) && PYTHONPATH=$T timeout $(( budget - SECONDS )) python3 benchmarks/async_client.py \
  --device cuda --sizes 65536 --dim 1024 --recalls 1500 --coroutines 1,16,64,1 --only-coroutines > $OUT/async-cuda.txt 2>&1
pkill -9 -f "kalos[ ]serve" 2>/dev/null
grep -E "p50" $OUT/async-cuda.txt
NEED_S=40 INTO=fast CROWD=1,16,64 crowd $B base-fast "" $FAST
echo "=== done ${SECONDS}s"
summary
cat $OUT/batch-rtt.txt
