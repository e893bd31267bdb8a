#!/bin/bash
# Session 18, the 2-vCPU VM: the crowd of single recalls, 1-64 client processes, the CPU engine
# (65,536 x 384, k = 8), this code (passes of 2-64 queries scored by kalos.engine._dots; a CPU
# sidecar's crowded clients sleep instead of napping) beside the session's start (96433ac),
# alternating, twice. Needs the session's start in .snap/trees/s18 with its _fence built.
cd "$(dirname "$0")/../../.."
for r in 1 2; do
for t in "src this" ".snap/trees/s18/src base"; do set -- $t
  PYTHONPATH=$1 timeout 600 .venv/bin/python $1/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 > benchmarks/results/cpu-crowd-s18/$2-$r.txt 2>&1
  echo "== $2 ($r)"; grep -E "^ +[0-9]+ |Traceback|Error" benchmarks/results/cpu-crowd-s18/$2-$r.txt | head -10
done; done
