#!/bin/bash
# Session 33, call 2: per-query namespaces in the GPU rounds (this tree) against dff6d2d
# (.snap/trees/s33-base), the crowds of `kalos serve --device cuda --precision fast` at 1, 16,
# 64, and beside a process running bf16 GEMMs (the LLM's stand-in) at 16 and 64, both trees
# each; then this tree's 'agents' crowd beside the GEMMs.
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h100-s33/call2.sh   (carry .snap/trees/s33-base, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s33-base/src
build_fence src $B
nvidia-smi --query-gpu=name --format=csv,noheader
FAST="--serve-arg=--precision --serve-arg=fast"
NEED_S=40 INTO=fast CROWD=1,16,64 crowd src this-fast "" $FAST
NEED_S=40 INTO=fast CROWD=1,16,64 crowd $B base-fast "" $FAST
NEED_S=60 INTO=colo CROWD=16,64 crowd src this-colo 16,64
NEED_S=60 INTO=colo CROWD=16,64 crowd $B base-colo 16,64
NEED_S=60 INTO=colo CROWD=16,64 crowd src this-colo-agents 16,64 --crowd-scopes agents
echo "=== done ${SECONDS}s"
summary
