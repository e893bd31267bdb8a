#!/bin/bash
# Session 19 run 2: the score-writing scan for batches of 16-64 against cuBLAS, and wider
# final-kernel tiles for batches (probe.py).
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
PYTHONPATH=src:benchmarks timeout 540 python3 benchmarks/results/h200-s19/probe.py > $OUT/run2-probe.txt 2>&1
sed -n '/== table/,$p' $OUT/run2-probe.txt; grep -E "fail|Error" $OUT/run2-probe.txt | head
