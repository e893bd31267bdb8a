#!/bin/bash
# For the next session's first device call (not run in session 18: its device time was spent):
# the crowd of client processes, 1-64 and beside the GEMMs, on this code (the waiting kernels
# take a warp per 32 slots) beside the session-18 start (96433ac) in one call, then fast
# precision at 1, 16 and 64, then C = 1 alone at 9 and 128 slots. Needs the session-18 start in
# .snap/trees/s18 (git archive 96433ac src benchmarks | tar -x -C .snap/trees/s18); carry it.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s18/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label"; PYTHONPATH=$tree timeout 140 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes \
    --crowd-seconds 2 "$@" > $OUT/next-crowd-$label.txt 2>&1; show $OUT/next-crowd-$label.txt
}
crowd src this 1,2,4,8,16,32,64 --colocated 1,16
crowd .snap/trees/s18/src base 1,2,4,8,16,32,64 --colocated 1,16
crowd src this-fast 1,16,64 --serve-arg=--precision --serve-arg=fast
for slots in 9 128; do crowd src this-c1-$slots-slots 1 --serve-arg=--slots --serve-arg=$slots; done
