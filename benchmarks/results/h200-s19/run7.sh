#!/bin/bash
# Session 19 run 7: run 6's crowd again at C = 16 and 64 (alone and, at 16, beside the GEMMs),
# this code and the session start (b9c3f1a) alternated twice: run 6 saw one C = 64 p99 of 2 ms
# and a colocated p50 40 us apart, each from a single run.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s19/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -8; }
for i in 1 2; do
  for pair in "src this" ".snap/trees/s19/src base"; do
    set -- $pair
    echo "=== $2 $i"; PYTHONPATH=$1 timeout 95 python3 $1/kalos/tools/crowd.py --device cuda --crowd 16,64 \
      --crowd-seconds 2 --colocated 16 > $OUT/run7-crowd-$2-$i.txt 2>&1; show $OUT/run7-crowd-$2-$i.txt
  done
done
