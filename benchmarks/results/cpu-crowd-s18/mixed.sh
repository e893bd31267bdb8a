#!/bin/bash
# Session 18, the 2-vCPU VM: the crowd with filters mixed in every pass (--crowd-scopes mixed:
# a third each namespace "default", every namespace, a time window), this code (a pass's filter
# groups in one engine call, scored in one read of the rows) beside the code before that change
# (.snap/trees/s18m: git archive of 005a1a9's src, _fence and _dots built), alternated twice.
cd "$(dirname "$0")/../../.."
for r in 1 2; do
for t in "src this" ".snap/trees/s18m/src before"; do set -- $t
  PYTHONPATH=$1 timeout 600 .venv/bin/python $1/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,8,16 --crowd-seconds 3 --crowd-scopes mixed > benchmarks/results/cpu-crowd-s18/mixed-$2-$r.txt 2>&1
  echo "== $2 ($r)"; grep -E "^ +[0-9]+ |Traceback|Error" benchmarks/results/cpu-crowd-s18/mixed-$2-$r.txt | head -10
done; done
