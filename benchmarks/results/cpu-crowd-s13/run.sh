#!/bin/bash
# Session 13, the 2-vCPU VM: the CPU crowd 1, 8, 16 (65,536 x 384) with the row-sliced small-batch
# product (src then: 565c7ec with numpy-sliced.patch, beside this script; dropped) against 565c7ec
# (.snap/trees/cur = git archive 565c7ec src), alternated
# twice. Outputs in this folder: <tree>-<n>.txt.
cd "$(dirname "$0")/../../.."
for i in 1 2; do
  for v in cur src; do
    tree=.snap/trees/$v/src; [ $v = src ] && tree=src
    PYTHONPATH=$tree timeout 600 .venv/bin/python $tree/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
      --crowd 1,8,16 --crowd-seconds 3 > benchmarks/results/cpu-crowd-s13/$v-$i.txt 2>&1
  done
done
