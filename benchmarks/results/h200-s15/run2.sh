#!/bin/bash
# Session 15 run 2: the CUDA test of batch rounds of every size (run 1 found a scratch buffer
# shared between rounds' graphs: fixed), then the crowd of single recalls, 1-64 client
# processes plus the co-located case (1 and 16 beside bf16 GEMMs), in one run: this code with
# --gpu-polling (batch rounds), this code's default sweep, and the session's start (81be365,
# .snap/trees/s15) default. Outputs: $OUT/run2-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s15/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
echo "=== CUDA test: batch rounds"
PYTHONPATH=src timeout 140 python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/test_slot_server.py -k batch_rounds > $OUT/run2-cuda-batch.txt 2>&1; grep -E "passed|failed|Error" $OUT/run2-cuda-batch.txt | tail -5
crowd() { # tree label extra...
  local tree=$1 label=$2; shift 2
  echo "=== $label"; PYTHONPATH=$tree timeout 150 python3 $tree/kalos/tools/crowd.py --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 "$@" > $OUT/run2-crowd-$label.txt 2>&1; show $OUT/run2-crowd-$label.txt
}
crowd src polling --colocated 1,16 --serve-arg=--gpu-polling
crowd src sweep --colocated 1,16
crowd .snap/trees/s15/src base --colocated 1,16
