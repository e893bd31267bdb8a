#!/bin/bash
# Session 15 run 1: the CUDA tests on this code (the batch rounds of the GPU's polling, the
# table's new publish words), then the crowd of single recalls with --gpu-polling (batch
# rounds; windows of 20 and 0 us) beside the default sweep, this code only: a first look
# before the side-by-side run. Outputs: $OUT/run1-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s15/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error|ready:" "$1" | head -24; }
echo "=== CUDA tests: slot server"
PYTHONPATH=.snap/model:src timeout 150 python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run1-cuda-slot.txt 2>&1; tail -15 $OUT/run1-cuda-slot.txt
echo "=== crowd, --gpu-polling (window 20 us)"
PYTHONPATH=src timeout 120 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,2,4,16,64 --crowd-seconds 3 --serve-arg=--gpu-polling > $OUT/run1-crowd-polling.txt 2>&1; show $OUT/run1-crowd-polling.txt; tail -5 $OUT/run1-crowd-polling.txt | grep -v "^ "
echo "=== crowd, --gpu-polling --gpu-window-us 0"
PYTHONPATH=src timeout 100 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 --serve-arg=--gpu-polling --serve-arg=--gpu-window-us --serve-arg=0 > $OUT/run1-crowd-polling-w0.txt 2>&1; show $OUT/run1-crowd-polling-w0.txt
echo "=== crowd, default"
PYTHONPATH=src timeout 80 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/run1-crowd-src.txt 2>&1; show $OUT/run1-crowd-src.txt
echo "=== CUDA tests: the rest"
PYTHONPATH=.snap/model:src timeout 150 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ --deselect tests/test_slot_server.py > $OUT/run1-cuda-tests.txt 2>&1; tail -3 $OUT/run1-cuda-tests.txt
