#!/bin/bash
# Session 16 run 1: the CUDA suite on this code (exact batches of 2-8 by FMA); the engine at
# the crowd's pass sizes, FMA tiles against tf32 + re-score; the polling rounds in process;
# (the rounds probe is session 15's, unchanged;) a short crowd with --gpu-polling, this code beside the session's start (f51ce31).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s16/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests"
PYTHONPATH=src timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ > $OUT/run1-cuda-tests.txt 2>&1; grep -E "passed|failed|Error" $OUT/run1-cuda-tests.txt | tail -8
echo "=== small batches"
PYTHONPATH=src timeout 240 python3 benchmarks/small_batch.py --qs 1,2,4,8,16,32 --precisions exact --repeats 200 \
  --variants "default,no fma,fma<=32,fma n8,fma n32,fma d128,fma d32,fma w8,fma r128" > $OUT/run1-small-batch.txt 2>&1; sed -n '/^N=/,$p' $OUT/run1-small-batch.txt
echo "=== rounds"
PYTHONPATH=src timeout 120 python3 benchmarks/results/h200-s15/rounds.py 20 > $OUT/run1-rounds.txt 2>&1; tail -9 $OUT/run1-rounds.txt
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label"; PYTHONPATH=$tree timeout 100 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run1-crowd-$label.txt 2>&1; show $OUT/run1-crowd-$label.txt
}
crowd src polling 1,2,4,8,16,64 --serve-arg=--gpu-polling
crowd .snap/trees/s16/src base-polling 1,2,4,8,16,64 --serve-arg=--gpu-polling
