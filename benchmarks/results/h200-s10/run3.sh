#!/bin/bash
# Session 10 final crowd: this code beside ee1cb43 (before the layout move) and the baseline 1a45792, one run.
cd "$(dirname "$0")/.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
gcc -O2 -shared -fPIC $inc .snap/trees/prev/src/kalos/_fence.c -o .snap/trees/prev/src/kalos/_fence$ext || exit 1
gcc -O2 -shared -fPIC $inc .baseline/src/kalos/_fence.c -o .baseline/src/kalos/_fence$ext || exit 1
CROWD=src/kalos/tools/crowd.py
show() { grep -E "^ +[0-9]+ |GEMMs|first error|^crowd|^the same" "$1"; }
echo "=== head"
PYTHONPATH=src timeout 240 python3 $CROWD --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 --json $OUT/head.json > $OUT/head.txt 2>&1; show $OUT/head.txt
echo "=== ee1cb43 (naps; before the layout move)"
PYTHONPATH=.snap/trees/prev/src timeout 120 python3 .snap/crowd_flat.py --device cuda --crowd 1,16,32,64 --crowd-seconds 3 > $OUT/prev-ee1cb43.txt 2>&1; show $OUT/prev-ee1cb43.txt
echo "=== baseline 1a45792"
PYTHONPATH=.baseline/src timeout 120 python3 .snap/crowd_flat.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/baseline-1a45792.txt 2>&1; show $OUT/baseline-1a45792.txt
echo "=== head fast"
PYTHONPATH=src timeout 100 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 --serve-arg=--precision --serve-arg=fast > $OUT/head-fast.txt 2>&1; show $OUT/head-fast.txt
echo "=== CUDA tests on this code"
PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider tests/ > $OUT/cuda-tests.txt 2>&1; tail -3 $OUT/cuda-tests.txt
