#!/bin/bash
# Session 32, call 3: collect_kernel no longer masks the scan's scores again (they come masked;
# a GEMM's still are), this tree against d036a93 (.snap/trees/s32-base): the rounds in process
# at 1, 16, 64 (kernels profiled at 16 and 64) and this tree's with every request in its own
# window; the exact crowd 1-64 of each (default `kalos serve --device cuda`, 65,536 x 1024, k =
# 8, 2 s a crowd); the fast crowd at 1, 16, 64 of each, and this tree's with windows; the mixed
# crowd (a third each: all namespaces, 'default', a window) at 16 and 64 of each.
#   BUDGET_S=570 OUT=$OUT bash benchmarks/results/h100-s32/call3.sh   (carry .snap/trees/s32-base, this folder)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s32-base/src
build_fence src $B
nvidia-smi --query-gpu=name --format=csv,noheader
rounds this src --sizes 1,16,64 --profile 16,64
rounds base $B --sizes 1,16,64 --profile 16,64
NEED_S=200 rounds this-windows src --sizes 16,64 --profile 16,64 --windows
crowd src this ""
crowd $B base ""
FAST="--serve-arg=--precision --serve-arg=fast"
NEED_S=30 INTO=fast CROWD=1,16,64 crowd src this-fast "" $FAST
NEED_S=30 INTO=fast CROWD=1,16,64 crowd $B base-fast "" $FAST
NEED_S=30 INTO=mixed CROWD=16,64 crowd src this-mixed "" --crowd-scopes mixed
NEED_S=30 INTO=mixed CROWD=16,64 crowd $B base-mixed "" --crowd-scopes mixed
NEED_S=30 INTO=fast CROWD=1,16,64 crowd src this-fast-windows "" $FAST --crowd-scopes windows
echo "=== done ${SECONDS}s"
summary
