#!/bin/bash
# Session 15 on the 2-vCPU VM: the crowd of single recalls, CPU engine, 65,536 x 384, this code
# (one mat-vec per query for passes of 2-4) beside the session's start (81be365,
# .snap/trees/s15 with its _fence built), in one run: base, src, then src, base again.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/cpu-crowd-s15
inc=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
ext=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -O2 -shared -fPIC -I$inc .snap/trees/s15/src/kalos/ipc/_fence.c -o .snap/trees/s15/src/kalos/ipc/_fence$ext || exit 1
i=0
for v in base src src base; do
  i=$((i+1)); tree=.snap/trees/s15/src; [ $v = src ] && tree=src
  PYTHONPATH=$tree timeout 900 .venv/bin/python $tree/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 \
    --crowd 1,2,4,8 --crowd-seconds 3 > $out/run-$i-$v.txt 2>&1
  grep -E "^ +[0-9]+ " $out/run-$i-$v.txt | sed "s/^/$v /"
done
