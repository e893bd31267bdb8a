#!/bin/bash
# Session 41, first device call: on an H200, issue 18's measurement (h200-s40/call2.sh: the
# default crowd 1-64 with the co-located GEMMs beside c5539f3, one client's batches, fast, the
# async coroutines); on any other card, this tree's CUDA-marked tests (not run on a GPU since
# session 39) so the machine's start is not spent for nothing.
#   mkdir -p .snap/trees/s35-base && git archive c5539f3 src | tar -x -C .snap/trees/s35-base
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s41/call1.sh
#     (carry benchmarks/results/h200-s40, benchmarks/results/h200-s41 and .snap/trees/s35-base)
cd "$(dirname "$0")/../../.."
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
if [[ $card == *H200* ]]; then exec bash benchmarks/results/h200-s40/call2.sh; fi
source benchmarks/results/h100-s32/lib.sh
build_fence src
cuda_tests $(( budget - 10 )) tests
