#!/bin/bash
# Session 17 run 2: single rounds leave the servable requests they do not take pending (no
# longer handed to the host). The CUDA tests run 1 did not finish (the batch rounds, the
# sidecar under clients, adds and deletes); then the crowd, 1-64 client processes plus the
# co-located case, in one run: this code with --gpu-polling beside the session's start
# (82cb521) with --gpu-polling; and an experiment: clients that nap 50 us with a 1 us timer
# slack (.snap/trees/nap: this code, ClientChannel.NAP_S and _nap patched).
# Outputs: $OUT/run2-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s17/src .snap/trees/nap/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests: slot server's batch rounds, the sidecar under clients"
PYTHONPATH=src timeout 200 python3 -m pytest -q -rf -m cuda -p no:cacheprovider tests/test_slot_server.py -k "batch_rounds or sidecar_with_gpu_polling" > $OUT/run2-cuda-slot.txt 2>&1; grep -E "passed|failed|Error" $OUT/run2-cuda-slot.txt | tail -6
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label timeout sizes extra...
  local tree=$1 label=$2 limit=$3 sizes=$4; shift 4
  echo "=== $label"; PYTHONPATH=$tree timeout $limit python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes --crowd-seconds 2 "$@" > $OUT/run2-crowd-$label.txt 2>&1; show $OUT/run2-crowd-$label.txt
}
crowd src polling 130 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd .snap/trees/s17/src base-polling 130 1,2,4,8,16,32,64 --colocated 1,16 --serve-arg=--gpu-polling
crowd .snap/trees/nap/src nap50-polling 80 1,16,32,64 --serve-arg=--gpu-polling
