#!/bin/bash
# Session 42, first device call: on an H200, issue 18's measurement (h200-s40/call2.sh: the
# default crowd 1-64 with the co-located GEMMs beside c5539f3, one client's batches, fast, the
# async coroutines); on any other card, this tree's CUDA-marked tests with the carried MiniLM
# export on the path (benchmarks/export_model.py), so the two MiniLM GPU tests run too.
#   mkdir -p .snap/trees/s35-base && git archive c5539f3 src | tar -x -C .snap/trees/s35-base
#   .venv/bin/python benchmarks/export_model.py --out .snap/model
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s42/call1.sh
#     (carry benchmarks/results/h200-s40, benchmarks/results/h200-s42, .snap/trees/s35-base, .snap/model)
cd "$(dirname "$0")/../../.."
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
if [[ $card == *H200* ]]; then exec bash benchmarks/results/h200-s40/call2.sh; fi
source benchmarks/results/h100-s32/lib.sh
build_fence src
echo "=== cuda tests $(date +%T), model $(ls .snap/model)"
PYTHONPATH=.snap/model:src timeout -s INT -k 5 $(( budget - 10 )) python3 -m pytest -v -p no:cacheprovider -m cuda tests \
  > $OUT/cuda-tests.txt 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/cuda-tests.txt | tail -8
