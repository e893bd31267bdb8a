#!/bin/bash
# Session 14 run 3 (one call): the crowd, 1-64 client processes of single recalls plus the
# co-located case (1 and 16 beside bf16 GEMMs), this code (src) against the session's start
# (ad2bbd0, .snap/trees/head), each tree with its own crowd.py, alternated: head, src (1-64 and
# co-located), then src, head (1, 16, 64). Outputs: $OUT/run3-crowd-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
for v in head src; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  echo "=== $v"; PYTHONPATH=$tree timeout 175 python3 $tree/kalos/tools/crowd.py --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 > $OUT/run3-crowd-$v.txt 2>&1; show $OUT/run3-crowd-$v.txt
done
for v in src head; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  echo "=== $v again"; PYTHONPATH=$tree timeout 85 python3 $tree/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/run3-crowd-$v-2.txt 2>&1; show $OUT/run3-crowd-$v-2.txt
done
