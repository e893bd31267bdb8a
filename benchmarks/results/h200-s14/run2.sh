#!/bin/bash
# Session 14 run 2 (one call): the CUDA tests on this code; the sweep's CPU per pass without
# clients (hostpass.py, the real engine) on this code and on the session's start (ad2bbd0,
# .snap/trees/head); the sweep's timeline under the crowd on this code (sweep_trace.py); the
# text recall on this code (graphs + op recall_text). Outputs: $OUT/run2-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests"
PYTHONPATH=.snap/model:src timeout 200 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ > $OUT/run2-cuda-tests.txt 2>&1; tail -2 $OUT/run2-cuda-tests.txt
for t in head src; do
  tree=.snap/trees/$t/src; [ $t = src ] && tree=src
  for c in 16 64; do
    PYTHONPATH=$tree timeout 90 python3 benchmarks/results/h200-s13/hostpass.py $c > $OUT/run2-hostpass-$t-$c.txt 2>&1
    echo "hostpass $t: $(grep CPU $OUT/run2-hostpass-$t-$c.txt)"
  done
done
echo "=== sweep trace (this code)"
PYTHONPATH=src timeout 150 python3 benchmarks/sweep_trace.py --crowd 1,16,64 --seconds 3 > $OUT/run2-trace-src.txt 2>&1; tail -6 $OUT/run2-trace-src.txt
echo "=== text recall (this code)"
PYTHONPATH=.snap/model:src timeout 150 python3 benchmarks/text_recall.py --device cuda --filler random --rounds 500 \
  --embed-runtime graphs > $OUT/run2-text-src-graphs.txt 2>&1
grep -E "^\| |hits,|Error" $OUT/run2-text-src-graphs.txt | head -12
