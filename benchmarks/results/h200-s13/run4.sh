#!/bin/bash
# Session 13 run 4: the CUDA tests on this code, then the crowd 1-64 with the co-located case,
# this code (src, 565c7ec) against the session's start (.snap/trees/head = git archive 626bebe src), each
# with its own crowd.py (unchanged between them), alternated; then 1, 16, 64 again in the
# other order. Outputs: run4-<name>.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
echo "=== CUDA tests"; PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ > $OUT/cuda-tests.txt 2>&1; tail -3 $OUT/cuda-tests.txt
for v in head src; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  echo "=== $v"; PYTHONPATH=$tree timeout 170 python3 $tree/kalos/tools/crowd.py --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 > $OUT/crowd-$v.txt 2>&1; show $OUT/crowd-$v.txt
done
for v in src head; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  echo "=== $v again"; PYTHONPATH=$tree timeout 80 python3 $tree/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/crowd-$v-2.txt 2>&1; show $OUT/crowd-$v-2.txt
done
