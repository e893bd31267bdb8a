#!/bin/bash
# Session 17, the 2-vCPU VM: the crowd of single recalls, 1-64 client processes, the CPU engine
# (65,536 x 384), this code beside the session's start (82cb521) in one run. The GPU's path
# could not be measured again after the last tidy (the session's device time was spent).
cd "$(dirname "$0")/../../.."
for t in "src this" ".snap/trees/s17/src base"; do set -- $t
  PYTHONPATH=$1 timeout 600 .venv/bin/python $1/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 > benchmarks/results/cpu-crowd-s17/$2.txt 2>&1
  echo "== $2"; grep -E "^ +[0-9]+ |Traceback|Error" benchmarks/results/cpu-crowd-s17/$2.txt | head -10
done
