#!/bin/bash
# (run from .snap/run1.sh on the device: the repo root is one folder up)
# Session 11 run 1: the sidecar split (890ff4e + review 5f23ad6, = HEAD) beside the commit before it (5095d55), one run, alternated.
# Needs .snap/trees/pre/src: mkdir -p .snap/trees/pre && git archive 5095d55 src | tar -x -C .snap/trees/pre.
# Its $OUT files are kept here as run1-<name> (head.txt -> run1-head.txt).
cd "$(dirname "$0")/.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/pre/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
show() { grep -E "^ +[0-9]+ |GEMMs|first error|^crowd|^the same" "$1"; }
CROWD=src/kalos/tools/crowd.py
echo "=== head"; PYTHONPATH=src timeout 150 python3 $CROWD --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 --json $OUT/head.json > $OUT/head.txt 2>&1; show $OUT/head.txt
echo "=== pre-split 5095d55"; PYTHONPATH=.snap/trees/pre/src timeout 150 python3 .snap/trees/pre/src/kalos/tools/crowd.py --device cuda --crowd 1,2,4,8,16,32,64 --crowd-seconds 3 --colocated 1,16 > $OUT/pre.txt 2>&1; show $OUT/pre.txt
echo "=== head again"; PYTHONPATH=src timeout 60 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/head-2.txt 2>&1; show $OUT/head-2.txt
echo "=== pre-split again"; PYTHONPATH=.snap/trees/pre/src timeout 60 python3 .snap/trees/pre/src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/pre-2.txt 2>&1; show $OUT/pre-2.txt
echo "=== head fast"; PYTHONPATH=src timeout 60 python3 $CROWD --device cuda --crowd 1,16,64 --crowd-seconds 3 --serve-arg=--precision --serve-arg=fast > $OUT/head-fast.txt 2>&1; show $OUT/head-fast.txt
echo "=== CUDA tests on head"; PYTHONPATH=src timeout 120 python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider tests/ > $OUT/cuda-tests.txt 2>&1; tail -3 $OUT/cuda-tests.txt
