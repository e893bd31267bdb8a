#!/bin/bash
# Session 20, the 2-vCPU VM, after the final mend: the crowd of single recalls, 1-64 client
# processes beside one (C = 1), this code and then baf1c2d (the base of the change read in the
# review; .snap/trees/baf1 = git archive baf1c2d src, its _fence and _dots built with -O2) in one
# run (run-2.sh: the same with the order reversed), 65,536 x 384, k = 8, default `kalos serve --device cpu`. The session's serving changes are
# the GPU polling's (no GPU was lent after run 2): this checks the host paths they share.
cd "$(dirname "$0")/../../.."
for t in ".snap/trees/baf1/src base-2" "src this-2"; do set -- $t
  PYTHONPATH=$1 timeout 900 .venv/bin/python $1/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 > benchmarks/results/cpu-crowd-s20/$2.txt 2>&1
  echo "== $2"; grep -E "^ +[0-9]+ |Traceback|Error" benchmarks/results/cpu-crowd-s20/$2.txt | head -10
done
