#!/bin/bash
# Session 17 run 4: the review's fixes (the kernels' taken words, which a hello checks before a
# slot changes hands; the in-use words agreed between warps on their own; a capture for the
# demand that fails keeps serving): the slot server's CUDA tests, then a short crowd with this
# code's default. Outputs: $OUT/run4-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests: slot server"
PYTHONPATH=src timeout 230 python3 -m pytest -q -rf -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run4-cuda-slot.txt 2>&1; grep -E "passed|failed|Error" $OUT/run4-cuda-slot.txt | tail -6
echo "=== default"
PYTHONPATH=src timeout 80 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 2 > $OUT/run4-crowd-default.txt 2>&1
grep -E "^ +[0-9]+ |first error|Traceback|Error" $OUT/run4-crowd-default.txt | head -12
