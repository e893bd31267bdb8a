#!/bin/bash
# Session 20 run 5 (for the next device session; not run in session 20): the slot server's two k
# buckets (rounds at the bucket of 8 for k <= 8, of 16 once a larger k shows up). In one call:
# the rounds in process held at each bucket (benchmarks/rounds.py --k-buckets 8,16), the crowd
# 1-64 and beside the GEMMs at 1 and 16 on this tree and on d6fa4b9 (rounds at 16 only), fast
# at 1, 16, 64, then the CUDA tests of the slot server (both buckets' graphs against float64)
# and the engine. Needs .snap/trees/s20 (git archive d6fa4b9 src benchmarks); carry it.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s20/src; do
  gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== rounds $(date +%T)"
PYTHONPATH=src timeout 150 python3 benchmarks/rounds.py --sizes 1,2,8,16,32,64 --rounds 240 --k-buckets 8,16 \
  --variant 'default:exact:{}' > $OUT/run5-rounds.txt 2>&1; tail -4 $OUT/run5-rounds.txt
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label $(date +%T)"; PYTHONPATH=$tree timeout 150 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes \
    --crowd-seconds 2 "$@" > $OUT/run5-crowd-$label.txt 2>&1; show $OUT/run5-crowd-$label.txt
}
crowd src this 1,2,4,8,16,32,64 --colocated 1,16
crowd .snap/trees/s20/src base 1,2,4,8,16,32,64 --colocated 1,16
crowd src this-fast 1,16,64 --serve-arg=--precision --serve-arg=fast
echo "=== tests $(date +%T)"
PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider --durations=4 \
  -k "(batch_rounds and 40) or sidecar_with_gpu_polling or answers_while_running or (matches_reference and v1 and 1024)" \
  tests/test_slot_server.py tests/test_torch_engine.py > $OUT/run5-cuda-tests.txt 2>&1
grep -E "passed|failed|^FAILED|Error|s call" $OUT/run5-cuda-tests.txt | tail -8
echo "end $(date +%T)"
