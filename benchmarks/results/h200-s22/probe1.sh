#!/bin/bash
# Session 22 probe 1: why recall_text on the H200 takes 3.8 ms end to end when its parts, each
# timed alone, sum to 0.9 ms (h200-s21 text run). Hypotheses: (a) the embedder's CUDA stream
# shares a hardware queue with the GPU polling's queued rounds, whose kernels wait behind the
# resident waiting kernel, so the embedding waits until the polling idles out (test: more
# hardware queues, CUDA_DEVICE_MAX_CONNECTIONS=32; polling off); (b) the sweep thread, which
# yields its core in a loop while the GPU polls, holds the GIL against the control thread
# (test: .snap/trees/gilsleep, the sweep sleeping 20 us there instead). Then the two engine CUDA
# tests that run5.sh's timeout cut. Carry .snap/model, .snap/trees/gilsleep and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/gilsleep/src; do
  gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
run() { # label tree env... -- args
  local label=$1 tree=$2; shift 2
  echo "=== $label $(date +%T)"
  env PYTHONPATH=.snap/model:$tree "$@" timeout 100 python3 benchmarks/text_recall.py --device cuda --filler random \
    --rounds 200 --embed-runtime triton > $OUT/probe1-$label.txt 2>&1
  grep -E "one round trip|three round|embed op|recall of|get of|in process|Error|Traceback" $OUT/probe1-$label.txt | head -8
}
run default src
run conn32 src CUDA_DEVICE_MAX_CONNECTIONS=32
run gilsleep .snap/trees/gilsleep/src
run default-again src
echo "=== polling off $(date +%T)"
PYTHONPATH=.snap/model:src timeout 100 python3 benchmarks/text_recall.py --device cuda --filler random --rounds 200 \
  --embed-runtime triton --serve-args='--gpu-polling off' > $OUT/probe1-polling-off.txt 2>&1
grep -E "one round trip|three round|embed op|recall of|get of|Error|Traceback" $OUT/probe1-polling-off.txt | head -8
echo "=== engine tests $(date +%T)"
PYTHONPATH=src timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider --durations=3 \
  -k "matches_reference and v1 and 1024" tests/test_torch_engine.py > $OUT/probe1-engine-tests.txt 2>&1
grep -E "passed|failed|^FAILED|Error|s call" $OUT/probe1-engine-tests.txt | tail -5
echo "end $(date +%T)"
