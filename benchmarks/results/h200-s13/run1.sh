#!/bin/bash
# Session 13 run 1: the sweep's timeline (benchmarks/sweep_trace.py) under C = 1, 16, 64 for three
# client waits: the committed naps (.snap/trees/head = git archive 626bebe src), futex naps woken
# by the sidecar (.snap/trees/futex: 626bebe with futex-naps.patch beside this script, the
# uncommitted work of the session before), and precise timed naps guided by each client's own
# latency (src then: 626bebe with precise-naps.patch); then the engine's per-kernel device time at
# the crowd's batch sizes. Outputs kept as run1-<name>.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src .snap/trees/futex/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
for v in head futex nap; do
  tree=.snap/trees/$v/src; [ $v = nap ] && tree=src
  PYTHONPATH=$tree timeout 100 python3 benchmarks/sweep_trace.py --crowd 1,16,64 --seconds 3 --label $v > $OUT/trace-$v.txt 2>&1
  tail -5 $OUT/trace-$v.txt
done
PYTHONPATH=src timeout 150 python3 benchmarks/diagnostics.py gpu --batches 1,2,8,16,32,64 --precisions exact --thresholds on > $OUT/diag-batches.txt 2>&1
grep -E "'part': '(graph|graph_kernel)'" $OUT/diag-batches.txt | grep -v "per_search_us': [0-1]\." | cut -c1-200 | head -60
