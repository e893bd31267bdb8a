#!/bin/bash
# Session 37, call 3: one call for what matters most, as machines were scarce (four starts failed):
# 1. the client's own cost (benchmarks/client_cost.py), this tree and c5539f3 alternated;
# 2. the places CUDA tests (the 1-place passes the sweep can queue ran under the interpreter only);
# 3. the default crowd (GPU polling, exact, C = 1-64 with the co-located case) this, base, this;
# 4. if time is left, fast precision at C = 1, 16, 64 (this tree), then the floor: C = 16 and 64
#    over 1,024 rows.
# Predictions as call1.sh and call2.sh: the client's cost on this host about 3x the VM's and
# ~1.2 us x 3 less on this tree; the crowd C = 1 a few us under c5539f3, C = 16 and 64 a few
# percent faster; the floor at C = 64 near 150 us. Both trees run this checkout's crowd.py, whose
# clients check their answers after the crowd (ea9ff64), no longer between recalls: predicted,
# C = 64 some 10-20 us faster than session 35's records for either tree.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s37/call3.sh   (carry .snap/trees/s35-base)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B"; exit 1; }
build_fence src $B
for t in src $B; do echo "=== client cost $t $(date +%T) (${SECONDS}s)" | tee -a $OUT/client-cost.txt
  PYTHONPATH=$t timeout 40 python3 benchmarks/client_cost.py >> $OUT/client-cost.txt 2>&1; done; cat $OUT/client-cost.txt
cuda_tests 120 tests/test_torch_engine.py -k places
NEED_S=100 INTO=default crowd src this 16,64
NEED_S=100 INTO=default crowd $B base 16,64
NEED_S=100 INTO=default crowd src this2 16,64
NEED_S=45 INTO=fast CROWD=1,16,64 crowd src this-fast "" --serve-arg=--precision --serve-arg=fast
NEED_S=40 INTO=floor CROWD=16,64 crowd src exact-n1024 "" --n 1024
echo "=== done ${SECONDS}s"
summary
