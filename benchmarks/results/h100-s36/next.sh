#!/bin/bash
# For the next session's first device call (sessions 35 and 36 could not start a machine): one
# call for what session 35 left unmeasured on a GPU.
# 1. The places CUDA tests (the 1-place passes the sweep can now queue ran under the interpreter only).
# 2. The crowd's floor on the host (h100-s35/next.sh): the default serve, exact and fast, over 1,024
#    rows then 65,536, C = 16 and 64. Predicted: C = 64 p50 near 150 us at N = 1,024 for exact and
#    fast alike (the clients' turnaround and the rounds' gathering, not the pass), which would put
#    issue 18's fast target (0.6x the exact 250 us) at that floor.
# 3. `--gpu-polling off`, agents each in their own namespace, C = 1-64 with the co-located case,
#    HEAD against c5539f3 (.snap/trees/s35-base): c7224a2 and 54bcfe6 never ran on a GPU.
#    Predicted: the same as session 35's call 3 within its noise (C = 64 about 100k recalls/s).
# 4. What a recall costs the client process by itself on this host (benchmarks/client_cost.py:
#    4.8-8.3 us p50 on the 2-vCPU VM in session 36, cpu-s36/client-cost.txt). Predicted: about 3x that (this host's Python
#    ran sum(range(10000)) 3x slower in session 26): at C = 64, four clients a core, 60 us or more of
#    each round would be the clients' own Python.
#   mkdir -p .snap/trees/s35-base && git archive c5539f3 src | tar -x -C .snap/trees/s35-base
#   BUDGET_S=590 OUT=$OUT bash benchmarks/results/h100-s36/next.sh
#     (carry .snap/trees/s35-base, benchmarks/results/h100-s36, benchmarks/results/h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B: see this script's header"; exit 1; }
build_fence src $B
echo "=== client cost $(date +%T) (${SECONDS}s)"
PYTHONPATH=src timeout 60 python3 benchmarks/client_cost.py > $OUT/client-cost.txt 2>&1; cat $OUT/client-cost.txt
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
