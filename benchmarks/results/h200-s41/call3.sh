#!/bin/bash
# Session 41, a later device call with little device time left (~650 s): on an H200 only, issue
# 18's crowd cut to what decides its targets (h200-s40/call3.sh: the default crowd 1-64 of this
# tree without the GEMMs, then c5539f3 at C = 1, 16, 64). On any other card it exits at once.
#   BUDGET_S=260 OUT=$OUT bash benchmarks/results/h200-s41/call3.sh
#     (carry benchmarks/results/h200-s40, benchmarks/results/h200-s41 and .snap/trees/s35-base)
cd "$(dirname "$0")/../../.."
exec bash benchmarks/results/h200-s40/call3.sh
