#!/bin/bash
# Prepared in session 26 for the next device call (its budget was spent): the GPU tests of the
# embedder's graphs (their host copies are captured since session 26) and the engine; then
# recall_text and the crowd 1-64 (alone, beside the GEMMs at 16 and 64) on main, main with
# KALOS_SIDECAR_SWITCH_US=20 (recall_text 1.33-1.42 ms against 1.61-1.81 on an H100; does it
# cost the crowd?), and the candidate tree .snap/trees/s27-quick (main + candidate-quick-switch.patch:
# the 20 us interval only while a recall_text is in flight on a polling GPU), alternated,
# each while BUDGET_S leaves room. A table of every crowd last.
# Before the call: bash benchmarks/results/h200-s26/next.sh --trees (builds the tree from HEAD).
# Carry .snap/model, .snap/trees/s27-quick and this folder.
cd "$(dirname "$0")/../../.."
H=benchmarks/results/h200-s26
if [ "$1" = "--trees" ]; then
  rm -rf .snap/trees/s27-quick && mkdir -p .snap/trees/s27-quick && git archive HEAD src tests | tar -x -C .snap/trees/s27-quick \
    && patch -s -p1 -d .snap/trees/s27-quick < $H/candidate-quick-switch.patch && echo "built .snap/trees/s27-quick"
  exit
fi
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s27-quick/src; do
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
Q=.snap/trees/s27-quick/src
text src main DUMMY=1; text $Q quick DUMMY=1; text src switch20 KALOS_SIDECAR_SWITCH_US=20
crowd src main DUMMY=1; crowd src switch20 KALOS_SIDECAR_SWITCH_US=20; crowd $Q quick DUMMY=1
text $Q quick-2 DUMMY=1; text src main-2 DUMMY=1; text src switch20-2 KALOS_SIDECAR_SWITCH_US=20
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
  grep GEMMs $f
done
