#!/bin/bash
# Session 14 run 4 (one call, the session's last): the CUDA tests on the final code; the device
# time of exact passes of 2, 8 and 16 queries scanned by the tensor cores (tf32, then the
# certified float32 re-score) against the float32 FMA scan (ieee); the crowd on the final code
# (1, 16, 64: a check that nothing regressed since run 3); the crowd with --gpu-polling graph
# (1, 4, 16, 64: which mode wins where). Outputs: $OUT/run4-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
echo "=== CUDA tests"
PYTHONPATH=.snap/model:src timeout 200 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ > $OUT/run4-cuda-tests.txt 2>&1; tail -2 $OUT/run4-cuda-tests.txt
echo "=== exact scans"
PYTHONPATH=src timeout 150 python3 benchmarks/diagnostics.py gpu --batches 2,8,16 --precisions exact --thresholds on \
  --exact-scans tf32,ieee > $OUT/run4-diag-scans.txt 2>&1
grep -E "'part': '(select|graph)'" $OUT/run4-diag-scans.txt | cut -c1-260
echo "=== crowd, default"
PYTHONPATH=src timeout 80 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/run4-crowd-src.txt 2>&1; show $OUT/run4-crowd-src.txt
echo "=== crowd, --gpu-polling graph"
PYTHONPATH=src timeout 90 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,4,16,64 --crowd-seconds 3 --serve-arg=--gpu-polling > $OUT/run4-crowd-polling.txt 2>&1; show $OUT/run4-crowd-polling.txt
