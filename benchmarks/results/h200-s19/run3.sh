#!/bin/bash
# Session 19 run 3: the selection and final stages' tunings for batches of 2-64 (probe2.py).
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
PYTHONPATH=src:benchmarks timeout 540 python3 benchmarks/results/h200-s19/probe2.py > $OUT/run3-probe2.txt 2>&1
sed -n '/== table/,$p' $OUT/run3-probe2.txt; grep -E "fail|Error" $OUT/run3-probe2.txt | head
