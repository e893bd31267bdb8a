#!/bin/bash
# Run 1 (session 10): client wait variants for the crowd, one run, side by side.
cd "$(dirname "$0")/.."
T=.snap/trees/exp
gcc -O2 -shared -fPIC $(python3-config --includes) $T/kalos/ipc/_fence.c -o $T/kalos/ipc/_fence$(python3-config --extension-suffix) || exit 1
nproc; uname -r; nvidia-smi --query-gpu=name,memory.used --format=csv
mkdir -p $OUT
for V in default yield-mid yield-all; do
  echo "=== variant $V"
  VV=$V; [ $V = default ] && VV=""
  head -3 /proc/stat | head -1 > $OUT/stat-$V-before.txt
  KALOS_WAIT_VARIANT=$VV PYTHONPATH=$T timeout 200 python3 -m kalos.tools.crowd --device cuda --crowd 1,8,16,32,64 --crowd-seconds 3 --colocated 16 > $OUT/crowd-$V.txt 2>&1
  head -1 /proc/stat > $OUT/stat-$V-after.txt
  grep -v Warning $OUT/crowd-$V.txt | grep -E "^ +[0-9]+ |GEMMs|first error" 
done
echo "=== yield-all fast"
KALOS_WAIT_VARIANT=yield-all PYTHONPATH=$T timeout 150 python3 -m kalos.tools.crowd --device cuda --crowd 1,16,64 --crowd-seconds 3 --serve-arg=--precision --serve-arg=fast > $OUT/crowd-yield-all-fast.txt 2>&1
grep -E "^ +[0-9]+ |first error" $OUT/crowd-yield-all-fast.txt
