#!/bin/bash
# Session 19 run 6: the crowd of client processes 1-64 and beside the GEMMs, this code (the final
# kernel's re-score split over programs) and the session's start (b9c3f1a) in one call; fast
# precision at 1, 16 and 64 on this code; then CUDA tests of the engine and the slot server.
# Needs the session start in .snap/trees/s19 (git archive b9c3f1a src benchmarks | tar -x -C
# .snap/trees/s19); carry it.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s19/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label"; PYTHONPATH=$tree timeout 150 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes \
    --crowd-seconds 2 "$@" > $OUT/run6-crowd-$label.txt 2>&1; show $OUT/run6-crowd-$label.txt
}
crowd src this 1,2,4,8,16,32,64 --colocated 1,16
crowd .snap/trees/s19/src base 1,2,4,8,16,32,64 --colocated 1,16
crowd src this-fast 1,16,64 --serve-arg=--precision --serve-arg=fast
PYTHONPATH=src timeout 180 python3 -m pytest -q -m cuda -p no:cacheprovider --durations=4 \
  -k "(batch_rounds and 40) or sidecar_with_gpu_polling or (matches_reference and v1 and 1024)" \
  tests/test_slot_server.py tests/test_torch_engine.py > $OUT/run6-cuda-tests.txt 2>&1
grep -E "passed|failed|^FAILED|Error|s call" $OUT/run6-cuda-tests.txt | tail -8
