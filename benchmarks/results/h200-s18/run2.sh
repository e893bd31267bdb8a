#!/bin/bash
# Session 18 run 2: how crowded clients wait on a GPU sidecar (GPU polling, the default): this
# code (past two clients per core they nap: 100 us timed sleeps) against a copy in which they
# spin yielding their core at every look whatever their number (.snap/trees/s18y: one line of
# kalos/ipc/channel.py), in one call; exact, then fast at C = 64.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s18y/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label"; PYTHONPATH=$tree timeout 140 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run2-crowd-$label.txt 2>&1; show $OUT/run2-crowd-$label.txt
}
crowd src nap 1,16,32,64 --colocated 64
crowd .snap/trees/s18y/src yield 1,16,32,64 --colocated 64
crowd src nap-fast 64 --serve-arg=--precision --serve-arg=fast
crowd .snap/trees/s18y/src yield-fast 64 --serve-arg=--precision --serve-arg=fast
