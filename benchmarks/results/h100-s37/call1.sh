#!/bin/bash
# Session 37, call 1: session 36's next.sh (h100-s36/next.sh: the places CUDA tests, the crowd's
# floor over 1,024 rows, the `--gpu-polling off` agents crowd against c5539f3), with the client's
# own cost (benchmarks/client_cost.py) run on this tree and on c5539f3, alternated twice.
# This tree's Client.recall takes a short path for its usual call (Client._recall_one).
# Predicted: the client's cost on this host about 3x the 2-vCPU VM's (there, against an answerer
# that answers at once: c5539f3 about 5.4 us, this tree about 4.2); the crowd's floor at N = 1,024
# near 150 us at C = 64; the sweep's agents crowd as session 35's call 3 (C = 64 about 100k/s).
#   mkdir -p .snap/trees/s35-base && git archive c5539f3 src | tar -x -C .snap/trees/s35-base
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s37/call1.sh   (carry .snap/trees/s35-base)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B: see this script's header"; exit 1; }
build_fence src $B
for t in src $B src $B; do echo "=== client cost $t $(date +%T) (${SECONDS}s)" | tee -a $OUT/client-cost.txt
  PYTHONPATH=$t timeout 60 python3 benchmarks/client_cost.py >> $OUT/client-cost.txt 2>&1; done; cat $OUT/client-cost.txt
cuda_tests 120 tests/test_torch_engine.py -k places
FAST="--serve-arg=--precision --serve-arg=fast"
for n in 1024 65536; do
  NEED_S=45 INTO=floor CROWD=16,64 crowd src exact-n$n "" --n $n
  NEED_S=45 INTO=floor CROWD=16,64 crowd src fast-n$n "" --n $n $FAST
done
OFF="--serve-arg=--gpu-polling --serve-arg=off"
NEED_S=100 INTO=off-agents crowd src this-off-agents 16,64 --crowd-scopes agents $OFF
NEED_S=100 INTO=off-agents crowd $B base-off-agents 16,64 --crowd-scopes agents $OFF
echo "=== done ${SECONDS}s"
summary
