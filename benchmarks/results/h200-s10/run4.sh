#!/bin/bash
# Session 10 run 4: is C=1 slower after the layout move? HEAD and ee1cb43 alternated, one run.
cd "$(dirname "$0")/.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
gcc -O2 -shared -fPIC $inc .snap/trees/prev/src/kalos/_fence.c -o .snap/trees/prev/src/kalos/_fence$ext || exit 1
show() { grep -E "^ +[0-9]+ |first error" "$1"; }
for i in 1 2; do
  echo "=== head $i"; PYTHONPATH=src timeout 60 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16 --crowd-seconds 3 > $OUT/head-$i.txt 2>&1; show $OUT/head-$i.txt
  echo "=== ee1cb43 $i"; PYTHONPATH=.snap/trees/prev/src timeout 60 python3 .snap/crowd_flat.py --device cuda --crowd 1,16 --crowd-seconds 3 > $OUT/prev-$i.txt 2>&1; show $OUT/prev-$i.txt
done
for t in src .snap/trees/prev/src; do echo "=== engine alone, $t"; PYTHONPATH=$t timeout 90 python3 benchmarks/small_batch.py --variants default --qs 1,8,16,64 --precisions exact,fast --repeats 200 2>&1 | grep -v Warn | tail -8; done
