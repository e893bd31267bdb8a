#!/bin/bash
# Session 19 run 1: where the device time of a batch pass of 1-64 queries goes (the engine's
# graphs' kernels, exact and fast), then the crowd of processes 1-64 and beside the GEMMs on
# session 18's final code (b9c3f1a: the waiting kernels take a warp per 32 slots).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PYTHONPATH=src timeout 200 python3 benchmarks/diagnostics.py gpu --batches 1,2,4,8,16,32,64 --thresholds on \
  > $OUT/run1-diag.txt 2>&1; sed -n '/== summary/,$p' $OUT/run1-diag.txt | cut -c1-200
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
PYTHONPATH=src timeout 200 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,2,4,8,16,32,64 \
  --crowd-seconds 2 --colocated 1,16 > $OUT/run1-crowd.txt 2>&1; show $OUT/run1-crowd.txt
