#!/bin/bash
# Session 17 run 1: clients come and go without stopping the GPU's polling (rest seqs, every
# slot polled, in-use words), and the rounds sized by demand. The CUDA tests of the slot
# server; then the crowd of single recalls, 1-64 client processes plus the co-located case, in
# one run: this code with --gpu-polling, the session's start (82cb521) with --gpu-polling, this
# code's default sweep (with the co-located case: the default's cost to the LLM), fast
# precision with polling. Outputs: $OUT/run1-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s17/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests: slot server"
PYTHONPATH=src timeout 170 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run1-cuda-slot.txt 2>&1; grep -E "passed|failed|Error" $OUT/run1-cuda-slot.txt | tail -6
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label timeout sizes extra...
  local tree=$1 label=$2 limit=$3 sizes=$4; shift 4
  echo "=== $label"; PYTHONPATH=$tree timeout $limit python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run1-crowd-$label.txt 2>&1; show $OUT/run1-crowd-$label.txt
}
crowd src polling 100 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd .snap/trees/s17/src base-polling 100 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd src sweep 100 1,2,4,8,16,32,64 --colocated 1,16
crowd src polling-fast 60 1,16,64 --serve-arg=--gpu-polling --serve-arg=--precision --serve-arg=fast
