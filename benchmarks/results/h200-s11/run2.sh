#!/bin/bash
# (run from .snap/run2.sh on the device: the repo root is one folder up)
# Session 11 run 2: the split (HEAD) and 5095d55 alternated again, the commit before first this time.
# Needs .snap/trees/pre/src: mkdir -p .snap/trees/pre && git archive 5095d55 src | tar -x -C .snap/trees/pre.
# Its $OUT files are kept here as run2-<name> (head.txt -> run2-head.txt).
cd "$(dirname "$0")/.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/pre/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
show() { grep -E "^ +[0-9]+ |first error" "$1"; }
for i in 1 2; do
  echo "=== pre-split $i"; PYTHONPATH=.snap/trees/pre/src timeout 70 python3 .snap/trees/pre/src/kalos/tools/crowd.py --device cuda --crowd 1,16,32,64 --crowd-seconds 3 > $OUT/pre-$i.txt 2>&1; show $OUT/pre-$i.txt
  echo "=== head $i"; PYTHONPATH=src timeout 70 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,32,64 --crowd-seconds 3 > $OUT/head-$i.txt 2>&1; show $OUT/head-$i.txt
done
echo "=== engine device time per kernel, Q = 1-64 (exact and fast)"
PYTHONPATH=src PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/diagnostics.py gpu --batches 1,2,4,8,16,32,64 --out $OUT > $OUT/diag-batches.txt 2>&1; sed -n '/== summary ==/,$p' $OUT/diag-batches.txt | grep -v "threshold': False" | head -120
