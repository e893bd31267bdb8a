#!/bin/bash
# Session 22 probe 1: why recall_text on the H200 takes 3.8 ms end to end when its parts, each
# timed alone, sum to 0.9 ms (h200-s21 text run; 1.85 ms in s14, before GPU polling was the
# default). Hypotheses: (a) the embedder's CUDA stream shares a hardware queue with the GPU
# polling's queued rounds, whose kernels wait behind the resident waiting kernel, so that the
# embedding waits until the polling idles out (test: CUDA_DEVICE_MAX_CONNECTIONS=32, polling
# off); (b) the sweep thread, which loops on sched_yield while the GPU polls, holds the GIL
# against the control thread (test: .snap/trees/gilsleep, the sweep sleeping 20 us there
# instead). .snap/trees/sfix: both (the sidecar sets the variable unless it is set).
# .snap/trees/s22base: git archive 149f4e8 src; the other two trees: it with those changes (not
# on main: see BENCHMARKS.md). Then the crowd 1-64 and beside the GEMMs, sfix beside s22base,
# and the two engine CUDA tests that run5.sh's timeout cut; polling off last. Carry .snap/model,
# .snap/trees/{s22base,gilsleep,sfix} and this folder. Outputs: probe1-*.txt beside it.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in .snap/trees/s22base/src .snap/trees/gilsleep/src .snap/trees/sfix/src; do
  gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
text() { # label tree extra-args... (env before: VAR=value)
  local label=$1 tree=$2; shift 2
  echo "=== text $label $(date +%T)"
  PYTHONPATH=.snap/model:$tree timeout 90 python3 benchmarks/text_recall.py --device cuda --filler random \
    --rounds 100 --embed-runtime triton "$@" > $OUT/probe1-text-$label.txt 2>&1
  grep -E "one round trip|three round|embed op|recall of|get of|Error|Traceback" $OUT/probe1-text-$label.txt | head -6
}
text default .snap/trees/s22base/src
text sfix .snap/trees/sfix/src
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # tree label
  echo "=== crowd $2 $(date +%T)"; PYTHONPATH=$1 timeout 120 python3 $1/kalos/tools/crowd.py --device cuda \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 --colocated 1,16 > $OUT/probe1-crowd-$2.txt 2>&1; show $OUT/probe1-crowd-$2.txt
}
crowd .snap/trees/sfix/src sfix
crowd .snap/trees/s22base/src base
CUDA_DEVICE_MAX_CONNECTIONS=32 text conn32 .snap/trees/s22base/src
text gilsleep .snap/trees/gilsleep/src
echo "=== engine tests $(date +%T)"
PYTHONPATH=.snap/trees/sfix/src timeout 80 python3 -m pytest -q -m cuda -p no:cacheprovider --durations=3 \
  -k "matches_reference and v1 and 1024" tests/test_torch_engine.py > $OUT/probe1-engine-tests.txt 2>&1
grep -E "passed|failed|^FAILED|Error|s call" $OUT/probe1-engine-tests.txt | tail -5
text polling-off .snap/trees/s22base/src --serve-args='--gpu-polling off'
echo "end $(date +%T)"
