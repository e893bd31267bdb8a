#!/bin/bash
# Session 34, call 2: the sweep's pass of agents in namespaces of their own (`--gpu-polling off`:
# one pass, each query's namespace its own, where each namespace was a pass of its own; predicted
# C = 16 from under 10k recalls/s to over 40k), against 9e9e84f (.snap/trees/s34-base: `git
# archive 9e9e84f src`), 65,536 x 1024, k = 8, 2 s a crowd: the engine's places CUDA tests; the
# agents crowd 1-64, its colocated 16 and 64, the one-scope crowd with polling off; and the
# default (GPU polling) crowd at 1, 16, 64 of both trees (the graph key's change touches every pass).
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h100-s34/call2.sh   (carry .snap/trees/s34-base, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s34-base/src
build_fence src $B
cuda_tests ${TESTS_S:-90} tests/test_torch_engine.py -k "places"
OFF="--serve-arg=--gpu-polling --serve-arg=off"
NEED_S=45 INTO=off-agents CROWD=1,4,16,64 crowd src this-off-agents "" --crowd-scopes agents $OFF
NEED_S=45 INTO=off-agents CROWD=1,4,16,64 crowd $B base-off-agents "" --crowd-scopes agents $OFF
NEED_S=30 INTO=off CROWD=1,16,64 crowd src this-off "" $OFF
NEED_S=30 INTO=off CROWD=1,16,64 crowd $B base-off "" $OFF
NEED_S=30 INTO=default CROWD=1,16,64 crowd src this ""
NEED_S=30 INTO=default CROWD=1,16,64 crowd $B base ""
NEED_S=60 INTO=off-colo CROWD=16 crowd src this-off-colo-agents 16,64 --crowd-scopes agents $OFF
NEED_S=60 INTO=off-colo CROWD=16 crowd $B base-off-colo-agents 16,64 --crowd-scopes agents $OFF
echo "=== done ${SECONDS}s"
summary
