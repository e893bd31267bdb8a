#!/bin/bash
# Session 35, call 2: the sweep's queued pass of single recalls in any mix of namespaces
# (`--gpu-polling off`: RecallLoop._queue_singles, each slot's namespace remembered, the rest of a
# mixed crowd left to the mixed path; predicted: agents as c5539f3 or a few us better a pass) and
# the GPU engine's attached passes moved to engine/gpu/attached.py (predicted: no change), against
# c5539f3 (.snap/trees/s35-base: `git archive c5539f3 src`), 65,536 x 1024, k = 8, 2 s a crowd:
# the engine's CUDA tests; `--gpu-polling off` agents at 1, 4, 16, 64; the default crowd 1-64 with
# its co-located case (bf16 GEMMs beside C = 16 and 64), both trees in one call.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s35/call2.sh   (carry .snap/trees/s35-base, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
build_fence src $B
cuda_tests ${TESTS_S:-130} tests/test_torch_engine.py
OFF="--serve-arg=--gpu-polling --serve-arg=off"
NEED_S=45 INTO=off-agents CROWD=1,4,16,64 crowd src this-off-agents "" --crowd-scopes agents $OFF
NEED_S=45 INTO=off-agents CROWD=1,4,16,64 crowd $B base-off-agents "" --crowd-scopes agents $OFF
NEED_S=120 INTO=default crowd src this 16,64
NEED_S=120 INTO=default crowd $B base 16,64
echo "=== done ${SECONDS}s"
summary
