#!/bin/bash
# Session 18 run 3: where C = 1's extra time goes (the crowd's C = 1 ~111 us against a round of
# ~86 us in process): e2e_split (the client back to back, and the raw slot without its Python),
# then the crowd at C = 1 alone with 9 slots (what --crowd 1 serves) and with 128 (kalos serve's
# default: the polling kernel reads every slot's words at each poll).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== e2e split"
PYTHONPATH=src timeout 200 python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --precisions exact > $OUT/run3-split.txt 2>&1; tail -8 $OUT/run3-split.txt
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
i=0
for slots in 9 128 9 128; do
  i=$((i + 1)); echo "=== crowd 1, $slots slots"
  PYTHONPATH=src timeout 100 python3 src/kalos/tools/crowd.py --device cuda --crowd 1 --crowd-seconds 3 \
    --serve-arg=--slots --serve-arg=$slots > $OUT/run3-crowd1-$i-$slots-slots.txt 2>&1; show $OUT/run3-crowd1-$i-$slots-slots.txt
done
