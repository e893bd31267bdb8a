#!/bin/bash
# Session 32, call 2 (the machine call 1 left warm): the CUDA tests of the windows (verbose),
# the rounds in process of this tree (4e8f71d) and of d036a93 (.snap/trees/s32-base) at 1, 16,
# 64 (kernels profiled at 16 and 64), this tree's rounds with every request in its own window,
# the crowd at 16 and 64 beside the GEMMs (the co-located LLM) for both trees, and d036a93's
# crowd with windows (this tree's crowd.py against its server: its own has no 'windows' scope).
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s32/call2.sh   (carry .snap/trees/s32-base, this folder)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s32-base/src
build_fence src $B
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== cuda tests $(date +%T)"
PYTHONPATH=src timeout -s INT -k 10 ${TESTS_S:-200} python3 -m pytest -v -p no:cacheprovider -m cuda \
  tests/test_slot_server.py -k "answers_while_running or (every_size and exact-40)" > $OUT/cuda-tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/cuda-tests.txt | tail -6
rounds this src --sizes 1,16,64 --profile 16,64
rounds base $B --sizes 1,16,64 --profile 16,64
rounds this-windows src --sizes 16,64 --profile 16,64 --windows
NEED_S=100 CROWD=16,64 crowd src this-colo 16,64
NEED_S=100 CROWD=16,64 crowd $B base-colo 16,64
echo "=== crowd base-windows $(date +%T) (${SECONDS}s)"
(( SECONDS + 40 < budget )) && PYTHONPATH=$B timeout $(( budget - SECONDS )) python3 src/kalos/tools/crowd.py --device cuda \
  --crowd 1,16,64 --crowd-seconds 2 --crowd-scopes windows > $OUT/crowd-base-windows.txt 2>&1
pkill -9 -f "kalos[ ]serve" 2>/dev/null
echo "=== done ${SECONDS}s"
summary
