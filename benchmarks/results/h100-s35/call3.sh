#!/bin/bash
# Session 35, call 3: call 2's `--gpu-polling off` agents crowd at every size with its co-located
# case (bf16 GEMMs beside C = 16 and 64), and the one-namespace crowd with polling off (its path,
# _answer_uniform, did not change: predicted the same), this tree against c5539f3 (.snap/trees/s35-base).
#   BUDGET_S=420 OUT=$OUT bash benchmarks/results/h100-s35/call3.sh   (carry .snap/trees/s35-base, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
build_fence src $B
OFF="--serve-arg=--gpu-polling --serve-arg=off"
NEED_S=100 INTO=off-agents crowd src this-off-agents 16,64 --crowd-scopes agents $OFF
NEED_S=100 INTO=off-agents crowd $B base-off-agents 16,64 --crowd-scopes agents $OFF
NEED_S=30 INTO=off CROWD=1,16,64 crowd src this-off "" $OFF
NEED_S=30 INTO=off CROWD=1,16,64 crowd $B base-off "" $OFF
echo "=== done ${SECONDS}s"
summary
