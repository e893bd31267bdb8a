#!/bin/bash
# Session 32, call 4: the crowd at 16 and 64 beside the GEMMs (the co-located LLM) of this tree
# (b886803: call 3's code) and of d036a93 (.snap/trees/s32-base), then the CUDA tests of the
# slot server (windows in single and batch rounds of every size, both precisions) and of the
# engine's own searches, for what time is left.
#   BUDGET_S=335 OUT=$OUT bash benchmarks/results/h100-s32/call4.sh   (as run; carry .snap/trees/s32-base, this folder)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s32-base/src
build_fence src $B
nvidia-smi --query-gpu=name --format=csv,noheader
NEED_S=60 CROWD=16,64 crowd src this-colo 16,64
NEED_S=60 CROWD=16,64 crowd $B base-colo 16,64
echo "=== cuda tests $(date +%T) (${SECONDS}s)"
PYTHONPATH=src timeout -s INT -k 5 $(( budget - SECONDS - 8 )) python3 -m pytest -v -p no:cacheprovider -m cuda \
  tests/test_slot_server.py tests/test_torch_engine.py \
  -k "answers_while_running or every_size or (matches_reference and v1)" > $OUT/cuda-tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/cuda-tests.txt | tail -16
echo "=== done ${SECONDS}s"
summary
