#!/bin/bash
# Session 12 run 3b (short): CUDA tests of the engine's passes in flight, then the crowd 1,16,64
# on this code beside 3d2b418 (.snap/trees/prev, its crowd.py replaced by this one's).
cd "$(dirname "$0")/.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/prev/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
show() { grep -E "^ +[0-9]+ |first error|Traceback|Error" "$1" | head -20; }
echo "=== CUDA tests"; PYTHONPATH=src timeout 170 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ > $OUT/cuda-tests.txt 2>&1; tail -4 $OUT/cuda-tests.txt
CROWD=src/kalos/tools/crowd.py
echo "=== head"; PYTHONPATH=src timeout 60 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/head.txt 2>&1; show $OUT/head.txt
echo "=== prev 3d2b418"; PYTHONPATH=.snap/trees/prev/src timeout 60 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/prev.txt 2>&1; show $OUT/prev.txt
echo "=== head fast"; PYTHONPATH=src timeout 50 python3 $CROWD --device cuda --crowd 16,64 --crowd-seconds 3 --serve-arg=--precision --serve-arg=fast > $OUT/head-fast.txt 2>&1; show $OUT/head-fast.txt
