#!/bin/bash
# Session 19 run 4: the re-score loop unrolled (probe3.py).
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
PYTHONPATH=src:benchmarks timeout 540 python3 benchmarks/results/h200-s19/probe3.py > $OUT/run4-probe3.txt 2>&1
sed -n '/== table/,$p' $OUT/run4-probe3.txt; grep -E "fail|Error" $OUT/run4-probe3.txt | head
