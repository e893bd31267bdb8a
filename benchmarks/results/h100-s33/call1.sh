#!/bin/bash
# Session 33, call 1: per-query namespaces in the GPU rounds (this tree) against dff6d2d, the
# code before them (.snap/trees/s33-base: `git archive dff6d2d src`): the slot server's CUDA
# tests (this tree's), then the crowds of default `kalos serve --device cuda` (65,536 x 1024,
# k = 8, 2 s a crowd), both trees each: 'agents' (the rows in 64 namespaces, each client in
# its own) at 1, 4, 16, 64; the crowd 1-64 in "default"; 'mixed' at 16 and 64.
#   BUDGET_S=570 OUT=$OUT bash benchmarks/results/h100-s33/call1.sh   (carry .snap/trees/s33-base)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s33-base/src
build_fence src $B
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== cuda tests $(date +%T)"
PYTHONPATH=src timeout -s INT -k 5 ${TESTS_S:-170} python3 -m pytest -v -p no:cacheprovider -m cuda \
  tests/test_slot_server.py > $OUT/cuda-tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/cuda-tests.txt | tail -8
NEED_S=40 INTO=agents CROWD=1,4,16,64 crowd src this-agents "" --crowd-scopes agents
NEED_S=40 INTO=agents CROWD=1,4,16,64 crowd $B base-agents "" --crowd-scopes agents
crowd src this ""
crowd $B base ""
NEED_S=30 INTO=mixed CROWD=16,64 crowd src this-mixed "" --crowd-scopes mixed
NEED_S=30 INTO=mixed CROWD=16,64 crowd $B base-mixed "" --crowd-scopes mixed
echo "=== done ${SECONDS}s"
summary
