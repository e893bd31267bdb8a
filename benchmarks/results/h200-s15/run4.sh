#!/bin/bash
# Session 15 run 4 (the final code): the crowd of single recalls, 1-64 client processes plus
# the co-located case (1 and 16 beside bf16 GEMMs), in one run: this code with --gpu-polling
# (batch rounds), this code's default sweep, the session's start (81be365, .snap/trees/s15)
# default; then fast precision (1, 16, 64) with and without --gpu-polling; then the slot
# server's CUDA tests. Outputs: $OUT/run4-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s15/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label"; PYTHONPATH=$tree timeout 120 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run4-crowd-$label.txt 2>&1; show $OUT/run4-crowd-$label.txt
}
crowd src polling 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd src sweep 1,2,4,8,16,32,64 --colocated 1,16
crowd .snap/trees/s15/src base 1,2,4,8,16,32,64 --colocated 1,16
crowd src polling-fast 1,16,64 --serve-arg=--gpu-polling --serve-arg=--precision --serve-arg=fast
crowd src sweep-fast 1,16,64 --serve-arg=--precision --serve-arg=fast
echo "=== CUDA tests: slot server"
PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run4-cuda-slot.txt 2>&1; grep -E "passed|failed|Error" $OUT/run4-cuda-slot.txt | tail -5
