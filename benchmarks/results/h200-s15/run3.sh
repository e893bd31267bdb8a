#!/bin/bash
# Session 15 run 3: where a polling round's time goes, by round size, in process (rounds.py,
# windows 20 and 0 us); then the crowd with --gpu-polling at 1, 16, 32, 64: this code (its
# rank by prefix sum), the window at 0, and rounds capped at 16 (--max-batch 16).
# Outputs: $OUT/run3-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1
show() { grep -E "^ +[0-9]+ |first error|Traceback|Error" "$1" | head -24; }
echo "=== rounds in process"
PYTHONPATH=src timeout 150 python3 benchmarks/results/h200-s15/rounds.py 20 > $OUT/run3-rounds.txt 2>&1; tail -9 $OUT/run3-rounds.txt
PYTHONPATH=src timeout 60 python3 benchmarks/results/h200-s15/rounds.py 0 > $OUT/run3-rounds-w0.txt 2>&1; tail -8 $OUT/run3-rounds-w0.txt
crowd() { local label=$1; shift
  echo "=== $label"; PYTHONPATH=src timeout 100 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,32,64 --crowd-seconds 2 --serve-arg=--gpu-polling "$@" > $OUT/run3-crowd-$label.txt 2>&1; show $OUT/run3-crowd-$label.txt
}
crowd polling
crowd polling-w0 --serve-arg=--gpu-window-us --serve-arg=0
crowd polling-mb16 --serve-arg=--max-batch --serve-arg=16
