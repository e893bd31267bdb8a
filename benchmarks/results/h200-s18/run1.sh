#!/bin/bash
# Session 18 run 1: the slot server's CUDA tests on this code (session 17's last host-side
# changes had run under the interpreter only); the polling server's rounds in process for
# tuning variants of the batch pass (which path a round of 2-64 queries takes).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
gcc -O2 -shared -fPIC $inc src/kalos/engine/_dots.c -o src/kalos/engine/_dots$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA slot-server tests"
PYTHONPATH=src timeout 230 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run1-cuda-slot.txt 2>&1
grep -E "passed|failed|Error" $OUT/run1-cuda-slot.txt | tail -5
echo "=== rounds by tuning"
PYTHONPATH=src timeout 330 python3 benchmarks/results/h200-s18/rounds_tuning.py > $OUT/run1-rounds.txt 2>&1
sed -n '/^round host/,$p' $OUT/run1-rounds.txt; grep -E "Traceback|Error" $OUT/run1-rounds.txt | head -5; tail -3 $OUT/run1-rounds.txt
