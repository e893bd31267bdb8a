#!/bin/bash
# Prepared in session 26 for the next device call (its budget was spent): the GPU tests of the
# embedder's graphs (their host copies are captured since session 26) and the engine; then
# recall_text and the crowd 1-64 (alone, beside the GEMMs at 16 and 64) on main, main with
# KALOS_SIDECAR_SWITCH_US=20 (recall_text 1.33-1.42 ms against 1.61-1.81 on an H100; does it
# cost the crowd?), and the candidate tree .snap/trees/s27-quick (main + candidate-quick-switch.patch:
# the 20 us interval only while a recall_text is in flight on a polling GPU), alternated,
# and .snap/trees/s27-fused (main + candidate-fused-layernorm.patch: the model's LayerNorms applied by
# the kernels that read their output, 32 kernels a pass instead of 44; predicted: a short
# text's replay ~45-60 us less device time, recall_text as much less), each while BUDGET_S
# leaves room. A table of every crowd last.
# Before the call: bash benchmarks/results/h200-s26/next.sh --trees (builds the tree from HEAD).
# Carry .snap/model, .snap/trees/s27-quick, .snap/trees/s27-fused and this folder.
cd "$(dirname "$0")/../../.."
H=benchmarks/results/h200-s26
if [ "$1" = "--trees" ]; then
  for c in quick:quick-switch fused:fused-layernorm; do
    t=.snap/trees/s27-${c%%:*}
    rm -rf $t && mkdir -p $t && git archive HEAD src tests | tar -x -C $t \
      && patch -s -p1 -d $t < $H/candidate-${c#*:}.patch && echo "built $t"
  done
  exit
fi
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s27-quick/src .snap/trees/s27-fused/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-560}
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== GPU tests $(date +%T)"
PYTHONPATH=.snap/model:src timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda -x \
  tests/test_sidecar_embed.py tests/test_minilm_kernels.py tests/test_torch_engine.py tests/test_slot_server.py \
  > $OUT/gpu-tests.txt 2>&1; tail -3 $OUT/gpu-tests.txt
text() { # tree label env...
  local src=$1 label=$2; shift 2
  room 50 "text $label" || return 1
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  env "$@" PYTHONPATH=.snap/model:$src timeout 70 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 200 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  grep -E "one round trip|embed op|get of" $OUT/text-$label.txt | head -3
}
crowd() { # tree label env...
  local src=$1 label=$2; shift 2
  room 110 "crowd $label" || return 1
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  env "$@" PYTHONPATH=$src timeout $(( budget - SECONDS )) python3 $src/kalos/tools/crowd.py --device cuda \
    --crowd 1,2,4,8,16,32,64 --crowd-seconds 2 --colocated 16,64 > $OUT/crowd-$label.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$label.txt | head -6
}
Q=.snap/trees/s27-quick/src F=.snap/trees/s27-fused/src
for pair in main:src fused:$F; do
  label=${pair%%:*} t=${pair#*:}
  room 80 "embed_forward $label" || break
  echo "=== embed_forward $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/model:$t timeout 120 python3 benchmarks/embed_forward.py --rounds 300 > $OUT/forward-$label.txt 2>&1
  tail -12 $OUT/forward-$label.txt
done
text $F fused DUMMY=1
text src main DUMMY=1; text $Q quick DUMMY=1; text src switch20 KALOS_SIDECAR_SWITCH_US=20
crowd src main DUMMY=1; crowd src switch20 KALOS_SIDECAR_SWITCH_US=20; crowd $Q quick DUMMY=1
text $Q quick-2 DUMMY=1; text src main-2 DUMMY=1; text src switch20-2 KALOS_SIDECAR_SWITCH_US=20
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
