#!/bin/bash
# Session 18 run 6: the waiting kernels get a warp per 32 slots (slot_server.waiting_warps;
# one warp spilled its registers past 32): the batch rounds' CUDA test at 40 slots (2 warps)
# and 128 (4 warps) and the sidecar's; the rounds in process at 16 and 128 slots.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PYTHONPATH=src timeout 75 python3 benchmarks/results/h200-s18/rounds_slots.py 16,128 > $OUT/run6-rounds-slots.txt 2>&1; tail -4 $OUT/run6-rounds-slots.txt
PYTHONPATH=src timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider -k "batch_rounds or sidecar" --durations=5 tests/test_slot_server.py > $OUT/run6-cuda-slot.txt 2>&1
grep -E "passed|failed|Error|s call" $OUT/run6-cuda-slot.txt | tail -8
