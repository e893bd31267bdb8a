#!/bin/bash
# Session 13 run 2: the sweep's timeline with the sweep thread's CPU time, C = 1, 16, 32, 64:
# precise latency-guided naps past 2x cores with yielding spins between (.snap/trees/nap, run 1's
# src: 626bebe with precise-naps.patch) against the same naps past cores - 1 and no yielding spins
# (src then: the same, with ClientChannel._budgets returning (0.0, True, False) past
# self._spin_clients). Outputs kept as run2-<name>.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/nap/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
for v in nap src nap src; do
  tree=.snap/trees/$v/src; [ $v = src ] && tree=src
  PYTHONPATH=$tree timeout 150 python3 benchmarks/sweep_trace.py --crowd 1,16,32,64 --seconds 3 --label $v >> $OUT/trace-$v.txt 2>&1
  tail -7 $OUT/trace-$v.txt
done
