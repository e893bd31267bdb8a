#!/bin/bash
# Session 37, call 4: call3.sh cut to fit what device time the failed starts left: the client's
# own cost (this tree and c5539f3), the default crowd (GPU polling, exact, C = 1-64 with the
# co-located case) this then base, the places CUDA tests, fast precision at C = 1, 16, 64, then
# the floor if time is left. Predictions as in call3.sh.
#   BUDGET_S=<s> OUT=$OUT bash benchmarks/results/h100-s37/call4.sh   (carry .snap/trees/s35-base)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B"; exit 1; }
build_fence src $B
for t in src $B; do echo "=== client cost $t $(date +%T) (${SECONDS}s)" | tee -a $OUT/client-cost.txt
  PYTHONPATH=$t timeout 40 python3 benchmarks/client_cost.py >> $OUT/client-cost.txt 2>&1; done; cat $OUT/client-cost.txt
NEED_S=100 INTO=default crowd src this 16,64
NEED_S=100 INTO=default crowd $B base 16,64
cuda_tests 120 tests/test_torch_engine.py -k places
NEED_S=45 INTO=fast CROWD=1,16,64 crowd src this-fast "" --serve-arg=--precision --serve-arg=fast
NEED_S=40 INTO=floor CROWD=16,64 crowd src exact-n1024 "" --n 1024
echo "=== done ${SECONDS}s"
summary
