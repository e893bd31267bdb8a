#!/bin/bash
# Session 17 run 3: the final code, GPU polling the default (a round whose size the demand
# needs and whose graph a change of the engine's columns forgot is captured while serving).
# The slot server's CUDA tests; then the crowd, 1-64 client processes plus the co-located
# case, in one run: this code's default (kalos serve, no flag: GPU polling) beside the
# session's start's default (82cb521: the sweep); fast precision with this code's default.
# Outputs: $OUT/run3-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s17/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests: slot server"
PYTHONPATH=src timeout 230 python3 -m pytest -q -rf -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run3-cuda-slot.txt 2>&1; grep -E "passed|failed|Error" $OUT/run3-cuda-slot.txt | tail -6
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label timeout sizes extra...
  local tree=$1 label=$2 limit=$3 sizes=$4; shift 4
  echo "=== $label"; PYTHONPATH=$tree timeout $limit python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run3-crowd-$label.txt 2>&1; show $OUT/run3-crowd-$label.txt
}
crowd src default 125 1,2,4,8,16,32,64 --colocated 1,16
crowd .snap/trees/s17/src base-default 125 1,2,4,8,16,32,64 --colocated 1,16
crowd src default-fast 50 1,16,64 --serve-arg=--precision --serve-arg=fast
