#!/bin/bash
# Session 14 run 5 (one call): the final code (src) beside the session's start (ad2bbd0,
# .snap/trees/head) on one machine, 1, 16 and 64 clients, 2 s each, alternated twice (run 4's
# crowd ran on a machine of its own, slower for the same code). Outputs: $OUT/run5-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
for v in head src head src; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  n=$((${n:-0} + 1))
  echo "=== $v ($n)"; PYTHONPATH=$tree timeout 60 python3 $tree/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 2 > $OUT/run5-crowd-$n-$v.txt 2>&1
  grep -E "^ +[0-9]+ |Traceback|Error" $OUT/run5-crowd-$n-$v.txt | head -4
done
