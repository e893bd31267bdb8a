#!/bin/bash
# Session 32, call 1: time windows served by the GPU rounds (each query's own, in its gather-table
# row) against d036a93 (.snap/trees/s32-base: git archive d036a93 src), which hands windowed
# requests to the sweep. The CUDA tests that cover it (slot server single and batch rounds with
# windows, the engine's own filtered searches), then the crowd 1-64 of each tree (default
# `kalos serve --device cuda`, 65,536 x 1024, k = 8, 2 s a crowd), then the crowd with every
# client in its own window (--crowd-scopes windows) at 1, 16, 64.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s32/call1.sh   (carry .snap/trees/s32-base, this folder)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s32-base/src
build_fence src $B
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== cuda tests $(date +%T)"
PYTHONPATH=src timeout -s INT -k 10 ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -m cuda \
  tests/test_slot_server.py tests/test_torch_engine.py \
  -k "answers_while_running or every_size or (matches_reference and v1)" > $OUT/cuda-tests.txt 2>&1
tail -3 $OUT/cuda-tests.txt
crowd src this ""
crowd $B base ""
CROWD=1,16,64 crowd src this-windows "" --crowd-scopes windows
CROWD=1,16,64 crowd $B base-windows "" --crowd-scopes windows
echo "=== done ${SECONDS}s"
summary
