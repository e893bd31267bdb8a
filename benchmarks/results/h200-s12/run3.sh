#!/bin/bash
# Session 12 run 3: passes queued two deep on the GPU (HEAD, working tree) beside 3d2b418
# (.snap/trees/prev = git archive 3d2b418 src, its crowd.py replaced by HEAD's so that both
# sidecars face the same clients); CUDA tests first.
cd "$(dirname "$0")/.."  # (run from .snap/run3.sh on the device: the repo root is one folder up)
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/prev/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
show() { grep -E "^ +[0-9]+ |GEMMs|first error|^crowd|^the same|Traceback|Error" "$1" | head -40; }
echo "=== CUDA tests"; PYTHONPATH=src timeout 150 python3 -m pytest -q -x -m cuda -n 4 -p no:cacheprovider tests/ > $OUT/cuda-tests.txt 2>&1; tail -4 $OUT/cuda-tests.txt
CROWD=src/kalos/tools/crowd.py
echo "=== head"; PYTHONPATH=src timeout 100 python3 $CROWD --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 --json $OUT/head.json > $OUT/head.txt 2>&1; show $OUT/head.txt
echo "=== prev 3d2b418"; PYTHONPATH=.snap/trees/prev/src timeout 100 python3 $CROWD --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 > $OUT/prev.txt 2>&1; show $OUT/prev.txt
echo "=== head fast"; PYTHONPATH=src timeout 50 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 --serve-arg=--precision --serve-arg=fast > $OUT/head-fast.txt 2>&1; show $OUT/head-fast.txt
echo "=== prev fast"; PYTHONPATH=.snap/trees/prev/src timeout 50 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 --serve-arg=--precision --serve-arg=fast > $OUT/prev-fast.txt 2>&1; show $OUT/prev-fast.txt
echo "=== head again"; PYTHONPATH=src timeout 50 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/head-2.txt 2>&1; show $OUT/head-2.txt
