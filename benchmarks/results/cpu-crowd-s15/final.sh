#!/bin/bash
# Session 15's final check on the 2-vCPU VM (no device time left): the crowd of single recalls,
# 1-64 client processes, CPU engine, 65,536 x 384, the final code (src) beside the session's
# start (81be365, .snap/trees/s15, its _fence built by run.sh), in one run: base, src.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/cpu-crowd-s15
for v in base src; do
  tree=.snap/trees/s15/src; [ $v = src ] && tree=src
  PYTHONPATH=$tree timeout 1200 .venv/bin/python $tree/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 > $out/final-$v.txt 2>&1
  grep -E "^ +[0-9]+ " $out/final-$v.txt | sed "s/^/$v /"
done
