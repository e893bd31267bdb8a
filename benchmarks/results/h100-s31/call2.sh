#!/bin/bash
# Session 31, call 2: collect_kernel taking the K groups of largest maximum straight from a
# top-K of (maximum, group) keys (no list of groups or candidates written and read back), this
# tree against 4b7f4da (.snap/trees/s31-base: git archive 4b7f4da src). The crowd 1-64 (default
# `kalos serve --device cuda`, 65,536 x 1024, k = 8, 2 s a crowd; 16 and 64 beside the GEMMs),
# exact and fast, after a short warm-up crowd; then the rounds in process (kernels profiled;
# this tree also with each round's queries read by 16 programs each); the exact crowd again.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s31/call2.sh   (carry .snap/trees/s31-base)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s31-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-540}
B=.snap/trees/s31-base/src
nvidia-smi --query-gpu=name --format=csv,noheader
crowd() { # tree label [colocated] [serve args...]
  local tree=$1 label=$2 colo=$3; shift 3
  (( SECONDS + 70 < budget )) || { echo "--- skipped crowd $label: ${SECONDS}s gone"; return 1; }
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 $tree/kalos/tools/crowd.py --device cuda \
    --crowd ${CROWD:-1,2,4,8,16,32,64} --crowd-seconds 2 ${colo:+--colocated $colo} "$@" > $OUT/crowd-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null
  grep -E "Traceback|Error" $OUT/crowd-$label.txt | head -4
}
rounds() { # label tree [args...]
  local label=$1 tree=$2; shift 2
  (( SECONDS + 60 < budget )) || { echo "--- skipped rounds $label: ${SECONDS}s gone"; return; }
  echo "=== rounds $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 benchmarks/rounds.py --sizes 1,8,16,32,64 --rounds 300 "$@" \
    > $OUT/rounds-$label.txt 2>&1
}
PYTHONPATH=src timeout 60 python3 src/kalos/tools/crowd.py --device cuda --crowd 16 --crowd-seconds 1 \
  > $OUT/crowd-warmup.txt 2>&1; pkill -9 -f "kalos serve" 2>/dev/null
crowd src this 16,64
crowd $B base 16,64
crowd src this-fast "" --serve-arg=--precision --serve-arg=fast
crowd $B base-fast "" --serve-arg=--precision --serve-arg=fast
rounds base $B --profile 16,64
rounds this src --profile 1,16,64 --variant 'default:exact:{}' --variant 'default:fast:{}' \
  --variant 'stage16:exact:{"stage_split": 16}' --variant 'stage16:fast:{"stage_split": 16}'
crowd src this-2 ""
echo "=== done ${SECONDS}s"
for f in $(ls $OUT/crowd-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"; grep -E "^ +[0-9]+ +[0-9.]+ |GEMMs [0-9]" $f | head -14; done
for f in $(ls $OUT/rounds-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"; grep -A6 "^variant" $f; done
