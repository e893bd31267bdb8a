#!/bin/bash
# Session 16 run 2 (the final code): the crowd of single recalls, 1-64 client processes plus the
# co-located case, in one run: this code with --gpu-polling (a round waits only for the clients
# that asked in the last 2 ms; exact pairs by FMA), the session's start (f51ce31) with
# --gpu-polling, this code's default sweep; fast precision with polling; then the CUDA tests of
# the slot server and the engine. Outputs: $OUT/run2-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s16/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label"; PYTHONPATH=$tree timeout 120 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run2-crowd-$label.txt 2>&1; show $OUT/run2-crowd-$label.txt
}
crowd src polling 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd .snap/trees/s16/src base-polling 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd src sweep 1,2,4,8,16,32,64
crowd src polling-fast 1,16,64 --serve-arg=--gpu-polling --serve-arg=--precision --serve-arg=fast
echo "=== CUDA tests: slot server, engine"
PYTHONPATH=src timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_slot_server.py > $OUT/run2-cuda-slot.txt 2>&1; tail -3 $OUT/run2-cuda-slot.txt
PYTHONPATH=src timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_torch_engine.py > $OUT/run2-cuda-engine.txt 2>&1; tail -3 $OUT/run2-cuda-engine.txt
