#!/bin/bash
# Session 20 run 1: the crowd of client processes 1-64 and beside the GEMMs on this code (d6fa4b9,
# after session 19's mend) and on b9c3f1a in one call; fast at 1, 16, 64; then the napping
# clients' variants (C > 2 per core) at 32, 48, 64: naps of 30 us, a 1 us timer slack around
# the naps, both. Needs .snap/trees/{s19,nap30,slack,nap30s} (carry them).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s19/src .snap/trees/nap30/src .snap/trees/slack/src .snap/trees/nap30s/src; do
  gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label $(date +%T)"; PYTHONPATH=$tree timeout 150 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes \
    --crowd-seconds 2 "$@" > $OUT/run1-crowd-$label.txt 2>&1; show $OUT/run1-crowd-$label.txt
}
crowd src this 1,2,4,8,16,32,64 --colocated 1,16
crowd .snap/trees/s19/src base 1,2,4,8,16,32,64 --colocated 1,16
crowd src this-fast 1,16,64 --serve-arg=--precision --serve-arg=fast
crowd .snap/trees/nap30/src nap30 32,48,64
crowd .snap/trees/slack/src slack 32,48,64
crowd .snap/trees/nap30s/src nap30s 32,48,64
crowd src this-again 32,48,64
echo "end $(date +%T)"
