#!/bin/bash
# Session 18, the 2-vCPU VM, after the final tidy: the crowd of single recalls, 1-64 client
# processes beside one (C = 1), this code and then the session's start (96433ac,
# .snap/trees/s18 with its _fence built) in one run, 65,536 x 384, k = 8.
cd "$(dirname "$0")/../../.."
for t in "src final-this" ".snap/trees/s18/src final-base"; do set -- $t
  PYTHONPATH=$1 timeout 600 .venv/bin/python $1/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 > benchmarks/results/cpu-crowd-s18/$2.txt 2>&1
  echo "== $2"; grep -E "^ +[0-9]+ |Traceback|Error" benchmarks/results/cpu-crowd-s18/$2.txt | head -10
done
