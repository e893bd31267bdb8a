#!/bin/bash
# Session 13 run 3: the sweep's CPU per pass with the places path (hostpass.py), the CUDA tests of
# the engine's queued passes, then the sweep's timeline, this code (src, e437a9d) against the
# session's start (.snap/trees/head = git archive 626bebe src), alternated. Outputs: run3-<name>.
# (e437a9d still had the precise naps of precise-naps.patch; 565c7ec took them out.)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
PYTHONPATH=src python3 benchmarks/results/h200-s13/hostpass.py 16 --ops
PYTHONPATH=src python3 benchmarks/results/h200-s13/hostpass.py 64
PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_torch_engine.py -k "places or in_flight or attached" 2>&1 | tail -3
for v in src head src head; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  PYTHONPATH=$tree timeout 150 python3 benchmarks/sweep_trace.py --crowd 1,16,32,64 --seconds 3 --label $v >> $OUT/trace-$v.txt 2>&1
  tail -6 $OUT/trace-$v.txt
done
