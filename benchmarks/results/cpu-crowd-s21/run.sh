#!/bin/bash
# Session 21, the 2-vCPU VM: the crowd of single recalls, 1-64 client processes beside one
# (C = 1), this code and then 51dfaa1 (the session's base; .snap/trees/s21base = git archive
# 51dfaa1 src, its _fence and _dots built with -O2) in one run, 65,536 x 384, k = 8, default
# `kalos serve --device cpu`. The session's serving change: op recall_text recalls in a client's
# slot, and the client's request words are written by SlotView.write_request.
cd "$(dirname "$0")/../../.."
for t in "src this" ".snap/trees/s21base/src base"; do set -- $t
  PYTHONPATH=$1 timeout 900 .venv/bin/python $1/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 > benchmarks/results/cpu-crowd-s21/$2.txt 2>&1
  echo "== $2"; grep -E "^ +[0-9]+ |Traceback|Error" benchmarks/results/cpu-crowd-s21/$2.txt | head -10
done
