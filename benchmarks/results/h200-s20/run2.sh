#!/bin/bash
# Session 20 run 2: how a round gathers the crowd. Run 1 found the rounds at C = 64 took 29.5
# requests each (two cohorts of about 32, each waiting for the other's round). Variants beside
# d6fa4b9 (base: wait up to the window from the first request, or until as many as the recent
# rounds found): "gap" (this tree: keep gathering while requests keep arriving, stop once
# --gpu-window-us passes without a new one, once every client asked, or after 8x the window),
# with windows of 10 and 20 us; "yield" (d6fa4b9 with clients that spin and yield past two per
# core instead of napping); "gapyield" (both). Needs .snap/trees/{s20,yield,gapyield}: s20 =
# git archive d6fa4b9; yield = s20 with ClientChannel._budgets returning the yielding spin past
# two per core too; the gap kernel = candidate-yield-gather.patch's poll.py without the expect
# cap, going once quiet >= window or waited >= 8 x window.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s20/src .snap/trees/yield/src .snap/trees/gapyield/src; do
  gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label $(date +%T)"; PYTHONPATH=$tree timeout 150 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes \
    --crowd-seconds 2 "$@" > $OUT/run2-crowd-$label.txt 2>&1; show $OUT/run2-crowd-$label.txt
}
crowd .snap/trees/s20/src base 1,2,8,16,32,48,64
crowd src gap10 1,2,8,16,32,48,64 --serve-arg=--gpu-window-us=10
crowd src gap20 1,2,8,16,32,48,64 --serve-arg=--gpu-window-us=20
crowd .snap/trees/yield/src yield 16,32,48,64
crowd .snap/trees/gapyield/src gapyield10 16,32,48,64 --serve-arg=--gpu-window-us=10
crowd .snap/trees/gapyield/src gapyield20 32,48,64 --serve-arg=--gpu-window-us=20
echo "end $(date +%T)"
