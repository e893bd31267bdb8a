#!/bin/bash
# Session 14, the final review's check on the 2-vCPU VM (no device time left): the crowd, 1-64
# client processes of single recalls, the CPU engine, 65,536 x 384, this code (src) beside the
# session's start (ad2bbd0, .snap/trees/head with its _fence built), in one run: head, src.
cd "$(dirname "$0")/../../.."
[ "$1" = again ] || for v in head src; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  PYTHONPATH=$tree timeout 900 .venv/bin/python $tree/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 > benchmarks/results/cpu-crowd-s14b/$v.txt 2>&1
done
# Then 32 and 64 again, alternated (src, head, src): the first pair differed at 64.
if [ "$1" = again ]; then
  for v in src head src; do
    tree=.snap/trees/$v/src; [ $v = src ] && tree=src
    PYTHONPATH=$tree timeout 900 .venv/bin/python $tree/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
      --crowd 32,64 --crowd-seconds 3 >> benchmarks/results/cpu-crowd-s14b/$v-again.txt 2>&1
  done
fi
