#!/bin/bash
# Session 18 run 5: each poll fetches the req_seq words of the slots in use only (the previous
# look's in-use words), not of every slot: the slot server's CUDA tests; the crowd, this code
# beside the session's start (96433ac, .snap/trees/s18), 1-64 clients and beside the GEMMs;
# the rounds in process at 9, 16 and 128 slots.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s18/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA slot-server tests"
PYTHONPATH=src timeout 220 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run5-cuda-slot.txt 2>&1
grep -E "passed|failed|Error" $OUT/run5-cuda-slot.txt | tail -5
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label
  echo "=== $2"; PYTHONPATH=$1 timeout 130 python3 $1/kalos/tools/crowd.py --device cuda --crowd 1,2,4,8,16,32,64 \
    --crowd-seconds 2 --colocated 1,16 > $OUT/run5-crowd-$2.txt 2>&1; show $OUT/run5-crowd-$2.txt
}
crowd src this
crowd .snap/trees/s18/src base
echo "=== rounds by slots"
PYTHONPATH=src timeout 90 python3 benchmarks/results/h200-s18/rounds_slots.py > $OUT/run5-rounds-slots.txt 2>&1; tail -5 $OUT/run5-rounds-slots.txt
