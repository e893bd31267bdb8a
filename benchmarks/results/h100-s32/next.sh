#!/bin/bash
# For the next session's first device call: per-query namespaces in the GPU rounds, run from a
# checkout of 020cccd with `git apply benchmarks/results/h100-s32/candidate-per-query-namespaces.patch`
# (src), against 020cccd itself (.snap/trees/s32-base: `git archive 020cccd src | tar -x -C
# .snap/trees/s32-base`): the slot server's CUDA tests (the candidate's), the rounds in process,
# the crowd 1-64, the mixed crowd (two namespaces and a time window) at 16 and 64, and the crowd
# beside the GEMMs at 16 and 64, for both trees.
#   BUDGET_S=570 OUT=$OUT bash benchmarks/results/h100-s32/next.sh   (carry .snap/trees/s32-base, this folder)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s32-base/src
N=src
build_fence $N $B
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== cuda tests $(date +%T)"
PYTHONPATH=$N timeout -s INT -k 5 ${TESTS_S:-150} python3 -m pytest -v -p no:cacheprovider -m cuda \
  tests/test_slot_server.py -k "answers_while_running or every_size" > $OUT/cuda-tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/cuda-tests.txt | tail -8
rounds ns $N --sizes 1,16,64 --profile 16,64
crowd $N ns ""
crowd $B base ""
NEED_S=30 INTO=mixed CROWD=16,64 crowd $N ns-mixed "" --crowd-scopes mixed
NEED_S=30 INTO=mixed CROWD=16,64 crowd $B base-mixed "" --crowd-scopes mixed
NEED_S=60 INTO=colo CROWD=16,64 crowd $N ns-colo 16,64
NEED_S=60 INTO=colo CROWD=16,64 crowd $B base-colo 16,64
echo "=== done ${SECONDS}s"
summary
