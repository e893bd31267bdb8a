#!/bin/bash
# (kept here; run from .snap/ on the device, with .snap/trees/prev = git archive 3d2b418 src)
# Session 12 run 2: where the sweep's pass goes on the H200. (a) one pass of C pending single
# recalls timed without clients (real engine, .snap/hostpass.py) on HEAD and on the commit
# before the uniform-crowd shortcut (.snap/trees/prev = git archive 3d2b418 src), with a
# cProfile of HEAD's pass; (b) py-spy of the sidecar under the crowd (C = 64, 1) on HEAD;
# (c) the crowd 1,16,64 on HEAD and prev alternated.
cd "$(dirname "$0")/.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/prev/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
pip install -q --no-deps --target /tmp/pyspy .snap/wheels/py_spy-*.whl >/dev/null 2>&1
SPY=/tmp/pyspy/bin/py-spy
echo "=== (a) pass without clients"
for c in 1 16 64; do
  sed 's#sys.path.insert(0, "src")#sys.path.insert(0, ".snap/trees/prev/src")#' .snap/hostpass.py > /tmp/hostpass_prev.py
  cp .snap/hostpass.py /tmp/hostpass_head.py
  for t in prev head; do echo -n "$t "; timeout 60 python3 /tmp/hostpass_$t.py $c --cuda 2>&1 | tail -1; done
done
timeout 60 python3 .snap/hostpass.py 64 --cuda --profile > $OUT/pass-profile-c64.txt 2>&1; sed -n 1,30p $OUT/pass-profile-c64.txt
timeout 60 python3 .snap/hostpass.py 1 --cuda --profile > $OUT/pass-profile-c1.txt 2>&1
show() { grep -E "^ +[0-9]+ |first error" "$1"; }
profile() {  # $1 crowd size, $2 tag
  log=$OUT/spy-crowd-$2.txt
  PYTHONPATH=src timeout 100 python3 src/kalos/tools/crowd.py --device cuda --crowd $1 --crowd-seconds 8 > $log 2>&1 &
  cpid=$!
  for i in $(seq 600); do grep -q "kalos sidecar" $log 2>/dev/null && break; sleep 0.2; done
  spid=$(pgrep -f "kalos serve" | head -1)
  sleep 3
  kid=$(pgrep -f "spawn_main" | tail -1)
  $SPY record -p $kid -d 4 -r 997 --nonblocking -f raw -o $OUT/spy-$2-client.txt > $OUT/spy-$2-client.log 2>&1 &
  $SPY record -p $spid -d 4 -r 997 --nonblocking -f raw -o $OUT/spy-$2-sidecar.txt > $OUT/spy-$2.log 2>&1
  wait
  wait $cpid; show $log
}
echo "=== (b) py-spy under the crowd"; profile 64 c64; profile 1 c1
echo "=== (c) crowd alternated"
for i in 1 2; do
  echo "--- prev $i"; PYTHONPATH=.snap/trees/prev/src timeout 70 python3 .snap/trees/prev/src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/prev-$i.txt 2>&1; show $OUT/prev-$i.txt
  echo "--- head $i"; PYTHONPATH=src timeout 70 python3 src/kalos/tools/crowd.py --device cuda --crowd 1,16,64 --crowd-seconds 3 > $OUT/head-$i.txt 2>&1; show $OUT/head-$i.txt
done
