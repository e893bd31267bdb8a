#!/bin/bash
# Session 20 run 4: this tree (crowded clients of the GPU's polling spin yielding instead of
# napping; a round waits its 20 us window, then on while requests keep coming, each within
# 10 us of the last, up to 80 us) beside d6fa4b9 (base) in one call: the crowd 1-64, and beside
# the GEMMs (the LLM's stand-in) at 1, 16 and 64; fast at 1, 16, 64; then the CUDA tests of the
# slot server and the engine. "blendnap": this tree's rounds with napping clients, as before.
# Not run in session 20 (no device was lent after run 2); the candidate is not on main. To run it,
# in a checkout of d6fa4b9 (e29ff71 changed the same kernels since):
# git apply benchmarks/results/h200-s20/candidate-yield-gather.patch; .snap/trees/s20 = git archive
# d6fa4b9 src benchmarks; .snap/trees/blendnap = the patched src with crowded_wait() returning
# "nap" (kalos/server/sidecar.py). Carry .snap/trees and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/s20/src .snap/trees/blendnap/src; do
  gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label sizes extra...
  local tree=$1 label=$2 sizes=$3; shift 3
  echo "=== $label $(date +%T)"; PYTHONPATH=$tree timeout 170 python3 $tree/kalos/tools/crowd.py --device cuda --crowd $sizes \
    --crowd-seconds 2 "$@" > $OUT/run4-crowd-$label.txt 2>&1; show $OUT/run4-crowd-$label.txt
}
crowd src this 1,2,4,8,16,32,48,64 --colocated 1,16,64
crowd .snap/trees/s20/src base 1,2,4,8,16,32,48,64 --colocated 1,16,64
crowd .snap/trees/blendnap/src blendnap 16,32,48,64 --colocated 64
crowd src this-fast 1,16,64 --serve-arg=--precision --serve-arg=fast
echo "=== tests $(date +%T)"
PYTHONPATH=src timeout 170 python3 -m pytest -q -m cuda -p no:cacheprovider --durations=4 \
  -k "(batch_rounds and 40) or sidecar_with_gpu_polling or (matches_reference and v1 and 1024)" \
  tests/test_slot_server.py tests/test_torch_engine.py > $OUT/run4-cuda-tests.txt 2>&1
grep -E "passed|failed|^FAILED|Error|s call" $OUT/run4-cuda-tests.txt | tail -8
echo "end $(date +%T)"
